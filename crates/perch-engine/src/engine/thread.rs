//! The engine thread: its command queue, its loop over the batch and the requests it runs beside
//! the batch, and how it ends requests.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::config::*;
use crate::api::EngineEvent;
use crate::api::EngineRequest;
use crate::api::EngineStats;
use crate::api::Prompt;
use crate::api::{
    ErrorKind, FinishReason, GenerateRequest, GenerationStats, RequestError, TokenEvent,
};
use crate::api::{KeepAlive, Residency};
use crate::device::{memory_stats, Backend};
use crate::engine::batch::{BatchConfig, BatchEvent, BatchGenerator};
use crate::error::{EngineError, Result};
use crate::models;
use crate::models::Model;
use crate::nn::weights::LoadProgress;
use crate::sequence::speculative::{Draft, SoloSequence};
use crate::text::tokenizer::Tokenizer;
use perch_sched::kv_cache_manager::RequestId;

pub(super) struct Job {
    pub(super) id: RequestId,
    pub(super) request: EngineRequest,
    pub(super) events: Sender<EngineEvent>,
}

/// Everything the engine thread keeps besides the model and the batch, so it can be borrowed
/// while the batch steps (commands are handled between steps).
pub(super) struct Queue {
    pub(super) inbox: Receiver<Command>,
    /// Submitted since the last step; they join the batch before the next one.
    pub(super) submitted: Vec<Job>,
    pub(super) prompt_cache_jobs: Vec<PromptCacheJob>,
    pub(super) cancelled: Arc<Mutex<HashSet<RequestId>>>,
    pub(super) finished_requests: u64,
    pub(super) shutting_down: bool,
    /// Events of this pass, sent after the pass's stats are published.
    pub(super) outbox: Vec<(RequestId, Sender<EngineEvent>, EngineEvent)>,
    pub(super) stats: Arc<Mutex<EngineStats>>,
    /// When `stats` was last replaced.
    pub(super) published_at: Instant,
    pub(super) outstanding: Arc<AtomicUsize>,
    /// Ids of the requests running beside the batch (speculative ones the batch does not draft
    /// for: with logits processors, or without a draft in the batch; see [`SoloSequence`]).
    pub(super) solo: HashSet<RequestId>,
    /// How long the model stays loaded once idle: the last request's `keep_alive`, or
    /// `default_keep_alive` ([`EngineConfig::keep_alive`]) when it set none.
    pub(super) keep_alive: KeepAlive,
    pub(super) default_keep_alive: KeepAlive,
}

impl Queue {
    /// Applies one command; `batch` and `jobs` (batch request id -> job) are read for stats and
    /// cancels, only when such a command comes.
    fn handle(
        &mut self,
        command: Command,
        batch: Option<&mut BatchGenerator<'_>>,
        jobs: &HashMap<RequestId, Job>,
    ) {
        match command {
            Command::Submit {
                id,
                request,
                events,
            } => {
                // Ollama's rule: each request's keep-alive, or the engine's when it sets none.
                self.keep_alive = request.params.keep_alive.unwrap_or(self.default_keep_alive);
                self.submitted.push(Job {
                    id,
                    request: *request,
                    events,
                })
            }
            Command::PromptCache(job) => self.prompt_cache_jobs.push(job),
            Command::Cancel(id) => {
                let known = jobs.values().chain(&self.submitted).any(|job| job.id == id)
                    || self.solo.contains(&id);
                if !known {
                    // Not in the engine: it already finished (a submit always reaches the thread
                    // before a cancel of the id it returned), so drop the mark.
                    if let Ok(mut set) = self.cancelled.lock() {
                        set.remove(&id);
                    }
                }
            }
            Command::ClearCache(reply) => {
                // An unloaded engine has no prefix cache.
                if let Some(batch) = batch {
                    batch.reset_prefix_cache();
                    self.publish(batch);
                }
                let _ = reply.send(());
            }
            Command::Shutdown => self.shutting_down = true,
        }
    }

    /// Submitted next-token-logprobs calls not in the batch yet.
    fn scoring(&self) -> usize {
        self.submitted
            .iter()
            .filter(|job| job.request.params.next_token_logprobs)
            .count()
    }

