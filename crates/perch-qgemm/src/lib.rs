//! `y = x · dequantize(W)ᵀ` on the CPU for a weight `W` stored in MLX's affine quantized layout.
//!
//! MLX's CPU backend runs `quantized_matmul` as scalar code (~1.8 GFLOP/s on the 2-core dev
//! machine, whatever the number of rows) and its `dequantize` costs ~2 ns per weight, while a
//! float32 GEMM reaches ~100 GFLOP/s. This crate dequantizes one tile of `W`'s rows at a time
//! into a scratch buffer small enough to stay in the L2 cache and multiplies it with
//! `matrixmultiply`'s sgemm, splitting `W`'s rows over the CPU cores (rayon). Nothing of `W` is ever
//! dequantized as a whole, so the extra memory is one tile per core.
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

/// Dequantized weights per scratch tile (float32: 4 bytes each), per thread.
const TILE_ELEMENTS: usize = 64 << 10;
/// Up to this many rows of `x`, each row of `W` is dequantized and dotted with them directly.
const GEMV_MAX_ROWS: usize = 4;
/// Rows of `W` per parallel work item on the dot-product path.
const GEMV_CHUNK_ROWS: usize = 64;
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
        let mut permuted = vec![0f32; self.group_size];
        for group in dst.chunks_exact_mut(self.group_size) {
            permuted.copy_from_slice(group);
            self.unpermute_group(&permuted, group);
        }
    }
}

/// Within each group, the order in which [`QuantizedMatrix::dequantize_rows_permuted`] writes
/// columns: position `j * words_per_group + k` holds column `k * per_word + j` (value `j` of word
/// `k`), so one shift applies to consecutive words and the loop vectorizes.
impl QuantizedMatrix<'_> {
    fn words_per_group(&self) -> usize {
        self.group_size * self.bits as usize / 32
    }

    /// Position in the permuted order of value `j` of word `k` (column `k * per_word + j`).
    fn permuted_position(&self, k: usize, j: usize) -> usize {
        j * self.words_per_group() + k
    }

    /// `x` `[m, cols]` with each group's columns in the permuted order.
    fn permute_columns(&self, x: &[f32]) -> Vec<f32> {
        let per_word = (32 / self.bits) as usize;
        let mut permuted = vec![0f32; x.len()];
        for (dst, src) in permuted
            .chunks_exact_mut(self.group_size)
            .zip(x.chunks_exact(self.group_size))
        {
            for k in 0..self.words_per_group() {
                for j in 0..per_word {
                    dst[self.permuted_position(k, j)] = src[k * per_word + j];
                }
            }
        }
        permuted
    }

    /// The inverse for one group: `permuted` back to column order in `dst`.
    fn unpermute_group(&self, permuted: &[f32], dst: &mut [f32]) {
        let per_word = (32 / self.bits) as usize;
        for k in 0..self.words_per_group() {
            for j in 0..per_word {
                dst[k * per_word + j] = permuted[self.permuted_position(k, j)];
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
    let groups = dst
        .chunks_exact_mut(group_size)
        .zip(packed.chunks_exact(words_per_group));
    for ((group, words), (&scale, &bias)) in groups.zip(scales.iter().zip(biases)) {
        for (j, values) in group.chunks_exact_mut(words_per_group).enumerate() {
            let shift = BITS as usize * j;
            for (value, &word) in values.iter_mut().zip(words) {
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
    let chunk_rows = if m <= GEMV_MAX_ROWS {
        GEMV_CHUNK_ROWS
    } else {
        (TILE_ELEMENTS / w.cols).max(1)
    };
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
/// [`QuantizedMatrix::permute_columns`]. Up to [`GEMV_MAX_ROWS`] rows of `x`: dot products
/// against one dequantized row of `W` at a time, which stays in L1 (a GEMM would pack the tile
/// first, for little reuse). More: the rows dequantized into one tile, then one sgemm.
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
    if m <= GEMV_MAX_ROWS {
        scratch.resize(w.cols, 0.0);
        for r in start..end {
            w.dequantize_rows_permuted(r, scratch);
            for (i, x) in x.chunks_exact(w.cols).take(m).enumerate() {
                *out.0.add(i * w.rows + r) = dot(scratch, x);
            }
        }
        return;
    }
    scratch.resize((end - start) * w.cols, 0.0);
    w.dequantize_rows_permuted(start, scratch);
    // C [m, n] = A [m, cols] · B [cols, n], where B is the tile read transposed.
    matrixmultiply::sgemm(
        m,
        w.cols,
        end - start,
        1.0,
        x.as_ptr(),
        w.cols as isize,
        1,
        scratch.as_ptr(),
        1,
        w.cols as isize,
        0.0,
        out.0.add(start),
        w.rows as isize,
        1,
    );
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
