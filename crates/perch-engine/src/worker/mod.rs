//! The batch's model runner: the forward passes over the slot caches, sampling and the decode
//! step in flight ([`runner`]), and decode steps compiled by MLX ([`compiled`]).

pub(crate) mod compiled;
pub(crate) mod runner;
