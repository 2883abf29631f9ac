//! Tool calls in a model's output: the formats the chat templates of the models Perch runs teach
//! their models, parsed as the text streams so that tool-call markup never reaches the answer's
//! content.
//!
//! Formats (from each family's chat template and model card):
//! - [`ToolCallFormat::Tagged`]: `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Hermes,
//!   Qwen 2.5, Qwen 3), or with `<function=NAME><parameter=P>value</parameter></function>` between
//!   the tags (Qwen3-Coder, Qwen 3.5). Several calls follow each other.
//! - [`ToolCallFormat::Json`]: the whole answer is a JSON object `{"name": …, "parameters": {…}}`,
//!   optionally after `<|python_tag|>` (Llama 3.1–3.3); several calls separated by `;`.
//! - [`ToolCallFormat::Harmony`]: gpt-oss's channels. `<|channel|>analysis<|message|>…<|end|>` is
//!   reasoning, `<|channel|>final<|message|>…` the answer, and a message addressed
//!   `to=functions.NAME` (in its header, before `<|message|>`) a call whose content is the JSON
//!   arguments, ended by `<|call|>`.

use serde_json::{Map, Value};

/// How a model writes tool calls, recognised from its chat template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallFormat {
    Tagged,
    Json,
    Harmony,
}

impl ToolCallFormat {
    /// The format the chat template `source` renders past calls in (and so teaches): Harmony's
    /// channels, `<tool_call>` tags, else bare JSON (Llama 3's templates).
    pub fn detect(source: &str) -> Self {
        if source.contains("<|channel|>") {
            Self::Harmony
        } else if source.contains("<tool_call>") {
            Self::Tagged
        } else {
            Self::Json
        }
    }
}

/// One call: the function's name and its arguments (a JSON object).
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
}

/// A parsed piece of output.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolOutput {
    /// Answer text.
    Text(String),
    /// Reasoning the format keeps apart from the answer (Harmony's analysis channel).
    Reasoning(String),
    Call(ToolCall),
}

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MESSAGE: &str = "<|message|>";
/// Harmony's ends of a message; `<|start|>` opens the next one.
const HARMONY_ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"];

/// Parses streamed output text into answer text, reasoning and tool calls.
pub struct ToolCallParser {
    format: ToolCallFormat,
    /// Parameter types by function and parameter name, from the request's tool schemas: a
    /// `string` parameter of an XML-style call stays a string even when it reads as a number.
    string_params: Vec<(String, String)>,
    pending: String,
    state: State,
}

#[derive(Debug, PartialEq)]
enum State {
    /// Answer text (Tagged), or not yet known whether the answer is a call (Json: before the
    /// first non-blank character).
    Text,
    /// Inside `<tool_call>` (Tagged), or an answer that is JSON calls (Json).
    Call,
    /// Json: the answer is plain text.
    Plain,
    /// Harmony: reading a message's header up to `<|message|>`.
    Header,
    /// Harmony: a message's content, for the channel or function named.
    Content(Channel),
}

#[derive(Debug, PartialEq)]
enum Channel {
    Final,
    Analysis,
    Function(String),
}

impl ToolCallParser {
    /// A parser for `format`; `tools` are the request's tool definitions (OpenAI's shape,
    /// `{"type": "function", "function": {"name", "parameters"}}`) whose schemas type the
    /// parameters of XML-style calls.
    pub fn new(format: ToolCallFormat, tools: &[Value]) -> Self {
        let mut string_params = Vec::new();
        for tool in tools {
            let function = tool.get("function").unwrap_or(tool);
            let name = function.get("name").and_then(Value::as_str).unwrap_or("");
            let properties = function
                .pointer("/parameters/properties")
                .and_then(Value::as_object);
            for (param, schema) in properties.into_iter().flatten() {
                if schema.get("type").and_then(Value::as_str) == Some("string") {
                    string_params.push((name.to_owned(), param.clone()));
                }
            }
        }
        let state = match format {
            ToolCallFormat::Harmony => State::Header,
            _ => State::Text,
        };
        Self {
            format,
            string_params,
            pending: String::new(),
            state,
        }
    }

