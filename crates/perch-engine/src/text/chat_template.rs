//! Chat templates: Jinja templates from `tokenizer_config.json` / `chat_template.jinja`, rendered
//! with minijinja configured as transformers configures Jinja2 (`trim_blocks`, `lstrip_blocks`,
//! `raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, Python string methods).
//!
//! Templates come with downloaded models, so rendering is bounded: [`TEMPLATE_FUEL`] instructions
//! per render (minijinja's fuel: a template that loops forever is an error after about a second),
//! [`TEMPLATE_RECURSION_LIMIT`] nested calls, [`MAX_RENDERED_BYTES`] of output, and the helpers a
//! template can make allocate from a number check it (`tojson`'s indent, `strftime_now`'s format,
//! `indent`'s width, `slice`'s and `batch`'s counts, the widths and precisions of `format` and
//! `str.format`). Not bounded: the memory of values a template builds from other values and keeps
//! without writing them (a string doubled in a loop through a `namespace`, a long string joined or
//! `replace`d many times over, a repeated list made a `list`), since minijinja has no allocation
//! limit; and the time such values take, since fuel counts instructions and one instruction may
//! copy 100 MB (`'x' * 100000000` in a loop of 100,000 runs for minutes). scripts/fuzz.sh renders
//! arbitrary templates (fuzz/fuzz_targets/chat_template.rs) under a 2 GiB memory limit.

use minijinja::value::Rest;
use minijinja::{Environment, Error, ErrorKind, State, Value as JinjaValue};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::text::tool_calls::ToolCallFormat;

/// One message of a conversation, OpenAI style. `content` is a string or a list of parts of
/// which the `text` parts are joined (missing or null: empty); `image_url` parts (`{"url": …}` or
/// the URL itself) are kept in [`ChatMessage::parts`] with the text, in order. The tool fields are
/// rendered by templates that support tools, as transformers passes them.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(from = "WireMessage")]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The content's parts in order when it holds an image (empty otherwise). Templates then see
    /// `content` as a list of `{"type": "text", "text": …}` and `{"type": "image"}` parts, as
    /// transformers passes a multimodal message.
    pub parts: Vec<ContentPart>,
    /// An assistant's tool calls: `{"id", "type": "function", "function": {"name",
    /// "arguments"}}` with `arguments` an object (what chat templates expect).
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message: the id of the call it answers.
    pub tool_call_id: Option<String>,
    /// A `tool` message: the function's name, for templates that show it.
    pub name: Option<String>,
}

/// A part of a message's content.
#[derive(Clone, Debug, PartialEq)]
pub enum ContentPart {
    Text(String),
    /// An image by URL: a `data:` URL is what Perch reads
    /// ([`crate::image_processor::ImageProcessor::process_url`]).
    Image(String),
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            parts: Vec::new(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    /// A message of `parts` in order: `content` their text joined, `parts` kept when one is an
    /// image.
    pub fn from_parts(role: impl Into<String>, parts: Vec<ContentPart>) -> Self {
        let content = parts
            .iter()
            .filter_map(|p| match p {
                ContentPart::Text(text) => Some(text.as_str()),
                ContentPart::Image(_) => None,
            })
            .collect::<Vec<_>>()
            .join("");
        let images = parts.iter().any(|p| matches!(p, ContentPart::Image(_)));
        Self {
            parts: if images { parts } else { Vec::new() },
            ..Self::new(role, content)
        }
    }

    /// The URLs of its images, in order.
    pub fn image_urls(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            ContentPart::Image(url) => Some(url.as_str()),
            ContentPart::Text(_) => None,
        })
    }
}

impl Serialize for ChatMessage {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("role", &self.role)?;
        if self.parts.is_empty() {
            map.serialize_entry("content", &self.content)?;
        } else {
            let parts: Vec<serde_json::Value> = self
                .parts
                .iter()
                .map(|p| match p {
                    ContentPart::Text(text) => serde_json::json!({"type": "text", "text": text}),
                    ContentPart::Image(_) => serde_json::json!({"type": "image"}),
                })
                .collect();
            map.serialize_entry("content", &parts)?;
        }
        if let Some(calls) = &self.tool_calls {
            map.serialize_entry("tool_calls", calls)?;
        }
        if let Some(id) = &self.tool_call_id {
            map.serialize_entry("tool_call_id", id)?;
        }
        if let Some(name) = &self.name {
            map.serialize_entry("name", name)?;
        }
        map.end()
    }
}

