//! Building blocks shared by the decoder architectures: linear layers (dense or MLX affine
//! quantized), embeddings, RMSNorm, RoPE and the SwiGLU MLP. They mirror mlx-lm's `mlx.nn` layers
//! op for op, so Perch's logits equal mlx_lm's bit for bit on the same backend.

use std::collections::HashMap;

use mlx_rs::error::AsSliceError;
use mlx_rs::{fast, ops, Array, Dtype};
use perch_qgemm::QuantizedMatrix;
use serde_json::Value;

use crate::device::Backend;
use crate::error::{EngineError, Result};
use crate::nn::mlx_ext::slice;
use crate::nn::weights::Weights;

/// Group size, bit width and mode of MLX quantization.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantParams {
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
}

/// MLX's quantization modes (`mlx.core.quantize`'s `mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantMode {
    /// `w = scale * q + bias` per group: packed values, float scales and biases.
    #[default]
    Affine,
    /// OCP microscaling, groups of 32: FP4 (E2M1) values with a power-of-two scale each (E8M0,
    /// uint8), no biases (gpt-oss's experts).
    Mxfp4,
    /// The same with FP8 (E4M3) values.
    Mxfp8,
}

impl QuantMode {
    /// The name MLX takes.
    pub fn mlx_name(self) -> &'static std::ffi::CStr {
        match self {
            QuantMode::Affine => c"affine",
            QuantMode::Mxfp4 => c"mxfp4",
            QuantMode::Mxfp8 => c"mxfp8",
        }
    }

    /// Whether weights carry `.biases` (zero points).
    pub fn has_biases(self) -> bool {
        self == QuantMode::Affine
    }
}

impl QuantParams {
    /// `(group_size, bits)`.
    pub fn sizes(self) -> (i32, i32) {
        (self.group_size, self.bits)
    }

    /// Checks that `scales` (the tensor `name`) is stored as this mode stores them: uint8 for
    /// the microscaling modes, floats for affine. A config naming the wrong mode is an error
    /// here rather than garbage later.
    pub(crate) fn check_scales(self, name: &str, scales: &Array) -> Result<()> {
        let uint8 = scales.dtype() == Dtype::Uint8;
        if uint8 == self.mode.has_biases() {
            return Err(EngineError::WeightFormat {
                name: name.to_string(),
                message: format!(
                    "scales of dtype {:?} do not fit the config's quantization mode `{}`",
                    scales.dtype(),
                    self.mode.mlx_name().to_str().unwrap_or("?")
                ),
            });
        }
        Ok(())
    }
}

/// The `quantization` entry of an mlx-community `config.json`: defaults plus per-module overrides
/// keyed by module path (`model.layers.0.mlp.down_proj`), where `false` means "not quantized".
#[derive(Clone, Debug, Default)]
pub struct Quantization {
    default: Option<QuantParams>,
    overrides: HashMap<String, Option<QuantParams>>,
}

impl Quantization {
    /// Parses `config["quantization"]` (or `quantization_config`); absent means unquantized.
    /// Modes `affine` (the default), `mxfp4` and `mxfp8`; an override without a `mode` is
    /// affine whatever the default's (as mlx_lm reads them: mlx-community's gpt-oss has mxfp4
    /// experts by default and 8-bit affine routers by override). Other modes, sizes a mode does
    /// not take, and Hugging Face's own quantization formats (`quant_method`) are errors naming
    /// them.
    pub fn from_config(config: &Value) -> std::result::Result<Self, String> {
        let Some(section) = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"))
        else {
            return Ok(Self::default());
        };
        let Some(map) = section.as_object() else {
            return Err("`quantization` must be an object".into());
        };
        if let Some(method) = map.get("quant_method").and_then(Value::as_str) {
            if !map.contains_key("bits") {
                return Err(format!(
                    "quantization method `{method}` (the original checkpoint's format) is not \
                     supported: use an MLX conversion (mlx-community)"
                ));
            }
        }
        let params = |v: &Value| -> std::result::Result<QuantParams, String> {
            let mode = match v.get("mode") {
                None | Some(Value::Null) => QuantMode::Affine,
                Some(Value::String(m)) if m == "affine" => QuantMode::Affine,
                Some(Value::String(m)) if m == "mxfp4" => QuantMode::Mxfp4,
                Some(Value::String(m)) if m == "mxfp8" => QuantMode::Mxfp8,
                Some(other) => {
                    return Err(format!(
                        "quantization mode {other} is not supported (affine, mxfp4, mxfp8)"
                    ))
                }
            };
            let (default_group, default_bits): (i32, i32) = match mode {
                QuantMode::Affine => (64, 4),
                QuantMode::Mxfp4 => (32, 4),
                QuantMode::Mxfp8 => (32, 8),
            };
            let group_size = v
                .get("group_size")
                .and_then(Value::as_i64)
                .unwrap_or(default_group.into()) as i32;
            let bits = v
                .get("bits")
                .and_then(Value::as_i64)
                .unwrap_or(default_bits.into()) as i32;
            let fits = match mode {
                QuantMode::Affine => {
                    [2, 3, 4, 5, 6, 8].contains(&bits) && [32, 64, 128].contains(&group_size)
                }
                _ => (group_size, bits) == (default_group, default_bits),
            };
            if !fits {
                return Err(format!(
                    "unsupported quantization bits={bits} group_size={group_size} ({})",
                    mode.mlx_name().to_str().unwrap_or("?")
                ));
            }
            Ok(QuantParams {
                group_size,
                bits,
                mode,
            })
        };
        let mut overrides = HashMap::new();
        for (key, value) in map {
            match value {
                Value::Bool(false) => {
                    overrides.insert(key.clone(), None);
                }
                Value::Object(_) => {
                    overrides.insert(key.clone(), Some(params(value)?));
                }
                _ => {}
            }
        }
        Ok(Self {
            default: Some(params(section)?),
            overrides,
        })
    }

    /// How the module at `path` is stored: quantized when the override says so, or (like mlx-lm)
    /// when its `.scales` tensor exists.
    pub fn for_module(&self, path: &str, weights: &Weights) -> Option<QuantParams> {
        if let Some(over) = self.overrides.get(path) {
            return *over;
        }
        if weights.contains(&format!("{path}.scales")) {
            return Some(self.default.unwrap_or(QuantParams {
                group_size: 64,
                bits: 4,
                mode: QuantMode::Affine,
            }));
        }
        None
    }
}

/// Quantized weight storage: packed `weight` `[out, in * bits / 32]` (uint32), `scales` and
/// (affine only) `biases` `[out, in / group_size]`.
#[derive(Clone)]
pub struct QuantizedWeight {
    pub weight: Array,
    pub scales: Array,
    pub biases: Option<Array>,
    pub params: QuantParams,
    /// Multiply with Perch's CPU kernel instead of MLX's (see [`QuantizedWeight::matmul_transposed`]).
    cpu_kernel: bool,
}

impl QuantizedWeight {
    fn load(
        weights: &mut Weights,
        path: &str,
        rows: i32,
        cols: i32,
        params: QuantParams,
    ) -> Result<Self> {
        let packed = cols * params.bits / 32;
        let groups = cols / params.group_size;
        let affine = params.mode == QuantMode::Affine;
        let scales_name = format!("{path}.scales");
        let scales = weights.take_shaped(&scales_name, &[rows, groups])?;
        params.check_scales(&scales_name, &scales)?;
        Ok(Self {
            weight: weights.take_shaped(&format!("{path}.weight"), &[rows, packed])?,
            scales,
            biases: affine
                .then(|| weights.take_shaped(&format!("{path}.biases"), &[rows, groups]))
                .transpose()?,
            params,
            cpu_kernel: Backend::current() == Backend::Cpu
                && affine
                && matches!(params.bits, 2 | 4 | 8),
        })
    }

    /// The dense matrix `[out, in]` (lazy): in the scales' dtype, or for the microscaling
    /// modes in the compute dtype.
    fn dequantized(&self) -> Result<Array> {
        let dtype = (!self.params.mode.has_biases())
            .then(|| Backend::current().compute_dtype(Dtype::Float32));
        Ok(crate::nn::mlx_ext::dequantize(
            &self.weight,
            &self.scales,
            self.biases.as_ref(),
            self.params.sizes(),
            self.params.mode.mlx_name(),
            dtype,
        )?)
    }

    /// The weights dequantized into a dense matrix `[out, in]` in the scales' dtype (evaluated),
    /// when [`dense_weights`] says this backend multiplies faster that way; `None` keeps them
    /// quantized.
    fn dense_copy(&self) -> Result<Option<Array>> {
        // An unread weight is copied once its part is read ([`Linear::from_quantized`] again).
        if !dense_weights() || crate::nn::part_reads::is_unread(&self.weight) {
            return Ok(None);
        }
        let dense = self.dequantized()?;
        dense.eval()?;
        Ok(Some(dense))
    }

    /// Multiplies with MLX's `quantized_matmul` only: Perch's CPU kernel reads its input on the
    /// host, which a traced (compiled) graph cannot.
    fn use_mlx_kernels(&mut self) {
        self.cpu_kernel = false;
    }