    /// Adds streamed text; returns what is known now. Text that might begin markup is held back
    /// until it is known not to.
    pub fn push(&mut self, text: &str) -> Vec<ToolOutput> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out, false) {}
        out
    }

    /// The output has ended: releases what was held back. A call left open (the model stopped
    /// before its closing tag) is parsed as it stands; markup that does not parse as a call is
    /// given back as text rather than lost.
    pub fn finish(&mut self) -> Vec<ToolOutput> {
        let mut out = Vec::new();
        while self.step(&mut out, true) {}
        out
    }

    /// Moves the state machine once; `false` when it needs more text (or, at the end, is done).
    fn step(&mut self, out: &mut Vec<ToolOutput>, end: bool) -> bool {
        match (self.format, &self.state) {
            (ToolCallFormat::Tagged, State::Text) => {
                if let Some(at) = self.pending.find(CALL_OPEN) {
                    push_text(out, self.pending[..at].to_owned());
                    self.pending.drain(..at + CALL_OPEN.len());
                    self.state = State::Call;
                    return true;
                }
                let keep = if end {
                    0
                } else {
                    partial_suffix(&self.pending, &[CALL_OPEN])
                };
                let ready: String = self.pending.drain(..self.pending.len() - keep).collect();
                push_text(out, ready);
                false
            }
            (ToolCallFormat::Tagged, State::Call) => {
                let (inner, rest) = match self.pending.find(CALL_CLOSE) {
                    Some(at) => (
                        self.pending[..at].to_owned(),
                        self.pending[at + CALL_CLOSE.len()..].to_owned(),
                    ),
                    None if end => (std::mem::take(&mut self.pending), String::new()),
                    None => return false,
                };
                match self.parse_tagged(&inner) {
                    Some(call) => out.push(ToolOutput::Call(call)),
                    None => push_text(out, format!("{CALL_OPEN}{inner}")),
                }
                self.pending = rest;
                self.state = State::Text;
                !end || !self.pending.is_empty()
            }
            (ToolCallFormat::Json, State::Text) => {
                let start = self.pending.trim_start();
                let undecided = start.len() < PYTHON_TAG.len() && PYTHON_TAG.starts_with(start);
                if undecided && !end {
                    return false;
                }
                let maybe_call = start.starts_with('{') || start.starts_with(PYTHON_TAG);
                self.state = if maybe_call {
                    State::Call
                } else {
                    State::Plain
                };
                true
            }
            (ToolCallFormat::Json, State::Call) => {
                if !end {
                    return false;
                }
                let raw = std::mem::take(&mut self.pending);
                match parse_json_calls(&raw) {
                    Some(calls) => out.extend(calls.into_iter().map(ToolOutput::Call)),
                    None => push_text(out, raw),
                }
                false
            }
            (ToolCallFormat::Json, _) => {
                push_text(out, std::mem::take(&mut self.pending));
                false
            }
            (ToolCallFormat::Harmony, State::Header) => {
                let Some(at) = self.pending.find(MESSAGE) else {
                    if end {
                        // A header with no message: nothing to show but what is not markup.
                        let rest = std::mem::take(&mut self.pending);
                        if !rest.contains("<|") {
                            push_text(out, rest);
                        }
                    }
                    return false;
                };
                let header = self.pending[..at].to_owned();
                self.pending.drain(..at + MESSAGE.len());
                self.state = State::Content(harmony_channel(&header));
                true
            }
            (ToolCallFormat::Harmony, State::Content(channel)) => {
                let found = HARMONY_ENDS
                    .iter()
                    .filter_map(|m| self.pending.find(m).map(|at| (at, m.len())))
                    .min();
                let (content, done) = match found {
                    Some((at, len)) => {
                        let content = self.pending[..at].to_owned();
                        let marker = &self.pending[at..at + len];
                        // `<|start|>` begins the next message: keep it for its header.
                        let skip = if marker == "<|start|>" { at } else { at + len };
                        self.pending.drain(..skip);
                        (content, true)
                    }
                    None if end => (std::mem::take(&mut self.pending), true),
                    None => {
                        if matches!(channel, Channel::Function(_)) {
                            return false;
                        }
                        let keep = partial_suffix(&self.pending, &HARMONY_ENDS);
                        let ready: String =
                            self.pending.drain(..self.pending.len() - keep).collect();
                        (ready, false)
                    }
                };
                match channel {
                    Channel::Final => push_text(out, content),
                    Channel::Analysis => {
                        if !content.is_empty() {
                            out.push(ToolOutput::Reasoning(content));
                        }
                    }
                    Channel::Function(name) => {
                        let arguments = match serde_json::from_str::<Value>(content.trim()) {
                            Ok(Value::Object(map)) => Value::Object(map),
                            _ => Value::Object(Map::new()),
                        };
                        out.push(ToolOutput::Call(ToolCall {
                            name: name.clone(),
                            arguments,
                        }));
                    }
                }
                if done {
                    self.state = State::Header;
                    !self.pending.is_empty()
                } else {
                    false
                }
            }
            (ToolCallFormat::Harmony, _) | (ToolCallFormat::Tagged, _) => false,
        }
    }

    /// The inside of `<tool_call>…</tool_call>`: JSON, or Qwen3-Coder's XML-style function.
    fn parse_tagged(&self, inner: &str) -> Option<ToolCall> {
        let inner = inner.trim();
        if inner.starts_with('{') {
            return json_call(serde_json::from_str(inner).ok()?);
        }
        let rest = inner.strip_prefix("<function=")?;
        let (name, mut body) = rest.split_once('>')?;
        let name = name.trim().to_owned();
        let mut arguments = Map::new();
        while let Some(start) = body.find("<parameter=") {
            let after = &body[start + "<parameter=".len()..];
            let (param, value_and_rest) = after.split_once('>')?;
            let (value, rest) = match value_and_rest.find("</parameter>") {
                Some(at) => (
                    &value_and_rest[..at],
                    &value_and_rest[at + "</parameter>".len()..],
                ),
                None => {
                    // Unclosed: up to the next parameter or the function's end.
                    let at = ["<parameter=", "</function>"]
                        .iter()
                        .filter_map(|m| value_and_rest.find(m))
                        .min()
                        .unwrap_or(value_and_rest.len());
                    (&value_and_rest[..at], &value_and_rest[at..])
                }
            };
            let value = value.strip_prefix('\n').unwrap_or(value);
            let value = value.strip_suffix('\n').unwrap_or(value);
            let param = param.trim().to_owned();
            let is_string = self
                .string_params
                .iter()
                .any(|(f, p)| *f == name && *p == param);
            let value = if is_string {
                Value::String(value.to_owned())
            } else {
                serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()))
            };
            arguments.insert(param, value);
            body = rest;
        }
        (!name.is_empty()).then(|| ToolCall {
            name,
            arguments: Value::Object(arguments),
        })
    }
}