    /// Handles commands while `wanted` holds, for at most `limit`, until none arrives for `gap`.
    /// False when every handle is gone.
    fn gather(
        &mut self,
        batch: &mut BatchGenerator<'_>,
        jobs: &HashMap<RequestId, Job>,
        limit: std::time::Duration,
        gap: std::time::Duration,
        wanted: impl Fn(&Queue) -> bool,
    ) -> bool {
        let deadline = Instant::now() + limit;
        while wanted(self) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.inbox.recv_timeout(gap.min(left)) {
                Ok(command) => self.handle(command, Some(&mut *batch), jobs),
                Err(mpsc::RecvTimeoutError::Timeout) => break,
                Err(mpsc::RecvTimeoutError::Disconnected) => return false,
            }
        }
        true
    }

    /// Handles every command already sent, without waiting.
    fn drain(&mut self, batch: &mut BatchGenerator<'_>, jobs: &HashMap<RequestId, Job>) {
        while let Ok(command) = self.inbox.try_recv() {
            self.handle(command, Some(&mut *batch), jobs);
        }
    }

    fn mark_cancelled(&self, id: RequestId) {
        if let Ok(mut set) = self.cancelled.lock() {
            set.insert(id);
        }
    }

    fn is_cancelled(&self, id: RequestId) -> bool {
        self.cancelled
            .lock()
            .map(|set| set.contains(&id))
            .unwrap_or(false)
    }

    /// Ends a request the engine refused before running it (see [`EngineEvent::Finished`]).
    fn refuse(&mut self, job: &Job, error: &EngineError) {
        self.end(job, EngineEvent::failed(error.to_refusal()));
    }

    /// Queues a token event of `job` for [`Queue::flush`].
    fn send(&mut self, job: &Job, event: EngineEvent) {
        self.outbox.push((job.id, job.events.clone(), event));
    }

    /// Replaces the published stats with the engine's state now.
    fn publish(&mut self, batch: &mut BatchGenerator<'_>) {
        self.published_at = Instant::now();
        let stats = EngineStats {
            running: batch.num_running() + self.solo.len(),
            waiting: batch.num_waiting() + self.submitted.len(),
            finished_requests: self.finished_requests,
            prompt_tps: batch.prompt_throughput.rate(),
            generation_tps: batch.generation_throughput.rate(),
            kv_cache: batch.kv_stats(),
            step_times: batch.step_times(),
            memory: memory_stats(),
            warm_ups_left: batch.idle_warm_ups_left(),
            residency: Residency::Loaded,
            clients: batch.client_tallies(),
            group_stopped: batch.group_stopped(),
        };
        if let Ok(mut published) = self.stats.lock() {
            *published = stats;
        }
    }

    /// Publishes the stats of an engine without a model in memory: unloaded, or `Loading`
    /// again.
    fn publish_residency(&mut self, residency: Residency) {
        self.published_at = Instant::now();
        let stats = EngineStats {
            waiting: self.submitted.len(),
            finished_requests: self.finished_requests,
            memory: memory_stats(),
            residency,
            ..EngineStats::default()
        };
        if let Ok(mut published) = self.stats.lock() {
            *published = stats;
        }
    }

    /// While unloaded: handles commands until a request or prompt-cache job needs the model,
    /// then loads it with `loader`, the progress published as [`Residency::Loading`]. A load
    /// that fails ends the waiting requests and jobs with its error and waits again. `None`
    /// at shutdown or when every handle is gone.
    fn reload(&mut self, loader: &mut Loader) -> Option<Loaded> {
        let no_jobs = HashMap::new();
        loop {
            match self.inbox.recv() {
                Ok(command) => self.handle(command, None, &no_jobs),
                Err(_) => return None,
            }
            // Everything already sent too: a shutdown or cancel queued behind it counts now.
            while let Ok(command) = self.inbox.try_recv() {
                self.handle(command, None, &no_jobs);
            }
            if self.shutting_down {
                self.fail_waiting(&EngineError::EngineStopped);
                return None;
            }
            if self.submitted.is_empty() && self.prompt_cache_jobs.is_empty() {
                continue;
            }
            self.publish_residency(Residency::Loading {
                progress: LoadProgress::default(),
            });
            let stats = Arc::clone(&self.stats);
            let loaded = std::panic::catch_unwind(AssertUnwindSafe(|| {
                loader(&mut |progress| {
                    if let Ok(mut published) = stats.lock() {
                        published.residency = Residency::Loading { progress };
                    }
                })
            }))
            .unwrap_or_else(|panic| {
                Err(EngineError::Request(format!(
                    "loading the model failed ({})",
                    panic_message(panic.as_ref())
                )))
            });
            match loaded {
                Ok(loaded) => return Some(loaded),
                Err(error) => {
                    // Requests sent while it loaded meet the same failure.
                    while let Ok(command) = self.inbox.try_recv() {
                        self.handle(command, None, &no_jobs);
                    }
                    self.fail_waiting(&error);
                    if self.shutting_down {
                        return None;
                    }
                }
            }
        }
    }

    /// Ends every waiting request and prompt-cache job of an unloaded engine with `error` (the
    /// model could not be loaded again, or the engine stops): 503 for too little memory or a
    /// stopped engine, the model-not-loaded kind otherwise, with the load's sentence.
    fn fail_waiting(&mut self, error: &EngineError) {
        let kind = match error.kind() {
            ErrorKind::Overloaded => ErrorKind::Overloaded,
            _ => ErrorKind::ModelNotLoaded,
        };
        let message = match error {
            EngineError::EngineStopped => error.to_string(),
            _ => format!("the model could not be loaded again: {error}"),
        };
        for job in std::mem::take(&mut self.submitted) {
            self.end(
                &job,
                EngineEvent::failed(RequestError::new(kind, message.clone())),
            );
        }
        for job in std::mem::take(&mut self.prompt_cache_jobs) {
            job.fail(error);
        }
        self.publish_residency(Residency::Unloaded);
        self.flush();
    }

    /// Publishes the stats, then sends the pass's events: a client that sees a request end
    /// sees it counted.
    fn publish_and_flush(&mut self, batch: &mut BatchGenerator<'_>) {
        self.publish(batch);
        self.flush();
    }

    /// [`Queue::publish_and_flush`] after a step: the stats are published when requests `moved`
    /// (were admitted, preempted or left), a request ended (its `Finished` is in the outbox) or
    /// [`STATS_INTERVAL`] has passed; else only the tokens are sent.
    fn publish_if_due_and_flush(&mut self, batch: &mut BatchGenerator<'_>, moved: bool) {
        let ended = self
            .outbox
            .iter()
            .any(|(_, _, event)| matches!(event, EngineEvent::Finished { .. }));
        if moved || ended || self.published_at.elapsed() >= STATS_INTERVAL {
            self.publish(batch);
        }
        self.flush();
    }

    /// Sends the outbox.
    fn flush(&mut self) {
        for (id, events, event) in std::mem::take(&mut self.outbox) {
            let is_token = matches!(event, EngineEvent::Token { .. });
            // Nobody listens any more: treat as cancelled at the next step.
            if events.send(event).is_err() && is_token {
                self.mark_cancelled(id);
            }
        }
    }

    fn finish(
        &mut self,
        job: &Job,
        finish_reason: FinishReason,
        stats: GenerationStats,
        error: Option<RequestError>,
    ) {
        self.end(
            job,
            EngineEvent::Finished {
                finish_reason,
                stats,
                error,
                stop_string: None,
                next_token_logprobs: None,
            },
        );
    }

    /// Queues a request's `Finished` (see [`Queue::publish_and_flush`]) and forgets it.
    fn end(&mut self, job: &Job, finished: EngineEvent) {
        self.outbox.push((job.id, job.events.clone(), finished));
        if let Ok(mut set) = self.cancelled.lock() {
            set.remove(&job.id);
        }
        self.finished_requests += 1;
        self.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The batch's block pool for `model` (and its `draft`, whose KV the blocks pay for where it
/// drafts in the batch, [`BatchConfig::counting_draft`]) within `config`'s KV budget: what the
/// engine thread runs and what [`super::handle::EngineHandle`] publishes as its limits.
pub(super) fn pool_config(
    model: &dyn Model,
    draft: Option<&dyn Model>,
    config: &EngineConfig,
) -> BatchConfig {
    BatchConfig::for_budget(
        model,
        config.kv_cache_bytes,
        config.block_size,
        config.kv_quantization,
    )
    .counting_draft(model, draft)
}

/// Loads a draft model and checks it against the model (see [`crate::sequence::speculative::Draft`]).
pub(super) fn load_draft(
    dir: &Path,
    model: &dyn Model,
    tokenizer: &Tokenizer,
) -> Result<(Box<dyn Model>, Tokenizer)> {
    let draft = models::load(dir)?;
    let draft_tokenizer = Tokenizer::load(dir)?;
    if !tokenizer.same_vocabulary(&draft_tokenizer) {
        return Err(EngineError::Request(format!(
            "the draft model {} has another tokenizer than the model: speculative decoding needs \
             a draft of the same family (the same tokens and ids)",
            dir.display()
        )));
    }
    if draft.info().vocab_size > model.info().vocab_size {
        return Err(EngineError::Request(format!(
            "the draft model {} cannot draft for this model (a larger vocabulary)",
            dir.display()
        )));
    }
    Ok((draft, draft_tokenizer))
}

/// A model in memory and its draft model (with the draft's tokenizer), when one is configured.
pub(super) struct Loaded {
    pub(super) model: Box<dyn Model>,
    pub(super) draft: Option<(Box<dyn Model>, Tokenizer)>,
}

/// Loads the model (and draft) again after an idle unload, reporting the weights read.
pub(super) type Loader = Box<dyn FnMut(&mut dyn FnMut(LoadProgress)) -> Result<Loaded> + Send>;

pub(super) struct EngineThread {
    /// The model as first loaded.
    pub(super) loaded: Loaded,
    pub(super) loader: Loader,
    pub(super) memory: MemoryAtLoad,
    pub(super) tokenizer: Arc<Tokenizer>,
    pub(super) model_id: String,
    pub(super) queue: Queue,
    pub(super) config: EngineConfig,
}

/// The memory left once the model first loaded, on CPU and Metal (`None` on CUDA, see
/// [`crate::memory::available_for`]), and whether the KV budget was lowered for it.
#[derive(Clone, Copy, Default)]
pub(super) struct MemoryAtLoad {
    pub(super) available: Option<u64>,
    /// See [`BatchConfig::lowered_for_memory`].
    pub(super) lowered: Option<crate::memory::LoweredBudget>,
}

/// Why [`Pass::serve`] returned.
enum Ended {
    /// Shutdown, or every handle is gone.
    Stopped,
    /// Idle past the keep-alive time ([`KeepAlive`]): unload the model.
    Idle,
}

impl EngineThread {
    /// Serves until shutdown; `ready` is called once, after the fresh batch's stats are
    /// published, so a client that sees the load finish reads the real KV pool and memory.
    /// Idle past [`Queue::keep_alive`], the model, its KV pool and prefix cache are dropped and
    /// MLX's buffer cache emptied; the next request (or prompt-cache job) loads it again.
    pub(super) fn run(self, ready: impl FnOnce()) {
        let mut ready = Some(ready);
        let EngineThread {
            loaded,
            mut loader,
            memory,
            tokenizer,
            model_id,
            mut queue,
            config,
        } = self;
        let mut loaded = Some(loaded);
        loop {
            let model = match loaded.take() {
                Some(model) => model,
                None => match queue.reload(&mut loader) {
                    Some(model) => model,
                    None => return,
                },
            };
            // Kept resident while the model is loaded (Metal), restored once it is dropped.
            let wired = crate::device::WiredLimit::raise();
            let ended = serve_model(
                &model,
                (&tokenizer, &model_id),
                &mut queue,
                (&config, memory),
                &mut ready,
            );
            match ended {
                Ended::Stopped => {
                    // The model first, then the wired limit it was held under.
                    drop(model);
                    drop(wired);
                    return;
                }
                Ended::Idle => {
                    drop(model);
                    drop(wired);
                    crate::device::release_freed_memory();
                    queue.publish_residency(Residency::Unloaded);
                }
            }
        }
    }
}

/// Serves `loaded` until shutdown or an idle unload, restarting a fresh batch after a panic.
fn serve_model(
    loaded: &Loaded,
    (tokenizer, model_id): (&Tokenizer, &str),
    queue: &mut Queue,
    (config, memory): (&EngineConfig, MemoryAtLoad),
    ready: &mut Option<impl FnOnce()>,
) -> Ended {
    let model = loaded.model.as_ref();
    // A model whose image tokens attend to each other both ways computes an image in one pass
    // (the batch refuses a longer one): the budget takes its processor's largest image (Gemma 4's
    // 280 tokens by default, above the CPU's 256).
    let both_ways = model
        .vision()
        .is_some_and(crate::models::vision::VisionTower::attends_both_ways);
    let prefill_token_budget = match (both_ways, tokenizer.image_processor()) {
        (true, Some(processor)) => config.prefill_token_budget.max(processor.max_tokens()),
        _ => config.prefill_token_budget,
    };
    // A model divided over ranks runs its batch in lockstep with theirs (`super::lockstep`),
    // without what that does not run yet.
    let divided = model.division().is_some_and(|d| d.size() > 1);
    let batch_config = BatchConfig {
        max_running: config.max_running,
        prefill_batch_size: config.prefill_batch_size,
        prefill_token_budget,
        slot_attention: config.slot_attention,
        // Pipeline stages step uncompiled whatever this says (`BatchGenerator::new`).
        compile_decode: config.compile_decode,
        prompt_lookup: config.prompt_lookup,
        lowered_for_memory: memory.lowered,
        ..pool_config(
            model,
            loaded.draft.as_ref().map(|(m, _)| m.as_ref()),
            config,
        )
    };
    let mut pass = Pass {
        model,
        draft: loaded.draft.as_ref().map(|(m, t)| (m.as_ref(), t)),
        solo: Vec::new(),
        tokenizer,
        model_id,
        config,
        jobs: HashMap::new(),
        steps: 0,
        pressure: memory.available.map(crate::memory::PressureGuard::new),
        heap_trimmed: (Instant::now(), false),
    };
    let mut warm_up = true;
    loop {
        let mut batch = BatchGenerator::new(model, tokenizer, batch_config.clone(), model_id);
        if let Some((draft, _)) = pass.draft {
            batch = batch.with_draft(draft, config.num_draft_tokens);
        }
        if let Some(models) = &config.client_models {
            batch = batch.with_client_models(model_id, models.clone());
        }
        if divided {
            // A failure here fails every call after it: requests end with its sentence.
            let _ = batch.lead_ranks(model_id);
        }
        if std::mem::take(&mut warm_up) {
            // A warm-up that fails leaves nothing behind; the first request that meets the
            // same failure reports it.
            if Backend::current() != Backend::Cpu {
                let _ = batch.warm_up();
            }
            if config.idle_warm_up {
                batch.queue_idle_warm_up();
            }
        }
        // Stats of the fresh batch, then the failed requests' ends (after a panic).
        queue.publish_and_flush(&mut batch);
        if let Some(ready) = ready.take() {
            ready();
        }
        let served = std::panic::catch_unwind(AssertUnwindSafe(|| pass.serve(&mut batch, queue)));
        let panic = match served {
            Ok(ended) => {
                batch.stop_followers();
                return ended;
            }
            Err(panic) => panic,
        };
        // A panic mid-pass: the batch's state is unknown. Its requests end with the panic's
        // message (sent once the next batch is up); the next loop starts a fresh batch (and
        // prefix cache) on the same model.
        let message = format!(
            "the engine failed while running this request ({}); it was stopped and the engine \
             restarted",
            panic_message(panic.as_ref())
        );
        let solo = std::mem::take(&mut pass.solo).into_iter();
        queue.solo.clear();
        for job in std::mem::take(&mut pass.jobs)
            .into_values()
            .chain(solo.map(|(job, _)| job))
        {
            queue.finish(
                &job,
                FinishReason::Error,
                GenerationStats::default(),
                Some(RequestError::new(ErrorKind::Internal, message.clone())),
            );
        }
        if divided {
            // The other ranks' batches may not match this one any more, and a fresh batch needs
            // their collectives: the engine stops here (later requests are refused).
            queue.publish_and_flush(&mut batch);
            return Ended::Stopped;
        }
    }
}

/// What a panic carried, as text.
pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// The engine thread's state that outlives a batch: the model, the settings and the requests
/// in the batch (batch request id -> the submitted job it serves, waiting or running).
pub(super) struct Pass<'m> {
    pub(super) model: &'m dyn Model,
    /// The draft model and its tokenizer, when loaded.
    pub(super) draft: Option<(&'m dyn Model, &'m Tokenizer)>,
    /// Requests the batch cannot run (speculative ones): each runs beside it, a step of its own
    /// per engine step.
    pub(super) solo: Vec<(Job, SoloSequence<'m>)>,
    pub(super) tokenizer: &'m Tokenizer,
    pub(super) model_id: &'m str,
    pub(super) config: &'m EngineConfig,
    pub(super) jobs: HashMap<RequestId, Job>,
    /// Steps run since the model loaded (for [`FaultInjection::panic_at_step`]).
    pub(super) steps: u64,
    /// Watches the memory left (CPU and Metal); see [`Pass::relieve_memory`].
    pub(super) pressure: Option<crate::memory::PressureGuard>,
    /// When the heap was last trimmed ([`HEAP_TRIM_EVERY`]), and whether work (a batch or solo
    /// step) ran since.
    pub(super) heap_trimmed: (Instant, bool),
}

/// How often a busy engine gives the heap's free pages back ([`crate::device::trim_heap`]),
/// and an engine going idle after work does at once: memory MLX frees below the mmap threshold
/// otherwise stays resident until malloc reuses it. A trim walks the arenas' free chunks; its
/// cost was not measured, which is why it runs at most twice a minute. In the soak (where
/// MLX's own cache was most of the growth, bounded since by `memory::cache_limit_within`) a run
/// with the trim and one without ended within 1% of each other: its effect there is not shown.
pub(super) const HEAP_TRIM_EVERY: Duration = Duration::from_secs(30);

impl Pass<'_> {
    /// Under memory pressure ([`crate::memory::PressureGuard`]): on entering it, drops the
    /// prefix cache's free blocks; at each reading under the floor, gives freed memory back
    /// ([`crate::device::release_freed_memory`]); while it lasts, admits no request beside
    /// those running (they wait in line). Above the floor, each fresh reading's headroom bounds
    /// what admissions may add to the slot caches ([`BatchGenerator::set_memory_headroom`]).
    /// A model divided over ranks: the other ranks' readings count alike, the least headroom
    /// and capacity of any rank bounding admissions, and any rank under its floor holding them
    /// ([`BatchGenerator::least_rank_memory`]).
    fn relieve_memory(&mut self, batch: &mut BatchGenerator<'_>) {
        let Some(guard) = &mut self.pressure else {
            return;
        };
        if batch.awaits_memory_reading() {
            guard.read_again();
            // A failure here fails the next call alike.
            let _ = batch.refresh_rank_memory();
        }
        let (low, fresh) = guard.low();
        let (mut headroom, mut capacity) = (guard.headroom(), guard.capacity());
        let others = batch.least_rank_memory();
        if let Some(others) = others {
            if others.headroom.bytes < headroom.bytes {
                headroom = others.headroom;
            }
            capacity = capacity.min(others.capacity);
        }
        let low = low || others.is_some_and(|o| o.low);
        if low && !batch.admissions_held() {
            batch.reset_prefix_cache();
        }
        if low && fresh {
            crate::device::release_freed_memory();
        }
        if fresh {
            batch.set_memory_headroom(Some(headroom));
            // Requests beside the batch (speculative, late-quantized) hold memory that comes
            // back: no refusal is then beyond what the engine can ever give.
            batch.set_memory_capacity(self.solo.is_empty().then_some(capacity));
        }
        batch.hold_admissions(low);
    }

    /// Serves commands and steps the batch until shutdown or the last handle is dropped.
    fn serve(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) -> Ended {
        let config = self.config;
        loop {
            if batch.is_empty()
                && self.solo.is_empty()
                && queue.submitted.is_empty()
                && queue.prompt_cache_jobs.is_empty()
                && !queue.shutting_down
            {
                // Idle: sleep until a command arrives or the keep-alive time has passed; a
                // dropped last handle ends the thread.
                queue.publish_and_flush(batch);
                self.trim_heap(Duration::ZERO);
                // A time past what an `Instant` holds is never; a model divided over ranks stays
                // (loading it again would need the other ranks to load theirs).
                let unload_at = match queue.keep_alive {
                    KeepAlive::Idle(_) if batch.leads_ranks() => None,
                    KeepAlive::Idle(time) => Instant::now().checked_add(time),
                    KeepAlive::Forever => None,
                };
                // Queued warm-up passes run one at a time while no command waits.
                let command = loop {
                    let left = unload_at.map(|at| at.saturating_duration_since(Instant::now()));
                    if left.is_some_and(|left| left.is_zero()) {
                        // Not while a command already waits.
                        match queue.inbox.try_recv() {
                            Ok(command) => break Some(command),
                            Err(mpsc::TryRecvError::Empty) => return Ended::Idle,
                            Err(mpsc::TryRecvError::Disconnected) => break None,
                        }
                    }
                    if batch.idle_warm_ups_left() == 0 {
                        // An idle rank 0 still calls the other ranks now and then: their
                        // watchdogs end a group that makes no call (`distributed::Watchdog`).
                        if batch.leads_ranks() && batch.group_stopped().is_none() {
                            let every = super::batch::lockstep::alive_interval();
                            match queue.inbox.recv_timeout(every) {
                                Ok(command) => break Some(command),
                                Err(mpsc::RecvTimeoutError::Timeout) => {
                                    // A failure stops the group: published at once, so that
                                    // `perch serve` (watching the stats) ends without waiting
                                    // for a request to meet it.
                                    if batch.tell_ranks_alive().is_err() {
                                        queue.publish_and_flush(batch);
                                    }
                                    continue;
                                }
                                Err(mpsc::RecvTimeoutError::Disconnected) => break None,
                            }
                        }
                        match left {
                            None => break queue.inbox.recv().ok(),
                            Some(left) => match queue.inbox.recv_timeout(left) {
                                Ok(command) => break Some(command),
                                Err(mpsc::RecvTimeoutError::Timeout) => return Ended::Idle,
                                Err(mpsc::RecvTimeoutError::Disconnected) => break None,
                            },
                        }
                    }
                    match queue.inbox.try_recv() {
                        Ok(command) => break Some(command),
                        Err(mpsc::TryRecvError::Empty) => {
                            // A failed pass ends the warm-up; requests meet the failure anew.
                            let _ = batch.warm_up_idle();
                            queue.publish_and_flush(batch);
                        }
                        Err(mpsc::TryRecvError::Disconnected) => break None,
                    }
                };
                match command {
                    Some(command) => queue.handle(command, Some(batch), &self.jobs),
                    None => return Ended::Stopped,
                }
                // A next-token-logprobs call waits briefly for others to share its step.
                let timeout = config.logprobs_batch_timeout;
                let scoring = |q: &Queue| (1..config.logprobs_batch_size).contains(&q.scoring());
                // A burst of requests starts together (see `EngineConfig::arrival_window`).
                let window = config.arrival_window;
                let burst = |q: &Queue| {
                    !window.is_zero() && (1..config.max_running).contains(&q.submitted.len())
                };
                if !queue.gather(batch, &self.jobs, timeout, timeout, scoring)
                    || !queue.gather(batch, &self.jobs, window * 4, window, burst)
                {
                    return Ended::Stopped;
                }
            }
            queue.drain(batch, &self.jobs);
            self.prompt_cache_jobs(batch, queue);
            // New requests count as running (or waiting) before their first step ends.
            let arrived = !queue.submitted.is_empty();
            self.admit(batch, queue);

            // Cancelled (or no longer listened to) requests leave before the next step.
            let leaving: Vec<RequestId> = self
                .jobs
                .iter()
                .filter(|(_, job)| queue.shutting_down || queue.is_cancelled(job.id))
                .map(|(id, _)| *id)
                .collect();
            for id in leaving {
                let job = self.jobs.remove(&id).expect("listed above");
                match batch.remove(id) {
                    Ok(output) => queue.finish(
                        &job,
                        FinishReason::Cancelled,
                        output.map(|o| o.stats).unwrap_or_default(),
                        None,
                    ),
                    Err(err) => queue.finish(
                        &job,
                        FinishReason::Error,
                        GenerationStats::default(),
                        Some(err.to_request_error()),
                    ),
                }
            }
            for (job, sequence) in std::mem::take(&mut self.solo) {
                if queue.shutting_down || queue.is_cancelled(job.id) {
                    queue.solo.remove(&job.id);
                    let stats = sequence
                        .finish(self.tokenizer, &mut |_| ControlFlow::Continue(()))
                        .map(|o| o.stats)
                        .unwrap_or_default();
                    queue.finish(&job, FinishReason::Cancelled, stats, None);
                } else {
                    self.solo.push((job, sequence));
                }
            }
            if queue.shutting_down {
                queue.publish_and_flush(batch);
                return Ended::Stopped;
            }
            // Refused and cancelled requests hear of it now, not after the step.
            if arrived || !queue.outbox.is_empty() {
                queue.publish_and_flush(batch);
            }
            let queues = |b: &BatchGenerator<'_>| (b.num_running(), b.num_waiting());
            let before = queues(batch);
            let stepped = !batch.is_empty() || !self.solo.is_empty();
            if !batch.is_empty() {
                self.relieve_memory(batch);
                self.step(batch, queue);
            }
            self.step_solo(batch, queue);
            if stepped {
                self.worked();
            }
            let moved = queues(batch) != before;
            queue.publish_if_due_and_flush(batch, moved);
        }
    }

    fn prompt_cache_jobs(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) {
        for job in std::mem::take(&mut queue.prompt_cache_jobs) {
            match job {
                PromptCacheJob::Save {
                    prompt,
                    path,
                    reply,
                } => {
                    let saved = tokens_of(&prompt, self.tokenizer).and_then(|tokens| {
                        // Checked before the prefix is computed for nothing.
                        if let Some(reason) = crate::prompt_cache::unsupported_reason(self.model) {
                            return Err(EngineError::PromptCache {
                                path: path.clone(),
                                message: reason.into(),
                            });
                        }
                        batch.save_prefix(
                            &tokens,
                            GenerateRequest::DEFAULT_PREFILL_STEP_SIZE,
                            &path,
                            self.model_id,
                        )
                    });
                    let _ = reply.send(saved);
                }
                PromptCacheJob::Load { path, reply } => {
                    let loaded = batch.import_prefix_file(&path, self.model_id);
                    let _ = reply.send(loaded);
                }
            }
        }
    }

    /// Hands the submitted requests to the batch (or refuses them).
    fn admit(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) {
        for job in std::mem::take(&mut queue.submitted) {
            let params = &job.request.params;
            if params.runs_beside_batch(batch.drafts()) {
                if batch.leads_ranks() {
                    let error = EngineError::Distributed(
                        "a model divided over ranks runs speculative decoding only inside its \
                         batch: not for requests with penalties, a logit bias, \
                         log-probabilities, a grammar, images or KV cache options, nor with a \
                         model whose layers cannot draft in the batch (sliding-window layers)"
                            .into(),
                    );
                    queue.refuse(&job, &error);
                    continue;
                }
                match self.start_solo(&job) {
                    Ok(sequence) => {
                        queue.solo.insert(job.id);
                        self.solo.push((job, sequence));
                    }
                    Err(err) => queue.refuse(&job, &err),
                }
                continue;
            }
            let inserted = match &job.request.prompt {
                Prompt::AfterCache { cache_file, tokens } => {
                    let mut request = job.request.params.clone();
                    request.prompt = tokens.clone();
                    batch.insert_after_cache_file(request, cache_file, self.model_id)
                }
                prompt => tokens_of(prompt, self.tokenizer).and_then(|tokens| {
                    let mut request = job.request.params.clone();
                    request.prompt = tokens;
                    batch.insert(request)
                }),
            };
            match inserted {
                Ok(id) => {
                    self.jobs.insert(id, job);
                }
                Err(err) => queue.refuse(&job, &err),
            }
        }
    }
}

