//! What both wire formats share about prompts and tools: rendering the conversation with the
//! model's chat template (tool definitions included) off the async threads, and the parser that
//! takes tool calls out of the answer.

use std::sync::Arc;

use perch_engine::text::tool_calls::{ToolCall, ToolCallFormat, ToolCallParser, ToolOutput};
use perch_engine::{ChatMessage, Grammar, ImageInput, Tokenizer};
use serde_json::{json, Value};

use crate::error::ApiError;

/// The conversation's prompt tokens and images: the chat template applied with `tools` (OpenAI's
/// shape) and the assistant's turn header, the messages' images read and their tokens written
/// ([`Tokenizer::encode_chat_with_images`]). Rendering and decoding run on a blocking thread (a
/// chat template is a program, an image a decoder's work). Errors: 400 when tools are given to a
/// model whose template has no tool support, the template fails on these messages, or an image
/// cannot be used (a text-only model, a remote URL, a damaged or too large image, too many).
pub(crate) async fn render(
    tokenizer: &Arc<Tokenizer>,
    messages: Vec<ChatMessage>,
    tools: Vec<Value>,
) -> Result<(Vec<u32>, Vec<ImageInput>), ApiError> {
    if !tools.is_empty() && format(tokenizer).is_none() {
        return Err(ApiError::invalid(
            "this model's chat template has no tool support: send the request without `tools`",
            Some("tools"),
        ));
    }
    let tokenizer = Arc::clone(tokenizer);
    tokio::task::spawn_blocking(move || {
        let tools = (!tools.is_empty()).then_some(tools.as_slice());
        tokenizer.encode_chat_with_images(&messages, tools)
    })
    .await
    .map_err(|e| ApiError::engine(e.to_string()))?
    .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))
}

/// How the model writes tool calls; `None` without a tool-capable chat template.
fn format(tokenizer: &Tokenizer) -> Option<ToolCallFormat> {
    tokenizer.chat_template()?.tool_call_format()
}

/// The parser an answer goes through: when the request offers tools (and allows calls), or
/// always for a model that answers in Harmony's channels; `None` when the text is the answer.
pub(crate) fn parser(
    tokenizer: &Tokenizer,
    tools: &[Value],
    calls_allowed: bool,
) -> Option<ToolCallParser> {
    let format = format(tokenizer)?;
    let wanted = (!tools.is_empty() && calls_allowed) || format == ToolCallFormat::Harmony;
    wanted.then(|| ToolCallParser::new(format, tools))
}

/// A tool call the request makes compulsory: OpenAI's `tool_choice` `"required"` or a named
/// function, Anthropic's `any` or `tool`. As vLLM does it, generation is then constrained to
/// JSON that names the call(s) with arguments valid against the tool's schema, whatever the
/// model's own tool-call format, and that JSON is the calls.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Forced {
    /// At least one call, to any of the tools: `[{"name", "parameters"}, …]`.
    Any,
    /// One call to this tool: the output is its arguments.
    Named(String),
}

/// The grammar a forced choice constrains generation to, over the offered `tools` (OpenAI's
/// shape). Errors: no tools, or a named tool that is not among them (400 on `tool_choice`).
pub(crate) fn forced_grammar(tools: &[Value], forced: &Forced) -> Result<Grammar, ApiError> {
    let param = Some("tool_choice");
    let functions = tools.iter().filter_map(|t| t.get("function"));
    let parameters = |f: &Value| {
        f.get("parameters")
            .cloned()
            .unwrap_or_else(|| json!({"type": "object"}))
    };
    let name_of = |f: &Value| f.get("name").and_then(Value::as_str).map(str::to_owned);
    match forced {
        Forced::Any => {
            let choices: Vec<Value> = functions
                .filter_map(|f| {
                    Some(json!({
                        "type": "object",
                        "properties": {"name": {"const": name_of(f)?}, "parameters": parameters(f)},
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    }))
                })
                .collect();
            if choices.is_empty() {
                return Err(ApiError::invalid(
                    "a tool call is required but the request offers no tools",
                    param,
                ));
            }
            Ok(Grammar::JsonSchema(json!({
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": choices},
            })))
        }
        Forced::Named(name) => functions
            .into_iter()
            .find(|f| name_of(f).as_deref() == Some(name))
            .map(|f| Grammar::JsonSchema(parameters(f)))
            .ok_or_else(|| {
                ApiError::invalid(format!("`{name}` is not one of the offered tools"), param)
            }),
    }
}

