//! Chat templates: Jinja templates from `tokenizer_config.json` / `chat_template.jinja`, rendered
//! with minijinja configured as transformers configures Jinja2 (`trim_blocks`, `lstrip_blocks`,
//! `raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, Python string methods).

use minijinja::{Environment, Error, ErrorKind, Value as JinjaValue};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// One message of a conversation, OpenAI style. `content` is a string or a list of parts of
/// which the `text` parts are joined.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(deserialize_with = "content_text")]
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
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
        env.add_template_owned("chat", source).map_err(|e| {
            EngineError::ChatTemplate(format!("the template does not compile: {e}"))
        })?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders the conversation; `add_generation_prompt` appends the assistant's turn header.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
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
    fn messages_accept_content_parts() {
        let m: ChatMessage =
            serde_json::from_str(r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"image"},{"type":"text","text":"b"}]}"#).unwrap();
        assert_eq!(m.content, "ab");
    }
}
