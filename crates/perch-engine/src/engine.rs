//! The engine thread and its handle. The thread owns the model, the tokenizer and every MLX
//! array; the rest of Perch (CLI, app, HTTP API) talks to it through [`EngineHandle`], which is
//! `Clone + Send`: `submit` returns a stream of [`EngineEvent`]s, `cancel` stops a request at the
//! next token, `stats` reports the queue and memory.
//!
//! Scheduling: continuous batching through [`BatchGenerator`]. Between steps the thread reads
//! commands, drops cancelled requests, and admits waiting ones while fewer than
//! [`EngineConfig::max_running`] run; each step is one prefill chunk plus one batched decode step.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::path::Path;
use std::thread::JoinHandle;

use serde::Serialize;

use crate::chat_template::ChatMessage;
use crate::device::{memory_stats, MemoryStats};
use crate::error::{EngineError, Result};
use crate::batch::{BatchEvent, BatchGenerator};
use crate::generate::{FinishReason, GenerateRequest, GenerationStats};
use crate::kv_cache_manager::RequestId;
use crate::models::{self, Model};
use crate::tokenizer::Tokenizer;

/// Engine settings.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most requests generating at once (the completion batch size); more wait in line.
    pub max_running: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self { max_running: 32 }
    }
}

/// What to generate from: token ids, or a conversation rendered with the chat template.
#[derive(Clone, Debug)]
pub enum Prompt {
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

/// A request as submitted: the prompt plus every per-request setting of [`GenerateRequest`]
/// (whose own `prompt` field is filled in by the engine).
#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub prompt: Prompt,
    pub params: GenerateRequest,
}

/// What a request's stream carries, in order: tokens, then exactly one `Finished`.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// A generated token and the text it completes (may be empty); `id` is `None` for text held
    /// back until the end (see [`crate::TokenEvent`]).
    Token { id: Option<u32>, text: String },
    /// The request ended. `error` is set when `finish_reason` is `Error`.
    Finished { finish_reason: FinishReason, stats: GenerationStats, error: Option<String> },
}

/// The engine's state on demand.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub finished_requests: u64,
    /// Prompt tokens per second over the last [`crate::batch::THROUGHPUT_WINDOW`].
    pub prompt_tps: f64,
    /// Generated tokens per second over the same window.
    pub generation_tps: f64,
    pub memory: MemoryStats,
}

enum Command {
    Submit { id: RequestId, request: Box<EngineRequest>, events: Sender<EngineEvent> },
    Cancel(RequestId),
    Stats(Sender<EngineStats>),
    Shutdown,
}

/// A cloneable, thread-safe handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    commands: Sender<Command>,
    next_id: Arc<AtomicU64>,
    /// Cancels are also recorded here so the running request sees them between tokens, while
    /// the engine thread is busy generating and not reading commands.
    cancelled: Arc<Mutex<HashSet<RequestId>>>,
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

/// A submitted request: its id (for `cancel`) and its event stream.
pub struct RequestStream {
    pub id: RequestId,
    pub events: Receiver<EngineEvent>,
}

impl EngineHandle {
    /// Starts the engine thread and loads the model in `model_dir` there (MLX arrays belong to
    /// the thread that creates them). Returns once the model is loaded, or the load's error.
    pub fn load(model_dir: &Path, config: EngineConfig) -> Result<Self> {
        let dir = model_dir.to_path_buf();
        Self::spawn_with(config, move || Ok((models::load(&dir)?, Tokenizer::load(&dir)?)))
    }

