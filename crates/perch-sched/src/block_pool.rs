//! The block pool: a fixed number of KV-cache blocks of `block_size` tokens, handed out to
//! sequences and, once full, identified by a hash chained over their tokens so that later
//! requests sharing the prefix reuse them (prefix caching).
//!
//! Vocabulary and design follow vLLM v1 (`vllm/v1/core/block_pool.py`, `kv_cache_utils.py`):
//! - every block's metadata ([`KvCacheBlock`]) is allocated up front and addressed by [`BlockId`];
//! - blocks with no reference sit in a free queue in LRU order (an intrusive doubly linked list,
//!   so taking a cached block back out of the middle is O(1));
//! - a freed block keeps its hash and content until it is reused ("cached-free"); allocation takes
//!   from the front of the queue, evicting the least recently freed block's hash;
//! - running out of blocks returns `None` so the scheduler can preempt; misuse is a `debug_assert!`.
//!
//! This file knows nothing of MLX: it is the bookkeeping over which KV tensors are laid out.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use sha2::{Digest, Sha256};

/// Index of a block in the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    fn index(self) -> usize {
        self.0 as usize
    }
}

/// Identity of a full block's content: SHA-256 (truncated to 128 bits) over the parent block's
/// hash, the block's token ids and any extra keys. The chain starts at a root derived from the
/// model, so two models never share blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The hash every chain starts from: a function of the model's identity (e.g. its directory
    /// and weights' size, or a Hub commit).
    pub fn root(model_id: &str) -> Self {
        Self::digest(|h| {
            h.update(b"perch-prefix-root\0");
            h.update(model_id.as_bytes());
        })
    }

    /// The hash of a block holding `tokens` after a block whose hash is `self`.
    /// `extra` distinguishes otherwise equal tokens (e.g. a KV-cache dtype or an adapter).
    pub fn chain(self, tokens: &[u32], extra: &[u8]) -> Self {
        Self::digest(|h| {
            h.update(self.0.to_le_bytes());
            h.update((tokens.len() as u64).to_le_bytes());
            for t in tokens {
                h.update(t.to_le_bytes());
            }
            h.update(extra);
        })
    }

    fn digest(fill: impl FnOnce(&mut Sha256)) -> Self {
        let mut hasher = Sha256::new();
        fill(&mut hasher);
        let out = hasher.finalize();
        let mut first = [0u8; 16];
        first.copy_from_slice(&out[..16]);
        Self(u128::from_le_bytes(first))
    }
}

/// Hashes of the full blocks of `tokens` (a trailing partial block gets none), chained from `root`.
pub fn full_block_hashes(
    root: BlockHash,
    tokens: &[u32],
    block_size: usize,
    extra: &[u8],
) -> Vec<BlockHash> {
    let mut parent = root;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            parent = parent.chain(block, extra);
            parent
        })
        .collect()
}

/// Metadata of one block.
#[derive(Clone, Debug)]
pub struct KvCacheBlock {
    pub id: BlockId,
    /// Number of sequences whose block table holds this block.
    ref_cnt: u32,
    /// Set once the block is full and registered in the prefix cache.
    hash: Option<BlockHash>,
    prev_free: Option<BlockId>,
    next_free: Option<BlockId>,
    in_free_queue: bool,
}

impl KvCacheBlock {
    pub fn ref_cnt(&self) -> u32 {
        self.ref_cnt
    }

    pub fn hash(&self) -> Option<BlockHash> {
        self.hash
    }
}

/// Blocks nobody references, least recently freed first.
#[derive(Debug, Default)]
struct FreeBlockQueue {
    head: Option<BlockId>,
    tail: Option<BlockId>,
    len: usize,
}

