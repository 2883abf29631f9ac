//! `y = x · dequantize(W)ᵀ` on the CPU for a weight `W` stored in MLX's affine quantized layout.
//!
//! MLX's CPU backend runs `quantized_matmul` as scalar code (~1.8 GFLOP/s on the 2-core dev
//! machine, whatever the number of rows) and its `dequantize` costs ~2 ns per weight, while a
//! float32 GEMM reaches ~100 GFLOP/s. This crate dequantizes up to 64 of `W`'s rows at a time
//! into a scratch buffer (each core its own rows, rayon) and multiplies them with `x` by a
//! register-blocked kernel: 4 rows of `W` against 2 rows of `x` at a time (AVX2 on x86_64, plain
//! dot products elsewhere), `x` read in blocks of 64 rows that stay in the L2 cache.
//!
//! Each output is one dot product summed in the same order whatever the number of rows of `x`:
//! a sequence's results do not depend on the batch it runs in (the engine's batched steps give
//! the ids the sequence gets alone). A general GEMM (packing, then blocks whose shape depends on
//! the operands) would not keep that; at 512 rows it was also no faster here once its packing of
//! the strided tile was counted.
//!
//! Nothing of `W` is dequantized as a whole, so the extra memory is 64 rows per core.
//!
//! Layout (MLX `mx.quantize`, mode `affine`): for `W` `[rows, cols]` quantized with `bits` ∈
//! {2, 4, 8} and `group_size`:
//! - `packed` `[rows, cols * bits / 32]` uint32, element `j` of a word in bits `bits*j ..`;
//! - `scales`, `biases` `[rows, cols / group_size]` float32;
//! - `w[r, c] = scales[r, g] * q[r, c] + biases[r, g]` with `g = c / group_size`.
//!
//! Results differ from MLX's own kernels by float32 rounding only (summation order).

use std::cell::RefCell;

use rayon::prelude::*;

/// Rows of `W` dequantized together and multiplied by one pass of the kernel.
const W_BLOCK: usize = 4;
/// Rows of `W` per parallel work item, dequantized once into its scratch buffer.
const CHUNK_ROWS: usize = 64;
/// Rows of `x` multiplied with a chunk's rows before the next ones (they stay in L2).
const X_BLOCK_ROWS: usize = 64;
/// Below this many weights a matrix is handled on the calling thread alone: spawning costs more
/// than it saves.
const PARALLEL_MIN_ELEMENTS: usize = 256 << 10;

/// Why a matrix or an operand was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QgemmError {
    #[error("{bits}-bit weights are not supported (only 2, 4 and 8)")]
    UnsupportedBits { bits: u32 },
    #[error("group size {group_size} must be a positive multiple of {per_word} dividing the {cols} columns")]
    BadGroupSize {
        group_size: usize,
        cols: usize,
        per_word: usize,
    },
    #[error("{name} has {found} elements, expected {expected}")]
    Length {
        name: &'static str,
        found: usize,
        expected: usize,
    },
}

/// A borrowed quantized matrix `W` `[rows, cols]` (see the crate docs for the layout).
#[derive(Clone, Copy, Debug)]
pub struct QuantizedMatrix<'a> {
    packed: &'a [u32],
    scales: &'a [f32],
    biases: &'a [f32],
    rows: usize,
    cols: usize,
    group_size: usize,
    bits: u32,
}

