//! The KV content of the block pool's cached blocks: for each block that is a prefix-cache entry,
//! its keys and values in every layer, `[1, kv_heads, block_size, head_dim]` each, in the format
//! of the engine's caches (float, or quantized parts: see `cache.rs`).
//!
//! Running sequences compute in contiguous per-sequence caches (see `kv_cache_manager.rs` for the
//! measurement behind that); the store receives a copy of each full block once, when it is
//! registered in the prefix cache, and gives copies back when a later request hits it. A block's
//! content is dropped when the pool hands the block out again (eviction).
//!
//! # Bounded layers: sliding windows and recurrent states
//! A block's content is two parts, as vLLM's hybrid KV cache manager keeps a group of blocks per
//! kind of layer: the full-attention layers' KV, kept while the block is cached, and the
//! *bounded* layers' (those whose cache per sequence does not grow with its length), kept for
//! a bounded number of bytes, least recently used dropped first (`max_bounded_bytes`): a
//! dropped block keeps its full-attention KV and still serves hits that do not need the rest.
//! - A sliding-window layer (window `W`) attends to its last `W` positions: a hit ending at
//!   position `P` reads only the blocks from position `P - W + 1` on in that layer
//!   ([`KvCache::positions_to_skip`]). A long conversation's early blocks are only ever read by
//!   hits that end near them, so keeping every layer of every block would make the prefix cache
//!   grow with all layers (Gemma 3: 5 of 6 sliding) where the sequences themselves grow with the
//!   global layers only. A hit ends at the last block whose window's blocks all hold their
//!   sliding parts ([`BlockStore::usable_blocks`]); a sequence that recomputes blocks after that
//!   end gives them their sliding parts back ([`BlockStore::put_bounded`]). Sliding parts take
//!   blocks of the pool ([`BlockStore::with_pool_charge`]; the pool's own blocks count the
//!   global layers only, see `perch_sched::budget::KvBudget`) and give them up first when a sequence
//!   needs blocks.
//! - A linear-attention layer (Gated DeltaNet) has no positions to split into blocks: its cache
//!   is a recurrent state after the last token computed (mlx_lm's `ArraysCache`). A block keeps
//!   that layer's state only when the sequence's state was exactly at the block's end when the
//!   block was copied out: prefill chunks of hybrid models end on block boundaries
//!   ([`perch_sched::scheduler::align_chunk_to_block`]), and a decoding sequence keeps its state from
//!   the last boundary it crossed. A prefix hit on a hybrid model ends at a block that holds the
//!   state; the attention layers' KV before it comes from every block as usual. States are large
//!   (Qwen3-Next's layout: 36 linear layers x `[32 value heads, 128, 128]` float32 = 72 MiB per
//!   block that holds them).

use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use mlx_rs::{ops, Array};

use crate::error::Result;
use crate::kv::cache::KvCache;
use perch_sched::block_pool::BlockId;
use perch_sched::kv_cache_manager::BlockContents;

/// The KV parts of one block, one list per layer ([`KvCache::parts`]); a layer kept in the
/// other part of the block ([`Content`]) has an empty list.
type BlockKv = Vec<Vec<Array>>;

/// One part of a block's content.
enum Piece {
    /// The block's own arrays.
    Own(BlockKv),
    /// Block `index` of `len` consecutive blocks copied out at once ([`BlockStore::put_run`]):
    /// each array `[1, kv_heads, len * block_size, head_dim]`. The copy lives while any of its
    /// blocks does: the store's bytes count it once while any of its blocks holds it; the bounded
    /// parts' budget counts each block's share of it.
    InRun {
        run: Rc<BlockKv>,
        index: usize,
        len: usize,
    },
}

impl Piece {
    fn nbytes(&self) -> usize {
        match self {
            Piece::Own(kv) => kv_nbytes(kv),
            Piece::InRun { run, len, .. } => kv_nbytes(run) / len,
        }
    }

    /// Layer `layer`'s arrays (of the whole run for a block of one).
    fn layer(&self, layer: usize) -> &[Array] {
        match self {
            Piece::Own(kv) => &kv[layer],
            Piece::InRun { run, .. } => &run[layer],
        }
    }
}

/// What the store holds for one block.
struct Content {
    /// The full-attention layers' parts.
    full: Piece,
    /// The bounded layers' parts, and when they were last used (the LRU order's key); `None`
    /// when dropped, never held, or the model has no bounded layer.
    bounded: Option<(Piece, u64)>,
}

/// How a layer's cache grows with a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LayerKind {
    Full,
    Sliding,
    Recurrent,
}

/// KV content per block id; `None` for blocks that hold nothing worth keeping.
pub struct BlockStore {
    blocks: Vec<Option<Content>>,
    /// Bytes of all content held: blocks' own arrays, and each run copy's once while any block
    /// holds it (kept up to date, since stats are read often).
    nbytes: usize,
    /// Per run copy held (by address): how many blocks' pieces hold it.
    run_refs: HashMap<*const BlockKv, usize>,
    /// Per cache layer: its kind (see the module docs).
    kinds: Vec<LayerKind>,
    /// The widest sliding window; `None` without sliding layers.
    window: Option<usize>,
    /// Blocks holding bounded parts, by last use (oldest first).
    lru: BTreeMap<u64, BlockId>,
    /// Per block: the pins keeping its bounded parts ([`BlockStore::pin`]).
    pins: Vec<u32>,
    next_use: u64,
    /// Bytes of bounded parts held, at most `max_bounded_bytes` (but always the newest).
    bounded_bytes: usize,
    max_bounded_bytes: usize,
    /// `(own, of the budget)`: this store's layers against those `max_bounded_bytes` was
    /// reckoned for ([`BlockStore::set_budget_scale`]); `(1, 1)` but on a pipeline stage.
    budget_scale: (usize, usize),
    /// With [`BlockStore::with_pool_charge`]: the bytes one pool block stands for, and the
    /// blocks the store holds for its bounded bytes.
    charge: Option<(usize, Vec<BlockId>)>,
}

