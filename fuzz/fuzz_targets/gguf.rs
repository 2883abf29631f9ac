//! A GGUF file, as `perch import` reads one: `GgufFile::open` (header, metadata, tensor infos,
//! bounds), every tensor's bytes, then the whole import into a scratch directory (metadata
//! checks, tensor plan, tokenizer, conversion, writing).
//!
//! The body is `perch_fuzz::gguf` (fuzz/src/lib.rs), which the test suite replays too.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| perch_fuzz::gguf(data));