impl<'a> QuantizedMatrix<'a> {
    /// Checks that the buffers match `[rows, cols]` with the given `group_size` and `bits`.
    pub fn new(
        packed: &'a [u32],
        scales: &'a [f32],
        biases: &'a [f32],
        rows: usize,
        cols: usize,
        group_size: usize,
        bits: u32,
    ) -> Result<Self, QgemmError> {
        if !matches!(bits, 2 | 4 | 8) {
            return Err(QgemmError::UnsupportedBits { bits });
        }
        let per_word = (32 / bits) as usize;
        if group_size == 0
            || !group_size.is_multiple_of(per_word)
            || !cols.is_multiple_of(group_size)
        {
            return Err(QgemmError::BadGroupSize {
                group_size,
                cols,
                per_word,
            });
        }
        let check = |name, found: usize, expected: usize| {
            if found == expected {
                Ok(())
            } else {
                Err(QgemmError::Length {
                    name,
                    found,
                    expected,
                })
            }
        };
        check("packed", packed.len(), rows * cols / per_word)?;
        check("scales", scales.len(), rows * (cols / group_size))?;
        check("biases", biases.len(), rows * (cols / group_size))?;
        Ok(Self {
            packed,
            scales,
            biases,
            rows,
            cols,
            group_size,
            bits,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Writes rows `first .. first + dst.len() / cols` of `W` as float32 into `dst`.
    ///
    /// Panics if those rows are out of range or `dst.len()` is not a multiple of `cols`.
    pub fn dequantize_rows(&self, first: usize, dst: &mut [f32]) {
        assert_eq!(dst.len() % self.cols, 0, "dst must hold whole rows");
        assert!(
            first + dst.len() / self.cols <= self.rows,
            "rows out of range"
        );
        self.dequantize_rows_permuted(first, dst);
        let mut permuted = vec![0f32; self.cols];
        for row in dst.chunks_exact_mut(self.cols) {
            permuted.copy_from_slice(row);
            self.unpermute_row(&permuted, row);
        }
    }
}

/// Within each row, the order in which [`QuantizedMatrix::dequantize_rows_permuted`] writes
/// columns: position `j * words_per_row + k` holds column `k * per_word + j` (value `j` of word
/// `k`), so one shift applies to a whole run of consecutive words and the loop vectorizes at
/// any group size.
impl QuantizedMatrix<'_> {
    fn words_per_row(&self) -> usize {
        self.cols * self.bits as usize / 32
    }

    /// `x` `[m, cols]` with each row's columns in the permuted order.
    fn permute_columns(&self, x: &[f32]) -> Vec<f32> {
        let per_word = (32 / self.bits) as usize;
        let words = self.words_per_row();
        let mut permuted = vec![0f32; x.len()];
        for (dst, src) in permuted
            .chunks_exact_mut(self.cols)
            .zip(x.chunks_exact(self.cols))
        {
            for (k, values) in src.chunks_exact(per_word).enumerate() {
                for (j, &value) in values.iter().enumerate() {
                    dst[j * words + k] = value;
                }
            }
        }
        permuted
    }

    /// The inverse for one row: `permuted` back to column order in `dst`.
    fn unpermute_row(&self, permuted: &[f32], dst: &mut [f32]) {
        let per_word = (32 / self.bits) as usize;
        let words = self.words_per_row();
        for (k, values) in dst.chunks_exact_mut(per_word).enumerate() {
            for (j, value) in values.iter_mut().enumerate() {
                *value = permuted[j * words + k];
            }
        }
    }

    /// Like [`QuantizedMatrix::dequantize_rows`], in the permuted column order.
    #[inline(always)]
    fn dequantize_rows_permuted(&self, first: usize, dst: &mut [f32]) {
        let words_per_row = self.cols * self.bits as usize / 32;
        let groups_per_row = self.cols / self.group_size;
        for (i, row) in dst.chunks_exact_mut(self.cols).enumerate() {
            let r = first + i;
            let packed = &self.packed[r * words_per_row..(r + 1) * words_per_row];
            let scales = &self.scales[r * groups_per_row..(r + 1) * groups_per_row];
            let biases = &self.biases[r * groups_per_row..(r + 1) * groups_per_row];
            match self.bits {
                2 => dequantize_row_permuted::<2>(packed, scales, biases, self.group_size, row),
                4 => dequantize_row_permuted::<4>(packed, scales, biases, self.group_size, row),
                _ => dequantize_row_permuted::<8>(packed, scales, biases, self.group_size, row),
            }
        }
    }
}

/// Words of a row dequantized per pass of [`dequantize_row_permuted`] (at most; whole groups):
/// their scales and biases, one per word, fit on the stack.
const SEGMENT_WORDS: usize = 256;

#[inline(always)]
fn dequantize_row_permuted<const BITS: u32>(
    packed: &[u32],
    scales: &[f32],
    biases: &[f32],
    group_size: usize,
    dst: &mut [f32],
) {
    let per_word = (32 / BITS) as usize;
    let mask = (1u32 << BITS) - 1;
    let words_per_group = group_size / per_word;
    let words = packed.len();
    let groups_per_segment = SEGMENT_WORDS / words_per_group;
    if groups_per_segment == 0 {
        // Groups longer than a segment: each group's runs are long enough to vectorize alone.
        for (g, run) in packed.chunks_exact(words_per_group).enumerate() {
            let (scale, bias) = (scales[g], biases[g]);
            for j in 0..per_word {
                let shift = BITS as usize * j;
                let at = j * words + g * words_per_group;
                for (value, &word) in dst[at..at + words_per_group].iter_mut().zip(run) {
                    *value = scale * ((word >> shift) & mask) as i32 as f32 + bias;
                }
            }
        }
        return;
    }
    let mut word_scales = [0f32; SEGMENT_WORDS];
    let mut word_biases = [0f32; SEGMENT_WORDS];
    let segments = packed.chunks(groups_per_segment * words_per_group).zip(
        scales
            .chunks(groups_per_segment)
            .zip(biases.chunks(groups_per_segment)),
    );
    for (s, (segment, (segment_scales, segment_biases))) in segments.enumerate() {
        let first = s * groups_per_segment * words_per_group;
        let n = segment.len();
        let per_group = word_scales[..n]
            .chunks_exact_mut(words_per_group)
            .zip(word_biases[..n].chunks_exact_mut(words_per_group));
        for ((word_scale, word_bias), (&scale, &bias)) in
            per_group.zip(segment_scales.iter().zip(segment_biases))
        {
            word_scale.fill(scale);
            word_bias.fill(bias);
        }
        for j in 0..per_word {
            let shift = BITS as usize * j;
            let out = &mut dst[j * words + first..j * words + first + n];
            for (((value, &word), &scale), &bias) in out
                .iter_mut()
                .zip(segment)
                .zip(&word_scales)
                .zip(&word_biases)
            {
                // Masked values fit in an i32, whose conversion is one instruction.
                *value = scale * ((word >> shift) & mask) as i32 as f32 + bias;
            }
        }
    }
}

/// `y = x · Wᵀ`: `x` `[m, W.cols]` and `y` `[m, W.rows]`, both row-major float32.
///
/// Uses every core (rayon's pool) for matrices of 256K weights or more. Errors if a buffer has
/// the wrong length.
pub fn matmul_transposed(
    x: &[f32],
    m: usize,
    w: &QuantizedMatrix,
    y: &mut [f32],
) -> Result<(), QgemmError> {
    if x.len() != m * w.cols {
        return Err(QgemmError::Length {
            name: "x",
            found: x.len(),
            expected: m * w.cols,
        });
    }
    if y.len() != m * w.rows {
        return Err(QgemmError::Length {
            name: "y",
            found: y.len(),
            expected: m * w.rows,
        });
    }
    if m == 0 || w.rows == 0 {
        return Ok(());
    }
    let x = w.permute_columns(x);
    let out = OutPtr(y.as_mut_ptr());
    let chunk_rows = CHUNK_ROWS;
    let chunks = w.rows.div_ceil(chunk_rows);
    let avx2 = has_avx2_fma();
    let run = |chunk: usize| {
        let start = chunk * chunk_rows;
        let end = (start + chunk_rows).min(w.rows);
        // SAFETY: `y` is `[m, w.rows]` (checked above) and borrowed mutably for this call; each
        // chunk writes only its own columns `start..end`. The AVX2 variant runs only where the
        // CPU has AVX2 and FMA.
        SCRATCH.with_borrow_mut(|scratch| unsafe {
            if avx2 {
                #[cfg(target_arch = "x86_64")]
                multiply_rows_avx2(&x, m, w, start, end, out, scratch);
            } else {
                multiply_rows(&x, m, w, start, end, out, scratch);
            }
        })
    };
    if w.rows * w.cols >= PARALLEL_MIN_ELEMENTS {
        (0..chunks).into_par_iter().for_each(run);
    } else {
        (0..chunks).for_each(run);
    }
    Ok(())
}

/// Whether the CPU has AVX2 and FMA (x86_64 builds target SSE2 only unless told otherwise).
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`multiply_rows`] compiled for AVX2 + FMA.
///
/// # Safety
/// As for [`multiply_rows`], and the CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn multiply_rows_avx2(
    x: &[f32],
    m: usize,
    w: &QuantizedMatrix,
    start: usize,
    end: usize,
    out: OutPtr,
    scratch: &mut Vec<f32>,
) {
    multiply_rows(x, m, w, start, end, out, scratch)
}

