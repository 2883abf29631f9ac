//! The KV cache of a whole batch, slot-major: per layer, one set of buffers
//! `[rows, kv_heads, capacity, last]` (the same float or quantized parts as [`KvCache`], see
//! `cache.rs`) in which row `r` holds the sequence in slot `r`, its first `len(r)` positions
//! filled. A step writes every row's new keys and values at that row's own positions (one
//! `put_along_axis` per buffer) and attends over the whole buffer with a causal mask offset by
//! each row's length: one attention call per layer for the whole batch, where [`KvCache`] needs
//! one per sequence. The batch engine keeps two: one for decode steps (a token per row) and one
//! for prefill steps (a prompt chunk per row).
//!
//! A leaving sequence leaves a free slot (a hole) that the next sequence to enter takes; nothing
//! moves. Moving a row would rewrite every layer's buffers while the decode step in flight still
//! reads them, and MLX then copies each whole buffer instead of updating it in place (at 128 rows
//! that doubled the peak memory in the steps where sequences finished).
//! Rows are compacted only when the occupied slots fit a row bucket half as large (one gather
//! into the smaller buffers). Both `rows` and `capacity` are bucketed ([`row_bucket`], [`capacity_bucket`]) so that a run
//! meets few distinct shapes: MLX's CUDA backend caches a graph per shape and thrashes (then
//! fails) past a few hundred. Padding rows and free slots compute garbage that nobody reads; their
//! position is 0, so their mask is never empty and softmax never divides by zero.
//!
//! Memory is `rows * capacity` positions per layer, where capacity follows the longest sequence:
//! like mlx_lm's `BatchKVCache`, a batch of mixed lengths pads the short ones.
//!
//! # Sliding-window layers: rings
//! A sliding layer's queries see their last `window` positions only, so its buffers stop
//! growing at `R` positions (mlx_lm's `RotatingKVCache` bound): position `p` of a row lives in
//! entry `p mod R`, overwriting position `p - R`. A query at position `q` reads entry `e` as
//! the latest position written there, `q - ((q - e) mod R)`, masked when that is negative (not
//! written yet, or a stale row's) or `window` or more before `q`. With `R >= window + T - 1`
//! for a step of `T` tokens per row, the entries a step overwrites with later positions read as
//! positions `R` back, out of every query's window, and nothing a query of the step sees is
//! overwritten; while the capacity is below `R` no position wraps and the rings read as the
//! linear buffers do. `R` adds a block's worth of positions for publishing: a block's
//! positions are copied to the prefix cache before they are overwritten (the batch publishes
//! sliding models' blocks as they fill). So a long conversation on a sliding-window model takes
//! `R` positions per row in its sliding layers, whatever its length; global layers keep all.
//!
//! # Bounded rows: `max_kv_size`
//! A sequence whose request bounds its KV cache (mlx_lm's `--max-kv-size`, a
//! `RotatingKVCache(max_size, keep)` per attention layer, see [`KvLimit`]) holds, in the
//! layers that keep every position, its first `keep` positions in entries `0..keep` and the
//! later ones in a ring of `W = max_size - keep - 1 + T` entries after them (`T` the widest step
//! this cache takes): position `p >= keep` lives in entry `keep + (p - keep) mod W`. Its mask
//! gives each query what mlx_lm's rotating cache gives it ([`KvLimit::held_before`]): the kept
//! positions and the most recent ones, `max_size - 1` before a step, each query seeing the
//! `max_size` entries up to its own in that list's order. A step's `T` writes overwrite only
//! positions older than that list. Other rows of the same buffers keep every position; sliding
//! layers keep their own rings and recurrent layers their states.
//!
//! # Quantized rows: `kv_bits`
//! A sequence whose request quantizes its KV cache (mlx_lm's `--kv-bits` from
//! `--quantized-kv-start`: a `QuantizedKVCache` once a forward pass leaves the cache holding that
//! many positions, [`RowQuantization`]) keeps a row of the float buffers like any other, but once
//! quantized, what it holds and writes is the affine quantization's round trip
//! (`dequantize(quantize(x))` per head vector, in groups), the values mlx_lm's quantized
//! attention multiplies with: when a step leaves the row at its start or more, the row's entries
//! in every layer that keeps positions are replaced by their round trip, and later steps write
//! round-tripped keys and values ([`SlotStep`]'s quantized rows). Attention reads it as any row,
//! so its outputs are the quantized cache's while its memory is a full-precision row's; the
//! memory a quantized cache saves comes from a quantized cache (`SlotKvCache::new` with a
//! quantization: every row's parts packed), which such rows do not join. Decode steps with
//! quantized rows run uncompiled (the round trip's settings are not among a trace's inputs).
//!
//! # Linear-attention layers: recurrent states
//! A Gated DeltaNet layer (hybrid models) keeps no positions: its buffers are the recurrent state
//! of every row, the convolution's last inputs `[rows, kernel - 1, channels]` and the
//! recurrence's `[rows, value_heads, value_dim, key_dim]` (float32), as mlx_lm's `ArraysCache`
//! holds them for a batch. A step replaces them with the states after each row's real tokens
//! ([`SlotStep::real_tokens`]: a prompt chunk's padding leaves a row's state as it was). A
//! sequence entering a slot brings its state (or zeros); nothing reads a free row's.
//!
//! A state cannot go back, so a step that may be rewound (speculative decoding's verify step,
//! [`SlotKvCache::record_replay`]) keeps what each recurrent layer needs to compute its state
//! again after fewer of the step's tokens ([`StateReplay`]: the state before the step and the
//! layer's inputs to its recurrence). [`SlotKvCache::rewind_rows`] then recomputes every
//! recurrent layer's state once for all rows, each after the tokens it keeps (lazy: the next
//! step's evaluation computes it). The record lives until then or until the next step begins.

use std::cell::{OnceCell, RefCell};

use mlx_rs::{ops, Array, Dtype};
use serde::Serialize;

use crate::attention::{additive_mask, masked_attention, AttentionSpec, SlotRead};
use crate::attention::{CachedKv, KvQuantization};
use crate::device::Backend;
use crate::error::Result;
use crate::kv::cache::{kv_parts, quantize_round_trip, KvCache, KvLimit, RecurrentState};
use crate::nn::mlx_ext::{slice, slice_update};
use perch_sched::shapes::{capacity_bucket, row_bucket};

/// What a request asks of its own KV cache, carried by its row of the slot caches: nothing, a
/// bound (`max_kv_size`, see the module docs) or a quantization from some position on
/// (`kv_bits`); never both, as mlx_lm's rotating cache is not quantized.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RowKv {
    /// Every position kept, in the cache's format.
    #[default]
    Plain,
    Bounded(KvLimit),
    Quantized(RowQuantization),
}

/// A row quantized from `start` positions on (mlx_lm's `kv_bits` with `quantized_kv_start`; see
/// the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowQuantization {
    pub quantization: KvQuantization,
    pub start: usize,
}

impl RowQuantization {
    /// The row length from which the row is quantized: after a forward pass that left it at
    /// `start` positions or more (mlx_lm quantizes after each model call, so a first pass
    /// always computes in full precision).
    pub fn from_len(&self) -> usize {
        self.start.max(1)
    }
}

impl RowKv {
    /// Whether the row holds a plain cache's KV (what the prefix cache can share).
    pub fn is_plain(&self) -> bool {
        *self == Self::Plain
    }

    /// The bound of a bounded row.
    pub fn limit(&self) -> Option<KvLimit> {
        match self {
            Self::Bounded(limit) => Some(*limit),
            _ => None,
        }
    }

    /// The quantization a row of `len` positions reads and writes with
    /// ([`RowQuantization::from_len`]).
    pub fn quantized_at(&self, len: usize) -> Option<KvQuantization> {
        match self {
            Self::Quantized(q) if len >= q.from_len() => Some(q.quantization),
            _ => None,
        }
    }
}

/// How a step's attention reads the slot cache's dense keys and values, with the mask of each
/// row's length.
///
/// MLX 0.32's CUDA backend has no fused kernel for one query per row with an array mask (its
/// vector kernel and cuDNN's decode path refuse such masks) and falls back to an unfused
/// attention, about three times as slow at 128 rows of 512 positions as the explicit form
/// ([`crate::attention::explicit_scaled_dot_product_attention`]); the fused kernel without a
/// mask, which rows of different lengths cannot use, is faster still. The explicit form
/// launches more kernels, so it pays off only where the device, not the host launching them,
/// bounds the step: from about 128 rows of 512 positions
/// ([`SlotAttention::EXPLICIT_FROM_POSITIONS`]). Below that threshold, CUDA decode steps read
/// through Perch's own fused kernel for masked single queries
/// ([`crate::attention::decode_kernel`], [`SlotRead::decode_kernel`]), not MLX's unfused
/// fallback, up to 8,192 positions; at 128 rows it equals the explicit read, which stays.
/// Prompt chunks (more than one query per row) reach cuDNN with their mask and stay fused.
/// cuDNN builds a plan for each new shape on its first call in a process (tens of
/// milliseconds); reading small prompt steps explicitly, cheaper on a first call but slower
/// after, did not shorten the first token, so what keeps new shapes away is a burst prefilled
/// in one pass ([`crate::EngineConfig::arrival_window`]). Metal's vector kernel takes masks, so
/// Metal and the CPU read fused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotAttention {
    /// The backend decides per step: explicit on CUDA for steps of fewer than 4 queries per row
    /// (where MLX needs its vector kernel) over at least
    /// [`SlotAttention::EXPLICIT_FROM_POSITIONS`] positions in all, fused otherwise; CUDA's
    /// prompt chunks pass the mask as an additive one ([`SlotRead::additive_mask`]).
    #[default]
    Auto,
    /// MLX's fused `scaled_dot_product_attention` with the boolean mask (on CUDA, a decode step
    /// up to 8,192 positions reads through [`crate::attention::decode_kernel`] instead).
    Fused,
    /// Scores by matmul, mask, precise softmax, matmul.
    Explicit,
}

impl SlotAttention {
    /// Rows times capacity from which [`SlotAttention::Auto`] reads a CUDA decode step
    /// explicitly: 128 rows of 512 positions, where the explicit read is faster (at 64 rows of
    /// 512 the fused one is: the step is bound by the host, see above).
    pub const EXPLICIT_FROM_POSITIONS: usize = 128 * 512;
}

/// The per-step inputs every layer shares, for a step of `tokens` tokens per row: positions
/// `[rows]` int32 (RoPE's offsets: where each row's first new token goes, plus the row's RoPE
/// shift), the attention mask
/// `[rows, 1, tokens, capacity]` bool, and how attention reads the buffers.
pub struct SlotStep {
    pub positions: Array,
    pub mask: Array,
    pub read: SlotRead,
    /// `[rows, 1, tokens, 1]` int32: each query's position.
    index: Array,
    /// `[rows, 1, tokens, 1]` int32: the entries the layers that keep every position write: the
    /// positions, or a bounded row's ring entries (see the module docs).
    write: Array,
    /// The sliding layers' ring entries and mask, when the cache has rings.
    ring: Option<RingStep>,
    /// Which of a step's tokens are real, when the cache has recurrent layers and the step is
    /// wider than one token or an occupied row feeds nothing (padding must not advance a row's
    /// states); `None`: every token is.
    real: Option<RealTokens>,
    /// The quantized rows' settings, each with `[rows, 1, 1, 1]` bool marking its rows: their
    /// new keys and values are written round-tripped (see the module docs). Empty when no row
    /// is quantized.
    quantized: Vec<(KvQuantization, Array)>,
    /// The sliding layers' mask, made by the first sliding layer for all of them.
    window_mask: OnceCell<Array>,
    /// The step's mask and the sliding layers' made additive in the activations' dtype, when
    /// the step reads with additive masks ([`SlotRead::additive_mask`]): made once each.
    additive: [OnceCell<Array>; 2],
    /// `write` and the rings' entries broadcast to the shapes of the buffers they write
    /// (`(ring, shape)`): made once a step for every layer, not once a buffer and layer.
    write_indices: RefCell<Vec<(bool, Vec<i32>, Array)>>,
}

/// The array in `cell`, made by `make` the first time.
fn once(cell: &OnceCell<Array>, make: impl FnOnce() -> Result<Array>) -> Result<&Array> {
    if let Some(array) = cell.get() {
        return Ok(array);
    }
    let array = make()?;
    Ok(cell.get_or_init(|| array))
}

/// The flat indices of [`SlotKvCache::copy_ranges`]'s gathers, made once for every layer part
/// of the same entries and buffer shape: the parts of a layer (keys and values) and the layers
/// of one kind (full, sliding) publish the same positions. Each index is a host array, which on
/// CUDA costs MLX 0.32 a synchronous copy whenever the cached buffer it reuses was the device's
/// (`CudaAllocator::malloc_async` moves it to unified memory): made per layer part, they were
/// most of a publishing's host time. Lives for one `ranges` (a publishing copy).
#[derive(Default)]
pub struct CopyIndices {
    made: Vec<MadeIndex>,
}

/// One of [`CopyIndices`]' indices: its `(row, entry)` pairs, the buffers' `(heads, capacity)`,
/// the index.
type MadeIndex = (Vec<(i32, i32)>, (i32, i32), Array);

impl CopyIndices {
    /// The index of `entries` (`(row, entry)` pairs) in buffers of `heads` heads and
    /// `capacity` entries flattened to `[rows * heads * capacity, last]`: entry `e` of row `r`
    /// and head `h` at `(r * heads + h) * capacity + e`, heads outermost (`[heads * n]`).
    fn get(&mut self, entries: &[(i32, i32)], heads: i32, capacity: i32) -> Array {
        let shape = (heads, capacity);
        if let Some((_, _, index)) = self
            .made
            .iter()
            .find(|(e, s, _)| *s == shape && e.as_slice() == entries)
        {
            return index.clone();
        }
        let flat: Vec<i32> = (0..heads)
            .flat_map(|h| {
                entries
                    .iter()
                    .map(move |&(row, e)| (row * heads + h) * capacity + e)
            })
            .collect();
        let index = Array::from_slice(&flat, &[heads * entries.len() as i32]);
        self.made.push((entries.to_vec(), shape, index.clone()));
        index
    }
}

