//! The batch engine over a model divided between ranks ([`crate::distributed`]): every rank
//! holds its part of the model and a batch of its own ([`BatchGenerator`]); rank 0's engine
//! thread takes the requests and runs its batch as on one machine, and every call it makes on
//! that batch (a request inserted or removed, a step, a warm-up pass, news of memory) first goes
//! to the other ranks, which make the same call on theirs ([`follow`]). A batch's choices
//! depend only on the calls made on it and the time they carry (rank 0's, [`BatchCall`] by
//! [`BatchCall`]), so every rank admits, prefills, decodes and evicts alike, runs the same
//! passes and meets the same collectives; each samples from the same logits (the collectives
//! give every rank the same sums) with the same keys (rank 0 gives every request a seed), so
//! each reads the same tokens. SGLang's tensor-parallel schedulers work the same way (each
//! rank's scheduler fed the requests rank 0 received); vLLM sends its scheduler's output to
//! workers that hold no scheduler instead.
//!
//! A call travels as rank 0's bytes ([`Group::broadcast_bytes_gathering`]) together with every
//! rank's memory reading ([`RankMemory`]: rank 0 admits within the least room of any rank) and
//! its digest of its batch before the call ([`BatchGenerator::digest`]): a rank whose
//! batch no longer matches rank 0's is an error on every rank at the next call, never a hang in
//! mismatched collectives; so is a rank that is gone (MLX's error). After either, rank 0's
//! requests end with the error and every later call fails alike; the other ranks return it.
//!
//! Tensor-parallel decode steps are compiled as on one process where the configuration says so
//! (every rank gets rank 0's), the ranks' sums traced into the step; pipeline stages step
//! uncompiled. Speculative decoding runs as on one process: every rank holds the whole draft
//! model (it is not divided) and proposes alike, and prompt lookup's choice between verify and
//! plain steps learns rank 0's step times on every rank ([`StepTiming`], sent with each step),
//! not each rank's own clock. Images travel with their request ([`SentImage`]: its pixel
//! values), and every rank's vision tower (whole on every rank) encodes them alike. What a
//! divided batch does not run yet (refused with a sentence): the requests that run beside the
//! batch. Prompt caches on disk are a file a rank: saving and reading one are calls every rank
//! makes on its own part, the ranks agreeing on the outcome ([`agree`]).
//!
//! Every rank must run its collectives in one order. A stage's own arrays (its layers' KV,
//! which a batch's block copies evaluate) depend on the hand-over only on the stages after the
//! first, so each pipeline pass evaluates its hand-over and gather as it is built (the
//! decoder's forward), and tensor-parallel steps put their sums inside the pass's own graph.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use std::path::PathBuf;

use super::{BatchConfig, BatchGenerator, StepTiming};
use crate::distributed::{note_progress, stall_limit, Group, Watchdog, GATHERED_WORDS};
use crate::error::{EngineError, Result};
use crate::memory::{Available, MemoryBound, PressureGuard};
use crate::models::Model;
use crate::{GenerateRequest, RequestId, Tokenizer};

/// A call rank 0 made on its batch, for the other ranks to make on theirs.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum BatchCall {
    /// A fresh batch with this configuration (once, at start: a divided engine stops after a
    /// panic), drafting with `draft_tokens` a row when rank 0's batch has a draft model.
    Fresh {
        config: BatchConfig,
        model_id: String,
        stage: Stage,
        draft_tokens: Option<usize>,
    },
    /// [`BatchGenerator::insert`], the request's seed set, with its images (which a request
    /// does not serialize).
    Insert(Box<GenerateRequest>, Vec<SentImage>),
    /// [`BatchGenerator::insert_after_cache_file`], as `Insert`: each rank reads its own part
    /// of the file.
    InsertAfterCache {
        request: Box<GenerateRequest>,
        images: Vec<SentImage>,
        path: PathBuf,
        model_id: String,
    },
    /// [`BatchGenerator::save_prefix`]: each rank writes its own part of the file, all under
    /// rank 0's `save_id`.
    SavePrefix {
        tokens: Vec<u32>,
        prefill_step_size: usize,
        path: PathBuf,
        model_id: String,
        save_id: u64,
    },
    /// [`BatchGenerator::import_prefix_file`].
    ImportPrefix {
        path: PathBuf,
        model_id: String,
    },
    Remove(RequestId),
    Clear,
    /// [`BatchGenerator::step`], with what rank 0's step before taught its choice between
    /// verify and plain steps.
    Step(Option<StepTiming>),
    WarmUp,
    QueueIdleWarmUp,
    WarmUpIdle,
    HoldAdmissions(bool),
    MemoryHeadroom(Option<Available>),
    MemoryCapacity(Option<u64>),
    ResetPrefixCache,
    /// Nothing to make: its gather brings every rank's memory read just now, for a waiting
    /// request about to be judged ([`BatchGenerator::refresh_rank_memory`]).
    ReadMemory,
    /// Nothing to make: rank 0 is idle, and tells the other ranks it is still there (their
    /// [`Watchdog`]s count the group stalled after [`stall_limit`] without a call;
    /// [`alive_interval`]).
    Alive,
    /// Rank 0's engine stops: the others return.
    Stop,
}