/// `y[:, start..end] = x · W[start..end]ᵀ`; `x` in the permuted column order of
/// [`QuantizedMatrix::permute_columns`], multiplied with `W`'s rows [`W_BLOCK`] at a time
/// ([`multiply_block`]): up to [`X_BLOCK_ROWS`] rows of `x`, those rows dequantized in turn
/// (each is read once); more, all of them dequantized into `scratch` once, then each block of
/// [`X_BLOCK_ROWS`] rows of `x` multiplied with them. The same values and sums either way.
///
/// # Safety
/// `out` must point to a writable `[m, w.rows]` row-major buffer whose columns `start..end` no
/// one else touches during the call.
#[inline(always)]
unsafe fn multiply_rows(
    x: &[f32],
    m: usize,
    w: &QuantizedMatrix,
    start: usize,
    end: usize,
    out: OutPtr,
    scratch: &mut Vec<f32>,
) {
    debug_assert_eq!(x.len(), m * w.cols);
    if m <= X_BLOCK_ROWS {
        // One block of `x`: each row of `W` is read once, so W_BLOCK rows at a time (in L1).
        scratch.resize(W_BLOCK * w.cols, 0.0);
        for first in (start..end).step_by(W_BLOCK) {
            let block = &mut scratch[..W_BLOCK.min(end - first) * w.cols];
            w.dequantize_rows_permuted(first, block);
            multiply_block(x, m, w.cols, block, |i, b, value| {
                *out.0.add(i * w.rows + first + b) = value;
            });
        }
        return;
    }
    scratch.resize((end - start) * w.cols, 0.0);
    w.dequantize_rows_permuted(start, scratch);
    for (xb, x_block) in x.chunks(X_BLOCK_ROWS * w.cols).enumerate() {
        let first_row = xb * X_BLOCK_ROWS;
        let rows_x = x_block.len() / w.cols;
        for (wb, block) in scratch.chunks(W_BLOCK * w.cols).enumerate() {
            let first = start + wb * W_BLOCK;
            multiply_block(x_block, rows_x, w.cols, block, |i, b, value| {
                *out.0.add((first_row + i) * w.rows + first + b) = value;
            });
        }
    }
}

