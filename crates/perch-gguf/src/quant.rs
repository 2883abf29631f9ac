//! ggml block quantization → MLX affine quantization, and undoing llama.cpp's RoPE row order.
//!
//! ggml blocks (`ggml/src/ggml-common.h`, `block_q4_0` / `block_q4_1` / `block_q8_0`), 32 weights
//! each, consecutive along a row (`ne[0]`):
//! - Q4_0, 18 bytes: f16 `d`, then 16 bytes `qs`; byte `k` holds weight `k` in its low nibble
//!   and weight `k + 16` in its high nibble; `w = d * (q - 8)`.
//! - Q4_1, 20 bytes: f16 `d`, f16 `m`, 16 bytes `qs` as above; `w = d * q + m`.
//! - Q8_0, 34 bytes: f16 `d`, 32 × i8 `qs`; `w = d * q`.
//!
//! MLX affine (`mlx.core.quantize`, `mode="affine"`): a weight `[out, in]` becomes `weight`
//! uint32 `[out, in * bits / 32]` where weight `j` of a word sits at bits `j*bits .. j*bits+bits`
//! (LSB first, consecutive along `in`), plus `scales` and `biases` `[out, in / group_size]`;
//! `w = scale * q + bias`. Each ggml block maps to exactly one MLX group of 32:
//! - Q4_1 → bits 4, scale `d`, bias `m`.
//! - Q4_0 → bits 4, scale `d`, bias `-8d`.
//! - Q8_0 → bits 8, codes `q + 128` (unsigned), scale `d`, bias `-128d`.
//!
//! Scales and biases are stored as float16. This is lossless: `d` and `m` are f16 already, and
//! `-8d` / `-128d` multiply an f16 by a power of two, which is exact in f16 (subnormals included)
//! unless it overflows; overflow is reported as [`GgufError::ScaleOverflow`], never written.
//! In exact arithmetic (and in f32, where every product and sum here is exact)
//! `scale * q + bias` equals the ggml formula exactly (up to the sign of a zero: ggml's
//! `d * (8 - 8)` may give -0 where MLX gives +0); the block tests check every finite f16 scale.

use half::f16;

use crate::ggml_type::GgmlType;
use crate::GgufError;

/// Weights per ggml block for Q4_0, Q4_1 and Q8_0 (`QK4_0`, `QK4_1`, `QK8_0`); also the MLX
/// group size of the converted weights.
pub(crate) const BLOCK_ELEMS: usize = 32;

/// MLX affine quantization parameters of one weight (`quantization` entries in config.json).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct AffineParams {
    /// Bits per weight (4 or 8 here).
    pub(crate) bits: u32,
    /// Weights sharing one scale and bias, along the input dimension.
    pub(crate) group_size: u32,
}

/// The ggml block formats that convert losslessly to MLX affine quantization.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockFormat {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl BlockFormat {
    pub(crate) fn from_ggml(ggml_type: GgmlType) -> Option<Self> {
        match ggml_type {
            GgmlType::Q4_0 => Some(BlockFormat::Q4_0),
            GgmlType::Q4_1 => Some(BlockFormat::Q4_1),
            GgmlType::Q8_0 => Some(BlockFormat::Q8_0),
            _ => None,
        }
    }

    /// Bytes of one ggml block.
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q8_0 => 34,
        }
    }

    pub(crate) fn params(self) -> AffineParams {
        let bits = match self {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 => 4,
            BlockFormat::Q8_0 => 8,
        };
        AffineParams {
            bits,
            group_size: BLOCK_ELEMS as u32,
        }
    }

    /// Bytes of MLX codes for one block (32 weights at `bits` each).
    pub(crate) fn packed_bytes(self) -> usize {
        BLOCK_ELEMS * self.params().bits as usize / 8
    }
}

/// A block whose bias does not fit in float16.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct BiasOverflow {
    pub(crate) scale: f32,
    pub(crate) bias: f32,
}

fn read_f16(bytes: &[u8], at: usize) -> f16 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]])
}

