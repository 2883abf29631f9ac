//! Sparse mixture-of-experts feed-forward blocks (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`,
//! Qwen3-Next's and Qwen3.5-MoE's `Qwen3NextSparseMoeBlock`): a router picks each token's top-k
//! experts, each a SwiGLU MLP, and their outputs are summed with the router's softmax weights
//! (renormalised over the k when `norm_topk_prob`); Qwen3.5-MoE adds a shared expert every token
//! goes through, scaled by `sigmoid(shared_expert_gate(x))`. Where Perch's CUDA kernels run the
//! experts, a shared expert quantized as the experts are is folded into them at load: its
//! SwiGLU MLP of `S = n·I` features is the sum of `n` MLPs of the experts' `I` features (its
//! gate and up rows and its down columns cut in `n`), appended to the experts' stacks as experts
//! `E .. E + n` that every token takes with the gate's sigmoid as their weight, the gate's row
//! appended to the router's; so a layer's experts stay three launches (router, gated product,
//! weighted product) instead of adding the shared MLP's products, activation, gate, sigmoid,
//! scaling and sum to every decode step. The experts'
//! weights are stacked per projection, `[experts, out, in]` (mlx-community's `switch_mlp`
//! layout; Hugging Face's `experts.{e}` tensors are stacked at load, as mlx_lm's `sanitize`
//! does), and multiplied by MLX's `gather_mm` / `gather_qmm` for the chosen experts only.
//! Gemma 4's experts sit beside every layer's dense MLP instead ([`MlpAndExperts`]), with a
//! router of their own.
//! Reference: mlx-lm `models/qwen3_moe.py`, `models/gemma4_text.py`, `models/switch_layers.py`.

use mlx_rs::{ops, Array};

use crate::distributed::TensorParallel;
use crate::error::{EngineError, Result};
use crate::nn::expert_kernel;
use crate::nn::layers::{
    Activation, Linear, Mlp, QuantParams, Quantization, RmsNorm, Shard, ShardParts,
};
use crate::nn::mlx_ext::top_k;
use crate::nn::weights::Weights;

/// The sizes of a model's sparse blocks, and which layers have one.
#[derive(Debug, Clone)]
pub struct MoeConfig {
    pub num_experts: i32,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: i32,
    /// Each expert's intermediate size (`moe_intermediate_size`).
    pub intermediate_size: i32,
    /// Renormalise the chosen experts' weights to sum to one.
    pub norm_topk_prob: bool,
    /// Layer `i` is sparse when `(i + 1) % decoder_sparse_step == 0` and `i` is not in
    /// `mlp_only_layers`; the others keep a dense MLP of the model's `intermediate_size`.
    pub decoder_sparse_step: i32,
    pub mlp_only_layers: Vec<i32>,
    /// The shared expert's intermediate size (`shared_expert_intermediate_size`), when the
    /// blocks have one.
    pub shared_expert_intermediate_size: Option<i32>,
    pub style: MoeStyle,
}

/// How a model's experts are routed and where they sit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MoeStyle {
    /// Qwen3-MoE, Qwen3.5-MoE: a softmax over every expert's score, the top k kept; the sparse
    /// block replaces the layer's MLP ([`SparseMoe`]).
    #[default]
    Qwen,
    /// Gemma 4: the experts run beside the layer's MLP, each part with its own norms
    /// ([`MlpAndExperts`]); the top k scores are softmaxed among themselves.
    Gemma4,
    /// gpt-oss: the sparse block replaces the MLP; the router (`router`, with a bias) keeps the
    /// top k scores and softmaxes them among themselves; experts (`experts.*`) have biases and
    /// gpt-oss's clamped SwiGLU ([`Activation::SwigluOai`]).
    GptOss,
}

impl MoeConfig {
    /// Largest expert count accepted from a config (published models have up to 512).
    const MAX_EXPERTS: i32 = 4096;

    pub fn is_sparse_layer(&self, i: i32) -> bool {
        !self.mlp_only_layers.contains(&i) && (i + 1) % self.decoder_sparse_step == 0
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        use super::within;
        within("num_experts", self.num_experts, Self::MAX_EXPERTS)?;
        within("num_experts_per_tok", self.top_k, self.num_experts)?;
        within("moe_intermediate_size", self.intermediate_size, 1 << 20)?;
        within("decoder_sparse_step", self.decoder_sparse_step, 1024)?;
        if let Some(size) = self.shared_expert_intermediate_size {
            within("shared_expert_intermediate_size", size, 1 << 20)?;
        }
        Ok(())
    }
}

/// One projection of every expert: `[experts, out, in]` weights, and a bias `[experts, out]`
/// per expert where the model has them (gpt-oss).
#[derive(Clone)]
struct SwitchLinear {
    weight: SwitchWeight,
    bias: Option<Array>,
}

/// Dense or MLX-quantized expert weights (packed `[experts, out, in * bits / 32]`, scales and,
/// affine only, biases `[experts, out, in / group_size]`). Quantized experts stay quantized on
/// every backend (a dense copy of all experts would take 4–8× the memory of the whole quantized
/// model).
#[derive(Clone)]
enum SwitchWeight {
    Dense(Array),
    Quantized {
        weight: Array,
        scales: Array,
        biases: Option<Array>,
        params: QuantParams,
    },
}

impl SwitchLinear {
    fn dense(weight: Array) -> Self {
        Self {
            weight: SwitchWeight::Dense(weight),
            bias: None,
        }
    }

    /// A dense layer's quantized `{path}.*` (`[out, in]` weights, `params`) as `pieces` experts:
    /// its output rows cut in `pieces` consecutive runs (`split_input` false: `[pieces, out /
    /// pieces, ...]`) or its input features (`split_input`: `[pieces, out, ...]`, a run of `in /
    /// pieces` features each, which must hold whole groups and whole packed words).
    fn load_pieces(
        weights: &mut Weights,
        (path, params): (&str, QuantParams),
        (in_features, out_features): (i32, i32),
        (pieces, split_input): (i32, bool),
    ) -> Result<Self> {
        let packed = in_features * params.bits / 32;
        let groups = in_features / params.group_size;
        let cut = |weights: &mut Weights, part: &str, last: i32| -> Result<Array> {
            let name = format!("{path}.{part}");
            let whole = weights.take_shaped(&name, &[out_features, last])?;
            let cut = match split_input {
                false => whole.reshape(&[pieces, out_features / pieces, last])?,
                true => whole
                    .reshape(&[out_features, pieces, last / pieces])?
                    .swap_axes(0, 1)?,
            };
            let cut = cut.contiguous()?;
            cut.eval()?;
            // Read whole by the cut: not held for part reads ([`crate::nn::part_reads`]).
            crate::nn::part_reads::read_whole(&[&whole])?;
            Ok(cut)
        };
        let scales = cut(weights, "scales", groups)?;
        params.check_scales(&format!("{path}.scales"), &scales)?;
        Ok(Self {
            weight: SwitchWeight::Quantized {
                weight: cut(weights, "weight", packed)?,
                scales,
                biases: params
                    .mode
                    .has_biases()
                    .then(|| cut(weights, "biases", groups))
                    .transpose()?,
                params,
            },
            bias: None,
        })
    }

    /// These experts followed by `more`'s (`[experts + more, ...]`), both quantized alike and
    /// without biases; evaluated here.
    fn append_experts(self, more: Self) -> Result<Self> {
        let quantized = matches!(self.weight, SwitchWeight::Quantized { .. });
        if quantized && self.bias.is_none() && more.bias.is_none() {
            if let Some(weight) = self.weight.join(&more.weight, 0)? {
                return Ok(Self { weight, bias: None });
            }
        }
        Err(crate::error::EngineError::Kernel(
            "experts appended to a stack must be quantized as it is".into(),
        ))
    }