/// Every dot product of the `m` rows of `x` `[m, cols]` with the rows of `block` `[b, cols]`
/// (`b` ≤ [`W_BLOCK`]), handed to `store(i, j, x_i · block_j)`. With AVX2 (and `cols` a multiple
/// of 8): two rows of `x` against four of `block` per pass, 8 accumulators of 8 lanes, six loads
/// for eight multiply-adds (products and sums rounded separately, as the plain path rounds them).
/// Otherwise one [`dot`] per pair.
#[inline(always)]
fn multiply_block(
    x: &[f32],
    m: usize,
    cols: usize,
    block: &[f32],
    mut store: impl FnMut(usize, usize, f32),
) {
    let b = block.len() / cols;
    #[cfg(target_arch = "x86_64")]
    if b == W_BLOCK && cols.is_multiple_of(8) && has_avx2_fma() {
        let mut i = 0;
        while i < m {
            let n = (m - i).min(2);
            let rows = &x[i * cols..(i + n) * cols];
            // SAFETY: the CPU has AVX2 and FMA; `rows` holds `n` rows and `block` W_BLOCK rows of
            // `cols` (a multiple of 8) values each.
            let sums = unsafe {
                if n == 2 {
                    block_avx2::<2>(rows, block, cols)
                } else {
                    block_avx2::<1>(rows, block, cols)
                }
            };
            for (r, row) in sums.iter().take(n).enumerate() {
                for (j, &value) in row.iter().enumerate() {
                    store(i + r, j, value);
                }
            }
            i += n;
        }
        return;
    }
    for (i, x) in x.chunks_exact(cols).take(m).enumerate() {
        for (j, w) in block.chunks_exact(cols).take(b).enumerate() {
            store(i, j, dot(w, x));
        }
    }
}