impl<'m> Pass<'m> {
    /// The sequence of a request that runs beside the batch (checked; nothing runs yet): a
    /// speculative one (which may quantize its own KV cache too).
    fn start_solo(&self, job: &Job) -> Result<SoloSequence<'m>> {
        let draft = match (job.request.params.num_draft_tokens, self.draft) {
            (None, _) => None,
            (Some(num_draft_tokens), Some((model, tokenizer))) => Some(Draft {
                model,
                tokenizer,
                num_draft_tokens,
            }),
            (Some(_), None) => {
                return Err(EngineError::Request(
                    "no draft model is loaded: speculative decoding needs one (the engine's \
                     draft_model, `perch serve --draft-model`)"
                        .into(),
                ))
            }
        };
        let mut request = job.request.params.clone();
        request.prompt = match &job.request.prompt {
            Prompt::AfterCache { cache_file, .. } => {
                return Err(EngineError::PromptCache {
                    path: cache_file.clone(),
                    message: "a speculative request cannot start from a prompt cache".into(),
                })
            }
            prompt => tokens_of(prompt, self.tokenizer)?,
        };
        // Its prompt goes in chunks no larger than the batch's prefill budget, one per step,
        // so that running streams keep their pace.
        request.prefill_step_size = request
            .prefill_step_size
            .min(self.config.prefill_token_budget.max(1));
        SoloSequence::new(self.model, draft.as_ref(), self.tokenizer, &request)
    }

    /// One step of every request beside the batch (a prompt chunk, a token, or a round of
    /// proposals); their events go to the outbox.
    fn step_solo(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) {
        // By index, the sequences staying in `self.solo` while they step: a panic mid-step
        // finds every request there (see `EngineThread::run`).
        let mut i = 0;
        while i < self.solo.len() {
            let (job, sequence) = &mut self.solo[i];
            let job = &*job;
            let mut tokens = 0;
            let mut send = |event: &TokenEvent| {
                tokens += event.id.is_some() as usize;
                queue.send(job, token_message(event));
                ControlFlow::Continue(())
            };
            let stepped = sequence.step(self.tokenizer, &mut send);
            batch.generation_throughput.record(tokens);
            if let Ok(false) = stepped {
                i += 1;
                continue;
            }
            let (job, sequence) = self.solo.remove(i);
            queue.solo.remove(&job.id);
            let mut send = |event: &TokenEvent| {
                queue.send(&job, token_message(event));
                ControlFlow::Continue(())
            };
            let output = stepped.and_then(|_| sequence.finish(self.tokenizer, &mut send));
            match output {
                Ok(output) => queue.end(&job, finished_event(output)),
                Err(err) => queue.finish(
                    &job,
                    FinishReason::Error,
                    GenerationStats::default(),
                    Some(err.to_request_error()),
                ),
            }
        }
    }

    /// Gives the heap's free pages back when work ran since the last time and `after` has
    /// passed since it.
    fn trim_heap(&mut self, after: Duration) {
        let (at, worked) = self.heap_trimmed;
        if worked && at.elapsed() >= after {
            crate::device::trim_heap();
            self.heap_trimmed = (Instant::now(), false);
        }
    }

    /// Counts a step's work toward the next heap trim, trimming when one is due.
    fn worked(&mut self) {
        self.heap_trimmed.1 = true;
        self.trim_heap(HEAP_TRIM_EVERY);
    }

    /// One batch step; its events go to the outbox.
    fn step(&mut self, batch: &mut BatchGenerator<'_>, queue: &mut Queue) {
        self.steps += 1;
        let faults = &self.config.fault_injection;
        if !faults.step_delay.is_zero() {
            std::thread::sleep(faults.step_delay);
        }
        if faults.panic_at_step == Some(self.steps) {
            panic!("fault injected at step {}", self.steps);
        }
        match batch.step() {
            Ok(events) => {
                for event in events {
                    match event {
                        BatchEvent::Admitted {
                            request,
                            prompt_cache,
                        } => {
                            let job = self.jobs.get(&request).expect("event of a running request");
                            queue.send(job, EngineEvent::Admitted { prompt_cache });
                        }
                        BatchEvent::Token { request, event } => {
                            let job = self.jobs.get(&request).expect("event of a running request");
                            let message = EngineEvent::Token {
                                id: event.id,
                                text: event.text,
                                logprobs: event.logprobs,
                            };
                            queue.send(job, message);
                        }
                        BatchEvent::Finished { request, output } => {
                            let job = self
                                .jobs
                                .remove(&request)
                                .expect("finished request was running");
                            queue.end(&job, finished_event(*output));
                        }
                        BatchEvent::Refused { request, error } => {
                            let job = self
                                .jobs
                                .remove(&request)
                                .expect("refused request was queued");
                            queue.end(&job, EngineEvent::failed(error.to_request_error()));
                        }
                    }
                }
            }
            Err(err) => {
                // An MLX failure mid-step leaves the batch's caches unusable: fail its requests,
                // every one the batch held (a request being admitted when the step failed is in
                // neither its running nor its waiting list, but still has a job).
                let error = err.to_request_error();
                batch.clear();
                for (_, job) in self.jobs.drain() {
                    queue.finish(
                        &job,
                        FinishReason::Error,
                        GenerationStats::default(),
                        Some(error.clone()),
                    );
                }
            }
        }
    }
}

