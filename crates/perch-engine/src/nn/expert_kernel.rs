//! The experts' quantized products at decode (few tokens) in one CUDA kernel launch: for each
//! (token, expert) pair `p`, `y[p] = W[indices[p]] · x[p / x_per_row]` with `W` MLX-quantized
//! (affine 4- or 8-bit, or MXFP4), written with MLX's custom-kernel API
//! ([`crate::nn::custom_kernel`]).
//!
//! Why: MLX 0.32's CUDA `gather_qmm` runs a CUTLASS GEMM kernel (`qmm_sm80`) for every shape,
//! also when each pair is one row; on an H200 a `qwen3_moe` decode step at 16 rows spends 28% of
//! its device time there, about 36 µs a product for weights that take a few µs to read (see
//! docs/benchmarks.md). A matrix-vector product per pair reads each weight once per pair (the
//! repeats of an expert come from L2) and does no padded arithmetic. On Metal MLX's own
//! `gather_qmm` has such a path (`gather_qmv`), so the kernel is built for CUDA only; the CPU
//! runs MLX's operations.
//!
//! Layout: a block of [`WARPS`] warps computes [`ROWS`]·[`WARPS`] output features of one pair;
//! the pair's input row is staged in shared memory as float32; each lane reads every 32nd
//! packed word of its warp's rows (32-bit words, coalesced across the warp), dequantizes it in
//! registers and accumulates in float32; a warp sum gives each output. Dequantization as MLX's
//! (`mlx/backend/*/quantized`): affine `w = scale·q + bias` per group, the word's values low
//! bits first; MXFP4 values are E2M1 (`±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`) times `2^(s − 127)` of
//! the group's E8M0 scale `s` (OCP Microscaling Formats v1.0).

use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{ops, Array, Dtype};

use crate::device::Backend;
use crate::nn::custom_kernel::{time_call, CustomKernel, TemplateArg};
use crate::nn::layers::{QuantMode, QuantParams};

/// Warps per block.
const WARPS: i32 = 4;
/// Output features per warp.
const ROWS: i32 = 4;
/// The widest input row staged in shared memory (float32: 28 KiB).
const MAX_IN: i32 = 7168;
/// The most pairs a launch takes (CUDA's grid z); above [`MAX_PAIRS`] the engine keeps MLX's
/// `gather_qmm`, whose GEMM reuses each expert's weights across its tokens (prefill).
const MAX_GRID_Z: i32 = 65_535;
/// The most (token, expert) pairs the engine sends to the kernel: a decode step of up to 128
/// rows at 8 experts a token. Above it, `gather_qmm`.
pub const MAX_PAIRS: usize = 1024;

