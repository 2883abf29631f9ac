//! Per-request block tables over the [`BlockPool`], with prefix-cache lookups: what the scheduler
//! calls to admit a request (`get_computed_blocks`, `allocate_slots`), to grow it during decode
//! (`allocate_slots`), to publish finished blocks (`cache_blocks`) and to release it (`free`).
//! Same roles as vLLM v1's `KVCacheManager`.
//!
//! Only full blocks are shared. A cache hit is whole blocks and always leaves at least one prompt
//! token to compute (its logits start generation), so a shared block is never written to.
//!
//! # How attention will read the pool
//! The batch engine keeps a contiguous working KV buffer per running batch and uses the pool as
//! the prefix store: blocks are copied into the buffer when a request is admitted with a cache hit,
//! and a request's full blocks are copied out to the pool once, when they fill. Gathering every
//! sequence's blocks from the pool on every step would cost 4.5x the attention itself (32
//! sequences of 1,024 tokens on CPU); there is no paged-attention kernel in MLX 0.32. Batching
//! also needs dense projections on CPU: MLX's CPU 4-bit `quantized_matmul` of a 576x1536 weight
//! takes 45x a float32 GEMM's time at batch 32.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::block_pool::{full_block_hashes, BlockHash, BlockId, BlockPool};
use crate::prefix_pins::{PinKey, PinRefused, PrefixPins, Unpinned};

/// Identifies a request inside the engine.
pub type RequestId = u64;

/// What the prefix cache's blocks hold besides their hashes, as allocation and admission need to
/// know it (the engine's `kv::BlockStore`, which keeps the KV content): for models with bounded
/// layers (sliding windows, recurrent states), which blocks still hold those layers' parts, the
/// pins and least-recently-used order that decide which are dropped, and the pool blocks those
/// parts are charged. A model without bounded layers answers trivially (every hit block usable,
/// nothing held, nothing to drop).
pub trait BlockContents {
    /// How many leading blocks of a prefix hit `blocks` a sequence can start after, loading
    /// what its layers read.
    fn usable_blocks(&self, blocks: &[BlockId], block_size: usize) -> usize;
    /// The blocks of `blocks` (a hit's, from the first) whose bounded parts a hit ending after
    /// them reads.
    fn read_by_hit<'a>(&self, blocks: &'a [BlockId], block_size: usize) -> &'a [BlockId];
    /// Keeps the bounded parts of `ids` from being dropped until as many unpins.
    fn pin(&mut self, ids: &[BlockId]);
    /// Undoes a pin of `ids`.
    fn unpin(&mut self, ids: &[BlockId]);
    /// Whether pinning the bounded parts of `ids` too keeps the pinned parts within the share of
    /// the bounded parts' budget that prefix pins may hold ([`KvCacheManager::pin_prefix`]).
    fn pinned_parts_fit(&self, ids: &[BlockId]) -> bool;
    /// Whether some layer is recurrent (hits end at a block that holds the states).
    fn has_recurrent_layers(&self) -> bool;
    /// Drops the content of block `id`: the pool handed it out again.
    fn clear(&mut self, id: BlockId);
    /// Drops the least recently used unpinned block's bounded parts; false when none is left.
    fn drop_least_recent(&mut self) -> bool;
    /// Pool blocks held for the bounded parts.
    fn held_blocks(&self) -> usize;
    /// How many more pool blocks the bounded parts need (`> 0`), or how many of those held
    /// they no longer need (`< 0`).
    fn blocks_to_charge(&self) -> isize;
    /// Adds `ids`, taken from the pool, to the blocks held for the bounded parts.
    fn hold_blocks(&mut self, ids: Vec<BlockId>);
    /// Gives up `n` of the blocks held for the bounded parts, to return to the pool.
    fn release_blocks(&mut self, n: usize) -> Vec<BlockId>;
}

/// Blocks found in the prefix cache for a prompt, and how many tokens they hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ComputedBlocks {
    pub blocks: Vec<BlockId>,
    pub num_tokens: usize,
}

