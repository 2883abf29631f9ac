//! The pre-norm decoder-only transformer that Llama, Qwen2, Qwen3, Qwen3.5 and Gemma 3 share. Each
//! architecture file turns its `config.json` into a [`DecoderConfig`]; this file owns the forward
//! pass, written op for op like mlx-lm's `models/llama.py` (and `gemma3_text.py` for what
//! [`BlockStyle`] changes) so that logits match mlx_lm exactly.

use mlx_rs::{ops, Array, Dtype};

use crate::attention::AttentionSpec;
use crate::attention::KvQuantization;
use crate::distributed::{Division, PipelineParallel, TensorParallel};
use crate::error::{EngineError, Result};
use crate::kv::cache::KvCache;
use crate::kv::{LayerCaches, Positions};
use crate::models::gated_delta::{GatedDeltaConfig, GatedDeltaNet};
use crate::models::moe::{MlpAndExperts, MoeConfig, MoeStyle, SparseMoe};
use crate::models::vision::VisionTower;
use crate::models::{within, Model, ModelInfo, Output, Spliced};
use crate::nn::layers::{
    gelu_approx, Activation, Embedding, Linear, Mlp, Quantization, RmsNorm, Rope, Shard, ShardParts,
};
use crate::nn::mlx_ext::slice;
use crate::nn::rope_kernel;
use crate::nn::weights::Weights;

/// Everything the shared decoder needs, resolved from an architecture's config. `Default` gives
/// Llama's choices for every switch and zero for every size (which [`DecoderConfig::validate`]
/// rejects, naming it), so a loader spells out the sizes and only what differs from Llama.
#[derive(Debug, Clone, Default)]
pub struct DecoderConfig {
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub num_layers: i32,
    pub num_heads: i32,
    pub num_kv_heads: i32,
    pub head_dim: i32,
    pub vocab_size: i32,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// Bias on the q/k/v projections (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    pub mlp_bias: bool,
    /// RMSNorm on each query and key head before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The query projection also yields a gate per query feature, and attention's output is
    /// multiplied by its sigmoid before the output projection (Qwen3-Next, Qwen3.5).
    pub attn_output_gate: bool,
    /// Hybrid models: every layer but each `full_attention_interval`-th is a Gated DeltaNet
    /// (Qwen3.5's `linear_attn`); `None`: every layer is attention.
    pub linear_attention: Option<LinearAttention>,
    /// Prepended to every weight name (`language_model.` for checkpoints that nest the text
    /// model, as multimodal Qwen3.5 ones do); empty otherwise.
    pub weight_prefix: String,
    pub context_length: usize,
    /// How the blocks differ from Llama's (`Default`: they don't).
    pub style: BlockStyle,
    /// Sparse mixture-of-experts feed-forward blocks on some layers (Qwen3-MoE), or experts
    /// beside every layer's MLP (Gemma 4, [`MoeStyle::Gemma4`]).
    pub moe: Option<MoeConfig>,
    /// The global (not sliding) layers' own attention shape, where it differs from the sliding
    /// layers' `num_kv_heads` heads of `head_dim` (Gemma 4).
    pub global_attention: Option<GlobalAttention>,
    /// The last this-many layers compute no keys or values of their own: each attends over the
    /// cache of the last earlier layer of its kind (sliding or global), as that layer left it
    /// in the same forward pass (Gemma 4's `num_kv_shared_layers`; mlx_lm makes no cache for
    /// them). 0: none.
    pub kv_shared_layers: i32,
    /// A second embedding per layer (Gemma 4's E2B / E4B), see [`PerLayerInputs`].
    pub per_layer_inputs: Option<PerLayerInputs>,
}

/// Gemma 4's global layers: heads of their own size and count, and optionally values taken
/// from the key projection (`attention_k_eq_v`: no `v_proj`).
#[derive(Debug, Clone, Copy)]
pub struct GlobalAttention {
    pub head_dim: i32,
    pub num_kv_heads: i32,
    pub values_from_keys: bool,
}

/// Gemma 4's per-layer inputs (mlx_lm `gemma4_text.py`): every token has a second embedding
/// of `layers * hidden` features (`embed_tokens_per_layer`, scaled by `sqrt(hidden)`), which is
/// averaged (sum times `2^-0.5`) with a normed projection of the scaled token embedding
/// (`per_layer_model_projection`, times `hidden_size^-0.5`, `per_layer_projection_norm`); layer
/// `l` reads its `hidden` features after its feed-forward part: `gelu(per_layer_input_gate(h))`
/// times them, projected back (`per_layer_projection`), normed (`post_per_layer_input_norm`)
/// and added to `h`.
#[derive(Debug, Clone, Copy)]
pub struct PerLayerInputs {
    /// `hidden_size_per_layer_input`.
    pub hidden: i32,
    /// `vocab_size_per_layer_input`: rows of the per-layer embedding (at least the vocabulary).
    pub vocab_size: i32,
}

/// What sets a block apart from Llama's, each default being Llama's choice.
#[derive(Debug, Clone, Default)]
pub struct BlockStyle {
    /// Every RMSNorm scales by `1 + weight` (Gemma stores its norm weights as offsets from one).
    pub norm_unit_offset: bool,
    /// The feed-forward gate's activation.
    pub activation: Activation,
    /// Norms on each sub-layer's output as well as its input (Gemma 2 and 3): the block reads
    /// `post_attention_layernorm` on attention's output, then `pre_feedforward_layernorm` and
    /// `post_feedforward_layernorm` around the MLP, where Llama's reads
    /// `post_attention_layernorm` on the MLP's input.
    pub sandwich_norms: bool,
    /// Residual sums in float16 are computed in float32 and clipped to float16's range (Gemma
    /// 3's `clip_residual`); other dtypes add as they are.
    pub clip_float16_residuals: bool,
    /// Embeddings are multiplied by this (Gemma: `sqrt(hidden_size)` rounded to bfloat16).
    pub embedding_scale: Option<f32>,
    /// Spliced features ([`super::Spliced::features`]) replace their tokens' embeddings after
    /// [`BlockStyle::embedding_scale`] (Gemma 4, as mlx-vlm's `get_input_embeddings` scatters
    /// them), not before (Gemma 3, whose tower divides them by the scale first).
    pub features_after_scale: bool,
    /// Attention's score scale; `None`: `head_dim^-0.5` (Gemma: `query_pre_attn_scalar^-0.5`).
    pub attention_scale: Option<f32>,
    /// Sliding-window attention on some layers (Gemma 3).
    pub sliding_window: Option<SlidingWindow>,
    /// Layers that attend without RoPE ("NoPE", SmolLM3's `no_rope_layers` zeros).
    pub no_rope_layers: Vec<i32>,
    /// No norm on a sub-layer's input, only on its output: `post_attention_layernorm` on
    /// attention's, `post_feedforward_layernorm` on the MLP's (OLMo 2).
    pub output_norms_only: bool,
    /// The query and key norms span all heads' features (`[heads * head_dim]` weights, OLMo 2),
    /// not each head's (Qwen3, Gemma 3).
    pub qk_norm_across_heads: bool,
    /// Queries scaled by their position after RoPE (Ministral 3's Llama 4 attention scaling).
    pub query_position_scale: Option<QueryPositionScale>,
    /// RMSNorm without a weight on each value head (Gemma 4's `v_norm`).
    pub value_norm: bool,
    /// Attention sinks: a learned logit per query head (`self_attn.sinks`) joins every
    /// query's softmax as a key without a value, so a query may attend to nothing (gpt-oss).
    pub attention_sinks: bool,
    /// Each block's output is multiplied by its own scalar weight, `layer_scalar` (Gemma 4).
    pub layer_scalar: bool,
    /// Logits squashed into `(-cap, cap)` as `tanh(logits / cap) * cap` (Gemma 4's
    /// `final_logit_softcapping`).
    pub final_logit_softcap: Option<f32>,
    /// KV-shared layers' MLPs are twice `intermediate_size` wide (Gemma 4's
    /// `use_double_wide_mlp`).
    pub double_wide_shared_mlp: bool,
    /// Multimodal RoPE's sections (Qwen3.5's `mrope_section`, interleaved): for a pass given
    /// each token's `[time, row, column]` positions ([`super::Spliced::rope_positions`]), RoPE
    /// frequency `j` turns by the row's position when `j mod 3 = 1` and `j < 3 · sections[1]`, by
    /// the column's when `j mod 3 = 2` and `j < 3 · sections[2]`, else by the time's.
    pub mrope_sections: Option<[i32; 3]>,
}

/// Llama 4's attention temperature as Ministral 3 applies it (mlx_lm `_get_llama_4_attn_scale`):
/// the query at position `p` is multiplied by `1 + beta * ln(1 + floor(p / original))`, which is
/// 1 below `original` positions.
#[derive(Debug, Clone, Copy)]
pub struct QueryPositionScale {
    /// `llama_4_scaling_beta`.
    pub beta: f32,
    /// `original_max_position_embeddings`.
    pub original: f32,
}

impl QueryPositionScale {
    /// The scales of queries at `positions` (int32, any shape) → float32 of the same shape.
    pub fn scales(&self, positions: &Array) -> Result<Array> {
        let blocks = ops::floor(&ops::divide(
            &positions.as_dtype(Dtype::Float32)?,
            Array::from_f32(self.original),
        )?)?;
        let log = ops::log(&ops::add(&blocks, Array::from_f32(1.0))?)?;
        Ok(ops::add(
            &ops::multiply(&log, Array::from_f32(self.beta))?,
            Array::from_f32(1.0),
        )?)
    }
}