/// The real (not padding) tokens of a step's rows: row `r`'s first `counts[r]` tokens.
pub struct RealTokens {
    /// `[rows]` int32.
    pub counts: Array,
    /// `[rows, tokens]` bool: token `t` of row `r` is real.
    pub mask: Array,
}

/// A recurrent layer's state computed again after fewer of a recorded step's tokens (see the
/// module docs): the layer's part of [`SlotKvCache::record_replay`], which it hands to
/// [`crate::kv::LayerCaches::keep_replay`].
pub trait StateReplay: Send {
    /// The layer's state `[rows, ..]` after each row's first `real.counts[r]` tokens of the
    /// recorded step, from the state before it.
    fn replay(&self, real: &RealTokens) -> Result<RecurrentState>;
}

/// What a recorded step keeps until its rows are rewound ([`SlotKvCache::record_replay`]).
struct StepReplay {
    /// Per cache layer: a recurrent layer's replay once the step ran it.
    layers: Vec<Option<Box<dyn StateReplay>>>,
    /// Per slot: the step's real tokens, once it ended.
    counts: Option<Vec<usize>>,
    /// Tokens per row of the step.
    tokens: usize,
}

/// A step's view of the sliding layers' rings (see the module docs).
struct RingStep {
    /// `[rows, 1, tokens, 1]` int32: the entries the step writes, `position mod R`.
    index: Array,
    /// `[rows, 1, tokens, R]` bool: the entries each query sees.
    mask: Array,
}

impl SlotStep {
    /// The entries a buffer of `shape` `[rows, heads, tokens, features]` is written at: the
    /// rings' (`ring`) or `write`, broadcast to `shape`, once a step for each.
    fn write_index(&self, ring: bool, shape: &[i32]) -> Result<Array> {
        let mut made = self.write_indices.borrow_mut();
        if let Some((.., index)) = made.iter().find(|(r, s, _)| *r == ring && s == shape) {
            return Ok(index.clone());
        }
        let index = match (&self.ring, ring) {
            (Some(rings), true) => &rings.index,
            _ => &self.write,
        };
        let index = ops::broadcast_to(index, shape)?;
        made.push((ring, shape.to_vec(), index.clone()));
        Ok(index)
    }

    /// [`SlotStep::mask`] narrowed to a sliding window of `window` positions: row `r`'s query
    /// at position `p` sees positions `p - window + 1 ..= p` (mlx_lm's
    /// `create_causal_mask(window_size=window)`). Built from the step's arrays only, so a
    /// compiled step traces it.
    pub fn window_mask(&self, window: i32) -> Result<Array> {
        let capacity = self.mask.shape()[3];
        let keys = ops::arange::<_, i32>(0, capacity, None)?.reshape(&[1, 1, 1, -1])?;
        let seen = ops::gt(&ops::add(&keys, Array::from_int(window))?, &self.index)?;
        Ok(ops::logical_and(&self.mask, &seen)?)
    }

    /// `[rows, 1, tokens, 1]` int32: each query's position (where its key is written).
    pub fn query_positions(&self) -> &Array {
        &self.index
    }

    /// The mask of the sliding layers' rings `[rows, 1, tokens, R]`, when the cache has them
    /// (what a sliding layer attends with instead of [`SlotStep::window_mask`]).
    pub fn ring_mask(&self) -> Option<&Array> {
        self.ring.as_ref().map(|r| &r.mask)
    }

    /// Which tokens of each row are real, for a step over recurrent layers with padding or a
    /// row that feeds nothing (see [`RealTokens`]); `None` when every token is.
    pub fn real_tokens(&self) -> Option<&RealTokens> {
        self.real.as_ref()
    }

    /// The step's arrays, in the order [`SlotStep::with_arrays`] takes them: positions, mask,
    /// query positions, write entries, then the rings' entries and mask when there are rings,
    /// then the real tokens' counts and mask when some row pads or feeds nothing
    /// ([`SlotStep::real_tokens`]). (Quantized rows' steps are not compiled.)
    pub(crate) fn arrays(&self) -> Vec<&Array> {
        let mut arrays = vec![&self.positions, &self.mask, &self.index, &self.write];
        if let Some(ring) = &self.ring {
            arrays.extend([&ring.index, &ring.mask]);
        }
        if let Some(real) = &self.real {
            arrays.extend([&real.counts, &real.mask]);
        }
        arrays
    }

    /// A step over `arrays` (as [`SlotStep::arrays`] lists them for a cache with sliding
    /// layers' `rings` or not: 4 to 8; a compiled step's inputs), read as `read`.
    pub(crate) fn with_arrays(arrays: Vec<Array>, read: SlotRead, rings: bool) -> Self {
        let mut arrays = arrays.into_iter();
        let mut next = || arrays.next().expect("a step's arrays");
        let (positions, mask, index, write) = (next(), next(), next(), next());
        let ring = rings.then(|| RingStep {
            index: next(),
            mask: next(),
        });
        let real = arrays.next().map(|counts| RealTokens {
            counts,
            mask: arrays.next().expect("the real tokens' mask"),
        });
        Self {
            positions,
            mask,
            read,
            index,
            write,
            ring,
            real,
            quantized: Vec::new(),
            window_mask: OnceCell::new(),
            write_indices: RefCell::default(),
            additive: Default::default(),
        }
    }

    /// `x` `[rows, kv_heads, tokens, head_dim]` with each quantized row's part replaced by its
    /// quantization's round trip (see the module docs).
    fn round_trip_quantized_rows(&self, x: &Array) -> Result<Array> {
        let mut out = x.clone();
        for (quantization, rows) in &self.quantized {
            out = ops::select(rows, &quantize_round_trip(x, *quantization)?, &out)?;
        }
        Ok(out)
    }

    /// The mask a layer reads: for a sliding layer (`window`), the rings' or, over linear
    /// buffers, [`SlotStep::window_mask`]; else the step's. Additive in `dtype` when the step
    /// reads that way ([`SlotRead::additive_mask`]). Each is made once per step.
    fn mask_for(&self, window: Option<i32>, dtype: Dtype) -> Result<&Array> {
        let additive = self.read.additive_mask;
        match window {
            None if !additive => Ok(&self.mask),
            None => once(&self.additive[0], || additive_mask(&self.mask, dtype)),
            Some(window) => {
                let sliding = once(&self.window_mask, || match &self.ring {
                    Some(ring) => Ok(ring.mask.clone()),
                    None => self.window_mask(window),
                })?;
                match additive {
                    false => Ok(sliding),
                    true => once(&self.additive[1], || additive_mask(sliding, dtype)),
                }
            }
        }
    }
}

/// The sliding-window layers of a slot cache (see the module docs).
#[derive(Clone, Debug)]
struct Rings {
    /// Per cache layer, whether it slides.
    sliding: Vec<bool>,
    window: usize,
    /// Positions a ring keeps at most (`R` once the capacity reaches it).
    positions: usize,
    /// The widest step the rings allow (`R >= window + tokens - 1`).
    max_step_tokens: usize,
}

/// Slot-major KV buffers of every layer; see the module docs.
pub struct SlotKvCache {
    quantization: Option<KvQuantization>,
    attention: SlotAttention,
    /// Prompt chunks take additive masks on every backend, not only CUDA's (tests).
    additive_masks: bool,
    num_layers: usize,
    rings: Option<Rings>,
    /// Per cache layer, whether it keeps a recurrent state instead of positions.
    recurrent: Vec<bool>,
    /// Per layer: keys' parts then values' parts (2 or 6), or a recurrent layer's state (conv,
    /// ssm); empty until written.
    layers: Vec<Vec<Array>>,
    /// Positions filled, per slot up to the last occupied one; `None` for a free slot.
    lengths: Vec<Option<usize>>,
    /// Per slot (as `lengths`), what its request asks of its KV cache (see the module docs).
    row_kv: Vec<RowKv>,
    /// Per slot (as `lengths`), what its RoPE positions add to its cache positions: a sequence
    /// whose prompt holds images under Qwen's multimodal RoPE continues at its index plus this
    /// (see [`crate::models::qwen_vision::mrope_positions`]); 0 for every other.
    rope_shift: Vec<i32>,
    /// The widest step this cache takes, in tokens per row (what a bounded row's ring adds).
    max_step_tokens: usize,
    rows: usize,
    capacity: usize,
    /// `[1, 1, 1, capacity]` int32, `0..capacity`: the key positions a one-token step's mask
    /// compares with its index, kept while the capacity stays ([`SlotKvCache::key_positions`]).
    key_positions: RefCell<Option<Array>>,
    /// `[1, 1, 1, R]` int32, `R - e` for each ring entry `e`: what a one-token step's ring mask
    /// adds to its index, kept while the ring size stays ([`SlotKvCache::ring_back`]).
    ring_back: RefCell<Option<Array>>,
    /// The last pass over these buffers dispatched and not waited for, with what followed it
    /// (the prefix cache's copies of its blocks): a one-element copy of a buffer, dispatched
    /// after them ([`SlotKvCache::mark_pass_in_flight`]).
    pass_in_flight: Option<Array>,
    /// Whether the next step records its recurrent layers' replays
    /// ([`SlotKvCache::record_replay`]).
    replay_next: bool,
    /// The last step's record, when it was recorded and not yet rewound.
    replay: Option<StepReplay>,
}

/// Why a cache with sliding layers' rings cannot go back ([`SlotKvCache::rewind_rows`]).
const RINGS_DO_NOT_KEEP: &str = "sliding-window rings do not keep what they replace";

impl SlotKvCache {
    pub fn new(num_layers: usize, quantization: Option<KvQuantization>) -> Self {
        Self {
            quantization,
            attention: SlotAttention::Auto,
            additive_masks: false,
            num_layers,
            rings: None,
            recurrent: vec![false; num_layers],
            layers: Vec::new(),
            lengths: Vec::new(),
            row_kv: Vec::new(),
            rope_shift: Vec::new(),
            max_step_tokens: 1,
            rows: 0,
            capacity: 0,
            key_positions: RefCell::default(),
            ring_back: RefCell::default(),
            pass_in_flight: None,
            replay_next: false,
            replay: None,
        }
    }

    /// An empty cache with this one's layers, quantization, attention setting and rings.
    pub fn empty_like(&self) -> Self {
        Self {
            rings: self.rings.clone(),
            recurrent: self.recurrent.clone(),
            additive_masks: self.additive_masks,
            max_step_tokens: self.max_step_tokens,
            ..Self::new(self.num_layers, self.quantization).with_attention(self.attention)
        }
    }

    /// This cache with rings for the sliding layers: `windows` has one entry per cache layer
    /// (the window of a sliding one, all alike), steps are at most `max_step_tokens` tokens per
    /// row (as [`SlotKvCache::with_max_step_tokens`]), and blocks of `block_size` positions are
    /// copied out as they fill (see the module docs). No rings when no layer slides.
    pub fn with_windows(
        mut self,
        windows: &[Option<i32>],
        max_step_tokens: usize,
        block_size: usize,
    ) -> Self {
        debug_assert_eq!(windows.len(), self.num_layers, "one entry per cache layer");
        self.max_step_tokens = max_step_tokens.max(1);
        let window = windows.iter().flatten().map(|&w| w.max(1) as usize).max();
        self.rings = window.map(|window| Rings {
            sliding: windows.iter().map(Option::is_some).collect(),
            window,
            positions: capacity_bucket(window + max_step_tokens.max(1) - 1 + block_size),
            max_step_tokens: max_step_tokens.max(1),
        });
        self
    }

    /// This cache taking steps of at most `max_step_tokens` tokens per row (1 by default): the
    /// bounded rows' rings are sized for it (see the module docs).
    pub fn with_max_step_tokens(mut self, max_step_tokens: usize) -> Self {
        self.max_step_tokens = max_step_tokens.max(1);
        self
    }

    /// This cache with recurrent states for the layers `recurrent` marks (one entry per cache
    /// layer; see the module docs).
    pub fn with_recurrent_layers(mut self, recurrent: &[bool]) -> Self {
        debug_assert_eq!(
            recurrent.len(),
            self.num_layers,
            "one entry per cache layer"
        );
        self.recurrent = recurrent.to_vec();
        self
    }

    /// Whether layer `layer` keeps a recurrent state.
    pub fn is_recurrent(&self, layer: usize) -> bool {
        self.recurrent.get(layer).copied().unwrap_or(false)
    }

    /// Whether some layer keeps a recurrent state.
    pub fn has_recurrent_layers(&self) -> bool {
        self.recurrent.contains(&true)
    }

    /// Buffers layer `layer` has once written: a recurrent state's two, or 2 (6 quantized)
    /// KV parts.
    fn parts_per_layer(&self, layer: usize) -> usize {
        match (self.is_recurrent(layer), self.quantization) {
            (true, _) | (false, None) => 2,
            (false, Some(_)) => 6,
        }
    }

    /// Positions a sliding layer's ring holds at most (`R`); `None` without rings.
    pub fn ring_positions(&self) -> Option<usize> {
        self.rings.as_ref().map(|r| r.positions)
    }

    /// The ring size of a sliding layer at capacity `capacity`: `R`, or the capacity while it is
    /// smaller (no position wraps then). `None` without rings.
    fn ring_size(&self, capacity: usize) -> Option<usize> {
        self.rings.as_ref().map(|r| r.positions.min(capacity))
    }

    /// Whether layer `layer` keeps a ring.
    fn is_ring(&self, layer: usize) -> bool {
        self.rings
            .as_ref()
            .is_some_and(|r| r.sliding.get(layer).copied().unwrap_or(false))
    }

    /// Positions layer `layer`'s buffers hold at capacity `capacity`.
    fn layer_capacity(&self, layer: usize, capacity: usize) -> usize {
        match self.ring_size(capacity) {
            Some(ring) if self.is_ring(layer) => ring,
            _ => capacity,
        }
    }

    /// Whether layer `layer` keeps every position (neither a sliding ring nor a recurrent
    /// state): the layers a bounded row bounds.
    fn is_bounded_layer(&self, layer: usize) -> bool {
        !self.is_recurrent(layer) && !self.is_ring(layer)
    }

    /// The ring a row bounded by `limit` keeps its positions from `limit.keep` on in: `W` entries
    /// (see the module docs).
    fn bounded_ring(&self, limit: KvLimit) -> usize {
        (limit.max_size - limit.keep - 1) as usize + self.max_step_tokens
    }

