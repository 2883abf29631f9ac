//! The KV content of the block pool's cached blocks: for each block that is a prefix-cache entry,
//! its keys and values in every layer, `[1, kv_heads, block_size, head_dim]` each, in the format
//! of the engine's caches (float, or quantized parts: see `cache.rs`).
//!
//! Running sequences compute in contiguous per-sequence caches (see `kv_cache_manager.rs` for the
//! measurement behind that); the store receives a copy of each full block once, when it is
//! registered in the prefix cache, and gives copies back when a later request hits it. A block's
//! content is dropped when the pool hands the block out again (eviction).

use mlx_rs::{ops, Array};

use crate::block_pool::BlockId;
use crate::cache::KvCache;
use crate::error::Result;

/// The KV parts of one block, one list per layer ([`KvCache::parts`]).
type BlockKv = Vec<Vec<Array>>;

/// KV content per block id; `None` for blocks that hold nothing worth keeping.
pub struct BlockStore {
    blocks: Vec<Option<BlockKv>>,
    /// Bytes of all content held (kept up to date, since stats are read often).
    nbytes: usize,
}

fn kv_nbytes(kv: &BlockKv) -> usize {
    kv.iter().flatten().map(Array::nbytes).sum()
}

impl BlockStore {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            blocks: (0..num_blocks).map(|_| None).collect(),
            nbytes: 0,
        }
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
            .map(|layer| layer.copy_parts(start, end))
            .collect::<Result<BlockKv>>()?;
        self.put_parts(id, kv);
        Ok(())
    }

    /// Keeps `kv` (per layer, the block's parts in buffers of their own, as
    /// [`KvCache::copy_parts`] returns them) as block `id`'s content.
    pub fn put_parts(&mut self, id: BlockId, kv: Vec<Vec<Array>>) {
        self.clear(id);
        self.nbytes += kv_nbytes(&kv);
        self.blocks[id.0 as usize] = Some(kv);
    }

    /// Drops the content of `id` (the block was handed out again or forgotten).
    pub fn clear(&mut self, id: BlockId) {
        if let Some(kv) = self.blocks[id.0 as usize].take() {
            self.nbytes -= kv_nbytes(&kv);
        }
    }

    /// Whether `id` holds content.
    pub fn contains(&self, id: BlockId) -> bool {
        self.blocks[id.0 as usize].is_some()
    }

    /// Appends the content of `ids`, in order, to an empty per-layer `cache`. Errors when a
    /// block holds nothing (a broken invariant: every cached block has content). A sliding
    /// layer's cache that may drop positions skips the leading blocks its window no longer
    /// reaches from the end of the prefix ([`KvCache::positions_to_skip`]).
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
            let skip = layer_cache.positions_to_skip(positions, block_size as i32);
            layer_cache.start_at(skip);
            if skip == positions {
                continue;
            }
            let kept = &blocks[skip as usize / block_size..];
            let parts = (0..kept[0][layer].len())
                .map(|part| {
                    let pieces: Vec<&Array> = kept.iter().map(|b| &b[layer][part]).collect();
                    Ok(ops::concatenate(&pieces, 2)?)
                })
                .collect::<Result<Vec<Array>>>()?;
            layer_cache.append_parts(&parts)?;
        }
        Ok(())
    }

    /// Arrays to evaluate after [`BlockStore::put`] so the copies hold data, not graphs that
    /// keep a sequence's whole cache alive.
    pub fn state(&self, ids: &[BlockId]) -> Vec<&Array> {
        ids.iter()
            .filter_map(|id| self.blocks[id.0 as usize].as_ref())
            .flat_map(|kv| kv.iter().flatten())
            .collect()
    }

    /// Bytes of KV content held.
    pub fn nbytes(&self) -> usize {
        self.nbytes
    }
}

fn missing(id: BlockId) -> crate::error::EngineError {
    mlx_rs::error::Exception::from(
        format!("prefix-cache block {} has no KV content", id.0).as_str(),
    )
    .into()
}