/// Layers whose queries see only the last `window` positions (their own included), as mlx_lm's
/// `RotatingKVCache(max_size=window)` and `create_causal_mask(window_size=window)` give them.
#[derive(Debug, Clone)]
pub struct SlidingWindow {
    pub window: i32,
    /// One flag per layer, true for the sliding ones (see [`SlidingWindow::every_but_nth`];
    /// Ministral 3 lists them in `layer_types`).
    pub layers: Vec<bool>,
    /// RoPE base of the sliding layers (Gemma 3's `rope_local_base_freq`, unscaled); `None`:
    /// the global layers' RoPE.
    pub local_rope_theta: Option<f32>,
}

impl SlidingWindow {
    /// Flags for `num_layers` layers where every `pattern`-th is global and the others slide
    /// (Gemma 3's `sliding_window_pattern`; 1: none slides). `pattern` must be at least 1.
    pub fn every_but_nth(num_layers: i32, pattern: i32) -> Vec<bool> {
        (0..num_layers.max(0))
            .map(|i| (i + 1) % pattern.max(1) != 0)
            .collect()
    }

    /// Flags from a config's `layer_types` (`full_attention` or `sliding_attention` per
    /// layer); an error names any other entry.
    pub fn layers_from_types(types: &[String]) -> std::result::Result<Vec<bool>, String> {
        types
            .iter()
            .map(|kind| match kind.as_str() {
                "full_attention" => Ok(false),
                "sliding_attention" => Ok(true),
                other => Err(format!(
                    "`layer_types` lists `{other}` (full_attention or sliding_attention)"
                )),
            })
            .collect()
    }

    pub fn is_sliding_layer(&self, i: i32) -> bool {
        usize::try_from(i)
            .ok()
            .and_then(|i| self.layers.get(i))
            .copied()
            .unwrap_or(false)
    }
}

/// Which layers of a hybrid model are linear attention, and their sizes.
#[derive(Debug, Clone)]
pub struct LinearAttention {
    /// Layer `i` is full attention when `(i + 1) % full_attention_interval == 0`.
    pub full_attention_interval: i32,
    pub layer: GatedDeltaConfig,
}

impl DecoderConfig {
    /// Whether layer `i` is a linear-attention (Gated DeltaNet) layer.
    pub fn is_linear_layer(&self, i: i32) -> bool {
        self.linear_attention
            .as_ref()
            .is_some_and(|l| (i + 1) % l.full_attention_interval != 0)
    }

    fn is_sliding_layer(&self, i: i32) -> bool {
        self.style
            .sliding_window
            .as_ref()
            .is_some_and(|s| s.is_sliding_layer(i))
    }

    /// [`ModelInfo::mlp_width`]: the widest feed-forward hidden of one token (Gemma 4's
    /// KV-shared layers' MLPs are twice as wide; experts beside the MLP add theirs).
    fn mlp_width(&self) -> usize {
        let dense = match self.kv_shared_layers {
            0 => self.intermediate_size,
            _ => 2 * self.intermediate_size,
        };
        let experts = self.moe.as_ref().map_or(0, |m| {
            m.top_k * m.intermediate_size + m.shared_expert_intermediate_size.unwrap_or(0)
        });
        let beside = self
            .moe
            .as_ref()
            .is_some_and(|m| m.style == crate::models::moe::MoeStyle::Gemma4);
        (if beside {
            dense + experts
        } else {
            dense.max(experts)
        })
        .max(0) as usize
    }

    /// The first layer that reads another's cache ([`DecoderConfig::kv_shared_layers`]).
    fn first_kv_shared_layer(&self) -> i32 {
        self.num_layers - self.kv_shared_layers
    }

    /// The layer whose cache layer `i` attends over: itself, or for a KV-shared layer the last
    /// earlier layer of its kind with a cache of its own (`None` when there is none).
    fn kv_source(&self, i: i32) -> Option<i32> {
        let first_shared = self.first_kv_shared_layer();
        if i < first_shared {
            return Some(i);
        }
        let sliding = self.is_sliding_layer(i);
        (0..first_shared)
            .rev()
            .find(|&j| self.is_sliding_layer(j) == sliding)
    }

    /// The cache layer `i` keeps, when it keeps one of its own: its `[kv_heads, head_dim]` and,
    /// for a sliding layer, its window. `None` for linear-attention and KV-shared layers.
    pub(crate) fn cache_layer(&self, i: i32) -> Option<([i32; 2], Option<i32>)> {
        if self.is_linear_layer(i) || i >= self.first_kv_shared_layer() {
            return None;
        }
        let window = self
            .style
            .sliding_window
            .as_ref()
            .filter(|s| s.is_sliding_layer(i))
            .map(|s| s.window);
        Some((self.head_shape(i), window))
    }

    /// Layer `i`'s attention shape: `[kv_heads, head_dim]`.
    fn head_shape(&self, i: i32) -> [i32; 2] {
        match &self.global_attention {
            Some(g) if !self.is_sliding_layer(i) => [g.num_kv_heads, g.head_dim],
            _ => [self.num_kv_heads, self.head_dim],
        }
    }
}

impl DecoderConfig {
    /// Largest sizes accepted from a config file (well above every published model's: the
    /// largest open models have ~130 layers, 128 heads, head_dim 256, hidden 16k–25k,
    /// vocabularies ~260k).
    pub(crate) const MAX_LAYERS: i32 = 1024;
    const MAX_HEADS: i32 = 1024;
    const MAX_HEAD_DIM: i32 = 1024;
    const MAX_HIDDEN: i32 = 1 << 17;
    const MAX_INTERMEDIATE: i32 = 1 << 20;
    const MAX_VOCAB: i32 = 1 << 22;
    const MAX_CONTEXT: usize = 1 << 24;

    /// Checks the sizes before anything is built from them: a downloaded `config.json` with
    /// `num_hidden_layers: 0`, a negative size, heads that do not divide, or a huge `head_dim`
    /// must be an error naming the field, not a pool sized for 2^31 blocks, a capacity-overflow
    /// panic or gigabytes of RoPE tables.
    pub fn validate(&self) -> std::result::Result<(), String> {
        within("num_hidden_layers", self.num_layers, Self::MAX_LAYERS)?;
        within("num_attention_heads", self.num_heads, Self::MAX_HEADS)?;
        within("num_key_value_heads", self.num_kv_heads, Self::MAX_HEADS)?;
        within("head_dim", self.head_dim, Self::MAX_HEAD_DIM)?;
        within("hidden_size", self.hidden_size, Self::MAX_HIDDEN)?;
        within(
            "intermediate_size",
            self.intermediate_size,
            Self::MAX_INTERMEDIATE,
        )?;
        within("vocab_size", self.vocab_size, Self::MAX_VOCAB)?;
        if self.num_heads % self.num_kv_heads != 0 {
            return Err(format!(
                "`num_attention_heads` ({}) must be a multiple of `num_key_value_heads` ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim % 2 != 0 {
            return Err(format!(
                "`head_dim` must be even for RoPE, got {}",
                self.head_dim
            ));
        }
        if !(1..=Self::MAX_CONTEXT).contains(&self.context_length) {
            return Err(format!(
                "the context length must be between 1 and {}, got {}",
                Self::MAX_CONTEXT,
                self.context_length
            ));
        }
        if let Some(sliding) = &self.style.sliding_window {
            within("sliding_window", sliding.window, Self::MAX_CONTEXT as i32)?;
            if sliding.layers.len() != self.num_layers as usize {
                return Err(format!(
                    "the sliding-window layer list has {} entries for {} layers",
                    sliding.layers.len(),
                    self.num_layers
                ));
            }
            if let Some(theta) = sliding.local_rope_theta {
                if !(theta.is_finite() && theta > 0.0) {
                    return Err(format!(
                        "`rope_local_base_freq` must be a positive number, got {theta}"
                    ));
                }
            }
        }
        for (name, value) in [
            ("the embedding scale", self.style.embedding_scale),
            ("the attention scale", self.style.attention_scale),
        ] {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0) {
                    return Err(format!("{name} must be a positive number, got {v}"));
                }
            }
        }
        if let Some(moe) = &self.moe {
            moe.validate()?;
        }
        if let Some(g) = &self.global_attention {
            within("global_head_dim", g.head_dim, Self::MAX_HEAD_DIM)?;
            within(
                "num_global_key_value_heads",
                g.num_kv_heads,
                Self::MAX_HEADS,
            )?;
            if self.num_heads % g.num_kv_heads != 0 || g.head_dim % 2 != 0 {
                return Err(format!(
                    "global layers' {} KV heads of {} features do not fit {} query heads",
                    g.num_kv_heads, g.head_dim, self.num_heads
                ));
            }
        }
        if !(0..self.num_layers).contains(&self.kv_shared_layers) {
            return Err(format!(
                "`num_kv_shared_layers` must be below the layer count {}, got {}",
                self.num_layers, self.kv_shared_layers
            ));
        }
        if let Some(i) = (0..self.num_layers).find(|&i| self.kv_source(i).is_none()) {
            return Err(format!(
                "layer {i} shares the keys and values of an earlier layer of its kind, and there \
                 is none"
            ));
        }
        if let Some(p) = &self.per_layer_inputs {
            within("hidden_size_per_layer_input", p.hidden, Self::MAX_HIDDEN)?;
            within("vocab_size_per_layer_input", p.vocab_size, Self::MAX_VOCAB)?;
            if p.vocab_size < self.vocab_size {
                return Err(format!(
                    "`vocab_size_per_layer_input` ({}) is below the vocabulary ({})",
                    p.vocab_size, self.vocab_size
                ));
            }
            if (self.num_layers as i64) * (p.hidden as i64) > Self::MAX_INTERMEDIATE as i64 {
                return Err(format!(
                    "{} layers of {} per-layer input features are too many",
                    self.num_layers, p.hidden
                ));
            }
        }
        if let Some(cap) = self.style.final_logit_softcap {
            if !(cap.is_finite() && cap > 0.0) {
                return Err(format!(
                    "`final_logit_softcapping` must be a positive number, got {cap}"
                ));
            }
        }
        if let Some(linear) = &self.linear_attention {
            if !(1..=self.num_layers).contains(&linear.full_attention_interval) {
                return Err(format!(
                    "`full_attention_interval` must be between 1 and the layer count {}, got {}",
                    self.num_layers, linear.full_attention_interval
                ));
            }
            linear.layer.validate()?;
        }
        // Every projection's output width fits MLX's int32 shapes (at most 1024 · 3 · 1024).
        Ok(())
    }
}

