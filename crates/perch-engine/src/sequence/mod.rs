//! One sequence with KV caches of its own, outside the batch: [`generate()`](generate::generate)
//! (mlx-lm's `generate_step`: chunked prefill, then a pipelined decode loop) and speculative
//! decoding with a draft model ([`speculative`]). Both call the model's one forward over the
//! sequence's caches.

pub mod generate;
pub mod speculative;