/// A message as clients send it.
#[derive(Deserialize)]
struct WireMessage {
    role: String,
    #[serde(default)]
    content: WireContent,
    #[serde(default)]
    tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(untagged)]
enum WireContent {
    Text(String),
    Parts(Vec<WirePart>),
    #[default]
    Null,
}

#[derive(Deserialize)]
struct WirePart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    image_url: Option<WireImageUrl>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum WireImageUrl {
    Url(String),
    Object { url: String },
}

impl From<WireMessage> for ChatMessage {
    fn from(wire: WireMessage) -> Self {
        let parts = match wire.content {
            WireContent::Text(text) => vec![ContentPart::Text(text)],
            WireContent::Null => Vec::new(),
            WireContent::Parts(parts) => parts
                .into_iter()
                .filter_map(|p| match (p.kind.as_str(), p.text, p.image_url) {
                    ("text", Some(text), _) => Some(ContentPart::Text(text)),
                    (
                        "image_url",
                        _,
                        Some(WireImageUrl::Url(url) | WireImageUrl::Object { url }),
                    ) => Some(ContentPart::Image(url)),
                    _ => None,
                })
                .collect(),
        };
        Self {
            tool_calls: wire.tool_calls,
            tool_call_id: wire.tool_call_id,
            name: wire.name,
            ..Self::from_parts(wire.role, parts)
        }
    }
}

/// Instructions one render may execute (minijinja fuel). A 1,000-message conversation with the
/// common templates takes well under 1% of it.
pub const TEMPLATE_FUEL: u64 = 20_000_000;
/// Nested template calls (macros, includes) one render may make.
pub const TEMPLATE_RECURSION_LIMIT: usize = 100;
/// The longest rendered prompt, in bytes (far beyond any model's context).
pub const MAX_RENDERED_BYTES: usize = 64 << 20;
/// The largest `tojson(indent=…)` and `indent(width=…)` accepted.
const MAX_INDENT: usize = 64;
/// The most lists `slice` makes and the largest `batch` (as many as minijinja's `range` yields).
const MAX_COUNT: usize = 100_000;
/// The widest field and longest precision `format` and `str.format` accept.
const MAX_FORMAT_WIDTH: usize = 1024;

/// A compiled chat template with the tokenizer's special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// How the template writes tool calls; `None` when it does not read `tools`.
    tool_call_format: Option<ToolCallFormat>,
}

impl ChatTemplate {
    /// Compiles `source`. Errors: [`EngineError::ChatTemplate`] with minijinja's message.
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION_LIMIT);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(python_method);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<JinjaValue, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("indent", indent);
        env.add_filter("format", format);
        env.add_filter("slice", slice);
        env.add_filter("batch", batch);
        let format = ToolCallFormat::detect(&source);
        env.add_template_owned("chat", source).map_err(|e| {
            EngineError::ChatTemplate(format!("the template does not compile: {e}"))
        })?;
        let reads_tools = env
            .get_template("chat")
            .map(|t| t.undeclared_variables(false).contains("tools"))
            .unwrap_or(false);
        Ok(Self {
            env,
            bos_token,
            eos_token,
            tool_call_format: reads_tools.then_some(format),
        })
    }

    /// Replaces the budget of [`TEMPLATE_FUEL`] instructions per render (the fuzz target renders
    /// with less: its instrumented build runs some 30 times slower).
    pub fn set_fuel(&mut self, fuel: u64) {
        self.env.set_fuel(Some(fuel));
    }

    /// How this template's model writes tool calls, or `None` when the template has no tool
    /// support (it never reads the `tools` variable).
    pub fn tool_call_format(&self) -> Option<ToolCallFormat> {
        self.tool_call_format
    }

    /// Renders the conversation; `add_generation_prompt` appends the assistant's turn header.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with tool definitions in the template's `tools` variable
    /// (OpenAI's shape, `{"type": "function", "function": {"name", "description",
    /// "parameters"}}`, as transformers' `apply_chat_template(tools=…)` passes them).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        let mut out = BoundedWriter::default();
        let rendered = template.render_captured_to(
            minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone().unwrap_or_default(),
                eos_token => self.eos_token.clone().unwrap_or_default(),
            },
            &mut out,
        );
        if out.overflowed {
            return Err(EngineError::ChatTemplate(format!(
                "the rendered prompt passed {} MiB; the template or the conversation is too large",
                MAX_RENDERED_BYTES >> 20
            )));
        }
        rendered.map_err(|e| match e.kind() {
            ErrorKind::OutOfFuel => EngineError::ChatTemplate(format!(
                "the template ran past its limit of {TEMPLATE_FUEL} instructions (a loop that does not end?)"
            )),
            _ => EngineError::ChatTemplate(e.to_string()),
        })?;
        String::from_utf8(out.bytes)
            .map_err(|_| EngineError::ChatTemplate("the rendered prompt is not UTF-8".into()))
    }
}