    /// `x @ W.T` for `x` `[..., in]` → `[..., out]`.
    ///
    /// On MLX's CPU backend, 2/4/8-bit weights go through `perch_qgemm` (dequantize a cache-sized
    /// tile, float32 GEMM, all cores), because MLX's CPU `quantized_matmul` is scalar code whose
    /// cost grows with every row. This evaluates `x` first: the projection leaves MLX's lazy graph.
    ///
    /// Results differ from `quantized_matmul` by float32 rounding only; every parity test passes
    /// either way. Other backends and bit widths use MLX's `quantized_matmul`.
    fn matmul_transposed(&self, x: &Array) -> Result<Array> {
        if self.cpu_kernel && x.dtype() == Dtype::Float32 {
            return self.cpu_matmul_transposed(x);
        }
        Ok(crate::nn::mlx_ext::quantized_matmul(
            x,
            &self.weight,
            &self.scales,
            self.biases.as_ref(),
            true,
            self.params.sizes(),
            self.params.mode.mlx_name(),
        )?)
    }

    fn cpu_matmul_transposed(&self, x: &Array) -> Result<Array> {
        let (out, groups) = (self.scales.shape()[0], self.scales.shape()[1]);
        let cols = groups * self.params.group_size;
        let shape = x.shape();
        let rows: i32 = shape[..shape.len() - 1].iter().product();
        let mut x = x.reshape(&[rows, cols])?;
        x.eval()?;
        if x.try_as_slice::<f32>().is_err() {
            x = x.contiguous()?;
        }
        let kernel_error = |message: String| EngineError::Kernel(message);
        let slice_error = |e: AsSliceError| kernel_error(e.to_string());
        let biases = self
            .biases
            .as_ref()
            .ok_or_else(|| kernel_error("Perch's CPU kernel takes affine weights only".into()))?;
        let matrix = QuantizedMatrix::new(
            self.weight.try_as_slice::<u32>().map_err(slice_error)?,
            self.scales.try_as_slice::<f32>().map_err(slice_error)?,
            biases.try_as_slice::<f32>().map_err(slice_error)?,
            out as usize,
            cols as usize,
            self.params.group_size as usize,
            self.params.bits as u32,
        )
        .map_err(|e| kernel_error(e.to_string()))?;
        let mut y = vec![0f32; rows as usize * out as usize];
        perch_qgemm::matmul_transposed(
            x.try_as_slice::<f32>().map_err(slice_error)?,
            rows as usize,
            &matrix,
            &mut y,
        )
        .map_err(|e| kernel_error(e.to_string()))?;
        let mut out_shape = shape.to_vec();
        *out_shape.last_mut().expect("x has a feature axis") = out;
        Ok(Array::from_slice(&y, &out_shape))
    }
}

/// Whether quantized weights are dequantized at load and multiplied dense: on CUDA by default,
/// where MLX 0.32.2's 4-bit kernels bound a batch's decode step (mlx_lm's own batched forward of
/// a 1.07B Llama: 59 ms a step at 128 rows, 4.9 ms with the same weights dequantized to
/// bfloat16), for 3.6x the weights' memory at 4 bits.
/// On Metal MLX's quantized kernels are its best-tuned path and on CPU `perch_qgemm` is used:
/// both keep the weights quantized. `PERCH_WEIGHTS=quantized` or `=dense` overrides the default
/// (for benchmarks); [`loading_dense_weights`] overrides both for the models one thread loads.
pub fn dense_weights() -> bool {
    if let Some(dense) = DENSE_WEIGHTS.with(std::cell::Cell::get) {
        return dense;
    }
    match std::env::var("PERCH_WEIGHTS").as_deref() {
        Ok("dense") => true,
        Ok("quantized") => false,
        _ => Backend::current() == Backend::Cuda,
    }
}

thread_local! {
    /// [`loading_dense_weights`]'s answer for [`dense_weights`] on this thread, while it runs.
    static DENSE_WEIGHTS: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `load` with [`dense_weights`] answering `dense` on this thread: the models it loads keep
/// their quantized weights that way, whatever the backend's default and `PERCH_WEIGHTS` say.
/// For tests that run CUDA's form on the CPU (compiled decode steps over dense weights, where
/// MLX's CPU `quantized_matmul` would take seconds a step).
pub fn loading_dense_weights<T>(dense: bool, load: impl FnOnce() -> T) -> T {
    let before = DENSE_WEIGHTS.with(|d| d.replace(Some(dense)));
    // Restored however `load` ends (a panic included).
    struct Restore(Option<bool>);
    impl Drop for Restore {
        fn drop(&mut self) {
            DENSE_WEIGHTS.with(|d| d.set(self.0));
        }
    }
    let _restore = Restore(before);
    load()
}

/// The two halves of `both`'s last axis (a fused gate and up projection's output), as slices
/// (views).
pub(crate) fn halves(both: &Array) -> Result<(Array, Array)> {
    let shape = both.shape().to_vec();
    let (last, half) = (shape.len() - 1, shape[shape.len() - 1] / 2);
    let mut start = vec![0; shape.len()];
    let mut stop = shape.clone();
    stop[last] = half;
    let first = slice(both, &start, &stop)?;
    (start[last], stop[last]) = (half, shape[last]);
    Ok((first, slice(both, &start, &stop)?))
}

/// Whether projections that read the same input (a layer's query/key/value projections, an
/// MLP's gate and up projections) are fused at load into one matmul each ([`Linear::fuse`]): on
/// GPUs, where a decode step is bound by the host launching its kernels (a 1.07B Llama's single
/// stream runs at about 1.9x the tok/s fused). Not on CPU, where the projections are
/// arithmetic-bound and separate ones keep mlx_lm's exact numerics. `PERCH_FUSED_PROJECTIONS=1` or `=0` overrides the
/// default (for tests and benchmarks).
pub fn fused_projections() -> bool {
    match std::env::var("PERCH_FUSED_PROJECTIONS").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => Backend::current() != Backend::Cpu,
    }
}

/// A dense layer's weight `W` `[out, in]` and its transpose `[in, out]` as an evaluated view of
/// the same memory (and, on GPUs, that view with a leading unit axis `[1, in, out]`).
///
/// Why: MLX records `W.t()` as an operation of its own, and a product with a 3-D input as a
/// flatten, the product and an unflatten, each replayed and evaluated in every step of a
/// compiled graph, where a decode step on a GPU is bound by the host
/// (docs/benchmarks.md). With the transpose evaluated at load no operation makes it, and a
/// `[rows, tokens, in]` input times the `[1, in, out]` view is a broadcast and one product:
/// MLX's GPU backends fold a batch over a broadcast matrix into one GEMM's rows (`M`) when the
/// input is row-contiguous, the same GEMM (or, at one row, the same GEMV) as before. The CPU
/// keeps the flattened product (its batched product runs one GEMM per batch entry, with other
/// rounding), and a product with a bias stays MLX's `addmm` (which flattens).
#[derive(Clone)]
pub struct DenseWeight {
    weight: Array,
    transposed: Array,
    transposed_batched: Option<Array>,
}

impl DenseWeight {
    /// `weight` `[out, in]`; evaluates it and its transposed views (no copy). The first on CUDA
    /// runs the small-product kernel's load check ([`crate::nn::gemm_kernel::enabled`]) here, at
    /// load, not inside a step's traced graph.
    pub fn new(weight: Array) -> Result<Self> {
        let _ = crate::nn::gemm_kernel::enabled();
        let transposed = weight.t();
        let transposed_batched = match Backend::current() {
            Backend::Cpu => None,
            Backend::Metal | Backend::Cuda => Some(transposed.expand_dims(0)?),
        };
        let mut all = vec![&weight, &transposed];
        all.extend(transposed_batched.as_ref());
        // Not before a divided model's layer is divided (its part alone is read then).
        crate::nn::part_reads::settle(&all)?;
        Ok(Self {
            weight,
            transposed,
            transposed_batched,
        })
    }

    /// `W` `[out, in]`.
    pub fn weight(&self) -> &Array {
        &self.weight
    }

    /// `x` `[..., in]` → `x W^T` `[..., out]`, plus `bias` `[out]` when given. A few rows over a
    /// small weight go through Perch's CUDA kernel ([`crate::nn::gemm_kernel`]) where it is on.
    fn forward(&self, x: &Array, bias: Option<&Array>) -> Result<Array> {
        if crate::nn::gemm_kernel::takes(x, &self.weight, bias) && crate::nn::gemm_kernel::enabled()
        {
            return Ok(crate::nn::gemm_kernel::small_matmul(x, &self.weight, bias)?);
        }
        match (bias, &self.transposed_batched) {
            (Some(bias), _) => Ok(ops::addmm(bias, x, &self.transposed, None, None)?),
            (None, Some(batched)) if x.ndim() == 3 => Ok(ops::matmul(x, batched)?),
            (None, _) => Ok(ops::matmul(x, &self.transposed)?),
        }
    }
}

/// How a linear layer is divided over the ranks of a tensor-parallel group (Shoeybi et al. 2019,
/// "Megatron-LM": column- and row-parallel layers; mlx_lm's `shard_linear` calls them
/// "all-to-sharded" and "sharded-to-all"). Rank `r` of `n` holds the `r`th of `n` equal,
/// contiguous parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shard {
    /// The output features (rows of `W`, and of the bias): every rank reads the whole input and
    /// computes its part of the output (query, key and value projections, gate and up).
    Outputs,
    /// The input features (columns of `W`): every rank reads its part of the input and computes
    /// a partial sum of the whole output. The ranks' sums add up (`all_sum`), after which the
    /// bias, which the shard leaves out, is added once (output and down projections).
    Inputs,
}