#[derive(Clone)]
struct Attention {
    qkv: Qkv,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// See [`BlockStyle::value_norm`].
    v_norm: Option<RmsNorm>,
    /// See [`BlockStyle::qk_norm_across_heads`].
    qk_norm_across_heads: bool,
    num_heads: i32,
    num_kv_heads: i32,
    head_dim: i32,
    scale: f32,
    /// See [`DecoderConfig::attn_output_gate`].
    output_gate: bool,
    /// A sliding layer's window ([`SlidingWindow`]); `None`: global attention.
    window: Option<i32>,
    /// Per query head, a learned logit that joins each query's softmax as one more key with
    /// no value ([`BlockStyle::attention_sinks`]): `[heads]`.
    sinks: Option<Array>,
}

/// The query, key and value projections, separate or fused into one (see
/// [`crate::nn::layers::fused_projections`]).
#[derive(Clone)]
enum Qkv {
    Separate {
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
    },
    /// Outputs `[..., (heads · g + 2 · kv_heads) · head_dim]`: queries, keys, then values,
    /// where `g` is 2 when the attention has an output gate (each query head followed by its
    /// gate, as the query projection's output interleaves them) and 1 otherwise.
    Fused(Linear),
    /// The values are the key projection's output, before the key norm (Gemma 4's
    /// `attention_k_eq_v`).
    KeysAsValues { q_proj: Linear, k_proj: Linear },
    /// Queries only: the layer attends over an earlier layer's cache
    /// ([`DecoderConfig::kv_shared_layers`]).
    QueriesOnly(Linear),
}

impl Qkv {
    /// Separate projections, fused where [`Linear::fuse_if_enabled`] does.
    fn of(q_proj: Linear, k_proj: Linear, v_proj: Linear) -> Result<Self> {
        Ok(match Linear::fuse_if_enabled([q_proj, k_proj, v_proj])? {
            Ok(fused) => Qkv::Fused(fused),
            Err([q_proj, k_proj, v_proj]) => Qkv::Separate {
                q_proj,
                k_proj,
                v_proj,
            },
        })
    }
}

/// How one attention layer is shaped: its KV heads and head size, whether its values are its
/// keys' projection, whether it reads another layer's cache.
#[derive(Clone, Copy)]
struct AttentionShape {
    num_kv_heads: i32,
    head_dim: i32,
    values_from_keys: bool,
    shares_kv: bool,
}

impl Attention {
    fn load(
        w: &mut Weights,
        q: &Quantization,
        path: &str,
        c: &DecoderConfig,
        window: Option<i32>,
        shape: AttentionShape,
    ) -> Result<Self> {
        let (hidden, hd, kv_heads) = (c.hidden_size, shape.head_dim, shape.num_kv_heads);
        let across = c.style.qk_norm_across_heads;
        let norm = |w: &mut Weights, name: &str, heads: i32| -> Result<Option<RmsNorm>> {
            c.qk_norm
                .then(|| {
                    RmsNorm::load_with_offset(
                        w,
                        &format!("{path}.{name}"),
                        if across { heads * hd } else { hd },
                        c.rms_norm_eps,
                        c.style.norm_unit_offset,
                    )
                })
                .transpose()
        };
        let proj = |w: &mut Weights, name: &str, out: i32| {
            Linear::load(w, q, &format!("{path}.{name}"), hidden, out, c.qkv_bias)
        };
        let fused_path = format!("{path}.qkv_proj");
        let qkv = if shape.shares_kv {
            // A checkpoint may still hold the projections nobody reads (mlx_lm's sanitize drops
            // them).
            let unread = [".k_proj.", ".v_proj.", ".k_norm."].map(|p| format!("{path}{p}"));
            w.discard_where(|name| unread.iter().any(|p| name.starts_with(p.as_str())));
            Qkv::QueriesOnly(proj(w, "q_proj", c.num_heads * hd)?)
        } else if shape.values_from_keys {
            Qkv::KeysAsValues {
                q_proj: proj(w, "q_proj", c.num_heads * hd)?,
                k_proj: proj(w, "k_proj", kv_heads * hd)?,
            }
        } else if !c.attn_output_gate && w.contains(&format!("{fused_path}.weight")) {
            // Stored fused (Phi-3's `qkv_proj`): queries, then keys, then values.
            Qkv::Fused(proj(w, "qkv_proj", (c.num_heads + 2 * kv_heads) * hd)?)
        } else {
            Self::load_qkv(w, q, path, c, shape)?
        };
        Ok(Self {
            qkv,
            o_proj: Linear::load(
                w,
                q,
                &format!("{path}.o_proj"),
                c.num_heads * hd,
                hidden,
                c.o_bias,
            )?,
            q_norm: norm(w, "q_norm", c.num_heads)?,
            k_norm: if shape.shares_kv {
                None
            } else {
                norm(w, "k_norm", kv_heads)?
            },
            v_norm: (c.style.value_norm && !shape.shares_kv)
                .then(|| RmsNorm::unweighted(c.rms_norm_eps)),
            qk_norm_across_heads: across,
            num_heads: c.num_heads,
            num_kv_heads: kv_heads,
            head_dim: hd,
            scale: c.style.attention_scale.unwrap_or((hd as f32).powf(-0.5)),
            output_gate: c.attn_output_gate,
            window,
            sinks: c
                .style
                .attention_sinks
                .then(|| w.take_shaped(&format!("{path}.sinks"), &[c.num_heads]))
                .transpose()?,
        })
    }

    /// Separate `q_proj`, `k_proj` and `v_proj` (fused at load where that is enabled).
    fn load_qkv(
        w: &mut Weights,
        q: &Quantization,
        path: &str,
        c: &DecoderConfig,
        shape: AttentionShape,
    ) -> Result<Qkv> {
        let (hidden, hd, kv_heads) = (c.hidden_size, shape.head_dim, shape.num_kv_heads);
        let gate = if c.attn_output_gate { 2 } else { 1 };
        let q_proj = Linear::load(
            w,
            q,
            &format!("{path}.q_proj"),
            hidden,
            c.num_heads * hd * gate,
            c.qkv_bias,
        )?;
        let k_proj = Linear::load(
            w,
            q,
            &format!("{path}.k_proj"),
            hidden,
            kv_heads * hd,
            c.qkv_bias,
        )?;
        let v_proj = Linear::load(
            w,
            q,
            &format!("{path}.v_proj"),
            hidden,
            kv_heads * hd,
            c.qkv_bias,
        )?;
        Qkv::of(q_proj, k_proj, v_proj)
    }