/// Collects output up to [`MAX_RENDERED_BYTES`], then refuses more.
#[derive(Default)]
struct BoundedWriter {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_RENDERED_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("rendered prompt too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// transformers' `strftime_now(format)`: the local time in C `strftime` notation. A format
/// chrono cannot read (`%` alone, an unknown specifier) is a template error.
fn strftime_now(format: String) -> std::result::Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    use std::fmt::Write;
    let items: Vec<Item> = StrftimeItems::new(&format).collect();
    if items.iter().any(|item| matches!(item, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} is not a strftime format"),
        ));
    }
    let mut out = String::new();
    write!(
        out,
        "{}",
        chrono::Local::now().format_with_items(items.into_iter())
    )
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} cannot be formatted"),
        )
    })?;
    Ok(out)
}

/// Python's methods on strings, maps and lists (minijinja-contrib's `pycompat`), with
/// `str.format`'s format string checked ([`check_format_string`]).
fn python_method(
    state: &State,
    value: &JinjaValue,
    method: &str,
    args: &[JinjaValue],
) -> std::result::Result<JinjaValue, Error> {
    if let (Some(text), "format") = (value.as_str(), method) {
        check_format_string(text, false)?;
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// minijinja's printf-style `format` filter, with the format string checked
/// ([`check_format_string`]).
fn format(
    state: &State,
    format: &JinjaValue,
    args: Rest<JinjaValue>,
) -> std::result::Result<JinjaValue, Error> {
    if let Some(text) = format.as_str() {
        check_format_string(text, true)?;
    }
    minijinja::filters::format(state, format, args)
}

/// Refuses the format strings minijinja's formatter cannot take (printf's `%-10.3f` and
/// `%(key)s`, `str.format`'s `{:>10.3}` and `{0[key].attr}`): a width or precision over
/// [`MAX_FORMAT_WIDTH`] (it pads to any width, allocating it, and panics on a precision over
/// 65535; conservative: any number in a field's spec counts), and a key with a non-ASCII
/// character (it steps through keys a byte at a time and panics inside a character).
fn check_format_string(format: &str, printf: bool) -> std::result::Result<(), Error> {
    let refuse = |what: &str| {
        Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("format: {what} is not supported"),
        ))
    };
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let opening = if printf { '%' } else { '{' };
    let mut rest = format;
    while let Some(start) = rest.find(opening) {
        let field = &rest[start + 1..];
        // `%%` and `{{` are the characters themselves.
        if field.starts_with(opening) {
            rest = &field[1..];
            continue;
        }
        let spec = if printf {
            // `%(key)` names an argument (read up to `)`, or to the end without one); the type,
            // or a length modifier, ends the spec.
            let field = match field.strip_prefix('(') {
                Some(keyed) => {
                    let (key, after) = keyed.split_once(')').unwrap_or((keyed, ""));
                    if !key.is_ascii() {
                        return refuse("a key with non-ASCII characters");
                    }
                    after
                }
                None => field,
            };
            let end = field
                .find(|c: char| c.is_ascii_alphabetic() || c == '%')
                .unwrap_or(field.len());
            rest = &field[end..];
            &field[..end]
        } else {
            // The argument's name or index, then `.attr` and `[key]` (each key read up to `]`,
            // or to the end without one).
            let mut path = field.trim_start_matches(is_ident);
            loop {
                if let Some(attr) = path.strip_prefix('.') {
                    path = attr.trim_start_matches(is_ident);
                } else if let Some(keyed) = path.strip_prefix('[') {
                    let (key, after) = keyed.split_once(']').unwrap_or((keyed, ""));
                    if !key.is_ascii() {
                        return refuse("a key with non-ASCII characters");
                    }
                    path = after;
                } else {
                    break;
                }
            }
            let end = path.find('}').unwrap_or(path.len());
            rest = &path[end..];
            path[..end].split_once(':').map_or("", |(_, spec)| spec)
        };
        let too_wide = spec
            .split(|c: char| !c.is_ascii_digit())
            // A run of digits too long for a usize is too wide too.
            .any(|digits| {
                digits
                    .parse::<usize>()
                    .map_or(!digits.is_empty(), |n| n > MAX_FORMAT_WIDTH)
            });
        if too_wide {
            return refuse(&format!("a width or precision over {MAX_FORMAT_WIDTH}"));
        }
    }
    Ok(())
}