/// `N` rows of `x` dotted with the [`W_BLOCK`] rows of `block`, all `cols` long: `[N][W_BLOCK]`
/// sums in the first `N` rows of the result.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x` must hold `N * cols` and `block` `W_BLOCK * cols` values,
/// `cols` a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2<const N: usize>(x: &[f32], block: &[f32], cols: usize) -> [[f32; W_BLOCK]; 2] {
    use std::arch::x86_64::*;
    debug_assert!(x.len() >= N * cols && block.len() >= W_BLOCK * cols && cols.is_multiple_of(8));
    let (x, w) = (x.as_ptr(), block.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); W_BLOCK]; N];
    let mut k = 0;
    while k < cols {
        let wv: [__m256; W_BLOCK] = std::array::from_fn(|j| _mm256_loadu_ps(w.add(j * cols + k)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xv = _mm256_loadu_ps(x.add(r * cols + k));
            for (acc, &wv) in acc.iter_mut().zip(&wv) {
                *acc = _mm256_add_ps(_mm256_mul_ps(xv, wv), *acc);
            }
        }
        k += 8;
    }
    let mut sums = [[0f32; W_BLOCK]; 2];
    for (sums, acc) in sums.iter_mut().zip(&acc) {
        for (sum, &v) in sums.iter_mut().zip(acc) {
            // 8 lanes -> 4 -> 2 -> 1.
            let v4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
            let v1 = _mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2));
            *sum = _mm_cvtss_f32(v1);
        }
    }
    sums
}

thread_local! {
    /// Each worker's dequantization scratch, kept between calls.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `a · b` with 32 partial sums: four SIMD registers' worth, so the additions do not wait on
/// each other.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 32;
    let mut acc = [0f32; LANES];
    let whole = a.len() / LANES * LANES;
    for (a, b) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
    {
        for lane in 0..LANES {
            acc[lane] += a[lane] * b[lane];
        }
    }
    let tail: f32 = a[whole..].iter().zip(&b[whole..]).map(|(a, b)| a * b).sum();
    acc.iter().sum::<f32>() + tail
}

