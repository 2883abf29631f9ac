//! The per-layer KV cache of one sequence (mlx-lm's `KVCache`, or `QuantizedKVCache` when
//! [`KvQuantization`] is set): buffers grown in steps of [`KvCache::STEP`] tokens and written in
//! place, never re-concatenated every token.
//!
//! A float cache holds two buffers, keys and values `[batch, kv_heads, capacity, head_dim]`. A
//! quantized one holds MLX affine-quantized keys and values (`mx.quantize` over the head
//! dimension), three buffers each: packed `[.., capacity, head_dim * bits / 32]` uint32, scales
//! and biases `[.., capacity, head_dim / group_size]`. Every buffer has the token axis at 2, so
//! growing, writing and slicing are the same code for both; "parts" below means these buffers'
//! contents in this order.

use mlx_rs::{ops, Array};

use crate::error::{EngineError, Result};
use crate::mlx_ext::{owned_copy, slice, slice_update};

/// KV cache quantization (MLX affine, as mlx_lm's `--kv-bits` / `--kv-group-size`): keys and
/// values are stored with `bits` per element plus a float scale and bias per `group_size`
/// elements of each head vector. 8 bits is close to lossless; 4 bits halves the memory again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvQuantization {
    pub bits: i32,
    pub group_size: i32,
}

impl KvQuantization {
    /// mlx_lm's default group size.
    pub const DEFAULT_GROUP_SIZE: i32 = 64;

    /// Checks `bits` (2, 3, 4, 5, 6 or 8) and `group_size` (32, 64 or 128), and that the group
    /// size divides `head_dim`.
    pub fn new(bits: i32, group_size: i32, head_dim: i32) -> Result<Self> {
        let invalid = |message: String| EngineError::InvalidKvQuantization(message);
        if ![2, 3, 4, 5, 6, 8].contains(&bits) {
            return Err(invalid(format!(
                "{bits} bits is not an MLX quantization width (2, 3, 4, 5, 6 or 8)"
            )));
        }
        if ![32, 64, 128].contains(&group_size) {
            return Err(invalid(format!(
                "group size {group_size} is not 32, 64 or 128"
            )));
        }
        if head_dim % group_size != 0 {
            return Err(invalid(format!(
                "group size {group_size} does not divide the model's head dimension {head_dim}"
            )));
        }
        Ok(Self { bits, group_size })
    }

    /// Bytes one head vector of `head_dim` elements takes: packed values plus a scale and a bias
    /// per group in the compute dtype (`dtype_bytes`).
    pub fn bytes_per_vector(&self, head_dim: usize, dtype_bytes: usize) -> usize {
        head_dim * self.bits as usize / 8 + 2 * (head_dim / self.group_size as usize) * dtype_bytes
    }
}

/// What attention reads after an update: every cached position, float or quantized.
pub enum CachedKv {
    /// Keys and values `[batch, kv_heads, positions, head_dim]`.
    Dense { keys: Array, values: Array },
    /// Packed values, scales and biases of keys and of values (see the module docs).
    Quantized {
        keys: [Array; 3],
        values: [Array; 3],
        quantization: KvQuantization,
    },
}

/// Keys and values `[batch, kv_heads, new, head_dim]` as a cache of format `quantization` stores
/// them: the two arrays, or their MLX-quantized parts (see the module docs).
pub(crate) fn kv_parts(
    quantization: Option<KvQuantization>,
    keys: &Array,
    values: &Array,
) -> Result<Vec<Array>> {
    Ok(match quantization {
        None => vec![keys.clone(), values.clone()],
        Some(q) => {
            let (kw, ks, kb) = ops::quantize(keys, q.group_size, q.bits)?;
            let (vw, vs, vb) = ops::quantize(values, q.group_size, q.bits)?;
            vec![kw, ks, kb, vw, vs, vb]
        }
    })
}

impl CachedKv {
    /// Parts in the order [`kv_parts`] makes them (2, or 6 when `quantization` is set).
    pub(crate) fn from_parts(quantization: Option<KvQuantization>, parts: Vec<Array>) -> Self {
        let mut all = parts.into_iter();
        let mut next = || all.next().expect("one part per buffer");
        match quantization {
            None => CachedKv::Dense {
                keys: next(),
                values: next(),
            },
            Some(quantization) => CachedKv::Quantized {
                keys: [next(), next(), next()],
                values: [next(), next(), next()],
                quantization,
            },
        }
    }
}