/// Entries of an array per feature of its divided axis, `(numerator, denominator)` (a quantized
/// weight's packed words: `(bits, 32)`).
pub(crate) type Units = (i32, i32);

/// One rank's parts of an array's divided axis, whose features are `segments` side by side
/// (one segment, or a fused projection's: queries, keys and values; gate and up): the `r`th of
/// `size` equal runs of every segment, as `(first feature, features)`.
pub(crate) struct ShardParts {
    parts: Vec<(i32, i32)>,
}

impl ShardParts {
    /// Rank `rank`'s parts of `segments`, which must add up to the axis' `divided` features, each
    /// a multiple of `size`; why not otherwise.
    pub(crate) fn new(
        segments: &[i32],
        divided: i32,
        rank: usize,
        size: usize,
    ) -> std::result::Result<Self, String> {
        if size == 0 || rank >= size {
            return Err(format!("rank {rank} is not one of them"));
        }
        if segments.iter().sum::<i32>() != divided || segments.iter().any(|&s| s <= 0) {
            return Err(format!(
                "its parts {segments:?} are not its {divided} features"
            ));
        }
        let n = size as i32;
        if let Some(s) = segments.iter().find(|&&s| s % n != 0) {
            return Err(format!("{s} is not a multiple of {size}"));
        }
        let r = rank as i32;
        let mut at = 0;
        let parts = segments
            .iter()
            .map(|&s| {
                let part = (at + r * s / n, s / n);
                at += s;
                part
            })
            .collect();
        Ok(Self { parts })
    }

    /// The units of a quantized weight's packed words and of its scales (and quantization
    /// biases) per feature of the divided axis, as `(numerator, denominator)`: one each for
    /// outputs (rows); `bits / 32` and `1 / group_size` for inputs, whose parts must then hold
    /// whole groups (why not, otherwise).
    pub(crate) fn quantized_units(
        &self,
        shard: Shard,
        params: QuantParams,
    ) -> std::result::Result<(Units, Units), String> {
        let group = params.group_size;
        match shard {
            Shard::Outputs => Ok(((1, 1), (1, 1))),
            Shard::Inputs => match self.parts.iter().find(|&&(_, len)| len % group != 0) {
                None => Ok(((params.bits, 32), (1, group))),
                Some(&(_, len)) => Err(format!(
                    "a rank's {len} inputs are not whole groups of {group}"
                )),
            },
        }
    }

    /// The parts of `a` along `axis`, `units` entries of `a` a feature (`(numerator,
    /// denominator)`), side by side in a buffer of their own, evaluated: a slice is a view of the
    /// whole array's buffer (and MLX's `copy` and `contiguous` may share it, as its one-array
    /// `concatenate` returns its input), while an elementwise product reading a view writes a new
    /// buffer; times one is exact in every dtype.
    pub(crate) fn take(&self, a: &Array, axis: usize, (num, den): Units) -> Result<Array> {
        // Entries `[start, stop)` along `axis` of each part.
        let runs: Vec<(usize, usize)> = self
            .parts
            .iter()
            .map(|&(first, len)| {
                let (start, stop) = (first * num / den, (first + len) * num / den);
                (start as usize, (stop - start) as usize)
            })
            .collect();
        // A tensor not read yet (a divided model's layer being built): its part alone is read.
        if let Some(part) = crate::nn::part_reads::read_part(a, axis, &runs) {
            return part;
        }
        let pieces = self
            .parts
            .iter()
            .map(|&(first, len)| {
                let mut start = vec![0; a.ndim()];
                let mut stop = a.shape().to_vec();
                start[axis] = first * num / den;
                stop[axis] = (first + len) * num / den;
                Ok(slice(a, &start, &stop)?)
            })
            .collect::<Result<Vec<Array>>>()?;
        let copy = match pieces.as_slice() {
            [one] => ops::multiply(one, &Array::from_int(1).as_dtype(a.dtype())?)?,
            more => ops::concatenate(more, axis as i32)?,
        };
        copy.eval()?;
        Ok(copy)
    }
}

/// What a shard divides: "outputs" or "inputs" (for messages).
impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Shard::Outputs => "outputs",
            Shard::Inputs => "inputs",
        })
    }
}

/// A linear layer `y = x W^T (+ b)` with `W` `[out, in]`, dense or quantized.
#[derive(Clone)]
pub enum Linear {
    Dense {
        weight: DenseWeight,
        bias: Option<Array>,
    },
    Quantized {
        weight: QuantizedWeight,
        bias: Option<Array>,
    },
}

impl Linear {
    /// Every product through MLX's operations (see [`QuantizedWeight::use_mlx_kernels`]).
    pub fn use_mlx_kernels(&mut self) {
        if let Linear::Quantized { weight, .. } = self {
            weight.use_mlx_kernels();
        }
    }

    /// Loads `{path}.weight` (and `.scales`/`.biases` when quantized, `.bias` when `bias`).
    pub fn load(
        weights: &mut Weights,
        quantization: &Quantization,
        path: &str,
        in_features: i32,
        out_features: i32,
        bias: bool,
    ) -> Result<Self> {
        let bias = if bias {
            Some(weights.take_shaped(&format!("{path}.bias"), &[out_features])?)
        } else {
            None
        };
        Ok(match quantization.for_module(path, weights) {
            Some(params) => Linear::from_quantized(
                QuantizedWeight::load(weights, path, out_features, in_features, params)?,
                bias,
            )?,
            None => Linear::Dense {
                weight: DenseWeight::new(
                    weights.take_shaped(&format!("{path}.weight"), &[out_features, in_features])?,
                )?,
                bias,
            },
        })
    }

    /// A layer of quantized `weight`: copied dense where [`dense_weights`] says so.
    fn from_quantized(weight: QuantizedWeight, bias: Option<Array>) -> Result<Self> {
        Ok(match weight.dense_copy()? {
            Some(weight) => Linear::Dense {
                weight: DenseWeight::new(weight)?,
                bias,
            },
            None => Linear::Quantized { weight, bias },
        })
    }

    /// This layer as loaded whole: a divided model's layer built unread
    /// ([`crate::nn::part_reads`]) is read now, and copied dense where [`dense_weights`] says
    /// so. For layers every rank keeps whole (a router), so that they are what a model loaded
    /// whole holds, and can be fused.
    pub fn read_whole(self) -> Result<Linear> {
        if !self.is_unread() {
            return Ok(self);
        }
        let bias = self.bias().cloned();
        match self {
            Linear::Dense { weight, .. } => {
                let mut arrays = vec![weight.weight()];
                arrays.extend(bias.as_ref());
                crate::nn::part_reads::read_whole(&arrays)?;
                Ok(Linear::Dense { weight, bias })
            }
            Linear::Quantized { weight, .. } => {
                let mut arrays = vec![&weight.weight, &weight.scales];
                arrays.extend(weight.biases.as_ref());
                arrays.extend(bias.as_ref());
                crate::nn::part_reads::read_whole(&arrays)?;
                Linear::from_quantized(weight, bias)
            }
        }
    }

    /// [`Linear::load`] of a layer every rank of a divided model keeps whole (a router, a gate):
    /// read at once ([`Linear::read_whole`]).
    pub fn load_whole(
        weights: &mut Weights,
        quantization: &Quantization,
        path: &str,
        in_features: i32,
        out_features: i32,
        bias: bool,
    ) -> Result<Self> {
        Self::load(weights, quantization, path, in_features, out_features, bias)?.read_whole()
    }

    /// Whether its weight is a divided model's tensor not read yet ([`crate::nn::part_reads`]):
    /// it is fused with others only once divided.
    fn is_unread(&self) -> bool {
        let weight = match self {
            Linear::Dense { weight, .. } => weight.weight(),
            Linear::Quantized { weight, .. } => &weight.weight,
        };
        crate::nn::part_reads::is_unread(weight)
    }

    /// The bias `[out]`, if any.
    pub fn bias(&self) -> Option<&Array> {
        match self {
            Linear::Dense { bias, .. } | Linear::Quantized { bias, .. } => bias.as_ref(),
        }
    }

    /// `(in, out)` features.
    pub fn features(&self) -> (i32, i32) {
        match self {
            Linear::Dense { weight, .. } => {
                let shape = weight.weight().shape();
                (shape[1], shape[0])
            }
            Linear::Quantized { weight, .. } => {
                let shape = weight.scales.shape();
                (shape[1] * weight.params.group_size, shape[0])
            }
        }
    }

    /// Rank `rank`'s part of this layer in a group of `size` ranks (see [`Shard`]), copied and
    /// evaluated so that the whole layer's memory can be freed. A quantized layer is divided by
    /// its packed words, scales and quantization biases: divided by inputs, each rank's part must
    /// hold whole quantization groups. An [`Shard::Inputs`] part has no bias (add
    /// [`Linear::bias`] after the ranks' sum). Errors when the features do not divide.
    pub fn shard(&self, shard: Shard, rank: usize, size: usize) -> Result<Linear> {
        let (inputs, outputs) = self.features();
        let divided = match shard {
            Shard::Outputs => outputs,
            Shard::Inputs => inputs,
        };
        self.shard_segments(shard, &[divided], rank, size)
    }

