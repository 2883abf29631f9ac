//! Text in and out: the tokenizer and streaming detokenizer ([`tokenizer`]), chat templates
//! ([`chat_template`]), stop strings ([`stop`]) and tool-call parsing ([`tool_calls`]).

pub mod chat_template;
pub mod stop;
pub mod tokenizer;
pub mod tool_calls;