#[derive(Debug, Default)]
struct RequestBlocks {
    blocks: Vec<BlockId>,
    /// Leading blocks already registered in the prefix cache.
    num_cached: usize,
    /// Hash of each full block registered so far (the chain continues from the last one).
    hashes: Vec<BlockHash>,
    /// Blocks held for the sliding layers' KV ([`KvCacheManager::with_window_cost`]): never
    /// cached, released with the request.
    window_blocks: Vec<BlockId>,
    /// Positions its sliding layers hold at most from now on, when fewer than the cost's
    /// ([`KvCacheManager::bound_window`]).
    window_tokens: Option<usize>,
    /// Positions its cache holds at most, for a request whose KV cache is bounded
    /// ([`KvCacheManager::bound_request`]); its blocks are never cached.
    max_tokens: Option<usize>,
}

/// What a running request's sliding-window layers cost in blocks (see [`crate::budget::KvBudget`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowCost {
    /// Positions the sliding layers hold at most.
    pub tokens: usize,
    /// Their bytes per position.
    pub bytes_per_token: usize,
    /// What a block's position costs.
    pub block_bytes_per_token: usize,
}

impl WindowCost {
    /// Blocks of `block_size` positions a request of `num_tokens` tokens holds for its sliding
    /// layers.
    pub fn blocks_for(&self, num_tokens: usize, block_size: usize) -> usize {
        (num_tokens.min(self.tokens) * self.bytes_per_token)
            .div_ceil((self.block_bytes_per_token * block_size).max(1))
    }
}

/// The longest request a pool of `num_blocks` blocks of `block_size` tokens holds: its block
/// table and, with a `window_cost`, its sliding layers' blocks.
pub fn max_sequence_tokens(
    num_blocks: usize,
    block_size: usize,
    window_cost: Option<WindowCost>,
) -> usize {
    let block_size = block_size.max(1);
    let fits = |tokens: usize| {
        tokens.div_ceil(block_size) + window_cost.map_or(0, |c| c.blocks_for(tokens, block_size))
            <= num_blocks
    };
    // The blocks needed grow with the tokens: the last that fits, by bisection.
    let (mut lo, mut hi) = (0, num_blocks * block_size);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Block tables of the running requests.
#[derive(Debug)]
pub struct KvCacheManager {
    pool: BlockPool,
    root: BlockHash,
    requests: HashMap<RequestId, RequestBlocks>,
    /// Prefix caching (vLLM's `enable_caching`): off, no block is ever registered or found.
    enable_caching: bool,
    window_cost: Option<WindowCost>,
    pins: PrefixPins,
}

/// What [`KvCacheManager::pin_prefix`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinOutcome {
    /// The prefix's first `tokens` tokens (whole blocks) are pinned.
    Pinned { tokens: usize },
    /// Larger than the pins' share of the pool, which holds at most `max_tokens`.
    TooLarge { max_tokens: usize },
    /// Its bounded parts (a sliding window's KV, recurrent states) are more than the share of
    /// their budget pins may hold, even with every other pin given up.
    NoRoomForBoundedParts,
    /// None of the prefix is in the prefix cache (caching off, a request whose cache is its
    /// own, or less than a block computed).
    NotCached,
}

impl KvCacheManager {
    /// `model_id` seeds the hash chain so different models never share blocks.
    pub fn new(pool: BlockPool, model_id: &str) -> Self {
        let pins = PrefixPins::new(pool.num_blocks());
        Self {
            pool,
            root: BlockHash::root(model_id),
            requests: HashMap::new(),
            enable_caching: true,
            window_cost: None,
            pins,
        }
    }

