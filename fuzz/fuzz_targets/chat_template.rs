//! A chat template and a conversation: `ChatTemplate::new` (compiling, tool-call format
//! detection) and `render` (with tools when the template reads them). The input is the template's
//! source, a NUL byte, then the messages as JSON (an array of `{"role", "content", ...}`); without
//! a NUL, or when the JSON is not messages, a fixed two-turn conversation is rendered.

#![no_main]

use libfuzzer_sys::fuzz_target;
use perch_engine::text::chat_template::{ChatMessage, ChatTemplate, TEMPLATE_FUEL};

fuzz_target!(|data: &[u8]| {
    let (source, rest) = match data.iter().position(|&b| b == 0) {
        Some(nul) => (&data[..nul], &data[nul + 1..]),
        None => (data, &[][..]),
    };
    let source = String::from_utf8_lossy(source).into_owned();
    let messages: Vec<ChatMessage> = serde_json::from_slice(rest).unwrap_or_else(|_| {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi <b>there</b>"),
        ]
    });
    let Ok(mut template) = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into()))
    else {
        return;
    };
    // A twentieth of the app's fuel: this build (AddressSanitizer, coverage) runs some 30 times
    // slower, and a template that loops until its fuel runs out should take about as long (under
    // a second) as in the app, not most of libFuzzer's 10 s timeout.
    template.set_fuel(TEMPLATE_FUEL / 20);
    let _ = template.render(&messages, true);
    if template.tool_call_format().is_some() {
        let tool = serde_json::json!({"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
        let _ = template.render_with_tools(&messages, Some(&[tool]), false);
    }
});