/// What a rank's part of the model makes its batch choose by, as rank 0 sends it with a fresh
/// batch: the KV bytes a position of a row takes over its layers (admission weighs growth in
/// them; a pipeline stage holds fewer layers than the model). How another stage's own bytes
/// scale against rank 0's is settled at load ([`join_ranks`]).
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub(crate) struct Stage {
    pub(crate) row_bytes_per_position: usize,
}

/// The most bytes a call may take as sent (a request's images are most of it): a larger one
/// is refused before anything is exchanged.
const MAX_CALL_BYTES: usize = 1 << 30;

/// An image of a request as rank 0 sends it: its pixel values' float32 bytes (little-endian,
/// base64) and shape; every rank's vision tower encodes it alike.
#[derive(Serialize, Deserialize)]
pub(crate) struct SentImage {
    shape: [usize; 3],
    pixels: String,
}

impl std::fmt::Debug for SentImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SentImage({:?})", self.shape)
    }
}

impl SentImage {
    pub(crate) fn new(image: &crate::image_processor::ImageInput) -> Self {
        use base64::Engine as _;
        let bytes: Vec<u8> = image
            .pixels()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        Self {
            shape: image.shape(),
            pixels: base64::engine::general_purpose::STANDARD.encode(bytes),
        }
    }

    /// The image again, checked as any image is ([`ImageInput::new`](crate::ImageInput::new)).
    fn into_image(self) -> Result<crate::image_processor::ImageInput> {
        use base64::Engine as _;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(self.pixels)
            .map_err(|e| {
                EngineError::Distributed(format!("rank 0 sent an image this rank cannot read: {e}"))
            })?;
        let pixels = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        crate::image_processor::ImageInput::new(pixels, self.shape)
    }
}

/// A call as sent: rank 0's time of it, in microseconds since its lockstep began.
#[derive(Serialize)]
struct Sent<'a> {
    call: &'a BatchCall,
    at_us: u64,
}

#[derive(Deserialize)]
struct Received {
    call: BatchCall,
    at_us: u64,
}

/// A rank's memory as its [`PressureGuard`] last read it, sent to rank 0 with every call
/// ([`Lockstep::receive`]): every rank holds its part of every sequence's KV, so rank 0 admits
/// within the least headroom of any rank and holds admissions while any rank is under
/// pressure, as it does for its own memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RankMemory {
    /// What the rank may still take before it is under pressure.
    pub(crate) headroom: Available,
    /// What the rank had above its floor once its part loaded.
    pub(crate) capacity: u64,
    /// Under its floor now.
    pub(crate) low: bool,
}

impl RankMemory {
    /// The guard's last reading (the guard reads again when that is older than its interval);
    /// under the floor at a fresh reading, freed memory is given back first, as rank 0 does.
    fn read(guard: &mut PressureGuard) -> Self {
        let (low, fresh) = guard.low();
        if low && fresh {
            crate::device::release_freed_memory();
        }
        Self {
            headroom: guard.headroom(),
            capacity: guard.capacity(),
            low,
        }
    }

    /// This reading in rank 0's bytes ([`in_rank_0_bytes`]).
    fn in_rank_0_bytes(mut self, scale: (usize, usize)) -> Self {
        self.headroom.bytes = in_rank_0_bytes(self.headroom.bytes, scale);
        self.capacity = in_rank_0_bytes(self.capacity, scale);
        self
    }

