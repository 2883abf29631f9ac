//! A model's `config.json`: parsed and checked for the architecture it names, as a model load
//! does before reading weights (`perch_engine::models::check_config`).
//!
//! The body is `perch_fuzz::config` (fuzz/src/lib.rs), which the test suite replays too.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| perch_fuzz::config(data));