    /// Queries, keys and values of `x` `[batch, seq, hidden]`, each `[batch, heads, seq,
    /// head_dim]` (query, key and value norms applied, RoPE not yet; no keys and values for a
    /// layer that reads another's cache), and the output gate `[batch, seq, heads * head_dim]`
    /// when the attention has one.
    #[allow(clippy::type_complexity)]
    fn project(&self, x: &Array) -> Result<(Array, Option<(Array, Array)>, Option<Array>)> {
        let (batch, seq) = (x.shape()[0], x.shape()[1]);
        // `[batch, seq, n, head_dim]` → normed, `[batch, n, seq, head_dim]`.
        let heads = |h: Array, norm: &Option<RmsNorm>| -> Result<Array> {
            let h = match norm {
                Some(norm) if self.qk_norm_across_heads => {
                    let shape = h.shape().to_vec();
                    norm.forward(&h.reshape(&[batch, seq, -1])?)?
                        .reshape(&shape)?
                }
                Some(norm) => norm.forward(&h)?,
                None => h,
            };
            Ok(h.transpose_axes(&[0, 2, 1, 3])?)
        };
        let split = |proj: &Linear, n: i32| -> Result<Array> {
            Ok(proj.forward(x)?.reshape(&[batch, seq, n, -1])?)
        };
        // With an output gate, each query head's features are its query, then its gate.
        let (q, kv) = match &self.qkv {
            Qkv::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => (
                split(q_proj, self.num_heads)?,
                Some((
                    split(k_proj, self.num_kv_heads)?,
                    split(v_proj, self.num_kv_heads)?,
                )),
            ),
            Qkv::Fused(proj) => {
                let (nq, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
                // Query heads as stored: with a gate, a query's features then its gate's.
                let nq_stored = if self.output_gate { 2 * nq } else { nq };
                let all = proj
                    .forward(x)?
                    .reshape(&[batch, seq, nq_stored + 2 * nkv, hd])?;
                // Slices (views), not MLX's `split`: a build using `split` here once ended a run
                // in cuDNN's teardown (not isolated).
                let part =
                    |from: i32, to: i32| slice(&all, &[0, 0, from, 0], &[batch, seq, to, hd]);
                let q = match self.output_gate {
                    true => part(0, nq_stored)?.reshape(&[batch, seq, nq, 2 * hd])?,
                    false => part(0, nq)?,
                };
                (
                    q,
                    Some((
                        part(nq_stored, nq_stored + nkv)?,
                        part(nq_stored + nkv, nq_stored + 2 * nkv)?,
                    )),
                )
            }
            Qkv::KeysAsValues { q_proj, k_proj } => {
                let k = split(k_proj, self.num_kv_heads)?;
                (split(q_proj, self.num_heads)?, Some((k.clone(), k)))
            }
            Qkv::QueriesOnly(q_proj) => (split(q_proj, self.num_heads)?, None),
        };
        // mlx_lm splits a gated query head's features in two: the query, then the gate.
        let (q, gate) = match self.output_gate {
            true => {
                let (nq, hd) = (self.num_heads, self.head_dim);
                let half = |from: i32| slice(&q, &[0, 0, 0, from], &[batch, seq, nq, from + hd]);
                (half(0)?, Some(half(hd)?.reshape(&[batch, seq, -1])?))
            }
            false => (q, None),
        };
        let kv = match kv {
            Some((k, v)) => Some((heads(k, &self.k_norm)?, heads(v, &self.v_norm)?)),
            None => None,
        };
        Ok((heads(q, &self.q_norm)?, kv, gate))
    }

    /// A decode step's queries, keys and values (`[rows, heads or kv_heads, 1, head_dim]`), the
    /// queries and keys normed and rotated in one kernel ([`rope_kernel::norm_rope`]), and the
    /// output gate (`[rows, 1, heads * head_dim]`) when the attention has one, where the kernel
    /// computes what [`Attention::project`] and RoPE would: CUDA, one token a row at per-row
    /// positions, fused projections, query and key norms per head or none, RoPE in the
    /// non-interleaved layout (with YaRN's or LongRoPE's attention factor, if any), no query
    /// scales or value norm. `None` elsewhere.
    #[allow(clippy::type_complexity)]
    fn decode_norm_rope(
        &self,
        x: &Array,
        rope: Option<&Rope>,
        positions: &Positions,
        query_scales: Option<&Array>,
    ) -> Result<Option<(Array, Array, Array, Option<Array>)>> {
        let (Qkv::Fused(proj), Some(rope), Positions::Rows { offsets, .. }) =
            (&self.qkv, rope, positions)
        else {
            return Ok(None);
        };
        let norms = match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) => match (q.weight(), k.weight()) {
                (Some(qw), Some(kw)) if q.eps() == k.eps() => Some((qw, kw, q.eps())),
                _ => return Ok(None),
            },
            (None, None) => None,
            _ => return Ok(None),
        };
        let (batch, seq) = (x.shape()[0], x.shape()[1]);
        if seq != 1
            || query_scales.is_some()
            || self.v_norm.is_some()
            || self.qk_norm_across_heads
            || rope.traditional
            || !rope_kernel::enabled()
        {
            return Ok(None);
        }
        let (nq, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let spec = rope_kernel::RopeSpec {
            dims: rope.dims,
            base: rope.base,
            scale: rope.scale,
            freqs: rope.freqs.as_ref(),
            mscale: rope.mscale,
        };
        let weights = norms.map(|(q, k, _)| (q, k));
        let heads = rope_kernel::Heads {
            queries: nq,
            kv: nkv,
            size: hd,
            gated: self.output_gate,
        };
        // The projection's output `[batch, 1, width]`, taken as it comes (a reshape would be
        // one more operation in every step). Judged before the projection is built (so a layer
        // the kernel does not take builds it once), and again on it (its dtype could differ
        // from the input's).
        let shape = [batch, 1, heads.width()];
        if !rope_kernel::takes((&shape, x.dtype()), heads, weights, offsets, &spec) {
            return Ok(None);
        }
        let all = proj.forward(x)?;
        if !rope_kernel::computes(&all, heads, weights, offsets, &spec) {
            return Ok(None);
        }
        let out = rope_kernel::norm_rope(&all, heads, norms, offsets, &spec)?;
        Ok(Some((out.queries, out.keys, out.values, out.gates)))
    }

    /// Rank `tp.rank()`'s part: its share of the query and key-value heads (the query, key and
    /// value projections by outputs, a fused one by each of its three parts; the attention
    /// sinks of its query heads) and the output projection by inputs, whose output is then a
    /// partial sum ([`Linear::shard_to_all`]). Query and key norms per head stay whole; norms
    /// over all heads together are refused (they would need every rank's heads).
    fn shard(&self, tp: &TensorParallel) -> Result<Self> {
        if self.qk_norm_across_heads {
            return Err(EngineError::Distributed(
                "query and key norms over all heads together (OLMo 2) are not divided over \
                 ranks yet"
                    .into(),
            ));
        }
        let (rank, size) = (tp.rank(), tp.size());
        let num_heads = tp.part("query heads", self.num_heads)?;
        let num_kv_heads = tp.part("key-value heads", self.num_kv_heads)?;
        let out = |proj: &Linear| proj.shard(Shard::Outputs, rank, size);
        let qkv = match &self.qkv {
            // Fused as at load (parts read unfused are fused once divided).
            Qkv::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => Qkv::of(out(q_proj)?, out(k_proj)?, out(v_proj)?)?,
            Qkv::Fused(proj) => {
                let gate = if self.output_gate { 2 } else { 1 };
                let queries = self.num_heads * gate * self.head_dim;
                let kv = self.num_kv_heads * self.head_dim;
                Qkv::Fused(proj.shard_segments(Shard::Outputs, &[queries, kv, kv], rank, size)?)
            }
            Qkv::KeysAsValues { q_proj, k_proj } => Qkv::KeysAsValues {
                q_proj: out(q_proj)?,
                k_proj: out(k_proj)?,
            },
            Qkv::QueriesOnly(q_proj) => Qkv::QueriesOnly(out(q_proj)?),
        };
        let sinks = match &self.sinks {
            Some(sinks) => Some(
                ShardParts::new(&[self.num_heads], self.num_heads, rank, size)
                    .map_err(EngineError::Distributed)?
                    .take(sinks, 0, (1, 1))?,
            ),
            None => None,
        };
        Ok(Self {
            qkv,
            o_proj: self.o_proj.shard_to_all(rank, size)?,
            num_heads,
            num_kv_heads,
            sinks,
            ..self.clone()
        })
    }

    /// The output projection of attention's output `[batch, seq, heads * head_dim]`, gated
    /// first when the attention has a gate.
    fn output(&self, out: &Array, gate: Option<Array>) -> Result<Array> {
        match gate {
            Some(gate) => self
                .o_proj
                .forward(&ops::multiply(out, &ops::sigmoid(&gate)?)?),
            None => self.o_proj.forward(out),
        }
    }

    /// `x` `[rows, tokens, hidden]` → `[rows, tokens, hidden]`: queries, keys and values
    /// projected, rotated at the pass's `positions`, queries scaled by `query_scales`
    /// (`[rows, 1, tokens, 1]`, [`QueryPositionScale`]) when given, then cache layer `layer` of
    /// `caches` takes the keys and values (none for a layer that reads another's) and decides
    /// how attention reads it ([`LayerCaches::attend`]).
    fn forward(
        &self,
        x: &Array,
        rope: Option<&Rope>,
        (positions, query_scales): (&Positions, Option<&Array>),
        caches: &mut LayerCaches<'_>,
        layer: usize,
    ) -> Result<Array> {
        let (queries, kv, gate) = match self.decode_norm_rope(x, rope, positions, query_scales)? {
            Some((queries, keys, values, gate)) => (queries, Some((keys, values)), gate),
            None => {
                let (queries, kv, gate) = self.project(x)?;
                let at = |a: &Array| -> Result<Array> {
                    match rope {
                        Some(rope) => positions.rope(rope, a),
                        None => Ok(a.clone()),
                    }
                };
                let queries = at(&queries)?;
                let queries = match query_scales {
                    Some(scales) => ops::multiply(&queries, &scales.as_dtype(queries.dtype())?)?,
                    None => queries,
                };
                let kv = match kv {
                    Some((keys, values)) => Some((at(&keys)?, values)),
                    None => None,
                };
                (queries, kv, gate)
            }
        };
        let spec = AttentionSpec {
            scale: self.scale,
            sinks: self.sinks.as_ref(),
            window: self.window,
        };
        let out = caches.attend(layer, &queries, kv, &spec)?;
        self.output(&out, gate)
    }
}

/// Layers of a large batched prompt pass dispatched at a time ([`PREFILL_EVAL_TOKENS`] tokens or
/// more), each part waited for once the next is dispatched (waiting before building the next
/// would leave the device idle meanwhile): MLX keeps a graph's intermediate arrays alive until
/// the device has run the command buffers holding them, so one evaluation of a whole pass over
/// four rows of 2,048 tokens held every layer's projections, MLP activations and attention
/// temporaries at once (in parts, a 1.07B Llama's peak over four 7,936-token prompts fell from
/// 15.3 to 10.6 GB).
const PREFILL_EVAL_LAYERS: usize = 4;