    /// [`Linear::shard`] of a layer whose divided features are `segments` side by side (a fused
    /// projection: queries, keys and values; gate and up): rank `r` takes the `r`th part of
    /// every segment, its parts side by side in the segments' order (mlx_lm's `segments`).
    /// Errors when the segments do not add up to the divided features or one does not divide.
    pub fn shard_segments(
        &self,
        shard: Shard,
        segments: &[i32],
        rank: usize,
        size: usize,
    ) -> Result<Linear> {
        let (inputs, outputs) = self.features();
        let divided = match shard {
            Shard::Outputs => outputs,
            Shard::Inputs => inputs,
        };
        let fail = |why: String| {
            Err(EngineError::Distributed(format!(
                "a layer of {inputs} inputs and {outputs} outputs cannot be divided by its \
                 {} over {size} ranks: {why}",
                shard
            )))
        };
        let parts = match ShardParts::new(segments, divided, rank, size) {
            Ok(parts) => parts,
            Err(why) => return fail(why),
        };
        // Built unread, so not yet copied dense as a layer loaded whole is (part reads).
        let unread = self.is_unread();
        let take = |a: &Array, axis: usize, units: Units| parts.take(a, axis, units);
        let bias = match (shard, self.bias()) {
            (Shard::Outputs, Some(bias)) => Some(take(bias, 0, (1, 1))?),
            _ => None,
        };
        let axis = match shard {
            Shard::Outputs => 0,
            Shard::Inputs => 1,
        };
        Ok(match self {
            Linear::Dense { weight, .. } => Linear::Dense {
                weight: DenseWeight::new(take(weight.weight(), axis, (1, 1))?)?,
                bias,
            },
            Linear::Quantized { weight: q, .. } => {
                let (words, groups) = match parts.quantized_units(shard, q.params) {
                    Ok(units) => units,
                    // A layer loaded whole would be divided as its dense copy, at any feature.
                    Err(_) if unread && dense_weights() => {
                        return self
                            .clone()
                            .read_whole()?
                            .shard_segments(shard, segments, rank, size);
                    }
                    Err(why) => return fail(why),
                };
                let part = QuantizedWeight {
                    weight: take(&q.weight, axis, words)?,
                    scales: take(&q.scales, axis, groups)?,
                    biases: q
                        .biases
                        .as_ref()
                        .map(|b| take(b, axis, groups))
                        .transpose()?,
                    params: q.params,
                    cpu_kernel: q.cpu_kernel,
                };
                // Copied dense where a layer loaded whole is, if it was not yet.
                match unread {
                    true => Linear::from_quantized(part, bias)?,
                    false => Linear::Quantized { weight: part, bias },
                }
            }
        })
    }

    /// Rank `rank`'s part by inputs ("sharded-to-all": the ranks' outputs are partial sums to
    /// add up), its bias on rank 0 alone, so that the sum holds it once (added before the sum
    /// rather than after it: the same sum, rounded in another order).
    pub fn shard_to_all(&self, rank: usize, size: usize) -> Result<Linear> {
        let part = self.shard(Shard::Inputs, rank, size)?;
        Ok(match (part, self.bias().filter(|_| rank == 0)) {
            (part, None) => part,
            (Linear::Dense { weight, .. }, Some(bias)) => Linear::Dense {
                weight,
                bias: Some(bias.clone()),
            },
            (Linear::Quantized { weight, .. }, Some(bias)) => Linear::Quantized {
                weight,
                bias: Some(bias.clone()),
            },
        })
    }

    /// One layer computing `parts`' outputs side by side (`[..., out_1 + out_2 + ...]`), their
    /// weights (and scales, quantization biases, biases) stacked along the output axis, when
    /// the parts allow it: all dense in one dtype, or all
    /// quantized with the same parameters and multiplied by MLX, with a bias on every part or none.
    /// Otherwise hands `parts` back. The stacked arrays are evaluated here, so the parts' memory
    /// is freed as they drop.
    pub fn fuse<const N: usize>(
        parts: [Linear; N],
    ) -> Result<std::result::Result<Linear, [Linear; N]>> {
        let with_bias = parts.iter().filter(|p| p.bias().is_some()).count();
        // Unread parts (a divided model's layer being built) are fused once divided.
        if N < 2 || (with_bias != 0 && with_bias != N) || parts.iter().any(Linear::is_unread) {
            return Ok(Err(parts));
        }
        let stack = |arrays: Vec<&Array>| -> Result<Array> {
            let stacked = ops::concatenate(&arrays, 0)?;
            stacked.eval()?;
            Ok(stacked)
        };
        let bias = match with_bias {
            0 => None,
            _ => Some(parts.iter().filter_map(Linear::bias).collect::<Vec<_>>()),
        };
        // Every part's weight when all are alike; `None` when some part differs from the first.
        let dense: Option<Vec<&Array>> = parts
            .iter()
            .map(|p| match (p, &parts[0]) {
                (Linear::Dense { weight, .. }, Linear::Dense { weight: first, .. })
                    if weight.weight().dtype() == first.weight().dtype() =>
                {
                    Some(weight.weight())
                }
                _ => None,
            })
            .collect();
        let quantized: Option<Vec<&QuantizedWeight>> = parts
            .iter()
            .map(|p| match (p, &parts[0]) {
                (Linear::Quantized { weight, .. }, Linear::Quantized { weight: first, .. })
                    if weight.params == first.params && !weight.cpu_kernel =>
                {
                    Some(weight)
                }
                _ => None,
            })
            .collect();
        let bias = bias.map(stack).transpose()?;
        let fused = match (dense, quantized) {
            (Some(weights), _) => Linear::Dense {
                weight: DenseWeight::new(stack(weights)?)?,
                bias,
            },
            (None, Some(q)) => Linear::Quantized {
                weight: QuantizedWeight {
                    weight: stack(q.iter().map(|q| &q.weight).collect())?,
                    scales: stack(q.iter().map(|q| &q.scales).collect())?,
                    biases: q
                        .iter()
                        .map(|q| q.biases.as_ref())
                        .collect::<Option<Vec<_>>>()
                        .map(stack)
                        .transpose()?,
                    params: q[0].params,
                    cpu_kernel: false,
                },
                bias,
            },
            (None, None) => return Ok(Err(parts)),
        };
        Ok(Ok(fused))
    }

    /// [`Linear::fuse`] where [`fused_projections`] says so; `parts` back otherwise.
    pub fn fuse_if_enabled<const N: usize>(
        parts: [Linear; N],
    ) -> Result<std::result::Result<Linear, [Linear; N]>> {
        match fused_projections() {
            true => Linear::fuse(parts),
            false => Ok(Err(parts)),
        }
    }

    /// The dense weight `[out, in]` and bias; `None` when quantized.
    pub fn dense(&self) -> Option<(&Array, Option<&Array>)> {
        match self {
            Linear::Dense { weight, bias } => Some((weight.weight(), bias.as_ref())),
            Linear::Quantized { .. } => None,
        }
    }

    /// `[..., in]` → `[..., out]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            Linear::Dense { weight, bias } => weight.forward(x, bias.as_ref()),
            Linear::Quantized { weight, bias } => {
                let y = weight.matmul_transposed(x)?;
                match bias {
                    Some(bias) => Ok(ops::add(&y, bias)?),
                    None => Ok(y),
                }
            }
        }
    }
}

/// `LayerNorm` with a learned scale and shift (vision towers').
#[derive(Clone)]
pub struct LayerNorm {
    weight: Array,
    bias: Array,
    eps: f32,
}

impl LayerNorm {
    /// `{path}.weight` and `{path}.bias`, `[dims]` each.
    pub fn load(weights: &mut Weights, path: &str, dims: i32, eps: f32) -> Result<Self> {
        Ok(Self {
            weight: weights.take_shaped(&format!("{path}.weight"), &[dims])?,
            bias: weights.take_shaped(&format!("{path}.bias"), &[dims])?,
            eps,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::layer_norm(x, &self.weight, &self.bias, self.eps)?)
    }
}

/// Token embedding table `[vocab, hidden]`, dense or quantized; doubles as the output projection
/// when embeddings are tied.
#[derive(Clone)]
pub enum Embedding {
    Dense(Array),
    Quantized(QuantizedWeight),
}

impl Embedding {
    pub fn load(
        weights: &mut Weights,
        quantization: &Quantization,
        path: &str,
        vocab: i32,
        hidden: i32,
    ) -> Result<Self> {
        Self::load_as(weights, quantization, path, [vocab, hidden], true)
    }

    /// [`Embedding::load`] for a table that is only looked up, never multiplied (Gemma 4's
    /// per-layer embeddings): a quantized one stays quantized on every backend, where a dense
    /// copy would only take memory (4.7 GB of bfloat16 for E2B's).
    pub fn load_lookup_only(
        weights: &mut Weights,
        quantization: &Quantization,
        path: &str,
        vocab: i32,
        hidden: i32,
    ) -> Result<Self> {
        Self::load_as(weights, quantization, path, [vocab, hidden], false)
    }

    fn load_as(
        weights: &mut Weights,
        quantization: &Quantization,
        path: &str,
        [vocab, hidden]: [i32; 2],
        multiplied: bool,
    ) -> Result<Self> {
        Ok(match quantization.for_module(path, weights) {
            Some(params) => {
                let table = QuantizedWeight::load(weights, path, vocab, hidden, params)?;
                let dense = if multiplied {
                    table.dense_copy()?
                } else {
                    None
                };
                match dense {
                    Some(table) => Embedding::Dense(table),
                    None => Embedding::Quantized(table),
                }
            }
            None => {
                Embedding::Dense(weights.take_shaped(&format!("{path}.weight"), &[vocab, hidden])?)
            }
        })
    }