    /// Loads `{path}.weight` (and `.scales`/`.biases` when quantized), or stacks Hugging Face's
    /// per-expert `{experts_path}.{e}.{name}.weight` tensors when the stacked one is absent;
    /// with `bias`, `{path}.bias` too.
    fn load(
        weights: &mut Weights,
        quantization: &Quantization,
        (path, experts_path, name): (&str, &str, &str),
        experts: i32,
        (in_features, out_features): (i32, i32),
        bias: bool,
    ) -> Result<Self> {
        let path = format!("{path}.{name}");
        let bias = bias
            .then(|| weights.take_shaped(&format!("{path}.bias"), &[experts, out_features]))
            .transpose()?;
        if let Some(params) = quantization.for_module(&path, weights) {
            let packed = in_features * params.bits / 32;
            let groups = in_features / params.group_size;
            let take = |weights: &mut Weights, part: &str, last: i32| {
                weights.take_shaped(&format!("{path}.{part}"), &[experts, out_features, last])
            };
            let scales = take(weights, "scales", groups)?;
            params.check_scales(&format!("{path}.scales"), &scales)?;
            return Ok(Self {
                weight: SwitchWeight::Quantized {
                    weight: take(weights, "weight", packed)?,
                    scales,
                    biases: params
                        .mode
                        .has_biases()
                        .then(|| take(weights, "biases", groups))
                        .transpose()?,
                    params,
                },
                bias,
            });
        }
        let stacked = format!("{path}.weight");
        if weights.contains(&stacked)
            || !weights.contains(&format!("{experts_path}.0.{name}.weight"))
        {
            return Ok(Self {
                weight: SwitchWeight::Dense(
                    weights.take_shaped(&stacked, &[experts, out_features, in_features])?,
                ),
                bias,
            });
        }
        let parts = (0..experts)
            .map(|e| {
                weights.take_shaped(
                    &format!("{experts_path}.{e}.{name}.weight"),
                    &[out_features, in_features],
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let weight = ops::stack(&parts, 0)?;
        weight.eval()?;
        // Read whole by the stack: not held for part reads ([`crate::nn::part_reads`]).
        crate::nn::part_reads::read_whole(&parts.iter().collect::<Vec<_>>())?;
        Ok(Self {
            weight: SwitchWeight::Dense(weight),
            bias,
        })
    }

    /// `x` `[..., rows, in]` times the transposed weights of expert `indices[...]` (broadcast
    /// against `x`'s leading axes), plus that expert's bias → `[..., rows, out]`. `sorted`:
    /// `indices` are in ascending order (MLX then reads each expert's weights once).
    /// `kernel`: quantized products of a decode step's few pairs (at most this many) go through
    /// Perch's CUDA kernel ([`expert_kernel::gather_qmv`]) where it takes them.
    fn forward(
        &self,
        x: &Array,
        indices: &Array,
        sorted: bool,
        kernel: Option<usize>,
    ) -> Result<Array> {
        if let Some(max_pairs) = kernel {
            let plain = expert_kernel::Epilogue::Plain;
            if let Some(y) = self.through_kernel(x, indices, (plain, false), max_pairs)? {
                return Ok(y);
            }
        }
        let y = match &self.weight {
            SwitchWeight::Dense(weight) => {
                ops::gather_mm(x, weight.swap_axes(-1, -2)?, None, indices, sorted)?
            }
            SwitchWeight::Quantized {
                weight,
                scales,
                biases,
                params,
            } => crate::nn::mlx_ext::gather_qmm(
                x,
                weight,
                scales,
                biases.as_ref(),
                indices,
                params.sizes(),
                params.mode.mlx_name(),
                sorted,
            )?,
        };
        self.with_bias(y, indices)
    }

    /// `y` plus the bias of expert `indices[...]` for each row, where the experts have biases.
    fn with_bias(&self, y: Array, indices: &Array) -> Result<Array> {
        Ok(match &self.bias {
            Some(bias) => ops::add(&y, &bias.take_axis(indices, 0)?.expand_dims(-2)?)?,
            None => y,
        })
    }

    /// [`SwitchLinear::forward`] of pairs sorted by expert, `x` `[pairs, 1, in]` and `indices`
    /// `[pairs]` ascending, as one grouped product: quantized weights are dequantized into
    /// `x`'s dtype first (the whole stack, `[experts, out, in]`, for this call), then MLX's
    /// `gather_mm` with sorted indices multiplies each expert's run of rows by its matrix (on
    /// CUDA a grouped GEMM, CUTLASS's, reading each expert's weights once; MLX 0.32's
    /// `gather_qmm` reads them once a pair there, [`SwitchGlu::groups`]).
    fn forward_grouped(&self, x: &Array, indices: &Array) -> Result<Array> {
        let weight = match &self.weight {
            SwitchWeight::Dense(weight) => weight.clone(),
            SwitchWeight::Quantized {
                weight,
                scales,
                biases,
                params,
            } => crate::nn::mlx_ext::dequantize(
                weight,
                scales,
                biases.as_ref(),
                params.sizes(),
                params.mode.mlx_name(),
                Some(x.dtype()),
            )?,
        };
        let y = ops::gather_mm(x, weight.swap_axes(-1, -2)?, None, indices, true)?;
        self.with_bias(y, indices)
    }

    /// Experts in the stack and the bytes [`SwitchLinear::forward_grouped`] makes for it: a
    /// quantized stack's dense matrices in `dtype`, nothing for a dense one (used as it is).
    fn dense_size(&self, dtype: mlx_rs::Dtype) -> (usize, usize) {
        let experts = |shape: &[i32]| shape.first().map_or(0, |&e| e.max(0) as usize);
        let (weight, bits) = match &self.weight {
            SwitchWeight::Dense(weight) => return (experts(weight.shape()), 0),
            SwitchWeight::Quantized { weight, params, .. } => (weight, params.bits.max(1)),
        };
        // 32 / bits values a packed word.
        let stored: usize = weight.shape().iter().map(|&d| d.max(0) as usize).product();
        let values = stored * 32 / bits as usize;
        let item = match dtype {
            mlx_rs::Dtype::Float64 => 8,
            mlx_rs::Dtype::Float32 => 4,
            _ => 2,
        };
        (experts(weight.shape()), values * item)
    }

    /// The product, bias and `epilogue` in one launch of [`expert_kernel::gather_qmv`], when the
    /// weights are quantized, the pairs at most `max_pairs` ([`SwitchGlu::max_pairs`]) and the
    /// kernel takes the operands; `None` otherwise. `per_token`: `x` is `[tokens..., in]`, a
    /// row per token ([`expert_kernel::Operands::per_token`]).
    fn through_kernel(
        &self,
        x: &Array,
        indices: &Array,
        (epilogue, per_token): (expert_kernel::Epilogue, bool),
        max_pairs: usize,
    ) -> Result<Option<Array>> {
        let SwitchWeight::Quantized {
            weight,
            scales,
            biases,
            params,
        } = &self.weight
        else {
            return Ok(None);
        };
        let operands = expert_kernel::Operands {
            x,
            weight,
            scales,
            biases: biases.as_ref(),
            indices,
            params: *params,
            bias: self.bias.as_ref(),
            epilogue,
            per_token,
        };
        if indices.size() > max_pairs || operands.x_per_row().is_none() {
            return Ok(None);
        }
        Ok(Some(expert_kernel::gather_qmv(&operands)?))
    }
}

impl SwitchLinear {
    /// Every expert's part for rank `rank` of `size` (see [`Shard`]): the rows of its weight and
    /// bias (`Outputs`, in `segments` side by side: a fused gate and up), or its input features
    /// (`Inputs`, in whole quantization groups), its bias then on rank 0 alone so that the ranks'
    /// sum holds it once. Copied and evaluated, as [`Linear::shard`].
    fn shard(
        &self,
        shard: Shard,
        segments: Option<&[i32]>,
        rank: usize,
        size: usize,
    ) -> Result<Self> {
        let [experts, outputs, inputs] = self.weight.shape();
        let (axis, divided) = match shard {
            Shard::Outputs => (1, outputs),
            Shard::Inputs => (2, inputs),
        };
        let fail = |why: String| {
            EngineError::Distributed(format!(
                "{experts} experts of {inputs} inputs and {outputs} outputs cannot be divided by \
                 their {} over {size} ranks: {why}",
                shard
            ))
        };
        let parts =
            ShardParts::new(segments.unwrap_or(&[divided]), divided, rank, size).map_err(fail)?;
        let weight = match &self.weight {
            SwitchWeight::Dense(w) => SwitchWeight::Dense(parts.take(w, axis, (1, 1))?),
            SwitchWeight::Quantized {
                weight,
                scales,
                biases,
                params,
            } => {
                let (words, groups) = parts.quantized_units(shard, *params).map_err(fail)?;
                SwitchWeight::Quantized {
                    weight: parts.take(weight, axis, words)?,
                    scales: parts.take(scales, axis, groups)?,
                    biases: biases
                        .as_ref()
                        .map(|b| parts.take(b, axis, groups))
                        .transpose()?,
                    params: *params,
                }
            }
        };
        let bias = match (shard, &self.bias) {
            (Shard::Outputs, Some(bias)) => Some(parts.take(bias, 1, (1, 1))?),
            (Shard::Inputs, Some(bias)) if rank == 0 => Some(bias.clone()),
            _ => None,
        };
        Ok(Self { weight, bias })
    }

    /// One projection computing `gate`'s and `up`'s outputs side by side (`[..., 2 * out]`),
    /// their weights (scales, quantization biases, biases) stacked along the output axis, when
    /// both are dense in one dtype or quantized with the same parameters, each with a bias or
    /// neither; otherwise both back. Evaluated here, so the parts' memory is freed as they drop.
    fn fuse(gate: Self, up: Self) -> Result<std::result::Result<Self, (Self, Self)>> {
        // Unread experts (a divided model's layer being built) are fused once divided.
        if gate.weight.is_unread() || up.weight.is_unread() {
            return Ok(Err((gate, up)));
        }
        let Some(weight) = gate.weight.join(&up.weight, 1)? else {
            return Ok(Err((gate, up)));
        };
        let bias = match (&gate.bias, &up.bias) {
            (None, None) => None,
            (Some(a), Some(b)) => Some(joined(a, b, 1)?),
            _ => return Ok(Err((gate, up))),
        };
        Ok(Ok(Self { weight, bias }))
    }
}

impl SwitchWeight {
    /// Whether its weight is a divided model's tensor not read yet ([`crate::nn::part_reads`]).
    fn is_unread(&self) -> bool {
        match self {
            SwitchWeight::Dense(weight) | SwitchWeight::Quantized { weight, .. } => {
                crate::nn::part_reads::is_unread(weight)
            }
        }
    }

    /// `[experts, out, in]` (a quantized weight's `in` from its scales' groups).
    fn shape(&self) -> [i32; 3] {
        match self {
            SwitchWeight::Dense(w) => [w.shape()[0], w.shape()[1], w.shape()[2]],
            SwitchWeight::Quantized { scales, params, .. } => {
                let s = scales.shape();
                [s[0], s[1], s[2] * params.group_size]
            }
        }
    }

    /// `self` and `other` joined along `axis` (the weights, and the scales and quantization
    /// biases alike), evaluated, when both are dense in one dtype or quantized with the same
    /// parameters, scales of one dtype and biases alike; `None` otherwise.
    fn join(&self, other: &Self, axis: i32) -> Result<Option<Self>> {
        Ok(Some(match (self, other) {
            (SwitchWeight::Dense(a), SwitchWeight::Dense(b)) if a.dtype() == b.dtype() => {
                SwitchWeight::Dense(joined(a, b, axis)?)
            }
            (
                SwitchWeight::Quantized {
                    weight: wa,
                    scales: sa,
                    biases: ba,
                    params: pa,
                },
                SwitchWeight::Quantized {
                    weight: wb,
                    scales: sb,
                    biases: bb,
                    params: pb,
                },
            ) if pa == pb && sa.dtype() == sb.dtype() && ba.is_some() == bb.is_some() => {
                SwitchWeight::Quantized {
                    weight: joined(wa, wb, axis)?,
                    scales: joined(sa, sb, axis)?,
                    biases: match (ba, bb) {
                        (Some(a), Some(b)) => Some(joined(a, b, axis)?),
                        _ => None,
                    },
                    params: *pa,
                }
            }
            _ => return Ok(None),
        }))
    }
}

/// `a` and `b` concatenated along `axis`, evaluated (so the parts' memory is freed as they drop).
fn joined(a: &Array, b: &Array, axis: i32) -> Result<Array> {
    let both = ops::concatenate(&[a, b], axis)?;
    both.eval()?;
    // Read whole by the join: not held for part reads ([`crate::nn::part_reads`]).
    crate::nn::part_reads::read_whole(&[a, b])?;
    Ok(both)
}

/// Every expert's gated MLP (mlx_lm's `SwitchGLU`): SwiGLU, or GeGLU for Gemma 4.
#[derive(Clone)]
struct SwitchGlu {
    gate_up: GateUp,
    down_proj: SwitchLinear,
    activation: Activation,
    /// Whether the (token, expert) pairs are sorted by expert when many tokens route
    /// ([`SwitchGlu::sorting_pays`]).
    sort: bool,
    /// Whether a prompt pass with many pairs an expert runs them as grouped products
    /// ([`SwitchGlu::groups`]).
    grouped: bool,
    /// Whether a decode step's quantized products go through [`expert_kernel::gather_qmv`]
    /// (CUDA, once its load check has passed).
    kernel: bool,
    /// Whether, with `kernel`, the router, the activation and the weighted sum run inside
    /// Perch's kernels too ([`expert_kernel::route`], [`expert_kernel::Epilogue`]);
    /// `PERCH_EXPERT_EPILOGUES=0` keeps them in MLX's operations (benchmarks).
    fused: bool,
    /// The last experts of the stacks that are a folded shared expert's pieces, which every
    /// token takes (0 when none; see the module's doc).
    shared_pieces: i32,
}

/// The experts' gate and up projections: separate, or one product of twice the width where
/// [`crate::nn::layers::fused_projections`] says so (GPUs: one gather kernel fewer a layer).
#[derive(Clone)]
enum GateUp {
    Separate {
        gate: SwitchLinear,
        up: SwitchLinear,
    },
    Fused(SwitchLinear),
}

impl GateUp {
    /// `gate` and `up`, fused where [`SwitchGlu::fuses_gate_up`] says and they can be.
    fn of(gate: SwitchLinear, up: SwitchLinear) -> Result<Self> {
        Ok(match SwitchGlu::fuses_gate_up() {
            true => match SwitchLinear::fuse(gate, up)? {
                Ok(fused) => GateUp::Fused(fused),
                Err((gate, up)) => GateUp::Separate { gate, up },
            },
            false => GateUp::Separate { gate, up },
        })
    }
}

impl SwitchGlu {
    fn new(
        gate: SwitchLinear,
        up: SwitchLinear,
        down_proj: SwitchLinear,
        activation: Activation,
    ) -> Result<Self> {
        let gate_up = GateUp::of(gate, up)?;
        let sort = Self::sorting_pays(&gate_up, &down_proj);
        let grouped = Self::grouping_pays(&gate_up, &down_proj);
        let kernel = expert_kernel::usable();
        Ok(Self {
            gate_up,
            down_proj,
            activation,
            sort,
            grouped,
            kernel,
            fused: kernel && Self::epilogues_in_kernels(),
            shared_pieces: 0,
        })
    }

    /// Rank `rank`'s part of `size`: every expert's intermediate features divided (mlx_lm's
    /// `SwitchGLU` sharding), the gate and up projections by outputs, the down projection by
    /// inputs; its output is a partial sum of the experts' whole output.
    fn shard(&self, rank: usize, size: usize) -> Result<Self> {
        let gate_up = match &self.gate_up {
            // Fused as at load (parts read unfused are fused once divided).
            GateUp::Separate { gate, up } => GateUp::of(
                gate.shard(Shard::Outputs, None, rank, size)?,
                up.shard(Shard::Outputs, None, rank, size)?,
            )?,
            GateUp::Fused(both) => {
                let half = both.weight.shape()[1] / 2;
                GateUp::Fused(both.shard(Shard::Outputs, Some(&[half, half]), rank, size)?)
            }
        };
        Ok(Self {
            gate_up,
            down_proj: self.down_proj.shard(Shard::Inputs, None, rank, size)?,
            ..self.clone()
        })
    }

    /// The most pairs a step of `indices` `[..., k]` sends to Perch's kernel: up to
    /// [`expert_kernel::MAX_PAIRS`] routed pairs, and a folded shared expert's pieces for each of
    /// their tokens.
    fn max_pairs(&self, indices: &Array) -> usize {
        let k = indices.shape().last().map_or(1, |&k| k.max(1) as usize);
        let routed = k.saturating_sub(self.shared_pieces as usize).max(1);
        expert_kernel::MAX_PAIRS / routed * k
    }

    /// Whether the router, the activation and the weighted sum run in Perch's kernels (see
    /// [`SwitchGlu::fused`]), as far as the environment says.
    fn epilogues_in_kernels() -> bool {
        std::env::var("PERCH_EXPERT_EPILOGUES").as_deref() != Ok("0")
    }

    /// Whether the gate and up projections are fused at load where they can be
    /// ([`crate::nn::layers::fused_projections`]); `PERCH_FUSED_EXPERTS=0` keeps them apart
    /// (benchmarks).
    fn fuses_gate_up() -> bool {
        crate::nn::layers::fused_projections()
            && std::env::var("PERCH_FUSED_EXPERTS").as_deref() != Ok("0")
    }

    /// Whether a decode step's experts run as the three launches of Perch's kernels (router,
    /// gated product, weighted product): CUDA with the kernels' load check passed, the gate and
    /// up projections fused and the epilogues in the kernels.
    fn three_launches() -> bool {
        expert_kernel::usable() && Self::epilogues_in_kernels() && Self::fuses_gate_up()
    }

    /// Tokens at or above which the (token, expert) pairs are sorted by expert before the
    /// products (mlx_lm's `indices.size >= 64`).
    const SORT_FROM: usize = 64;

    /// Whether sorting the (token, expert) pairs by expert helps the products: on Metal and the
    /// CPU MLX then reads each expert's weights once (`gather_qmm_rhs`, `gather_mm_rhs`); MLX
    /// 0.32's CUDA `gather_qmm` ignores the order, so there the sort and unsort are only more
    /// kernels to launch. `PERCH_MOE_SORT=1` or `=0` overrides (benchmarks).
    fn sorting_pays(gate_up: &GateUp, down_proj: &SwitchLinear) -> bool {
        match std::env::var("PERCH_MOE_SORT").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => !Self::quantized_on_cuda(gate_up, down_proj),
        }
    }

    /// Whether every projection is quantized and MLX runs on CUDA: where its `gather_qmm`
    /// reads an expert's weights once a pair whatever the pairs' order.
    fn quantized_on_cuda(gate_up: &GateUp, down_proj: &SwitchLinear) -> bool {
        let quantized = |l: &SwitchLinear| matches!(l.weight, SwitchWeight::Quantized { .. });
        let all_quantized = quantized(down_proj)
            && match gate_up {
                GateUp::Separate { gate, up } => quantized(gate) && quantized(up),
                GateUp::Fused(both) => quantized(both),
            };
        all_quantized && crate::device::Backend::current() == crate::device::Backend::Cuda
    }

    /// Whether prompt passes with many pairs an expert run them as grouped products
    /// ([`SwitchGlu::groups`]): where sorting alone does not pay (quantized experts on CUDA).
    /// `PERCH_MOE_GROUPED=1` or `=0` overrides (benchmarks).
    fn grouping_pays(gate_up: &GateUp, down_proj: &SwitchLinear) -> bool {
        match std::env::var("PERCH_MOE_GROUPED").as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => Self::quantized_on_cuda(gate_up, down_proj),
        }
    }

    /// Pairs an expert, on average, from which a prompt pass's products are grouped. From the
    /// bytes each way at 4 bits: dequantizing a stack reads its packed bytes and writes and reads
    /// back 16-bit values, about 9 times the packed bytes, where the per-pair products read the
    /// packed stack once a pair (mostly from L2). The boundary itself is not measured; prompt
    /// passes of 8 prompts of 128 tokens (128 pairs an expert on `qwen3_moe`'s shape) are
    /// (docs/benchmarks.md).
    const GROUP_PAIRS_PER_EXPERT: usize = 8;

    /// The most bytes one projection's stack may take dequantized for a grouped product (it
    /// lives for that product only): larger stacks keep MLX's `gather_qmm`.
    const GROUP_MAX_BYTES: usize = 1 << 30;

    /// Whether the pairs of `indices` `[batch, seq, k]` for `x`'s dtype `dtype` run as grouped
    /// products ([`SwitchLinear::forward_grouped`]): with `grouped`, in a pass of more than one
    /// token a row (never a decode step), with more pairs than Perch's kernel takes where it
    /// runs ([`SwitchGlu::max_pairs`]: so a speculative step's verify pass of a few tokens a row
    /// stays in the kernel, as decode does), at least [`SwitchGlu::GROUP_PAIRS_PER_EXPERT`] pairs
    /// an expert and each stack at most [`SwitchGlu::GROUP_MAX_BYTES`] dequantized (on the CPU,
    /// float32 only).
    fn groups(&self, indices: &Array, dtype: mlx_rs::Dtype) -> bool {
        let shape = indices.shape();
        if !self.grouped || shape.len() != 3 || shape[1] < 2 {
            return false;
        }
        if self.kernel && indices.size() <= self.max_pairs(indices) {
            return false;
        }
        // MLX's CPU `gather_mm` takes float32 only.
        let cpu = crate::device::Backend::current() == crate::device::Backend::Cpu;
        if cpu && dtype != mlx_rs::Dtype::Float32 {
            return false;
        }
        let stacks = match &self.gate_up {
            GateUp::Separate { gate, up } => vec![gate, up, &self.down_proj],
            GateUp::Fused(both) => vec![both, &self.down_proj],
        };
        stacks.iter().all(|stack| {
            let (experts, bytes) = stack.dense_size(dtype);
            indices.size() >= Self::GROUP_PAIRS_PER_EXPERT * experts
                && bytes <= Self::GROUP_MAX_BYTES
        })
    }

    /// `x` `[batch, seq, hidden]`, `indices` and `scores` `[batch, seq, k]` → `[batch, seq,
    /// hidden]`: each token through each of its k experts, summed with its weights; the sum in
    /// the experts' dtype with `keep_dtype` (mlx_lm's `.astype(y.dtype)` of Qwen and gpt-oss),
    /// else in the promoted one (Gemma 4). Perch's kernels give `x`'s dtype.
    fn forward_weighted(
        &self,
        x: &Array,
        indices: &Array,
        scores: &Array,
        keep_dtype: bool,
    ) -> Result<Array> {
        let order = self.sorts(indices, x.dtype());
        if !order.0 {
            if let Some(y) = self.through_kernels(x, indices, scores, keep_dtype)? {
                return Ok(y);
            }
        }
        weighted_sum(&self.forward(x, indices, order)?, scores, keep_dtype)
    }

    /// At decode on CUDA: the fused gate and up product with the activation in one launch, the
    /// down product with the weighted sum in another ([`expert_kernel::Epilogue`]); `None`
    /// where the kernel is off or the projections are not fused and quantized (never called for
    /// sorted pairs).
    fn through_kernels(
        &self,
        x: &Array,
        indices: &Array,
        scores: &Array,
        keep_dtype: bool,
    ) -> Result<Option<Array>> {
        let GateUp::Fused(gate_up) = &self.gate_up else {
            return Ok(None);
        };
        if !self.fused {
            return Ok(None);
        }
        // [batch, seq, hidden]: one row per token, read for each of its experts.
        let max_pairs = self.max_pairs(indices);
        let gated = expert_kernel::Epilogue::Gated(self.activation);
        let Some(h) = gate_up.through_kernel(x, indices, (gated, true), max_pairs)? else {
            return Ok(None);
        };
        let weighted = expert_kernel::Epilogue::Weighted(scores);
        if let Some(y) = self
            .down_proj
            .through_kernel(&h, indices, (weighted, false), max_pairs)?
        {
            return Ok(Some(y));
        }
        let y = self
            .down_proj
            .forward(&h, indices, false, Some(max_pairs))?;
        Ok(Some(weighted_sum(
            &y.squeeze_axes(&[-2])?,
            scores,
            keep_dtype,
        )?))
    }

    /// Whether the pairs of `indices` for `x`'s dtype `dtype` are sorted by expert, and whether
    /// they are multiplied as grouped products ([`SwitchGlu::groups`], sorted too).
    fn sorts(&self, indices: &Array, dtype: mlx_rs::Dtype) -> (bool, bool) {
        let grouped = self.groups(indices, dtype);
        (
            grouped || (self.sort && indices.size() >= Self::SORT_FROM),
            grouped,
        )
    }

    /// `x` `[batch, seq, hidden]`, `indices` `[batch, seq, k]` → `[batch, seq, k, hidden]`:
    /// each token through each of its k experts, the pairs sorted and grouped as `(sort,
    /// grouped)` say ([`SwitchGlu::sorts`]).
    fn forward(&self, x: &Array, indices: &Array, (sort, grouped): (bool, bool)) -> Result<Array> {
        let s = indices.shape().to_vec();
        let k = s[2];
        // [batch, seq, 1, 1, hidden]: one row per token, broadcast over its experts.
        let x = x.expand_dims_axes(&[-2, -3])?;
        let (x, idx, inverse) = if sort {
            // Pairs in expert order: row t * k + j of the flat pairs is token t's j-th expert.
            let flat = indices.flatten(None, None)?;
            let order = ops::argsort_axis(&flat, 0)?;
            let inverse = ops::argsort_axis(&order, 0)?;
            let hidden = x.shape()[4];
            let rows = x.reshape(&[-1, 1, hidden])?;
            let token_of = ops::floor_divide(&order, Array::from_int(k))?;
            (
                rows.take_axis(&token_of, 0)?,
                flat.take_axis(&order, 0)?,
                Some(inverse),
            )
        } else {
            (x, indices.clone(), None)
        };
        let kernel = (self.kernel && !grouped).then(|| self.max_pairs(indices));
        let product = |linear: &SwitchLinear, x: &Array| match grouped {
            true => linear.forward_grouped(x, &idx),
            false => linear.forward(x, &idx, sort, kernel),
        };
        let (gate, up) = match &self.gate_up {
            GateUp::Separate { gate, up } => (product(gate, &x)?, product(up, &x)?),
            GateUp::Fused(both) => crate::nn::layers::halves(&product(both, &x)?)?,
        };
        let h = self.activation.gated(&gate, &up)?;
        let out = product(&self.down_proj, &h)?;
        let out = match inverse {
            Some(inverse) => {
                let hidden = out.shape()[2];
                out.take_axis(&inverse, 0)?
                    .reshape(&[s[0], s[1], k, 1, hidden])?
            }
            None => out,
        };
        Ok(out.squeeze_axes(&[-2])?)
    }
}

/// A sparse feed-forward block: router, top-k experts, weighted sum (plus the gated shared
/// expert, when there is one).
#[derive(Clone)]
pub struct SparseMoe {
    gate: Linear,
    switch_mlp: SwitchGlu,
    top_k: i32,
    norm_topk_prob: bool,
    shared: Option<SharedExpert>,
    /// The shared expert's pieces folded into `switch_mlp`'s stacks (experts `num_experts ..
    /// num_experts + folded_shared`), its gate's row the last of `gate`'s; 0 when there is
    /// none or it runs as `shared` (see the module's doc).
    folded_shared: i32,
    /// [`MoeStyle::Qwen`] or [`MoeStyle::GptOss`]: how the router's scores become weights.
    style: MoeStyle,
}

/// Qwen3-Next's shared expert: a SwiGLU MLP and its scalar gate `Linear(hidden, 1)`.
#[derive(Clone)]
struct SharedExpert {
    mlp: Mlp,
    gate: Linear,
}

impl SparseMoe {
    /// The block at `path` (`…mlp`): `{path}.gate` (the router) and `{path}.switch_mlp.*`;
    /// gpt-oss's `{path}.router` and `{path}.experts.*`, with biases. A shared expert is folded
    /// into the experts where their decode runs in Perch's kernels and it can be
    /// ([`SparseMoe::folds_shared`]); `PERCH_FOLD_SHARED_EXPERT=0` keeps it apart (benchmarks).
    pub fn load(
        weights: &mut Weights,
        quantization: &Quantization,
        path: &str,
        hidden: i32,
        c: &MoeConfig,
    ) -> Result<Self> {
        let fold = SwitchGlu::three_launches()
            && std::env::var("PERCH_FOLD_SHARED_EXPERT").as_deref() != Ok("0");
        Self::load_folding(weights, quantization, (path, hidden), c, fold)
    }