/// Tokens (rows times chunk width) from which a batched prompt pass is evaluated
/// [`PREFILL_EVAL_LAYERS`] layers at a time; smaller passes (short prompts) keep one
/// evaluation, whose waits would cost more than their memory. One long prompt's 2,048-token
/// chunks run in parts too: prefill passes are pipelined (`ModelRunner::prefill_step`), and a
/// pass encoded whole while the one before still runs held both passes' temporaries (at 2,048
/// tokens, a pipelined long prompt peaks no higher than one waited for pass by pass).
const PREFILL_EVAL_TOKENS: usize = 2048;

/// What mixes a block's positions: attention, or a Gated DeltaNet (hybrid models).
#[derive(Clone)]
enum Mixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
}

/// A block's feed-forward part: one MLP, a router over experts, or both side by side.
#[derive(Clone)]
enum FeedForward {
    Dense(Mlp),
    Sparse(Box<SparseMoe>),
    MlpAndExperts(Box<MlpAndExperts>),
}

impl FeedForward {
    /// `x` normed for the feed-forward part, and `unnormed` (what only
    /// [`FeedForward::MlpAndExperts`] reads besides).
    fn forward(&self, x: &Array, unnormed: &Array) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x),
            FeedForward::Sparse(moe) => moe.forward(x),
            FeedForward::MlpAndExperts(both) => both.forward(x, unnormed),
        }
    }

    /// `h + residual` and the part's output of it normed by `norm`, where the part does the add
    /// and the norm itself ([`SparseMoe::add_norm_forward`]); `None` where the caller does.
    fn add_norm_forward(
        &self,
        (h, residual): (&Array, &Array),
        norm: &RmsNorm,
    ) -> Result<Option<(Array, Array)>> {
        match self {
            FeedForward::Sparse(moe) => moe.add_norm_forward((h, residual), norm),
            FeedForward::Dense(_) | FeedForward::MlpAndExperts(_) => Ok(None),
        }
    }

    /// Rank `tp.rank()`'s part (see [`Mlp::shard`], [`SparseMoe::shard`]).
    fn shard(&self, tp: &TensorParallel) -> Result<Self> {
        match self {
            FeedForward::Dense(mlp) => Ok(FeedForward::Dense(mlp.shard(tp.rank(), tp.size())?)),
            FeedForward::Sparse(moe) => Ok(FeedForward::Sparse(Box::new(moe.shard(tp)?))),
            // Its MLP's and its experts' outputs are each normed before they add up.
            FeedForward::MlpAndExperts(_) => Err(EngineError::Distributed(
                "Gemma 4's MLP beside experts is not divided over ranks yet".into(),
            )),
        }
    }

    fn use_mlx_kernels(&mut self) {
        match self {
            FeedForward::Dense(mlp) => mlp.use_mlx_kernels(),
            FeedForward::Sparse(moe) => moe.use_mlx_kernels(),
            FeedForward::MlpAndExperts(both) => both.use_mlx_kernels(),
        }
    }
}

/// Gemma 4's per-layer input gate of one block (see [`PerLayerInputs`]).
#[derive(Clone)]
struct PerLayerGate {
    per_layer_input_gate: Linear,
    per_layer_projection: Linear,
    post_per_layer_input_norm: RmsNorm,
}

impl PerLayerGate {
    /// `h + norm(projection(gelu(gate(h)) * input))`: `h` `[batch, seq, hidden]`, `input` the
    /// layer's `[batch, seq, per_layer_hidden]`.
    fn forward(&self, h: &Array, input: &Array) -> Result<Array> {
        let gate = gelu_approx(&self.per_layer_input_gate.forward(h)?)?;
        let gate = self
            .per_layer_projection
            .forward(&ops::multiply(&gate, input)?)?;
        Ok(ops::add(
            h,
            &self.post_per_layer_input_norm.forward(&gate)?,
        )?)
    }

    fn use_mlx_kernels(&mut self) {
        self.per_layer_input_gate.use_mlx_kernels();
        self.per_layer_projection.use_mlx_kernels();
    }
}

/// Gemma 4's per-layer embeddings and their projection (see [`PerLayerInputs`]).
#[derive(Clone)]
struct PerLayerEmbedding {
    embed_tokens_per_layer: Embedding,
    per_layer_model_projection: Linear,
    per_layer_projection_norm: RmsNorm,
    layers: i32,
    hidden: i32,
}

impl PerLayerEmbedding {
    /// Every layer's input `[batch, seq, layers, hidden]` of `ids` `[batch, seq]` and their
    /// scaled embeddings `h` `[batch, seq, model hidden]`, as mlx_lm's
    /// `_get_per_layer_inputs` and `_project_per_layer_inputs` compute them (every scale a
    /// scalar of the activations' dtype, as mlx_lm's Python floats are).
    fn inputs(&self, ids: &Array, h: &Array) -> Result<Array> {
        let (batch, seq) = (ids.shape()[0], ids.shape()[1]);
        let shape = [batch, seq, self.layers, self.hidden];
        let scalar = |v: f32, like: &Array| Array::from_f32(v).as_dtype(like.dtype());
        let embedded = self.embed_tokens_per_layer.forward(ids)?;
        let embedded = ops::multiply(&embedded, &scalar((self.hidden as f32).sqrt(), &embedded)?)?
            .reshape(&shape)?;
        let projected = self.per_layer_model_projection.forward(h)?;
        let model_hidden = h.shape()[2];
        let projected = ops::multiply(
            &projected,
            &scalar((model_hidden as f32).powf(-0.5), &projected)?,
        )?
        .reshape(&shape)?;
        let projected = self.per_layer_projection_norm.forward(&projected)?;
        let sum = ops::add(&projected, &embedded)?;
        Ok(ops::multiply(&sum, &scalar(0.5f32.sqrt(), &sum)?)?)
    }

    /// Layer `layer`'s part of [`PerLayerEmbedding::inputs`]: `[batch, seq, hidden]`.
    fn layer(inputs: &Array, layer: i32) -> Result<Array> {
        let s = inputs.shape();
        Ok(slice(inputs, &[0, 0, layer, 0], &[s[0], s[1], layer + 1, s[3]])?.squeeze_axes(&[2])?)
    }

    fn use_mlx_kernels(&mut self) {
        self.embed_tokens_per_layer.use_mlx_kernels();
        self.per_layer_model_projection.use_mlx_kernels();
    }
}

#[derive(Clone)]
struct Block {
    mixer: Mixer,
    mlp: FeedForward,
    /// `None` for [`BlockStyle::output_norms_only`].
    input_layernorm: Option<RmsNorm>,
    /// On the MLP's input, or on attention's output when the block has [`SandwichNorms`].
    post_attention_layernorm: RmsNorm,
    sandwich: Option<SandwichNorms>,
    /// Attends within a sliding window (and reads [`Decoder::local_rope`] when there is one).
    sliding: bool,
    /// Applies RoPE to queries and keys ([`BlockStyle::no_rope_layers`]).
    rope: bool,
    /// The cache layer it writes, or reads when it has no keys and values of its own (see
    /// [`DecoderConfig::kv_shared_layers`]).
    cache: usize,
    /// Reads `cache` without writing it.
    shares_kv: bool,
    per_layer_gate: Option<PerLayerGate>,
    /// See [`BlockStyle::layer_scalar`]: `[1]`.
    layer_scalar: Option<Array>,
}

impl Block {
    /// Rank `tp.rank()`'s part of block `i` (see [`Model::shard`]); errors name the layer.
    fn shard(&self, tp: &TensorParallel, i: usize) -> Result<Block> {
        let at_layer = |e: EngineError| match e {
            EngineError::Distributed(why) => EngineError::Distributed(format!("layer {i}: {why}")),
            other => other,
        };
        let mixer = match &self.mixer {
            Mixer::Attention(attention) => Mixer::Attention(attention.shard(tp).map_err(at_layer)?),
            Mixer::Linear(net) => Mixer::Linear(net.shard(tp).map_err(at_layer)?),
        };
        Ok(Block {
            mixer,
            mlp: self.mlp.shard(tp).map_err(at_layer)?,
            ..self.clone()
        })
    }
}

/// The MLP's own norms of a [`BlockStyle::sandwich_norms`] block.
#[derive(Clone)]
struct SandwichNorms {
    /// `None` for [`BlockStyle::output_norms_only`].
    pre_feedforward_layernorm: Option<RmsNorm>,
    post_feedforward_layernorm: RmsNorm,
}

/// The decoder: embeddings, `num_layers` blocks, final norm, LM head (tied or not).
#[derive(Clone)]
pub struct Decoder {
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    rope: Rope,
    /// The sliding layers' RoPE ([`SlidingWindow::local_rope_theta`]).
    local_rope: Option<Rope>,
    /// The sliding layers' window, when there are sliding layers.
    window: Option<i32>,
    embedding_scale: Option<f32>,
    /// See [`BlockStyle::features_after_scale`].
    features_after_scale: bool,
    clip_float16_residuals: bool,
    /// See [`BlockStyle::query_position_scale`] (computed once per pass for all layers).
    query_position_scale: Option<QueryPositionScale>,
    /// See [`BlockStyle::mrope_sections`].
    mrope_sections: Option<[i32; 3]>,
    per_layer: Option<PerLayerEmbedding>,
    final_logit_softcap: Option<f32>,
    info: ModelInfo,
    /// How this decoder is divided over its group's ranks ([`Model::shard`]: a part of every
    /// block; [`Model::pipeline`]: a stage of blocks); `None`: all of it is here.
    division: Option<Division>,
    /// The index in the whole model of `layers[0]` (a pipeline stage's first layer; else 0).
    first_layer: usize,
    /// A vision-language checkpoint's vision tower (or why it was not loaded).
    vision: Option<std::result::Result<VisionTower, String>>,
}