const SOURCE: &str = r#"
  constexpr int PER_WORD = 32 / BITS;
  constexpr int WORDS = IN / PER_WORD;
  constexpr int GROUPS = IN / GROUP;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  __shared__ float xs[IN];
  const int lane = threadIdx.x;
  const int tid = threadIdx.y * 32 + lane;
  const int threads = blockDim.y * 32;
  const int pair = blockIdx.z;
  const int out = w_shape[1];
  const int first = (blockIdx.y * blockDim.y + threadIdx.y) * ROWS;
  const long long x_row = static_cast<long long>(pair / X_PER_ROW) * IN;
  for (int i = tid; i < IN; i += threads) {
    xs[i] = static_cast<float>(x[x_row + i]);
  }
  __syncthreads();
  const long long row0 = static_cast<long long>(indices[pair]) * out + first;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
  for (int word = lane; word < WORDS; word += 32) {
    const int base = word * PER_WORD;
    const int g = base / GROUP;
    float xv[PER_WORD];
    float xsum = 0.0f;
#pragma unroll
    for (int j = 0; j < PER_WORD; ++j) {
      xv[j] = xs[base + j];
      xsum += xv[j];
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const long long row = row0 + r;
      const unsigned q = w[row * WORDS + word];
      float dot = 0.0f;
      if (MXFP4) {
        // E2M1 magnitudes times two, a nibble each: 0, 1, 2, 3, 4, 6, 8, 12.
#pragma unroll
        for (int j = 0; j < PER_WORD; ++j) {
          const unsigned code = (q >> (4 * j)) & 15u;
          const float v = static_cast<float>((0xC8643210u >> (4 * (code & 7u))) & 15u) * 0.5f;
          dot += ((code & 8u) ? -v : v) * xv[j];
        }
        acc[r] += exp2f(static_cast<float>(scales[row * GROUPS + g]) - 127.0f) * dot;
      } else {
#pragma unroll
        for (int j = 0; j < PER_WORD; ++j) {
          dot += static_cast<float>((q >> (BITS * j)) & MASK) * xv[j];
        }
        acc[r] += static_cast<float>(scales[row * GROUPS + g]) * dot
            + static_cast<float>(biases[row * GROUPS + g]) * xsum;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float sum = acc[r];
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) {
      y[static_cast<long long>(pair) * out + first + r] = static_cast<T>(sum);
    }
  }
"#;

/// CUDA, unless `PERCH_EXPERT_KERNEL=0` (benchmarks against `gather_qmm`); `None` elsewhere.
pub fn backend() -> Option<Backend> {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    let enabled =
        *ENABLED.get_or_init(|| std::env::var("PERCH_EXPERT_KERNEL").as_deref() != Ok("0"));
    (enabled && Backend::current() == Backend::Cuda).then_some(Backend::Cuda)
}

/// One product's operands: `x` `[..., 1, in]` (a row per token, or per pair), `indices` the
/// pairs' experts (any shape, int32 or uint32), the weights `[experts, out, in · bits / 32]`
/// uint32 with their scales (and, affine, biases) `[experts, out, in / group_size]`.
pub struct Operands<'a> {
    pub x: &'a Array,
    pub weight: &'a Array,
    pub scales: &'a Array,
    pub biases: Option<&'a Array>,
    pub indices: &'a Array,
    pub params: QuantParams,
}

impl Operands<'_> {
    /// Pairs sharing one row of `x`, when the kernel computes this product: a float `x` whose
    /// rows divide the pairs, `in` a multiple of the group and at most [`MAX_IN`], `out` a
    /// multiple of a block's features, affine 4/8-bit with groups of 32, 64 or 128 or MXFP4
    /// (groups of 32, uint8 scales), at most [`MAX_GRID_Z`] pairs, and every shape consistent.
    pub fn x_per_row(&self) -> Option<i32> {
        let (ws, ss, xs) = (self.weight.shape(), self.scales.shape(), self.x.shape());
        if ws.len() != 3 || xs.len() < 2 || xs[xs.len() - 2] != 1 {
            return None;
        }
        let (experts, out, words) = (ws[0], ws[1], ws[2]);
        let p = self.params;
        let input = *xs.last()?;
        let pairs = i32::try_from(self.indices.size()).ok()?;
        let rows = i32::try_from(self.x.size()).ok()? / input.max(1);
        let formats = match p.mode {
            QuantMode::Affine => {
                matches!(p.bits, 4 | 8)
                    && matches!(p.group_size, 32 | 64 | 128)
                    && self
                        .biases
                        .is_some_and(|b| b.shape() == ss && b.dtype() == self.scales.dtype())
                    // gather_qmm's output is in the promoted dtype, the kernel's in x's.
                    && self.scales.dtype() == self.x.dtype()
            }
            QuantMode::Mxfp4 => {
                p.bits == 4
                    && p.group_size == 32
                    && self.biases.is_none()
                    && self.scales.dtype() == Dtype::Uint8
            }
            QuantMode::Mxfp8 => false,
        };
        let fits = formats
            && experts > 0
            && out > 0
            && out % (ROWS * WARPS) == 0
            && input > 0
            && input <= MAX_IN
            && input % p.group_size == 0
            && words * 32 == input * p.bits
            && ss == [experts, out, input / p.group_size]
            && self.weight.dtype() == Dtype::Uint32
            && matches!(self.indices.dtype(), Dtype::Int32 | Dtype::Uint32)
            && matches!(
                self.x.dtype(),
                Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16
            )
            && (1..=MAX_GRID_Z).contains(&pairs)
            && rows > 0
            && pairs % rows == 0
            && self.broadcasts_as_gather_qmm();
        fits.then(|| pairs / rows)
    }

    /// Whether `x`'s leading axes meet `indices`' as the kernel reads them: the same axes, the
    /// last of `x`'s 1 (a row per token, its experts on `indices`' last axis) or equal (a row
    /// per pair).
    fn broadcasts_as_gather_qmm(&self) -> bool {
        let (xs, is) = (self.x.shape(), self.indices.shape());
        let lead = &xs[..xs.len() - 2];
        lead.len() == is.len()
            && lead
                .iter()
                .zip(is)
                .enumerate()
                .all(|(axis, (&x, &i))| x == i || (axis + 1 == is.len() && x == 1))
    }
}

