//! The batch's model runner: the forward passes over the slot caches, sampling and the decode
//! step in flight ([`runner`]), decode steps compiled by MLX ([`compiled`]), and a draft model's
//! runner for speculative decoding in the batch ([`draft`]).

pub(crate) mod compiled;
pub(crate) mod draft;
pub(crate) mod runner;