    /// Entries a row of `len` positions (bounded by `limit`, if any) needs for a step of
    /// `tokens` more: a bounded row's kept positions and ring in the layers that keep every
    /// position, but never less than the sliding layers' rings while the row is longer (their
    /// ring is the capacity until that reaches `R`, and must not wrap sooner).
    fn row_entries(&self, limit: Option<KvLimit>, len: usize, tokens: usize) -> usize {
        match limit {
            Some(limit) => {
                let bounded = limit.keep as usize + self.bounded_ring(limit);
                (len + tokens).min(bounded.max(self.ring_positions().unwrap_or(0)))
            }
            None => len + tokens,
        }
    }

    /// The bound of the row in `slot`, if it is bounded.
    pub fn slot_limit(&self, slot: usize) -> Option<KvLimit> {
        self.slot_kv(slot).limit()
    }

    /// What the request of the row in `slot` asks of its KV cache.
    pub fn slot_kv(&self, slot: usize) -> RowKv {
        self.row_kv.get(slot).copied().unwrap_or_default()
    }

    /// Whether an occupied row is quantized, or will be (see the module docs).
    pub fn has_quantized_rows(&self) -> bool {
        self.lengths
            .iter()
            .zip(&self.row_kv)
            .any(|(len, kv)| len.is_some() && matches!(kv, RowKv::Quantized(_)))
    }

    /// Replaces every entry of `slot`'s row, in each layer that keeps positions, by its round
    /// trip through `quantization` (a row that became quantized; see the module docs). Lazy.
    fn quantize_row(&mut self, slot: usize, quantization: KvQuantization) -> Result<()> {
        let layers: Vec<usize> = (0..self.layers.len())
            .filter(|&l| !self.is_recurrent(l))
            .collect();
        for layer in layers {
            for buffer in self.layers[layer].iter_mut() {
                let s = buffer.shape().to_vec();
                let start = [slot as i32, 0, 0, 0];
                let stop = [slot as i32 + 1, s[1], s[2], s[3]];
                let row = slice(buffer, &start, &stop)?;
                let row = quantize_round_trip(&row, quantization)?;
                *buffer = slice_update(buffer, &row, &start, &stop)?;
            }
        }
        Ok(())
    }

    /// The positions a row of `len` positions bounded by `limit` holds in layer `layer` for its
    /// next step (what it reads, [`KvLimit::held_before`]), as ranges `[start, end)`; `None`
    /// for a layer the bound does not apply to (or no bound).
    fn held_ranges(
        &self,
        layer: usize,
        limit: Option<KvLimit>,
        len: usize,
    ) -> Option<Vec<(usize, usize)>> {
        let limit = limit.filter(|_| self.is_bounded_layer(layer))?;
        let (keep_end, recent_from) = limit.held_before(len as i32);
        let ranges = [(0, keep_end as usize), (recent_from as usize, len)];
        Some(ranges.into_iter().filter(|(a, b)| a < b).collect())
    }

    /// [`SlotKvCache::runs`] of positions `range` in row `slot`, at its length and bound.
    fn slot_runs(
        &self,
        slot: usize,
        layer: usize,
        range: (usize, usize),
    ) -> Result<Vec<(usize, usize)>> {
        self.runs(layer, self.slot_limit(slot), self.slot_len(slot), range)
    }

    /// Positions `[start, end)` of layer `layer` in a slot of `len` positions bounded by `limit`
    /// (if any) as runs of buffer entries in temporal order, `(first entry, count)`: one run, or
    /// two or three where a ring wraps. Errors for positions a ring has overwritten (before
    /// `len - R` in a sliding layer; a bounded row's before its last `max_size - keep - 1`
    /// other than its kept ones).
    fn runs(
        &self,
        layer: usize,
        limit: Option<KvLimit>,
        len: usize,
        (start, end): (usize, usize),
    ) -> Result<Vec<(usize, usize)>> {
        if let Some(limit) = limit.filter(|_| self.is_bounded_layer(layer)) {
            return self.bounded_runs(limit, len, (start, end));
        }
        if !self.is_ring(layer) {
            return Ok(vec![(start, end - start)]);
        }
        let size = self.layer_capacity(layer, self.capacity);
        if start + size < len || end > len {
            return Err(mlx_rs::error::Exception::custom(format!(
                "positions {start}..{end} of a sliding layer's ring of {size} are not held \
                 (the row holds {len})"
            ))
            .into());
        }
        let first = start % size;
        let count = end - start;
        Ok(if first + count <= size {
            vec![(first, count)]
        } else {
            vec![(first, size - first), (0, count - (size - first))]
        })
    }

    /// [`SlotKvCache::runs`] for a bounded row.
    fn bounded_runs(
        &self,
        limit: KvLimit,
        len: usize,
        (start, end): (usize, usize),
    ) -> Result<Vec<(usize, usize)>> {
        let keep = limit.keep as usize;
        let size = self.bounded_ring(limit);
        // Positions no step of this cache has overwritten: the kept ones, and the most recent
        // that any later step reads.
        let recent = (limit.max_size - limit.keep - 1) as usize;
        let held_from = len.saturating_sub(recent).max(keep);
        let dropped = (keep.min(len), held_from);
        if end > len || start.max(dropped.0) < end.min(dropped.1) {
            return Err(mlx_rs::error::Exception::custom(format!(
                "positions {start}..{end} of a row bounded to {} positions are not held (the row \
                 holds its first {keep} and {held_from}..{len})",
                limit.max_size
            ))
            .into());
        }
        let mut runs = Vec::with_capacity(3);
        if start < keep {
            runs.push((start, end.min(keep) - start));
        }
        let from = start.max(keep);
        if from < end {
            let first = keep + (from - keep) % size;
            let count = end - from;
            if first + count <= keep + size {
                runs.push((first, count));
            } else {
                let before_wrap = keep + size - first;
                runs.push((first, before_wrap));
                runs.push((keep, count - before_wrap));
            }
        }
        Ok(runs)
    }

    /// This cache read as `attention` says ([`SlotAttention::Auto`] when not set).
    pub fn with_attention(mut self, attention: SlotAttention) -> Self {
        self.attention = attention;
        self
    }

    /// This cache with its fused prompt-chunk reads taking additive masks on any backend, as
    /// [`SlotAttention::Auto`] has them on CUDA ([`SlotRead::additive_mask`]): what lets a CPU
    /// run that path.
    pub fn with_additive_masks(mut self) -> Self {
        self.additive_masks = true;
        self
    }