    /// Token ids `[batch, seq]` → embeddings `[batch, seq, hidden]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match self {
            Embedding::Dense(table) => Ok(table.take_axis(ids, 0)?),
            Embedding::Quantized(q) => {
                let rows = |a: &Array| a.take_axis(ids, 0);
                let biases = q.biases.as_ref().map(rows).transpose()?;
                let dtype = (!q.params.mode.has_biases())
                    .then(|| Backend::current().compute_dtype(Dtype::Float32));
                Ok(crate::nn::mlx_ext::dequantize(
                    &rows(&q.weight)?,
                    &rows(&q.scales)?,
                    biases.as_ref(),
                    q.params.sizes(),
                    q.params.mode.mlx_name(),
                    dtype,
                )?)
            }
        }
    }

    /// Every product through MLX's operations (see [`QuantizedWeight::use_mlx_kernels`]).
    pub fn use_mlx_kernels(&mut self) {
        if let Embedding::Quantized(q) = self {
            q.use_mlx_kernels();
        }
    }

    /// Hidden states `[..., hidden]` → logits `[..., vocab]` with the embedding matrix transposed.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        match self {
            Embedding::Dense(table) => Ok(ops::matmul(x, table.t())?),
            Embedding::Quantized(q) => q.matmul_transposed(x),
        }
    }
}

/// RMSNorm over the last axis (Zhang & Sennrich 2019), via `mx.fast.rms_norm`.
#[derive(Clone)]
pub struct RmsNorm {
    /// `None`: no scale (Gemma 4's value norm, mlx_lm's `RMSNormNoScale`).
    weight: Option<Array>,
    eps: f32,
}

impl RmsNorm {
    pub fn load(weights: &mut Weights, path: &str, dims: i32, eps: f32) -> Result<Self> {
        Ok(Self {
            weight: Some(weights.take_shaped(&format!("{path}.weight"), &[dims])?),
            eps,
        })
    }

    /// A norm without a learned scale.
    pub fn unweighted(eps: f32) -> Self {
        Self { weight: None, eps }
    }

    /// A norm scaling by `weight` (`[dims]`), built rather than loaded.
    pub fn from_weight(weight: Array, eps: f32) -> Self {
        Self {
            weight: Some(weight),
            eps,
        }
    }

    /// [`RmsNorm::load`], or, when `unit_offset`, a norm whose stored weight is an offset from
    /// one (Gemma's: it scales by `1 + weight`, added in the weight's dtype as mlx_lm's
    /// `1.0 + self.weight` does, once here instead of every call).
    pub fn load_with_offset(
        weights: &mut Weights,
        path: &str,
        dims: i32,
        eps: f32,
        unit_offset: bool,
    ) -> Result<Self> {
        let norm = Self::load(weights, path, dims, eps)?;
        match norm.weight {
            Some(weight) if unit_offset => {
                let one = Array::from_f32(1.0).as_dtype(weight.dtype())?;
                let weight = ops::add(&one, &weight)?;
                weight.eval()?;
                Ok(Self {
                    weight: Some(weight),
                    eps,
                })
            }
            _ => Ok(norm),
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::rms_norm(x, self.weight.as_ref(), self.eps)?)
    }

    /// The learned scale `[dims]`, when the norm has one.
    pub fn weight(&self) -> Option<&Array> {
        self.weight.as_ref()
    }

    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// `x + residual` and the norm of that sum: (`sum`, `normed`). One kernel on CUDA
    /// ([`crate::nn::norm_kernel`]), MLX's add and norm elsewhere.
    pub fn add_forward(&self, x: &Array, residual: &Array) -> Result<(Array, Array)> {
        use crate::nn::norm_kernel;
        if let Some(weight) = &self.weight {
            if norm_kernel::enabled() && norm_kernel::computes(x, residual, weight) {
                return Ok(norm_kernel::add_rms_norm(x, residual, weight, self.eps)?);
            }
        }
        let sum = ops::add(x, residual)?;
        let normed = self.forward(&sum)?;
        Ok((sum, normed))
    }
}

/// Rotary position embedding (Su et al. 2021) over the first `dims` features of each head, in the
/// non-interleaved layout unless `traditional`. `freqs` replaces `base` for scaled variants
/// (Llama 3's `rope_scaling`, see [`llama3_frequencies`]; LongRoPE, see [`Rope::su_scaled`]).
#[derive(Clone)]
pub struct Rope {
    pub dims: i32,
    pub traditional: bool,
    pub base: f32,
    pub scale: f32,
    pub freqs: Option<Array>,
    /// LongRoPE's and YaRN's attention factor: the rotated features are multiplied by it first
    /// (1 for every other variant).
    pub mscale: f32,
    /// `[head_dim]` float32: `mscale` on the rotated features, 1 on the others, when only some
    /// are rotated (see [`Rope::for_head_dim`]); one multiply then replaces slicing them out.
    pub feature_scale: Option<Array>,
}

impl Rope {
    /// Builds the RoPE of a config: `rope_theta`, `rope_traditional` and `rope_scaling` (types
    /// none, `default`, `linear`, `llama3`; others are an error naming the type).
    pub fn new(
        dims: i32,
        base: f32,
        traditional: bool,
        scaling: Option<&Value>,
    ) -> std::result::Result<Self, String> {
        let mut rope = Rope {
            dims,
            traditional,
            base,
            scale: 1.0,
            freqs: None,
            mscale: 1.0,
            feature_scale: None,
        };
        let Some(scaling) = scaling.filter(|v| !v.is_null()) else {
            return Ok(rope);
        };
        let kind = scaling
            .get("type")
            .or_else(|| scaling.get("rope_type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let number =
            |key: &str, default: f64| scaling.get(key).and_then(Value::as_f64).unwrap_or(default);
        match kind {
            "default" => {}
            "linear" => rope.scale = 1.0 / number("factor", 1.0) as f32,
            "llama3" => {
                let freqs = llama3_frequencies(
                    dims,
                    base,
                    number("factor", 8.0) as f32,
                    number("low_freq_factor", 1.0) as f32,
                    number("high_freq_factor", 4.0) as f32,
                    number("original_max_position_embeddings", 8192.0) as f32,
                );
                rope.freqs = Some(Array::from_slice(&freqs, &[freqs.len() as i32]));
            }
            "yarn" | "deepseek_yarn" => {
                let factor = scaling
                    .get("factor")
                    .and_then(Value::as_f64)
                    .ok_or("rope_scaling type `yarn` needs a numeric `factor`")?;
                return Rope::yarn(
                    dims,
                    base,
                    traditional,
                    Yarn {
                        factor,
                        original_max_position_embeddings: number(
                            "original_max_position_embeddings",
                            4096.0,
                        ),
                        beta_fast: number("beta_fast", 32.0),
                        beta_slow: number("beta_slow", 1.0),
                        mscale: number("mscale", 1.0),
                        mscale_all_dim: number("mscale_all_dim", 0.0),
                    },
                );
            }
            "proportional" => {
                rope.freqs = Some(
                    proportional_frequencies(
                        dims,
                        base,
                        number("partial_rotary_factor", 1.0),
                        number("factor", 1.0),
                    )
                    .map_err(|e| format!("proportional RoPE: {e}"))?,
                );
            }
            other => {
                return Err(format!(
                    "rope_scaling type `{other}` is not supported (none, linear, llama3, yarn, \
                     proportional)"
                ))
            }
        }
        Ok(rope)
    }

    /// YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language
    /// Models") as mlx_lm's `YarnRoPE` computes it: per-pair periods blended between
    /// `base^(2i / dims)` (pairs that rotate fast, below the correction range) and `factor`
    /// times that (slow ones, above it) over a linear ramp between the pairs that turn
    /// `beta_fast` and `beta_slow` times in `original_max_position_embeddings` positions; the
    /// rotated features are multiplied by `m(factor, mscale) / m(factor, mscale_all_dim)` with
    /// `m(s, a) = 0.1 a ln(s) + 1` (1 when `s <= 1`).
    pub fn yarn(
        dims: i32,
        base: f32,
        traditional: bool,
        yarn: Yarn,
    ) -> std::result::Result<Self, String> {
        let Yarn {
            factor,
            original_max_position_embeddings: original,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
        } = yarn;
        let finite = [
            factor,
            original,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
        ]
        .iter()
        .all(|v| v.is_finite());
        if !finite || factor <= 0.0 || original <= 0.0 || beta_fast <= 0.0 || beta_slow <= 0.0 {
            return Err(
                "rope_scaling `yarn` needs a positive `factor`, `original_max_position_embeddings`, \
                 `beta_fast` and `beta_slow`"
                    .into(),
            );
        }
        if !(base.is_finite() && base > 1.0) {
            return Err(format!("`rope_theta` must be above 1 for YaRN, got {base}"));
        }
        // The pair index at which a feature turns `rotations` times in `original` positions.
        let correction = |rotations: f64| {
            dims as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * (base as f64).ln())
        };
        let low = correction(beta_fast).floor().max(0.0);
        let mut high = correction(beta_slow).ceil().min((dims - 1) as f64);
        if low == high {
            high += 0.001;
        }
        let m = |scale: f64, a: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * a * scale.ln() + 1.0
            }
        };
        let attention_factor = m(factor, mscale) / m(factor, mscale_all_dim);
        let freqs = (|| -> Result<Array> {
            let extra = ops::power(
                Array::from_f32(base),
                &ops::divide(
                    &ops::arange::<_, f32>(0, dims, 2)?,
                    Array::from_f32(dims as f32),
                )?,
            )?;
            let inter = ops::multiply(&extra, Array::from_f32(factor as f32))?;
            let ramp = ops::clip(
                &ops::divide(
                    &ops::subtract(
                        &ops::arange::<_, f32>(0, dims / 2, None)?,
                        Array::from_f32(low as f32),
                    )?,
                    Array::from_f32((high - low) as f32),
                )?,
                (Array::from_f32(0.0), Array::from_f32(1.0)),
            )?;
            let mask = ops::subtract(Array::from_f32(1.0), &ramp)?;
            let blended = ops::add(
                &ops::multiply(&inter, &mask)?,
                &ops::multiply(&extra, &ops::subtract(Array::from_f32(1.0), &mask)?)?,
            )?;
            let freqs = ops::divide(&ops::multiply(&inter, &extra)?, &blended)?;
            freqs.eval()?;
            Ok(freqs)
        })()
        .map_err(|e| e.to_string())?;
        Ok(Rope {
            dims,
            traditional,
            base,
            scale: 1.0,
            freqs: Some(freqs),
            mscale: attention_factor as f32,
            feature_scale: None,
        })
    }

    /// LongRoPE ("su" / "longrope" `rope_scaling`, Phi-3.5 and Phi-4-mini) as mlx_lm's
    /// `SuScaledRoPE` computes it: per-pair periods `long_factor[i] * base^(2i / dims)` (mlx_lm
    /// uses the long factors at every length; `short_factor` is never read) and the rotated
    /// features scaled by `long_mscale`, else `sqrt(1 + ln(s) / ln(original))` with
    /// `s = max_position_embeddings / original_max_position_embeddings` when `s > 1`.
    /// `long_factor`: one number, or `dims / 2` of them.
    pub fn su_scaled(
        dims: i32,
        base: f32,
        long_factor: &[f32],
        max_position_embeddings: f64,
        original_max_position_embeddings: f64,
        long_mscale: Option<f64>,
    ) -> std::result::Result<Self, String> {
        let pairs = dims / 2;
        if long_factor.len() != 1 && long_factor.len() as i32 != pairs {
            return Err(format!(
                "rope_scaling `long_factor` has {} values; RoPE over {dims} features needs {pairs}",
                long_factor.len()
            ));
        }
        if !(original_max_position_embeddings > 1.0 && max_position_embeddings > 0.0) {
            return Err(
                "`original_max_position_embeddings` must be above 1 and `max_position_embeddings` \
                 above 0"
                    .into(),
            );
        }
        let freqs = (|| -> Result<Array> {
            let exponents = ops::divide(
                &ops::arange::<_, f32>(0, dims, 2)?,
                Array::from_f32(dims as f32),
            )?;
            let periods = ops::power(Array::from_f32(base), &exponents)?;
            let factors = Array::from_slice(long_factor, &[long_factor.len() as i32]);
            let freqs = ops::multiply(&factors, &periods)?;
            freqs.eval()?;
            Ok(freqs)
        })()
        .map_err(|e| e.to_string())?;
        let factor = max_position_embeddings / original_max_position_embeddings;
        let mscale = long_mscale.unwrap_or(if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / original_max_position_embeddings.ln()).sqrt()
        });
        Ok(Rope {
            dims,
            traditional: false,
            base,
            scale: 1.0,
            freqs: Some(freqs),
            mscale: mscale as f32,
            feature_scale: None,
        })
    }

    /// `x` `[batch, heads, seq, head_dim]`, positions starting at `offset`.
    pub fn forward(&self, x: &Array, offset: i32) -> Result<Array> {
        let scaled = self.pre_scale(x)?;
        let x = scaled.as_ref().unwrap_or(x);
        Ok(fast::rope(
            x,
            self.dims,
            self.traditional,
            self.mlx_base(),
            self.scale,
            offset,
            self.freqs.as_ref(),
        )?)
    }
}