/// `y` `[indices.shape, 1, out]` in `x`'s dtype, as `gather_qmm(x, w, scales, biases, indices,
/// transpose = true)` gives it when `x`'s leading axes broadcast against `indices`' (a row per
/// token, or per pair). `Err` where [`Operands::x_per_row`] refuses the operands or there is no
/// backend ([`backend`]).
pub fn gather_qmv(o: &Operands) -> Result<Array, Exception> {
    thread_local! {
        static KERNEL: RefCell<Option<CustomKernel>> = const { RefCell::new(None) };
    }
    let (Some(backend), Some(x_per_row)) = (backend(), o.x_per_row()) else {
        return Err(Exception::custom("gather_qmv: operands it does not take"));
    };
    let input = *o.x.shape().last().expect("x has axes");
    let out = o.weight.shape()[1];
    let pairs = o.indices.size() as i32;
    let mxfp4 = o.params.mode == QuantMode::Mxfp4;
    let template = [
        TemplateArg::Dtype(c"T", o.x.dtype()),
        TemplateArg::Int(c"IN", input),
        TemplateArg::Int(c"BITS", o.params.bits),
        TemplateArg::Int(c"GROUP", o.params.group_size),
        TemplateArg::Int(c"X_PER_ROW", x_per_row),
        TemplateArg::Int(c"MXFP4", mxfp4 as i32),
        TemplateArg::Int(c"ROWS", ROWS),
    ];
    // MXFP4 has no biases; the kernel reads none, but every launch passes five inputs.
    let biases = o.biases.unwrap_or(o.scales);
    let y = KERNEL.with(|kernel| {
        let mut kernel = kernel.borrow_mut();
        let kernel = kernel.get_or_insert_with(|| {
            CustomKernel::new(
                backend,
                c"perch_gather_qmv",
                &["x", "w", "scales", "biases", "indices"],
                &["y"],
                SOURCE,
                true,
            )
        });
        kernel.apply(
            &[o.x, o.weight, o.scales, biases, o.indices],
            &[(&[pairs, out], o.x.dtype())],
            (32, out / ROWS, pairs),
            (32, WARPS, 1),
            &template,
        )
    })?;
    let y = y.into_iter().next().expect("one output");
    let mut shape = o.indices.shape().to_vec();
    shape.extend([1, out]);
    y.reshape(&shape)
}

/// Whether the engine uses [`gather_qmv`]: on CUDA ([`backend`]) once it has passed
/// [`self_test`] (asked at model load).
pub fn usable() -> bool {
    backend().is_some() && self_test().is_ok()
}

/// The small check behind [`usable`], once per process: a decode-shaped case of each format
/// (affine 4-bit, affine 8-bit, MXFP4; a row per token and a row per pair) against MLX's
/// `gather_qmm`. `Err` says why the kernel is not used.
pub fn self_test() -> &'static Result<(), String> {
    static RESULT: OnceLock<Result<(), String>> = OnceLock::new();
    RESULT.get_or_init(|| {
        if backend().is_none() {
            return Err("not on CUDA, or PERCH_EXPERT_KERNEL=0".into());
        }
        for case in &CASES[..3] {
            let run = Case::run(case).map_err(|e| e.to_string())?;
            // NaN fails too.
            if run.error.is_nan() || run.error > case.tolerance {
                return Err(format!("{}: largest error {:.2e}", case.name, run.error));
            }
        }
        Ok(())
    })
}