fn kv_nbytes(kv: &BlockKv) -> usize {
    kv.iter().flatten().map(Array::nbytes).sum()
}

impl BlockStore {
    /// Pinned bounded parts hold at most the bounded parts' budget divided by this.
    pub const PINNED_PARTS_SHARE: usize = 2;

    /// A store for `num_blocks` blocks of a model whose layers all keep every position.
    pub fn new(num_blocks: usize) -> Self {
        Self {
            blocks: (0..num_blocks).map(|_| None).collect(),
            nbytes: 0,
            run_refs: HashMap::new(),
            kinds: Vec::new(),
            window: None,
            lru: BTreeMap::new(),
            pins: vec![0; num_blocks],
            next_use: 0,
            bounded_bytes: 0,
            max_bounded_bytes: 0,
            budget_scale: (1, 1),
            charge: None,
        }
    }

    /// Makes the bounded parts take blocks of the pool: one for each `block_bytes` bytes of
    /// them (rounded up), which the engine takes from the pool and gives back
    /// ([`BlockStore::blocks_to_charge`]) and which the parts give up, least recently used
    /// first, when a sequence needs blocks ([`BlockStore::drop_least_recent`]). Sliding layers'
    /// blocks then compete for the pool with every other cached block, instead of a share of
    /// the budget of their own.
    pub fn with_pool_charge(mut self, block_bytes: usize) -> Self {
        self.charge = (block_bytes > 0).then(|| (block_bytes, Vec::new()));
        self
    }

    /// Counts `piece` in [`BlockStore::nbytes`] as held (`add`) or let go: its own arrays, or
    /// its run copy's once, from the first block that holds it to the last.
    fn account(&mut self, piece: &Piece, add: bool) {
        match piece {
            Piece::Own(kv) if add => self.nbytes += kv_nbytes(kv),
            Piece::Own(kv) => self.nbytes -= kv_nbytes(kv),
            Piece::InRun { run, .. } => {
                let key = Rc::as_ptr(run);
                let refs = self.run_refs.entry(key).or_insert(0);
                if add {
                    *refs += 1;
                    if *refs == 1 {
                        self.nbytes += kv_nbytes(run);
                    }
                } else {
                    *refs -= 1;
                    if *refs == 0 {
                        self.run_refs.remove(&key);
                        self.nbytes -= kv_nbytes(run);
                    }
                }
            }
        }
    }

    /// [`BlockStore::account`] for both parts of a block's content.
    fn account_content(&mut self, content: &Content, add: bool) {
        self.account(&content.full, add);
        if let Some((piece, _)) = &content.bounded {
            self.account(piece, add);
        }
    }

    /// Marks the bounded layers of a model whose caches are `layers` (one per cache layer:
    /// sliding-window and recurrent ones, see the module docs), keeping at most
    /// `max_bounded_bytes` of their parts (and always the newest block's).
    pub fn with_layers(mut self, layers: &[KvCache], max_bounded_bytes: usize) -> Self {
        // A hybrid model's blocks keep states only at some boundaries: its sliding layers (if
        // it had any) keep every block, as full-attention layers do.
        let hybrid = layers.iter().any(KvCache::is_recurrent);
        self.kinds = layers
            .iter()
            .map(|layer| match (layer.is_recurrent(), layer.window()) {
                (true, _) => LayerKind::Recurrent,
                (false, Some(_)) if !hybrid => LayerKind::Sliding,
                (false, _) => LayerKind::Full,
            })
            .collect();
        self.window = layers
            .iter()
            .filter(|_| !hybrid)
            .filter_map(|l| l.window())
            .map(|w| w.max(1) as usize)
            .max();
        self.max_bounded_bytes = max_bounded_bytes;
        self
    }

    /// Cache layers the store knows the kinds of (0 for [`BlockStore::new`]).
    pub fn num_layers(&self) -> usize {
        self.kinds.len()
    }

    fn has_bounded_layers(&self) -> bool {
        self.kinds.iter().any(|k| *k != LayerKind::Full)
    }

    /// Whether cache layer `layer` is a sliding-window or recurrent layer, kept in a block's
    /// bounded part.
    pub fn is_bounded(&self, layer: usize) -> bool {
        self.kinds.get(layer).is_some_and(|k| *k != LayerKind::Full)
    }

    /// Whether block `id` holds content in every layer: its full-attention KV, and the bounded
    /// layers' parts when the model has such layers (a recurrent state after the block, a
    /// sliding layer's KV).
    pub fn holds_every_layer(&self, id: BlockId) -> bool {
        match &self.blocks[id.0 as usize] {
            Some(content) => content.bounded.is_some() || !self.has_bounded_layers(),
            None => false,
        }
    }