impl Decoder {
    /// Takes every tensor the config implies from `weights` (Hugging Face names).
    pub fn load(
        config: DecoderConfig,
        rope: Rope,
        quantization: &Quantization,
        weights: &mut Weights,
        model_type: &str,
    ) -> Result<Self> {
        Self::load_divided(config, rope, quantization, weights, model_type, None)
    }

    /// [`Decoder::load`] of this rank's part alone (`division`): each block divided as soon as
    /// it is built (tensor parallelism), or the blocks of other stages not loaded at all, their
    /// tensors dropped unread (pipeline parallelism). With lazily read weights
    /// ([`Weights::load_lazily`]) a block's tensors are read only as it is divided, and then only
    /// this rank's part of each ([`crate::nn::part_reads`]).
    pub fn load_divided(
        config: DecoderConfig,
        rope: Rope,
        quantization: &Quantization,
        weights: &mut Weights,
        model_type: &str,
        division: Option<&Division>,
    ) -> Result<Self> {
        let c = &config;
        let stage = match division {
            Some(Division::Pipeline(pp)) => {
                if c.first_kv_shared_layer() < c.num_layers {
                    return Err(Self::kv_shared_refusal());
                }
                let kinds: Vec<_> = (0..c.num_layers)
                    .map(|i| (c.is_sliding_layer(i), c.is_linear_layer(i)))
                    .collect();
                Some(pp.layers(&kinds)?)
            }
            _ => None,
        };
        let global_head_dim = c.global_attention.map_or(c.head_dim, |g| g.head_dim);
        let rope = rope.for_head_dim(global_head_dim)?;
        let prefix = &c.weight_prefix;
        let embed_tokens = Embedding::load(
            weights,
            quantization,
            &format!("{prefix}model.embed_tokens"),
            c.vocab_size,
            c.hidden_size,
        )?;
        let norm = |weights: &mut Weights, path: &str| {
            RmsNorm::load_with_offset(
                weights,
                path,
                c.hidden_size,
                c.rms_norm_eps,
                c.style.norm_unit_offset,
            )
        };
        let sliding_window = c.style.sliding_window.as_ref();
        let first_shared = c.first_kv_shared_layer();
        let mut layers = Vec::with_capacity(c.num_layers as usize);
        // Divided by heads from lazily read weights: each layer's tensors stay unread until it
        // is divided, and then only this rank's part of each is read.
        let deferred = match division {
            Some(Division::Tensor(_)) => weights.defer_reads(),
            _ => None,
        };
        for i in 0..c.num_layers {
            let p = format!("{prefix}model.layers.{i}");
            if stage
                .as_ref()
                .is_some_and(|own| !own.contains(&(i as usize)))
            {
                let layer = format!("{p}.");
                weights.discard_where(|name| name.starts_with(&layer));
                continue;
            }
            let sliding = c.is_sliding_layer(i);
            let window = sliding_window.filter(|_| sliding).map(|s| s.window);
            let shares_kv = i >= first_shared;
            let [num_kv_heads, head_dim] = c.head_shape(i);
            let shape = AttentionShape {
                num_kv_heads,
                head_dim,
                values_from_keys: !sliding
                    && c.global_attention.is_some_and(|g| g.values_from_keys),
                shares_kv,
            };
            let mixer = match &c.linear_attention {
                Some(linear) if c.is_linear_layer(i) => Mixer::Linear(GatedDeltaNet::load(
                    weights,
                    quantization,
                    &format!("{p}.linear_attn"),
                    c.hidden_size,
                    c.rms_norm_eps,
                    &linear.layer,
                )?),
                _ => Mixer::Attention(Attention::load(
                    weights,
                    quantization,
                    &format!("{p}.self_attn"),
                    c,
                    window,
                    shape,
                )?),
            };
            let inputs_normed = !c.style.output_norms_only;
            let sandwich = if c.style.sandwich_norms || c.style.output_norms_only {
                Some(SandwichNorms {
                    pre_feedforward_layernorm: inputs_normed
                        .then(|| norm(weights, &format!("{p}.pre_feedforward_layernorm")))
                        .transpose()?,
                    post_feedforward_layernorm: norm(
                        weights,
                        &format!("{p}.post_feedforward_layernorm"),
                    )?,
                })
            } else {
                None
            };
            let intermediate = if shares_kv && c.style.double_wide_shared_mlp {
                2 * c.intermediate_size
            } else {
                c.intermediate_size
            };
            let mlp = match &c.moe {
                Some(moe) if moe.style == MoeStyle::Gemma4 => {
                    FeedForward::MlpAndExperts(Box::new(MlpAndExperts::load(
                        weights,
                        quantization,
                        &p,
                        (c.hidden_size, intermediate, c.rms_norm_eps),
                        moe,
                    )?))
                }
                Some(moe) if moe.is_sparse_layer(i) => {
                    FeedForward::Sparse(Box::new(SparseMoe::load(
                        weights,
                        quantization,
                        &format!("{p}.mlp"),
                        c.hidden_size,
                        moe,
                    )?))
                }
                _ => FeedForward::Dense(
                    Mlp::load(
                        weights,
                        quantization,
                        &format!("{p}.mlp"),
                        c.hidden_size,
                        intermediate,
                        c.mlp_bias,
                    )?
                    .with_activation(c.style.activation),
                ),
            };
            let per_layer_gate = match c.per_layer_inputs {
                Some(per_layer) => Some(PerLayerGate {
                    // Every rank keeps these whole.
                    per_layer_input_gate: Linear::load_whole(
                        weights,
                        quantization,
                        &format!("{p}.per_layer_input_gate"),
                        c.hidden_size,
                        per_layer.hidden,
                        false,
                    )?,
                    per_layer_projection: Linear::load_whole(
                        weights,
                        quantization,
                        &format!("{p}.per_layer_projection"),
                        per_layer.hidden,
                        c.hidden_size,
                        false,
                    )?,
                    post_per_layer_input_norm: norm(
                        weights,
                        &format!("{p}.post_per_layer_input_norm"),
                    )?,
                }),
                None => None,
            };
            let layer_scalar = c
                .style
                .layer_scalar
                .then(|| weights.take_shaped(&format!("{p}.layer_scalar"), &[1]))
                .transpose()?;
            let cache =
                c.kv_source(i)
                    .expect("validated: every layer has a cache to read") as usize;
            let block = Block {
                mixer,
                mlp,
                input_layernorm: inputs_normed
                    .then(|| norm(weights, &format!("{p}.input_layernorm")))
                    .transpose()?,
                post_attention_layernorm: norm(weights, &format!("{p}.post_attention_layernorm"))?,
                sandwich,
                sliding,
                rope: !c.style.no_rope_layers.contains(&i),
                cache,
                shares_kv,
                per_layer_gate,
                layer_scalar,
            };
            layers.push(match division {
                Some(Division::Tensor(tp)) => {
                    let part = block.shard(tp, i as usize)?;
                    if let Some(deferred) = &deferred {
                        deferred.finish_layer()?;
                    }
                    part
                }
                _ => block,
            });
        }
        drop(deferred);
        let per_layer = match c.per_layer_inputs {
            Some(per_layer) => {
                let width = c.num_layers * per_layer.hidden;
                Some(PerLayerEmbedding {
                    embed_tokens_per_layer: Embedding::load_lookup_only(
                        weights,
                        quantization,
                        &format!("{prefix}model.embed_tokens_per_layer"),
                        per_layer.vocab_size,
                        width,
                    )?,
                    per_layer_model_projection: Linear::load(
                        weights,
                        quantization,
                        &format!("{prefix}model.per_layer_model_projection"),
                        c.hidden_size,
                        width,
                        false,
                    )?,
                    per_layer_projection_norm: RmsNorm::load_with_offset(
                        weights,
                        &format!("{prefix}model.per_layer_projection_norm"),
                        per_layer.hidden,
                        c.rms_norm_eps,
                        c.style.norm_unit_offset,
                    )?,
                    layers: c.num_layers,
                    hidden: per_layer.hidden,
                })
            }
            None => None,
        };
        let final_norm = norm(weights, &format!("{prefix}model.norm"))?;
        let lm_head = if c.tie_word_embeddings {
            weights.discard(&format!("{prefix}lm_head.weight"));
            None
        } else {
            Some(Linear::load(
                weights,
                quantization,
                &format!("{prefix}lm_head"),
                c.hidden_size,
                c.vocab_size,
                false,
            )?)
        };
        let info = ModelInfo {
            model_type: model_type.to_string(),
            vocab_size: c.vocab_size as usize,
            num_layers: first_shared as usize,
            num_kv_heads: c.num_kv_heads as usize,
            head_dim: c.head_dim as usize,
            context_length: c.context_length,
            hidden_size: c.hidden_size as usize,
            num_heads: c.num_heads as usize,
            mlp_width: c.mlp_width(),
        };
        let local_rope = sliding_window
            .and_then(|s| s.local_rope_theta)
            .map(|theta| Rope {
                // Over every feature of the sliding layers' heads (Gemma 4's are narrower than
                // its global ones).
                dims: c.head_dim,
                base: theta,
                scale: 1.0,
                freqs: None,
                mscale: 1.0,
                feature_scale: None,
                ..rope.clone()
            });
        let mut decoder = Self {
            embed_tokens,
            layers,
            norm: final_norm,
            lm_head,
            rope,
            local_rope,
            window: sliding_window
                .filter(|s| (0..c.num_layers).any(|i| s.is_sliding_layer(i)))
                .map(|s| s.window),
            embedding_scale: c.style.embedding_scale,
            features_after_scale: c.style.features_after_scale,
            clip_float16_residuals: c.style.clip_float16_residuals,
            query_position_scale: c.style.query_position_scale,
            mrope_sections: c.style.mrope_sections,
            per_layer,
            final_logit_softcap: c.style.final_logit_softcap,
            info,
            division: None,
            first_layer: 0,
            vision: None,
        };
        decoder.mark_divided(division, stage.map_or(0, |own| own.start));
        Ok(decoder)
    }

