//! [`EngineHandle`]: what clients hold; it sends commands to the engine thread and reads the
//! stats the thread publishes.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use super::config::*;
use super::thread::*;
use crate::api::EngineEvent;
use crate::api::EngineLimits;
use crate::api::EngineRequest;
use crate::api::EngineStats;
use crate::api::GenerateRequest;
use crate::api::Prompt;
use crate::attention::KvQuantization;
use crate::error::{EngineError, Result};
use crate::models;
use crate::models::Model;
use crate::nn::weights::LoadProgress;
use crate::text::tokenizer::Tokenizer;
use perch_sched::kv_cache_manager::RequestId;

/// A cloneable, thread-safe handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    next_id: Arc<AtomicU64>,
    /// Cancels are also recorded here so the running request sees them between tokens, while
    /// the engine thread is busy generating and not reading commands.
    cancelled: Arc<Mutex<HashSet<RequestId>>>,
    /// The engine thread and its command channel; the thread is joined by
    /// [`EngineHandle::shutdown`] or when the last handle goes.
    thread: Arc<EngineThreadGuard>,
    tokenizer: Arc<Tokenizer>,
    limits: EngineLimits,
    /// Published by the engine thread after every step.
    stats: Arc<Mutex<EngineStats>>,
    /// Requests submitted and not finished; bounded by `max_requests`.
    outstanding: Arc<AtomicUsize>,
    max_requests: usize,
    /// Whether a draft model is loaded ([`EngineConfig::draft_model`]).
    draft_model: bool,
}

/// A submitted request: its id (for `cancel`) and its event stream.
pub struct RequestStream {
    pub id: RequestId,
    pub events: Receiver<EngineEvent>,
}

impl EngineHandle {
    /// Starts the engine thread and loads the model in `model_dir` there (MLX arrays belong to
    /// the thread that creates them). Returns once the model is loaded and the engine is ready
    /// (its KV pool made and its stats published; on GPUs after the warm-up, which compiles the
    /// decode shapes), or the load's error.
    pub fn load(model_dir: &Path, config: EngineConfig) -> Result<Self> {
        Self::load_with_progress(model_dir, config, |_| {})
    }

    /// [`EngineHandle::load`], calling `progress` (on the engine thread) as the weights are read.
    pub fn load_with_progress(
        model_dir: &Path,
        config: EngineConfig,
        mut progress: impl FnMut(LoadProgress) + Send + 'static,
    ) -> Result<Self> {
        let dir = model_dir.to_path_buf();
        let model_id = Self::model_id(&dir);
        Self::spawn_with(config, model_id, move |report| {
            let mut both = |p: LoadProgress| {
                progress(p);
                report(p);
            };
            let model = models::load_with_progress(&dir, &mut both)?;
            let tokenizer = Self::tokenizer_for(&dir, model.as_ref())?;
            Ok((model, tokenizer))
        })
    }

    /// The tokenizer of the model in `dir` as [`EngineHandle::load`] gives it to `model` (loaded
    /// from `dir`, whole or a rank's part): with the image processor of its vision tower, when
    /// it has one, so that chats with images are encoded for it.
    pub fn tokenizer_for(dir: &Path, model: &dyn Model) -> Result<Tokenizer> {
        let mut tokenizer = Tokenizer::load(dir)?;
        if let Some(images) = image_processor(dir, model) {
            tokenizer.set_image_processor(images);
        }
        Ok(tokenizer)
    }

    /// What [`EngineHandle::load`] passes [`EngineHandle::spawn_with`] as `model_id` for the model
    /// in `dir`: the prefix cache lives in this engine only, so the directory identifies the model.
    pub fn model_id(dir: &Path) -> String {
        dir.canonicalize()
            .unwrap_or_else(|_| dir.to_path_buf())
            .display()
            .to_string()
    }