/// The 4-bit code of weight `e` (0..32) in a Q4_0/Q4_1 `qs` array.
fn nibble(qs: &[u8], e: usize) -> u8 {
    if e < 16 {
        qs[e] & 0x0f
    } else {
        qs[e - 16] >> 4
    }
}

/// Converts one ggml block (`format.block_bytes()` bytes) into MLX codes written to `codes`
/// (`format.packed_bytes()` bytes, the little-endian bytes of the uint32 words) and returns
/// `(scale, bias)`.
pub(crate) fn convert_block(
    format: BlockFormat,
    block: &[u8],
    codes: &mut [u8],
) -> Result<(f16, f16), BiasOverflow> {
    let d = read_f16(block, 0);
    let (qs, bias_f32) = match format {
        BlockFormat::Q4_1 => (&block[4..20], read_f16(block, 2).to_f32()),
        BlockFormat::Q4_0 => (&block[2..18], -8.0 * d.to_f32()),
        BlockFormat::Q8_0 => (&block[2..34], -128.0 * d.to_f32()),
    };
    let bias = f16::from_f32(bias_f32);
    // Exact by construction (see module docs) except on overflow; checked rather than assumed.
    if bias_f32.is_finite() && bias.to_f32() != bias_f32 {
        return Err(BiasOverflow {
            scale: d.to_f32(),
            bias: bias_f32,
        });
    }
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
            // Little-endian words, LSB first: byte b holds weights 2b (low) and 2b+1 (high).
            for (b, out) in codes[..16].iter_mut().enumerate() {
                *out = nibble(qs, 2 * b) | (nibble(qs, 2 * b + 1) << 4);
            }
        }
        BlockFormat::Q8_0 => {
            // i8 q → u8 q + 128 is flipping the sign bit.
            for (out, &q) in codes[..32].iter_mut().zip(qs) {
                *out = q ^ 0x80;
            }
        }
    }
    Ok((d, bias))
}

/// Dequantizes one ggml block with ggml's own formulas (`dequantize_row_q4_0` etc.), in f32.
pub(crate) fn dequantize_block(format: BlockFormat, block: &[u8]) -> [f32; BLOCK_ELEMS] {
    let d = read_f16(block, 0).to_f32();
    let mut out = [0f32; BLOCK_ELEMS];
    match format {
        BlockFormat::Q4_0 => {
            for (e, w) in out.iter_mut().enumerate() {
                *w = (i32::from(nibble(&block[2..18], e)) - 8) as f32 * d;
            }
        }
        BlockFormat::Q4_1 => {
            let m = read_f16(block, 2).to_f32();
            for (e, w) in out.iter_mut().enumerate() {
                *w = f32::from(nibble(&block[4..20], e)) * d + m;
            }
        }
        BlockFormat::Q8_0 => {
            for (w, &q) in out.iter_mut().zip(&block[2..34]) {
                *w = f32::from(q as i8) * d;
            }
        }
    }
    out
}

/// A weight converted to MLX affine layout; all buffers are little-endian bytes.
#[derive(Debug)]
pub(crate) struct AffineTensor {
    /// uint32 `[rows, cols * bits / 32]`.
    pub(crate) weight: Vec<u8>,
    /// float16 `[rows, cols / 32]`.
    pub(crate) scales: Vec<u8>,
    /// float16 `[rows, cols / 32]`.
    pub(crate) biases: Vec<u8>,
}