/// The cache of one layer of one sequence. An attention layer's: the first `offset` positions of
/// its key and value buffers are filled. A linear-attention layer's (Gated DeltaNet, see
/// [`KvCache::recurrent`]): the recurrent state after `offset` tokens, with no positions to read
/// (mlx_lm's `ArraysCache`).
#[derive(Default)]
pub struct KvCache {
    quantization: Option<KvQuantization>,
    /// Keys' parts then values' parts (2 or 6 buffers); empty until the first update.
    buffers: Vec<Array>,
    offset: i32,
    /// A recurrent layer's state, `None` before its first token; `None` for attention layers.
    recurrent: Option<RecurrentState>,
    is_recurrent: bool,
}

/// A linear-attention layer's state for one or more sequences (rows on axis 0).
#[derive(Clone)]
pub struct RecurrentState {
    /// The last `kernel - 1` inputs of the short convolution, `[rows, kernel - 1, channels]`.
    pub conv: Array,
    /// The recurrence's state, `[rows, value_heads, value_dim, key_dim]`, float32.
    pub ssm: Array,
}

impl KvCache {
    /// Growth step in tokens: the buffers are reallocated once per this many tokens.
    pub const STEP: i32 = 256;

    /// A float cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// A float cache, or a quantized one.
    pub fn with_quantization(quantization: Option<KvQuantization>) -> Self {
        Self {
            quantization,
            ..Self::default()
        }
    }

    /// The cache of a linear-attention layer: a recurrent state, no positions.
    pub fn recurrent() -> Self {
        Self {
            is_recurrent: true,
            ..Self::default()
        }
    }

    /// Whether this is a linear-attention layer's cache ([`KvCache::recurrent`]).
    pub fn is_recurrent(&self) -> bool {
        self.is_recurrent
    }

    /// The recurrent state after [`KvCache::offset`] tokens; `None` before the first.
    pub fn recurrent_state(&self) -> Option<&RecurrentState> {
        self.recurrent.as_ref()
    }

    /// Replaces the recurrent state with the one after `new_tokens` more tokens.
    pub fn set_recurrent_state(&mut self, state: RecurrentState, new_tokens: i32) {
        debug_assert!(self.is_recurrent, "a recurrent state in an attention cache");
        self.recurrent = Some(state);
        self.offset += new_tokens;
    }

    pub fn quantization(&self) -> Option<KvQuantization> {
        self.quantization
    }

    /// Number of cached positions.
    pub fn offset(&self) -> i32 {
        self.offset
    }