    /// Starts the engine thread with whatever `load` returns, called on that thread (again
    /// after an idle unload, see [`crate::KeepAlive`], with a progress sink the engine
    /// publishes; the tokenizer it returns then is not used); `model_id` seeds the prefix
    /// cache's block hashes.
    pub fn spawn_with(
        config: EngineConfig,
        model_id: String,
        mut load: impl FnMut(&mut dyn FnMut(LoadProgress)) -> Result<(Box<dyn Model>, Tokenizer)>
            + Send
            + 'static,
    ) -> Result<Self> {
        let (commands, inbox) = mpsc::channel();
        let cancelled = Arc::new(Mutex::new(HashSet::new()));
        let stats = Arc::new(Mutex::new(EngineStats::default()));
        let outstanding = Arc::new(AtomicUsize::new(0));
        let max_requests = config
            .max_running
            .saturating_add(config.max_queued_requests);
        let draft_model = config.draft_model.is_some();
        let queue = Queue {
            inbox,
            submitted: Vec::new(),
            prompt_cache_jobs: Vec::new(),
            cancelled: Arc::clone(&cancelled),
            finished_requests: 0,
            shutting_down: false,
            outbox: Vec::new(),
            stats: Arc::clone(&stats),
            published_at: Instant::now(),
            outstanding: Arc::clone(&outstanding),
            solo: HashSet::new(),
            keep_alive: config.keep_alive,
            default_keep_alive: config.keep_alive,
        };
        let (loaded_tx, loaded_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("perch-engine".into())
            .spawn(move || {
                let _live = LiveEngine::start();
                let mut config = config;
                match load(&mut |_| {}).and_then(|loaded| {
                    // Rank 0 of a divided model serves; the others follow its batch.
                    let division = loaded.0.division().filter(|d| d.size() > 1);
                    if let Some(division) = division.filter(|d| d.rank() != 0) {
                        return Err(EngineError::Distributed(format!(
                            "rank {} of the group follows rank 0's batch \
                             (`perch_engine::engine::follow`): it serves no requests",
                            division.rank()
                        )));
                    }
                    let mut draft = None;
                    let prepared = (|| -> Result<()> {
                        // The quantization must fit every layer's head size.
                        if let Some(q) = config.kv_quantization {
                            let info = loaded.0.info();
                            for layer in loaded.0.make_cache(None) {
                                let [_, head_dim] =
                                    layer.head_shape().unwrap_or([0, info.head_dim as i32]);
                                KvQuantization::new(q.bits, q.group_size, head_dim)?;
                            }
                        }
                        if let Some(dir) = &config.draft_model {
                            draft = Some(load_draft(dir, loaded.0.as_ref(), &loaded.1)?);
                        }
                        Ok(())
                    })();
                    // On CPU and Metal the KV cache takes the memory the model was just
                    // loaded into: its budget leaves room for what it really takes. (On
                    // CUDA it is the GPU's memory, not judged.)
                    let available = crate::memory::available_for(crate::device::Backend::current());
                    // A divided model's budget fits the rank with the least room; a rank
                    // that failed to prepare fails every rank.
                    let available = match division {
                        Some(_) => {
                            crate::engine::batch::lockstep::join_ranks(
                                loaded.0.as_ref(),
                                draft.as_ref().map(|(m, _)| m.as_ref()),
                                prepared,
                                available,
                            )?
                            .available
                        }
                        None => prepared.map(|()| available)?,
                    };
                    Ok((loaded, draft, available))
                }) {
                    Ok(((model, tokenizer), draft, available)) => {
                        let tokenizer = Arc::new(tokenizer);
                        let mut memory = MemoryAtLoad::default();
                        if let Some(available) = available {
                            memory.available = Some(available.bytes);
                            memory.lowered = crate::memory::LoweredBudget::of(
                                config.kv_cache_bytes,
                                available.bytes,
                            );
                            config.kv_cache_bytes = crate::memory::kv_budget_within(
                                config.kv_cache_bytes,
                                available.bytes,
                            );
                            let _ =
                                mlx_rs::memory::set_cache_limit(crate::memory::cache_limit_within(
                                    available.bytes,
                                    config.kv_cache_bytes,
                                ));
                        }
                        let pool = pool_config(
                            model.as_ref(),
                            draft.as_ref().map(|(m, _)| m.as_ref()),
                            &config,
                        );
                        let limits = EngineLimits {
                            context_length: model.info().context_length,
                            kv_cache_tokens: perch_sched::kv_cache_manager::max_sequence_tokens(
                                pool.num_blocks,
                                pool.block_size,
                                crate::engine::batch::kv_budget_for_model(
                                    model.as_ref(),
                                    config.kv_quantization,
                                    0,
                                )
                                .window_cost(),
                            ),
                            kv_cache_bytes: config.kv_cache_bytes,
                        };
                        let ready = {
                            let tokenizer = Arc::clone(&tokenizer);
                            move || {
                                let _ = loaded_tx.send(Ok((tokenizer, limits)));
                            }
                        };
                        let draft_dir = config.draft_model.clone();
                        let loader: Loader = Box::new(move |report| {
                            let (model, tokenizer) = load(report)?;
                            let draft = match &draft_dir {
                                Some(dir) => Some(load_draft(dir, model.as_ref(), &tokenizer)?),
                                None => None,
                            };
                            Ok(Loaded { model, draft })
                        });
                        EngineThread {
                            loaded: Loaded { model, draft },
                            loader,
                            memory,
                            tokenizer,
                            model_id,
                            queue,
                            config,
                        }
                        .run(ready);
                        // The model and every array are gone; no kernel may outlive the
                        // thread (see `EngineThreadGuard`).
                        let _ = crate::nn::mlx_ext::synchronize();
                    }
                    Err(err) => {
                        // As after serving: every array gone before the error is told.
                        let _ = crate::nn::mlx_ext::synchronize();
                        let _ = loaded_tx.send(Err(err));
                    }
                }
            })
            .map_err(|e| EngineError::Io {
                path: "engine thread".into(),
                source: e,
            })?;
        let (tokenizer, limits) = loaded_rx.recv().map_err(|_| EngineError::EngineStopped)??;
        Ok(Self {
            thread: Arc::new(EngineThreadGuard {
                commands,
                thread: Mutex::new(Some(thread)),
            }),
            tokenizer,
            limits,
            next_id: Arc::new(AtomicU64::new(1)),
            cancelled,
            stats,
            outstanding,
            max_requests,
            draft_model,
        })
    }

    /// The loaded model's tokenizer and chat template, shared with the engine thread: clients
    /// count and render tokens with it (token strings for log-probabilities, a completion's text
    /// prompt, token counting) without a round trip through the engine.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Whether a draft model is loaded, for requests with
    /// [`GenerateRequest::num_draft_tokens`].
    pub fn has_draft_model(&self) -> bool {
        self.draft_model
    }

    /// The model's context and the KV pool's size in tokens.
    pub fn limits(&self) -> EngineLimits {
        self.limits
    }

    /// Queues a request; never waits for the engine. A [`Prompt::Chat`] is rendered here, on
    /// the caller's thread. Errors in the request itself (a chat template that fails, an empty
    /// or too long prompt, bad sampling parameters) arrive as a `Finished` event with reason
    /// `Error` and a [`crate::api::RequestError`] of their kind. Errors: [`EngineError::Busy`] when `max_running +
    /// max_queued_requests` requests are already in the engine, [`EngineError::EngineStopped`].
    pub fn submit(&self, mut request: EngineRequest) -> Result<RequestStream, EngineError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, receiver) = mpsc::channel();
        let stream = RequestStream {
            id,
            events: receiver,
        };
        if let Prompt::Chat(messages) = &request.prompt {
            match self.tokenizer.encode_chat_with_images(messages, None) {
                Ok((tokens, images)) => {
                    request.prompt = Prompt::Tokens(tokens);
                    request.params.images = images;
                }
                Err(err) => {
                    let _ = events.send(EngineEvent::failed(err.to_refusal()));
                    return Ok(stream);
                }
            }
        }
        let limit = self.max_requests;
        self.outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .map_err(|_| EngineError::Busy { limit })?;
        self.thread
            .commands
            .send(Command::Submit {
                id,
                request: Box::new(request),
                events,
            })
            .map_err(|_| {
                self.outstanding.fetch_sub(1, Ordering::AcqRel);
                EngineError::EngineStopped
            })?;
        Ok(stream)
    }

    /// Stops a request: a waiting one never starts, a running one ends before its next token.
    /// Either way its stream ends with `Finished { finish_reason: Cancelled }`.
    pub fn cancel(&self, id: RequestId) {
        if let Ok(mut set) = self.cancelled.lock() {
            set.insert(id);
        }
        let _ = self.thread.commands.send(Command::Cancel(id));
    }

    /// The log-probabilities of every vocabulary token for the position after `token_ids`:
    /// `[vocab]` floats, `log_softmax` of the model's last logits in float32 (genlm's
    /// `next_token_logprobs`). Concurrent calls run batched (see
    /// [`EngineConfig::logprobs_batch_size`]), and a call whose tokens extend an earlier call's
    /// reads the earlier tokens' KV from the prefix cache, its last partial block included, so
    /// scoring a sequence that grows a token at a time computes about one token per call.
    /// Blocks until answered. Errors: the engine's refusal (an empty prompt, one longer than the
    /// context, an id outside the vocabulary) as [`EngineError::Request`], MLX failures.
    pub fn next_token_logprobs(&self, token_ids: Vec<u32>) -> Result<Vec<f32>> {
        let stream = self.submit(Self::scoring_request(token_ids))?;
        Self::scoring_answer(stream)
    }

    /// [`EngineHandle::next_token_logprobs`] for many prompts at once (all submitted before any
    /// is awaited, so they share steps); answers in order.
    pub fn batch_next_token_logprobs(&self, prompts: Vec<Vec<u32>>) -> Result<Vec<Vec<f32>>> {
        let streams = prompts
            .into_iter()
            .map(|ids| self.submit(Self::scoring_request(ids)))
            .collect::<Result<Vec<_>, _>>()?;
        streams.into_iter().map(Self::scoring_answer).collect()
    }

    /// The request behind a next-token-logprobs call: `token_ids`, nothing generated.
    pub fn scoring_request(token_ids: Vec<u32>) -> EngineRequest {
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = 1;
        params.next_token_logprobs = true;
        EngineRequest {
            prompt: Prompt::Tokens(token_ids),
            params,
        }
    }

    fn scoring_answer(stream: RequestStream) -> Result<Vec<f32>> {
        for event in stream.events {
            if let EngineEvent::Finished {
                next_token_logprobs,
                error,
                ..
            } = event
            {
                return match (next_token_logprobs, error) {
                    (Some(logprobs), _) => Ok(logprobs),
                    (None, error) => Err(EngineError::Request(
                        error.map_or_else(|| "the call was cancelled".into(), |e| e.message),
                    )),
                };
            }
        }
        Err(EngineError::EngineStopped)
    }

    /// Empties the prefix cache (every cached block not in use, and the partial blocks kept
    /// for extension), as genlm's `clear_cache`, and the image processor's recent images.
    /// Answered between steps.
    pub fn clear_cache(&self) -> Result<()> {
        if let Some(processor) = self.tokenizer.image_processor() {
            processor.forget_recent();
        }
        let (tx, rx) = mpsc::channel();
        self.thread
            .commands
            .send(Command::ClearCache(tx))
            .map_err(|_| EngineError::EngineStopped)?;
        rx.recv().map_err(|_| EngineError::EngineStopped)
    }

    /// Queue lengths, throughput, KV blocks and MLX memory as of the engine's last step (or
    /// its last command while idle); never waits for a step. Errors:
    /// [`EngineError::EngineStopped`] once the engine thread has ended.
    pub fn stats(&self) -> Result<EngineStats, EngineError> {
        if self
            .thread
            .thread
            .lock()
            .map_or(true, |t| t.as_ref().is_none_or(|t| t.is_finished()))
        {
            return Err(EngineError::EngineStopped);
        }
        self.stats
            .lock()
            .map(|s| s.clone())
            .map_err(|_| EngineError::EngineStopped)
    }

    /// Computes the KV state of `prompt` (from the prefix cache where it can) and writes it to
    /// `path` (`.safetensors`) in mlx_lm's prompt-cache layout; returns the tokens saved. Its
    /// full blocks also join this engine's prefix cache. Errors: the prompt's (tokenizing, chat
    /// template), MLX's, and [`EngineError::PromptCache`] when the file cannot be written. A
    /// model divided over ranks writes a file a rank, each its part of the KV (rank `r`'s at
    /// [`crate::prompt_cache::rank_path`] on its host), and fails when any rank could not.
    pub fn save_prompt_cache(&self, prompt: Prompt, path: &Path) -> Result<usize> {
        let prompt = match prompt {
            Prompt::Chat(messages) => Prompt::Tokens(self.tokenizer.encode_chat(&messages)?),
            other => other,
        };
        let (reply, answer) = mpsc::channel();
        self.prompt_cache_job(
            PromptCacheJob::Save {
                prompt,
                path: path.to_path_buf(),
                reply,
            },
            answer,
        )
    }

    /// Reads a prompt-cache file written by Perch into the prefix cache, so requests starting
    /// with its tokens skip their prefill; returns the tokens now cached (whole blocks, as many
    /// as the pool has free). Errors: [`EngineError::PromptCache`] for a damaged file, another
    /// model's, or one without token ids (mlx_lm's; use [`Prompt::AfterCache`]). A model divided
    /// over ranks reads each rank's part on its rank, and fails when any rank cannot.
    pub fn load_prompt_cache(&self, path: &Path) -> Result<usize> {
        let (reply, answer) = mpsc::channel();
        self.prompt_cache_job(
            PromptCacheJob::Load {
                path: path.to_path_buf(),
                reply,
            },
            answer,
        )
    }

    fn prompt_cache_job(
        &self,
        job: PromptCacheJob,
        answer: Receiver<Result<usize>>,
    ) -> Result<usize> {
        self.thread
            .commands
            .send(Command::PromptCache(job))
            .map_err(|_| EngineError::EngineStopped)?;
        answer.recv().map_err(|_| EngineError::EngineStopped)?
    }

    /// Stops the thread after the running request's current token and waits for it; waiting
    /// requests finish as cancelled.
    pub fn shutdown(&self) {
        self.thread.shut_down();
    }
}