/// Converts a `[rows, cols]` ggml block-quantized weight to MLX affine layout.
///
/// `row_order[i]` is the source row of output row `i` (see [`rope_unpermute_order`]); `None`
/// keeps the order. `data` must hold `rows * cols / 32` blocks. Errors:
/// [`GgufError::ScaleOverflow`] (named after `tensor`), [`GgufError::InvalidTensor`] on a size
/// mismatch.
pub(crate) fn convert_affine(
    format: BlockFormat,
    data: &[u8],
    rows: usize,
    cols: usize,
    row_order: Option<&[usize]>,
    tensor: &str,
) -> Result<AffineTensor, GgufError> {
    let blocks_per_row = cols / BLOCK_ELEMS;
    let src_row_bytes = blocks_per_row * format.block_bytes();
    if !cols.is_multiple_of(BLOCK_ELEMS) || data.len() != rows * src_row_bytes {
        return Err(GgufError::InvalidTensor {
            tensor: tensor.to_string(),
            reason: format!(
                "{} bytes do not hold a [{rows}, {cols}] {format:?} tensor",
                data.len()
            ),
        });
    }
    let packed = format.packed_bytes();
    let mut weight = vec![0u8; rows * blocks_per_row * packed];
    let mut scales = Vec::with_capacity(rows * blocks_per_row * 2);
    let mut biases = Vec::with_capacity(rows * blocks_per_row * 2);
    for (row, codes_row) in weight.chunks_exact_mut(blocks_per_row * packed).enumerate() {
        let src = row_order.map_or(row, |order| order[row]);
        let src_row = &data[src * src_row_bytes..(src + 1) * src_row_bytes];
        for (block, codes) in src_row
            .chunks_exact(format.block_bytes())
            .zip(codes_row.chunks_exact_mut(packed))
        {
            let (scale, bias) =
                convert_block(format, block, codes).map_err(|o| GgufError::ScaleOverflow {
                    tensor: tensor.to_string(),
                    scale: o.scale,
                    bias: o.bias,
                })?;
            scales.extend_from_slice(&scale.to_le_bytes());
            biases.extend_from_slice(&bias.to_le_bytes());
        }
    }
    Ok(AffineTensor {
        weight,
        scales,
        biases,
    })
}

/// Dequantizes a whole ggml block-quantized tensor to f32 little-endian bytes (used for the
/// rare quantized 1-D tensor, which MLX cannot hold quantized).
pub(crate) fn dequantize_to_f32_bytes(format: BlockFormat, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() / format.block_bytes() * BLOCK_ELEMS * 4);
    for block in data.chunks_exact(format.block_bytes()) {
        for w in dequantize_block(format, block) {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    out
}

/// Copies rows of `row_bytes` bytes in the order given (`order[i]` = source row of row `i`).
pub(crate) fn reorder_rows(data: &[u8], row_bytes: usize, order: &[usize]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len());
    for &src in order {
        out.extend_from_slice(&data[src * row_bytes..(src + 1) * row_bytes]);
    }
    out
}