    /// How many of `blocks` from the first hold every layer: what a cache that keeps every
    /// position can load (a prompt-cache file's state, see `BatchGenerator::compute_prefix`).
    pub fn complete_blocks(&self, blocks: &[BlockId]) -> usize {
        if self.has_recurrent_layers() {
            return self.usable_blocks(blocks, 1);
        }
        blocks
            .iter()
            .position(|id| !self.holds_every_layer(*id))
            .unwrap_or(blocks.len())
    }

    /// Marks as used now the bounded parts that a hit ending after `blocks` reads
    /// ([`BlockStore::read_by_hit`]), so they are dropped last.
    pub fn touch(&mut self, blocks: &[BlockId], block_size: usize) {
        let read = self.read_by_hit(blocks, block_size);
        for id in read {
            let next = self.next_use;
            if let Some(Some(Content {
                bounded: Some((_, used)),
                ..
            })) = self.blocks.get_mut(id.0 as usize)
            {
                self.lru.remove(used);
                *used = next;
                self.lru.insert(next, *id);
                self.next_use += 1;
            }
        }
    }

    /// A pipeline stage's store, whose layers are `own` of the `budgeted` whose bytes
    /// `max_bounded_bytes` was reckoned for (rank 0's: every stage holds the same kinds of layers
    /// in the same proportions, `engine::batch::lockstep::join_ranks`): its own bytes are
    /// weighed against that budget scaled exactly, so that every stage keeps and drops the same
    /// blocks' parts.
    pub fn set_budget_scale(&mut self, own: usize, budgeted: usize) {
        self.budget_scale = (own.max(1), budgeted.max(1));
    }

    /// `(own, budgeted)` layers ([`BlockStore::set_budget_scale`]).
    pub fn budget_scale(&self) -> (usize, usize) {
        self.budget_scale
    }

    /// Whether `bytes` of this store's layers exceed `budget` bytes of the budgeted layers
    /// ([`BlockStore::set_budget_scale`]).
    fn beyond(&self, bytes: usize, budget: usize) -> bool {
        let (own, budgeted) = self.budget_scale;
        bytes as u128 * budgeted as u128 > budget as u128 * own as u128
    }

    /// Drops the bounded parts of the least recently used blocks beyond `max_bounded_bytes`,
    /// keeping the newest.
    fn bound(&mut self) {
        while self.beyond(self.bounded_bytes, self.max_bounded_bytes) && self.lru.len() > 1 {
            if !self.drop_least_recent() {
                break;
            }
        }
    }

    /// Bytes of bounded layers' parts held (sliding layers' KV, recurrent states).
    #[cfg(test)]
    pub fn bounded_bytes(&self) -> usize {
        self.bounded_bytes
    }

    /// Splits a block's per-layer `kv` into its full-attention part and its bounded part
    /// (`None` when a bounded layer has nothing, or the model has no bounded layer).
    fn split(&self, kv: BlockKv) -> (BlockKv, Option<BlockKv>) {
        if !self.has_bounded_layers() {
            return (kv, None);
        }
        let mut full = Vec::with_capacity(kv.len());
        let mut bounded = Vec::with_capacity(kv.len());
        let mut complete = true;
        for (layer, parts) in kv.into_iter().enumerate() {
            if self.is_bounded(layer) {
                complete &= !parts.is_empty();
                bounded.push(parts);
                full.push(Vec::new());
            } else {
                full.push(parts);
                bounded.push(Vec::new());
            }
        }
        (full, complete.then_some(bounded))
    }

    /// Keeps `content` as block `id`'s, its bounded part (if any) the most recently used.
    fn insert(&mut self, id: BlockId, full: Piece, bounded: Option<Piece>) {
        self.clear(id);
        let bounded = bounded.map(|piece| {
            let used = self.next_use;
            self.next_use += 1;
            self.lru.insert(used, id);
            self.bounded_bytes += piece.nbytes();
            (piece, used)
        });
        let content = Content { full, bounded };
        self.account_content(&content, true);
        self.blocks[id.0 as usize] = Some(content);
    }

    /// Copies block `index` (positions `index * block_size ..`) of a sequence's `cache` (one
    /// [`KvCache`] per layer) into the store as block `id`. Lazy: evaluate [`BlockStore::state`].
    pub fn put(
        &mut self,
        id: BlockId,
        cache: &[KvCache],
        index: usize,
        block_size: usize,
    ) -> Result<()> {
        let kv = self.copy_block(cache, index, block_size, |_| true)?;
        self.put_parts(id, kv);
        Ok(())
    }

    /// Block `index` of a sequence's `cache` (one [`KvCache`] per layer), copied out of the
    /// layers `copied` keeps ([`KvCache::block_parts`]; an empty list for the others). Lazy.
    fn copy_block(
        &self,
        cache: &[KvCache],
        index: usize,
        block_size: usize,
        copied: impl Fn(usize) -> bool,
    ) -> Result<BlockKv> {
        let (start, end) = block_range(index, block_size);
        cache
            .iter()
            .enumerate()
            .map(|(layer, cache)| match copied(layer) {
                true => cache.block_parts(start, end),
                false => Ok(Vec::new()),
            })
            .collect()
    }

    /// Keeps `kv` (per layer, the block's parts in buffers of their own, as
    /// [`KvCache::block_parts`] returns them) as block `id`'s content.
    pub fn put_parts(&mut self, id: BlockId, kv: Vec<Vec<Array>>) {
        let (full, bounded) = self.split(kv);
        self.insert(id, Piece::Own(full), bounded.map(Piece::Own));
        self.bound();
    }