impl FreeBlockQueue {
    fn push_back(&mut self, blocks: &mut [KvCacheBlock], id: BlockId) {
        debug_assert!(
            !blocks[id.index()].in_free_queue,
            "block {id:?} is already free"
        );
        let block = &mut blocks[id.index()];
        block.prev_free = self.tail;
        block.next_free = None;
        block.in_free_queue = true;
        match self.tail {
            Some(tail) => blocks[tail.index()].next_free = Some(id),
            None => self.head = Some(id),
        }
        self.tail = Some(id);
        self.len += 1;
    }

    fn pop_front(&mut self, blocks: &mut [KvCacheBlock]) -> Option<BlockId> {
        let id = self.head?;
        self.remove(blocks, id);
        Some(id)
    }

    fn remove(&mut self, blocks: &mut [KvCacheBlock], id: BlockId) {
        debug_assert!(
            blocks[id.index()].in_free_queue,
            "block {id:?} is not in the free queue"
        );
        let (prev, next) = {
            let b = &mut blocks[id.index()];
            b.in_free_queue = false;
            (b.prev_free.take(), b.next_free.take())
        };
        match prev {
            Some(p) => blocks[p.index()].next_free = next,
            None => self.head = next,
        }
        match next {
            Some(n) => blocks[n.index()].prev_free = prev,
            None => self.tail = prev,
        }
        self.len -= 1;
    }
}

/// Counters of the prefix cache, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up.
    pub queried_tokens: u64,
    /// Of those, tokens found in cached blocks.
    pub hit_tokens: u64,
}

impl PrefixCacheStats {
    /// `hit_tokens / queried_tokens`, 0 before any query.
    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.queried_tokens as f64
        }
    }
}

/// Why a cached block's content left the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionCause {
    /// The pool handed the block out again: the least recently used cached block goes first
    /// when sequences need blocks (the KV budget was full).
    Reused,
    /// The whole prefix cache was dropped ([`BlockPool::reset_prefix_cache`]: memory pressure,
    /// or on request).
    Reset,
}

/// When and why a block's content was evicted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Eviction {
    pub at: Instant,
    pub cause: EvictionCause,
}

/// The hashes of the most recently evicted blocks, to tell a prompt whose prefix was evicted
/// from one that was never cached. Bounded: the oldest entries are forgotten.
#[derive(Debug, Default)]
struct EvictionLog {
    /// Records in the order made, with their number (a hash evicted again has a newer record;
    /// its older place in the order is passed over).
    order: VecDeque<(BlockHash, u64)>,
    by_hash: HashMap<BlockHash, (Eviction, u64)>,
    recorded: u64,
    capacity: usize,
}

impl EvictionLog {
    fn record(&mut self, hash: BlockHash, eviction: Eviction) {
        if self.capacity == 0 {
            return;
        }
        self.recorded += 1;
        self.by_hash.insert(hash, (eviction, self.recorded));
        self.order.push_back((hash, self.recorded));
        while self.by_hash.len() > self.capacity || self.order.len() > 2 * self.capacity {
            let Some((old, number)) = self.order.pop_front() else {
                break;
            };
            if self.by_hash.get(&old).is_some_and(|&(_, n)| n == number) {
                self.by_hash.remove(&old);
            }
        }
    }
}