    /// [`SparseMoe::load`], folding a shared expert when `fold` and it can be.
    fn load_folding(
        weights: &mut Weights,
        quantization: &Quantization,
        (path, hidden): (&str, i32),
        c: &MoeConfig,
        fold: bool,
    ) -> Result<Self> {
        let gpt_oss = c.style == MoeStyle::GptOss;
        // Every rank keeps the router whole.
        let gate = Linear::load_whole(
            weights,
            quantization,
            &format!("{path}.{}", if gpt_oss { "router" } else { "gate" }),
            hidden,
            c.num_experts,
            gpt_oss,
        )?;
        let experts = format!("{path}.experts");
        let switch = if gpt_oss {
            experts.clone()
        } else {
            format!("{path}.switch_mlp")
        };
        let proj = |weights: &mut Weights, name: &str, i: i32, o: i32| {
            SwitchLinear::load(
                weights,
                quantization,
                (&switch, &experts, name),
                c.num_experts,
                (i, o),
                gpt_oss,
            )
        };
        let (h, m) = (hidden, c.intermediate_size);
        let shared_path = format!("{path}.shared_expert");
        // Asked before the experts' tensors are taken.
        let pieces = match fold {
            true => Self::folds_shared(weights, quantization, (&switch, &shared_path), (hidden, c)),
            false => None,
        };
        let (mut gate_proj, mut up_proj, mut down_proj) = (
            proj(weights, "gate_proj", h, m)?,
            proj(weights, "up_proj", h, m)?,
            proj(weights, "down_proj", m, h)?,
        );
        let (mut gate, mut shared, mut folded_shared) = (gate, None, 0);
        if let Some(size) = c.shared_expert_intermediate_size {
            let shared_gate = Linear::load_whole(
                weights,
                quantization,
                &format!("{path}.shared_expert_gate"),
                hidden,
                1,
                false,
            )?;
            // The router and the shared expert's gate as one product, `[experts + 1, hidden]`.
            let folding = match pieces {
                Some(pieces) => Linear::fuse([gate, shared_gate])?.map(|both| (both, pieces)),
                None => Err([gate, shared_gate]),
            };
            match folding {
                Ok((both, (params, pieces))) => {
                    let piece = |weights: &mut Weights, name: &str, (i, o), split_input| {
                        SwitchLinear::load_pieces(
                            weights,
                            (&format!("{shared_path}.{name}"), params),
                            (i, o),
                            (pieces, split_input),
                        )
                    };
                    gate_proj =
                        gate_proj.append_experts(piece(weights, "gate_proj", (h, size), false)?)?;
                    up_proj =
                        up_proj.append_experts(piece(weights, "up_proj", (h, size), false)?)?;
                    down_proj =
                        down_proj.append_experts(piece(weights, "down_proj", (size, h), true)?)?;
                    (gate, folded_shared) = (both, pieces);
                }
                Err([router, shared_gate]) => {
                    gate = router;
                    shared = Some(SharedExpert {
                        mlp: Mlp::load(weights, quantization, &shared_path, hidden, size, false)?,
                        gate: shared_gate,
                    });
                }
            }
        }
        let activation = match gpt_oss {
            true => Activation::SwigluOai,
            false => Activation::Silu,
        };
        let mut switch_mlp = SwitchGlu::new(gate_proj, up_proj, down_proj, activation)?;
        switch_mlp.shared_pieces = folded_shared;
        Ok(Self {
            gate,
            switch_mlp,
            top_k: c.top_k,
            norm_topk_prob: c.norm_topk_prob,
            shared,
            folded_shared,
            style: c.style,
        })
    }

