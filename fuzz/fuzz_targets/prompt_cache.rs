//! A prompt-cache file (`perch_engine::prompt_cache::load_prompt_cache`): the safetensors
//! check, MLX's reader, the metadata (model id, cache classes, tokens) and the per-layer shape
//! and offset checks, against a small model that only answers `info()` (all the loader asks of it).
//!
//! The body is `perch_fuzz::prompt_cache` (fuzz/src/lib.rs), which the test suite replays too.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| perch_fuzz::prompt_cache(data));