/// The pool of KV-cache blocks.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<KvCacheBlock>,
    free_queue: FreeBlockQueue,
    /// Full blocks by content hash (both referenced and cached-free ones).
    cached: HashMap<BlockHash, BlockId>,
    block_size: usize,
    stats: PrefixCacheStats,
    evictions: EvictionLog,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks of `block_size` tokens, all free.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        assert!(num_blocks <= u32::MAX as usize, "too many blocks");
        let mut blocks: Vec<KvCacheBlock> = (0..num_blocks)
            .map(|i| KvCacheBlock {
                id: BlockId(i as u32),
                ref_cnt: 0,
                hash: None,
                prev_free: None,
                next_free: None,
                in_free_queue: false,
            })
            .collect();
        let mut free_queue = FreeBlockQueue::default();
        for i in 0..num_blocks {
            free_queue.push_back(&mut blocks, BlockId(i as u32));
        }
        Self {
            blocks,
            free_queue,
            cached: HashMap::new(),
            block_size,
            stats: PrefixCacheStats::default(),
            evictions: EvictionLog {
                capacity: (4 * num_blocks).max(Self::MIN_EVICTIONS_KEPT),
                ..EvictionLog::default()
            },
        }
    }

    /// The evicted blocks' hashes kept at least (four times the pool's blocks when more).
    pub const MIN_EVICTIONS_KEPT: usize = 4096;

    /// When and why the block with this content hash was last evicted, if it is among those
    /// remembered and not cached again since.
    pub fn eviction(&self, hash: BlockHash) -> Option<Eviction> {
        match self.cached.contains_key(&hash) {
            true => None,
            false => self
                .evictions
                .by_hash
                .get(&hash)
                .map(|&(eviction, _)| eviction),
        }
    }

    /// A pool that fits `budget_bytes` given the KV bytes one token takes in every layer
    /// (`2 * layers * kv_heads * head_dim * dtype_size`).
    pub fn with_budget(budget_bytes: usize, bytes_per_token: usize, block_size: usize) -> Self {
        let per_block = bytes_per_token.max(1) * block_size;
        Self::new(budget_bytes / per_block, block_size)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks no sequence references (cached-free ones included): what allocation can use.
    pub fn num_free_blocks(&self) -> usize {
        self.free_queue.len
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used_blocks(&self) -> usize {
        self.blocks.len() - self.free_queue.len
    }

    /// Free blocks that still hold a cached prefix.
    pub fn num_cached_free_blocks(&self) -> usize {
        self.cached
            .values()
            .filter(|id| self.blocks[id.index()].ref_cnt == 0)
            .count()
    }

    pub fn block(&self, id: BlockId) -> &KvCacheBlock {
        &self.blocks[id.index()]
    }

    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Takes `n` blocks from the front of the free queue (least recently freed first), dropping
    /// any cached content they held. `None` when fewer than `n` are free (nothing is taken).
    pub fn get_new_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free_queue.len {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free_queue.pop_front(&mut self.blocks)?;
            let block = &mut self.blocks[id.index()];
            debug_assert_eq!(block.ref_cnt, 0, "free block {id:?} is referenced");
            if let Some(hash) = block.hash.take() {
                if self.cached.get(&hash) == Some(&id) {
                    self.cached.remove(&hash);
                    let at = Instant::now();
                    let cause = EvictionCause::Reused;
                    self.evictions.record(hash, Eviction { at, cause });
                }
            }
            block.ref_cnt = 1;
            out.push(id);
        }
        Some(out)
    }

    /// The cached block with this content, if any.
    pub fn get_cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Adds a reference to each block (a prefix-cache hit), taking cached-free ones out of the
    /// free queue.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if self.blocks[id.index()].ref_cnt == 0 {
                self.free_queue.remove(&mut self.blocks, id);
            }
            self.blocks[id.index()].ref_cnt += 1;
        }
    }

    /// Drops one reference from each block; blocks reaching zero join the free queue's tail in the
    /// given order, so pass a sequence's blocks last-first to have its tail evicted before its
    /// (more shareable) head.
    pub fn free_blocks(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        for id in ids {
            let block = &mut self.blocks[id.index()];
            debug_assert!(block.ref_cnt > 0, "double free of block {id:?}");
            block.ref_cnt = block.ref_cnt.saturating_sub(1);
            if block.ref_cnt == 0 {
                self.free_queue.push_back(&mut self.blocks, id);
            }
        }
    }

    /// Registers a block that just became full under `hash`. If another block already holds the
    /// same content, that one stays the cache entry and this one remains private. Returns whether
    /// this block became the cache entry (so its content must be kept for later hits).
    pub fn cache_full_block(&mut self, id: BlockId, hash: BlockHash) -> bool {
        let block = &mut self.blocks[id.index()];
        debug_assert!(block.ref_cnt > 0, "caching a free block {id:?}");
        if block.hash.is_some() {
            return false;
        }
        block.hash = Some(hash);
        *self.cached.entry(hash).or_insert(id) == id
    }

    /// Records a prefix-cache lookup of `queried` tokens of which `hit` were found.
    pub fn record_lookup(&mut self, queried: usize, hit: usize) {
        self.stats.queried_tokens += queried as u64;
        self.stats.hit_tokens += hit as u64;
    }

    /// Forgets every cached prefix (free blocks stay free) and returns the blocks forgotten.
    /// Referenced blocks keep their hashes.
    pub fn reset_prefix_cache(&mut self) -> Vec<BlockId> {
        let blocks = &mut self.blocks;
        let mut forgotten = Vec::new();
        let mut dropped = Vec::new();
        self.cached.retain(|hash, id| {
            let keep = blocks[id.index()].ref_cnt > 0;
            if !keep {
                blocks[id.index()].hash = None;
                forgotten.push(*id);
                dropped.push(*hash);
            }
            keep
        });
        let at = Instant::now();
        for hash in dropped {
            let cause = EvictionCause::Reset;
            self.evictions.record(hash, Eviction { at, cause });
        }
        forgotten
    }

    /// Checks every invariant; for tests and debug builds.
    pub fn check_invariants(&self) {
        let free = self.blocks.iter().filter(|b| b.ref_cnt == 0).count();
        assert_eq!(
            free, self.free_queue.len,
            "blocks with no reference == free queue length"
        );
        assert!(self
            .blocks
            .iter()
            .all(|b| b.in_free_queue == (b.ref_cnt == 0)));
        let mut walked = 0;
        let mut cursor = self.free_queue.head;
        let mut prev = None;
        while let Some(id) = cursor {
            let b = &self.blocks[id.index()];
            assert_eq!(b.prev_free, prev, "free queue links");
            prev = Some(id);
            cursor = b.next_free;
            walked += 1;
            assert!(walked <= self.blocks.len(), "free queue has a cycle");
        }
        assert_eq!(walked, self.free_queue.len);
        assert_eq!(self.free_queue.tail, prev);
        for (hash, id) in &self.cached {
            assert_eq!(
                self.blocks[id.index()].hash,
                Some(*hash),
                "cache entry matches its block"
            );
        }
        assert_eq!(
            self.num_free_blocks() + self.num_used_blocks(),
            self.num_blocks()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocation_is_lru_and_all_or_nothing() {
        let mut pool = BlockPool::new(4, 16);
        let a = pool.get_new_blocks(3).unwrap();
        assert_eq!(a, [BlockId(0), BlockId(1), BlockId(2)]);
        assert!(pool.get_new_blocks(2).is_none(), "only one block is free");
        assert_eq!(pool.num_free_blocks(), 1);
        pool.free_blocks(a.iter().rev().copied());
        // Freed last-first: the queue is now 3, 2, 1, 0.
        assert_eq!(
            pool.get_new_blocks(4).unwrap(),
            [BlockId(3), BlockId(2), BlockId(1), BlockId(0)]
        );
        pool.check_invariants();
    }

    #[test]
    fn freed_blocks_stay_cached_until_evicted() {
        let mut pool = BlockPool::new(3, 4);
        let root = BlockHash::root("m");
        let hashes = full_block_hashes(root, &[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, &[]);
        assert_eq!(hashes.len(), 2, "the partial block has no hash");
        let blocks = pool.get_new_blocks(2).unwrap();
        for (id, h) in blocks.iter().zip(&hashes) {
            pool.cache_full_block(*id, *h);
        }
        pool.free_blocks(blocks.iter().rev().copied());
        assert_eq!(pool.num_cached_free_blocks(), 2);
        // A hit takes the block out of the free queue again.
        let hit = pool.get_cached_block(hashes[0]).unwrap();
        pool.touch(&[hit]);
        assert_eq!(pool.block(hit).ref_cnt(), 1);
        assert_eq!(pool.num_free_blocks(), 2);
        // Allocating two blocks evicts the other cached one (block 2 is never-used, then block 1).
        let new = pool.get_new_blocks(2).unwrap();
        assert!(pool.get_cached_block(hashes[1]).is_none(), "evicted");
        assert_eq!(
            pool.get_cached_block(hashes[0]),
            Some(hit),
            "still referenced, still cached"
        );
        pool.free_blocks(new);
        pool.check_invariants();
    }

    #[test]
    fn hashes_chain_over_parent_tokens_and_model() {
        let a = full_block_hashes(BlockHash::root("m"), &[1, 2, 3, 4, 5, 6], 2, &[]);
        let b = full_block_hashes(BlockHash::root("m"), &[9, 2, 3, 4, 5, 6], 2, &[]);
        assert_ne!(a[0], b[0]);
        assert_ne!(
            a[2], b[2],
            "a different first block changes every later hash"
        );
        let c = full_block_hashes(BlockHash::root("other model"), &[1, 2, 3, 4, 5, 6], 2, &[]);
        assert!(a.iter().zip(&c).all(|(x, y)| x != y));
        let d = full_block_hashes(BlockHash::root("m"), &[1, 2, 3, 4, 5, 6], 2, b"q8");
        assert_ne!(a[0], d[0]);
        assert_eq!(
            a,
            full_block_hashes(BlockHash::root("m"), &[1, 2, 3, 4, 5, 6, 7], 2, &[])
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Allocate(usize),
        FreeSeq(usize),
        Cache(usize, u64),
        HitCached(u64),
        Reset,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..6).prop_map(Op::Allocate),
            (0usize..8).prop_map(Op::FreeSeq),
            (0usize..8, 0u64..6).prop_map(|(s, h)| Op::Cache(s, h)),
            (0u64..6).prop_map(Op::HitCached),
            Just(Op::Reset),
        ]
    }

    proptest! {
        /// free + used = total, the queue is a consistent LRU list, and reference counts equal the
        /// number of sequences holding a block — after any sequence of operations.
        #[test]
        fn invariants_hold_under_random_operations(ops in proptest::collection::vec(op(), 1..200)) {
            let mut pool = BlockPool::new(12, 4);
            let mut seqs: Vec<Vec<BlockId>> = Vec::new();
            for op in ops {
                match op {
                    Op::Allocate(n) => {
                        let before = pool.num_free_blocks();
                        match pool.get_new_blocks(n) {
                            Some(b) => seqs.push(b),
                            None => prop_assert!(n > before),
                        }
                    }
                    Op::FreeSeq(i) if i < seqs.len() => {
                        let s = seqs.remove(i);
                        pool.free_blocks(s.into_iter().rev());
                    }
                    Op::Cache(i, h) if i < seqs.len() => {
                        if let Some(&id) = seqs[i].last() {
                            pool.cache_full_block(id, BlockHash(h as u128));
                        }
                    }
                    Op::HitCached(h) => {
                        if let Some(id) = pool.get_cached_block(BlockHash(h as u128)) {
                            pool.touch(&[id]);
                            seqs.push(vec![id]);
                        }
                    }
                    Op::Reset => {
                        pool.reset_prefix_cache();
                    }
                    _ => {}
                }
                pool.check_invariants();
                for b in 0..pool.num_blocks() {
                    let holders = seqs.iter().flatten().filter(|id| id.0 as usize == b).count();
                    prop_assert_eq!(pool.block(BlockId(b as u32)).ref_cnt() as usize, holders);
                }
            }
            for s in seqs.drain(..) {
                pool.free_blocks(s.into_iter().rev());
            }
            prop_assert_eq!(pool.num_free_blocks(), pool.num_blocks());
        }
    }
}