    /// Appends `keys`/`values` `[batch, kv_heads, new, head_dim]` (quantizing them first when
    /// this cache is quantized) and returns every cached position.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<CachedKv> {
        self.append_parts(&kv_parts(self.quantization, keys, values)?)?;
        Ok(CachedKv::from_parts(
            self.quantization,
            self.parts(0, self.offset)?,
        ))
    }

    /// Appends parts in this cache's own format (from [`KvCache::parts`] of a cache with the
    /// same quantization), all with the same number of new positions on axis 2.
    pub fn append_parts(&mut self, parts: &[Array]) -> Result<()> {
        if self.is_recurrent {
            return Err(mlx_rs::error::Exception::from(
                "KV positions given to a linear-attention layer's cache",
            )
            .into());
        }
        let expected = if self.quantization.is_some() { 6 } else { 2 };
        if parts.len() != expected {
            return Err(mlx_rs::error::Exception::from(
                format!("{} KV parts given to a cache of {expected}", parts.len()).as_str(),
            )
            .into());
        }
        let new = parts[0].shape()[2];
        let start = self.offset;
        let end = start + new;
        let capacity = self.buffers.first().map_or(0, |b| b.shape()[2]);
        if end > capacity {
            let grow = (new + Self::STEP - 1) / Self::STEP * Self::STEP;
            let old = std::mem::take(&mut self.buffers);
            for (i, part) in parts.iter().enumerate() {
                let s = part.shape();
                let fresh = ops::zeros_dtype(&[s[0], s[1], grow, s[3]], part.dtype())?;
                self.buffers.push(match old.get(i) {
                    // Drop the unused tail before growing, as mlx-lm does, so sizes stay step
                    // multiples.
                    Some(buffer) => ops::concatenate(
                        &[
                            slice(buffer, &[0, 0, 0, 0], &[s[0], s[1], start, s[3]])?,
                            fresh,
                        ],
                        2,
                    )?,
                    None => fresh,
                });
            }
        }
        for (buffer, part) in self.buffers.iter_mut().zip(parts) {
            let s = part.shape();
            *buffer = slice_update(buffer, part, &[0, 0, start, 0], &[s[0], s[1], end, s[3]])?;
        }
        self.offset = end;
        Ok(())
    }

    /// Forgets the last `n` positions (at most `offset`); returns how many were removed.
    pub fn trim(&mut self, n: i32) -> i32 {
        let n = n.min(self.offset);
        self.offset -= n;
        n
    }

    /// Positions `[start, end)` (`0 <= start <= end <= offset`) of every buffer, in this cache's
    /// own format: views, valid for reading until the cache is written again (lazy).
    pub fn parts(&self, start: i32, end: i32) -> Result<Vec<Array>> {
        if self.is_recurrent {
            return Err(mlx_rs::error::Exception::from(
                "a linear-attention layer's cache has no positions to read",
            )
            .into());
        }
        if self.buffers.is_empty() {
            return Err(mlx_rs::error::Exception::from("positions of an empty KV cache").into());
        }
        debug_assert!(
            0 <= start && start <= end && end <= self.offset,
            "range {start}..{end} outside 0..{}",
            self.offset
        );
        let capacity = self.buffers[0].shape()[2];
        self.buffers
            .iter()
            .map(|b| {
                if start == 0 && end == capacity {
                    return Ok(b.clone());
                }
                let s = b.shape();
                Ok(slice(b, &[0, 0, start, 0], &[s[0], s[1], end, s[3]])?)
            })
            .collect()
    }

    /// [`KvCache::parts`] in buffers of their own, which outlive this cache's buffers (lazy).
    pub fn copy_parts(&self, start: i32, end: i32) -> Result<Vec<Array>> {
        self.parts(start, end)?
            .iter()
            .map(|p| Ok(owned_copy(p)?))
            .collect()
    }

    /// Positions `[start, end)` as float keys and values `[batch, kv_heads, end - start,
    /// head_dim]`, dequantized when the cache is quantized (lazy).
    pub fn positions(&self, start: i32, end: i32) -> Result<(Array, Array)> {
        let parts = self.parts(start, end)?;
        Ok(match (self.quantization, parts.as_slice()) {
            (None, [keys, values]) => (keys.clone(), values.clone()),
            (Some(q), [kw, ks, kb, vw, vs, vb]) => (
                ops::dequantize(kw, ks, kb, q.group_size, q.bits)?,
                ops::dequantize(vw, vs, vb, q.group_size, q.bits)?,
            ),
            _ => unreachable!("a cache holds 2 or 6 buffers"),
        })
    }

    /// Appends the first `end` positions of `other`, converting between float and quantized
    /// when the two caches differ.
    pub fn extend_from(&mut self, other: &KvCache, end: i32) -> Result<()> {
        if end == 0 {
            return Ok(());
        }
        if other.quantization == self.quantization {
            return self.append_parts(&other.parts(0, end)?);
        }
        let (keys, values) = other.positions(0, end)?;
        self.update_and_fetch(&keys, &values).map(drop)
    }

    /// Bytes held by the buffers (capacity, not only the filled part).
    pub fn nbytes(&self) -> usize {
        self.state().into_iter().map(Array::nbytes).sum()
    }

    /// The arrays to evaluate so that the cache holds computed data rather than a lazy graph.
    pub fn state(&self) -> Vec<&Array> {
        let recurrent = self.recurrent.iter().flat_map(|r| [&r.conv, &r.ssm]);
        self.buffers.iter().chain(recurrent).collect()
    }
}