/// Appends answer text, merging with the text before it.
fn push_text(out: &mut Vec<ToolOutput>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(ToolOutput::Text(last)) = out.last_mut() {
        last.push_str(&text);
    } else {
        out.push(ToolOutput::Text(text));
    }
}

/// Length in bytes of the longest suffix of `text` that begins one of `markers` (held back in
/// case the marker completes).
fn partial_suffix(text: &str, markers: &[&str]) -> usize {
    let mut best = 0;
    for marker in markers {
        for (len, _) in marker.char_indices().skip(1) {
            if len > best && text.ends_with(&marker[..len]) {
                best = len;
            }
        }
    }
    best
}

/// A call written as JSON: `{"name", "arguments"|"parameters"}` with an object (or a string
/// holding one) for the arguments.
fn json_call(value: Value) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_owned();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => Value::Object(Map::new()),
        Some(Value::String(text)) => match serde_json::from_str(text) {
            Ok(Value::Object(map)) => Value::Object(map),
            _ => return None,
        },
        Some(Value::Object(map)) => Value::Object(map.clone()),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// A whole answer of JSON calls (Llama 3): one object, a list of them, or objects separated by
/// `;`, after an optional `<|python_tag|>`. `None` when any part is not a call.
fn parse_json_calls(raw: &str) -> Option<Vec<ToolCall>> {
    let text = raw.trim();
    let text = text.strip_prefix(PYTHON_TAG).unwrap_or(text).trim();
    if let Ok(Value::Array(items)) = serde_json::from_str::<Value>(text) {
        return items.into_iter().map(json_call).collect();
    }
    let mut calls = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
        if rest.is_empty() {
            break;
        }
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        calls.push(json_call(stream.next()?.ok()?)?);
        rest = &rest[stream.byte_offset()..];
    }
    (!calls.is_empty()).then_some(calls)
}

