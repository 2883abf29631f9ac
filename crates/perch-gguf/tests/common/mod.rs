//! The real test inputs (the default model's GGUF, from PyPI through `scripts/test-inputs.sh`),
//! the mlx-community model it is checked against (fixtures), and importing the GGUF once per
//! test process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use half::f16;

pub use perch_test_support::{fixture, gguf_path};

/// `tests/fixtures/mlx-community/SmolLM2-135M-Instruct-4bit`: the independent mlx-community
/// conversion of the same model (small files verbatim and a sample of its weights).
pub fn reference_model_dir() -> PathBuf {
    fixture("mlx-community/SmolLM2-135M-Instruct-4bit")
}

/// The real GGUF imported once for the whole test binary, under cargo's per-target temp dir
/// (cleared first, so every run imports afresh), with the import's summary.
pub fn imported() -> &'static (PathBuf, perch_gguf::ImportSummary) {
    static IMPORTED: OnceLock<(PathBuf, perch_gguf::ImportSummary)> = OnceLock::new();
    IMPORTED.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("perch-gguf-smollm2-q4_1");
        if out.exists() {
            std::fs::remove_dir_all(&out).expect("clear the previous import");
        }
        let summary = perch_gguf::import(&gguf_path(), &out).expect("import the real GGUF");
        (out, summary)
    })
}

pub fn imported_dir() -> &'static Path {
    &imported().0
}

/// One quantized (or plain) matrix, dequantized to f32, row-major `[rows, cols]`.
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<f32>,
}

impl Matrix {
    pub fn row(&self, r: usize) -> &[f32] {
        &self.values[r * self.cols..(r + 1) * self.cols]
    }

    /// The matrix of the given rows, in that order.
    pub fn select_rows(&self, rows: &[usize]) -> Matrix {
        Matrix {
            rows: rows.len(),
            cols: self.cols,
            values: rows.iter().flat_map(|&r| self.row(r).to_vec()).collect(),
        }
    }
}

fn floats(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    let data = view.data();
    match view.dtype() {
        safetensors::Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        safetensors::Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => panic!("unexpected float dtype {other:?}"),
    }
}

/// MLX affine dequantization written from its definition: `bits`-wide codes LSB first in u32
/// words, `w = scale * q + bias` per group. `cols` is the module's input width (as in mlx-lm,
/// where the model, not the file, knows it); bits and group size follow from it. `rows`
/// selects rows (all when `None`).
pub fn dequantize_mlx(
    st: &safetensors::SafeTensors<'_>,
    module: &str,
    cols: usize,
    rows: Option<&[usize]>,
) -> Matrix {
    let weight = st.tensor(&format!("{module}.weight")).unwrap();
    let scales_view = st.tensor(&format!("{module}.scales")).unwrap();
    let scales = floats(&scales_view);
    let biases = floats(&st.tensor(&format!("{module}.biases")).unwrap());
    let (n_rows, words_per_row) = (weight.shape()[0], weight.shape()[1]);
    let n_groups = scales_view.shape()[1];
    let words: Vec<u32> = weight
        .data()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let bits = words_per_row * 32 / cols;
    let group = cols / n_groups;
    let all: Vec<usize> = (0..n_rows).collect();
    let rows = rows.unwrap_or(&all);
    let mut values = Vec::with_capacity(rows.len() * cols);
    for &r in rows {
        for c in 0..cols {
            let bit = c * bits;
            let q = (words[r * words_per_row + bit / 32] >> (bit % 32)) & ((1u32 << bits) - 1);
            let g = r * n_groups + c / group;
            values.push(scales[g] * q as f32 + biases[g]);
        }
    }
    Matrix {
        rows: rows.len(),
        cols,
        values,
    }
}

/// ggml's Q4_1 dequantization (`dequantize_row_q4_1`): per 20-byte block, f16 `d`, f16 `m`,
/// 16 bytes with weight k in the low and k + 16 in the high nibble; `w = d * q + m`.
pub fn dequantize_q4_1(data: &[u8], rows: usize, cols: usize) -> Matrix {
    let mut values = Vec::with_capacity(rows * cols);
    for block in data.chunks_exact(20) {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        let m = f16::from_le_bytes([block[2], block[3]]).to_f32();
        let low = block[4..].iter().map(|b| b & 0x0f);
        let high = block[4..].iter().map(|b| b >> 4);
        values.extend(low.chain(high).map(|q| d * f32::from(q) + m));
    }
    assert_eq!(values.len(), rows * cols);
    Matrix { rows, cols, values }
}

/// Pearson correlation of two equally long slices.
pub fn correlation(a: &[f32], b: &[f32]) -> f64 {
    let n = a.len() as f64;
    let mean_a = a.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let mean_b = b.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let (mut ab, mut aa, mut bb) = (0.0, 0.0, 0.0);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x) - mean_a, f64::from(y) - mean_b);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    ab / (aa * bb).sqrt()
}

/// Mean over rows of the row-wise correlation between two matrices of the same shape.
pub fn mean_row_correlation(a: &Matrix, b: &Matrix) -> f64 {
    assert_eq!((a.rows, a.cols), (b.rows, b.cols));
    (0..a.rows)
        .map(|r| correlation(a.row(r), b.row(r)))
        .sum::<f64>()
        / a.rows as f64
}