    /// The gathered words after the digest: headroom bytes, capacity, then flags (bit 0: a
    /// reading is there, bit 1: low, bits 8–15: what bounds the headroom, bits 32–63: the
    /// rank of [`MemoryBound::Rank`]). All zeros: no reading (CUDA, which no guard reads).
    fn words(memory: Option<Self>) -> [u64; GATHERED_WORDS - 1] {
        let Some(memory) = memory else {
            return [0; GATHERED_WORDS - 1];
        };
        let (bound, rank) = match memory.headroom.bound {
            MemoryBound::System => (0, 0),
            MemoryBound::Cgroup => (1, 0),
            MemoryBound::Pressure => (2, 0),
            MemoryBound::Rank(rank) => (3, u64::from(rank)),
        };
        let flags = 1 | (u64::from(memory.low) << 1) | (bound << 8) | (rank << 32);
        [memory.headroom.bytes, memory.capacity, flags]
    }

    /// What [`RankMemory::words`] wrote (`None` for no reading).
    fn from_words(words: &[u64]) -> Option<Self> {
        let [bytes, capacity, flags] = words else {
            return None;
        };
        if flags & 1 == 0 {
            return None;
        }
        let bound = match (flags >> 8) & 0xff {
            1 => MemoryBound::Cgroup,
            2 => MemoryBound::Pressure,
            3 => MemoryBound::Rank((flags >> 32) as u32),
            _ => MemoryBound::System,
        };
        Some(Self {
            headroom: Available {
                bytes: *bytes,
                bound,
            },
            capacity: *capacity,
            low: flags & 2 != 0,
        })
    }
}

/// `bytes` of a rank holding `own` cache layers, as rank 0's `rank_0` layers would hold them
/// (`scale = (own, rank_0)`): a pipeline stage's KV grows with its layers.
pub(crate) fn in_rank_0_bytes(bytes: u64, (own, rank_0): (usize, usize)) -> u64 {
    let scaled = bytes as u128 * rank_0.max(1) as u128 / own.max(1) as u128;
    scaled.min(u64::MAX as u128) as u64
}

/// [`Lockstep::least_memory`] of readings by rank.
fn least_of(memory: &[Option<RankMemory>]) -> Option<RankMemory> {
    let (rank, least) = memory
        .iter()
        .enumerate()
        .filter_map(|(rank, m)| Some((rank, (*m)?)))
        .min_by_key(|(_, m)| m.headroom.bytes)?;
    let readings = || memory.iter().flatten();
    Some(RankMemory {
        headroom: Available {
            bytes: least.headroom.bytes,
            bound: MemoryBound::Rank(rank as u32),
        },
        capacity: readings().map(|m| m.capacity).min()?,
        low: readings().any(|m| m.low),
    })
}

/// How often an idle rank 0 tells the other ranks it is there ([`BatchCall::Alive`]): a
/// quarter of [`stall_limit`], from 0.25 s to 10 s.
pub(crate) fn alive_interval() -> Duration {
    (stall_limit() / 4).clamp(Duration::from_millis(250), Duration::from_secs(10))
}

/// One rank's end of the calls: its group, when its calls' times count from, and whether the
/// group already failed.
pub(crate) struct Lockstep<'g> {
    group: &'g Group,
    epoch: Instant,
    /// Calls so far (errors name the one that failed).
    calls: u64,
    /// Why the group stopped, once it did.
    stopped: Option<String>,
    /// Rank 0: the other ranks' memory as their last call's gather carried it (by rank; none
    /// for rank 0 itself, and for a rank that reads none).
    memory: Vec<Option<RankMemory>>,
    watchdog: Watchdog,
}

impl<'g> Lockstep<'g> {
    pub(crate) fn new(group: &'g Group) -> Self {
        Self {
            group,
            epoch: Instant::now(),
            calls: 0,
            stopped: None,
            memory: Vec::new(),
            watchdog: Watchdog::start(group.rank(), stall_limit()),
        }
    }

    /// Rank 0: the other ranks' memory as their last calls' gathers carried it: the least
    /// headroom of any (bounded by [`MemoryBound::Rank`], naming that rank), the least capacity
    /// of any, low when any is; `None` while no rank reads its memory.
    pub(crate) fn least_memory(&self) -> Option<RankMemory> {
        least_of(&self.memory)
    }