    /// The quantization and the number of pieces of the experts' size when the shared expert at
    /// `shared_path` can be folded into the experts at `switch` (see the module's doc): all
    /// six projections quantized with the same parameters in a format and at sizes Perch's
    /// kernel takes ([`expert_kernel::takes`]), scales (and quantization biases) of one dtype,
    /// the shared expert's as its own `gate_proj`, `up_proj` and `down_proj` tensors, its size a
    /// multiple of the experts' (at most [`expert_kernel::MAX_SHARED`] pieces), the experts'
    /// size a whole number of groups and packed words; `None` otherwise.
    fn folds_shared(
        weights: &Weights,
        quantization: &Quantization,
        (switch, shared_path): (&str, &str),
        (hidden, c): (i32, &MoeConfig),
    ) -> Option<(QuantParams, i32)> {
        let size = c.shared_expert_intermediate_size?;
        let m = c.intermediate_size;
        let params = quantization.for_module(&format!("{switch}.gate_proj"), weights)?;
        let dtype = |path: &str, part: &str| weights.dtype(&format!("{path}.{part}"));
        let first = format!("{switch}.gate_proj");
        let alike = ["gate_proj", "up_proj", "down_proj"].iter().all(|name| {
            [format!("{switch}.{name}"), format!("{shared_path}.{name}")]
                .iter()
                .all(|path| {
                    quantization.for_module(path, weights) == Some(params)
                        && weights.contains(&format!("{path}.weight"))
                        && dtype(path, "scales") == dtype(&first, "scales")
                        && dtype(path, "biases") == dtype(&first, "biases")
                })
        });
        // `takes` of `m` input features: `m` a positive whole number of groups (of 32 or more
        // features, so of packed words too).
        let fits = alike
            && expert_kernel::takes(params, hidden, m)
            && expert_kernel::takes(params, m, hidden)
            && size % m == 0
            && (1..=expert_kernel::MAX_SHARED).contains(&(size / m));
        fits.then(|| (params, size / m))
    }