/// Jinja2's `slice(count, fill_with)`, with `count` at most [`MAX_COUNT`] (minijinja makes room for
/// `count` lists first).
fn slice(
    state: &State,
    value: JinjaValue,
    count: usize,
    fill_with: Option<JinjaValue>,
) -> std::result::Result<JinjaValue, Error> {
    check_count("slice", count)?;
    minijinja::filters::slice(state, value, count, fill_with)
}

/// Jinja2's `batch(count, fill_with)`, with `count` at most [`MAX_COUNT`] (minijinja makes room
/// for `count` items per batch, and `fill_with` pads the last one to `count`).
fn batch(
    state: &State,
    value: JinjaValue,
    count: usize,
    fill_with: Option<JinjaValue>,
) -> std::result::Result<JinjaValue, Error> {
    check_count("batch", count)?;
    minijinja::filters::batch(state, value, count, fill_with)
}

fn check_count(filter: &str, count: usize) -> std::result::Result<(), Error> {
    if count > MAX_COUNT {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("{filter}: a count over {MAX_COUNT} is not supported"),
        ));
    }
    Ok(())
}

/// Jinja2's `indent(width=4, first=False, blank=False)` (as transformers renders it), with
/// `width` (spaces, or the string to indent with) at most [`MAX_INDENT`].
fn indent(
    value: String,
    width: Option<JinjaValue>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<String, Error> {
    let width = match kwargs.get::<Option<JinjaValue>>("width")? {
        Some(w) => Some(w),
        None => width,
    };
    let first = kwargs
        .get::<Option<bool>>("first")?
        .or(first)
        .unwrap_or(false);
    let blank = kwargs
        .get::<Option<bool>>("blank")?
        .or(blank)
        .unwrap_or(false);
    kwargs.assert_all_used()?;
    let prefix = match &width {
        None => "    ".to_string(),
        Some(w) => match (w.as_str(), w.as_usize()) {
            (Some(text), _) if text.len() <= MAX_INDENT => text.to_string(),
            (None, Some(n)) if n <= MAX_INDENT => " ".repeat(n),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("indent: width {w} is not a count or string of at most {MAX_INDENT}"),
                ))
            }
        },
    };
    // Python's `(s + "\n").splitlines()`: a trailing newline adds no empty line.
    let text = format!("{value}\n");
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::with_capacity(text.len() + lines.len() * prefix.len());
    for (i, line) in lines.iter().enumerate() {
        if i > 0 {
            out.push('\n');
            if blank || !line.is_empty() {
                out.push_str(&prefix);
            }
        }
        out.push_str(line);
    }
    if first {
        out.insert_str(0, &prefix);
    }
    Ok(out)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)` as transformers' `tojson`
/// does it: no HTML escaping, `", "` and `": "` separators when compact.
fn tojson(
    value: JinjaValue,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<JinjaValue, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    if indent.is_some_and(|n| n > MAX_INDENT) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: an indent over {MAX_INDENT} is not supported"),
        ));
    }
    let json: serde_json::Value = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = match indent {
        Some(n) => {
            let indent = " ".repeat(n);
            let formatter = serde_json::ser::PrettyFormatter::with_indent(indent.as_bytes());
            let mut out = Vec::new();
            let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
            json.serialize(&mut ser)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            String::from_utf8(out).unwrap_or_default()
        }
        None => python_compact_json(&json),
    };
    Ok(JinjaValue::from_safe_string(text))
}

fn python_compact_json(value: &serde_json::Value) -> String {
    use serde_json::Value as J;
    match value {
        J::Array(items) => format!(
            "[{}]",
            items
                .iter()
                .map(python_compact_json)
                .collect::<Vec<_>>()
                .join(", ")
        ),
        J::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{}: {}", J::String(k.clone()), python_compact_json(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: &[ChatMessage]) -> Result<String> {
        ChatTemplate::new(source.into(), Some("<s>".into()), Some("</s>".into()))?
            .render(messages, true)
    }

    #[test]
    fn renders_with_hf_whitespace_rules_and_variables() {
        let source = "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\n[U]{{ m.content | trim }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}[A]{% endif %}";
        let out = render(source, &[ChatMessage::new("user", "  hi  ")]).unwrap();
        assert_eq!(out, "<s>[U]hi\n[A]");
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}";
        let err = render(source, &[ChatMessage::new("assistant", "x")]).unwrap_err();
        assert!(
            err.to_string()
                .contains("first message must be from the user"),
            "{err}"
        );
    }

    #[test]
    fn tojson_and_python_methods() {
        let source = "{{ messages[0] | tojson }}|{{ messages[0].content.strip().startswith('a<') }}|{{ messages[0] | tojson(indent=2) }}";
        let out = render(source, &[ChatMessage::new("user", " a<b> é ")]).unwrap();
        assert_eq!(
            out,
            "{\"role\": \"user\", \"content\": \" a<b> é \"}|True|{\n  \"role\": \"user\",\n  \"content\": \" a<b> é \"\n}"
        );
    }

    #[test]
    fn strftime_now_formats_the_date() {
        let out = render("{{ strftime_now('%Y') }}", &[]).unwrap();
        assert_eq!(out.len(), 4);
        assert!(out.starts_with("20"));
    }

    #[test]
    fn tools_reach_templates_that_read_them() {
        let source = "{% if tools %}{% for t in tools %}<tool>{{ t | tojson }}</tool>{% endfor %}{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}";
        let template = ChatTemplate::new(source.into(), None, None).unwrap();
        assert_eq!(template.tool_call_format(), Some(ToolCallFormat::Tagged));
        let tool = serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}});
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(vec![
            serde_json::json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": 2}}}),
        ]);
        let mut result = ChatMessage::new("tool", "42");
        result.tool_call_id = Some("c1".into());
        let out = template
            .render_with_tools(
                &[ChatMessage::new("user", "hi"), call, result],
                Some(&[tool]),
                false,
            )
            .unwrap();
        assert_eq!(
            out,
            "<tool>{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\", \"properties\": {}}}}</tool>[user]hi[assistant]<tool_call>{\"name\": \"f\", \"arguments\": {\"b\": 1, \"a\": 2}}</tool_call>[tool]42(c1)"
        );
        // Without tools the variable is undefined, as transformers passes None.
        let plain = template
            .render(&[ChatMessage::new("user", "hi")], false)
            .unwrap();
        assert_eq!(plain, "[user]hi");
        let no_tools = ChatTemplate::new("{{ messages[0].content }}".into(), None, None).unwrap();
        assert_eq!(no_tools.tool_call_format(), None);
    }

    #[test]
    fn hostile_templates_are_errors_not_hangs_panics_or_huge_allocations() {
        let hi = [ChatMessage::new("user", "hi")];
        for (source, expected) in [
            // 10^10 iterations: out of fuel after 2x10^7 instructions.
            (
                "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                "instructions",
            ),
            // Endless recursion.
            (
                "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                "recursion",
            ),
            // 10^4 strings of 10^7 bytes: stopped at 64 MiB of output.
            (
                "{% for i in range(10000) %}{{ 'x' * 10000000 }}{% endfor %}",
                "passed 64 MiB",
            ),
            // chrono panics formatting these; here they are template errors.
            ("{{ strftime_now('%') }}", "not a strftime format"),
            ("{{ strftime_now('%Q %Y') }}", "not a strftime format"),
            // A terabyte of indentation.
            ("{{ messages | tojson(indent=10**12) }}", "indent over 64"),
            ("{{ 'a\nb' | indent(10**12) }}", "at most 64"),
            ("{{ 'a\nb' | indent(width=10**12) }}", "at most 64"),
            // Each crashed fuzz/fuzz_targets/chat_template.rs before its check: room for 10^12
            // lists or items at once, padding to a width of 10^11, a panic on a precision over
            // 65535.
            ("{{ [1] | slice(10**12) }}", "count over 100000"),
            ("{{ [1] | batch(10**12, 0) }}", "count over 100000"),
            (
                "{{ '{:>99999999999}'.format(1) }}",
                "width or precision over 1024",
            ),
            (
                "{{ '{0:.70000f}'.format(1.5) }}",
                "width or precision over 1024",
            ),
            (
                "{{ '%(a)99999999999d' | format({'a': 1}) }}",
                "width or precision over 1024",
            ),
            (
                "{{ '%.70000f' | format(1.5) }}",
                "width or precision over 1024",
            ),
            // Found by the fuzz target: minijinja panics on a key with a non-ASCII character.
            ("{{ '{0[é]}'.format({'é': 1}) }}", "non-ASCII"),
            ("{{ '{a.b[x}é]}'.format(1) }}", "non-ASCII"),
            ("{{ '%(é)s' | format({'é': 1}) }}", "non-ASCII"),
        ] {
            let started = std::time::Instant::now();
            let err = render(source, &hi).expect_err(source);
            assert!(
                matches!(err, EngineError::ChatTemplate(_)) && err.to_string().contains(expected),
                "{source}: {err}"
            );
            assert!(
                started.elapsed() < std::time::Duration::from_secs(20),
                "{source} took {:?}",
                started.elapsed()
            );
        }
    }

    #[test]
    fn format_slice_and_batch_work_within_their_limits() {
        let out = render(
            "{{ '{0:>5}|{1:.2f}|{{:99999}}|é{2[a]}'.format('a', 1.5, {'a': 'ü'}) }}|{{ '%-4s|%05.1f|%%99999d' | format('b', 2.5) }}|{{ '%(a)s|é' | format({'a': 'ö'}) }}|{{ [1, 2, 3] | slice(2) | list }}|{{ [1, 2, 3] | batch(2, 0) | list }}",
            &[],
        )
        .unwrap();
        assert_eq!(
            out,
            "    a|1.50|{:99999}|éü|b   |002.5|%99999d|ö|é|[[1, 2], [3]]|[[1, 2], [3, 0]]"
        );
    }

    #[test]
    fn indent_follows_jinja2() {
        // Jinja2 3.1's output for the same filters (blank lines stay blank unless `blank`).
        let out = render(
            "{{ 'a\n\nb\n' | indent(2) }}|{{ 'a\n\nb' | indent(2, true, true) }}|{{ 'a\nb' | indent('> ') }}|{{ 'a\nb' | indent(first=true) }}",
            &[],
        )
        .unwrap();
        assert_eq!(out, "a\n\n  b\n|  a\n  \n  b|a\n> b|    a\n    b");
    }

    #[test]
    fn messages_accept_content_parts() {
        let m: ChatMessage =
            serde_json::from_str(r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"image"},{"type":"text","text":"b"}]}"#).unwrap();
        assert_eq!(m.content, "ab");
    }
}