/// The end of a request that ran to its end (stopped, cut or cancelled).
pub(super) fn finished_event(output: crate::GenerateOutput) -> EngineEvent {
    EngineEvent::Finished {
        finish_reason: output.finish_reason,
        stats: output.stats,
        error: None,
        stop_string: output.stop_string,
        next_token_logprobs: output.next_token_logprobs,
    }
}

/// A generated token's event for its stream.
pub(super) fn token_message(event: &TokenEvent) -> EngineEvent {
    EngineEvent::Token {
        id: event.id,
        text: event.text.clone(),
        logprobs: event.logprobs.clone(),
    }
}

/// The token ids of a prompt given as tokens or as a chat.
pub(super) fn tokens_of(prompt: &Prompt, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    match prompt {
        Prompt::Tokens(ids) => Ok(ids.clone()),
        Prompt::Chat(messages) => tokenizer.encode_chat(messages),
        Prompt::AfterCache { cache_file, .. } => Err(EngineError::PromptCache {
            path: cache_file.clone(),
            message: "only token ids or a chat can be saved as a prompt cache".into(),
        }),
    }
}

pub(super) enum Command {
    Submit {
        id: RequestId,
        request: Box<EngineRequest>,
        events: Sender<EngineEvent>,
    },
    PromptCache(PromptCacheJob),
    Cancel(RequestId),
    ClearCache(Sender<()>),
    Shutdown,
}