    /// Keeps `run` (per layer, parts of `ids.len()` consecutive blocks in buffers of their own,
    /// `[1, kv_heads, ids.len() * block_size, head_dim]` each) as the content of `ids`, in order,
    /// without an array per block: a slot sequence's prefill chunk copies out its blocks at
    /// once (up to `batch::PUBLISH_RUN_TOKENS` positions), and a view per block and layer part
    /// cost the host more than the copies (four 8,192-token prompts on a GPU made 13,000 views
    /// a step). Never for hybrid models' blocks,
    /// which keep states.
    pub fn put_run(&mut self, ids: &[BlockId], run: BlockKv) {
        let (full, bounded) = self.split(run);
        let (full, bounded) = (Rc::new(full), bounded.map(Rc::new));
        let len = ids.len();
        for (index, &id) in ids.iter().enumerate() {
            let piece = |run: &Rc<BlockKv>| Piece::InRun {
                run: Rc::clone(run),
                index,
                len,
            };
            self.insert(id, piece(&full), bounded.as_ref().map(piece));
        }
        self.bound();
    }

    /// Gives block `id`, which holds its full-attention KV but not its bounded layers' parts,
    /// those parts (per layer, what [`KvCache::block_parts`] gives; full-attention layers'
    /// entries ignored): a sequence that recomputed blocks of its prefix hit (the hit ended
    /// before them, see [`BlockStore::usable_blocks`]) leaves their sliding layers' KV, or a
    /// hybrid model's states at the end of the hit, for the next prompt that shares them.
    pub fn put_bounded(&mut self, id: BlockId, parts: Vec<Vec<Array>>) {
        if self.holds_every_layer(id) || !self.contains(id) {
            return;
        }
        let (_, Some(bounded)) = self.split(parts) else {
            return;
        };
        let content = self.blocks[id.0 as usize].take().expect("held");
        self.account_content(&content, false);
        self.insert(id, content.full, Some(Piece::Own(bounded)));
        self.bound();
    }

    /// [`BlockStore::put_bounded`] with block `index`'s bounded layers' parts copied from a
    /// sequence's `cache` (one [`KvCache`] per layer, holding those positions). Lazy, as
    /// [`BlockStore::put`].
    pub fn put_bounded_from(
        &mut self,
        id: BlockId,
        cache: &[KvCache],
        index: usize,
        block_size: usize,
    ) -> Result<()> {
        let parts = self.copy_block(cache, index, block_size, |layer| self.is_bounded(layer))?;
        self.put_bounded(id, parts);
        Ok(())
    }

    /// Whether `id` holds content.
    pub fn contains(&self, id: BlockId) -> bool {
        self.blocks[id.0 as usize].is_some()
    }

    /// Appends the content of `ids`, in order, to an empty per-layer `cache`. A sliding layer's
    /// cache that may drop positions skips the leading blocks its window no longer reaches from
    /// the end of the prefix ([`KvCache::positions_to_skip`]); a recurrent layer takes the last
    /// block's state. Errors when a block holds nothing (a broken invariant: every cached block
    /// has content), or lacks a bounded layer's part that the load needs (ask
    /// [`BlockStore::usable_blocks`] first).
    pub fn load_into(
        &self,
        ids: &[BlockId],
        cache: &mut [KvCache],
        block_size: usize,
    ) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let blocks = ids
            .iter()
            .map(|id| {
                self.blocks[id.0 as usize]
                    .as_ref()
                    .ok_or_else(|| missing(*id, "no KV content"))
            })
            .collect::<Result<Vec<_>>>()?;
        let positions = (ids.len() * block_size) as i32;
        for (layer, layer_cache) in cache.iter_mut().enumerate() {
            let skip = layer_cache.positions_to_skip(positions, block_size as i32);
            let first = match layer_cache.is_recurrent() {
                true => ids.len() - 1,
                false => skip as usize / block_size,
            };
            let pieces = (first..ids.len())
                .map(|i| match (self.is_bounded(layer), &blocks[i].bounded) {
                    (false, _) => Ok(&blocks[i].full),
                    (true, Some((piece, _))) => Ok(piece),
                    (true, None) => Err(missing(
                        ids[i],
                        &format!("no KV or recurrent state for layer {layer}"),
                    )),
                })
                .collect::<Result<Vec<&Piece>>>()?;
            if layer_cache.is_recurrent() {
                layer_cache.append_block_parts(pieces[0].layer(layer), positions)?;
                continue;
            }
            layer_cache.start_at(skip);
            if pieces.is_empty() {
                continue;
            }
            let parts = layer_pieces(&pieces, layer, block_size)?
                .into_iter()
                .map(|pieces| Ok(ops::concatenate(&pieces, 2)?))
                .collect::<Result<Vec<Array>>>()?;
            layer_cache.append_parts(&parts)?;
        }
        Ok(())
    }

    /// Arrays to evaluate after [`BlockStore::put`] so the copies hold data, not graphs that
    /// keep a sequence's whole cache alive.
    pub fn state(&self, ids: &[BlockId]) -> Vec<&Array> {
        let mut arrays = Vec::new();
        // A run's arrays once, however many of its blocks are asked for.
        let mut last_runs: [Option<&Rc<BlockKv>>; 2] = [None, None];
        for content in ids
            .iter()
            .filter_map(|id| self.blocks[id.0 as usize].as_ref())
        {
            let pieces = [
                Some(&content.full),
                content.bounded.as_ref().map(|(p, _)| p),
            ];
            for (piece, last) in pieces.into_iter().zip(&mut last_runs) {
                match piece {
                    Some(Piece::Own(kv)) => arrays.extend(kv.iter().flatten()),
                    Some(Piece::InRun { run, .. })
                        if !last.is_some_and(|last| Rc::ptr_eq(last, run)) =>
                    {
                        arrays.extend(run.iter().flatten());
                        *last = Some(run);
                    }
                    Some(Piece::InRun { .. }) | None => {}
                }
            }
        }
        arrays
    }

    /// Bytes of KV content held.
    pub fn nbytes(&self) -> usize {
        self.nbytes
    }
}