impl Rope {
    /// This RoPE for heads of `head_dim` features: when it scales only the first `dims` of
    /// them, the `[head_dim]` vector [`Rope::pre_scale`] multiplies by is built here, once.
    pub fn for_head_dim(mut self, head_dim: i32) -> Result<Self> {
        if self.mscale != 1.0 && self.dims < head_dim {
            let mut scale = vec![self.mscale; self.dims.max(0) as usize];
            scale.resize(head_dim as usize, 1.0);
            self.feature_scale = Some(Array::from_slice(&scale, &[head_dim]));
        }
        Ok(self)
    }

    /// `x` with its first `dims` features multiplied by `mscale` (in `x`'s dtype, as mlx_lm's
    /// `x.at[..., :dims].multiply(mscale)`); `None` (nothing built, as on every decode step of
    /// other variants) when that is 1.
    fn pre_scale(&self, x: &Array) -> Result<Option<Array>> {
        if self.mscale == 1.0 {
            return Ok(None);
        }
        if let Some(scale) = self
            .feature_scale
            .as_ref()
            .filter(|v| x.shape().last() == v.shape().last())
        {
            let scale = if scale.dtype() == x.dtype() {
                scale.clone()
            } else {
                scale.as_dtype(x.dtype())?
            };
            return Ok(Some(ops::multiply(x, &scale)?));
        }
        let mscale = crate::nn::mlx_ext::scalar(self.mscale, x.dtype())?;
        let shape = x.shape().to_vec();
        let last = shape.len() - 1;
        if self.dims >= shape[last] {
            return Ok(Some(ops::multiply(x, &mscale)?));
        }
        let mut start = vec![0; shape.len()];
        let mut end = shape.clone();
        end[last] = self.dims;
        let rotated = ops::multiply(&slice(x, &start, &end)?, &mscale)?;
        start[last] = self.dims;
        let rest = slice(x, &start, &shape)?;
        Ok(Some(ops::concatenate(&[rotated, rest], last as i32)?))
    }

    /// MLX's `base` argument: none when `freqs` replaces it.
    fn mlx_base(&self) -> Option<f32> {
        self.freqs.is_none().then_some(self.base)
    }

    /// `x` `[batch, heads, seq, head_dim]`, row `b`'s positions starting at `offsets[b]`
    /// (`offsets` `[batch]` int32).
    pub fn forward_at(&self, x: &Array, offsets: &Array) -> Result<Array> {
        let scaled = self.pre_scale(x)?;
        let x = scaled.as_ref().unwrap_or(x);
        Ok(fast::rope_dynamic(
            x,
            self.dims,
            self.traditional,
            self.mlx_base(),
            self.scale,
            offsets,
            self.freqs.as_ref(),
        )?)
    }
}

/// YaRN's `rope_scaling` parameters (see [`Rope::yarn`]), with mlx_lm's defaults: `factor`
/// required, `original_max_position_embeddings` 4096, `beta_fast` 32, `beta_slow` 1, `mscale`
/// 1, `mscale_all_dim` 0.
#[derive(Debug, Clone, Copy)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

/// Gemma 4's "proportional" RoPE (mlx_lm's `ProportionalRoPE`): of a head's `dims` features,
/// the first `int(dims * partial_rotary_factor)` rotate with periods `factor * base^(2i / dims)`
/// (exponents over all `dims`, not over the rotated ones) and the others not at all (an infinite
/// period). Returns the `dims / 2` periods MLX's `freqs` argument expects, float32, computed
/// with MLX's operations as mlx_lm computes them. Errors for a factor outside `[0, 1]` or an
/// odd number of rotated features.
pub fn proportional_frequencies(
    dims: i32,
    base: f32,
    partial_rotary_factor: f64,
    factor: f64,
) -> std::result::Result<Array, String> {
    if !(0.0..=1.0).contains(&partial_rotary_factor) {
        return Err(format!(
            "`partial_rotary_factor` must be between 0 and 1, got {partial_rotary_factor}"
        ));
    }
    let rotated = (dims as f64 * partial_rotary_factor) as i32;
    if rotated % 2 != 0 || dims % 2 != 0 {
        return Err(format!(
            "{rotated} rotated features of {dims}: both must be even"
        ));
    }
    let build = || -> Result<Array> {
        let exponents = ops::divide(
            &ops::arange::<_, f32>(0.0, rotated as f32, 2.0)?,
            Array::from_f32(dims as f32),
        )?;
        let periods = ops::multiply(
            Array::from_f32(factor as f32),
            &ops::power(Array::from_f32(base), &exponents)?,
        )?;
        let still = ops::full::<f32>(&[(dims - rotated) / 2], Array::from_f32(f32::INFINITY))?;
        let freqs = ops::concatenate(&[periods, still], 0)?;
        freqs.eval()?;
        Ok(freqs)
    };
    build().map_err(|e| e.to_string())
}

