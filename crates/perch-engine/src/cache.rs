//! The per-layer KV cache of one sequence (mlx-lm's `KVCache`): a buffer grown in steps of
//! [`KvCache::STEP`] tokens and written in place, never re-concatenated every token.

use mlx_rs::{ops, Array};

use crate::error::Result;
use crate::mlx_ext::{owned_copy, slice, slice_update};

/// Keys and values of one attention layer, `[batch, kv_heads, capacity, head_dim]`, of which the
/// first `offset` positions are filled.
#[derive(Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    offset: i32,
}

impl KvCache {
    /// Growth step in tokens: the buffer is reallocated once per this many tokens.
    pub const STEP: i32 = 256;

    pub fn new() -> Self {
        Self::default()
    }

    /// Number of cached positions.
    pub fn offset(&self) -> i32 {
        self.offset
    }

    /// Appends `keys`/`values` `[batch, kv_heads, new, head_dim]` and returns every cached position,
    /// `[batch, kv_heads, offset + new, head_dim]`.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let [batch, heads, new, head_dim] = shape4(keys);
        let value_dim = values.shape()[3];
        let start = self.offset;
        let end = start + new;
        let capacity = self.keys.as_ref().map_or(0, |k| k.shape()[2]);
        if end > capacity {
            let grow = (new + Self::STEP - 1) / Self::STEP * Self::STEP;
            let fresh_k = ops::zeros_dtype(&[batch, heads, grow, head_dim], keys.dtype())?;
            let fresh_v = ops::zeros_dtype(&[batch, heads, grow, value_dim], values.dtype())?;
            let (k, v) = match (self.keys.take(), self.values.take()) {
                (Some(k), Some(v)) => {
                    // Drop the unused tail before growing, as mlx-lm does, so sizes stay step multiples.
                    let k = slice(&k, &[0, 0, 0, 0], &[batch, heads, start, head_dim])?;
                    let v = slice(&v, &[0, 0, 0, 0], &[batch, heads, start, value_dim])?;
                    (
                        ops::concatenate(&[k, fresh_k], 2)?,
                        ops::concatenate(&[v, fresh_v], 2)?,
                    )
                }
                _ => (fresh_k, fresh_v),
            };
            self.keys = Some(k);
            self.values = Some(v);
        }
        let (Some(k_buf), Some(v_buf)) = (self.keys.take(), self.values.take()) else {
            unreachable!("buffers were allocated above");
        };
        let k_buf = slice_update(
            &k_buf,
            keys,
            &[0, 0, start, 0],
            &[batch, heads, end, head_dim],
        )?;
        let v_buf = slice_update(
            &v_buf,
            values,
            &[0, 0, start, 0],
            &[batch, heads, end, value_dim],
        )?;
        self.offset = end;
        let capacity = k_buf.shape()[2];
        let fetched = if end < capacity {
            (
                slice(&k_buf, &[0, 0, 0, 0], &[batch, heads, end, head_dim])?,
                slice(&v_buf, &[0, 0, 0, 0], &[batch, heads, end, value_dim])?,
            )
        } else {
            (k_buf.clone(), v_buf.clone())
        };
        self.keys = Some(k_buf);
        self.values = Some(v_buf);
        Ok(fetched)
    }

    /// Forgets the last `n` positions (at most `offset`); returns how many were removed.
    pub fn trim(&mut self, n: i32) -> i32 {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    /// Positions `[start, end)` (`0 <= start <= end <= offset`) as keys and values
    /// `[batch, kv_heads, end - start, head_dim]`: views into this cache's buffers, valid for
    /// reading until the cache is written again (lazy).
    pub fn positions(&self, start: i32, end: i32) -> Result<(Array, Array)> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else {
            return Err(mlx_rs::error::Exception::from("positions of an empty KV cache").into());
        };
        debug_assert!(
            0 <= start && start <= end && end <= self.offset,
            "range {start}..{end} outside 0..{}",
            self.offset
        );
        let [batch, heads, _, head_dim] = shape4(k);
        let value_dim = v.shape()[3];
        Ok((
            slice(k, &[0, 0, start, 0], &[batch, heads, end, head_dim])?,
            slice(v, &[0, 0, start, 0], &[batch, heads, end, value_dim])?,
        ))
    }

    /// [`KvCache::positions`] in buffers of their own, which outlive this cache's buffers (lazy).
    pub fn copy_range(&self, start: i32, end: i32) -> Result<(Array, Array)> {
        let (keys, values) = self.positions(start, end)?;
        Ok((owned_copy(&keys)?, owned_copy(&values)?))
    }

    /// Bytes held by the buffers (capacity, not only the filled part).
    pub fn nbytes(&self) -> usize {
        self.keys.as_ref().map_or(0, Array::nbytes) + self.values.as_ref().map_or(0, Array::nbytes)
    }

    /// The arrays to evaluate so that the cache holds computed data rather than a lazy graph.
    pub fn state(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).collect()
    }
}

fn shape4(a: &Array) -> [i32; 4] {
    let s = a.shape();
    [s[0], s[1], s[2], s[3]]
}
