//! The engine thread and its handle. The thread owns the model, the tokenizer and every MLX
//! array; the rest of Perch (CLI, app, HTTP API) talks to it through [`EngineHandle`], which is
//! `Clone + Send`: `submit` returns a stream of [`EngineEvent`]s, `cancel` stops a request at the
//! next token, `stats` reports the queue and memory.
//!
//! Nothing a client calls waits for a step: `submit` and `cancel` send a command, `stats` reads
//! the snapshot the thread publishes between steps: after any step that admits, preempts or ends
//! a request (before that step's events are sent, so a client that has seen a request finish
//! sees it counted), at least every [`STATS_INTERVAL`] while tokens stream, and whenever it goes
//! idle. Chat templates are rendered on
//! the caller's thread. A panic inside a step ends every request in the batch with
//! `Finished { Error }` and the thread goes on with a fresh batch (the prefix cache is lost).
//!
//! Scheduling: continuous batching through [`BatchGenerator`]. Between steps the thread reads
//! commands, hands new requests to the batch (which admits them by room and free KV blocks) and
//! drops cancelled ones; each step is admission, prefill chunks and one batched decode step.

pub(crate) mod batch;
mod config;
mod handle;
mod images;
mod thread;

pub use batch::lockstep::follow;
pub use config::{EngineConfig, FaultInjection};
pub use handle::{EngineHandle, RequestStream};
pub use thread::{live_engines, STATS_INTERVAL};