/// A check case: `tokens` tokens of `k` experts each out of `experts`, `(in, out)` features;
/// `per_pair`: `x` has a row per pair (the down projection) rather than per token.
struct CaseSpec {
    name: &'static str,
    tokens: i32,
    k: i32,
    experts: i32,
    features: (i32, i32),
    params: QuantParams,
    per_pair: bool,
    dtype: Dtype,
    tolerance: f32,
}

const fn affine(bits: i32, group_size: i32) -> QuantParams {
    QuantParams {
        group_size,
        bits,
        mode: QuantMode::Affine,
    }
}

const MXFP4: QuantParams = QuantParams {
    group_size: 32,
    bits: 4,
    mode: QuantMode::Mxfp4,
};

const CASES: [CaseSpec; 7] = [
    CaseSpec {
        name: "affine 4-bit g64, 2 tokens × 4 of 8 experts, 256 → 64",
        tokens: 2,
        k: 4,
        experts: 8,
        features: (256, 64),
        params: affine(4, 64),
        per_pair: false,
        dtype: Dtype::Float32,
        tolerance: 1e-3,
    },
    CaseSpec {
        name: "affine 8-bit g32, a row per pair, 3 tokens × 2 of 4 experts, 128 → 32",
        tokens: 3,
        k: 2,
        experts: 4,
        features: (128, 32),
        params: affine(8, 32),
        per_pair: true,
        dtype: Dtype::Float32,
        tolerance: 1e-3,
    },
    CaseSpec {
        name: "MXFP4, 2 tokens × 2 of 4 experts, 128 → 32",
        tokens: 2,
        k: 2,
        experts: 4,
        features: (128, 32),
        params: MXFP4,
        per_pair: false,
        dtype: Dtype::Float32,
        tolerance: 1e-3,
    },
    CaseSpec {
        name: "qwen3_moe gate+up, 16 rows × 8 of 64 experts, 1024 → 512, 4-bit g64",
        tokens: 16,
        k: 8,
        experts: 64,
        features: (1024, 512),
        params: affine(4, 64),
        per_pair: false,
        dtype: Dtype::Bfloat16,
        tolerance: 5e-2,
    },
    CaseSpec {
        name: "qwen3_moe down, 16 rows × 8 of 64 experts, 256 → 1024, 4-bit g64",
        tokens: 16,
        k: 8,
        experts: 64,
        features: (256, 1024),
        params: affine(4, 64),
        per_pair: true,
        dtype: Dtype::Bfloat16,
        tolerance: 5e-2,
    },
    CaseSpec {
        name: "qwen3_moe gate+up, 128 rows × 8 of 64 experts, 1024 → 512, 4-bit g64",
        tokens: 128,
        k: 8,
        experts: 64,
        features: (1024, 512),
        params: affine(4, 64),
        per_pair: false,
        dtype: Dtype::Bfloat16,
        tolerance: 5e-2,
    },
    CaseSpec {
        name: "gpt_oss gate+up, 32 rows × 4 of 32 experts, 1024 → 2048, MXFP4",
        tokens: 32,
        k: 4,
        experts: 32,
        features: (1024, 2048),
        params: MXFP4,
        per_pair: false,
        dtype: Dtype::Bfloat16,
        tolerance: 5e-2,
    },
];

/// One random case through [`gather_qmv`] and MLX's `gather_qmm`: the largest |difference|
/// relative to the largest |reference| value, and both operands kept for timing.
struct Case {
    error: f32,
    x: Array,
    weight: Array,
    scales: Array,
    biases: Option<Array>,
    indices: Array,
}