/// How stale the published stats may get while requests only stream tokens.
pub const STATS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);

/// Engine threads alive in this process: loading or holding a model.
pub(super) static LIVE_ENGINES: AtomicUsize = AtomicUsize::new(0);

/// How many engine threads are alive in this process (each loads or holds one model): what
/// shows two models resident at once.
pub fn live_engines() -> usize {
    LIVE_ENGINES.load(Ordering::Acquire)
}

/// Counts an engine thread from its start to its end (panics included).
pub(super) struct LiveEngine;

impl LiveEngine {
    pub(super) fn start() -> Self {
        LIVE_ENGINES.fetch_add(1, Ordering::AcqRel);
        LiveEngine
    }
}

impl Drop for LiveEngine {
    fn drop(&mut self) {
        LIVE_ENGINES.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A prompt-cache file to write or read, answered with the number of tokens it holds.
pub(super) enum PromptCacheJob {
    Save {
        prompt: Prompt,
        path: PathBuf,
        reply: Sender<Result<usize>>,
    },
    Load {
        path: PathBuf,
        reply: Sender<Result<usize>>,
    },
}

impl PromptCacheJob {
    /// Answers the job with `error` (the model it needed could not be loaded).
    fn fail(self, error: &EngineError) {
        let (path, reply) = match self {
            PromptCacheJob::Save { path, reply, .. } | PromptCacheJob::Load { path, reply } => {
                (path, reply)
            }
        };
        let _ = reply.send(Err(EngineError::PromptCache {
            path,
            message: format!("the model could not be loaded again: {error}"),
        }));
    }
}