/// For each row of a Hugging Face q/k projection, the GGUF row it is stored in.
///
/// llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute`) reorders the rows of `q_proj`
/// and `k_proj` so ggml's RoPE, which rotates adjacent pairs, matches Hugging Face's, which
/// rotates the two halves of each head:
/// `w.reshape(n_head, 2, head_dim / 2, in).swapaxes(1, 2).reshape(out, in)`.
/// So HF row `h*head_dim + s*(head_dim/2) + j` sits at GGUF row `h*head_dim + 2j + s`.
/// `n_head` is the attention head count for q and the KV head count for k.
pub(crate) fn rope_unpermute_order(rows: usize, n_head: usize) -> Result<Vec<usize>, String> {
    if n_head == 0 || !rows.is_multiple_of(n_head) || !(rows / n_head).is_multiple_of(2) {
        return Err(format!(
            "{rows} rows cannot be split into {n_head} heads of even size"
        ));
    }
    let head_dim = rows / n_head;
    let half = head_dim / 2;
    let mut order = Vec::with_capacity(rows);
    for h in 0..n_head {
        for s in 0..2 {
            for j in 0..half {
                order.push(h * head_dim + 2 * j + s);
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MLX's dequantization, written from the layout definition: unpack `bits`-wide fields from
    /// u32 words LSB first, then `scale * q + bias` in f32.
    fn mlx_dequantize(codes: &[u8], bits: u32, scale: f16, bias: f16) -> Vec<f32> {
        let per_word = (32 / bits) as usize;
        let mask = (1u32 << bits) - 1;
        let mut out = Vec::new();
        for word in codes.chunks_exact(4) {
            let word = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            for k in 0..per_word {
                let q = (word >> (bits as usize * k)) & mask;
                out.push(scale.to_f32() * q as f32 + bias.to_f32());
            }
        }
        out
    }

    fn q4_block(format: BlockFormat, d: f32, m: f32, codes: [u8; 32]) -> Vec<u8> {
        let mut block = f16::from_f32(d).to_le_bytes().to_vec();
        if format == BlockFormat::Q4_1 {
            block.extend_from_slice(&f16::from_f32(m).to_le_bytes());
        }
        for k in 0..16 {
            block.push(codes[k] | (codes[k + 16] << 4));
        }
        block
    }

    fn q8_block(d: f16, qs: [i8; 32]) -> Vec<u8> {
        let mut block = d.to_le_bytes().to_vec();
        block.extend(qs.iter().map(|&q| q as u8));
        block
    }

    fn assert_exact(format: BlockFormat, block: &[u8]) {
        let mut codes = vec![0u8; format.packed_bytes()];
        let (scale, bias) = convert_block(format, block, &mut codes).unwrap();
        let mlx = mlx_dequantize(&codes, format.params().bits, scale, bias);
        let ggml = dequantize_block(format, block);
        for (e, (a, b)) in mlx.iter().zip(ggml.iter()).enumerate() {
            // Value equality: the two formulas may differ only in the sign of a zero.
            assert!(a == b, "{format:?} weight {e}: mlx {a} vs ggml {b}");
        }
    }

    #[test]
    fn q4_1_block_converts_losslessly_and_in_mlx_bit_order() {
        let codes: [u8; 32] = std::array::from_fn(|e| (e % 16) as u8);
        let block = q4_block(BlockFormat::Q4_1, 0.5, -1.0, codes);
        let mut packed = [0u8; 16];
        let (scale, bias) = convert_block(BlockFormat::Q4_1, &block, &mut packed).unwrap();
        // Weights 0..8 hold codes 0..7, LSB first.
        assert_eq!(
            u32::from_le_bytes(packed[0..4].try_into().unwrap()),
            0x7654_3210
        );
        assert_eq!(
            u32::from_le_bytes(packed[4..8].try_into().unwrap()),
            0xfedc_ba98
        );
        assert_eq!((scale.to_f32(), bias.to_f32()), (0.5, -1.0));
        let ggml = dequantize_block(BlockFormat::Q4_1, &block);
        assert_eq!(ggml[3], 0.5 * 3.0 - 1.0, "ggml formula: d * q + m");
        assert_eq!(
            ggml[31],
            0.5 * 15.0 - 1.0,
            "weight 31 is the high nibble of byte 15"
        );
        assert_exact(BlockFormat::Q4_1, &block);
    }

    #[test]
    fn q4_0_block_converts_losslessly() {
        let codes: [u8; 32] = std::array::from_fn(|e| ((e * 7 + 3) % 16) as u8);
        let block = q4_block(BlockFormat::Q4_0, -0.0371, 0.0, codes);
        let ggml = dequantize_block(BlockFormat::Q4_0, &block);
        let d = f16::from_f32(-0.0371).to_f32();
        assert_eq!(ggml[0], d * (3.0 - 8.0), "ggml formula: d * (q - 8)");
        assert_exact(BlockFormat::Q4_0, &block);
    }

    #[test]
    fn q8_0_block_converts_losslessly_with_extreme_codes() {
        let qs: [i8; 32] = std::array::from_fn(|e| match e {
            0 => -128,
            1 => 127,
            2 => 0,
            e => (e as i8).wrapping_mul(37),
        });
        let block = q8_block(f16::from_f32(0.0123), qs);
        let mut packed = [0u8; 32];
        convert_block(BlockFormat::Q8_0, &block, &mut packed).unwrap();
        assert_eq!(&packed[..3], &[0, 255, 128], "codes are q + 128");
        let ggml = dequantize_block(BlockFormat::Q8_0, &block);
        assert_eq!(
            ggml[0],
            -128.0 * f16::from_f32(0.0123).to_f32(),
            "ggml formula: d * q"
        );
        assert_exact(BlockFormat::Q8_0, &block);
    }

    #[test]
    fn every_finite_f16_scale_stays_exact() {
        // Includes subnormals, negatives and the largest scales that do not overflow.
        let qs: [i8; 32] = std::array::from_fn(|e| (e as i32 * 8 - 128) as i8);
        let codes: [u8; 32] = std::array::from_fn(|e| (e % 16) as u8);
        for bits in 0..=u16::MAX {
            let d = f16::from_bits(bits);
            if !d.is_finite() {
                continue;
            }
            if d.to_f32().abs() < 511.0 {
                assert_exact(BlockFormat::Q8_0, &q8_block(d, qs));
            }
            if d.to_f32().abs() < 8000.0 {
                let mut block = q4_block(BlockFormat::Q4_0, 0.0, 0.0, codes);
                block[..2].copy_from_slice(&d.to_le_bytes());
                assert_exact(BlockFormat::Q4_0, &block);
            }
        }
    }

    #[test]
    fn overflowing_bias_is_an_error_naming_the_tensor() {
        let block = q8_block(f16::from_f32(1000.0), [1; 32]);
        let err = convert_affine(
            BlockFormat::Q8_0,
            &block,
            1,
            32,
            None,
            "blk.3.ffn_up.weight",
        )
        .unwrap_err();
        assert!(matches!(err, GgufError::ScaleOverflow { .. }), "{err}");
        assert!(err.to_string().contains("blk.3.ffn_up.weight"), "{err}");
    }

    #[test]
    fn convert_affine_lays_out_rows_and_groups() {
        // Two rows of two blocks; row 1 first via row_order.
        let mut data = Vec::new();
        for (d, m) in [(1.0, 0.0), (2.0, 0.5), (3.0, 1.0), (4.0, 1.5)] {
            data.extend(q4_block(BlockFormat::Q4_1, d, m, [1; 32]));
        }
        let t = convert_affine(BlockFormat::Q4_1, &data, 2, 64, Some(&[1, 0]), "w").unwrap();
        assert_eq!(t.weight.len(), 2 * 64 / 2);
        let scales: Vec<f32> = t
            .scales
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        assert_eq!(scales, vec![3.0, 4.0, 1.0, 2.0]);
        let err = convert_affine(BlockFormat::Q4_1, &data[1..], 2, 64, None, "w").unwrap_err();
        assert!(matches!(err, GgufError::InvalidTensor { .. }));
    }

    /// llama.cpp's permutation, written as numpy does it: index `[h][s][j]`, read out `[h][j][s]`.
    fn llama_cpp_permute<T: Copy>(rows: &[T], n_head: usize) -> Vec<T> {
        let head_dim = rows.len() / n_head;
        let half = head_dim / 2;
        let at = |h: usize, s: usize, j: usize| rows[(h * 2 + s) * half + j];
        let mut out = Vec::with_capacity(rows.len());
        for h in 0..n_head {
            for j in 0..half {
                for s in 0..2 {
                    out.push(at(h, s, j));
                }
            }
        }
        out
    }

    #[test]
    fn rope_unpermute_inverts_llama_cpp_permute() {
        assert_eq!(rope_unpermute_order(4, 1).unwrap(), vec![0, 2, 1, 3]);
        for (rows, n_head) in [(576, 9), (192, 3), (8, 2), (128, 1)] {
            let hf_rows: Vec<usize> = (0..rows).collect();
            let gguf_rows = llama_cpp_permute(&hf_rows, n_head);
            assert_ne!(gguf_rows, hf_rows);
            let order = rope_unpermute_order(rows, n_head).unwrap();
            let restored: Vec<usize> = order.iter().map(|&g| gguf_rows[g]).collect();
            assert_eq!(restored, hf_rows, "rows {rows}, heads {n_head}");
        }
        assert!(rope_unpermute_order(6, 4).is_err());
        assert!(rope_unpermute_order(6, 2).is_err(), "odd head_dim");
    }

    #[test]
    fn reorder_rows_moves_whole_rows() {
        let data = [1u8, 2, 3, 4, 5, 6];
        assert_eq!(reorder_rows(&data, 2, &[2, 0, 1]), vec![5, 6, 1, 2, 3, 4]);
    }
}
