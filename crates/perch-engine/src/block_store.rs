//! The KV content of the block pool's cached blocks: for each block that is a prefix-cache entry,
//! its keys and values in every layer, `[1, kv_heads, block_size, head_dim]` each, in the format
//! of the engine's caches (float, or quantized parts: see `cache.rs`).
//!
//! Running sequences compute in contiguous per-sequence caches (see `kv_cache_manager.rs` for the
//! measurement behind that); the store receives a copy of each full block once, when it is
//! registered in the prefix cache, and gives copies back when a later request hits it. A block's
//! content is dropped when the pool hands the block out again (eviction).
//!
//! # Hybrid models
//! A linear-attention layer (Gated DeltaNet) has no positions to split into blocks: its cache is
//! a recurrent state after the last token computed (mlx_lm's `ArraysCache`). A block keeps that
//! layer's state only when the sequence's state was exactly at the block's end when the block was
//! copied out: prefill chunks of hybrid models end on block boundaries
//! ([`crate::scheduler::align_chunk_to_block`]), and a decoding sequence keeps its state from the
//! last boundary it crossed. A prefix hit on a hybrid model ends at a block that holds the state
//! ([`BlockStore::has_state`]); the attention layers' KV before it comes from every block as usual.
//! States are large (Qwen3-Next's layout: 36 linear layers x `[32 value heads, 128, 128]` float32
//! = 72 MiB per block that holds them), so their bytes are bounded apart from the pool's blocks:
//! beyond `max_state_bytes` the least recently used state is dropped (its block keeps its KV and
//! can still lead to a later block that has a state).

use std::collections::VecDeque;
use std::rc::Rc;

use mlx_rs::{ops, Array};

use crate::block_pool::BlockId;
use crate::cache::KvCache;
use crate::error::Result;

/// The KV parts of one block, one list per layer ([`KvCache::parts`]).
type BlockKv = Vec<Vec<Array>>;

/// What the store holds for one block.
enum Content {
    /// The block's own parts.
    Own(BlockKv),
    /// Block `index` of `len` consecutive blocks copied out at once ([`BlockStore::put_run`]):
    /// each part `[1, kv_heads, len * block_size, head_dim]`. The copy lives while any of its
    /// blocks does; a block's share of its bytes is counted as its own.
    InRun {
        run: Rc<BlockKv>,
        index: usize,
        len: usize,
    },
}

impl Content {
    fn nbytes(&self) -> usize {
        match self {
            Content::Own(kv) => kv_nbytes(kv),
            Content::InRun { run, len, .. } => kv_nbytes(run) / len,
        }
    }
}

/// KV content per block id; `None` for blocks that hold nothing worth keeping.
pub struct BlockStore {
    blocks: Vec<Option<Content>>,
    /// Bytes of all content held (kept up to date, since stats are read often).
    nbytes: usize,
    /// Per layer: whether its cache is a recurrent state (see the module docs).
    recurrent: Vec<bool>,
    /// Blocks holding recurrent states, least recently used first.
    states: VecDeque<BlockId>,
    /// Bytes of those states, at most `max_state_bytes` (but always the newest one).
    state_bytes: usize,
    max_state_bytes: usize,
}

fn kv_nbytes(kv: &BlockKv) -> usize {
    kv.iter().flatten().map(Array::nbytes).sum()
}