    /// Starts the engine thread with whatever `load` returns, called on that thread.
    pub fn spawn_with(
        config: EngineConfig,
        load: impl FnOnce() -> Result<(Box<dyn Model>, Tokenizer)> + Send + 'static,
    ) -> Result<Self> {
        let (commands, inbox) = mpsc::channel();
        let cancelled = Arc::new(Mutex::new(HashSet::new()));
        let queue = Queue {
            inbox,
            waiting: VecDeque::new(),
            cancelled: Arc::clone(&cancelled),
            finished_requests: 0,
            shutting_down: false,
        };
        let (loaded_tx, loaded_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("perch-engine".into())
            .spawn(move || match load() {
                Ok((model, tokenizer)) => {
                    let _ = loaded_tx.send(Ok(()));
                    EngineThread { model, tokenizer, queue, config }.run();
                }
                Err(err) => {
                    let _ = loaded_tx.send(Err(err));
                }
            })
            .map_err(|e| EngineError::Io { path: "engine thread".into(), source: e })?;
        loaded_rx.recv().map_err(|_| EngineError::EngineStopped)??;
        Ok(Self { commands, next_id: Arc::new(AtomicU64::new(1)), cancelled, thread: Arc::new(Mutex::new(Some(thread))) })
    }

    /// Queues a request. Errors in the request itself (empty prompt, too long, bad sampling
    /// parameters) arrive as a `Finished` event with reason `Error`.
    pub fn submit(&self, request: EngineRequest) -> Result<RequestStream, EngineError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, receiver) = mpsc::channel();
        self.commands.send(Command::Submit { id, request: Box::new(request), events }).map_err(|_| EngineError::EngineStopped)?;
        Ok(RequestStream { id, events: receiver })
    }

    /// Stops a request: a waiting one never starts, a running one ends before its next token.
    /// Either way its stream ends with `Finished { finish_reason: Cancelled }`.
    pub fn cancel(&self, id: RequestId) {
        if let Ok(mut set) = self.cancelled.lock() {
            set.insert(id);
        }
        let _ = self.commands.send(Command::Cancel(id));
    }

    /// Queue lengths and MLX memory, answered between tokens.
    pub fn stats(&self) -> Result<EngineStats, EngineError> {
        let (tx, rx) = mpsc::channel();
        self.commands.send(Command::Stats(tx)).map_err(|_| EngineError::EngineStopped)?;
        rx.recv().map_err(|_| EngineError::EngineStopped)
    }

    /// Stops the thread after the running request's current token and waits for it; waiting
    /// requests finish as cancelled.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = thread.join();
        }
    }
}

struct Job {
    id: RequestId,
    request: EngineRequest,
    events: Sender<EngineEvent>,
}

/// Everything the engine thread keeps besides the model, so it can be borrowed while the model
/// generates (commands are handled between tokens).
struct Queue {
    inbox: Receiver<Command>,
    waiting: VecDeque<Job>,
    cancelled: Arc<Mutex<HashSet<RequestId>>>,
    finished_requests: u64,
    shutting_down: bool,
}

impl Queue {
    /// Applies one command; `live` describes the batch right now (for stats).
    fn handle(&mut self, command: Command, live: &Live) {
        match command {
            Command::Submit { id, request, events } => self.waiting.push_back(Job { id, request: *request, events }),
            Command::Cancel(id) => {
                if let Some(pos) = self.waiting.iter().position(|j| j.id == id) {
                    let job = self.waiting.remove(pos).expect("position is valid");
                    self.finish(&job, FinishReason::Cancelled, GenerationStats::default(), None);
                } else if !live.running_ids.contains(&id) {
                    // Neither waiting nor running: it already finished (a submit always reaches
                    // the thread before a cancel of the id it returned), so drop the mark.
                    if let Ok(mut set) = self.cancelled.lock() {
                        set.remove(&id);
                    }
                }
            }
            Command::Stats(reply) => {
                let _ = reply.send(EngineStats {
                    running: live.running,
                    waiting: self.waiting.len(),
                    finished_requests: self.finished_requests,
                    prompt_tps: live.prompt_tps,
                    generation_tps: live.generation_tps,
                    memory: memory_stats(),
                });
            }
            Command::Shutdown => self.shutting_down = true,
        }
    }

    /// Handles every command already sent, without waiting.
    fn drain(&mut self, live: &Live) {
        while let Ok(command) = self.inbox.try_recv() {
            self.handle(command, live);
        }
    }

    fn mark_cancelled(&self, id: RequestId) {
        if let Ok(mut set) = self.cancelled.lock() {
            set.insert(id);
        }
    }

    fn is_cancelled(&self, id: RequestId) -> bool {
        self.cancelled.lock().map(|set| set.contains(&id)).unwrap_or(false)
    }

    fn finish(&mut self, job: &Job, finish_reason: FinishReason, stats: GenerationStats, error: Option<String>) {
        let _ = job.events.send(EngineEvent::Finished { finish_reason, stats, error });
        if let Ok(mut set) = self.cancelled.lock() {
            set.remove(&job.id);
        }
        self.finished_requests += 1;
    }
}