    /// Rank 0: sends `call`, with every rank's `digest` of its batch gathered and compared.
    /// Returns the call's time.
    pub(crate) fn lead(&mut self, call: &BatchCall, digest: u64) -> Result<Instant> {
        if let Some(why) = &self.stopped {
            return Err(EngineError::Distributed(why.clone()));
        }
        // In whole microseconds, as the other ranks read it.
        let at_us = Instant::now().duration_since(self.epoch).as_micros() as u64;
        let at = self.epoch + Duration::from_micros(at_us);
        let sent = Sent { call, at_us };
        let bytes = serde_json::to_vec(&sent).map_err(|e| {
            EngineError::Distributed(format!("a call could not be sent to the other ranks: {e}"))
        })?;
        // Refused before anything is exchanged: the call is not made, and the group goes on.
        if bytes.len() > MAX_CALL_BYTES {
            return Err(EngineError::Request(format!(
                "this request is too large to send to the other ranks ({} MiB with its images; \
                 at most {} MiB)",
                bytes.len() >> 20,
                MAX_CALL_BYTES >> 20
            )));
        }
        let fresh = matches!(call, BatchCall::Fresh { .. });
        let exchanged = self
            .group
            .broadcast_bytes_gathering(Some(&bytes), with_digest(digest, None))
            .and_then(|(_, words)| {
                self.memory = words
                    .iter()
                    .enumerate()
                    .map(|(rank, w)| (rank > 0).then(|| RankMemory::from_words(&w[1..]))?)
                    .collect();
                self.compare(&words, fresh)
            });
        match exchanged {
            Ok(()) => {
                note_progress();
                Ok(at)
            }
            Err(e) => Err(self.stop(&e)),
        }
    }

    /// Why the group stopped, once it did (the sentence every later call fails with).
    pub(crate) fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    /// Marks the group stopped by `error` (no call goes out after it); returns the error every
    /// later call gets.
    pub(crate) fn stop(&mut self, error: &EngineError) -> EngineError {
        // A stopped group makes no more calls, and none is awaited: nothing left to watch.
        self.watchdog.disarm();
        let why = self.stopped.get_or_insert_with(|| {
            format!("the ranks dividing the model stopped working together ({error}); restart them")
        });
        EngineError::Distributed(why.clone())
    }

    /// A rank other than 0: the next call rank 0 makes, and its time on this rank's clock,
    /// with every rank's `digest` of its batch gathered and compared, and this rank's `memory`
    /// sent to rank 0.
    pub(crate) fn receive(
        &mut self,
        digest: u64,
        memory: Option<RankMemory>,
    ) -> Result<(BatchCall, Instant)> {
        let (bytes, words) = self
            .group
            .broadcast_bytes_gathering(None, with_digest(digest, memory))?;
        let received: Received = serde_json::from_slice(&bytes).map_err(|e| {
            EngineError::Distributed(format!("rank 0 sent a call this rank cannot read: {e}"))
        })?;
        self.compare(&words, matches!(received.call, BatchCall::Fresh { .. }))?;
        note_progress();
        Ok((
            received.call,
            self.epoch + Duration::from_micros(received.at_us),
        ))
    }

    /// Counts a call; errors when some rank's digest of its batch before it (each rank's first
    /// word) differs from rank 0's (but for a fresh batch, which every rank makes anew).
    fn compare(&mut self, words: &[[u64; GATHERED_WORDS]], fresh: bool) -> Result<()> {
        self.calls += 1;
        match words.iter().position(|w| w[0] != words[0][0]) {
            Some(rank) if !fresh => Err(EngineError::Distributed(format!(
                "rank {rank}'s batch differs from rank 0's before call {}: the ranks no longer \
                 run the same passes",
                self.calls
            ))),
            _ => Ok(()),
        }
    }
}

/// A rank's words for a call's gather: its batch's digest, then its memory.
fn with_digest(digest: u64, memory: Option<RankMemory>) -> [u64; GATHERED_WORDS] {
    let mut words = [0; GATHERED_WORDS];
    words[0] = digest;
    words[1..].copy_from_slice(&RankMemory::words(memory));
    words
}