/// The channel of a Harmony message from its header (`<|start|>assistant<|channel|>commentary
/// to=functions.get_weather <|constrain|>json`): a recipient `functions.NAME` makes it a call.
fn harmony_channel(header: &str) -> Channel {
    let recipient = header
        .split(|c: char| c.is_whitespace() || c == '<')
        .find_map(|word| word.strip_prefix("to="));
    if let Some(name) = recipient.and_then(|r| r.strip_prefix("functions.")) {
        return Channel::Function(name.to_owned());
    }
    let channel = header
        .split("<|channel|>")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| c.is_whitespace() || c == '<').next())
        .unwrap_or("final");
    match channel {
        "analysis" => Channel::Analysis,
        _ => Channel::Final,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Feeds `text` in pieces of `size` characters, then finishes.
    fn parse(format: ToolCallFormat, tools: &[Value], text: &str, size: usize) -> Vec<ToolOutput> {
        let mut parser = ToolCallParser::new(format, tools);
        let chars: Vec<char> = text.chars().collect();
        let mut out = Vec::new();
        for piece in chars.chunks(size) {
            for item in parser.push(&piece.iter().collect::<String>()) {
                merge(&mut out, item);
            }
        }
        for item in parser.finish() {
            merge(&mut out, item);
        }
        out
    }

    fn merge(out: &mut Vec<ToolOutput>, item: ToolOutput) {
        match (out.last_mut(), item) {
            (Some(ToolOutput::Text(a)), ToolOutput::Text(b)) => a.push_str(&b),
            (Some(ToolOutput::Reasoning(a)), ToolOutput::Reasoning(b)) => a.push_str(&b),
            (_, item) => out.push(item),
        }
    }

    fn call(name: &str, arguments: Value) -> ToolOutput {
        ToolOutput::Call(ToolCall {
            name: name.into(),
            arguments,
        })
    }

    fn text(s: &str) -> ToolOutput {
        ToolOutput::Text(s.into())
    }

    /// Every split of the stream gives the same result: markup is never released early.
    fn all_splits(format: ToolCallFormat, tools: &[Value], input: &str, expected: &[ToolOutput]) {
        for size in [1, 2, 3, 5, 7, 1000] {
            assert_eq!(
                parse(format, tools, input, size),
                expected,
                "pieces of {size}"
            );
        }
    }

    #[test]
    fn detects_the_format_from_the_template() {
        assert_eq!(
            ToolCallFormat::detect("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}"),
            ToolCallFormat::Tagged
        );
        assert_eq!(
            ToolCallFormat::detect("<|start|>assistant<|channel|>commentary to=functions."),
            ToolCallFormat::Harmony
        );
        assert_eq!(
            ToolCallFormat::detect("{{- '<|python_tag|>' }}{{ '\"parameters\": ' }}"),
            ToolCallFormat::Json
        );
    }

    #[test]
    fn hermes_and_qwen_calls_between_text() {
        let input = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"zone\\\": \\\"CET\\\"}\"}\n</tool_call>";
        all_splits(
            ToolCallFormat::Tagged,
            &[],
            input,
            &[
                text("Let me check.\n"),
                call("get_weather", json!({"city": "Paris", "days": 2})),
                text("\n"),
                call("get_time", json!({"zone": "CET"})),
            ],
        );
    }

    #[test]
    fn text_that_only_looks_like_a_tag_is_released() {
        all_splits(
            ToolCallFormat::Tagged,
            &[],
            "a <tool and <tool_c> b",
            &[text("a <tool and <tool_c> b")],
        );
        // A call the model never closed is still a call; broken markup comes back as text.
        all_splits(
            ToolCallFormat::Tagged,
            &[],
            "<tool_call>{\"name\": \"f\", \"arguments\": {}}",
            &[call("f", json!({}))],
        );
        all_splits(
            ToolCallFormat::Tagged,
            &[],
            "<tool_call>{\"name\": oops}</tool_call>",
            &[text("<tool_call>{\"name\": oops}")],
        );
    }

    #[test]
    fn qwen3_coder_xml_calls_follow_the_schema_types() {
        let tools = [
            json!({"type": "function", "function": {"name": "write_file", "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"}}
            }}}),
        ];
        let input = "<tool_call>\n<function=write_file>\n<parameter=path>\n123\n</parameter>\n<parameter=content>\nline 1\nline 2\n</parameter>\n<parameter=mode>\n644\n</parameter>\n</function>\n</tool_call>";
        all_splits(
            ToolCallFormat::Tagged,
            &tools,
            input,
            &[call(
                "write_file",
                json!({"path": "123", "content": "line 1\nline 2", "mode": 644}),
            )],
        );
    }

    #[test]
    fn llama_json_calls_and_plain_answers() {
        all_splits(
            ToolCallFormat::Json,
            &[],
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
            &[call("get_weather", json!({"city": "Oslo"}))],
        );
        all_splits(
            ToolCallFormat::Json,
            &[],
            " {\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}",
            &[call("a", json!({})), call("b", json!({"x": 1}))],
        );
        all_splits(
            ToolCallFormat::Json,
            &[],
            "The answer is {not a call}.",
            &[text("The answer is {not a call}.")],
        );
        all_splits(
            ToolCallFormat::Json,
            &[],
            "{\"key\": \"a JSON answer, not a call\"}",
            &[text("{\"key\": \"a JSON answer, not a call\"}")],
        );
    }

    #[test]
    fn harmony_channels() {
        let input = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Tokyo\"}<|call|>";
        all_splits(
            ToolCallFormat::Harmony,
            &[],
            input,
            &[
                ToolOutput::Reasoning("The user wants the weather.".into()),
                call("get_weather", json!({"location": "Tokyo"})),
            ],
        );
        let input = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 21 °C in Tokyo.";
        all_splits(
            ToolCallFormat::Harmony,
            &[],
            input,
            &[
                ToolOutput::Reasoning("Easy.".into()),
                text("It is 21 °C in Tokyo."),
            ],
        );
        // The recipient may also stand before the channel.
        all_splits(
            ToolCallFormat::Harmony,
            &[],
            "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{\"q\": 1}<|call|>",
            &[call("lookup", json!({"q": 1}))],
        );
    }
}