impl Case {
    fn run(spec: &CaseSpec) -> crate::Result<Self> {
        use mlx_rs::random::{key, normal, randint};
        let (input, out) = spec.features;
        let p = spec.params;
        let words = input * p.bits / 32;
        let groups = input / p.group_size;
        let e = spec.experts;
        let seed = (spec.tokens * 131 + input) as u64;
        let k = |i: u64| key(seed * 8 + i);
        let half = |i: u64| -> crate::Result<Array> {
            Ok(
                randint::<_, i32>(0, 1 << 16, &[e, out, words], Some(&k(i)?))?
                    .as_dtype(Dtype::Uint32)?,
            )
        };
        let weight = ops::add(
            &half(0)?,
            &ops::multiply(&half(1)?, Array::from_slice(&[1u32 << 16], &[1]))?,
        )?;
        let (scales, biases) = match p.mode {
            QuantMode::Mxfp4 => (
                randint::<_, i32>(120, 130, &[e, out, groups], Some(&k(2)?))?
                    .as_dtype(Dtype::Uint8)?,
                None,
            ),
            _ => {
                let scale = 1.0 / (1 << p.bits) as f32;
                let s = normal::<f32>(&[e, out, groups], None, None, Some(&k(2)?))?
                    .multiply(Array::from_f32(scale))?
                    .as_dtype(spec.dtype)?;
                let b = normal::<f32>(&[e, out, groups], None, None, Some(&k(3)?))?
                    .multiply(Array::from_f32(0.1))?
                    .as_dtype(spec.dtype)?;
                (s, Some(b))
            }
        };
        let indices = randint::<_, i32>(0, e, &[spec.tokens, spec.k], Some(&k(4)?))?
            .as_dtype(Dtype::Uint32)?;
        let x_shape: &[i32] = if spec.per_pair {
            &[spec.tokens, spec.k, 1, input]
        } else {
            &[spec.tokens, 1, 1, input]
        };
        let x = normal::<f32>(x_shape, None, None, Some(&k(5)?))?.as_dtype(spec.dtype)?;
        let case = Self {
            error: 0.0,
            x,
            weight,
            scales,
            biases,
            indices,
        };
        let ours = case.kernel()?.as_dtype(Dtype::Float32)?;
        let reference = case.mlx()?.as_dtype(Dtype::Float32)?;
        let largest = ops::abs(&reference)?
            .max(None)?
            .item_exact::<f32>()
            .max(1e-6);
        let error = ops::abs(&ops::subtract(&ours, &reference)?)?
            .max(None)?
            .item_exact::<f32>()
            / largest;
        Ok(Self { error, ..case })
    }

    fn operands(&self, params: QuantParams) -> Operands<'_> {
        Operands {
            x: &self.x,
            weight: &self.weight,
            scales: &self.scales,
            biases: self.biases.as_ref(),
            indices: &self.indices,
            params,
        }
    }

    fn params(&self) -> QuantParams {
        match self.biases {
            None => MXFP4,
            Some(_) => {
                let (words, groups) = (self.weight.shape()[2], self.scales.shape()[2]);
                let input = *self.x.shape().last().expect("x has axes");
                affine(words * 32 / input, input / groups)
            }
        }
    }

    fn kernel(&self) -> crate::Result<Array> {
        Ok(gather_qmv(&self.operands(self.params()))?)
    }

    fn mlx(&self) -> crate::Result<Array> {
        let p = self.params();
        Ok(crate::nn::mlx_ext::gather_qmm(
            &self.x,
            &self.weight,
            &self.scales,
            self.biases.as_ref(),
            &self.indices,
            p.sizes(),
            p.mode.mlx_name(),
            false,
        )?)
    }
}