/// The least memory any rank of `group` can take now, each rank passing `mine` (its
/// [`crate::memory::available_for`]; `None` where its backend's memory is not judged, CUDA):
/// every rank holds its part of every sequence's KV, so a divided model's KV budget must fit
/// the rank with the least room, not rank 0's. `stage_scale`: this rank's cache layers against
/// rank 0's (`(1, 1)` unless divided into stages). A pipeline stage holds its own layers' KV,
/// so its room counts in rank 0's bytes: the KV budget is in rank 0's. Every rank calls it
/// once, after loading its part and before the batch's first call. Evaluates one gather;
/// errors when a rank is gone.
pub fn least_available(
    group: &Group,
    mine: Option<Available>,
    stage_scale: (usize, usize),
) -> Result<Option<Available>> {
    /// Each rank's answer as JSON, padded with spaces to one length.
    const WIDTH: usize = 128;
    let mine = mine.map(|mut mine| {
        mine.bytes = in_rank_0_bytes(mine.bytes, stage_scale);
        mine
    });
    let mut bytes = serde_json::to_vec(&mine).map_err(|e| {
        EngineError::Distributed(format!("this rank's memory could not be sent: {e}"))
    })?;
    if bytes.len() > WIDTH {
        return Err(EngineError::Distributed(
            "this rank's memory does not fit its message".into(),
        ));
    }
    bytes.resize(WIDTH, b' ');
    let mut least: Option<Available> = None;
    for (rank, theirs) in group.all_gather_bytes(&bytes)?.iter().enumerate() {
        let theirs: Option<Available> = serde_json::from_slice(theirs).map_err(|e| {
            EngineError::Distributed(format!(
                "rank {rank} sent memory this rank cannot read: {e}"
            ))
        })?;
        if let Some(mut theirs) = theirs {
            if least.is_none_or(|l| theirs.bytes < l.bytes) {
                if rank != group.rank() {
                    theirs.bound = MemoryBound::Rank(rank as u32);
                }
                least = Some(theirs);
            }
        }
    }
    Ok(least)
}

/// What the ranks of a divided model settle at load ([`join_ranks`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Joined {
    /// The least room of any rank, in rank 0's bytes ([`least_available`]).
    pub(crate) available: Option<Available>,
    /// `(own, rank 0's)` cache layers: a pipeline stage weighs its own bytes against rank 0's
    /// scaled by them (`(1, 1)` unless divided into stages).
    pub(crate) stage_scale: (usize, usize),
}

/// Every load-time collective of a divided model, on every rank at the same point of its load
/// (rank 0's engine thread once its draft is loaded, [`follow`] before it follows): the ranks'
/// parts checked against each other ([`check_division`]), their drafts ([`check_draft`]) and
/// their room ([`least_available`]). `prepared`: how this rank's own preparation went (rank 0:
/// its KV quantization checked and its draft loaded; another rank: its draft loaded). A rank
/// that failed it still joins, so that every rank fails at once, the others naming it, rather
/// than waiting in a gather.
pub(crate) fn join_ranks(
    model: &dyn Model,
    draft: Option<&dyn Model>,
    prepared: Result<()>,
    available: Option<Available>,
) -> Result<Joined> {
    let division = model.division().ok_or_else(|| {
        EngineError::Distributed("only the ranks of a divided model join each other".into())
    })?;
    // Still loading as far as the others know (a rank may load its draft meanwhile): each
    // waits for the slowest within the load limit.
    let _meeting =
        Watchdog::waiting_while_loading(division.rank(), crate::distributed::load_limit());
    let stage_scale = check_division(model, division, prepared)?;
    check_draft(division.group(), model, draft)?;
    let available = least_available(division.group(), available, stage_scale)?;
    Ok(Joined {
        available,
        stage_scale,
    })
}

/// Rank `r > 0` of a model divided over ranks, while rank 0 serves it ([`crate::EngineHandle`]
/// over the same division): makes every call rank 0's batch makes, on a batch of its own over
/// `model` (this rank's part), until rank 0's engine stops (`Ok`) or the group fails (the
/// error: a rank gone, or batches that no longer match). Runs on the calling thread, which
/// then owns the batch's arrays. `draft`: the draft model, whole, when rank 0 serves with one
/// (the same files: every rank proposes alike), or why it could not be loaded (every rank then
/// fails at load, the others naming this one); rank 0's batch drafting when this rank has none
/// is an error on every rank.
///
/// Where its memory is judged (CPU and Metal, as on rank 0), this rank reads it as rank 0's
/// engine reads its own ([`PressureGuard`]) and sends each reading with its next call's
/// gather: rank 0 admits within the least headroom of any rank.
pub fn follow(
    model: &dyn Model,
    draft: Result<Option<&dyn Model>>,
    tokenizer: &Tokenizer,
) -> Result<()> {
    let available = crate::memory::available_for(crate::device::Backend::current());
    follow_reading(
        model,
        draft,
        tokenizer,
        available,
        available.map(|a| PressureGuard::new(a.bytes)),
    )
}