    /// Every product through MLX's operations (see [`Linear::use_mlx_kernels`]; the experts'
    /// always are).
    pub fn use_mlx_kernels(&mut self) {
        self.gate.use_mlx_kernels();
        if let Some(shared) = &mut self.shared {
            shared.mlp.use_mlx_kernels();
            shared.gate.use_mlx_kernels();
        }
    }

    /// `x` `[batch, seq, hidden]` → `[batch, seq, hidden]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let routed = self.route(x)?;
        self.experts_forward(x, routed)
    }

    /// The block after the residual add and RMS norm before it: `h`, `residual` `[batch, seq,
    /// hidden]` → (`h + residual`, the block's output of its normed sum), where the add, the
    /// norm and the router run in one launch ([`expert_kernel::route_after_add_norm`]: CUDA, at
    /// decode, the router's product in the kernel); `None` elsewhere, and for a norm without a
    /// weight.
    pub fn add_norm_forward(
        &self,
        (h, residual): (&Array, &Array),
        norm: &crate::nn::layers::RmsNorm,
    ) -> Result<Option<(Array, Array)>> {
        let (Some(norm_weight), Some(gate)) = (norm.weight(), self.gate.dense()) else {
            return Ok(None);
        };
        if !self.switch_mlp.fused {
            return Ok(None);
        }
        let Some(((sum, normed), routed)) = expert_kernel::route_after_add_norm(
            (h, residual),
            (norm_weight, norm.eps()),
            gate,
            self.top_k,
            self.normalize(),
            self.folded_shared,
        )?
        else {
            return Ok(None);
        };
        let y = self.experts_forward(&normed, routed)?;
        Ok(Some((sum, y)))
    }

    /// The routed experts of `x` (and the shared expert, when it runs apart).
    fn experts_forward(&self, x: &Array, (indices, scores): (Array, Array)) -> Result<Array> {
        let y = self
            .switch_mlp
            .forward_weighted(x, &indices, &scores, true)?;
        match &self.shared {
            Some(shared) => {
                let weight = ops::sigmoid(&shared.gate.forward(x)?)?;
                Ok(ops::add(
                    &y,
                    &ops::multiply(&weight, &shared.mlp.forward(x)?)?,
                )?)
            }
            None => Ok(y),
        }
    }
}

impl SparseMoe {
    /// Rank `tp.rank()`'s part: every expert's features and the shared expert's divided
    /// ([`SwitchGlu::shard`], [`Mlp::shard`]), the router and the shared expert's gate whole;
    /// its output is a partial sum of the block's.
    pub fn shard(&self, tp: &TensorParallel) -> Result<Self> {
        let (rank, size) = (tp.rank(), tp.size());
        Ok(Self {
            switch_mlp: self.switch_mlp.shard(rank, size)?,
            shared: match &self.shared {
                Some(shared) => Some(SharedExpert {
                    mlp: shared.mlp.shard(rank, size)?,
                    gate: shared.gate.clone(),
                }),
                None => None,
            },
            ..self.clone()
        })
    }
}

