//! What both wire formats share about prompts and tools: rendering the conversation with the
//! model's chat template (tool definitions included) off the async threads, and the parser that
//! takes tool calls out of the answer.

use std::sync::Arc;

use perch_engine::tool_calls::{ToolCallFormat, ToolCallParser, ToolOutput};
use perch_engine::{ChatMessage, Tokenizer};
use serde_json::Value;

use crate::error::ApiError;

/// The conversation's prompt tokens: the chat template applied with `tools` (OpenAI's shape) and
/// the assistant's turn header. Rendering runs on a blocking thread (a chat template is a
/// program). Errors: 400 when tools are given to a model whose template has no tool support, or
/// the template fails on these messages.
pub(crate) async fn render(
    tokenizer: &Arc<Tokenizer>,
    messages: Vec<ChatMessage>,
    tools: Vec<Value>,
) -> Result<Vec<u32>, ApiError> {
    if !tools.is_empty() && format(tokenizer).is_none() {
        return Err(ApiError::invalid(
            "this model's chat template has no tool support: send the request without `tools`",
            Some("tools"),
        ));
    }
    let tokenizer = Arc::clone(tokenizer);
    tokio::task::spawn_blocking(move || {
        let tools = (!tools.is_empty()).then_some(tools.as_slice());
        tokenizer.encode_chat_with_tools(&messages, tools)
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

/// An answer's text through an optional parser, piece by piece; `finish` at its end.
pub(crate) struct Answer {
    parser: Option<ToolCallParser>,
    /// Calls seen so far (their indexes in the answer).
    pub calls: usize,
}

impl Answer {
    pub fn new(parser: Option<ToolCallParser>) -> Self {
        Self { parser, calls: 0 }
    }

    /// The outputs `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<ToolOutput> {
        let out = match &mut self.parser {
            Some(parser) => parser.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![ToolOutput::Text(text.to_owned())],
        };
        self.count(out)
    }

    /// What was held back.
    pub fn finish(&mut self) -> Vec<ToolOutput> {
        let out = match &mut self.parser {
            Some(parser) => parser.finish(),
            None => Vec::new(),
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