/// The output pointer, shared by workers that write disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: see `multiply_rows`: writers never overlap.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Packs `q` (values < 2^bits) row by row the way MLX does.
    fn pack(q: &[u32], bits: u32) -> Vec<u32> {
        let per_word = (32 / bits) as usize;
        q.chunks(per_word)
            .map(|values| {
                values
                    .iter()
                    .enumerate()
                    .fold(0u32, |word, (j, &v)| word | (v << (bits as usize * j)))
            })
            .collect()
    }

    struct Case {
        q: Vec<u32>,
        packed: Vec<u32>,
        scales: Vec<f32>,
        biases: Vec<f32>,
        rows: usize,
        cols: usize,
        group_size: usize,
        bits: u32,
    }

    impl Case {
        fn new(rows: usize, cols: usize, group_size: usize, bits: u32, seed: u64) -> Self {
            let mut state = seed | 1;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let q: Vec<u32> = (0..rows * cols)
                .map(|_| (next() % (1 << bits)) as u32)
                .collect();
            let groups = rows * cols / group_size;
            let scales = (0..groups)
                .map(|_| (next() % 1000) as f32 / 1e4 + 1e-3)
                .collect();
            let biases = (0..groups)
                .map(|_| (next() % 1000) as f32 / 1e3 - 0.5)
                .collect();
            Self {
                packed: pack(&q, bits),
                q,
                scales,
                biases,
                rows,
                cols,
                group_size,
                bits,
            }
        }

        fn matrix(&self) -> QuantizedMatrix<'_> {
            QuantizedMatrix::new(
                &self.packed,
                &self.scales,
                &self.biases,
                self.rows,
                self.cols,
                self.group_size,
                self.bits,
            )
            .unwrap()
        }

        fn dense(&self) -> Vec<f32> {
            (0..self.rows * self.cols)
                .map(|i| {
                    let g = i / self.group_size;
                    self.scales[g] * self.q[i] as f32 + self.biases[g]
                })
                .collect()
        }
    }

    #[test]
    fn dequantizes_every_bit_width_exactly() {
        for bits in [2, 4, 8] {
            let case = Case::new(5, 128, 32, bits, 7 + bits as u64);
            let mut out = vec![0f32; 3 * 128];
            case.matrix().dequantize_rows(2, &mut out);
            assert_eq!(out, case.dense()[2 * 128..5 * 128], "{bits}-bit");
        }
    }

    #[test]
    fn refuses_bad_shapes() {
        let case = Case::new(4, 64, 64, 4, 1);
        let err = QuantizedMatrix::new(&case.packed, &case.scales, &case.biases, 4, 64, 64, 3);
        assert_eq!(err.unwrap_err(), QgemmError::UnsupportedBits { bits: 3 });
        let err = QuantizedMatrix::new(&case.packed[1..], &case.scales, &case.biases, 4, 64, 64, 4);
        assert!(matches!(
            err,
            Err(QgemmError::Length { name: "packed", .. })
        ));
        let err = QuantizedMatrix::new(&case.packed, &case.scales, &case.biases, 4, 64, 48, 4);
        assert!(matches!(err, Err(QgemmError::BadGroupSize { .. })));
        let x = vec![0f32; 64];
        let mut y = vec![0f32; 3];
        let err = matmul_transposed(&x, 1, &case.matrix(), &mut y);
        assert!(matches!(err, Err(QgemmError::Length { name: "y", .. })));
    }

    fn naive(x: &[f32], m: usize, dense: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * rows];
        for i in 0..m {
            for r in 0..rows {
                y[i * rows + r] = (0..cols)
                    .map(|c| x[i * cols + c] as f64 * dense[r * cols + c] as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    fn check_matmul(m: usize, rows: usize, cols: usize, group_size: usize, bits: u32) {
        let case = Case::new(rows, cols, group_size, bits, (m * rows + cols) as u64);
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let mut y = vec![f32::NAN; m * rows];
        matmul_transposed(&x, m, &case.matrix(), &mut y).unwrap();
        let expected = naive(&x, m, &case.dense(), rows, cols);
        for (got, want) in y.iter().zip(&expected) {
            assert!(
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                "m={m} rows={rows} cols={cols}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn large_matrices_split_over_threads_match_the_naive_product() {
        // 1000 x 512 = 512K weights: above PARALLEL_MIN_ELEMENTS, several tiles per thread,
        // an odd row count so the last thread's share and tile are short.
        check_matmul(7, 1001, 512, 64, 4);
        check_matmul(1, 1001, 512, 128, 8);
        check_matmul(3, 1001, 512, 32, 2);
        // Several blocks of rows of `x`, the last one short.
        check_matmul(X_BLOCK_ROWS + 1, 1001, 512, 64, 4);
        check_matmul(130, 37, 96, 32, 8);
    }

    #[test]
    fn a_row_gives_the_same_bits_in_any_batch() {
        // Each row of `x` alone, then all 70 together: every output equal to the bit.
        let (rows, cols) = (1001, 512);
        let case = Case::new(rows, cols, 64, 4, 3);
        let m = 70;
        let x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0)
            .collect();
        let mut all = vec![0f32; m * rows];
        matmul_transposed(&x, m, &case.matrix(), &mut all).unwrap();
        for i in [0, 1, 2, 63, 64, 69] {
            let mut alone = vec![0f32; rows];
            matmul_transposed(&x[i * cols..(i + 1) * cols], 1, &case.matrix(), &mut alone).unwrap();
            assert_eq!(alone, all[i * rows..(i + 1) * rows], "row {i}");
        }
    }

    #[test]
    fn rows_not_a_multiple_of_eight_take_the_plain_dot_products() {
        // 8-bit weights in groups of 4: 12 columns, which the AVX2 kernel does not take.
        check_matmul(5, 10, 12, 4, 8);
        check_matmul(60, 10, 12, 4, 8);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn small_products_match_the_naive_product(
            m in 1usize..9,
            rows in 1usize..40,
            groups in 1usize..4,
            bits in prop::sample::select(vec![2u32, 4, 8]),
            group_size in prop::sample::select(vec![32usize, 64]),
        ) {
            check_matmul(m, rows, groups * group_size, group_size, bits);
        }
    }
}