impl SparseMoe {
    /// `x` `[batch, seq, hidden]` → each token's top k experts and their weights, `[batch, seq,
    /// k]` each (`k + folded_shared`, the shared expert's pieces last, when folded), from the
    /// router's logits (`gate`). Qwen: a softmax over every expert, then the
    /// top k (renormalised with `norm_topk_prob`); gpt-oss: the top k logits, then their
    /// softmax. On CUDA in one launch ([`expert_kernel::route`]), at decode with the router's
    /// product in it too ([`expert_kernel::route_from_hidden`]).
    fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let normalize = self.normalize();
        let shared = self.folded_shared;
        if self.switch_mlp.fused {
            if let Some(gate) = self.gate.dense() {
                let routed =
                    expert_kernel::route_from_hidden(x, gate, self.top_k, normalize, None, shared)?;
                if let Some(routed) = routed {
                    return Ok(routed);
                }
            }
        }
        let logits = self.gate.forward(x)?;
        if self.switch_mlp.fused {
            let routed = expert_kernel::route(&logits, self.top_k, normalize, None, shared)?;
            if let Some(routed) = routed {
                return Ok(routed);
            }
        }
        let (logits, gate) = expert_kernel::split_shared_gate(&logits, shared)?;
        let routed = self.route_with_ops(&logits)?;
        match gate {
            Some(gate) => {
                let experts = *logits.shape().last().expect("scores");
                Ok(expert_kernel::append_shared(
                    routed,
                    &gate,
                    (experts, shared),
                )?)
            }
            None => Ok(routed),
        }
    }

    /// Over what the router's softmax runs: every expert (Qwen without `norm_topk_prob`) or
    /// the top k.
    fn normalize(&self) -> expert_kernel::Normalize {
        match (self.style, self.norm_topk_prob) {
            (MoeStyle::Qwen, false) => expert_kernel::Normalize::All,
            _ => expert_kernel::Normalize::TopK,
        }
    }

    /// [`SparseMoe::route`] in MLX's operations, from the experts' scores `logits`.
    fn route_with_ops(&self, logits: &Array) -> Result<(Array, Array)> {
        if self.style == MoeStyle::GptOss {
            let (indices, top) = top_k(logits, self.top_k)?;
            return Ok((indices, ops::softmax_axis(&top, -1, true)?));
        }
        let (indices, scores) = top_k(&ops::softmax_axis(logits, -1, true)?, self.top_k)?;
        let scores = match self.norm_topk_prob {
            true => ops::divide(&scores, &scores.sum_axis(-1, true)?)?,
            false => scores,
        };
        Ok((indices, scores))
    }
}

/// Gemma 4's feed-forward part (mlx_lm `gemma4_text.py`, `DecoderLayer` with
/// `enable_moe_block`): the dense MLP on the pre-feed-forward-normed input, normed again
/// (`post_feedforward_layernorm_1`), plus the routed experts on the input normed their own way
/// (`pre_feedforward_layernorm_2`), normed after (`post_feedforward_layernorm_2`). The router
/// reads the un-normed input: an RMSNorm scaled by `scale * hidden^-0.5`, a score per expert
/// (`proj`), the top k scores softmaxed among themselves and each multiplied by its expert's
/// `per_expert_scale`; every expert is a GeGLU MLP.
#[derive(Clone)]
pub struct MlpAndExperts {
    mlp: Mlp,
    post_feedforward_layernorm_1: RmsNorm,
    pre_feedforward_layernorm_2: RmsNorm,
    post_feedforward_layernorm_2: RmsNorm,
    /// The router's input norm, its weight `scale * hidden^-0.5` (in the weight's dtype).
    router_norm: RmsNorm,
    router_proj: Linear,
    /// `[experts]`.
    per_expert_scale: Array,
    experts: SwitchGlu,
    top_k: i32,
}

impl MlpAndExperts {
    /// The layer at `path` (`model.layers.{i}`): `{path}.mlp` (an MLP of `intermediate`
    /// features), its norms, `{path}.router.*` and `{path}.experts.switch_glu.*` (mlx-community's
    /// layout; Hugging Face's stacked `experts.gate_up_proj` / `experts.down_proj` are split as
    /// mlx_lm's `sanitize` does).
    pub fn load(
        weights: &mut Weights,
        quantization: &Quantization,
        path: &str,
        (hidden, intermediate, eps): (i32, i32, f32),
        c: &MoeConfig,
    ) -> Result<Self> {
        let norm = |weights: &mut Weights, name: &str| {
            RmsNorm::load(weights, &format!("{path}.{name}"), hidden, eps)
        };
        let scale = weights.take_shaped(&format!("{path}.router.scale"), &[hidden])?;
        let root = Array::from_f32((hidden as f32).powf(-0.5)).as_dtype(scale.dtype())?;
        let router_weight = ops::multiply(&scale, &root)?;
        router_weight.eval()?;
        let (e, m) = (c.num_experts, c.intermediate_size);
        let switch = format!("{path}.experts.switch_glu");
        let stacked_gate_up = format!("{path}.experts.gate_up_proj");
        let experts = if weights.contains(&stacked_gate_up) {
            let both = weights.take_shaped(&stacked_gate_up, &[e, 2 * m, hidden])?;
            let half = |from: i32| -> Result<SwitchLinear> {
                let part = crate::nn::mlx_ext::slice(&both, &[0, from, 0], &[e, from + m, hidden])?;
                let part = part.contiguous()?;
                part.eval()?;
                Ok(SwitchLinear::dense(part))
            };
            SwitchGlu::new(
                half(0)?,
                half(m)?,
                SwitchLinear::dense(
                    weights.take_shaped(&format!("{path}.experts.down_proj"), &[e, hidden, m])?,
                ),
                Activation::GeluApprox,
            )?
        } else {
            let proj = |weights: &mut Weights, name: &str, i: i32, o: i32| {
                SwitchLinear::load(
                    weights,
                    quantization,
                    (&switch, &switch, name),
                    e,
                    (i, o),
                    false,
                )
            };
            SwitchGlu::new(
                proj(weights, "gate_proj", hidden, m)?,
                proj(weights, "up_proj", hidden, m)?,
                proj(weights, "down_proj", m, hidden)?,
                Activation::GeluApprox,
            )?
        };
        Ok(Self {
            mlp: Mlp::load(
                weights,
                quantization,
                &format!("{path}.mlp"),
                hidden,
                intermediate,
                false,
            )?
            .with_activation(Activation::GeluApprox),
            post_feedforward_layernorm_1: norm(weights, "post_feedforward_layernorm_1")?,
            pre_feedforward_layernorm_2: norm(weights, "pre_feedforward_layernorm_2")?,
            post_feedforward_layernorm_2: norm(weights, "post_feedforward_layernorm_2")?,
            router_norm: RmsNorm::from_weight(router_weight, eps),
            router_proj: Linear::load_whole(
                weights,
                quantization,
                &format!("{path}.router.proj"),
                hidden,
                e,
                false,
            )?,
            per_expert_scale: weights
                .take_shaped(&format!("{path}.router.per_expert_scale"), &[e])?,
            experts,
            top_k: c.top_k,
        })
    }

    /// Every product through MLX's operations (the experts' always are).
    pub fn use_mlx_kernels(&mut self) {
        self.mlp.use_mlx_kernels();
        self.router_proj.use_mlx_kernels();
    }

    /// `normed` (the input after `pre_feedforward_layernorm`) and `x` (before it), both
    /// `[batch, seq, hidden]` → `[batch, seq, hidden]`, before `post_feedforward_layernorm`.
    pub fn forward(&self, normed: &Array, x: &Array) -> Result<Array> {
        let dense = self
            .post_feedforward_layernorm_1
            .forward(&self.mlp.forward(normed)?)?;
        let router_input = self.router_norm.forward(x)?;
        // The kernel scales in the scores' dtype (the router input's); a scale in another one
        // is applied as MLX promotes it.
        let scale = Some(&self.per_expert_scale).filter(|s| s.dtype() == router_input.dtype());
        let normalize = expert_kernel::Normalize::TopK;
        // What a kernel routed, times the experts' scales unless it applied them.
        let scaled = |(indices, weights): (Array, Array)| -> Result<(Array, Array)> {
            match scale {
                Some(_) => Ok((indices, weights)),
                None => {
                    let weights = ops::multiply(&weights, &self.per_expert_scale.take(&indices)?)?;
                    Ok((indices, weights))
                }
            }
        };
        let from_hidden = match (self.experts.fused, self.router_proj.dense()) {
            (true, Some(proj)) => expert_kernel::route_from_hidden(
                &router_input,
                proj,
                self.top_k,
                normalize,
                scale,
                0,
            )?,
            _ => None,
        };
        let (indices, weights) = match from_hidden {
            Some(routed) => scaled(routed)?,
            None => {
                let scores = self.router_proj.forward(&router_input)?;
                let routed = match self.experts.fused {
                    true => expert_kernel::route(&scores, self.top_k, normalize, scale, 0)?,
                    false => None,
                };
                match routed {
                    Some(routed) => scaled(routed)?,
                    None => {
                        let (indices, top) = top_k(&scores, self.top_k)?;
                        let weights = ops::softmax_axis(&top, -1, false)?;
                        let weights =
                            ops::multiply(&weights, &self.per_expert_scale.take(&indices)?)?;
                        (indices, weights)
                    }
                }
            }
        };
        let normed = self.pre_feedforward_layernorm_2.forward(x)?;
        let routed = self
            .experts
            .forward_weighted(&normed, &indices, &weights, false)?;
        let routed = self.post_feedforward_layernorm_2.forward(&routed)?;
        Ok(ops::add(&dense, &routed)?)
    }
}