/// Llama 3.1's frequency-dependent RoPE scaling (Meta's `apply_scaling`; mlx-lm `Llama3RoPE`):
/// low frequencies are divided by `factor`, high ones kept, the band between interpolated.
/// Returns the `dims / 2` per-pair periods MLX's `freqs` argument expects.
pub fn llama3_frequencies(
    dims: i32,
    base: f32,
    factor: f32,
    low_freq_factor: f32,
    high_freq_factor: f32,
    old_context: f32,
) -> Vec<f32> {
    let low_freq_wavelen = old_context / low_freq_factor;
    let high_freq_wavelen = old_context / high_freq_factor;
    (0..dims / 2)
        .map(|i| {
            let freq = base.powf((2 * i) as f32 / dims as f32);
            let wavelen = 2.0 * std::f32::consts::PI * freq;
            let scaled = if wavelen > low_freq_wavelen {
                freq * factor
            } else {
                freq
            };
            if wavelen > high_freq_wavelen && wavelen < low_freq_wavelen {
                let smooth = (old_context / wavelen - low_freq_factor)
                    / (high_freq_factor - low_freq_factor);
                scaled / ((1.0 - smooth) / factor + smooth)
            } else {
                scaled
            }
        })
        .collect()
}

/// The gate's activation in a gated feed-forward block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU: Llama, Qwen).
    #[default]
    Silu,
    /// GELU's tanh approximation (GeGLU: Gemma), see [`gelu_approx`].
    GeluApprox,
    /// gpt-oss's clamped SwiGLU (mlx_lm's `swiglu_oai`): the gate clipped from above at 7, the
    /// linear part to ±7 and shifted by one, `(up + 1) * gate * sigmoid(1.702 * gate)`.
    SwigluOai,
}

impl Activation {
    /// gpt-oss's `alpha` and `limit` (mlx_lm's `SwigluOAI` defaults, which its model uses).
    const OAI_ALPHA: f32 = 1.702;
    const OAI_LIMIT: f32 = 7.0;

    /// The gated unit: `act(gate) * up`, or [`Activation::SwigluOai`]'s form; every constant a
    /// scalar of the activations' dtype.
    pub fn gated(self, gate: &Array, up: &Array) -> Result<Array> {
        match self {
            Activation::Silu => Ok(ops::multiply(&mlx_rs::nn::silu(gate)?, up)?),
            Activation::GeluApprox => Ok(ops::multiply(&gelu_approx(gate)?, up)?),
            Activation::SwigluOai => {
                let c = |v: f32| Array::from_f32(v).as_dtype(gate.dtype());
                let limit = c(Self::OAI_LIMIT)?;
                let gate = ops::minimum(gate, &limit)?;
                let up = ops::clip(up, (&ops::negative(&limit)?, &limit))?;
                let glu = ops::multiply(
                    &gate,
                    &ops::sigmoid(&ops::multiply(&c(Self::OAI_ALPHA)?, &gate)?)?,
                )?;
                Ok(ops::multiply(&ops::add(&up, &c(1.0)?)?, &glu)?)
            }
        }
    }
}

/// GELU's tanh approximation (Hendrycks & Gimpel 2016), written as MLX's `nn.gelu_approx`:
/// `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))`, every constant in `x`'s dtype
/// (mlx-rs's `gelu_approximate` uses float32 constants, which would promote bfloat16
/// activations to float32).
pub fn gelu_approx(x: &Array) -> Result<Array> {
    let dtype = x.dtype();
    let c = |v: f32| Array::from_f32(v).as_dtype(dtype);
    let cube = ops::power(x, &c(3.0)?)?;
    let inner = ops::multiply(
        &c((2.0 / std::f32::consts::PI).sqrt())?,
        &ops::add(x, &ops::multiply(&c(0.044715)?, &cube)?)?,
    )?;
    let half_x = ops::multiply(&c(0.5)?, x)?;
    Ok(ops::multiply(
        &half_x,
        &ops::add(&c(1.0)?, &ops::tanh(&inner)?)?,
    )?)
}

/// The gated feed-forward block: `down(act(gate(x)) * up(x))`, SwiGLU unless
/// [`Mlp::with_activation`] says otherwise.
#[derive(Clone)]
pub struct Mlp {
    gate_up: GateUp,
    down_proj: Linear,
    activation: Activation,
}

/// The gate and up projections, separate or fused into one (see [`fused_projections`]).
#[derive(Clone)]
enum GateUp {
    Separate {
        gate_proj: Linear,
        up_proj: Linear,
    },
    /// Outputs `[..., 2 * intermediate]`: the gate's, then the up projection's.
    Fused(Linear),
}

impl GateUp {
    /// `gate_proj` and `up_proj`, fused where [`Linear::fuse_if_enabled`] does.
    fn of(gate_proj: Linear, up_proj: Linear) -> Result<Self> {
        Ok(match Linear::fuse_if_enabled([gate_proj, up_proj])? {
            Ok(proj) => GateUp::Fused(proj),
            Err([gate_proj, up_proj]) => GateUp::Separate { gate_proj, up_proj },
        })
    }
}

impl Mlp {
    pub fn load(
        weights: &mut Weights,
        quantization: &Quantization,
        path: &str,
        hidden: i32,
        intermediate: i32,
        bias: bool,
    ) -> Result<Self> {
        let fused_path = format!("{path}.gate_up_proj");
        let gate_up = if weights.contains(&format!("{fused_path}.weight")) {
            // Stored fused (Phi-3's `gate_up_proj`): the gate's outputs, then the up projection's.
            GateUp::Fused(Linear::load(
                weights,
                quantization,
                &fused_path,
                hidden,
                2 * intermediate,
                bias,
            )?)
        } else {
            Self::load_gate_up(weights, quantization, path, hidden, intermediate, bias)?
        };
        Ok(Self {
            gate_up,
            down_proj: Linear::load(
                weights,
                quantization,
                &format!("{path}.down_proj"),
                intermediate,
                hidden,
                bias,
            )?,
            activation: Activation::Silu,
        })
    }

    /// Separate `gate_proj` and `up_proj` (fused at load where that is enabled).
    fn load_gate_up(
        weights: &mut Weights,
        quantization: &Quantization,
        path: &str,
        hidden: i32,
        intermediate: i32,
        bias: bool,
    ) -> Result<GateUp> {
        let gate_proj = Linear::load(
            weights,
            quantization,
            &format!("{path}.gate_proj"),
            hidden,
            intermediate,
            bias,
        )?;
        let up_proj = Linear::load(
            weights,
            quantization,
            &format!("{path}.up_proj"),
            hidden,
            intermediate,
            bias,
        )?;
        GateUp::of(gate_proj, up_proj)
    }

    /// The same block with `activation` on its gate.
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// Every product through MLX's operations (see [`QuantizedWeight::use_mlx_kernels`]).
    pub fn use_mlx_kernels(&mut self) {
        match &mut self.gate_up {
            GateUp::Separate { gate_proj, up_proj } => {
                gate_proj.use_mlx_kernels();
                up_proj.use_mlx_kernels();
            }
            GateUp::Fused(proj) => proj.use_mlx_kernels(),
        }
        self.down_proj.use_mlx_kernels();
    }