/// Layer `layer`'s content of consecutive blocks' pieces, per part: the arrays to concatenate
/// along the positions, a block's own array or one slice for each stretch of blocks of the
/// same run.
fn layer_pieces(blocks: &[&Piece], layer: usize, block_size: usize) -> Result<Vec<Vec<Array>>> {
    let mut pieces: Vec<Vec<Array>> = vec![Vec::new(); blocks[0].layer(layer).len()];
    let mut i = 0;
    while i < blocks.len() {
        match blocks[i] {
            Piece::Own(kv) => {
                for (piece, part) in pieces.iter_mut().zip(&kv[layer]) {
                    piece.push(part.clone());
                }
                i += 1;
            }
            Piece::InRun { run, index, .. } => {
                // The following blocks that are the run's next ones.
                let mut count = 1;
                while let Some(Piece::InRun {
                    run: next,
                    index: next_index,
                    ..
                }) = blocks.get(i + count)
                {
                    if !Rc::ptr_eq(run, next) || *next_index != index + count {
                        break;
                    }
                    count += 1;
                }
                let (from, to) = (
                    (index * block_size) as i32,
                    ((index + count) * block_size) as i32,
                );
                for (piece, part) in pieces.iter_mut().zip(&run[layer]) {
                    let s = part.shape();
                    piece.push(crate::nn::mlx_ext::slice(
                        part,
                        &[0, 0, from, 0],
                        &[s[0], s[1], to, s[3]],
                    )?);
                }
                i += count;
            }
        }
    }
    Ok(pieces)
}

/// Positions `start..end` of block `index` of a sequence.
pub(crate) fn block_range(index: usize, block_size: usize) -> (i32, i32) {
    (
        (index * block_size) as i32,
        ((index + 1) * block_size) as i32,
    )
}

fn missing(id: BlockId, what: &str) -> crate::error::EngineError {
    mlx_rs::error::Exception::from(format!("prefix-cache block {} has {what}", id.0).as_str())
        .into()
}

impl BlockContents for BlockStore {
    /// How many of a prefix hit's `blocks` (consecutive from the first prompt token, all
    /// holding content) a sequence can start after, loading only what its layers read
    /// ([`BlockStore::load_into`] into caches that allow dropping what a window left,
    /// [`KvCache::release_before`]): all of them without bounded layers; with recurrent layers,
    /// up to the last block that holds their states; with sliding layers, up to the last end
    /// whose window's blocks all hold their sliding parts.
    fn usable_blocks(&self, blocks: &[BlockId], block_size: usize) -> usize {
        if self.has_recurrent_layers() {
            return blocks
                .iter()
                .rposition(|id| self.holds_every_layer(*id))
                .map_or(0, |i| i + 1);
        }
        let Some(window) = self.window else {
            return blocks.len();
        };
        // Blocks in a row holding every layer, ending at each block.
        let mut held = Vec::with_capacity(blocks.len());
        let mut run = 0;
        for id in blocks {
            run = if self.holds_every_layer(*id) {
                run + 1
            } else {
                0
            };
            held.push(run);
        }
        (1..=blocks.len())
            .rev()
            .find(|&end| {
                let first = (end * block_size + 1).saturating_sub(window) / block_size;
                held[end - 1] >= end - first
            })
            .unwrap_or(0)
    }