/// [`follow`] with this rank's memory read by `read` instead (tests of what rank 0 does with
/// another rank's memory).
pub fn follow_reading_memory(
    model: &dyn Model,
    tokenizer: &Tokenizer,
    read: fn() -> Available,
) -> Result<()> {
    follow_reading(
        model,
        Ok(None),
        tokenizer,
        Some(read()),
        Some(PressureGuard::reading(read)),
    )
}

fn follow_reading<'m>(
    model: &'m dyn Model,
    draft: Result<Option<&'m dyn Model>>,
    tokenizer: &'m Tokenizer,
    available: Option<Available>,
    mut guard: Option<PressureGuard>,
) -> Result<()> {
    let division = model.division().filter(|d| d.rank() > 0).ok_or_else(|| {
        EngineError::Distributed(
            "only a rank other than 0 of a divided model follows rank 0's batch".into(),
        )
    })?;
    // Rank 0 budgets the batch's KV within the least room of any rank.
    let (draft, prepared) = match draft {
        Ok(draft) => (draft, Ok(())),
        Err(err) => (None, Err(err)),
    };
    let joined = join_ranks(model, draft, prepared, available)?;
    let mut lockstep = Lockstep::new(division.group());
    let mut batch: Option<BatchGenerator<'_>> = None;
    loop {
        if let Some(batch) = &mut batch {
            batch.wait_for_work_in_flight()?;
        }
        let digest = batch.as_ref().map_or(0, BatchGenerator::digest);
        // A request waits to be judged at the next reading (rank 0 reads its own again):
        // this rank's goes with this call's gather fresh too.
        if let (Some(guard), Some(batch)) = (&mut guard, &batch) {
            if batch.awaits_memory_reading() {
                guard.read_again();
            }
        }
        // In rank 0's bytes: a pipeline stage's KV grows with its own layers.
        let memory = guard
            .as_mut()
            .map(|guard| RankMemory::read(guard).in_rank_0_bytes(joined.stage_scale));
        let (call, at) = lockstep.receive(digest, memory)?;
        match call {
            BatchCall::Fresh {
                config,
                model_id,
                stage,
                draft_tokens,
            } => {
                let mut fresh = BatchGenerator::new(model, tokenizer, config, &model_id);
                fresh.follow_stage(stage, joined.stage_scale);
                // Every rank's draft was checked alike at load (`check_draft`).
                if let (Some(k), Some(draft)) = (draft_tokens, draft) {
                    fresh = fresh.with_draft(draft, k);
                }
                if fresh.drafts() != draft_tokens.is_some() {
                    return Err(EngineError::Distributed(
                        "this rank's batch drafts otherwise than rank 0's: give every rank the \
                         same --draft-model"
                            .into(),
                    ));
                }
                batch = Some(fresh);
            }
            BatchCall::Stop => return Ok(()),
            call => {
                let batch = batch.as_mut().ok_or_else(|| {
                    EngineError::Distributed(format!(
                        "rank 0 sent {call:?} before making its batch"
                    ))
                })?;
                batch.set_group_time(at);
                apply(batch, call)?;
            }
        }
    }
}

