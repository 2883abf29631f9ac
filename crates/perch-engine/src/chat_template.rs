//! Chat templates: Jinja templates from `tokenizer_config.json` / `chat_template.jinja`, rendered
//! with minijinja configured as transformers configures Jinja2 (`trim_blocks`, `lstrip_blocks`,
//! `raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, Python string methods).

use minijinja::{Environment, Error, ErrorKind, Value as JinjaValue};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::tool_calls::ToolCallFormat;

/// One message of a conversation, OpenAI style. `content` is a string or a list of parts of
/// which the `text` parts are joined (missing or null: empty). The tool fields are rendered by
/// templates that support tools, as transformers passes them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(deserialize_with = "content_text", default)]
    pub content: String,
    /// An assistant's tool calls: `{"id", "type": "function", "function": {"name",
    /// "arguments"}}` with `arguments` an object (what chat templates expect).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message: the function's name, for templates that show it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

fn content_text<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Content {
        Text(String),
        Parts(Vec<Part>),
        Null(()),
    }
    #[derive(Deserialize)]
    struct Part {
        #[serde(rename = "type")]
        kind: String,
        text: Option<String>,
    }
    Ok(match Content::deserialize(d)? {
        Content::Text(s) => s,
        Content::Parts(parts) => parts
            .into_iter()
            .filter(|p| p.kind == "text")
            .filter_map(|p| p.text)
            .collect::<Vec<_>>()
            .join(""),
        Content::Null(()) => String::new(),
    })
}

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
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<JinjaValue, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| {
            chrono::Local::now().format(&format).to_string()
        });
        env.add_filter("tojson", tojson);
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
        template
            .render(minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone().unwrap_or_default(),
                eos_token => self.eos_token.clone().unwrap_or_default(),
            })
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)` as transformers' `tojson`
/// does it: no HTML escaping, `", "` and `": "` separators when compact.
fn tojson(
    value: JinjaValue,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<JinjaValue, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
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
    fn messages_accept_content_parts() {
        let m: ChatMessage =
            serde_json::from_str(r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"image"},{"type":"text","text":"b"}]}"#).unwrap();
        assert_eq!(m.content, "ab");
    }
}