    /// Marks this decoder, whose blocks are already `division`'s part (the stage's, from layer
    /// `first_layer`), as divided: its caches numbered within the stage, its sizes the rank's.
    fn mark_divided(&mut self, division: Option<&Division>, first_layer: usize) {
        match division {
            Some(Division::Tensor(tp)) => {
                let n = tp.size();
                self.info.num_heads /= n;
                self.info.num_kv_heads /= n;
                self.info.mlp_width /= n;
            }
            Some(Division::Pipeline(_)) => {
                // Cache layers are numbered within the stage: block j's cache is j (no layer
                // shares another's).
                for (j, block) in self.layers.iter_mut().enumerate() {
                    block.cache = j;
                }
                self.info.num_layers = self.layers.len();
                self.first_layer = first_layer;
            }
            None => {}
        }
        self.division = division.cloned();
    }

    fn refuse_if_divided(&self) -> Result<()> {
        match self.division {
            Some(_) => Err(EngineError::Distributed(
                "this model is divided over ranks already".into(),
            )),
            None => Ok(()),
        }
    }

    fn kv_shared_refusal() -> EngineError {
        EngineError::Distributed(
            "layers that read another layer's keys and values (Gemma 4) are not split into \
             stages yet"
                .into(),
        )
    }

    /// This decoder with a vision-language checkpoint's vision tower, or the reason it was not
    /// loaded ([`super::Resolved::vision`]).
    pub fn with_vision(mut self, vision: Option<std::result::Result<VisionTower, String>>) -> Self {
        self.vision = vision;
        self
    }
}

impl Decoder {
    /// Embeddings and every block with `mix(layer index, mixer, normed input, rope)` mixing its
    /// positions: token ids `[batch, seq]` → the last block's hidden states `[batch, seq,
    /// hidden]` (logits come from [`Decoder::head`]).
    fn run(
        &self,
        ids: &Array,
        spliced: Option<&Spliced>,
        mut mix: impl FnMut(&Block, &Array, Option<&Rope>) -> Result<Array>,
    ) -> Result<Array> {
        let mut h = self.embed_tokens.forward(ids)?;
        let features = spliced.and_then(|s| s.features.as_ref());
        // The features replace their tokens' embeddings (mlx-vlm's masked scatter), before the
        // embedding scale or after it ([`BlockStyle::features_after_scale`]).
        let splice = |h: Array, (positions, features): &(Array, Array)| -> Result<Array> {
            let shape = h.shape().to_vec();
            let hidden = shape[2];
            let n = positions.size() as i32;
            let flat = h.reshape(&[-1, hidden])?;
            let at = ops::broadcast_to(&positions.reshape(&[n, 1])?, &[n, hidden])?;
            let features = features.as_dtype(h.dtype())?;
            Ok(mlx_rs::ops::indexing::put_along_axis(&flat, &at, &features, 0)?.reshape(&shape)?)
        };
        if let Some(f) = features.filter(|_| !self.features_after_scale) {
            h = splice(h, f)?;
        }
        if let Some(scale) = self.embedding_scale {
            h = ops::multiply(&h, &Array::from_f32(scale).as_dtype(h.dtype())?)?;
        }
        if let Some(f) = features.filter(|_| self.features_after_scale) {
            h = splice(h, f)?;
        }
        let per_layer_inputs = match (&self.per_layer, features) {
            (Some(per_layer), None) => Some(per_layer.inputs(ids, &h)?),
            // Spliced tokens take token 0's per-layer embedding (mlx-vlm's Gemma 4).
            (Some(per_layer), Some((positions, _))) => {
                let n = positions.size() as i32;
                let zeros = Array::zeros::<u32>(&[n])?.as_dtype(ids.dtype())?;
                let text_ids = mlx_rs::ops::indexing::put_along_axis(
                    &ids.reshape(&[-1])?,
                    positions,
                    &zeros,
                    0,
                )?
                .reshape(ids.shape())?;
                Some(per_layer.inputs(&text_ids, &h)?)
            }
            (None, _) => None,
        };
        // A stage after the first receives the hidden states of the stage before it (the next
        // rank).
        if let Some(Division::Pipeline(pp)) = &self.division {
            if pp.rank() + 1 < pp.size() {
                h = pp.recv_like(&h, pp.rank() + 1)?;
            }
        }
        // The last block's feed-forward output not yet added to `h`: added by the next block's
        // input norm in one kernel where there is one (`RmsNorm::add_forward`).
        let mut pending: Option<Array> = None;
        for (j, layer) in self.layers.iter().enumerate() {
            let i = self.first_layer + j;
            let rope = match (&self.local_rope, layer.sliding) {
                _ if !layer.rope => None,
                (Some(local), true) => Some(local),
                _ => Some(&self.rope),
            };
            let x = match (&layer.input_layernorm, pending.take()) {
                (Some(norm), Some(r)) => {
                    let (sum, normed) = norm.add_forward(&h, &r)?;
                    h = sum;
                    normed
                }
                (Some(norm), None) => norm.forward(&h)?,
                (None, Some(r)) => {
                    h = ops::add(&h, &r)?;
                    h.clone()
                }
                (None, None) => h.clone(),
            };
            let r = self.ranks_sum(mix(layer, &x, rope)?)?;
            h = match &layer.sandwich {
                None => {
                    let norm = &layer.post_attention_layernorm;
                    let (h2, out) = match layer.mlp.add_norm_forward((&h, &r), norm)? {
                        Some(done) => done,
                        None => {
                            let (h2, x) = norm.add_forward(&h, &r)?;
                            let out = layer.mlp.forward(&x, &h2)?;
                            (h2, out)
                        }
                    };
                    pending = Some(self.ranks_sum(out)?);
                    h2
                }
                Some(norms) => {
                    let h2 = self.residual(&h, &layer.post_attention_layernorm.forward(&r)?)?;
                    let r = self.ranks_sum(match &norms.pre_feedforward_layernorm {
                        Some(norm) => layer.mlp.forward(&norm.forward(&h2)?, &h2)?,
                        None => layer.mlp.forward(&h2, &h2)?,
                    })?;
                    self.residual(&h2, &norms.post_feedforward_layernorm.forward(&r)?)?
                }
            };
            let per_layer_gate = layer.per_layer_gate.as_ref().zip(per_layer_inputs.as_ref());
            if per_layer_gate.is_some() || layer.layer_scalar.is_some() {
                if let Some(r) = pending.take() {
                    h = ops::add(&h, &r)?;
                }
            }
            if let Some((gate, inputs)) = per_layer_gate {
                h = gate.forward(&h, &PerLayerEmbedding::layer(inputs, i as i32)?)?;
            }
            if let Some(scalar) = &layer.layer_scalar {
                h = ops::multiply(&h, scalar)?;
            }
        }
        if let Some(r) = pending {
            h = ops::add(&h, &r)?;
        }
        if let Some(Division::Pipeline(pp)) = &self.division {
            // Each stage but the last (rank 0) hands its states on; rank 0's final states go to
            // every rank (the first rows of the gather), so that every rank computes the logits.
            if pp.rank() > 0 {
                h = pp.send(&h, pp.rank() - 1)?;
            }
            let rows = h.shape()[0];
            let gathered = pp.all_gather(&h)?;
            let mut stop = gathered.shape().to_vec();
            stop[0] = rows;
            h = slice(&gathered, &vec![0; stop.len()], &stop)?;
        }
        Ok(h)
    }

    /// A block part's output `[batch, seq, hidden]`: under tensor parallelism this rank's
    /// partial sum, added up over the ranks; otherwise as it is.
    fn ranks_sum(&self, part: Array) -> Result<Array> {
        match &self.division {
            Some(Division::Tensor(tp)) => tp.all_sum(&part),
            _ => Ok(part),
        }
    }

    /// Final norm and output projection: hidden states → logits `[.., vocab]`.
    fn head(&self, h: &Array) -> Result<Array> {
        let h = self.norm.forward(h)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&h)?,
            None => self.embed_tokens.as_linear(&h)?,
        };
        match self.final_logit_softcap {
            // tanh(x / cap) * cap, the cap a scalar of the logits' dtype (mlx_lm's
            // `logit_softcap`).
            Some(cap) => {
                let cap = Array::from_f32(cap).as_dtype(logits.dtype())?;
                Ok(ops::multiply(
                    &ops::tanh(&ops::divide(&logits, &cap)?)?,
                    &cap,
                )?)
            }
            None => Ok(logits),
        }
    }
}