/// `y` `[..., k, hidden]` summed over its k experts, each times its weight in `scores` `[...,
/// k]`; in `y`'s dtype with `keep_dtype`.
fn weighted_sum(y: &Array, scores: &Array, keep_dtype: bool) -> Result<Array> {
    let sum = ops::multiply(y, &scores.expand_dims(-1)?)?.sum_axis(-2, false)?;
    Ok(match keep_dtype {
        true => sum.as_dtype(y.dtype())?,
        false => sum,
    })
}

/// A sparse block for the device's checks of the experts: `experts` experts of `intermediate`
/// features, `top_k` a token, and (Qwen style) a shared expert of `shared` features over
/// `hidden`, in `dtype`; Qwen-style experts affine 4-bit in groups of `group_size`, gpt-oss-style
/// ones MXFP4 with biases.
#[derive(Clone, Copy)]
struct MoeCase {
    hidden: i32,
    experts: i32,
    top_k: i32,
    intermediate: i32,
    shared: i32,
    group_size: i32,
    dtype: mlx_rs::Dtype,
    style: MoeStyle,
}

impl MoeCase {
    const PATH: &'static str = "model.layers.0.mlp";

    /// A Qwen3.5-MoE-shaped block in bfloat16 (the device's checks): 1,024 features, 64
    /// experts of 256, 8 a token, a shared expert of 512, 4-bit g64.
    const QWEN3_5_MOE: MoeCase = MoeCase {
        hidden: 1024,
        experts: 64,
        top_k: 8,
        intermediate: 256,
        shared: 512,
        group_size: 64,
        dtype: mlx_rs::Dtype::Bfloat16,
        style: MoeStyle::Qwen,
    };

    /// A gpt-oss-shaped block in bfloat16: 1,024 features, 32 experts of 512, 4 a token, MXFP4
    /// experts with biases, a router with a bias.
    const GPT_OSS: MoeCase = MoeCase {
        hidden: 1024,
        experts: 32,
        top_k: 4,
        intermediate: 512,
        shared: 0,
        group_size: 32,
        dtype: mlx_rs::Dtype::Bfloat16,
        style: MoeStyle::GptOss,
    };

    /// `block` with its experts' products grouped or not in passes that group
    /// ([`SwitchGlu::groups`]).
    fn grouped(block: &SparseMoe, grouped: bool) -> SparseMoe {
        let mut block = block.clone();
        block.switch_mlp.grouped = grouped;
        block
    }

    /// The line of a device check named `name` whose largest error is `error`, or an error
    /// outside bfloat16's tolerance.
    fn judged(name: String, error: f32) -> Result<String> {
        let line = format!("{name}: largest error {error:.2e}");
        crate::nn::custom_kernel::judged("experts", line, error, 2e-2)
    }

    fn config(&self) -> MoeConfig {
        MoeConfig {
            num_experts: self.experts,
            top_k: self.top_k,
            intermediate_size: self.intermediate,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![],
            shared_expert_intermediate_size: (self.shared > 0).then_some(self.shared),
            style: self.style,
        }
    }

    fn random(&self, shape: &[i32], seed: u64, scale: f32) -> Result<Array> {
        let key = mlx_rs::random::key(seed)?;
        let x = mlx_rs::random::normal::<f32>(shape, None, None, &key)?;
        Ok(ops::multiply(&x, Array::from_f32(scale))?.as_dtype(self.dtype)?)
    }

    /// The block's tensors: the experts and the shared expert quantized at 4 bits (the shared
    /// down projection at `shared_down_bits`), a dense router and shared gate.
    fn weights(&self, shared_down_bits: i32) -> Result<Weights> {
        let mut weights = Weights::empty(crate::device::Backend::current());
        let (h, e, m, s) = (self.hidden, self.experts, self.intermediate, self.shared);
        let w =
            |shape: &[i32], seed, fan_in: i32| self.random(shape, seed, (fan_in as f32).powf(-0.5));
        let tensors = [
            ("gate", w(&[e, h], 1, h)?, None),
            ("shared_expert_gate", w(&[1, h], 2, h)?, None),
            ("switch_mlp.gate_proj", w(&[e, m, h], 3, h)?, Some(4)),
            ("switch_mlp.up_proj", w(&[e, m, h], 4, h)?, Some(4)),
            ("switch_mlp.down_proj", w(&[e, h, m], 5, m)?, Some(4)),
            ("shared_expert.gate_proj", w(&[s, h], 6, h)?, Some(4)),
            ("shared_expert.up_proj", w(&[s, h], 7, h)?, Some(4)),
            (
                "shared_expert.down_proj",
                w(&[h, s], 8, s)?,
                Some(shared_down_bits),
            ),
        ];
        for (name, tensor, bits) in tensors {
            let name = format!("{}.{name}", Self::PATH);
            match bits {
                Some(bits) => {
                    let (q, scales, biases) = ops::quantize(&tensor, self.group_size, bits)?;
                    weights.insert(&format!("{name}.weight"), q);
                    weights.insert(&format!("{name}.scales"), scales);
                    weights.insert(&format!("{name}.biases"), biases);
                }
                None => weights.insert(&format!("{name}.weight"), tensor),
            }
        }
        Ok(weights)
    }

    /// A gpt-oss block's tensors: a dense router with a bias, and MXFP4 experts (random packed
    /// values, scales between 2^-9 and 2^-5) with biases.
    fn gpt_oss_weights(&self) -> Result<Weights> {
        use mlx_rs::random::{key, randint};
        let mut weights = Weights::empty(crate::device::Backend::current());
        let (h, e, m) = (self.hidden, self.experts, self.intermediate);
        let path = |name: &str| format!("{}.{name}", Self::PATH);
        weights.insert(&path("router.weight"), self.random(&[e, h], 1, 0.03)?);
        weights.insert(&path("router.bias"), self.random(&[e], 2, 0.1)?);
        for (i, (name, out, input)) in [("gate_proj", m, h), ("up_proj", m, h), ("down_proj", h, m)]
            .into_iter()
            .enumerate()
        {
            let seed = 10 * (i as u64 + 1);
            let words = [e, out, input / 8];
            let packed = crate::nn::custom_kernel::random_words(&words, (seed, seed + 1))?;
            let groups = [e, out, input / 32];
            let scales = randint::<_, i32>(118, 123, &groups, Some(&key(seed + 2)?))?
                .as_dtype(mlx_rs::Dtype::Uint8)?;
            let name = path(&format!("experts.{name}"));
            weights.insert(&format!("{name}.weight"), packed);
            weights.insert(&format!("{name}.scales"), scales);
            weights.insert(
                &format!("{name}.bias"),
                self.random(&[e, out], seed + 3, 0.1)?,
            );
        }
        Ok(weights)
    }

    /// The block, its shared expert folded when `fold` and it can be.
    fn load(&self, shared_down_bits: i32, fold: bool) -> Result<SparseMoe> {
        let params = |bits: i32| serde_json::json!({"group_size": self.group_size, "bits": bits});
        let mut quantization = params(4);
        if self.style == MoeStyle::GptOss {
            quantization["mode"] = "mxfp4".into();
        }
        if shared_down_bits != 4 {
            quantization[format!("{}.shared_expert.down_proj", Self::PATH)] =
                params(shared_down_bits);
        }
        let quantization =
            Quantization::from_config(&serde_json::json!({ "quantization": quantization }))
                .map_err(crate::error::EngineError::Kernel)?;
        let mut weights = match self.style {
            MoeStyle::GptOss => self.gpt_oss_weights()?,
            _ => self.weights(shared_down_bits)?,
        };
        let moe = SparseMoe::load_folding(
            &mut weights,
            &quantization,
            (Self::PATH, self.hidden),
            &self.config(),
            fold,
        )?;
        match weights.remaining().is_empty() {
            true => Ok(moe),
            false => Err(crate::error::EngineError::Kernel(format!(
                "tensors left: {:?}",
                weights.remaining()
            ))),
        }
    }

