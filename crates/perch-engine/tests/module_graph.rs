//! The engine's modules depend on each other one way: among the modules of each folder of
//! `src/` (the crate's top-level modules, and each folder's own), no two reach each other
//! through `crate::` or `super::` paths. A unit-test module at the end of a file (`#[cfg(test)]
//! mod tests`) may use anything and is not read.
//!
//! The same check as Tarjan's strongly connected components over the graph whose nodes are the
//! sibling modules and whose edges are their references; a component of more than one module
//! is a cycle, printed with the references that make it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path below the crate root (`["models", "decoder"]`).
type ModPath = Vec<String>;

/// Every `.rs` file under `dir`, with its module path.
fn modules(src: &Path) -> Vec<(ModPath, PathBuf)> {
    let mut out = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap();
            let mut parts: ModPath = rel
                .iter()
                .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
                .collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            out.push((parts, path));
        }
    }
    out.sort();
    out
}

/// The text of a file without comments, string literals' contents, and its trailing unit-test
/// module.
fn code(path: &Path) -> String {
    strip(&std::fs::read_to_string(path).unwrap())
}

/// `text` without comments, string literals' contents, and a trailing unit-test module.
fn strip(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(at) => &text[..at],
        None => text,
    };
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            // A char literal (`'"'`, `'\''`); a lifetime's quote has no closing one.
            '\'' => {
                let mut ahead = chars.clone();
                match (ahead.next(), ahead.next(), ahead.next()) {
                    (Some('\\'), Some(_), Some('\'')) => {
                        chars.nth(2);
                    }
                    (Some(c), Some('\''), _) if c != '\\' => {
                        chars.nth(1);
                    }
                    _ => out.push('\''),
                }
            }
            'r' if chars.peek() == Some(&'#') => {
                // A raw string `r#"…"#`: skip to `"#`.
                let mut last = ' ';
                for c in chars.by_ref() {
                    if last == '"' && c == '#' {
                        break;
                    }
                    last = c;
                }
                out.push_str("\"\"");
            }
            '"' => {
                // Skip to the closing quote (escapes included).
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => {
                            chars.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
                out.push_str("\"\"");
            }
            _ => out.push(c),
        }
    }
    out
}

/// Paths a use tree names, from its text after `use crate::` or `use super::` (up to `;`):
/// `a::{b, c::d}` gives `a::b` and `a::c::d`.
fn use_tree(text: &str) -> Vec<ModPath> {
    fn parse(tokens: &[String], at: &mut usize, prefix: &ModPath, out: &mut Vec<ModPath>) {
        let mut path = prefix.clone();
        while *at < tokens.len() {
            let token = tokens[*at].as_str();
            *at += 1;
            match token {
                "{" => {
                    loop {
                        parse(tokens, at, &path, out);
                        match tokens.get(*at).map(String::as_str) {
                            Some(",") => *at += 1,
                            Some("}") => {
                                *at += 1;
                                break;
                            }
                            _ => break,
                        }
                        if tokens.get(*at).map(String::as_str) == Some("}") {
                            *at += 1;
                            break;
                        }
                    }
                    return;
                }
                "::" => {}
                "," | "}" => {
                    *at -= 1;
                    break;
                }
                "as" => {
                    *at += 1; // the alias
                }
                "*" | "self" => {}
                ident => path.push(ident.to_string()),
            }
        }
        out.push(path);
    }
    let mut tokens = Vec::new();
    let mut ident = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_alphanumeric() || c == '_' {
            ident.push(c);
            continue;
        }
        if !ident.is_empty() {
            tokens.push(std::mem::take(&mut ident));
        }
        match c {
            ':' if chars.peek() == Some(&':') => {
                chars.next();
                tokens.push("::".into());
            }
            '{' | '}' | ',' | '*' => tokens.push(c.to_string()),
            _ => {}
        }
    }
    if !ident.is_empty() {
        tokens.push(ident);
    }
    let mut out = Vec::new();
    let mut at = 0;
    parse(&tokens, &mut at, &Vec::new(), &mut out);
    out
}