impl Decoder {
    /// Multimodal RoPE's cosines and sines `[rows, 1, tokens, dims]` (float32) of each token's
    /// `[time, row, column]` positions `each` `[3, rows, tokens]` int32, over this model's RoPE
    /// (`dims`, `base`; [`BlockStyle::mrope_sections`] picks each frequency's axis), as mlx-vlm's
    /// `MRoPERotaryEmbedding` computes them (`1 / base^(2i / dims)` in float32).
    fn multimodal_angles(&self, sections: [i32; 3], each: &Array) -> Result<(Array, Array)> {
        let dims = self.rope.dims;
        let frequencies = dims / 2;
        let axis_of = |j: i32| match j % 3 {
            1 if j < 3 * sections[1] => 1,
            2 if j < 3 * sections[2] => 2,
            _ => 0,
        };
        let selector: Vec<i32> = (0..frequencies).map(axis_of).collect();
        let steps: Vec<f32> = (0..dims).step_by(2).map(|i| i as f32).collect();
        let inv_freq = ops::divide(
            Array::from_f32(1.0),
            ops::power(
                Array::from_f32(self.rope.base),
                ops::divide(
                    Array::from_slice(&steps, &[frequencies]),
                    Array::from_f32(dims as f32),
                )?,
            )?,
        )?;
        // [3, rows, tokens] → per frequency its axis's position: [rows, tokens, frequencies].
        let chosen = each
            .take_axis(Array::from_slice(&selector, &[frequencies]), 0)?
            .transpose_axes(&[1, 2, 0])?;
        let angles = ops::multiply(&chosen.as_dtype(Dtype::Float32)?, &inv_freq)?;
        let angles = ops::concatenate(&[angles.clone(), angles], -1)?.expand_dims(1)?;
        Ok((ops::cos(&angles)?, ops::sin(&angles)?))
    }

    /// `x + y`, in float32 and clipped to float16's range for float16 when the style says so
    /// (mlx_lm's `clip_residual`).
    fn residual(&self, x: &Array, y: &Array) -> Result<Array> {
        if !self.clip_float16_residuals || x.dtype() != Dtype::Float16 {
            return Ok(ops::add(x, y)?);
        }
        let sum = ops::add(&x.as_dtype(Dtype::Float32)?, &y.as_dtype(Dtype::Float32)?)?;
        let bound = Array::from_f32(65504.0);
        Ok(ops::clip(&sum, (&ops::negative(&bound)?, &bound))?.as_dtype(Dtype::Float16)?)
    }
}

impl Model for Decoder {
    fn forward(
        &self,
        ids: &Array,
        spliced: Option<&Spliced>,
        caches: &mut LayerCaches<'_>,
        output: Output,
    ) -> Result<Option<Array>> {
        let (rows, tokens) = (ids.shape()[0], ids.shape()[1]);
        let mut positions = caches.positions();
        if let (Some(sections), Some(each)) = (
            self.mrope_sections,
            spliced.and_then(|s| s.rope_positions.as_ref()),
        ) {
            let (cos, sin) = self.multimodal_angles(sections, each)?;
            positions = positions.rotated(cos, sin, tokens)?;
        }
        let query_scales = match (self.query_position_scale, positions.last(tokens)) {
            // Below `original` positions every scale is 1 (multiplying by it changes nothing).
            (Some(scale), Some(last)) if last as f32 + 1.0 <= scale.original => None,
            (Some(scale), _) => Some(scale.scales(&positions.queries(tokens)?)?),
            (None, _) => None,
        };
        // A large batched prompt pass is evaluated a few layers at a time (see
        // PREFILL_EVAL_LAYERS); never a decode step (one token a row), which MLX may be tracing
        // (`compiled.rs`).
        let in_parts = matches!(caches, LayerCaches::Slots { .. })
            && tokens > 1
            && (rows * tokens) as usize >= PREFILL_EVAL_TOKENS;
        // The last part dispatched: waited for once the next one is dispatched, so the device
        // always has a part to run while the host builds the next.
        let mut dispatched: Option<Array> = None;
        let h = self.run(ids, spliced, |layer, x, rope| {
            let out = match &layer.mixer {
                Mixer::Attention(attn) => attn.forward(
                    x,
                    rope,
                    (&positions, query_scales.as_ref()),
                    caches,
                    layer.cache,
                )?,
                Mixer::Linear(net) => net.forward(x, caches, layer.cache)?,
            };
            if in_parts && (layer.cache + 1) % PREFILL_EVAL_LAYERS == 0 {
                if dispatched.is_none() {
                    // The pass before (pipelined prefill) is done before this one writes.
                    if let Some(slots) = caches.slots() {
                        slots.wait_for_pass_in_flight()?;
                    }
                }
                mlx_rs::transforms::async_eval([&out])?;
                if let Some(previous) = dispatched.replace(out.clone()) {
                    mlx_rs::transforms::eval([&previous])?;
                }
            }
            Ok(out)
        })?;
        match output {
            // A stage's caches do not depend on its send (the first stages') or the gather, so
            // evaluating them alone would leave the next stage waiting, and a stage that then
            // went on would issue its next pass's hand-over before this one's: the ranks'
            // collectives would run in different orders and deadlock (a batch's block copies
            // evaluate each stage's own KV). So every pipeline pass evaluates its hand-over and
            // gather here, on every stage alike (mlx_lm ties the send to the last cache with
            // `depends`). Pipeline stages never run traced (compiled) steps, where an
            // evaluation cannot happen.
            Output::Logits if matches!(self.division, Some(Division::Pipeline(_))) => {
                h.eval()?;
                Ok(Some(self.head(&h)?))
            }
            Output::Logits => Ok(Some(self.head(&h)?)),
            Output::CacheOnly if matches!(self.division, Some(Division::Pipeline(_))) => {
                h.eval()?;
                Ok(None)
            }
            Output::CacheOnly => Ok(None),
        }
    }

    fn shard(&mut self, tp: &TensorParallel) -> Result<()> {
        self.refuse_if_divided()?;
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, block)| block.shard(tp, i))
            .collect::<Result<Vec<Block>>>()?;
        self.layers = layers;
        self.mark_divided(Some(&Division::Tensor(tp.clone())), 0);
        Ok(())
    }

    fn pipeline(&mut self, pp: &PipelineParallel) -> Result<()> {
        self.refuse_if_divided()?;
        if self.layers.iter().any(|block| block.shares_kv) {
            return Err(Self::kv_shared_refusal());
        }
        let kinds: Vec<_> = self
            .layers
            .iter()
            .map(|block| (block.sliding, matches!(block.mixer, Mixer::Linear(_))))
            .collect();
        let own = pp.layers(&kinds)?;
        self.layers = self.layers.drain(own.clone()).collect();
        self.mark_divided(Some(&Division::Pipeline(pp.clone())), own.start);
        Ok(())
    }

    fn division(&self) -> Option<&Division> {
        self.division.as_ref()
    }

    fn clone_for_compile(&self) -> Box<dyn Model> {
        let mut copy = self.clone();
        copy.embed_tokens.use_mlx_kernels();
        if let Some(head) = &mut copy.lm_head {
            head.use_mlx_kernels();
        }
        if let Some(per_layer) = &mut copy.per_layer {
            per_layer.use_mlx_kernels();
        }
        for block in &mut copy.layers {
            if let Some(gate) = &mut block.per_layer_gate {
                gate.use_mlx_kernels();
            }
            let attention = match &mut block.mixer {
                Mixer::Attention(attention) => attention,
                Mixer::Linear(net) => {
                    net.use_mlx_kernels();
                    // The whole step is traced: its recurrence too, not a compiled call inside.
                    net.compile_recurrence(false);
                    block.mlp.use_mlx_kernels();
                    continue;
                }
            };
            match &mut attention.qkv {
                Qkv::Separate {
                    q_proj,
                    k_proj,
                    v_proj,
                } => [q_proj, k_proj, v_proj]
                    .into_iter()
                    .for_each(Linear::use_mlx_kernels),
                Qkv::Fused(proj) | Qkv::QueriesOnly(proj) => proj.use_mlx_kernels(),
                Qkv::KeysAsValues { q_proj, k_proj } => {
                    q_proj.use_mlx_kernels();
                    k_proj.use_mlx_kernels();
                }
            }
            attention.o_proj.use_mlx_kernels();
            block.mlp.use_mlx_kernels();
        }
        Box::new(copy)
    }

    fn vision(&self) -> Option<&VisionTower> {
        self.vision.as_ref().and_then(|v| v.as_ref().ok())
    }

    fn vision_unavailable(&self) -> Option<&str> {
        self.vision
            .as_ref()
            .and_then(|v| v.as_ref().err().map(String::as_str))
    }

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn has_sliding_window_layers(&self) -> bool {
        self.window.is_some()
    }

    fn has_recurrent_layers(&self) -> bool {
        self.layers
            .iter()
            .any(|block| matches!(block.mixer, Mixer::Linear(_)))
    }

    fn compile_recurrence(&mut self, on: bool) {
        for block in &mut self.layers {
            if let Mixer::Linear(net) = &mut block.mixer {
                net.compile_recurrence(on);
            }
        }
    }

    fn make_cache(&self, quantization: Option<KvQuantization>) -> Vec<KvCache> {
        self.layers
            .iter()
            .filter(|block| !block.shares_kv)
            .map(|block| match block.mixer {
                Mixer::Linear(ref linear) => {
                    KvCache::recurrent().with_state_shapes(linear.config().state_shapes())
                }
                Mixer::Attention(ref attention) => {
                    let cache = KvCache::with_quantization(quantization)
                        .with_head_shape(attention.num_kv_heads, attention.head_dim);
                    match attention.window {
                        Some(window) => cache.with_window(window),
                        None => cache,
                    }
                }
            })
            .collect()
    }
}