/// Checks [`gather_qmv`] against MLX's `gather_qmm` on random operands of each format and of the
/// experts' shapes at decode, with each one's time a call: one line per case, an error at the
/// first case outside its tolerance (relative to the largest reference value). CUDA only
/// (`perch check-kernels` on the device).
pub fn check() -> crate::Result<Vec<String>> {
    if backend().is_none() {
        return Err(crate::EngineError::Request(
            "the experts' kernel runs on MLX's CUDA backend, with PERCH_EXPERT_KERNEL unset".into(),
        ));
    }
    let mut lines = Vec::new();
    for spec in &CASES {
        let case = Case::run(spec)?;
        let ours = time_call(&|| case.kernel())?;
        let mlx = time_call(&|| case.mlx())?;
        let line = format!(
            "experts' kernel, {}, {:?}: relative error {:.2e} (tolerance {:.0e}); {ours:.3} ms a \
             call against gather_qmm's {mlx:.3}",
            spec.name, spec.dtype, case.error, spec.tolerance
        );
        if case.error.is_nan() || case.error > spec.tolerance {
            return Err(crate::EngineError::Kernel(line));
        }
        lines.push(line);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use mlx_rs::{Array, Dtype};

    use super::{affine, backend, Operands, MXFP4};

    fn zeros(shape: &[i32], dtype: Dtype) -> Array {
        mlx_rs::ops::zeros_dtype(shape, dtype).unwrap()
    }

    /// The operands of one product as the experts give them: `tokens` tokens of `k` experts,
    /// `x` a row per token (`[tokens, 1, 1, in]`) or per pair (`[tokens, k, 1, in]`), `(in, out)`
    /// features, affine `bits` (or MXFP4) in bfloat16.
    fn accepts(
        (tokens, k, per_pair): (i32, i32, bool),
        (input, out): (i32, i32),
        bits: i32,
        mxfp4: bool,
    ) -> Option<i32> {
        let x_shape = [tokens, if per_pair { k } else { 1 }, 1, input];
        operands(
            &x_shape,
            &[tokens, k],
            (input, out),
            bits,
            mxfp4,
            Dtype::Bfloat16,
        )
    }

    fn operands(
        x_shape: &[i32],
        indices_shape: &[i32],
        (input, out): (i32, i32),
        bits: i32,
        mxfp4: bool,
        scale_dtype: Dtype,
    ) -> Option<i32> {
        let params = if mxfp4 { MXFP4 } else { affine(bits, 64) };
        let groups = input / params.group_size;
        let x = zeros(x_shape, Dtype::Bfloat16);
        let weight = zeros(&[8, out, input * bits / 32], Dtype::Uint32);
        let scales = zeros(
            &[8, out, groups],
            if mxfp4 { Dtype::Uint8 } else { scale_dtype },
        );
        let biases = zeros(&[8, out, groups], scale_dtype);
        let indices = zeros(indices_shape, Dtype::Uint32);
        Operands {
            x: &x,
            weight: &weight,
            scales: &scales,
            biases: (!mxfp4).then_some(&biases),
            indices: &indices,
            params,
        }
        .x_per_row()
    }

    /// The kernel takes the formats and shapes it computes, refuses the rest, and is never
    /// chosen on the CPU.
    #[test]
    fn takes_only_the_shapes_it_computes() {
        assert!(backend().is_none(), "no CUDA on this machine");
        // A row per token of 8 experts, a row per pair; MXFP4; 8-bit.
        assert_eq!(accepts((4, 8, false), (1024, 512), 4, false), Some(8));
        assert_eq!(accepts((4, 8, true), (256, 1024), 4, false), Some(1));
        assert_eq!(accepts((4, 4, false), (1024, 2048), 4, true), Some(4));
        assert_eq!(accepts((4, 4, false), (1024, 512), 8, false), Some(4));
        // Sorted pairs: a row each, flat.
        let sorted = operands(
            &[32, 1, 1024],
            &[32],
            (1024, 512),
            4,
            false,
            Dtype::Bfloat16,
        );
        assert_eq!(sorted, Some(1));
        // out not a multiple of 16; in over the staged width; bits MLX has but the kernel does
        // not; scales in another dtype than x (gather_qmm would promote).
        assert_eq!(accepts((4, 8, false), (1024, 520), 4, false), None);
        assert_eq!(accepts((4, 8, false), (8192, 512), 4, false), None);
        assert_eq!(accepts((4, 8, false), (1024, 512), 3, false), None);
        let float32_scales = operands(
            &[4, 1, 1, 1024],
            &[4, 8],
            (1024, 512),
            4,
            false,
            Dtype::Float32,
        );
        assert_eq!(float32_scales, None);
        // x's axes not those of the indices (a batch of k rows against [tokens, k]; rows
        // that do not divide the pairs).
        assert_eq!(
            operands(
                &[8, 1, 1024],
                &[4, 8],
                (1024, 512),
                4,
                false,
                Dtype::Bfloat16
            ),
            None
        );
        assert_eq!(
            operands(
                &[3, 1, 1, 1024],
                &[4, 8],
                (1024, 512),
                4,
                false,
                Dtype::Bfloat16
            ),
            None
        );
        // No pairs; more pairs than a grid takes.
        assert_eq!(accepts((0, 8, false), (1024, 512), 4, false), None);
        assert_eq!(accepts((8_750, 8, false), (1024, 512), 4, false), None);
    }
}
