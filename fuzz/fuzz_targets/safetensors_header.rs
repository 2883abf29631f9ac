//! A weight file: `check_safetensors_header` (what `Weights::load` checks before MLX reads a
//! file), and for a file it accepts, `Weights::load` itself (MLX's reader, the cast to the
//! compute dtype, evaluation) on a model directory holding only that file.
//!
//! The body is `perch_fuzz::safetensors_header` (fuzz/src/lib.rs), which the test suite replays too.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| perch_fuzz::safetensors_header(data));