/// An answer's text through an optional parser, piece by piece; `finish` at its end.
pub(crate) struct Answer {
    mode: Mode,
    /// Calls seen so far (their indexes in the answer).
    pub calls: usize,
}

enum Mode {
    Parsed(Option<ToolCallParser>),
    /// A forced call's JSON, read whole at the end.
    Forced {
        forced: Forced,
        json: String,
    },
}

impl Answer {
    pub fn new(parser: Option<ToolCallParser>) -> Self {
        Self {
            mode: Mode::Parsed(parser),
            calls: 0,
        }
    }

    /// The answer to a request whose generation was constrained by
    /// [`forced_grammar`]`(forced)`.
    pub fn forced(forced: Forced) -> Self {
        Self {
            mode: Mode::Forced {
                forced,
                json: String::new(),
            },
            calls: 0,
        }
    }

    /// The outputs `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<ToolOutput> {
        let out = match &mut self.mode {
            Mode::Parsed(Some(parser)) => parser.push(text),
            Mode::Parsed(None) if text.is_empty() => Vec::new(),
            Mode::Parsed(None) => vec![ToolOutput::Text(text.to_owned())],
            Mode::Forced { json, .. } => {
                json.push_str(text);
                Vec::new()
            }
        };
        self.count(out)
    }

    /// What was held back: a forced answer's calls, or its text when it was cut short before
    /// its JSON closed (finish reason `length`).
    pub fn finish(&mut self) -> Vec<ToolOutput> {
        let out = match &mut self.mode {
            Mode::Parsed(Some(parser)) => parser.finish(),
            Mode::Parsed(None) => Vec::new(),
            Mode::Forced { forced, json } => {
                let text = std::mem::take(json);
                match forced_calls(forced, &text) {
                    Some(calls) => calls.into_iter().map(ToolOutput::Call).collect(),
                    None if text.is_empty() => Vec::new(),
                    None => vec![ToolOutput::Text(text)],
                }
            }
        };
        self.count(out)
    }

    fn count(&mut self, out: Vec<ToolOutput>) -> Vec<ToolOutput> {
        self.calls += out
            .iter()
            .filter(|o| matches!(o, ToolOutput::Call(_)))
            .count();
        out
    }
}

/// The calls in a forced answer's JSON, `None` when it is not complete.
fn forced_calls(forced: &Forced, text: &str) -> Option<Vec<ToolCall>> {
    let value: Value = serde_json::from_str(text).ok()?;
    match forced {
        Forced::Named(name) => Some(vec![ToolCall {
            name: name.clone(),
            arguments: value,
        }]),
        Forced::Any => value
            .as_array()?
            .iter()
            .map(|call| {
                Some(ToolCall {
                    name: call.get("name")?.as_str()?.to_owned(),
                    arguments: call.get("parameters")?.clone(),
                })
            })
            .collect(),
    }
}

/// Tool-call arguments as chat templates expect them: OpenAI clients send each call's
/// `function.arguments` as a JSON string; templates (as transformers') want the object.
pub(crate) fn arguments_as_objects(messages: &mut [ChatMessage]) {
    for call in messages
        .iter_mut()
        .flat_map(|m| m.tool_calls.iter_mut().flatten())
    {
        if let Some(arguments) = call.pointer_mut("/function/arguments") {
            if let Value::String(text) = arguments {
                if let Ok(parsed @ Value::Object(_)) = serde_json::from_str::<Value>(text) {
                    *arguments = parsed;
                }
            }
        }
    }
}