/// The module paths `code` (of module `this`) refers to: `crate::` and `super::` paths, in `use`
/// items and inline.
fn references(this: &ModPath, code: &str) -> Vec<ModPath> {
    let mut refs = Vec::new();
    let parent: ModPath = this[..this.len().saturating_sub(1)].to_vec();
    for (keyword, base) in [("crate::", Vec::new()), ("super::", parent)] {
        let mut rest = code;
        while let Some(at) = rest.find(keyword) {
            let before = rest[..at].chars().last();
            rest = &rest[at + keyword.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let end = rest.find(';').unwrap_or(rest.len());
            let tree = if rest.starts_with('{') || rest[..end].contains('{') {
                // A use tree (a path with braces ends at its `;`).
                &rest[..end]
            } else {
                // One path: identifiers and `::`.
                let len = rest
                    .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                    .unwrap_or(rest.len());
                &rest[..len]
            };
            for path in use_tree(tree) {
                refs.push([base.clone(), path].concat());
            }
        }
    }
    refs
}

/// Tarjan's strongly connected components of more than one node.
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct State<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        next: usize,
        found: Vec<Vec<String>>,
    }
    fn strong(s: &mut State, v: &str) {
        s.index.insert(v.into(), s.next);
        s.low.insert(v.into(), s.next);
        s.next += 1;
        s.stack.push(v.into());
        for w in s.edges.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                strong(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v.into(), low);
            } else if s.stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v.into(), low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                let done = w == v;
                component.push(w);
                if done {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut state = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !state.index.contains_key(v) {
            strong(&mut state, v);
        }
    }
    state.found
}

#[test]
fn sibling_modules_never_reach_each_other_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = modules(&src);
    let known: BTreeSet<ModPath> = files.iter().map(|(m, _)| m.clone()).collect();
    // Per folder (the parent's path), the edges between its child modules, and for each edge
    // one file that makes it.
    let mut graphs: BTreeMap<ModPath, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let mut why: BTreeMap<(ModPath, String, String), String> = BTreeMap::new();
    for (this, path) in &files {
        for target in references(this, &code(path)) {
            // The deepest known module the path names (the rest are items inside it).
            let Some(target) = (1..=target.len())
                .rev()
                .map(|n| target[..n].to_vec())
                .find(|p| known.contains(p))
            else {
                continue;
            };
            let shared = this.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if shared >= this.len() || shared >= target.len() {
                continue; // Itself, an ancestor or a descendant.
            }
            let parent = this[..shared].to_vec();
            let (from, to) = (this[shared].clone(), target[shared].clone());
            graphs
                .entry(parent.clone())
                .or_default()
                .entry(from.clone())
                .or_default()
                .insert(to.clone());
            why.entry((parent, from, to))
                .or_insert_with(|| path.strip_prefix(&src).unwrap().display().to_string());
        }
    }
    let mut report = Vec::new();
    for (parent, edges) in &graphs {
        for component in cycles(edges) {
            let folder = if parent.is_empty() {
                "src/".to_string()
            } else {
                format!("src/{}/", parent.join("/"))
            };
            let mut lines = vec![format!("{folder}: {}", component.join(" <-> "))];
            for from in &component {
                for to in edges[from].iter().filter(|t| component.contains(t)) {
                    let file = &why[&(parent.clone(), from.clone(), to.clone())];
                    lines.push(format!("  {from} -> {to} ({file})"));
                }
            }
            report.push(lines.join("\n"));
        }
    }
    assert!(
        report.is_empty(),
        "modules that reach each other in a circle:\n{}",
        report.join("\n")
    );
}

#[test]
fn use_trees_and_inline_paths_are_read() {
    let this = vec!["models".to_string(), "decoder".to_string()];
    let refs = references(
        &this,
        &strip("use crate::{cache::{KvCache, Kv as K}, error::Result};\nuse super::moe::SparseMoe;\n\
         let x = crate::slot_cache::row_bucket(3); // crate::not_this\nlet s = \"crate::nor_this\";"),
    );
    let names: Vec<String> = refs.iter().map(|p| p.join("::")).collect();
    assert_eq!(
        names,
        [
            "cache::KvCache",
            "cache::Kv",
            "error::Result",
            "slot_cache::row_bucket",
            "models::moe::SparseMoe"
        ]
    );
    let mut edges = BTreeMap::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        edges
            .entry(a.to_string())
            .or_insert_with(BTreeSet::new)
            .insert(b.to_string());
    }
    assert_eq!(cycles(&edges), [vec!["a", "b", "c"]]);
}