/// The batch's numbers at the moment commands are read.
struct Live {
    running: usize,
    /// Handle ids of the running requests.
    running_ids: Vec<RequestId>,
    prompt_tps: f64,
    generation_tps: f64,
}

impl Live {
    fn of(batch: &mut BatchGenerator<'_>, running: &HashMap<RequestId, Job>) -> Self {
        Self {
            running: batch.len(),
            running_ids: running.values().map(|job| job.id).collect(),
            prompt_tps: batch.prompt_throughput.rate(),
            generation_tps: batch.generation_throughput.rate(),
        }
    }
}

struct EngineThread {
    model: Box<dyn Model>,
    tokenizer: Tokenizer,
    queue: Queue,
    config: EngineConfig,
}

impl EngineThread {
    fn run(self) {
        let EngineThread { model, tokenizer, mut queue, config } = self;
        let mut batch = BatchGenerator::new(model.as_ref(), &tokenizer);
        batch.max_running = config.max_running.max(1);
        // Batch request id -> the submitted job it serves.
        let mut running: HashMap<RequestId, Job> = HashMap::new();
        loop {
            if batch.is_empty() && queue.waiting.is_empty() && !queue.shutting_down {
                // Idle: sleep until a command arrives; a dropped last handle ends the thread.
                match queue.inbox.recv() {
                    Ok(command) => queue.handle(command, &Live::of(&mut batch, &running)),
                    Err(_) => return,
                }
            }
            queue.drain(&Live::of(&mut batch, &running));

            // Cancelled (or no longer listened to) requests leave the batch before the next step.
            let leaving: Vec<RequestId> = running
                .iter()
                .filter(|(_, job)| queue.shutting_down || queue.is_cancelled(job.id))
                .map(|(id, _)| *id)
                .collect();
            for id in leaving {
                let job = running.remove(&id).expect("listed above");
                let stats = batch.remove(id).map(|out| out.stats).unwrap_or_default();
                queue.finish(&job, FinishReason::Cancelled, stats, None);
            }
            if queue.shutting_down {
                while let Some(job) = queue.waiting.pop_front() {
                    queue.finish(&job, FinishReason::Cancelled, GenerationStats::default(), None);
                }
                return;
            }

            // Admit waiting requests while there is room.
            while batch.len() < batch.max_running {
                let Some(job) = queue.waiting.pop_front() else { break };
                if queue.is_cancelled(job.id) {
                    queue.finish(&job, FinishReason::Cancelled, GenerationStats::default(), None);
                    continue;
                }
                let prompt = match &job.request.prompt {
                    Prompt::Tokens(ids) => Ok(ids.clone()),
                    Prompt::Chat(messages) => tokenizer.encode_chat(messages),
                };
                let inserted = prompt.and_then(|prompt| {
                    let mut request = job.request.params.clone();
                    request.prompt = prompt;
                    batch.insert(request)
                });
                match inserted {
                    Ok(id) => {
                        running.insert(id, job);
                    }
                    Err(err) => queue.finish(&job, FinishReason::Error, GenerationStats::default(), Some(err.to_string())),
                }
            }

            match batch.step() {
                Ok(events) => {
                    for event in events {
                        match event {
                            BatchEvent::Token { request, event } => {
                                let job = running.get(&request).expect("event of a running request");
                                let message = EngineEvent::Token { id: event.id, text: event.text };
                                // Nobody listens any more: treat as cancelled at the next step.
                                if job.events.send(message).is_err() {
                                    queue.mark_cancelled(job.id);
                                }
                            }
                            BatchEvent::Finished { request, output } => {
                                let job = running.remove(&request).expect("finished request was running");
                                queue.finish(&job, output.finish_reason, output.stats, None);
                            }
                        }
                    }
                }
                Err(err) => {
                    // An MLX failure mid-step leaves the batch's caches unusable: fail its requests.
                    let message = err.to_string();
                    for (id, job) in running.drain() {
                        batch.remove(id);
                        queue.finish(&job, FinishReason::Error, GenerationStats::default(), Some(message.clone()));
                    }
                }
            }
        }
    }
}