impl BlockStore {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            blocks: (0..num_blocks).map(|_| None).collect(),
            nbytes: 0,
            recurrent: Vec::new(),
            states: VecDeque::new(),
            state_bytes: 0,
            max_state_bytes: 0,
        }
    }

    /// Marks the layers whose caches are recurrent states (`recurrent[layer]`), keeping at most
    /// `max_state_bytes` of their states (and always the newest).
    pub fn with_recurrent_layers(mut self, recurrent: Vec<bool>, max_state_bytes: usize) -> Self {
        self.recurrent = recurrent;
        self.max_state_bytes = max_state_bytes;
        self
    }

    /// Whether some layer is recurrent: prefix hits must end at a block with a state.
    pub fn has_recurrent_layers(&self) -> bool {
        self.recurrent.iter().any(|&r| r)
    }

    /// Whether a prefix hit may end at block `id`: it holds content, and the recurrent layers'
    /// states after it when the model has such layers.
    pub fn has_state(&self, id: BlockId) -> bool {
        match &self.blocks[id.0 as usize] {
            Some(Content::Own(kv)) => self.state_nbytes(kv).is_some(),
            // Runs come from slot caches, which hybrid models do not use: no states.
            Some(Content::InRun { .. }) => !self.has_recurrent_layers(),
            None => false,
        }
    }

    /// Marks block `id`'s state as used now (a prefix hit ended there), so it is dropped last.
    pub fn touch_state(&mut self, id: BlockId) {
        if let Some(i) = self.states.iter().position(|s| *s == id) {
            self.states.remove(i);
            self.states.push_back(id);
        }
    }

    /// Bytes of the recurrent states in `kv`; `None` when a recurrent layer has none (0 when the
    /// model has no recurrent layer).
    fn state_nbytes(&self, kv: &BlockKv) -> Option<usize> {
        let mut bytes = 0;
        for (parts, _) in kv.iter().zip(&self.recurrent).filter(|(_, r)| **r) {
            if parts.is_empty() {
                return None;
            }
            bytes += parts.iter().map(Array::nbytes).sum::<usize>();
        }
        Some(bytes)
    }

    /// Drops the recurrent states of the least recently used blocks beyond `max_state_bytes`,
    /// keeping the newest.
    fn bound_states(&mut self) {
        while self.state_bytes > self.max_state_bytes && self.states.len() > 1 {
            let id = self.states.pop_front().expect("non-empty");
            let Some(Content::Own(kv)) = self.blocks[id.0 as usize].as_mut() else {
                continue;
            };
            for (parts, _) in kv.iter_mut().zip(&self.recurrent).filter(|(_, r)| **r) {
                let bytes: usize = parts.iter().map(Array::nbytes).sum();
                self.state_bytes -= bytes;
                self.nbytes -= bytes;
                parts.clear();
            }
        }
    }

    /// Bytes of recurrent states held.
    pub fn state_bytes(&self) -> usize {
        self.state_bytes
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
        let (start, end) = (
            (index * block_size) as i32,
            ((index + 1) * block_size) as i32,
        );
        let kv = cache
            .iter()
            .map(|layer| layer.block_parts(start, end))
            .collect::<Result<BlockKv>>()?;
        self.put_parts(id, kv);
        Ok(())
    }

    /// Keeps `kv` (per layer, the block's parts in buffers of their own, as
    /// [`KvCache::block_parts`] returns them) as block `id`'s content.
    pub fn put_parts(&mut self, id: BlockId, kv: Vec<Vec<Array>>) {
        self.clear(id);
        self.nbytes += kv_nbytes(&kv);
        if self.has_recurrent_layers() {
            if let Some(bytes) = self.state_nbytes(&kv) {
                self.state_bytes += bytes;
                self.states.push_back(id);
            }
        }
        self.blocks[id.0 as usize] = Some(Content::Own(kv));
        self.bound_states();
    }

    /// Keeps `run` (per layer, parts of `ids.len()` consecutive blocks in buffers of their own,
    /// `[1, kv_heads, ids.len() * block_size, head_dim]` each) as the content of `ids`, in order,
    /// without an array per block: a slot sequence's prefill chunk copies out up to 16 blocks
    /// at once, and a view per block and layer part cost the host more than the copies (four
    /// 8,192-token prompts on a GPU made 13,000 views a step). Never for hybrid models' blocks,
    /// which keep states.
    pub fn put_run(&mut self, ids: &[BlockId], run: BlockKv) {
        let run = Rc::new(run);
        for (index, &id) in ids.iter().enumerate() {
            self.clear(id);
            let content = Content::InRun {
                run: Rc::clone(&run),
                index,
                len: ids.len(),
            };
            self.nbytes += content.nbytes();
            self.blocks[id.0 as usize] = Some(content);
        }
    }

    /// Adds the recurrent layers' states after block `id` (per layer, what
    /// [`KvCache::block_parts`] gives; attention layers' entries ignored) to a block that holds KV
    /// but no states: a sequence that recomputed up to the end of a cached block, where its
    /// prompt leaves a cached chain, leaves the states there for the next prompt that does.
    pub fn put_state(&mut self, id: BlockId, states: Vec<Vec<Array>>) {
        let complete = states
            .iter()
            .zip(&self.recurrent)
            .all(|(state, recurrent)| !recurrent || !state.is_empty());
        if !complete || self.has_state(id) || !self.contains(id) {
            return;
        }
        let Some(Content::Own(kv)) = self.blocks[id.0 as usize].as_mut() else {
            return;
        };
        let mut bytes = 0;
        for ((parts, state), _) in kv
            .iter_mut()
            .zip(states)
            .zip(&self.recurrent)
            .filter(|(_, r)| **r)
        {
            bytes += state.iter().map(Array::nbytes).sum::<usize>();
            *parts = state;
        }
        self.nbytes += bytes;
        self.state_bytes += bytes;
        self.states.push_back(id);
        self.bound_states();
    }

    /// Drops the content of `id` (the block was handed out again or forgotten).
    pub fn clear(&mut self, id: BlockId) {
        if let Some(content) = self.blocks[id.0 as usize].take() {
            self.nbytes -= content.nbytes();
            if let Some(i) = self.states.iter().position(|s| *s == id) {
                self.states.remove(i);
                if let Content::Own(kv) = &content {
                    self.state_bytes -= self.state_nbytes(kv).unwrap_or(0);
                }
            }
        }
    }

    /// Whether `id` holds content.
    pub fn contains(&self, id: BlockId) -> bool {
        self.blocks[id.0 as usize].is_some()
    }

    /// Appends the content of `ids`, in order, to an empty per-layer `cache`. Errors when a
    /// block holds nothing (a broken invariant: every cached block has content), or when the
    /// last one holds no recurrent state for a recurrent layer ([`BlockStore::has_state`]). A
    /// sliding layer's cache that may drop positions skips the leading blocks its window no
    /// longer reaches from the end of the prefix ([`KvCache::positions_to_skip`]).
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
                    .ok_or_else(|| missing(*id))
            })
            .collect::<Result<Vec<_>>>()?;
        let positions = (ids.len() * block_size) as i32;
        for (layer, layer_cache) in cache.iter_mut().enumerate() {
            if layer_cache.is_recurrent() {
                let last = match blocks.last().expect("non-empty") {
                    Content::Own(kv) => &kv[layer],
                    Content::InRun { .. } => &Vec::new(),
                };
                if last.is_empty() {
                    return Err(mlx_rs::error::Exception::from(
                        format!(
                            "prefix-cache block {} holds no recurrent state for layer {layer}",
                            ids[ids.len() - 1].0
                        )
                        .as_str(),
                    )
                    .into());
                }
                layer_cache.append_block_parts(last, positions)?;
                continue;
            }
            let skip = layer_cache.positions_to_skip(positions, block_size as i32);
            layer_cache.start_at(skip);
            if skip == positions {
                continue;
            }
            let kept = &blocks[skip as usize / block_size..];
            let pieces = pieces(kept, layer, block_size)?;
            let parts = pieces
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
        let mut last_run: Option<&Rc<BlockKv>> = None;
        for content in ids
            .iter()
            .filter_map(|id| self.blocks[id.0 as usize].as_ref())
        {
            match content {
                Content::Own(kv) => arrays.extend(kv.iter().flatten()),
                // A run's arrays once, however many of its blocks are asked for.
                Content::InRun { run, .. } => {
                    if !last_run.is_some_and(|last| Rc::ptr_eq(last, run)) {
                        arrays.extend(run.iter().flatten());
                        last_run = Some(run);
                    }
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

/// Layer `layer`'s content of consecutive blocks, per part: the pieces to concatenate along the
/// positions, a block's own array or one slice for each stretch of blocks of the same run.
fn pieces(blocks: &[&Content], layer: usize, block_size: usize) -> Result<Vec<Vec<Array>>> {
    let num_parts = match blocks[0] {
        Content::Own(kv) => kv[layer].len(),
        Content::InRun { run, .. } => run[layer].len(),
    };
    let mut pieces: Vec<Vec<Array>> = vec![Vec::new(); num_parts];
    let mut i = 0;
    while i < blocks.len() {
        match blocks[i] {
            Content::Own(kv) => {
                for (piece, part) in pieces.iter_mut().zip(&kv[layer]) {
                    piece.push(part.clone());
                }
                i += 1;
            }
            Content::InRun { run, index, .. } => {
                // The following blocks that are the run's next ones.
                let mut count = 1;
                while let Some(Content::InRun {
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
                    piece.push(crate::mlx_ext::slice(
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

fn missing(id: BlockId) -> crate::error::EngineError {
    mlx_rs::error::Exception::from(
        format!("prefix-cache block {} has no KV content", id.0).as_str(),
    )
    .into()
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

    #[test]
    fn recurrent_states_are_bounded_by_bytes_least_recently_used_first() {
        let mut store = BlockStore::new(8).with_recurrent_layers(vec![false, true], 1024);
        let kv_bytes = 2 * 4 * 8 * 4;
        store.put_parts(BlockId(0), block(true));
        store.put_parts(BlockId(1), block(false));
        store.put_parts(BlockId(2), block(true));
        assert!(store.has_state(BlockId(0)) && store.has_state(BlockId(2)));
        assert!(!store.has_state(BlockId(1)) && store.contains(BlockId(1)));
        assert_eq!(store.state_bytes(), 1024);
        // A hit on block 0 makes block 2's state the least recently used.
        store.touch_state(BlockId(0));
        store.put_parts(BlockId(3), block(true));
        assert!(
            !store.has_state(BlockId(2)),
            "least recently used state dropped"
        );
        assert!(store.contains(BlockId(2)), "its KV stays");
        assert!(store.has_state(BlockId(0)) && store.has_state(BlockId(3)));
        assert_eq!(store.state_bytes(), 1024);
        assert_eq!(store.nbytes(), 4 * kv_bytes + 1024);
        // Eviction takes the state's bytes with the block.
        store.clear(BlockId(3));
        assert_eq!(store.state_bytes(), 512);
        assert_eq!(store.nbytes(), 3 * kv_bytes + 512);
        // The newest state stays even when it alone is over the bound.
        let mut tight = BlockStore::new(2).with_recurrent_layers(vec![false, true], 100);
        tight.put_parts(BlockId(0), block(true));
        tight.put_parts(BlockId(1), block(true));
        assert!(!tight.has_state(BlockId(0)) && tight.has_state(BlockId(1)));
    }

    /// Blocks kept as places in a run copy load as blocks of their own do (any stretch of them,
    /// mixed with owned blocks), count their share of its bytes, and evaluate it once.
    #[test]
    fn blocks_of_a_run_load_and_count_as_their_own() {
        let block_size = 4;
        // One layer of keys and values over 12 positions: position p holds p in every feature.
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
            let keys = match cache[0].fetch().unwrap() {
                crate::cache::CachedKv::Dense { keys, .. } => keys,
                _ => unreachable!("a float cache"),
            };
            keys.index((.., 0, .., 0)).flatten(None, None).unwrap()
        };
        let expected = ops::arange::<_, f32>(0.0, 16.0, None).unwrap();
        let all = loaded(&[BlockId(5), BlockId(1), BlockId(2), BlockId(3)]);
        assert_eq!(all.as_slice::<f32>(), expected.as_slice::<f32>());
        // The run's first block alone, after an owned block: positions 0..8.
        let two = loaded(&[BlockId(5), BlockId(1)]);
        assert_eq!(two.as_slice::<f32>(), &expected.as_slice::<f32>()[..8]);
        // Evicting part of a run keeps the rest readable and takes that block's share.
        store.clear(BlockId(2));
        assert_eq!(store.nbytes(), 3 * block_bytes);
        assert!(store.contains(BlockId(3)) && store.has_state(BlockId(3)));
    }

    #[test]
    fn a_hit_loads_the_last_blocks_recurrent_state() {
        let mut store = BlockStore::new(4).with_recurrent_layers(vec![false, true], 1 << 20);
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
        assert!(err.to_string().contains("no recurrent state"), "{err}");
    }
}