/// Owns the engine thread for all of an engine's handles: the last handle dropped stops the
/// thread and waits for it, as [`EngineHandle::shutdown`] does. A process that returns from
/// `main` (after an error, say) must not exit while the engine thread still runs MLX work: on
/// CUDA, the driver's teardown then fails the thread's next stream call and the process aborts
/// ("driver shutting down", exit 134).
pub(super) struct EngineThreadGuard {
    pub(super) commands: Sender<Command>,
    pub(super) thread: Mutex<Option<JoinHandle<()>>>,
}

impl EngineThreadGuard {
    fn shut_down(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        // Never from the engine thread itself (it would wait for itself).
        if let Some(thread) = thread.filter(|t| t.thread().id() != std::thread::current().id()) {
            let _ = thread.join();
        }
    }
}

impl Drop for EngineThreadGuard {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// The image processor of a vision-language model in `dir` (`Err`: why it takes no images), or
/// `None` for a text model.
fn image_processor(
    dir: &Path,
    model: &dyn Model,
) -> Option<std::result::Result<crate::image_processor::ImageProcessor, String>> {
    if let Some(why) = model.vision_unavailable() {
        return Some(Err(why.to_string()));
    }
    let tower = model.vision()?;
    use crate::image_processor::{ImageProcessor, Resize};
    let processor = match tower.resize() {
        Resize::Square { side, tokens } => ImageProcessor::load(dir, side, tokens),
        Resize::Smart { factor, .. } => ImageProcessor::load_qwen(dir, factor),
        Resize::Aspect {
            patch,
            pool,
            max_tokens,
        } => ImageProcessor::load_gemma4(dir, patch, pool, max_tokens),
    };
    Some(processor.map_err(|e| e.to_string()))
}