    /// Pins the first `num_tokens` tokens of `request`'s registered blocks (rounded down to
    /// whole blocks, and to where a hit can start: [`BlockContents::usable_blocks`]) for `ttl`
    /// from `now`, under the client's `key` or, without one, the prefix itself
    /// ([`PinKey`]). See [`crate::prefix_pins`].
    pub fn pin_prefix(
        &mut self,
        contents: &mut impl BlockContents,
        request: RequestId,
        num_tokens: usize,
        key: Option<String>,
        ttl: Duration,
        now: Instant,
    ) -> PinOutcome {
        let block_size = self.block_size();
        let Some(entry) = self.requests.get(&request).filter(|_| self.enable_caching) else {
            return PinOutcome::NotCached;
        };
        let wanted = (num_tokens / block_size).min(entry.hashes.len());
        let mut blocks: Vec<BlockId> = entry.hashes[..wanted]
            .iter()
            .map_while(|h| self.pool.get_cached_block(*h))
            .collect();
        blocks.truncate(contents.usable_blocks(&blocks, block_size));
        let Some(&last) = entry.hashes[..blocks.len()].last() else {
            return PinOutcome::NotCached;
        };
        let tokens = blocks.len() * block_size;
        let key = key.map_or(PinKey::Prefix(last), PinKey::Client);
        let expires = now + ttl;
        if self.pins.refresh(&key, &blocks, expires) {
            return PinOutcome::Pinned { tokens };
        }
        let bounded = contents.read_by_hit(&blocks, block_size).to_vec();
        // The bounded parts pins keep have a share of their own budget: the pins that expire
        // soonest give way.
        while !contents.pinned_parts_fit(&bounded) {
            let Some(pin) = self.pins.pop_soonest() else {
                return PinOutcome::NoRoomForBoundedParts;
            };
            self.release_pins(contents, vec![pin]);
        }
        match self
            .pins
            .insert(key, blocks.clone(), bounded.clone(), expires)
        {
            Ok(displaced) => {
                // The new pin's references first: a displaced pin's blocks it shares stay held.
                self.pool.touch(&blocks);
                contents.pin(&bounded);
                self.release_pins(contents, displaced);
                PinOutcome::Pinned { tokens }
            }
            Err(PinRefused::TooLarge { max_blocks }) => PinOutcome::TooLarge {
                max_tokens: max_blocks * block_size,
            },
        }
    }

    /// Gives up the pins that expired by `now`.
    pub fn expire_pins(&mut self, contents: &mut impl BlockContents, now: Instant) {
        if !self.pins.is_empty() {
            let expired = self.pins.expire(now);
            self.release_pins(contents, expired);
        }
    }

    /// Gives up the pin that expires soonest; false when none is left.
    pub fn unpin_soonest(&mut self, contents: &mut impl BlockContents) -> bool {
        let Some(pin) = self.pins.pop_soonest() else {
            return false;
        };
        self.release_pins(contents, vec![pin]);
        true
    }

    /// Gives up every pin.
    pub fn clear_pins(&mut self, contents: &mut impl BlockContents) {
        let pins = self.pins.clear();
        self.release_pins(contents, pins);
    }

    /// Tokens pinned now (distinct blocks), and the most pins may hold.
    pub fn pinned_tokens(&self) -> (usize, usize) {
        let block_size = self.block_size();
        (
            self.pins.num_blocks() * block_size,
            self.pins.max_blocks() * block_size,
        )
    }

    fn release_pins(&mut self, contents: &mut impl BlockContents, pins: Vec<Unpinned>) {
        for pin in pins {
            contents.unpin(&pin.bounded);
            // Last block first, as a request frees: a prefix's tail is evicted before its head.
            self.pool.free_blocks(pin.blocks.into_iter().rev());
        }
    }

    /// Makes each request hold, beside its block table, blocks for its sliding layers' KV: for
    /// `n` tokens, the bytes of `min(n, cost.tokens)` positions in those layers, in blocks of
    /// `block_size` positions at `cost.block_bytes_per_token` (rounded up). For models whose
    /// blocks count only the layers that keep every position.
    pub fn with_window_cost(mut self, cost: Option<WindowCost>) -> Self {
        self.window_cost = cost.filter(|c| c.block_bytes_per_token > 0);
        self
    }

    /// Blocks a request of `num_tokens` tokens holds for its sliding layers.
    pub fn window_blocks_for(&self, num_tokens: usize) -> usize {
        self.window_cost
            .map_or(0, |c| c.blocks_for(num_tokens, self.block_size()))
    }

    /// The longest request the whole pool holds, in tokens.
    pub fn max_tokens(&self) -> usize {
        max_sequence_tokens(self.pool.num_blocks(), self.block_size(), self.window_cost)
    }

    /// The blocks `request` holds for its sliding layers (see
    /// [`KvCacheManager::with_window_cost`]).
    pub fn window_blocks(&self, request: RequestId) -> &[BlockId] {
        self.requests
            .get(&request)
            .map_or(&[][..], |r| &r.window_blocks[..])
    }

    /// Turns prefix caching off (or on): off, [`KvCacheManager::cached_prefix`] finds nothing
    /// and [`KvCacheManager::cache_blocks`] registers nothing. For models whose layers are not
    /// all attention (a linear-attention layer's state is not split into blocks).
    pub fn with_caching(mut self, enable: bool) -> Self {
        self.enable_caching = enable;
        self
    }