    /// The blocks of `blocks` (a hit's, from the first) whose bounded parts a hit ending after
    /// them reads: the last block's states, or the sliding window's blocks.
    fn read_by_hit<'a>(&self, blocks: &'a [BlockId], block_size: usize) -> &'a [BlockId] {
        let first = match self.window {
            Some(window) if !self.has_recurrent_layers() => {
                (blocks.len() * block_size + 1).saturating_sub(window) / block_size
            }
            _ => blocks.len().saturating_sub(1),
        };
        &blocks[first.min(blocks.len())..]
    }

    /// Keeps the bounded parts of `ids` from being dropped until as many
    /// [`BlockStore::unpin`]s: a sequence admitted with a hit that reads them holds them while
    /// it runs, so that the allocations after it (its own included) cannot take them from it,
    /// and the next prompt that shares its prefix finds them (under a pool too small for
    /// everything, unpinned parts go first).
    fn pin(&mut self, ids: &[BlockId]) {
        for id in ids {
            self.pins[id.0 as usize] += 1;
        }
    }

    /// Undoes a [`BlockStore::pin`] of `ids`.
    fn unpin(&mut self, ids: &[BlockId]) {
        for id in ids {
            let pins = &mut self.pins[id.0 as usize];
            *pins = pins.saturating_sub(1);
        }
    }

    /// Whether the bounded parts pinned now, with those of `ids`, stay within half their
    /// budget ([`BlockStore::PINNED_PARTS_SHARE`]): a prefix pinned for a client keeps one
    /// block's recurrent states (72 MiB on Qwen3-Next) or a sliding window's KV, which the
    /// budget's least-recently-used order would otherwise drop.
    fn pinned_parts_fit(&self, ids: &[BlockId]) -> bool {
        let bytes = |id: &BlockId| {
            self.blocks[id.0 as usize]
                .as_ref()
                .and_then(|content| content.bounded.as_ref())
                .map_or(0, |(piece, _)| piece.nbytes())
        };
        let pinned: usize = self
            .lru
            .values()
            .filter(|id| self.pins[id.0 as usize] > 0)
            .map(bytes)
            .sum();
        let added: usize = ids
            .iter()
            .filter(|id| self.pins[id.0 as usize] == 0)
            .map(bytes)
            .sum();
        !self.beyond(
            pinned + added,
            self.max_bounded_bytes / Self::PINNED_PARTS_SHARE,
        )
    }

    /// Whether some layer is recurrent: prefix hits must end at a block with a state.
    fn has_recurrent_layers(&self) -> bool {
        self.kinds.contains(&LayerKind::Recurrent)
    }

    /// Drops the content of `id` (the block was handed out again or forgotten).
    fn clear(&mut self, id: BlockId) {
        if let Some(content) = self.blocks[id.0 as usize].take() {
            self.account_content(&content, false);
            if let Some((piece, used)) = &content.bounded {
                self.lru.remove(used);
                self.bounded_bytes -= piece.nbytes();
            }
        }
    }

    /// Drops the least recently used block's bounded parts, pinned ones
    /// ([`BlockStore::pin`]) left; false when none is left to drop.
    fn drop_least_recent(&mut self) -> bool {
        let Some((&used, &id)) = self
            .lru
            .iter()
            .find(|(_, id)| self.pins[id.0 as usize] == 0)
        else {
            return false;
        };
        self.lru.remove(&used);
        let content = self.blocks[id.0 as usize]
            .as_mut()
            .expect("a block in the LRU order holds content");
        if let Some((piece, _)) = content.bounded.take() {
            self.bounded_bytes -= piece.nbytes();
            self.account(&piece, false);
        }
        true
    }

    /// Blocks held for the bounded parts.
    fn held_blocks(&self) -> usize {
        self.charge.as_ref().map_or(0, |(_, held)| held.len())
    }

    /// With a pool charge: how many more blocks the bounded parts need from the pool (`> 0`),
    /// or how many of those held they no longer need (`< 0`); 0 without one.
    fn blocks_to_charge(&self) -> isize {
        match &self.charge {
            Some((block_bytes, held)) => {
                self.bounded_bytes.div_ceil(*block_bytes) as isize - held.len() as isize
            }
            None => 0,
        }
    }

    /// Adds `ids` (taken from the pool) to the blocks held for the bounded parts.
    fn hold_blocks(&mut self, ids: Vec<BlockId>) {
        if let Some((_, held)) = &mut self.charge {
            held.extend(ids);
        }
    }

    /// Gives up `n` of the blocks held for the bounded parts (to return to the pool).
    fn release_blocks(&mut self, n: usize) -> Vec<BlockId> {
        match &mut self.charge {
            Some((_, held)) => held.split_off(held.len() - n.min(held.len())),
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;

    /// A block of a two-layer hybrid model: layer 0 attention (keys, values), layer 1 recurrent
    /// (conv, ssm of 64 float32 each = 512 bytes) or nothing.
    fn block(with_state: bool) -> BlockKv {
        let kv = vec![ops::zeros::<f32>(&[1, 1, 4, 8]).unwrap(); 2];
        let state = match with_state {
            true => vec![ops::zeros::<f32>(&[64]).unwrap(); 2],
            false => Vec::new(),
        };
        vec![kv, state]
    }

    fn hybrid(max_bounded_bytes: usize, num_blocks: usize) -> BlockStore {
        BlockStore::new(num_blocks)
            .with_layers(&[KvCache::new(), KvCache::recurrent()], max_bounded_bytes)
    }

    #[test]
    fn recurrent_states_are_bounded_by_bytes_least_recently_used_first() {
        let mut store = hybrid(1024, 8);
        let kv_bytes = 2 * 4 * 8 * 4;
        store.put_parts(BlockId(0), block(true));
        store.put_parts(BlockId(1), block(false));
        store.put_parts(BlockId(2), block(true));
        assert!(store.holds_every_layer(BlockId(0)) && store.holds_every_layer(BlockId(2)));
        assert!(!store.holds_every_layer(BlockId(1)) && store.contains(BlockId(1)));
        assert_eq!(store.bounded_bytes(), 1024);
        // A hit ending at block 0 makes block 2's state the least recently used.
        store.touch(&[BlockId(0)], 4);
        store.put_parts(BlockId(3), block(true));
        assert!(
            !store.holds_every_layer(BlockId(2)),
            "least recently used state dropped"
        );
        assert!(store.contains(BlockId(2)), "its KV stays");
        assert!(store.holds_every_layer(BlockId(0)) && store.holds_every_layer(BlockId(3)));
        assert_eq!(store.bounded_bytes(), 1024);
        assert_eq!(store.nbytes(), 4 * kv_bytes + 1024);
        // Hits end at the last block with a state.
        let chain = [BlockId(0), BlockId(1), BlockId(2), BlockId(3)];
        assert_eq!(store.usable_blocks(&chain[..3], 4), 1);
        assert_eq!(store.usable_blocks(&chain, 4), 4);
        // Eviction takes the state's bytes with the block.
        store.clear(BlockId(3));
        assert_eq!(store.bounded_bytes(), 512);
        assert_eq!(store.nbytes(), 3 * kv_bytes + 512);
        // A state given back to a block that has none (a sequence recomputed up to it).
        store.put_bounded(BlockId(1), block(true));
        assert!(store.holds_every_layer(BlockId(1)));
        assert_eq!(store.nbytes(), 3 * kv_bytes + 1024);
        // The newest state stays even when it alone is over the bound.
        let mut tight = hybrid(100, 2);
        tight.put_parts(BlockId(0), block(true));
        tight.put_parts(BlockId(1), block(true));
        assert!(!tight.holds_every_layer(BlockId(0)) && tight.holds_every_layer(BlockId(1)));
    }

    /// A pipeline stage whose layers are half of those the budget was reckoned for keeps
    /// exactly the states the budgeted stage keeps: its 512-byte states against 1,024 budgeted
    /// bytes hold two, as 1,024-byte states would against 2,048 (rank 0's choice).
    #[test]
    fn a_stage_weighs_its_states_against_the_budget_scaled_by_its_layers() {
        let mut store = hybrid(2048, 8);
        store.set_budget_scale(1, 2);
        for id in 0..3 {
            store.put_parts(BlockId(id), block(true));
        }
        assert!(
            !store.holds_every_layer(BlockId(0)),
            "the third state is over the bound"
        );
        assert!(store.holds_every_layer(BlockId(1)) && store.holds_every_layer(BlockId(2)));
        assert_eq!(store.bounded_bytes(), 1024);
        // Unscaled, the same bytes keep all three.
        let mut whole = hybrid(2048, 8);
        for id in 0..3 {
            whole.put_parts(BlockId(id), block(true));
        }
        assert_eq!(whole.bounded_bytes(), 1536);
    }

    /// One layer's keys and values over positions `from..to`: position p holds p in every
    /// feature, `[1, 1, to - from, 8]` each.
    fn positions(from: i32, to: i32) -> Array {
        let p = ops::arange::<_, f32>(from as f32, to as f32, None).unwrap();
        ops::broadcast_to(p.reshape(&[1, 1, -1, 1]).unwrap(), &[1, 1, to - from, 8]).unwrap()
    }

    /// The positions a cache layer holds, from its keys' first feature.
    fn held(cache: &KvCache) -> Vec<f32> {
        let keys = match cache.fetch().unwrap() {
            crate::kv::cache::CachedKv::Dense { keys, .. } => keys,
            _ => unreachable!("a float cache"),
        };
        let keys = keys.index((.., 0, .., 0)).flatten(None, None).unwrap();
        keys.as_slice::<f32>().to_vec()
    }

    /// A sliding layer's blocks are kept for a bounded number of bytes, oldest use dropped first,
    /// while the global layer keeps every block; hits end where the window's blocks are all
    /// held, load only those, and blocks given their sliding parts back serve hits again.
    #[test]
    fn sliding_layers_blocks_are_bounded_and_hits_end_where_the_window_is_held() {
        let block_size = 4;
        // Layer 0 global, layer 1 sliding over 8 positions: a hit ending at position 4e reads
        // the sliding layer's blocks from (4e + 1 - 8) / 4 on, two blocks.
        let layers = || vec![KvCache::new(), KvCache::new().with_window(8)];
        let part_bytes = 2 * 4 * 8 * 4;
        let mut store = BlockStore::new(8).with_layers(&layers(), 3 * part_bytes);
        let kv = |b: i32| {
            let p = positions(4 * b, 4 * b + 4);
            vec![vec![p.clone(), p.clone()], vec![p.clone(), p]]
        };
        let chain: Vec<BlockId> = (0..6).map(BlockId).collect();
        for (b, &id) in chain[..2].iter().enumerate() {
            store.put_parts(id, kv(b as i32));
        }
        // Blocks 2..6 as one run copy.
        let run = |from: i32, to: i32| {
            let p = positions(4 * from, 4 * to);
            vec![vec![p.clone(), p.clone()], vec![p.clone(), p]]
        };
        store.put_run(&chain[2..6], run(2, 6));
        // The sliding parts of blocks 3, 4, 5 stay (three blocks' worth); every global part does.
        let holding: Vec<bool> = chain
            .iter()
            .map(|id| store.holds_every_layer(*id))
            .collect();
        assert_eq!(holding, [false, false, false, true, true, true]);
        assert!(chain.iter().all(|id| store.contains(*id)));
        assert_eq!(store.bounded_bytes(), 3 * part_bytes);
        // Every global part, and the sliding run copy whole (block 2's share of it lives on in
        // the copy that blocks 3..6 hold), as the memory is.
        assert_eq!(store.nbytes(), 10 * part_bytes);
        assert_eq!(store.usable_blocks(&chain, block_size), 6);
        assert_eq!(store.usable_blocks(&chain[..3], block_size), 0);
        assert_eq!(store.complete_blocks(&chain), 0);
        // A sequence that recomputed blocks 1 and 2 gives them their sliding parts back; the
        // least recently used (3, 4) go.
        store.put_bounded(BlockId(1), kv(1));
        store.put_bounded(BlockId(2), kv(2));
        assert_eq!(store.usable_blocks(&chain[..3], block_size), 3);
        assert_eq!(store.usable_blocks(&chain, block_size), 3);
        // A hit touching blocks 1 and 2 keeps them over block 5 when more come.
        store.touch(&chain[..3], block_size);
        store.put_bounded(BlockId(4), kv(4));
        assert!(!store.holds_every_layer(BlockId(5)));
        assert!(store.holds_every_layer(BlockId(1)) && store.holds_every_layer(BlockId(2)));
        // The hit loads every global position and the sliding layer's window blocks only.
        let mut cache = layers();
        for layer in &mut cache {
            layer.release_before(12);
        }
        store
            .load_into(&chain[..3], &mut cache, block_size)
            .unwrap();
        assert_eq!(
            held(&cache[0]),
            (0..12).map(|p| p as f32).collect::<Vec<_>>()
        );
        assert_eq!(cache[1].first_position(), 4);
        assert_eq!(
            held(&cache[1]),
            (4..12).map(|p| p as f32).collect::<Vec<_>>()
        );
        // A cache that keeps every position cannot load blocks without their sliding parts.
        let mut whole = layers();
        let err = store
            .load_into(&chain[..3], &mut whole, block_size)
            .unwrap_err();
        assert!(err.to_string().contains("block 0 has no KV"), "{err}");
        // Evicting every block leaves nothing counted (run shares included).
        for id in &chain {
            store.clear(*id);
        }
        assert_eq!((store.nbytes(), store.bounded_bytes()), (0, 0));
    }

    /// Pinned bounded parts (a running sequence's hit reads them) are passed over when parts
    /// must go; unpinned, they are the least recently used again.
    #[test]
    fn pinned_parts_are_not_dropped() {
        let mut store = hybrid(usize::MAX, 4);
        for id in 0..3 {
            store.put_parts(BlockId(id), block(true));
        }
        store.pin(&[BlockId(0)]);
        assert!(store.drop_least_recent());
        assert!(store.holds_every_layer(BlockId(0)), "pinned: kept");
        assert!(
            !store.holds_every_layer(BlockId(1)),
            "the next least recent went"
        );
        assert!(store.drop_least_recent());
        assert!(!store.drop_least_recent(), "only the pinned one is left");
        store.unpin(&[BlockId(0)]);
        assert!(store.drop_least_recent());
        assert_eq!(store.bounded_bytes(), 0);
    }

    /// Blocks kept as places in a run copy load as blocks of their own do (any stretch of them,
    /// mixed with owned blocks), and evaluate it once; its bytes count once.
    #[test]
    fn blocks_of_a_run_load_and_count_as_their_own() {
        let block_size = 4;
        // One layer of keys and values over 16 positions: position p holds p in every feature.
        let positions = |from: i32, to: i32| {
            let p = ops::arange::<_, f32>(from as f32, to as f32, None).unwrap();
            ops::broadcast_to(p.reshape(&[1, 1, -1, 1]).unwrap(), &[1, 2, to - from, 8]).unwrap()
        };
        let mut store = BlockStore::new(8);
        store.put_parts(BlockId(5), vec![vec![positions(0, 4), positions(0, 4)]]);
        store.put_run(
            &[BlockId(1), BlockId(2), BlockId(3)],
            vec![vec![positions(4, 16), positions(4, 16)]],
        );
        let block_bytes = 2 * (2 * 4 * 8) * 4;
        assert_eq!(store.nbytes(), 4 * block_bytes);
        assert_eq!(store.state(&[BlockId(1), BlockId(2), BlockId(5)]).len(), 4);
        let loaded = |ids: &[BlockId]| {
            let mut cache = vec![KvCache::new()];
            store.load_into(ids, &mut cache, block_size).unwrap();
            held(&cache[0])
        };
        let expected: Vec<f32> = (0..16).map(|p| p as f32).collect();
        let all = loaded(&[BlockId(5), BlockId(1), BlockId(2), BlockId(3)]);
        assert_eq!(all, expected);
        // The run's first block alone, after an owned block: positions 0..8.
        let two = loaded(&[BlockId(5), BlockId(1)]);
        assert_eq!(two, &expected[..8]);
        // Evicting part of a run keeps the rest readable, and its memory held (and counted)
        // until its last block goes.
        store.clear(BlockId(2));
        assert_eq!(store.nbytes(), 4 * block_bytes);
        assert!(store.contains(BlockId(3)) && store.holds_every_layer(BlockId(3)));
        store.clear(BlockId(1));
        assert_eq!(store.nbytes(), 4 * block_bytes);
        store.clear(BlockId(3));
        assert_eq!(store.nbytes(), block_bytes);
    }

    #[test]
    fn a_hit_loads_the_last_blocks_recurrent_state() {
        let mut store = hybrid(1 << 20, 4);
        store.put_parts(BlockId(0), block(false));
        store.put_parts(BlockId(1), block(true));
        let mut cache = vec![KvCache::new(), KvCache::recurrent()];
        store
            .load_into(&[BlockId(0), BlockId(1)], &mut cache, 4)
            .unwrap();
        assert_eq!(cache[0].offset(), 8);
        assert_eq!(cache[1].offset(), 8, "the state is after both blocks");
        assert!(cache[1].recurrent_state().is_some());
        // Ending at a block without states is refused, not loaded with a stale state.
        let mut cache = vec![KvCache::new(), KvCache::recurrent()];
        let err = store.load_into(&[BlockId(0)], &mut cache, 4).unwrap_err();
        assert!(err.to_string().contains("recurrent state"), "{err}");
    }
}