    /// How a step of `queries_per_row` queries per row on `backend` reads this cache: as
    /// [`SlotAttention`] says, a quantized cache dequantized on CUDA (see
    /// [`crate::attention::masked_attention`]).
    pub fn read(&self, backend: Backend, queries_per_row: usize) -> SlotRead {
        let cuda = backend == Backend::Cuda;
        let explicit = match self.attention {
            SlotAttention::Auto => {
                cuda && queries_per_row < 4
                    && self.rows * self.capacity >= SlotAttention::EXPLICIT_FROM_POSITIONS
            }
            SlotAttention::Fused => false,
            SlotAttention::Explicit => true,
        };
        SlotRead {
            explicit,
            dequantize: cuda,
            additive_mask: ((cuda && self.attention == SlotAttention::Auto) || self.additive_masks)
                && !explicit
                && queries_per_row > 1,
            decode_kernel: cuda
                && queries_per_row == 1
                && !explicit
                && crate::attention::decode_kernel::enabled(),
        }
    }

    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Occupied slots.
    pub fn len(&self) -> usize {
        self.lengths.iter().flatten().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots up to the last occupied one, free ones included: the length of a step's
    /// per-slot token counts ([`SlotKvCache::end_step`]).
    pub fn slots(&self) -> usize {
        self.lengths.len()
    }

    /// Whether `slot` holds a sequence.
    pub fn is_occupied(&self, slot: usize) -> bool {
        self.lengths.get(slot).is_some_and(Option::is_some)
    }

    /// Rows of the buffers, the batch size of a decode step (occupied slots plus padding).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Positions the buffers hold per row (layers that keep every position; rings hold fewer).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions filled in `slot`.
    pub fn slot_len(&self, slot: usize) -> usize {
        self.lengths[slot].expect("an occupied slot")
    }

    /// Gives up every slot and the buffers.
    pub fn clear(&mut self) {
        self.layers.clear();
        self.lengths.clear();
        self.row_kv.clear();
        self.rope_shift.clear();
        self.rows = 0;
        self.capacity = 0;
        self.pass_in_flight = None;
    }

    /// Marks what was dispatched over the buffers so far (a pass, and the copies of its blocks
    /// after it) as the pass in flight: one element of a buffer, copied and dispatched now, so
    /// done when everything before it on the stream is. Nothing when no buffer exists.
    pub fn mark_pass_in_flight(&mut self) -> Result<()> {
        let Some(last) = self.state().last() else {
            return Ok(());
        };
        let rank = last.ndim();
        let marker = crate::nn::mlx_ext::owned_copy(&slice(last, &vec![0; rank], &vec![1; rank])?)?;
        mlx_rs::transforms::async_eval([&marker])?;
        self.pass_in_flight = Some(marker);
        Ok(())
    }

    /// Waits for the pass marked by [`SlotKvCache::mark_pass_in_flight`], if any: called before
    /// the next pass dispatches anything, so that its writes update the buffers in place (MLX
    /// copies a buffer that work in flight still reads) and at most one pass's temporaries are
    /// alive. Errors of that pass surface here.
    pub fn wait_for_pass_in_flight(&mut self) -> Result<()> {
        if let Some(marker) = self.pass_in_flight.take() {
            mlx_rs::transforms::eval([&marker])?;
        }
        Ok(())
    }

    /// Puts a sequence whose per-layer `cache` holds `len` positions into the first free slot (copying
    /// them), with what its request asks of its KV cache (`kv`: a bound, a quantization; see the
    /// module docs), and returns the slot. Lazy: evaluate [`SlotKvCache::state`].
    pub fn push(&mut self, cache: &[KvCache], len: usize, kv: RowKv) -> Result<usize> {
        let slot = self.push_with(len, kv, |layer, ranges| {
            let Some(layer_cache) = cache.get(layer) else {
                return Ok(Vec::new()); // An empty sequence given no caches.
            };
            if layer_cache.is_recurrent() {
                // The state after `len` tokens (none before the first).
                return Ok(layer_cache
                    .recurrent_state()
                    .map(|s| vec![s.conv.clone(), s.ssm.clone()])
                    .unwrap_or_default());
            }
            match ranges {
                Some(ranges) => concat_ranges(ranges, |a, b| layer_cache.parts(a as i32, b as i32)),
                None => {
                    let first = layer_cache.first_position().min(len as i32);
                    layer_cache.parts(first, len as i32)
                }
            }
        })?;
        // Positions computed in full precision, for a row quantized already.
        if let Some(quantization) = kv.quantized_at(len) {
            self.quantize_row(slot, quantization)?;
        }
        Ok(slot)
    }

    /// Puts a sequence of `len` zeroed positions into the first free slot and returns the slot
    /// (warm-up's stand-in for a long sequence), its buffers shaped as `like`'s. Errors when
    /// `like` has no buffers.
    pub(crate) fn push_zeros(&mut self, like: &SlotKvCache, len: usize) -> Result<usize> {
        if !like.has_buffers() {
            return Err(mlx_rs::error::Exception::custom("no buffers to shape zeros like").into());
        }
        let shapes: Vec<Vec<([i32; 4], mlx_rs::Dtype)>> = like
            .layers
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                if self.is_recurrent(l) {
                    // A zeroed state: no buffer of its own needed.
                    return Vec::new();
                }
                // A ring keeps its last positions only (see `push_with`).
                let held = match &self.rings {
                    Some(rings) if self.is_ring(l) => len.min(rings.positions),
                    _ => len,
                };
                let shape = |b: &Array| [1, b.shape()[1], held as i32, b.shape()[3]];
                layer.iter().map(|b| (shape(b), b.dtype())).collect()
            })
            .collect();
        self.push_with(len, RowKv::Plain, |layer, _| {
            shapes[layer]
                .iter()
                .map(|(shape, dtype)| Ok(ops::zeros_dtype(shape, *dtype)?))
                .collect()
        })
    }

    /// Moves the first `len` positions of `other`'s `slot` into the first free slot of this cache (a
    /// sequence whose prefill is done joins the decode batch), with its KV options (a quantized
    /// row's entries are round-tripped already), and returns that
    /// slot; `other` keeps its copy until its [`SlotKvCache::remove`]. Lazy, as
    /// [`SlotKvCache::push`].
    pub fn push_from(&mut self, other: &SlotKvCache, slot: usize) -> Result<usize> {
        let len = other.slot_len(slot);
        let shift = other.rope_shift.get(slot).copied().unwrap_or(0);
        let to = self.push_with(len, other.slot_kv(slot), |layer, ranges| {
            if other.is_recurrent(layer) {
                return other.row_state(layer, slot);
            }
            if let Some(ranges) = ranges {
                return concat_ranges(ranges, |a, b| other.slot_parts(slot, layer, a, b));
            }
            // A ring's last positions (all that its layer sees later), in temporal order.
            let held = if other.is_ring(layer) {
                len.min(other.layer_capacity(layer, other.capacity))
            } else {
                len
            };
            other.slot_parts(slot, layer, len - held, len)
        })?;
        self.rope_shift[to] = shift;
        Ok(to)
    }

    /// Sets what `slot`'s RoPE positions add to its cache positions (see `rope_shift`'s field).
    pub fn set_rope_shift(&mut self, slot: usize, shift: i32) {
        assert!(self.is_occupied(slot), "slot {slot} is not occupied");
        self.rope_shift[slot] = shift;
    }

    /// Puts a sequence of `len` positions with KV options `kv` (bounded by its limit, if any) into the first free slot,
    /// layer `l`'s parts `[1, kv_heads, n, last]` given by `parts(l, ranges)`: for a layer the
    /// bound applies to, the positions of `ranges` (what the row reads next,
    /// [`SlotKvCache::held_ranges`]) one after the other; otherwise (`None`) the row's positions
    /// or its last `n < len` (a sliding layer holding its window only: the row's positions
    /// before them are stale, out of that layer's window mask). A row's stale positions past
    /// `len` are never read: the mask stops at each row's length.
    fn push_with(
        &mut self,
        len: usize,
        kv: RowKv,
        mut parts: impl FnMut(usize, Option<&[(usize, usize)]>) -> Result<Vec<Array>>,
    ) -> Result<usize> {
        let slot = self
            .lengths
            .iter()
            .position(Option::is_none)
            .unwrap_or(self.lengths.len());
        // Room for the token this sequence feeds next, as every occupied slot has.
        let slots = self.lengths.len().max(slot + 1);
        let limit = kv.limit();
        let entries = self.row_entries(limit, len, 1);
        self.reshape(slots, self.needed_capacity(1).max(entries))?;
        // A recurrent layer's row gets the sequence's state, or zeros: a free row's state is
        // whatever its last occupant or padding left.
        let recurrent = self.recurrent.clone();
        for layer in (0..self.num_layers).filter(|&l| recurrent[l]) {
            let parts = parts(layer, None)?;
            self.put_row_state(layer, slot, &parts)?;
        }
        if len > 0 {
            for layer in (0..self.num_layers).filter(|&l| !recurrent[l]) {
                let bounded = self.held_ranges(layer, limit, len);
                let mut parts = parts(layer, bounded.as_deref())?;
                self.ensure_buffers(layer, &parts)?;
                let held = parts.first().map_or(0, |p| p.shape()[2] as usize);
                let ranges = match bounded {
                    Some(ranges) => ranges,
                    None => {
                        // A ring keeps the last positions that fit it.
                        let size = self.layer_capacity(layer, self.capacity);
                        let kept = if self.is_ring(layer) {
                            held.min(size)
                        } else {
                            held
                        };
                        if kept < held {
                            parts = parts
                                .iter()
                                .map(|p| {
                                    let s = p.shape();
                                    Ok(slice(
                                        p,
                                        &[0, 0, (held - kept) as i32, 0],
                                        &[s[0], s[1], s[2], s[3]],
                                    )?)
                                })
                                .collect::<Result<_>>()?;
                        }
                        vec![(len - kept, len)]
                    }
                };
                let mut runs = Vec::new();
                for &range in &ranges {
                    runs.extend(self.runs(layer, limit, len, range)?);
                }
                for (buffer, part) in self.layers[layer].iter_mut().zip(&parts) {
                    let s = part.shape();
                    let mut from = 0;
                    for &(entry, count) in &runs {
                        let piece = slice(
                            part,
                            &[0, 0, from as i32, 0],
                            &[s[0], s[1], (from + count) as i32, s[3]],
                        )?;
                        let start = [slot as i32, 0, entry as i32, 0];
                        let stop = [slot as i32 + 1, s[1], (entry + count) as i32, s[3]];
                        *buffer = slice_update(buffer, &piece, &start, &stop)?;
                        from += count;
                    }
                }
            }
        }
        if slot == self.lengths.len() {
            self.lengths.push(Some(len));
            self.row_kv.push(kv);
            self.rope_shift.push(0);
        } else {
            self.lengths[slot] = Some(len);
            self.row_kv[slot] = kv;
            self.rope_shift[slot] = 0;
        }
        Ok(slot)
    }

    /// Frees `slot`; nothing moves, unless the occupied slots now fit a row bucket half as
    /// large: then they are compacted to `0..len` (one gather per buffer, into the smaller
    /// buffers) and the moves are returned, `(from, to)` for each sequence whose slot changed.
    pub fn remove(&mut self, slot: usize) -> Result<Vec<(usize, usize)>> {
        assert!(self.is_occupied(slot), "slot {slot} is not occupied");
        self.lengths[slot] = None;
        self.row_kv[slot] = RowKv::Plain;
        self.rope_shift[slot] = 0;
        while self.lengths.last() == Some(&None) {
            self.lengths.pop();
            self.row_kv.pop();
            self.rope_shift.pop();
        }
        let occupied = self.len();
        if occupied == 0 {
            self.clear();
            return Ok(Vec::new());
        }
        let mut moves = Vec::new();
        if row_bucket(occupied) * 2 <= self.rows {
            let order: Vec<usize> = (0..self.lengths.len())
                .filter(|&s| self.lengths[s].is_some())
                .collect();
            moves = order
                .iter()
                .enumerate()
                .filter(|&(to, &from)| from != to)
                .map(|(to, &from)| (from, to))
                .collect();
            // The new rows: the occupied slots in order, then padding (copies of row 0).
            let rows = row_bucket(occupied);
            let mut gather: Vec<i32> = order.iter().map(|&s| s as i32).collect();
            gather.resize(rows, 0);
            let gather = Array::from_slice(&gather, &[rows as i32]);
            for buffer in self.layers.iter_mut().flatten() {
                *buffer = buffer.take_axis(&gather, 0)?;
            }
            self.lengths = order.iter().map(|&s| self.lengths[s]).collect();
            self.row_kv = order.iter().map(|&s| self.row_kv[s]).collect();
            self.rope_shift = order.iter().map(|&s| self.rope_shift[s]).collect();
            self.rows = rows;
        }
        self.reshape(self.lengths.len(), self.needed_capacity(1))?;
        Ok(moves)
    }

    /// Capacity every occupied slot needs for `tokens` more positions (a bounded row: its kept
    /// positions and ring at most).
    fn needed_capacity(&self, tokens: usize) -> usize {
        self.lengths
            .iter()
            .zip(&self.row_kv)
            .filter_map(|(len, kv)| Some(self.row_entries(kv.limit(), (*len)?, tokens)))
            .max()
            .unwrap_or(tokens)
    }

    /// Resizes the buffers to the buckets of `slots` rows and `positions` positions: grows when
    /// short, shrinks when a smaller bucket fits in half (so a run does not flip between two
    /// sizes).
    fn reshape(&mut self, slots: usize, positions: usize) -> Result<()> {
        let rows = match row_bucket(slots) {
            r if r > self.rows || r * 2 <= self.rows => r,
            _ => self.rows,
        };
        let capacity = match capacity_bucket(positions) {
            c if c > self.capacity || c * 2 <= self.capacity => c,
            _ => self.capacity,
        };
        if rows == self.rows && capacity == self.capacity {
            return Ok(());
        }
        let keep_rows = rows.min(self.rows) as i32;
        // A ring's entries are positions while the capacity is below its size (nothing wraps
        // before), and its size only changes then: keeping its first entries keeps them all.
        let sizes: Vec<(usize, usize)> = (0..self.layers.len())
            .map(|l| {
                (
                    self.layer_capacity(l, self.capacity),
                    self.layer_capacity(l, capacity),
                )
            })
            .collect();
        for (l, (buffers, &(old, new))) in self.layers.iter_mut().zip(&sizes).enumerate() {
            if self.recurrent.get(l).copied().unwrap_or(false) {
                if rows != self.rows {
                    for buffer in buffers.iter_mut() {
                        *buffer = resize_rows(buffer, rows)?;
                    }
                }
                continue;
            }
            if rows == self.rows && old == new {
                continue;
            }
            for buffer in buffers.iter_mut() {
                let s = buffer.shape();
                let stop = [keep_rows, s[1], old.min(new) as i32, s[3]];
                let kept = slice(buffer, &[0, 0, 0, 0], &stop)?;
                let shape = [rows as i32, s[1], new as i32, s[3]];
                let grown = ops::zeros_dtype(&shape, buffer.dtype())?;
                *buffer = slice_update(&grown, &kept, &[0, 0, 0, 0], &stop)?;
            }
        }
        self.rows = rows;
        self.capacity = capacity;
        Ok(())
    }

    /// Creates layer `layer`'s buffers, zeroed, `[rows, kv_heads, capacity, last]` with the
    /// dtypes and head shapes of `parts` (one per buffer), unless they exist.
    fn ensure_buffers(&mut self, layer: usize, parts: &[Array]) -> Result<()> {
        if self.layers.len() < self.num_layers {
            self.layers.resize_with(self.num_layers, Vec::new);
        }
        if !self.layers[layer].is_empty() {
            return Ok(());
        }
        let size = self.layer_capacity(layer, self.capacity) as i32;
        let recurrent = self.is_recurrent(layer);
        self.layers[layer] = parts
            .iter()
            .map(|p| {
                let mut shape = p.shape().to_vec();
                shape[0] = self.rows as i32;
                if !recurrent {
                    shape[2] = size;
                }
                ops::zeros_dtype(&shape, p.dtype())
            })
            .collect::<std::result::Result<_, _>>()?;
        Ok(())
    }

    /// Recurrent layer `layer`'s state of every row, `[conv, ssm]` `[rows, ..]`; `None` until
    /// written (every row's state is zeros then).
    pub fn recurrent_state(&self, layer: usize) -> Option<RecurrentState> {
        match self.layers.get(layer).map(Vec::as_slice) {
            Some([conv, ssm]) if self.is_recurrent(layer) => Some(RecurrentState {
                conv: conv.clone(),
                ssm: ssm.clone(),
            }),
            _ => None,
        }
    }

    /// Replaces recurrent layer `layer`'s state of every row with `state` (`[rows, ..]`, as
    /// [`SlotKvCache::recurrent_state`] gives it): what a step computed.
    pub fn set_recurrent_state(&mut self, layer: usize, state: RecurrentState) {
        debug_assert!(self.is_recurrent(layer), "a state for an attention layer");
        if self.layers.len() < self.num_layers {
            self.layers.resize_with(self.num_layers, Vec::new);
        }
        self.layers[layer] = vec![state.conv, state.ssm];
    }

    /// Recurrent layer `layer`'s state of `slot`, `[conv, ssm]` `[1, ..]` (views); empty when
    /// nothing was written yet (a zero state).
    fn row_state(&self, layer: usize, slot: usize) -> Result<Vec<Array>> {
        let Some(buffers) = self.layers.get(layer).filter(|b| !b.is_empty()) else {
            return Ok(Vec::new());
        };
        buffers
            .iter()
            .map(|b| {
                let mut start = vec![0; b.ndim()];
                let mut stop = b.shape().to_vec();
                start[0] = slot as i32;
                stop[0] = slot as i32 + 1;
                Ok(slice(b, &start, &stop)?)
            })
            .collect()
    }

    /// Writes `state` (`[conv, ssm]` of one sequence, `[1, ..]`; empty for zeros) into row
    /// `slot` of recurrent layer `layer`, creating the buffers from it when needed.
    fn put_row_state(&mut self, layer: usize, slot: usize, state: &[Array]) -> Result<()> {
        let exists = self.layers.get(layer).is_some_and(|b| !b.is_empty());
        if state.is_empty() && !exists {
            return Ok(()); // No buffers: every row reads as zeros when the layer first runs.
        }
        if !exists {
            self.ensure_buffers(layer, state)?;
        }
        for (i, buffer) in self.layers[layer].iter_mut().enumerate() {
            let mut start = vec![0; buffer.ndim()];
            let mut stop = buffer.shape().to_vec();
            start[0] = slot as i32;
            stop[0] = slot as i32 + 1;
            let row = match state.get(i) {
                Some(part) => part.as_dtype(buffer.dtype())?,
                None => ops::zeros_dtype(
                    &stop
                        .iter()
                        .zip(&start)
                        .map(|(b, a)| b - a)
                        .collect::<Vec<_>>(),
                    buffer.dtype(),
                )?,
            };
            *buffer = slice_update(buffer, &row, &start, &stop)?;
        }
        Ok(())
    }

    /// Starts a step in which every row feeds `tokens` tokens (1 for a decode step, a prompt
    /// chunk's length for a prefill step): positions and mask for
    /// [`SlotKvCache::update_and_fetch`]. Row `r`'s token `i` sits at position `len(r) + i` and
    /// attends to positions `0..=len(r) + i` (causal within the chunk). A row with fewer real
    /// tokens pads its chunk: the padding writes past the row's length, where nothing reads
    /// (the row's next tokens overwrite it). `new_tokens`: each slot's real tokens (as
    /// [`SlotKvCache::end_step`] takes them), which recurrent layers need when some row pads.
    /// Call [`SlotKvCache::end_step`] after the forward.
    pub fn begin_step(&mut self, tokens: usize, new_tokens: &[usize]) -> Result<SlotStep> {
        self.begin_step_with(tokens, new_tokens, &[])
    }

    /// [`SlotKvCache::begin_step`] in which the tokens of each span `(row, start, end)` of
    /// `both_ways` (offsets in the step's tokens of that row) also see the span's later tokens:
    /// a query at `p` inside the span sees every position up to the span's last (the block
    /// overlay of Hugging Face's `create_masks_for_vision_model`, Gemma 4's image tokens). Its
    /// sliding layers' masks keep their window's lower bound.
    pub fn begin_step_with(
        &mut self,
        tokens: usize,
        new_tokens: &[usize],
        both_ways: &[(usize, usize, usize)],
    ) -> Result<SlotStep> {
        let tokens = tokens.max(1);
        // An older step's record is spent: only the step that just ran can be rewound.
        self.replay = std::mem::take(&mut self.replay_next).then(|| StepReplay {
            layers: (0..self.num_layers).map(|_| None).collect(),
            counts: None,
            tokens,
        });
        self.reshape(self.lengths.len(), self.needed_capacity(tokens))?;
        let mut lengths = vec![0i32; self.rows];
        for (p, len) in lengths.iter_mut().zip(&self.lengths) {
            *p = len.unwrap_or(0) as i32;
        }
        // RoPE's offsets: each row's length, plus its shift where it has one (`None`: the
        // lengths themselves).
        let shifted: Option<Vec<i32>> = self.rope_shift.iter().any(|&s| s != 0).then(|| {
            lengths
                .iter()
                .enumerate()
                .map(|(r, &len)| len + self.rope_shift.get(r).copied().unwrap_or(0))
                .collect()
        });
        let positions = |lengths: &[i32]| {
            Array::from_slice(shifted.as_deref().unwrap_or(lengths), &[self.rows as i32])
        };
        // [rows, 1, tokens, 1]: the last position each query sees, when some span reaches
        // past its query.
        let reach = match both_ways.is_empty() {
            true => None,
            false => {
                let mut reach: Vec<i32> = lengths
                    .iter()
                    .flat_map(|&len| (0..tokens as i32).map(move |i| len + i))
                    .collect();
                for &(row, start, end) in both_ways {
                    let end = end.min(tokens);
                    if row < self.rows && start < end {
                        let last = lengths[row] + end as i32 - 1;
                        reach[row * tokens + start..row * tokens + end].fill(last);
                    }
                }
                let shape = [self.rows as i32, 1, tokens as i32, 1];
                Some(Array::from_slice(&reach, &shape))
            }
        };
        let bounded = self.row_kv.iter().any(|kv| kv.limit().is_some());
        if tokens == 1 && !bounded && reach.is_none() {
            // A decode step without bounded rows: one array written by the host (its index),
            // its masks few operations on it against arrays kept between steps (a decode step on
            // a GPU is bound by the host launching its operations, and on CUDA each array written
            // by the host may cost MLX's allocator a synchronous copy, docs/benchmarks.md).
            let (index, mask, ring) = self.one_token_step(&lengths)?;
            // Unshifted, the offsets are the index's values: a view of it rather than another
            // array written by the host (each may cost MLX's CUDA allocator a synchronous copy,
            // docs/benchmarks.md).
            let positions = match shifted.is_none() {
                true => index.reshape(&[self.rows as i32])?,
                false => positions(&lengths),
            };
            return self.finish_step(
                tokens,
                new_tokens,
                positions,
                mask,
                index.clone(),
                index,
                ring,
            );
        }
        let positions = positions(&lengths);
        let lengths = match shifted.is_none() {
            true => positions.clone(),
            false => Array::from_slice(&lengths, &[self.rows as i32]),
        };
        // [rows, 1, tokens, 1]: where each row's tokens go.
        let index = ops::add(
            &lengths.reshape(&[-1, 1, 1, 1])?,
            &ops::arange::<_, i32>(0, tokens as i32, None)?.reshape(&[1, 1, -1, 1])?,
        )?;
        let upto = reach.as_ref().unwrap_or(&index);
        let keys = ops::arange::<_, i32>(0, self.capacity as i32, None)?.reshape(&[1, 1, 1, -1])?;
        let (mask, write) = if bounded {
            if tokens > self.max_step_tokens {
                return Err(mlx_rs::error::Exception::custom(format!(
                    "a step of {tokens} tokens per row is wider than bounded rows' rings allow \
                     ({})",
                    self.max_step_tokens
                ))
                .into());
            }
            self.bounded_step(&index, upto, &keys, tokens)?
        } else {
            (ops::le(&keys, upto)?, index.clone())
        };
        let ring = match (&self.rings, self.ring_size(self.capacity)) {
            (Some(rings), Some(size)) => {
                if size < self.capacity && tokens > rings.max_step_tokens {
                    return Err(mlx_rs::error::Exception::custom(format!(
                        "a step of {tokens} tokens per row is wider than the sliding layers' \
                         rings allow ({})",
                        rings.max_step_tokens
                    ))
                    .into());
                }
                let mut step = ring_step(&index, size as i32, rings.window as i32, None)?;
                if let Some(reach) = &reach {
                    // The later positions of a query's span: entries whose position at the
                    // step's end lies after the query and up to its reach.
                    let last = ops::add(&lengths, Array::from_int(tokens as i32 - 1))?
                        .reshape(&[-1, 1, 1, 1])?;
                    let ring = Array::from_int(size as i32);
                    let entries =
                        ops::arange::<_, i32>(0, size as i32, None)?.reshape(&[1, 1, 1, -1])?;
                    // (last - e) mod R in [0, R).
                    let age = ops::remainder(
                        &ops::add(
                            &ops::remainder(&ops::subtract(&last, &entries)?, &ring)?,
                            &ring,
                        )?,
                        &ring,
                    )?;
                    let held = ops::subtract(&last, &age)?;
                    let later =
                        ops::logical_and(&ops::gt(&held, &index)?, &ops::le(&held, reach)?)?;
                    step.mask = ops::logical_or(&step.mask, &later)?;
                }
                Some(step)
            }
            _ => None,
        };
        self.finish_step(tokens, new_tokens, positions, mask, index, write, ring)
    }

    /// [`SlotKvCache::begin_step_with`]'s index `[rows, 1, 1, 1]` (each row's length), mask
    /// `[rows, 1, 1, capacity]` and rings' entries and mask for a step of one token a row without
    /// bounded rows, from the rows' `lengths`: the index written by the host, the plain mask one
    /// comparison against kept key positions (entry `e` seen from position `q` when `e <= q`),
    /// the rings' four operations against kept ring entries ([`ring_step`]).
    fn one_token_step(&self, lengths: &[i32]) -> Result<(Array, Array, Option<RingStep>)> {
        let index = Array::from_slice(lengths, &[self.rows as i32, 1, 1, 1]);
        let mask = ops::le(&self.key_positions()?, &index)?;
        let ring = match (&self.rings, self.ring_size(self.capacity)) {
            (Some(rings), Some(size)) => Some(ring_step(
                &index,
                size as i32,
                rings.window as i32,
                Some(self.ring_back(size)?),
            )?),
            _ => None,
        };
        Ok((index, mask, ring))
    }

    /// [`ring_back`] for rings of `size` entries, made once a size (evaluated with the first
    /// step that reads it, then kept as data).
    fn ring_back(&self, size: usize) -> Result<Array> {
        kept_row(&self.ring_back, size, || ring_back(size as i32))
    }

    /// `[1, 1, 1, capacity]` int32 `0..capacity`, made once a capacity (evaluated with the
    /// first step that reads it, then kept as data).
    fn key_positions(&self) -> Result<Array> {
        kept_row(&self.key_positions, self.capacity, || {
            Ok(ops::arange::<_, i32>(0, self.capacity as i32, None)?.reshape(&[1, 1, 1, -1])?)
        })
    }

    /// The rest of [`SlotKvCache::begin_step_with`] once the step's index, mask, write entries
    /// and rings are made: recurrent layers' real tokens and the quantized rows.
    #[allow(clippy::too_many_arguments)]
    fn finish_step(
        &self,
        tokens: usize,
        new_tokens: &[usize],
        positions: Array,
        mask: Array,
        index: Array,
        write: Array,
        ring: Option<RingStep>,
    ) -> Result<SlotStep> {
        // A one-token step advances every row's states, unless an occupied row feeds nothing
        // (a draft's row that proposes nothing this round): its states must stay.
        let idle_row = || {
            self.lengths
                .iter()
                .enumerate()
                .any(|(slot, len)| len.is_some() && new_tokens.get(slot).is_none_or(|&n| n == 0))
        };
        let real = match self.has_recurrent_layers() {
            true if tokens > 1 || idle_row() => Some(self.real_tokens(tokens, new_tokens)?),
            _ => None,
        };
        // The rows quantized already, by setting (a float cache's only: see `RowKv`).
        let mut quantized: Vec<(KvQuantization, Vec<bool>)> = Vec::new();
        for (slot, (len, kv)) in self.lengths.iter().zip(&self.row_kv).enumerate() {
            let Some(q) = len.and_then(|len| kv.quantized_at(len)) else {
                continue;
            };
            let group = match quantized.iter().position(|(setting, _)| *setting == q) {
                Some(group) => group,
                None => {
                    quantized.push((q, vec![false; self.rows]));
                    quantized.len() - 1
                }
            };
            quantized[group].1[slot] = true;
        }
        let quantized = quantized
            .into_iter()
            .map(|(q, rows)| (q, Array::from_slice(&rows, &[self.rows as i32, 1, 1, 1])))
            .collect();
        Ok(SlotStep {
            positions,
            mask,
            read: self.read(Backend::current(), tokens),
            index,
            write,
            ring,
            real,
            quantized,
            window_mask: OnceCell::new(),
            write_indices: RefCell::default(),
            additive: Default::default(),
        })
    }

    /// The mask `[rows, 1, tokens, capacity]` and write entries `[rows, 1, tokens, 1]` of the
    /// layers that keep every position, for a step of `tokens` per row whose queries sit at
    /// `index` `[rows, 1, tokens, 1]`, over entries `keys` `[1, 1, 1, capacity]`, when some row
    /// is bounded (see the module docs).
    ///
    /// Per entry `e` of a bounded row, `P(e)`: the latest position written there by the end of
    /// the step (`e` itself below `keep`; in the ring, `last - ((last - e) mod W)` counted from
    /// `keep`). A query at `q` sees `e` when `P(e) <= q` (an entry the step overwrites later held
    /// a position older than anything the row reads, see the module docs) and `P(e)` is in the
    /// list mlx_lm's rotating cache gives it ([`KvLimit::held_before`]: kept positions before
    /// `keep_end`, recent ones from `recent_from`), fewer than `max_size` places before `q` in that
    /// list: a recent position from `max(recent_from, q - max_size + 1)`, a kept one from
    /// `q - recent_from + keep_end - max_size + 1`. An unbounded row takes `keep = 0` and `W`,
    /// `max_size` beyond any position, which leaves its plain causal mask. Only a few operations
    /// run over the whole `[rows, 1, tokens, capacity]`; the rest are per entry or per query.
    /// `upto` `[rows, 1, tokens, 1]`: the last position each query sees (its own, or its
    /// span's last, see [`SlotKvCache::begin_step_with`]).
    fn bounded_step(
        &self,
        index: &Array,
        upto: &Array,
        keys: &Array,
        tokens: usize,
    ) -> Result<(Array, Array)> {
        const UNBOUNDED: i32 = 1 << 30;
        // Per row: keep, W, max_size, the list before the step (keep_end, recent_from), and the
        // last position the step writes.
        let mut params = [0, UNBOUNDED, UNBOUNDED, 0, 0, 0].map(|v| vec![v; self.rows]);
        for (r, (len, kv)) in self.lengths.iter().zip(&self.row_kv).enumerate() {
            let limit = &kv.limit();
            let last = (len.unwrap_or(0) + tokens - 1) as i32;
            params[5][r] = last;
            if let (Some(len), Some(limit)) = (len, limit) {
                let (keep_end, recent_from) = limit.held_before(*len as i32);
                let ring = self.bounded_ring(*limit) as i32;
                let values = [limit.keep, ring, limit.max_size, keep_end, recent_from];
                for (param, value) in params.iter_mut().zip(values) {
                    param[r] = value;
                }
            }
        }
        let [keep, ring, max_size, keep_end, recent_from, last] =
            params.map(|p| Array::from_slice(&p, &[self.rows as i32, 1, 1, 1]));
        let zero = Array::from_int(0);
        // `a mod W` in `[0, W)` whatever the sign of `a`.
        let modulo = |a: &Array| -> Result<Array> {
            let m = ops::remainder(a, &ring)?;
            Ok(ops::select(
                &ops::lt(&m, &zero)?,
                &ops::add(&m, &ring)?,
                &m,
            )?)
        };
        // Per entry, [rows, 1, 1, capacity].
        let kept = ops::lt(keys, &keep)?;
        let re = ops::subtract(keys, &keep)?;
        let r_last = ops::subtract(&last, &keep)?;
        let in_ring = ops::subtract(
            &ops::add(&keep, &r_last)?,
            &modulo(&ops::subtract(&r_last, &re)?)?,
        )?;
        let position = ops::select(&kept, keys, &in_ring)?;
        let held = ops::logical_or(
            &kept,
            &ops::logical_and(&ops::lt(&re, &ring)?, &ops::ge(&in_ring, &keep)?)?,
        )?;
        // Per query, [rows, 1, tokens, 1]: the first position of each part of the list it sees.
        let q = index;
        let one = Array::from_int(1);
        let reach = ops::add(&ops::subtract(q, &max_size)?, &one)?;
        let recent_lo = ops::maximum(&recent_from, &reach)?;
        let kept_lo = ops::add(&ops::subtract(&reach, &recent_from)?, &keep_end)?;
        // [rows, 1, tokens, capacity].
        let lo = ops::select(&kept, &kept_lo, &recent_lo)?;
        let mask = ops::logical_and(
            &ops::logical_and(&held, &ops::le(&position, upto)?)?,
            &ops::ge(&position, &lo)?,
        )?;
        let rq = ops::subtract(q, &keep)?;
        let write = ops::select(&ops::lt(&rq, &zero)?, q, &ops::add(&keep, &modulo(&rq)?)?)?;
        Ok((mask, write))
    }

    /// Each row's real tokens of a step of `tokens` per row: `new_tokens[slot]` for an
    /// occupied slot, none for free slots and padding rows.
    fn real_tokens(&self, tokens: usize, new_tokens: &[usize]) -> Result<RealTokens> {
        let mut counts = vec![0i32; self.rows];
        for (slot, (count, len)) in counts.iter_mut().zip(&self.lengths).enumerate() {
            if len.is_some() {
                *count = new_tokens.get(slot).copied().unwrap_or(0).min(tokens) as i32;
            }
        }
        let counts = Array::from_slice(&counts, &[self.rows as i32]);
        let mask = ops::lt(
            &ops::arange::<_, i32>(0, tokens as i32, None)?.reshape(&[1, -1])?,
            &counts.reshape(&[-1, 1])?,
        )?;
        Ok(RealTokens { counts, mask })
    }

    /// Writes layer `layer`'s new keys and values `[rows, kv_heads, tokens, head_dim]` at each
    /// row's positions (quantizing them first when this cache is quantized) and returns the
    /// whole buffers (attention masks the unfilled positions with [`SlotStep::mask`]).
    pub fn update_and_fetch(
        &mut self,
        layer: usize,
        step: &SlotStep,
        keys: &Array,
        values: &Array,
    ) -> Result<CachedKv> {
        // A quantized cache holds no quantized rows (see `RowKv`).
        let parts = match step.quantized.is_empty() || self.quantization.is_some() {
            true => kv_parts(self.quantization, keys, values)?,
            false => vec![
                step.round_trip_quantized_rows(keys)?,
                step.round_trip_quantized_rows(values)?,
            ],
        };
        self.ensure_buffers(layer, &parts)?;
        let ring = step.ring.is_some() && self.is_ring(layer);
        let buffers = &mut self.layers[layer];
        for (buffer, part) in buffers.iter_mut().zip(&parts) {
            let index = step.write_index(ring, part.shape())?;
            *buffer = buffer.put_along_axis(&index, part, 2)?;
        }
        Ok(CachedKv::from_parts(self.quantization, buffers.clone()))
    }

    /// Attention of `queries` `[rows, heads, tokens, head_dim]` (rotated, each row at its
    /// positions of `step`) over layer `layer`, after writing `kv` (rotated keys and values
    /// `[rows, kv_heads, tokens, head_dim]`; `None` for a layer that reads this layer as an
    /// earlier one left it in the same step) → `[rows, tokens, heads * head_dim]`: every row's
    /// buffer masked by its own length (and a sliding layer's window), read as the step says
    /// ([`SlotStep::read`], [`masked_attention`]).
    pub fn attend(
        &mut self,
        layer: usize,
        step: &SlotStep,
        queries: &Array,
        kv: Option<(Array, Array)>,
        spec: &AttentionSpec<'_>,
    ) -> Result<Array> {
        let cached = match kv {
            Some((keys, values)) => self.update_and_fetch(layer, step, &keys, &values)?,
            None => self.fetch(layer)?,
        };
        let mask = step.mask_for(spec.window, queries.dtype())?;
        masked_attention(queries, cached, spec.scale, mask, step.read, spec.sinks)
    }

    /// Layer `layer`'s buffers as [`SlotKvCache::update_and_fetch`] returns them, without
    /// writing (a layer reading an earlier layer's cache in the same step, after its write).
    pub fn fetch(&self, layer: usize) -> Result<CachedKv> {
        match self.layers.get(layer).filter(|b| !b.is_empty()) {
            Some(buffers) => Ok(CachedKv::from_parts(self.quantization, buffers.clone())),
            None => Err(mlx_rs::error::Exception::custom(format!(
                "slot cache layer {layer} is read before it was written"
            ))
            .into()),
        }
    }

    /// Ends a step: occupied slot `s` holds `new_tokens[s]` more positions (its real tokens of
    /// the step; 1 each in a decode step). One count per slot of [`SlotKvCache::slots`]; free
    /// slots' counts are ignored. A row the step leaves quantized for the first time is
    /// round-tripped whole (see the module docs; lazy).
    pub fn end_step(&mut self, new_tokens: &[usize]) -> Result<()> {
        debug_assert_eq!(new_tokens.len(), self.lengths.len(), "one count per slot");
        if let Some(replay) = &mut self.replay {
            replay.counts.get_or_insert_with(|| new_tokens.to_vec());
        }
        let mut quantized = Vec::new();
        for (slot, (len, new)) in self.lengths.iter_mut().zip(new_tokens).enumerate() {
            if let Some(len) = len {
                let kv = self.row_kv[slot];
                if kv.quantized_at(*len).is_none() {
                    quantized.extend(kv.quantized_at(*len + new).map(|q| (slot, q)));
                }
                *len += new;
            }
        }
        for (slot, quantization) in quantized {
            self.quantize_row(slot, quantization)?;
        }
        Ok(())
    }

    /// Records the next step so that its rows can be rewound ([`SlotKvCache::rewind_rows`])
    /// on a cache with recurrent layers (see the module docs); nothing to record without them.
    /// Such a step runs uncompiled (a trace's outputs are the logits and the buffers).
    pub fn record_replay(&mut self) {
        self.replay_next = self.has_recurrent_layers();
    }

    /// Whether the next step records its recurrent layers' replays.
    pub fn records_replay(&self) -> bool {
        self.replay_next
    }

    /// Keeps recurrent layer `layer`'s replay (made by `make`) when the step running records
    /// ([`SlotKvCache::record_replay`]); otherwise `make` is not called.
    pub fn keep_replay(&mut self, layer: usize, make: impl FnOnce() -> Box<dyn StateReplay>) {
        if let Some(replay) = self.replay.as_mut().filter(|r| r.counts.is_none()) {
            if let Some(entry) = replay.layers.get_mut(layer) {
                *entry = Some(make());
            }
        }
    }

    /// Every recurrent layer's state of occupied slot `slot` as it is now (views; empty for an
    /// attention layer, and for a layer not run yet), to put back with
    /// [`SlotKvCache::restore_row`].
    pub fn row_states(&self, slot: usize) -> Result<Vec<Vec<Array>>> {
        (0..self.num_layers)
            .map(|layer| match self.is_recurrent(layer) {
                true => self.row_state(layer, slot),
                false => Ok(Vec::new()),
            })
            .collect()
    }

    /// Puts occupied slot `slot` back to its first `len` positions, with the recurrent `states`
    /// it had there ([`SlotKvCache::row_states`], taken when it held `len`): a rewind over any
    /// number of steps, where [`SlotKvCache::rewind_rows`] goes back over the last recorded one.
    /// Its next step writes over the positions after `len`. Refused, changing nothing, as a
    /// rewind is: a bounded or quantized row, sliding layers' rings, `len` beyond the row's
    /// length.
    pub fn restore_row(&mut self, slot: usize, len: usize, states: &[Vec<Array>]) -> Result<()> {
        let refuse = |why: String| -> Result<()> {
            Err(
                mlx_rs::error::Exception::custom(format!("cannot restore slot {slot}: {why}"))
                    .into(),
            )
        };
        let held = self.lengths.get(slot).copied().flatten();
        if let Some(held) = held.filter(|&held| held < len) {
            return refuse(format!("{len} positions asked of {held}"));
        }
        if let Some(why) = self.why_not_back(slot, held.map_or(0, |held| held - len)) {
            return refuse(why);
        }
        if states.len() != self.num_layers {
            return refuse(format!(
                "{} layers' states for {}",
                states.len(),
                self.num_layers
            ));
        }
        // Checked before anything is written, so that a refusal changes nothing.
        for (layer, state) in states.iter().enumerate() {
            let Some(buffers) = self.layers.get(layer).filter(|b| !b.is_empty()) else {
                continue;
            };
            let fits = state.is_empty()
                || (state.len() == buffers.len()
                    && state.iter().zip(buffers).all(|(part, buffer)| {
                        part.shape().first() == Some(&1) && part.shape()[1..] == buffer.shape()[1..]
                    }));
            if self.is_recurrent(layer) && !fits {
                return refuse(format!(
                    "layer {layer}'s state is not one row of its buffers"
                ));
            }
        }
        // A recorded step's replay would recompute this row from before the restore.
        self.replay = None;
        for (layer, state) in states.iter().enumerate() {
            if self.is_recurrent(layer) {
                self.put_row_state(layer, slot, state)?;
            }
        }
        self.lengths[slot] = Some(len);
        Ok(())
    }

    /// Why slot `slot` cannot go back `n` positions ([`SlotKvCache::rewind_rows`],
    /// [`SlotKvCache::restore_row`]): sliding layers' rings, a bounded or quantized row, a free
    /// slot, `n` beyond its length; `None` when it can.
    fn why_not_back(&self, slot: usize, n: usize) -> Option<String> {
        if self.rings.is_some() {
            return Some(RINGS_DO_NOT_KEEP.to_owned());
        }
        if !self.row_kv.get(slot).is_some_and(RowKv::is_plain) {
            return Some(
                "a bounded or quantized row does not keep every position as written".into(),
            );
        }
        match self.lengths.get(slot) {
            Some(Some(len)) if *len >= n => None,
            Some(Some(len)) => Some(format!("{n} positions asked of {len}")),
            _ => Some("a free slot".to_owned()),
        }
    }

    /// Forgets the last `n` positions of occupied slot `slot` ([`SlotKvCache::rewind_rows`]).
    pub fn rewind(&mut self, slot: usize, n: usize) -> Result<()> {
        self.rewind_rows(&[(slot, n)])
    }

    /// Forgets the last `n` positions of each occupied slot `(slot, n)` of `rewinds` (distinct
    /// slots; speculative decoding's rejected proposals): its length drops by `n` and its next
    /// step writes over them. Only a row that holds every position in entries of their own
    /// can: an error for a bounded or quantized row, a cache with sliding layers' rings (a ring
    /// entry held an older position before it was overwritten), and for `n` beyond the row's
    /// length. A cache with recurrent layers rewinds only the step it just ran, recorded
    /// ([`SlotKvCache::record_replay`]), by at most each row's tokens of that step: every
    /// recurrent layer's state is computed again once, each row's after the tokens it keeps
    /// (lazy). Nothing changes on an error; the step's record is spent either way.
    pub fn rewind_rows(&mut self, rewinds: &[(usize, usize)]) -> Result<()> {
        let replay = self.replay.take();
        let rewinds: Vec<(usize, usize)> = rewinds.iter().copied().filter(|r| r.1 > 0).collect();
        let Some(&(first, _)) = rewinds.first() else {
            return Ok(());
        };
        let refuse = |slot: usize, why: &str| -> Result<()> {
            Err(
                mlx_rs::error::Exception::custom(format!("cannot rewind slot {slot}: {why}"))
                    .into(),
            )
        };
        if self.rings.is_some() {
            return refuse(first, RINGS_DO_NOT_KEEP);
        }
        let (mut counts, replay) = match (self.has_recurrent_layers(), replay) {
            (false, _) => (None, None),
            (
                true,
                Some(StepReplay {
                    layers,
                    counts: Some(counts),
                    tokens,
                }),
            ) => match layers
                .iter()
                .zip(&self.recurrent)
                .position(|(r, &rec)| rec && r.is_none())
            {
                Some(layer) => {
                    return refuse(first, &format!("recurrent layer {layer} kept no replay"))
                }
                None => (Some(counts), Some((layers, tokens))),
            },
            (true, _) => {
                return refuse(
                    first,
                    "a recurrent state goes back only over the step just run, recorded",
                )
            }
        };
        for &(slot, n) in &rewinds {
            debug_assert_eq!(
                rewinds.iter().filter(|r| r.0 == slot).count(),
                1,
                "distinct slots"
            );
            if let Some(why) = self.why_not_back(slot, n) {
                return refuse(slot, &why);
            }
            if let Some(counts) = &counts {
                let added = counts.get(slot).copied().unwrap_or(0);
                if added < n {
                    return refuse(
                        slot,
                        &format!("{n} positions asked of the {added} its last step added"),
                    );
                }
            }
        }
        for &(slot, n) in &rewinds {
            if let Some(Some(len)) = self.lengths.get_mut(slot) {
                *len -= n;
            }
            if let Some(counts) = &mut counts {
                counts[slot] -= n;
            }
        }
        if let (Some(counts), Some((layers, tokens))) = (counts, replay) {
            let real = self.real_tokens(tokens, &counts)?;
            for (layer, replay) in layers.into_iter().enumerate() {
                if let Some(replay) = replay {
                    let state = replay.replay(&real)?;
                    self.set_recurrent_state(layer, state);
                }
            }
        }
        Ok(())
    }

    /// Positions `[start, end)` of `slot` in layer `layer`, in buffers of their own, shaped as
    /// [`KvCache::copy_parts`] returns them (`[1, kv_heads, end - start, last]`; lazy). For a
    /// recurrent layer, as [`KvCache::block_parts`]: its state `[conv, ssm]` when `end` is the
    /// slot's length (the state exists after the last token only), else nothing.
    pub fn copy_parts(
        &self,
        slot: usize,
        layer: usize,
        start: usize,
        end: usize,
    ) -> Result<Vec<Array>> {
        let parts = match self.is_recurrent(layer) {
            true if end == self.slot_len(slot) => self.row_state(layer, slot)?,
            true => Vec::new(),
            false => self.slot_parts(slot, layer, start, end)?,
        };
        parts
            .iter()
            .map(|part| Ok(crate::nn::mlx_ext::owned_copy(part)?))
            .collect()
    }

    /// [`SlotKvCache::copy_parts`] of several `(slot, start, end)` ranges of layer `layer` (not
    /// recurrent) in one buffer per part, the ranges one after another along its positions
    /// (`[1, kv_heads, Σ (end − start), last]`; lazy): one gather a part, whatever the number of
    /// ranges. The decode loop publishes the blocks that several rows filled in one step so
    /// (a copy a row and layer part cost the host more than the copies themselves). `indices`
    /// keeps the gathers' indices for the other layers of the same `ranges` (see
    /// [`CopyIndices`]).
    pub fn copy_ranges(
        &self,
        layer: usize,
        ranges: &[(usize, usize, usize)],
        indices: &mut CopyIndices,
    ) -> Result<Vec<Array>> {
        let flat_entries = |b: &Array| b.size() / b.shape()[3].max(1) as usize;
        let fits = self.layers[layer]
            .iter()
            .all(|b| flat_entries(b) <= i32::MAX as usize);
        if ranges.len() == 1 || !fits {
            // One range, or flat entries past an i32: a copy a range.
            let copies = ranges
                .iter()
                .map(|&(slot, start, end)| self.copy_parts(slot, layer, start, end))
                .collect::<Result<Vec<_>>>()?;
            let parts = copies.first().map_or(0, Vec::len);
            return (0..parts)
                .map(|p| match copies.len() {
                    1 => Ok(copies[0][p].clone()),
                    _ => {
                        let pieces: Vec<&Array> = copies.iter().map(|c| &c[p]).collect();
                        Ok(ops::concatenate(&pieces, 2)?)
                    }
                })
                .collect();
        }
        debug_assert!(!self.is_recurrent(layer), "states have no positions");
        // Each position's (row, entry) in the buffers.
        let mut entries = Vec::new();
        for &(slot, start, end) in ranges {
            for (entry, count) in self.slot_runs(slot, layer, (start, end))? {
                entries.extend((entry..entry + count).map(|e| (slot as i32, e as i32)));
            }
        }
        let n = entries.len() as i32;
        self.layers[layer]
            .iter()
            .map(|b| {
                let s = b.shape();
                let (heads, capacity, last) = (s[1], s[2], s[3]);
                let index = indices.get(&entries, heads, capacity);
                Ok(b.reshape(&[-1, last])?
                    .take_axis(&index, 0)?
                    .reshape(&[1, heads, n, last])?)
            })
            .collect()
    }

    /// Views of positions `[start, end)` of `slot` in layer `layer`'s buffers.
    fn slot_parts(
        &self,
        slot: usize,
        layer: usize,
        start: usize,
        end: usize,
    ) -> Result<Vec<Array>> {
        let runs = self.slot_runs(slot, layer, (start, end))?;
        self.layers[layer]
            .iter()
            .map(|b| {
                let s = b.shape();
                let pieces = runs
                    .iter()
                    .map(|&(entry, count)| {
                        slice(
                            b,
                            &[slot as i32, 0, entry as i32, 0],
                            &[slot as i32 + 1, s[1], (entry + count) as i32, s[3]],
                        )
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                Ok(match pieces.len() {
                    1 => pieces.into_iter().next().expect("one run"),
                    _ => ops::concatenate(&pieces, 2)?,
                })
            })
            .collect()
    }

    /// How many arrays a step of this cache has ([`SlotStep::arrays`]): 4, or 6 with rings;
    /// 2 more with real tokens (`real`: some row pads or feeds nothing).
    pub(crate) fn step_arrays(&self, real: bool) -> usize {
        4 + 2 * (self.rings.is_some() as usize) + 2 * (real as usize)
    }

    /// Whether this cache has sliding layers' rings ([`SlotStep::with_arrays`]).
    pub(crate) fn has_rings(&self) -> bool {
        self.rings.is_some()
    }

    /// Whether every layer's buffers exist (from the first step or sequence that wrote any).
    pub(crate) fn has_buffers(&self) -> bool {
        self.layers.len() == self.num_layers && self.layers.iter().all(|l| !l.is_empty())
    }

    /// Every layer's buffers, layer by layer (handles, not copies): a compiled step's inputs.
    pub(crate) fn buffers(&self) -> Vec<Array> {
        self.layers.iter().flatten().cloned().collect()
    }

    /// Replaces the buffers with `flat`, in the order [`SlotKvCache::buffers`] lists them (a
    /// compiled step's outputs).
    pub(crate) fn set_buffers(&mut self, flat: Vec<Array>) {
        debug_assert_eq!(flat.len(), self.buffers_len(), "one array per buffer");
        let counts: Vec<usize> = self.layers.iter().map(Vec::len).collect();
        let mut flat = flat.into_iter();
        for (layer, count) in self.layers.iter_mut().zip(counts) {
            *layer = flat.by_ref().take(count).collect();
        }
    }

    fn buffers_len(&self) -> usize {
        self.layers.iter().map(Vec::len).sum()
    }

    /// A cache with this one's layers, quantization and attention setting whose buffers are
    /// `flat` (as [`SlotKvCache::buffers`] lists them; a compiled function's traced inputs):
    /// rows and capacity from their shape, no slot lengths (for
    /// [`SlotKvCache::update_and_fetch`] and [`SlotKvCache::read`] only).
    pub(crate) fn over_buffers(&self, flat: &[Array]) -> Self {
        let mut cache = self.empty_like();
        if let Some(first) = flat.first() {
            cache.rows = first.shape()[0] as usize;
            let mut rest = flat;
            cache.layers = (0..self.num_layers)
                .map(|layer| {
                    let (parts, after) = rest.split_at(self.parts_per_layer(layer).min(rest.len()));
                    rest = after;
                    parts.to_vec()
                })
                .collect();
            // Rings may be shorter than the global layers' buffers; states have no positions.
            cache.capacity = (0..self.num_layers)
                .filter(|&l| !self.is_recurrent(l))
                .filter_map(|l| cache.layers[l].first())
                .map(|b| b.shape()[2] as usize)
                .max()
                .unwrap_or(0);
        }
        cache
    }

    /// The buffers, as [`SlotKvCache::buffers`] lists them.
    pub(crate) fn into_buffers(self) -> Vec<Array> {
        self.layers.into_iter().flatten().collect()
    }

    /// The arrays to evaluate so the buffers hold data, not graphs.
    pub fn state(&self) -> impl Iterator<Item = &Array> {
        self.layers.iter().flatten()
    }

    /// Bytes held by the buffers.
    pub fn nbytes(&self) -> usize {
        self.state().map(Array::nbytes).sum()
    }
}

/// The parts of each range of positions `[a, b)` (`parts(a, b)`, `[1, kv_heads, b - a, last]`),
/// one after the other along the positions' axis.
fn concat_ranges(
    ranges: &[(usize, usize)],
    mut parts: impl FnMut(usize, usize) -> Result<Vec<Array>>,
) -> Result<Vec<Array>> {
    let pieces: Vec<Vec<Array>> = ranges
        .iter()
        .map(|&(a, b)| parts(a, b))
        .collect::<Result<_>>()?;
    match pieces.len() {
        1 => Ok(pieces.into_iter().next().expect("one range")),
        _ => (0..pieces.first().map_or(0, Vec::len))
            .map(|i| {
                let column: Vec<&Array> = pieces.iter().map(|p| &p[i]).collect();
                Ok(ops::concatenate(&column, 2)?)
            })
            .collect(),
    }
}

/// `buffer` `[rows, ..]` with `rows` rows: its first ones kept, zeros after them.
fn resize_rows(buffer: &Array, rows: usize) -> Result<Array> {
    let s = buffer.shape();
    let keep = (rows as i32).min(s[0]);
    let mut stop = s.to_vec();
    stop[0] = keep;
    let kept = slice(buffer, &vec![0; s.len()], &stop)?;
    let mut shape = s.to_vec();
    shape[0] = rows as i32;
    let grown = ops::zeros_dtype(&shape, buffer.dtype())?;
    Ok(slice_update(&grown, &kept, &vec![0; s.len()], &stop)?)
}

/// The `[1, 1, 1, size]` array `kept` holds, or `make`'s, kept in its place.
fn kept_row(
    kept: &RefCell<Option<Array>>,
    size: usize,
    make: impl FnOnce() -> Result<Array>,
) -> Result<Array> {
    let mut kept = kept.borrow_mut();
    if let Some(row) = kept.as_ref().filter(|r| r.shape()[3] as usize == size) {
        return Ok(row.clone());
    }
    let row = make()?;
    *kept = Some(row.clone());
    Ok(row)
}

/// `[1, 1, 1, size]` int32: `size - e` for each entry `e` of a ring of `size` entries.
fn ring_back(size: i32) -> Result<Array> {
    let entries = ops::arange::<_, i32>(0, size, None)?.reshape(&[1, 1, 1, -1])?;
    Ok(ops::subtract(Array::from_int(size), &entries)?)
}

/// The rings' view of a step whose queries sit at `index` `[rows, 1, tokens, 1]` (positions,
/// not negative), over rings of `size` entries for a window of `window` positions (see the
/// module docs), given [`ring_back`]`(size)` when it is kept.
fn ring_step(index: &Array, size: i32, window: i32, back: Option<Array>) -> Result<RingStep> {
    let size_scalar = Array::from_int(size);
    let back = match back {
        Some(back) => back,
        None => ring_back(size)?,
    };
    // Entry e's age seen from position q: (q - e) mod R, as (q + R - e) mod R from operands
    // that are not negative. It is written when q - age >= 0 and seen when age < window.
    let age = ops::remainder(&ops::add(index, &back)?, &size_scalar)?;
    let reach = ops::minimum(index, Array::from_int(window - 1))?;
    Ok(RingStep {
        index: ops::remainder(index, &size_scalar)?,
        mask: ops::le(&age, &reach)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys' values of positions `[start, end)` of `slot` in `layer` (each a position when
    /// the caches came from [`counting_caches`]).
    fn held(slots: &SlotKvCache, slot: usize, layer: usize, start: usize, end: usize) -> Vec<f32> {
        let parts = slots.copy_parts(slot, layer, start, end).unwrap();
        parts[0]
            .flatten(None, None)
            .unwrap()
            .as_slice::<f32>()
            .to_vec()
    }

    /// Two layers' caches of `len` positions whose keys and values are each position times
    /// `factor(layer)` (`[1, 1, len, 1]`).
    fn counting_caches(len: i32, factor: impl Fn(usize) -> f32) -> Vec<KvCache> {
        (0..2)
            .map(|layer| {
                let mut cache = KvCache::new();
                let keys = ops::arange::<_, f32>(0.0, len as f32, None)
                    .unwrap()
                    .reshape(&[1, 1, len, 1])
                    .unwrap();
                let keys = ops::multiply(&keys, Array::from_f32(factor(layer))).unwrap();
                cache.update_and_fetch(&keys, &keys).unwrap();
                cache
            })
            .collect()
    }

    /// A one-token step's index and masks are what a host's loops give, rings included
    /// (positions that wrap, rows not yet past the window, an empty slot at 0), and what a
    /// wider step's operations compute; they hold after a capacity change (the kept key
    /// positions and ring entries made anew).
    #[test]
    fn one_token_steps_give_each_rows_entries() {
        let window = 5;
        let mut slots = SlotKvCache::new(2, None).with_windows(&[Some(window), None], 1, 4);
        let positions = slots.ring_positions().unwrap() as i32;
        slots.rows = 5;
        let ints = |a: &Array| (a.shape().to_vec(), a.as_slice::<i32>().to_vec());
        let bools = |a: &Array| (a.shape().to_vec(), a.as_slice::<bool>().to_vec());
        let wrapping = [0, 3, positions - 1, positions + 2, 3 * positions + 1];
        // Rings at the full size, at another capacity, and as small as a capacity below it
        // (positions 0..4: no position wraps).
        for (capacity, lengths) in [
            (4 * positions, wrapping),
            (6 * positions, wrapping),
            (4, [0, 1, 2, 3, 3]),
        ] {
            let (capacity, size) = (capacity as usize, capacity.min(positions));
            slots.capacity = capacity;
            let (index, mask, ring) = slots.one_token_step(&lengths).unwrap();
            let ring = ring.expect("the cache has rings");
            // Row q's plain mask: its first q + 1 entries. Its ring: entry q mod R written, and
            // the entries of ages 0..=min(q, window - 1), the positions q - age at
            // (q - age) mod R.
            let mut plain = Vec::new();
            let mut ring_mask = vec![false; lengths.len() * size as usize];
            for (row, &q) in lengths.iter().enumerate() {
                plain.extend((0..capacity as i32).map(|e| e <= q));
                for age in 0..=q.min(window - 1) {
                    ring_mask[row * size as usize + (q - age).rem_euclid(size) as usize] = true;
                }
            }
            let entries: Vec<i32> = lengths.iter().map(|&q| q % size).collect();
            assert_eq!(ints(&index), (vec![5, 1, 1, 1], lengths.to_vec()));
            assert_eq!(bools(&mask), (vec![5, 1, 1, capacity as i32], plain));
            assert_eq!(ints(&ring.index), (vec![5, 1, 1, 1], entries));
            assert_eq!(bools(&ring.mask), (vec![5, 1, 1, size], ring_mask));
            // The ring entries made afresh (as a wider step makes them) agree with the kept ones.
            let wider = ring_step(&index, size, window, None).unwrap();
            assert_eq!(bools(&wider.mask), bools(&ring.mask));
            // A row past the window sees the window's entries; the empty slot its one entry.
            let seen = |row: usize| {
                let size = size as usize;
                let mask = ring.mask.as_slice::<bool>();
                mask[row * size..(row + 1) * size]
                    .iter()
                    .filter(|&&b| b)
                    .count()
            };
            let past_window = (lengths[4] + 1).min(window).min(size) as usize;
            assert_eq!((seen(4), seen(0)), (past_window, 1));
        }
    }

    /// Rejected proposals are forgotten: a rewound row's next step writes over them, its
    /// earlier positions untouched; rows that do not keep what they replace refuse.
    #[test]
    fn a_rewound_row_writes_over_its_forgotten_positions() {
        let caches = counting_caches(4, |_| 1.0);
        let mut slots = SlotKvCache::new(2, None);
        let slot = slots.push(&caches, 4, RowKv::Plain).unwrap();
        let write = |slots: &mut SlotKvCache, values: &[f32]| {
            let n = values.len();
            let step = slots.begin_step(n, &[n]).unwrap();
            let kv = Array::from_slice(values, &[1, 1, n as i32, 1]);
            for layer in 0..2 {
                slots.update_and_fetch(layer, &step, &kv, &kv).unwrap();
            }
            slots.end_step(&[n]).unwrap();
        };
        write(&mut slots, &[10.0, 11.0, 12.0]);
        slots.rewind(slot, 2).unwrap();
        assert_eq!(slots.slot_len(slot), 5);
        write(&mut slots, &[20.0]);
        assert_eq!(
            held(&slots, slot, 1, 0, 6),
            [0.0, 1.0, 2.0, 3.0, 10.0, 20.0]
        );
        assert!(slots.rewind(slot, 7).is_err(), "more than it holds");
        assert!(slots.rewind(slot + 1, 1).is_err(), "a free slot");
        let mut rings = SlotKvCache::new(2, None).with_windows(&[Some(8), None], 1, 16);
        let ring_slot = rings.push(&caches, 4, RowKv::Plain).unwrap();
        assert!(rings.rewind(ring_slot, 1).is_err());
        let mut bounded = SlotKvCache::new(2, None);
        let limit = KvLimit::new(16, 4).unwrap();
        let bounded_slot = bounded.push(&caches, 4, RowKv::Bounded(limit)).unwrap();
        assert!(bounded.rewind(bounded_slot, 1).is_err());
    }

    /// Several rows' ranges copied in one gather ([`SlotKvCache::copy_ranges`]) equal each
    /// range's own copy, one after another: a sliding layer's ranges across its ring's wrap,
    /// and a global layer's, over two heads and three features.
    #[test]
    fn ranges_of_several_rows_copy_as_each_alone() {
        let caches = |len: i32, shift: f32| -> Vec<KvCache> {
            (0..2)
                .map(|layer| {
                    let mut cache = KvCache::new();
                    let positions = ops::arange::<_, f32>(0.0, len as f32, None)
                        .unwrap()
                        .reshape(&[1, 1, len, 1])
                        .unwrap();
                    let heads = Array::from_slice(&[0.0f32, 1000.0], &[1, 2, 1, 1]);
                    let features = Array::from_slice(&[0.0f32, 0.25, 0.5], &[1, 1, 1, 3]);
                    let keys = ops::add(ops::add(&positions, &heads).unwrap(), &features).unwrap();
                    let shift = Array::from_f32(shift + layer as f32 * 0.125);
                    let keys = ops::add(&keys, &shift).unwrap();
                    let values = ops::negative(&keys).unwrap();
                    cache.update_and_fetch(&keys, &values).unwrap();
                    cache
                })
                .collect()
        };
        // Layer 0 slides over 8 positions: a ring of 256 entries.
        let mut slots = SlotKvCache::new(2, None).with_windows(&[Some(8), None], 1, 16);
        let a = slots.push(&caches(600, 0.0), 600, RowKv::Plain).unwrap();
        let b = slots.push(&caches(530, 5000.0), 530, RowKv::Plain).unwrap();
        // 496..528 and 500..530 cross the ring's wrap at 512.
        let ranges = [(a, 496, 528), (b, 500, 530), (a, 576, 600)];
        // One memo for both layers, as a publishing shares it: the ring's entries differ from
        // the full layer's and must not be taken for them.
        let mut indices = CopyIndices::default();
        for layer in 0..2 {
            let together = slots.copy_ranges(layer, &ranges, &mut indices).unwrap();
            let alone: Vec<Vec<Array>> = ranges
                .iter()
                .map(|&(slot, start, end)| slots.copy_parts(slot, layer, start, end).unwrap())
                .collect();
            assert_eq!(together.len(), 2, "keys and values");
            for (p, part) in together.iter().enumerate() {
                let pieces: Vec<&Array> = alone.iter().map(|copy| &copy[p]).collect();
                let expected = ops::concatenate(&pieces, 2).unwrap();
                assert_eq!(part.shape(), [1, 2, 86, 3]);
                assert_eq!(part.shape(), expected.shape());
                assert_eq!(
                    part.as_slice::<f32>(),
                    expected.as_slice::<f32>(),
                    "layer {layer}, part {p}"
                );
            }
        }
        let err = slots
            .copy_ranges(
                0,
                &[(a, 300, 316), (b, 500, 516)],
                &mut CopyIndices::default(),
            )
            .unwrap_err();
        assert!(err.to_string().contains("not held"), "{err}");
    }

    /// A sliding layer's ring stops at its size while a global layer's buffers grow with the
    /// sequence; the ring hands back its last positions in order and refuses overwritten ones.
    #[test]
    fn rings_hold_the_last_positions_of_sliding_layers() {
        let len = 600;
        let caches = counting_caches(len, |layer| layer as f32 + 1.0);
        // Layer 0 slides over 8 positions: a ring of 256 (8 + 1 - 1 + 16, bucketed).
        let mut slots = SlotKvCache::new(2, None).with_windows(&[Some(8), None], 1, 16);
        let slot = slots.push(&caches, len as usize, RowKv::Plain).unwrap();
        let capacities: Vec<i32> = slots.layers.iter().map(|l| l[0].shape()[2]).collect();
        assert_eq!(capacities, [256, 768]);
        let positions = |layer, start, end| held(&slots, slot, layer, start, end);
        // Positions 500..600 cross the ring's wrap at 512 (entries 244..256, then 0..88).
        let expected: Vec<f32> = (500..600).map(|p| p as f32).collect();
        assert_eq!(positions(0, 500, 600), expected);
        assert_eq!(
            positions(1, 0, 4),
            [0.0, 2.0, 4.0, 6.0],
            "the global layer keeps all"
        );
        let err = slots.copy_parts(slot, 0, 300, 316).unwrap_err();
        assert!(err.to_string().contains("not held"), "{err}");
        // A decode step: the ring writes position 600 at entry 600 mod 256 = 88, and its mask
        // sees positions 593..=600 only.
        let step = slots.begin_step(1, &[1]).unwrap();
        let ring = step.ring.as_ref().expect("rings");
        assert_eq!(ring.index.as_slice::<i32>(), [88]);
        // The one-token step's arrays (made from its index against kept arrays) are those of the
        // wider step's operations, which a span that reaches no later token sends it through.
        let operations = slots.begin_step_with(1, &[1], &[(0, 0, 0)]).unwrap();
        let arrays = |step: &SlotStep| {
            let ring = step.ring.as_ref().expect("rings");
            let ints = |a: &Array| (a.shape().to_vec(), a.as_slice::<i32>().to_vec());
            let bools = |a: &Array| (a.shape().to_vec(), a.as_slice::<bool>().to_vec());
            (
                [ints(&step.index), ints(&step.write), ints(&ring.index)],
                [bools(&step.mask), bools(&ring.mask)],
            )
        };
        assert_eq!(arrays(&step), arrays(&operations));
        let seen: Vec<usize> = ring
            .mask
            .flatten(None, None)
            .unwrap()
            .as_slice::<bool>()
            .iter()
            .enumerate()
            .filter(|(_, &s)| s)
            .map(|(e, _)| e)
            .collect();
        assert_eq!(seen, (81..=88).collect::<Vec<_>>());
    }

    /// A span of a step's tokens that attend both ways (`begin_step_with`), past the ring's wrap:
    /// each of its queries sees its sliding window's positions and the span's later ones, in the
    /// ring and in the global layer's buffer; the other queries see what they see causally.
    #[test]
    fn spans_see_their_later_tokens_in_rings_and_buffers() {
        let len = 600;
        let caches = counting_caches(len, |_| 1.0);
        let mut slots = SlotKvCache::new(2, None).with_windows(&[Some(8), None], 16, 16);
        let slot = slots.push(&caches, len as usize, RowKv::Plain).unwrap();
        let tokens = 12;
        let step = slots
            .begin_step_with(tokens, &[tokens], &[(slot, 2, 9)])
            .unwrap();
        let last = len + tokens as i32 - 1;
        let reach = |i: i32| {
            if (2..9).contains(&i) {
                len + 8
            } else {
                len + i
            }
        };
        let ring = step.ring.as_ref().expect("rings");
        let size = ring.mask.shape()[3];
        let mask = ring.mask.flatten(None, None).unwrap();
        let mask = mask.as_slice::<bool>();
        for i in 0..tokens as i32 {
            // Entry e holds, at the step's end, the latest position written there.
            let mut seen: Vec<i32> = (0..size)
                .filter(|&e| mask[(i * size + e) as usize])
                .map(|e| last - (last - e).rem_euclid(size))
                .collect();
            seen.sort_unstable();
            let q = len + i;
            assert_eq!(
                seen,
                (q - 7..=reach(i)).collect::<Vec<_>>(),
                "ring, query {i}"
            );
        }
        let capacity = step.mask.shape()[3];
        let mask = step.mask.flatten(None, None).unwrap();
        let mask = mask.as_slice::<bool>();
        for i in 0..tokens as i32 {
            let seen: Vec<i32> = (0..capacity)
                .filter(|&e| mask[(i * capacity + e) as usize])
                .collect();
            assert_eq!(
                seen,
                (0..=reach(i)).collect::<Vec<_>>(),
                "buffer, query {i}"
            );
        }
    }

    /// The positions each query of a step sees, from the keys' values (each key holds its
    /// position) where `mask` `[1, 1, tokens, n]` is true.
    fn seen(keys: &Array, mask: &Array) -> Vec<Vec<i32>> {
        let keys: Vec<f32> = keys.flatten(None, None).unwrap().as_slice::<f32>().to_vec();
        let shape = mask.shape().to_vec();
        let mask = mask.flatten(None, None).unwrap();
        let mask = mask.as_slice::<bool>();
        let n = shape[3] as usize;
        (0..shape[2] as usize)
            .map(|i| {
                let mut seen: Vec<i32> = (0..n)
                    .filter(|&k| mask[i * n + k])
                    .map(|k| keys[k] as i32)
                    .collect();
                seen.sort_unstable();
                seen
            })
            .collect()
    }

    /// A bounded row beside an unbounded one: at every step, prefill chunks of several widths
    /// (wrapping the ring within a chunk and across chunks) then decode steps after moving to a
    /// cache of one-token steps, each query sees exactly the positions mlx_lm's rotating cache
    /// gives it (Perch's one-sequence `KvCache` with the same bound, tested against mlx_lm),
    /// and the unbounded row sees every position up to its own.
    #[test]
    fn bounded_rows_see_what_a_rotating_cache_gives() {
        let limit = KvLimit::new(10, KvLimit::KEEP).unwrap();
        let mut own = KvCache::new();
        own.limit_to(limit);
        let mut prefill = SlotKvCache::new(1, None).with_max_step_tokens(8);
        let bounded = prefill.push(&[], 0, RowKv::Bounded(limit)).unwrap();
        let plain = prefill.push(&[], 0, RowKv::Plain).unwrap();
        let mut decode = SlotKvCache::new(1, None);
        let mut len = 0;
        let positions = |from: i32, n: i32| {
            ops::arange::<_, f32>(from as f32, (from + n) as f32, None)
                .unwrap()
                .reshape(&[1, 1, n, 1])
                .unwrap()
        };
        for (i, &tokens) in [3, 8, 5, 1, 7, 2, 8, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
            .iter()
            .enumerate()
        {
            let decoding = i >= 7;
            if i == 7 {
                assert_eq!(decode.push_from(&prefill, bounded).unwrap(), 0);
                assert_eq!(decode.slot_limit(0), Some(limit));
            }
            let slots = if decoding { &mut decode } else { &mut prefill };
            let counts = vec![tokens as usize; slots.slots()];
            let step = slots.begin_step(tokens as usize, &counts).unwrap();
            // Every row writes its positions (both rows are at the same length).
            let rows = slots.rows() as i32;
            let keys = ops::broadcast_to(positions(len, tokens), &[rows, 1, tokens, 1]).unwrap();
            let cached = slots.update_and_fetch(0, &step, &keys, &keys).unwrap();
            let buffer = match cached {
                CachedKv::Dense { keys, .. } => keys,
                _ => unreachable!("a float cache"),
            };
            let row = |a: &Array, r: i32| {
                let s = a.shape().to_vec();
                slice(a, &[r, 0, 0, 0], &[r + 1, s[1], s[2], s[3]]).unwrap()
            };
            let got = seen(&row(&buffer, 0), &row(&step.mask, 0));
            own.update_and_fetch(&positions(len, tokens), &positions(len, tokens))
                .unwrap();
            let view = own.limited_fetch(tokens).unwrap();
            let held = view.keys.shape()[2];
            let mask = match view.mask {
                Some(mask) => mask,
                None => {
                    // Causal over the list (a token sees what is before it in the list).
                    let q = ops::arange::<_, i32>(held - tokens, held, None).unwrap();
                    let k = ops::arange::<_, i32>(0, held, None).unwrap();
                    ops::le(
                        k.reshape(&[1, 1, 1, -1]).unwrap(),
                        q.reshape(&[1, 1, -1, 1]).unwrap(),
                    )
                    .unwrap()
                }
            };
            let expected = seen(&view.keys, &mask);
            assert_eq!(got, expected, "step {i} ({tokens} tokens from {len})");
            if !decoding {
                let got = seen(&row(&buffer, plain as i32), &row(&step.mask, plain as i32));
                let all: Vec<Vec<i32>> = (0..tokens).map(|t| (0..=len + t).collect()).collect();
                assert_eq!(got, all, "step {i}: the unbounded row sees everything");
            }
            slots.end_step(&counts).unwrap();
            len += tokens;
        }
        // The bounded row's entries stop at its kept positions and ring; the unbounded one grows.
        assert_eq!(decode.needed_capacity(1), 4 + 6);
        assert_eq!(prefill.needed_capacity(1), 34 + 1);
        let ring = prefill.bounded_ring(limit);
        assert_eq!(ring, 10 - 4 - 1 + 8);
        let err = prefill.copy_parts(bounded, 0, 5, 8).unwrap_err();
        assert!(err.to_string().contains("not held"), "{err}");
    }

    /// A bounded row of a sliding model: its global layer keeps its kept positions and ring,
    /// while its sliding layer's ring (larger here) still holds the window's last positions,
    /// the capacity reaching that ring's size.
    #[test]
    fn a_bounded_row_keeps_the_sliding_layers_ring() {
        let len = 600;
        let caches = counting_caches(len, |_| 1.0);
        let limit = KvLimit::new(10, KvLimit::KEEP).unwrap();
        let mut slots = SlotKvCache::new(2, None).with_windows(&[Some(300), None], 1, 16);
        let slot = slots
            .push(&caches, len as usize, RowKv::Bounded(limit))
            .unwrap();
        let ring = slots.ring_positions().unwrap();
        assert!(
            ring > 300 && slots.capacity >= ring,
            "{ring} {}",
            slots.capacity
        );
        let positions = |layer, start, end| held(&slots, slot, layer, start, end);
        let last: Vec<f32> = (300..600).map(|p| p as f32).collect();
        assert_eq!(positions(0, 300, 600), last, "the sliding layer's window");
        assert_eq!(
            positions(1, 0, 4),
            [0.0, 1.0, 2.0, 3.0],
            "the kept positions"
        );
        let recent: Vec<f32> = (595..600).map(|p| p as f32).collect();
        assert_eq!(positions(1, 595, 600), recent, "the recent ones");
        assert!(
            slots.copy_parts(slot, 1, 590, 600).is_err(),
            "older ones are not held"
        );
    }

    #[test]
    fn cuda_reads_large_decode_steps_explicitly_and_the_setting_overrides() {
        let mut small = SlotKvCache::new(2, None);
        small.reshape(64, 512).unwrap();
        assert!(
            !small.read(Backend::Cuda, 1).explicit,
            "64 rows of 512 read fused"
        );
        let mut auto = SlotKvCache::new(2, None);
        auto.reshape(128, 300).unwrap();
        assert_eq!((auto.rows(), auto.capacity), (128, 512));
        let read = |cache: &SlotKvCache, backend, queries| cache.read(backend, queries).explicit;
        assert!(read(&auto, Backend::Cuda, 1));
        assert!(
            !read(&auto, Backend::Cuda, 256),
            "prompt chunks reach cuDNN"
        );
        assert!(
            !read(&auto, Backend::Metal, 1),
            "Metal's vector kernel takes masks"
        );
        assert!(!read(&auto, Backend::Cpu, 1));
        assert!(auto.read(Backend::Cuda, 1).dequantize);
        assert!(!auto.read(Backend::Metal, 1).dequantize);
        // CUDA's prompt chunks hand cuDNN an additive mask (a boolean one is broadcast to
        // every head first); Metal reads boolean masks natively.
        let additive = |backend, queries| auto.read(backend, queries).additive_mask;
        assert!(additive(Backend::Cuda, 256));
        assert!(!additive(Backend::Cuda, 1));
        assert!(!additive(Backend::Metal, 256));
        assert!(!additive(Backend::Cpu, 256));
        let fused = SlotKvCache::new(2, None).with_attention(SlotAttention::Fused);
        assert!(!fused.read(Backend::Cuda, 256).additive_mask);
        let explicit = SlotKvCache::new(2, None).with_attention(SlotAttention::Explicit);
        assert!(read(&explicit, Backend::Cpu, 256));
        let fused = SlotKvCache::new(2, None).with_attention(SlotAttention::Fused);
        assert!(!read(&fused, Backend::Cuda, 1));
    }
}