/// Refuses what the batch does not run over ranks: pipeline stages that hold a model's
/// sliding-window or linear-attention layers in other proportions than rank 0's. Every stage's
/// batch makes rank 0's choices with its own bytes (its blocks' parts kept and dropped, its
/// pool charge, its sliding layers' windows), which it weighs scaled by its layers against
/// rank 0's (the scale returned, `(own, rank 0's)` cache layers; `(1, 1)` unless divided into
/// stages; `BlockStore::set_budget_scale`): exact only when each kind of layer scales alike, as
/// when each stage holds whole runs of the layers' pattern (`PipelineParallel::layers` splits
/// so where every stage gets one). Also refuses on every rank when one failed to prepare
/// (`prepared`, this rank's: its own error). A collective ([`join_ranks`]).
fn check_division(
    model: &dyn Model,
    division: &crate::distributed::Division,
    prepared: Result<()>,
) -> Result<(usize, usize)> {
    let caches = model.make_cache(None);
    let counts = [
        u64::from(prepared.is_ok()),
        caches.len() as u64,
        caches.iter().filter(|c| c.window().is_some()).count() as u64,
        caches.iter().filter(|c| c.is_recurrent()).count() as u64,
    ];
    let gathered = division.group().all_gather_words(counts)?;
    prepared?;
    if let Some(rank) = gathered.iter().position(|c| c[0] == 0) {
        return Err(EngineError::Distributed(format!(
            "rank {rank} could not prepare its part of the model (its own error is in its output)"
        )));
    }
    if !matches!(division, crate::distributed::Division::Pipeline(_)) {
        return Ok((1, 1));
    }
    let gathered: Vec<[u64; 3]> = gathered.iter().map(|c| [c[1], c[2], c[3]]).collect();
    let first = gathered[0];
    let alike = |c: &[u64; 3]| (1..3).all(|k| c[k] * first[0] == first[k] * c[0]);
    if gathered.iter().all(alike) {
        return Ok((counts[1] as usize, first[0] as usize));
    }
    let held = gathered
        .iter()
        .enumerate()
        .map(|(rank, [layers, sliding, linear])| {
            format!(
                "rank {rank}: {sliding} sliding-window and {linear} linear-attention of {layers}"
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    Err(EngineError::Distributed(format!(
        "the pipeline stages hold this model's kinds of layers in different proportions \
         ({held}): the batch engine runs stages that hold the kinds in one proportion, as \
         stages of whole runs of the layers' pattern do (at least one run a stage, the layers \
         a whole number of runs); divide it with --distributed tensor, or over fewer ranks"
    )))
}

/// Refuses a draft model that is not every rank's alike: each rank sends whether it holds one,
/// whether its batch drafts with it, and a fingerprint of its shape ([`crate::ModelInfo`]), and
/// every rank refuses alike when they differ (a batch drafting on one rank and not on another
/// would meet other collectives). A collective ([`join_ranks`]).
fn check_draft(group: &Group, model: &dyn Model, draft: Option<&dyn Model>) -> Result<()> {
    use std::hash::{Hash, Hasher};
    let words = match draft {
        Some(draft) => {
            let mut hasher = std::hash::DefaultHasher::new();
            format!("{:?}", draft.info()).hash(&mut hasher);
            [
                1,
                u64::from(super::drafts_in_batch(model, draft)),
                hasher.finish(),
            ]
        }
        None => [0; 3],
    };
    let gathered = group.all_gather_words(words)?;
    if gathered.iter().all(|theirs| *theirs == gathered[0]) {
        return Ok(());
    }
    let held = gathered
        .iter()
        .enumerate()
        .map(|(rank, w)| match w[0] {
            0 => format!("rank {rank} none"),
            _ => format!("rank {rank} one"),
        })
        .collect::<Vec<_>>()
        .join(", ");
    Err(EngineError::Distributed(format!(
        "the ranks hold different draft models ({held}, or drafts of other shapes): give every \
         rank the same --draft-model"
    )))
}

/// `mine`, this rank's outcome of something every rank of `group` did alike on its own part
/// (read or wrote its part of a prompt cache) with a fingerprint of what it read (the parts of
/// one file must match), once every rank knows every rank's: this rank's error, else one naming
/// a rank that failed and why, else one when the fingerprints differ, else `mine`. A
/// collective: every rank calls it at the same point of the same call.
pub(crate) fn agree<T>(group: &Group, mine: Result<(T, u64)>) -> Result<T> {
    /// A rank's message: success, fingerprint, then its error's text (cut to fit).
    const WIDTH: usize = 512;
    let mut bytes = vec![b' '; WIDTH];
    match &mine {
        Ok((_, fingerprint)) => {
            bytes[0] = 1;
            bytes[1..9].copy_from_slice(&fingerprint.to_le_bytes());
        }
        Err(err) => {
            let text = err.to_string();
            let mut end = text.len().min(WIDTH - 9);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            bytes[0] = 0;
            bytes[9..9 + end].copy_from_slice(&text.as_bytes()[..end]);
        }
    }
    let gathered = group.all_gather_bytes(&bytes)?;
    let (mine, fingerprint) = mine?;
    if let Some((rank, theirs)) = gathered.iter().enumerate().find(|(_, t)| t[0] == 0) {
        return Err(EngineError::Distributed(format!(
            "rank {rank} could not read or write its part of the prompt cache: {}",
            String::from_utf8_lossy(&theirs[9..]).trim_end()
        )));
    }
    if gathered
        .iter()
        .any(|t| t[1..9] != fingerprint.to_le_bytes())
    {
        return Err(EngineError::Distributed(
            "the ranks' parts of the prompt cache are not of one save (a part left from an \
             earlier save beside a later one's): save it again"
                .into(),
        ));
    }
    Ok(mine)
}

/// A request as rank 0 sent it (`BatchGenerator::to_send`), its images put back.
fn received(request: Box<GenerateRequest>, images: Vec<SentImage>) -> Result<GenerateRequest> {
    let mut request = *request;
    request.images = images
        .into_iter()
        .map(SentImage::into_image)
        .collect::<Result<_>>()?;
    Ok(request)
}

/// Makes `call` on a follower's batch. What it returns is rank 0's to report (the same there):
/// a request refused and a step's events are dropped here. A failed pass is the error: rank 0
/// stops the group on its own failed passes (`BatchGenerator::stop_group_on`), so this rank
/// cannot count on another call (after a rank is gone, MLX's ring backend may never answer a
/// later collective).
fn apply(batch: &mut BatchGenerator<'_>, call: BatchCall) -> Result<()> {
    match call {
        BatchCall::Insert(request, images) => {
            let _ = batch.insert(received(request, images)?);
        }
        // Every rank's part read or written, and the ranks agreed (`agree`, which tells rank 0
        // this rank's error): refused alike.
        BatchCall::InsertAfterCache {
            request,
            images,
            path,
            model_id,
        } => {
            let _ = batch.insert_after_cache_file(received(request, images)?, &path, &model_id);
        }
        BatchCall::SavePrefix {
            tokens,
            prefill_step_size,
            path,
            model_id,
            save_id,
        } => {
            // A failed pass is this rank's error; a file not written, agreed.
            let _ = batch.save_prefix_as(&tokens, prefill_step_size, &path, &model_id, save_id)?;
        }
        BatchCall::ImportPrefix { path, model_id } => {
            let _ = batch.import_prefix_file(&path, &model_id);
        }
        BatchCall::Remove(id) => {
            let _ = batch.remove(id);
        }
        BatchCall::Clear => {
            batch.clear();
        }
        BatchCall::Step(timing) => batch.step_following(timing)?,
        BatchCall::WarmUp => {
            batch.warm_up()?;
        }
        BatchCall::QueueIdleWarmUp => batch.queue_idle_warm_up(),
        BatchCall::WarmUpIdle => batch.warm_up_idle()?,
        BatchCall::HoldAdmissions(held) => batch.hold_admissions(held),
        BatchCall::MemoryHeadroom(headroom) => batch.set_memory_headroom(headroom),
        BatchCall::MemoryCapacity(capacity) => batch.set_memory_capacity(capacity),
        BatchCall::ResetPrefixCache => batch.reset_prefix_cache(),
        BatchCall::ReadMemory | BatchCall::Alive => {}
        BatchCall::Fresh { .. } | BatchCall::Stop => unreachable!("handled by `follow`"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_s_memory_travels_in_its_words() {
        let memory = |bytes, bound, low| RankMemory {
            headroom: Available { bytes, bound },
            capacity: 7 << 30,
            low,
        };
        for sent in [
            memory(0, MemoryBound::System, true),
            memory(u64::MAX, MemoryBound::Cgroup, false),
            memory(5 << 20, MemoryBound::Pressure, true),
            memory(1, MemoryBound::Rank(u32::MAX), false),
        ] {
            assert_eq!(
                RankMemory::from_words(&RankMemory::words(Some(sent))),
                Some(sent)
            );
        }
        assert_eq!(RankMemory::from_words(&RankMemory::words(None)), None);
    }

    /// The least headroom names its rank; the least capacity and any rank's low count apart
    /// from it, and ranks that read nothing are passed over.
    #[test]
    fn the_least_memory_counts_each_reading_apart() {
        let memory = |bytes, capacity, low| {
            Some(RankMemory {
                headroom: Available {
                    bytes,
                    bound: MemoryBound::System,
                },
                capacity,
                low,
            })
        };
        let least = least_of(&[
            None,
            memory(5 << 30, 6 << 30, true),
            memory(3 << 30, 9 << 30, false),
            None,
        ])
        .unwrap();
        assert_eq!(
            least,
            RankMemory {
                headroom: Available {
                    bytes: 3 << 30,
                    bound: MemoryBound::Rank(2),
                },
                capacity: 6 << 30,
                low: true,
            }
        );
        assert_eq!(least_of(&[None, None]), None);
    }
}