    pub fn caching_enabled(&self) -> bool {
        self.enable_caching
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size())
    }

    /// The longest run of cached full blocks at the start of `prompt`, leaving at least one token
    /// to compute.
    pub fn get_computed_blocks(&self, prompt: &[u32]) -> ComputedBlocks {
        self.cached_prefix(&prompt[..prompt.len().saturating_sub(1)])
    }

    /// The longest run of cached full blocks at the start of `tokens`, all of them usable.
    pub fn cached_prefix(&self, tokens: &[u32]) -> ComputedBlocks {
        if !self.enable_caching {
            return ComputedBlocks::default();
        }
        let blocks: Vec<BlockId> = self
            .block_hashes(tokens)
            .iter()
            .map_while(|h| self.pool.get_cached_block(*h))
            .collect();
        let num_tokens = blocks.len() * self.block_size();
        ComputedBlocks { blocks, num_tokens }
    }

    /// The hashes of `tokens`' full blocks, chained as the prefix cache keys them: what a caller
    /// that asks [`KvCacheManager::cached_blocks`] again for the same tokens keeps.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<BlockHash> {
        full_block_hashes(self.root, tokens, self.block_size(), &[])
    }

    /// How many of the full blocks with these `hashes` ([`KvCacheManager::block_hashes`]) are
    /// cached, from the first on: [`KvCacheManager::cached_prefix`] without hashing again.
    pub fn cached_blocks(&self, hashes: &[BlockHash]) -> usize {
        match self.enable_caching {
            true => hashes
                .iter()
                .take_while(|h| self.pool.get_cached_block(**h).is_some())
                .count(),
            false => 0,
        }
    }

    /// Counts an admitted prompt of `prompt_tokens` tokens, `hit_tokens` of them found in the
    /// prefix cache, toward the hit rate.
    pub fn record_prefix_lookup(&mut self, prompt_tokens: usize, hit_tokens: usize) {
        self.pool.record_lookup(prompt_tokens, hit_tokens);
    }

    /// Forgets every cached prefix; returns the blocks whose content is no longer needed.
    pub fn reset_prefix_cache(&mut self) -> Vec<BlockId> {
        self.pool.reset_prefix_cache()
    }

    /// Makes room for `num_new_tokens` more tokens of `request`, which holds `num_computed` tokens
    /// already (from `computed`, on its first call). Returns the request's block table, or `None`
    /// when the pool is short of blocks, in which case nothing changed: the scheduler preempts or
    /// waits.
    pub fn allocate_slots(
        &mut self,
        request: RequestId,
        num_computed: usize,
        num_new_tokens: usize,
        computed: Option<&ComputedBlocks>,
    ) -> Option<&[BlockId]> {
        let held = self.requests.get(&request).map_or(0, |r| r.blocks.len());
        let hit = computed.map_or(&[][..], |c| &c.blocks[..]);
        debug_assert!(
            held == 0 || hit.is_empty(),
            "a prefix hit is only applied on admission"
        );
        let bound = self.requests.get(&request).and_then(|r| r.max_tokens);
        let needed = self
            .blocks_for((num_computed + num_new_tokens).min(bound.unwrap_or(usize::MAX)))
            .saturating_sub(held + hit.len());
        let window_held = self.window_blocks(request).len();
        let bound = self.requests.get(&request).and_then(|r| r.window_tokens);
        let window_needed = self
            .window_blocks_for((num_computed + num_new_tokens).min(bound.unwrap_or(usize::MAX)))
            .saturating_sub(window_held);
        // Touching a cached-free hit takes it out of the free queue too.
        let hit_from_free = hit
            .iter()
            .filter(|id| self.pool.block(**id).ref_cnt() == 0)
            .count();
        if needed + window_needed + hit_from_free > self.pool.num_free_blocks() {
            return None;
        }
        self.pool.touch(hit);
        let fresh = self.pool.get_new_blocks(needed)?;
        let window = self.pool.get_new_blocks(window_needed)?;
        let entry = self.requests.entry(request).or_default();
        entry.window_blocks.extend(window);
        if !hit.is_empty() {
            entry.blocks.extend_from_slice(hit);
            entry.num_cached = hit.len();
            entry.hashes = hit
                .iter()
                .map(|id| {
                    self.pool
                        .block(*id)
                        .hash()
                        .expect("cached block has a hash")
                })
                .collect();
        }
        entry.blocks.extend(fresh);
        Some(&entry.blocks)
    }

    /// [`KvCacheManager::allocate_slots`] that makes room first by dropping the prefix cache's
    /// bounded parts, least recently used first, while the pool is short; blocks handed out
    /// lose the content they cached (`contents.clear`). Returns false, changing no block
    /// table, when the pool is short even so.
    pub fn allocate(
        &mut self,
        contents: &mut impl BlockContents,
        request: RequestId,
        num_computed: usize,
        num_new_tokens: usize,
        hit: Option<&ComputedBlocks>,
    ) -> bool {
        let held = self.block_table(request).map_or(0, <[BlockId]>::len)
            + hit.map_or(0, |h| h.blocks.len());
        let window_held = self.window_blocks(request).len();
        while self
            .allocate_slots(request, num_computed, num_new_tokens, hit)
            .is_none()
        {
            // (Only parts that hold pool blocks: a hybrid model's states have a budget apart.)
            if contents.held_blocks() == 0 || !contents.drop_least_recent() {
                return false;
            }
            self.charge_pool(contents);
        }
        for &id in &self.block_table(request).expect("just allocated")[held..] {
            contents.clear(id);
        }
        for &id in &self.window_blocks(request)[window_held..] {
            contents.clear(id);
        }
        // Blocks handed out may have held sliding layers' KV: fewer blocks are charged for it.
        self.charge_pool(contents);
        true
    }

    /// Takes from the pool, or gives back, the blocks the prefix cache's bounded parts are
    /// charged ([`BlockContents::blocks_to_charge`]); when the pool has too few free blocks,
    /// the least recently used parts are dropped until it has enough.
    pub fn charge_pool(&mut self, contents: &mut impl BlockContents) {
        loop {
            let more = contents.blocks_to_charge();
            if more <= 0 {
                self.give_back_blocks(contents.release_blocks(more.unsigned_abs()));
                return;
            }
            match self.take_blocks(more as usize) {
                Some(ids) => {
                    // Cached blocks evicted for them lose their content (and maybe some parts,
                    // so fewer blocks are needed: the loop gives those back).
                    for &id in &ids {
                        contents.clear(id);
                    }
                    contents.hold_blocks(ids);
                }
                None => {
                    if !contents.drop_least_recent() {
                        return;
                    }
                }
            }
        }
    }

    /// Registers the blocks of `request` that `tokens[..num_computed]` has filled, so later
    /// requests with the same prefix can reuse them. Returns the newly registered blocks that
    /// became cache entries, with their index in the request's block table: the caller keeps
    /// their KV content (a block whose content another block already holds is not listed).
    pub fn cache_blocks(
        &mut self,
        request: RequestId,
        tokens: &[u32],
        num_computed: usize,
    ) -> Vec<(usize, BlockId)> {
        let block_size = self.block_size();
        let Some(entry) = self
            .requests
            .get_mut(&request)
            .filter(|r| self.enable_caching && r.max_tokens.is_none())
        else {
            return Vec::new();
        };
        let full = (num_computed.min(tokens.len()) / block_size).min(entry.blocks.len());
        let mut parent = entry.hashes.last().copied().unwrap_or(self.root);
        let mut entries = Vec::new();
        for i in entry.num_cached..full {
            parent = parent.chain(&tokens[i * block_size..(i + 1) * block_size], &[]);
            if self.pool.cache_full_block(entry.blocks[i], parent) {
                entries.push((i, entry.blocks[i]));
            }
            entry.hashes.push(parent);
        }
        entry.num_cached = entry.num_cached.max(full);
        entries
    }

    /// Takes `n` blocks from the free queue for a holder outside any request (the prefix
    /// cache's sliding layers' KV), evicting cached free blocks as allocation does: the caller
    /// drops their content. `None` when fewer are free.
    pub fn take_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        self.pool.get_new_blocks(n)
    }

    /// Gives back blocks from [`KvCacheManager::take_blocks`].
    pub fn give_back_blocks(&mut self, ids: Vec<BlockId>) {
        self.pool.free_blocks(ids);
    }

    /// Bounds what `request`'s sliding layers hold from now on to `tokens` positions (a
    /// sequence that moved into a cache whose sliding layers keep fewer positions than the
    /// cost's, e.g. the decode slot cache's rings after prefill) and gives the window blocks
    /// beyond that back to the pool. Without a window cost, or for an unknown request, nothing.
    pub fn bound_window(&mut self, request: RequestId, tokens: usize) {
        let Some(cost) = self.window_cost else {
            return;
        };
        let block_size = self.block_size();
        let Some(entry) = self.requests.get_mut(&request) else {
            return;
        };
        let tokens = entry.window_tokens.map_or(tokens, |t| t.min(tokens));
        entry.window_tokens = Some(tokens);
        let keep = cost.blocks_for(tokens, block_size);
        if entry.window_blocks.len() > keep {
            let extra = entry.window_blocks.split_off(keep);
            self.pool.free_blocks(extra);
        }
    }

    /// Makes `request`, before its first allocation, one whose cache holds at most `tokens`
    /// positions (a bounded KV cache, `max_kv_size`: it forgets older ones): its block table
    /// stops growing there, and none of its blocks joins the prefix cache (what they stand for
    /// is not a prefix's KV). Undone by [`KvCacheManager::free`].
    pub fn bound_request(&mut self, request: RequestId, tokens: usize) {
        self.requests.entry(request).or_default().max_tokens = Some(tokens.max(1));
    }

    /// Releases every block of `request` (last block first, so its tail is evicted first).
    pub fn free(&mut self, request: RequestId) {
        if let Some(entry) = self.requests.remove(&request) {
            self.pool.free_blocks(entry.window_blocks);
            self.pool.free_blocks(entry.blocks.into_iter().rev());
        }
    }

    pub fn block_table(&self, request: RequestId) -> Option<&[BlockId]> {
        self.requests.get(&request).map(|r| &r.blocks[..])
    }

    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manager(blocks: usize) -> KvCacheManager {
        KvCacheManager::new(BlockPool::new(blocks, 4), "test-model")
    }

    /// Admits a prompt the way the scheduler will: look up, allocate, "compute", publish.
    fn admit(m: &mut KvCacheManager, id: RequestId, prompt: &[u32]) -> Option<usize> {
        let hit = m.get_computed_blocks(prompt);
        m.allocate_slots(
            id,
            hit.num_tokens,
            prompt.len() - hit.num_tokens,
            Some(&hit),
        )?;
        m.record_prefix_lookup(prompt.len(), hit.num_tokens);
        m.cache_blocks(id, prompt, prompt.len());
        Some(hit.num_tokens)
    }

    /// Hashes kept from `block_hashes` find the blocks `cached_prefix` finds, as the cache
    /// changes under them; none with caching off.
    #[test]
    fn kept_block_hashes_find_what_cached_prefix_finds() {
        let mut m = manager(16);
        let prompt: Vec<u32> = (0..14).collect();
        let hashes = m.block_hashes(&prompt);
        assert_eq!(hashes.len(), 3);
        assert_eq!(m.cached_blocks(&hashes), 0);
        admit(&mut m, 1, &prompt[..9]).unwrap();
        assert_eq!(m.cached_prefix(&prompt).num_tokens, 8);
        assert_eq!(m.cached_blocks(&hashes), 2);
        m.free(1);
        let off = manager(16).with_caching(false);
        assert_eq!(off.cached_blocks(&off.block_hashes(&prompt)), 0);
    }

    #[test]
    fn multi_turn_chat_hits_the_previous_turn() {
        let mut m = manager(16);
        let turn1: Vec<u32> = (0..10).collect();
        assert_eq!(admit(&mut m, 1, &turn1), Some(0));
        // The assistant answers 3 tokens; then the conversation goes on with the same prefix.
        let mut convo = turn1.clone();
        convo.extend([100, 101, 102]);
        m.allocate_slots(1, 10, 3, None).unwrap();
        m.cache_blocks(1, &convo, convo.len());
        m.free(1);
        convo.extend([7, 7, 7, 7, 7]);
        // 18 tokens: blocks 0..4 of the 13 computed ones are full and cached (3 blocks = 12 tokens).
        assert_eq!(admit(&mut m, 2, &convo), Some(12));
        assert!(m.pool().stats().hit_rate() > 0.4);
        m.free(2);
        assert_eq!(m.pool().num_free_blocks(), 16);
        m.pool().check_invariants();
    }

    /// A sliding model's request holds blocks for its sliding layers up to their bound, then
    /// grows by its block table alone; all are released with it.
    #[test]
    fn sliding_layers_cost_blocks_up_to_their_window() {
        // Sliding layers: 10 bytes per position for 12 positions at most; a block position
        // costs 2 bytes (blocks of 4 positions: 8 bytes).
        let cost = WindowCost {
            tokens: 12,
            bytes_per_token: 10,
            block_bytes_per_token: 2,
        };
        let mut m = manager(40).with_window_cost(Some(cost));
        assert_eq!((m.window_blocks_for(1), m.window_blocks_for(8)), (2, 10));
        assert_eq!(m.window_blocks_for(12), 15);
        assert_eq!(m.window_blocks_for(1000), 15);
        // 40 blocks: 15 for the window, 25 of table: 100 tokens.
        assert_eq!(m.max_tokens(), 100);
        let prompt: Vec<u32> = (0..8).collect();
        admit(&mut m, 1, &prompt).unwrap();
        assert_eq!(m.window_blocks(1).len(), 10);
        assert_eq!(m.pool().num_free_blocks(), 40 - 2 - 10);
        // Decoding to 100 tokens takes table blocks only past the window's bound.
        m.allocate_slots(1, 8, 92, None).unwrap();
        assert_eq!(m.window_blocks(1).len(), 15);
        assert_eq!(m.pool().num_free_blocks(), 0);
        assert!(
            m.allocate_slots(1, 100, 1, None).is_none(),
            "the pool is full"
        );
        // A bound (a sequence now in a cache with smaller rings) gives the extra blocks back and
        // keeps them back as the request grows.
        m.bound_window(1, 4);
        assert_eq!(m.window_blocks(1).len(), 5);
        assert_eq!(m.pool().num_free_blocks(), 10);
        m.allocate_slots(1, 100, 20, None).unwrap();
        assert_eq!(m.window_blocks(1).len(), 5, "bounded while it grows");
        assert_eq!(m.pool().num_free_blocks(), 5);
        m.free(1);
        assert_eq!(m.pool().num_free_blocks(), 40);
        m.pool().check_invariants();
        // Without a window cost a request holds its table alone.
        assert_eq!(max_sequence_tokens(40, 4, None), 160);
    }

    #[test]
    fn a_fully_cached_prompt_still_computes_its_last_token() {
        let mut m = manager(8);
        let prompt: Vec<u32> = (0..8).collect();
        admit(&mut m, 1, &prompt).unwrap();
        m.free(1);
        let hit = m.get_computed_blocks(&prompt);
        assert_eq!(
            hit.num_tokens, 4,
            "the block holding the last token is recomputed"
        );
    }

    #[test]
    fn shared_prefix_blocks_are_shared_not_copied() {
        let mut m = manager(8);
        let a: Vec<u32> = (0..9).collect();
        let mut b: Vec<u32> = (0..8).collect();
        b.extend([50, 51, 52]);
        admit(&mut m, 1, &a).unwrap();
        assert_eq!(admit(&mut m, 2, &b), Some(8));
        let (ta, tb) = (m.block_table(1).unwrap(), m.block_table(2).unwrap());
        assert_eq!(ta[..2], tb[..2]);
        assert_ne!(ta[2], tb[2]);
        assert_eq!(m.pool().block(ta[0]).ref_cnt(), 2);
        assert_eq!(m.pool().num_used_blocks(), 4);
    }

    #[test]
    fn running_out_changes_nothing() {
        let mut m = manager(3);
        admit(&mut m, 1, &(0..8).collect::<Vec<_>>()).unwrap();
        let before = m.pool().num_free_blocks();
        assert!(m.allocate_slots(2, 0, 9, None).is_none());
        assert_eq!(m.pool().num_free_blocks(), before);
        assert!(m.block_table(2).is_none());
        // Growing request 1 by one token needs a third block: fits.
        assert_eq!(m.allocate_slots(1, 8, 1, None).unwrap().len(), 3);
        assert!(
            m.allocate_slots(1, 9, 4, None).is_none(),
            "a fourth block does not exist"
        );
        m.free(1);
        assert_eq!(m.pool().num_free_blocks(), 3);
    }

    #[test]
    fn a_hit_on_cached_free_blocks_counts_them_as_taken() {
        let mut m = manager(3);
        let prompt: Vec<u32> = (0..9).collect();
        admit(&mut m, 1, &prompt).unwrap();
        m.free(1);
        // 3 free blocks, 2 of them hold the hit; the request needs 1 more block: fits exactly.
        assert_eq!(admit(&mut m, 2, &prompt), Some(8));
        assert_eq!(m.pool().num_free_blocks(), 0);
        m.pool().check_invariants();
    }
}
