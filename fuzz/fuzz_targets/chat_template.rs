//! A chat template and a conversation: `ChatTemplate::new` (compiling, tool-call format
//! detection) and `render` (with tools when the template reads them). The input is the template's
//! source, a NUL byte, then the messages as JSON (an array of `{"role", "content", ...}`); without
//! a NUL, or when the JSON is not messages, a fixed two-turn conversation is rendered.
//!
//! The body is `perch_fuzz::chat_template` (fuzz/src/lib.rs), which the test suite replays too.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| perch_fuzz::chat_template(data));