    /// The largest difference of block `got`'s output from block `want`'s (the same weights,
    /// loaded or run another way: the shared expert folded or apart, the products grouped or
    /// not), relative to the largest output, for a random `x` `[rows, tokens, hidden]`.
    fn error(&self, got: &SparseMoe, want: &SparseMoe, (rows, tokens): (i32, i32)) -> Result<f32> {
        let x = self.random(&[rows, tokens, self.hidden], 10 + tokens as u64, 1.0)?;
        let want = want.forward(&x)?.as_dtype(mlx_rs::Dtype::Float32)?;
        let got = got.forward(&x)?.as_dtype(mlx_rs::Dtype::Float32)?;
        let largest =
            |a: &Array| -> Result<f32> { Ok(ops::max(&ops::abs(a)?, None)?.item_exact::<f32>()) };
        Ok(largest(&ops::subtract(&got, &want)?)? / largest(&want)?)
    }
}

/// Checks on the device that a prompt pass's pairs as grouped products (the stacks
/// dequantized, MLX's `gather_mm` over the sorted pairs: [`SwitchLinear::forward_grouped`]) give
/// the block's output through MLX's `gather_qmm`, at 2 × 200 tokens in bfloat16, for a
/// Qwen3.5-MoE-shaped block (affine 4-bit) and a gpt-oss-shaped one (MXFP4, expert biases): one
/// line each, an error outside bfloat16's tolerance. CUDA, where they are the default (`perch
/// check-kernels experts`).
pub fn check_grouped() -> Result<Vec<String>> {
    let (rows, tokens) = (2, 200);
    let mut lines = Vec::new();
    for (name, case) in [
        ("qwen3_5_moe", MoeCase::QWEN3_5_MOE),
        ("gpt_oss", MoeCase::GPT_OSS),
    ] {
        let block = case.load(4, false)?;
        let (grouped, ungrouped) = (
            MoeCase::grouped(&block, true),
            MoeCase::grouped(&block, false),
        );
        let indices = ops::zeros::<i32>(&[rows, tokens, case.top_k])?;
        if !grouped.switch_mlp.groups(&indices, case.dtype) {
            return Err(crate::error::EngineError::Kernel(format!(
                "{name}: a {rows} × {tokens}-token pass was not grouped"
            )));
        }
        let error = case.error(&grouped, &ungrouped, (rows, tokens))?;
        let line = format!("{name} block, grouped products, {rows} × {tokens} tokens");
        lines.push(MoeCase::judged(line, error)?);
    }
    Ok(lines)
}

/// Checks on the device that a Qwen3.5-MoE-shaped block with its shared expert folded into the
/// experts (Perch's router and experts' kernels, see the module's doc) gives the block's output
/// with it apart (its MLP through MLX's dense products), at decode (32 rows) and in a prefill
/// pass (2 × 200 tokens, grouped products): one line per case, an error outside bfloat16's
/// tolerance. CUDA only (`perch check-kernels experts`).
pub fn check_shared_fold() -> Result<Vec<String>> {
    let case = MoeCase::QWEN3_5_MOE;
    let (folded, apart) = (case.load(4, true)?, case.load(4, false)?);
    if !SwitchGlu::three_launches() {
        return Ok(vec![
            "not checked: a folded shared expert (the experts' kernels or their epilogues are \
             off: PERCH_EXPERT_KERNEL, PERCH_EXPERT_EPILOGUES or PERCH_FUSED_EXPERTS)"
                .into(),
        ]);
    }
    if folded.folded_shared != 2 {
        return Err(crate::error::EngineError::Kernel(
            "the qwen3_5_moe-shaped block's shared expert was not folded".into(),
        ));
    }
    let mut lines = Vec::new();
    for (rows, tokens) in [(32, 1), (2, 200)] {
        let error = case.error(&folded, &apart, (rows, tokens))?;
        let name = format!(
            "qwen3_5_moe block, shared expert folded in 2 pieces, {rows} × {tokens} tokens"
        );
        lines.push(MoeCase::judged(name, error)?);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Dtype;

    const CASE: MoeCase = MoeCase {
        hidden: 64,
        experts: 8,
        top_k: 2,
        intermediate: 32,
        shared: 64,
        group_size: 32,
        dtype: Dtype::Float32,
        style: MoeStyle::Qwen,
    };

    /// The shared expert cut into two experts' pieces and routed to every token gives the
    /// block's output with it apart: at decode (a row a token) and in a pass long enough that
    /// the pairs are sorted by expert. A shared expert quantized otherwise than the experts
    /// stays apart.
    #[test]
    fn a_shared_expert_folded_into_the_experts_gives_the_same_output() {
        let (apart, folded) = (CASE.load(4, false).unwrap(), CASE.load(4, true).unwrap());
        assert!(apart.shared.is_some() && apart.folded_shared == 0);
        assert!(folded.shared.is_none() && folded.folded_shared == 2);
        for (rows, tokens) in [(4, 1), (2, 40)] {
            let x = CASE
                .random(&[rows, tokens, CASE.hidden], 10 + tokens as u64, 1.0)
                .unwrap();
            let (indices, weights) = folded.route(&x).unwrap();
            assert_eq!(indices.shape(), [rows, tokens, 4]);
            let indices = indices.as_dtype(Dtype::Int32).unwrap();
            let pieces =
                crate::nn::mlx_ext::slice(&indices, &[0, 0, 2], &[rows, tokens, 4]).unwrap();
            assert_eq!(
                ops::sum(&pieces, None).unwrap().item_exact::<i32>(),
                (8 + 9) * rows * tokens,
                "every token takes experts 8 and 9, the shared expert's pieces"
            );
            let (_, top) = apart.route(&x).unwrap();
            let shared_gate = CASE.random(&[1, CASE.hidden], 2, 0.125).unwrap();
            let gate = ops::sigmoid(ops::matmul(&x, shared_gate.t()).unwrap()).unwrap();
            let expected = ops::concatenate(&[&top, &gate, &gate], -1).unwrap();
            let diff = ops::abs(ops::subtract(&weights, &expected).unwrap()).unwrap();
            assert!(ops::max(&diff, None).unwrap().item_exact::<f32>() < 1e-6);

            let error = CASE.error(&folded, &apart, (rows, tokens)).unwrap();
            assert!(error < 1e-5, "{rows} × {tokens}: relative error {error:e}");
        }
        // The kernel's pairs: 1,024 routed ones, and the pieces of each of their tokens on top.
        let pairs = |moe: &SparseMoe, k| {
            let indices = ops::zeros::<i32>(&[1, 1, k]).unwrap();
            moe.switch_mlp.max_pairs(&indices)
        };
        assert_eq!((pairs(&apart, 2), pairs(&folded, 4)), (1024, 2048));
        let mixed = CASE.load(8, true).unwrap();
        assert!(mixed.shared.is_some() && mixed.folded_shared == 0);
    }

    /// gpt-oss's experts as grouped products (MXFP4 stacks dequantized, their biases, the
    /// clamped SwiGLU) give the block's output through `gather_qmm`.
    #[test]
    fn grouped_mxfp4_products_give_the_experts_output() {
        let case = MoeCase {
            hidden: 64,
            intermediate: 64,
            shared: 0,
            style: MoeStyle::GptOss,
            ..CASE
        };
        let block = case.load(4, false).unwrap();
        let grouped = MoeCase::grouped(&block, true);
        let apart = MoeCase::grouped(&block, false);
        let pairs = ops::zeros::<i32>(&[2, 40, case.top_k]).unwrap();
        assert!(grouped.switch_mlp.groups(&pairs, case.dtype));
        let error = case.error(&grouped, &apart, (2, 40)).unwrap();
        assert!(error < 1e-5, "relative error {error:e}");
    }

    /// A prompt pass's pairs as grouped products (the stacks dequantized, MLX's `gather_mm`
    /// over the sorted pairs) give the block's output through `gather_qmm`, with the shared
    /// expert apart and folded; a decode step's pairs and too few pairs an expert are not
    /// grouped.
    #[test]
    fn grouped_products_give_the_experts_output() {
        for fold in [false, true] {
            let block = CASE.load(4, fold).unwrap();
            let grouped = MoeCase::grouped(&block, true);
            let apart = MoeCase::grouped(&block, false);
            let k = block.top_k + block.folded_shared;
            let pairs = |rows, tokens| ops::zeros::<i32>(&[rows, tokens, k]).unwrap();
            let groups = |rows, tokens| grouped.switch_mlp.groups(&pairs(rows, tokens), CASE.dtype);
            // 8 experts (10 with the shared expert's pieces), at least 8 pairs each.
            let experts = (CASE.experts + block.folded_shared) as usize;
            let fewest = (8 * experts).div_ceil(k as usize) as i32;
            assert!(groups(2, (fewest + 1) / 2) && !groups(1, fewest - 1));
            assert!(!groups(64, 1), "a decode step's pairs are not grouped");
            assert!(!apart.switch_mlp.groups(&pairs(2, 40), CASE.dtype));
            if crate::device::Backend::current() == crate::device::Backend::Cpu {
                let bf16 = mlx_rs::Dtype::Bfloat16;
                assert!(!grouped.switch_mlp.groups(&pairs(2, 40), bf16));
            }
            let error = CASE.error(&grouped, &apart, (2, 40)).unwrap();
            assert!(error < 1e-5, "folded {fold}: relative error {error:e}");
        }
    }
}