    /// Rank `rank`'s part of `size` (Megatron-LM's MLP): the gate and up projections by
    /// outputs, the down projection by inputs ([`Linear::shard_to_all`]); its output is a
    /// partial sum of the whole block's.
    pub fn shard(&self, rank: usize, size: usize) -> Result<Self> {
        let gate_up = match &self.gate_up {
            // Fused as at load (parts read unfused are fused once divided).
            GateUp::Separate { gate_proj, up_proj } => GateUp::of(
                gate_proj.shard(Shard::Outputs, rank, size)?,
                up_proj.shard(Shard::Outputs, rank, size)?,
            )?,
            GateUp::Fused(proj) => {
                let half = proj.features().1 / 2;
                GateUp::Fused(proj.shard_segments(Shard::Outputs, &[half, half], rank, size)?)
            }
        };
        Ok(Self {
            gate_up,
            down_proj: self.down_proj.shard_to_all(rank, size)?,
            activation: self.activation,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (gate, up) = match &self.gate_up {
            GateUp::Separate { gate_proj, up_proj } => (gate_proj.forward(x)?, up_proj.forward(x)?),
            GateUp::Fused(proj) => halves(&proj.forward(x)?)?,
        };
        let activated = self.activation.gated(&gate, &up)?;
        self.down_proj.forward(&activated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(shape: &[i32], seed: u64) -> Array {
        let key = mlx_rs::random::key(seed).unwrap();
        mlx_rs::random::normal::<f32>(shape, None, None, &key).unwrap()
    }

    fn quantized(weight: &Array, group_size: i32, bits: i32) -> QuantizedWeight {
        let (weight, scales, biases) = ops::quantize(weight, group_size, bits).unwrap();
        QuantizedWeight {
            weight,
            scales,
            biases: Some(biases),
            params: QuantParams {
                group_size,
                bits,
                mode: QuantMode::Affine,
            },
            cpu_kernel: false,
        }
    }

    /// `fused(x)` against the separate parts' outputs side by side.
    fn assert_fused_matches<const N: usize>(parts: [Linear; N], x: &Array) {
        let separate: Vec<Array> = parts.iter().map(|p| p.forward(x).unwrap()).collect();
        let expected = ops::concatenate(&separate, -1).unwrap();
        let fused = Linear::fuse(parts).unwrap().ok().expect("the parts fuse");
        let got = fused.forward(x).unwrap();
        assert_eq!(got.shape(), expected.shape());
        let diff = ops::abs(ops::subtract(&got, &expected).unwrap()).unwrap();
        let largest = ops::max(&diff, None).unwrap().item_exact::<f32>();
        assert!(largest <= 1e-5, "fused output differs by {largest}");
    }

    fn largest_difference(a: &Array, b: &Array) -> f32 {
        assert_eq!(a.shape(), b.shape());
        let diff = ops::abs(ops::subtract(a, b).unwrap()).unwrap();
        ops::max(&diff, None).unwrap().item_exact::<f32>()
    }

    /// Every rank's part of a layer, run alone, gives the whole layer's output: divided by outputs,
    /// the parts' outputs side by side; divided by inputs, each part reading its slice of the
    /// input, their sum plus the bias. Dense and quantized layers, with and without a bias, over
    /// 2 and 4 ranks (the products differ only by the sum's order: float32 rounding).
    #[test]
    fn shards_add_up_to_the_layer() {
        let (inputs, outputs) = (256, 96);
        let x = random(&[3, 5, inputs], 1);
        let w = random(&[outputs, inputs], 2);
        let b = random(&[outputs], 3);
        let layers = [
            (
                "dense",
                Linear::Dense {
                    weight: DenseWeight::new(w.clone()).unwrap(),
                    bias: None,
                },
            ),
            (
                "dense with a bias",
                Linear::Dense {
                    weight: DenseWeight::new(w.clone()).unwrap(),
                    bias: Some(b.clone()),
                },
            ),
            (
                "4-bit with a bias",
                Linear::Quantized {
                    weight: quantized(&w, 64, 4),
                    bias: Some(b.clone()),
                },
            ),
            (
                "8-bit, groups of 32",
                Linear::Quantized {
                    weight: quantized(&w, 32, 8),
                    bias: None,
                },
            ),
        ];
        for (name, layer) in &layers {
            let whole = layer.forward(&x).unwrap();
            for size in [2, 4] {
                let outputs_parts: Vec<Array> = (0..size)
                    .map(|r| {
                        layer
                            .shard(Shard::Outputs, r, size)
                            .unwrap()
                            .forward(&x)
                            .unwrap()
                    })
                    .collect();
                let side_by_side = ops::concatenate(&outputs_parts, -1).unwrap();
                let error = largest_difference(&side_by_side, &whole);
                assert!(error <= 1e-4, "{name} by outputs over {size}: {error}");

                let part = inputs / size as i32;
                let mut sum: Option<Array> = None;
                for r in 0..size {
                    let shard = layer.shard(Shard::Inputs, r, size).unwrap();
                    assert!(shard.bias().is_none(), "{name}: an inputs part has no bias");
                    assert_eq!(shard.features(), (part, outputs));
                    let start = r as i32 * part;
                    let x_part = slice(&x, &[0, 0, start], &[3, 5, start + part]).unwrap();
                    let y = shard.forward(&x_part).unwrap();
                    sum = Some(match sum {
                        Some(s) => ops::add(&s, &y).unwrap(),
                        None => y,
                    });
                }
                let mut sum = sum.unwrap();
                if let Some(bias) = layer.bias() {
                    sum = ops::add(&sum, bias).unwrap();
                }
                let error = largest_difference(&sum, &whole);
                assert!(error <= 1e-3, "{name} by inputs over {size}: {error}");

                // The bias on rank 0 alone: the parts add up to the whole layer.
                let mut sum: Option<Array> = None;
                for r in 0..size {
                    let start = r as i32 * part;
                    let x_part = slice(&x, &[0, 0, start], &[3, 5, start + part]).unwrap();
                    let y = layer
                        .shard_to_all(r, size)
                        .unwrap()
                        .forward(&x_part)
                        .unwrap();
                    sum = Some(match sum {
                        Some(s) => ops::add(&s, &y).unwrap(),
                        None => y,
                    });
                }
                let error = largest_difference(&sum.unwrap(), &whole);
                assert!(error <= 1e-3, "{name} to all over {size}: {error}");

                // A fused layer of two parts (32 and 64 outputs): each rank's part of each.
                let n = size as i32;
                for r in 0..size {
                    let r = r as i32;
                    let ours = layer
                        .shard_segments(Shard::Outputs, &[32, 64], r as usize, size)
                        .unwrap()
                        .forward(&x)
                        .unwrap();
                    let (a, b) = (32 / n, 64 / n);
                    let expected = ops::concatenate(
                        &[
                            slice(&whole, &[0, 0, r * a], &[3, 5, (r + 1) * a]).unwrap(),
                            slice(&whole, &[0, 0, 32 + r * b], &[3, 5, 32 + (r + 1) * b]).unwrap(),
                        ],
                        -1,
                    )
                    .unwrap();
                    let error = largest_difference(&ours, &expected);
                    assert!(error <= 1e-4, "{name} in segments over {size}: {error}");
                }
            }
        }
        // Shapes that do not divide are refused with a sentence.
        let q4 = &layers[2].1;
        for (shard, rank, size, expected) in [
            (Shard::Outputs, 0, 5, "96 is not a multiple of 5"),
            (
                Shard::Inputs,
                0,
                8,
                "a rank's 32 inputs are not whole groups of 64",
            ),
            (Shard::Outputs, 2, 2, "rank 2 is not one of them"),
        ] {
            let Err(e) = q4.shard(shard, rank, size) else {
                panic!("{shard:?} over {size} was accepted");
            };
            assert!(e.to_string().contains(expected), "{e}");
        }
    }

    /// mlx-community's gpt-oss MXFP4-Q8 layout: the default is mxfp4 (the experts), the other
    /// layers are listed by path without a mode and are 8-bit affine; a layer not listed but
    /// stored with scales takes the default.
    #[test]
    fn quantization_modes_by_path() {
        let config = serde_json::json!({"quantization": {"group_size": 32, "bits": 4,
            "mode": "mxfp4", "model.layers.0.mlp.router": {"group_size": 64, "bits": 8},
            "model.embed_tokens": false}});
        let q = Quantization::from_config(&config).unwrap();
        let mut weights = Weights::empty(Backend::Cpu);
        weights.insert_for_test("model.layers.0.mlp.experts.up_proj.scales");
        let experts = q.for_module("model.layers.0.mlp.experts.up_proj", &weights);
        assert_eq!(
            experts,
            Some(QuantParams {
                group_size: 32,
                bits: 4,
                mode: QuantMode::Mxfp4
            })
        );
        assert_eq!(
            q.for_module("model.layers.0.mlp.router", &weights),
            Some(QuantParams {
                group_size: 64,
                bits: 8,
                mode: QuantMode::Affine
            })
        );
        assert_eq!(q.for_module("model.embed_tokens", &weights), None);
        for (section, expected) in [
            (
                serde_json::json!({"mode": "nvfp4"}),
                "mode \"nvfp4\" is not supported",
            ),
            (
                serde_json::json!({"mode": "mxfp4", "group_size": 64}),
                "bits=4 group_size=64 (mxfp4)",
            ),
            (
                serde_json::json!({"bits": 4, "model.x": {"mode": "mxfp8", "bits": 4}}),
                "bits=4 group_size=32 (mxfp8)",
            ),
            (
                serde_json::json!({"quant_method": "mxfp4"}),
                "method `mxfp4` (the original checkpoint's format) is not supported",
            ),
            (
                serde_json::json!({"bits": 7}),
                "bits=7 group_size=64 (affine)",
            ),
        ] {
            let err = Quantization::from_config(&serde_json::json!({ "quantization": section }))
                .unwrap_err();
            assert!(err.contains(expected), "{section}: {err}");
        }
    }

    #[test]
    fn fused_dense_projections_with_biases_equal_the_separate_ones() {
        let x = random(&[2, 3, 64], 1);
        let parts = [(96, 2), (32, 3), (32, 4)].map(|(out, seed)| Linear::Dense {
            weight: DenseWeight::new(random(&[out, 64], seed)).unwrap(),
            bias: Some(random(&[out], seed + 10)),
        });
        assert_fused_matches(parts, &x);
    }

    #[test]
    fn fused_quantized_projections_equal_the_separate_ones() {
        let x = random(&[5, 128], 2);
        let parts = [(64, 5), (128, 6)].map(|(out, seed)| Linear::Quantized {
            weight: quantized(&random(&[out, 128], seed), 64, 4),
            bias: None,
        });
        assert_fused_matches(parts, &x);
    }

    #[test]
    fn parts_that_cannot_fuse_are_handed_back() {
        let dense = |bias: bool, seed| Linear::Dense {
            weight: DenseWeight::new(random(&[16, 64], seed)).unwrap(),
            bias: bias.then(|| random(&[16], seed + 1)),
        };
        let kept = Linear::fuse([dense(true, 1), dense(false, 2)]).unwrap();
        assert_eq!(
            kept.err().map(|p| p.len()),
            Some(2),
            "a bias on one part only"
        );
        let q4 = Linear::Quantized {
            weight: quantized(&random(&[16, 64], 3), 64, 4),
            bias: None,
        };
        let q8 = Linear::Quantized {
            weight: quantized(&random(&[16, 64], 4), 64, 8),
            bias: None,
        };
        let kept = Linear::fuse([q4, q8]).unwrap();
        assert_eq!(kept.err().map(|p| p.len()), Some(2), "different bit widths");
        let mixed = Linear::fuse([
            dense(false, 5),
            Linear::Quantized {
                weight: quantized(&random(&[16, 64], 6), 64, 4),
                bias: None,
            },
        ])
        .unwrap();
        assert_eq!(mixed.err().map(|p| p.len()), Some(2), "dense and quantized");
        assert!(Linear::fuse([dense(false, 7)]).unwrap().is_err());
    }
}
