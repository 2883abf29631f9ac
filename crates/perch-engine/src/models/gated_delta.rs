//! Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks"), the linear
//! attention of Qwen3-Next and Qwen3.5's hybrid layers, written op for op like mlx-lm's
//! `models/qwen3_5.py` (`GatedDeltaNet`) and `models/gated_delta.py` (`gated_delta_ops`, the
//! sequential form mlx_lm runs on CPU and CUDA; Metal has a kernel in mlx_lm that Perch does not
//! have yet).
//!
//! Per token, with `S` the state `[value_heads, value_dim, key_dim]` (float32):
//! `S ← g·S; S ← S + β·(v − S·k) ⊗ k; y = S·q`, where `g = exp(−exp(A_log)·softplus(a + dt_bias))`
//! and `β = sigmoid(b)` come from the input, and `q`, `k`, `v` from a short causal depthwise
//! convolution (`kernel` taps) over the projected input, `q` and `k` L2-normalised (q also
//! scaled by `key_dim^-½`). The output is RMS-normed, gated by `silu(z)` and projected back.
//! The state after a sequence's tokens lives in its cache ([`crate::kv::cache::KvCache::recurrent`], or
//! a row of a slot cache).

use std::cell::RefCell;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{fast, nn, ops, Array, Dtype};

use crate::attention::gated_delta_kernel;
use crate::device::Backend;
use crate::distributed::TensorParallel;
use crate::error::{EngineError, Result};
use crate::kv::cache::RecurrentState;
use crate::kv::slot_cache::{RealTokens, StateReplay};
use crate::kv::LayerCaches;
use crate::models::within;
use crate::nn::layers::{Linear, Quantization, Shard, ShardParts};
use crate::nn::mlx_ext::slice;
use crate::nn::norm_kernel;
use crate::nn::weights::Weights;

/// The sizes of a Gated DeltaNet layer (Qwen3.5's `linear_*` config fields).
#[derive(Debug, Clone, PartialEq)]
pub struct GatedDeltaConfig {
    pub num_value_heads: i32,
    pub num_key_heads: i32,
    pub key_head_dim: i32,
    pub value_head_dim: i32,
    /// Taps of the causal depthwise convolution (`linear_conv_kernel_dim`).
    pub conv_kernel: i32,
}

impl GatedDeltaConfig {
    const MAX_HEADS: i32 = 1024;
    const MAX_HEAD_DIM: i32 = 1024;
    const MAX_KERNEL: i32 = 64;

    /// Checks the sizes before anything is built from them; errors name the config field.
    pub fn validate(&self) -> std::result::Result<(), String> {
        within(
            "linear_num_value_heads",
            self.num_value_heads,
            Self::MAX_HEADS,
        )?;
        within("linear_num_key_heads", self.num_key_heads, Self::MAX_HEADS)?;
        within("linear_key_head_dim", self.key_head_dim, Self::MAX_HEAD_DIM)?;
        within(
            "linear_value_head_dim",
            self.value_head_dim,
            Self::MAX_HEAD_DIM,
        )?;
        within("linear_conv_kernel_dim", self.conv_kernel, Self::MAX_KERNEL)?;
        if self.num_value_heads % self.num_key_heads != 0 {
            return Err(format!(
                "`linear_num_value_heads` ({}) must be a multiple of `linear_num_key_heads` ({})",
                self.num_value_heads, self.num_key_heads
            ));
        }
        Ok(())
    }

    fn key_dim(&self) -> i32 {
        self.num_key_heads * self.key_head_dim
    }

    fn value_dim(&self) -> i32 {
        self.num_value_heads * self.value_head_dim
    }

    /// Channels of the convolution: queries, keys and values.
    fn conv_dim(&self) -> i32 {
        2 * self.key_dim() + self.value_dim()
    }

    /// One sequence's state shapes: the convolution's last inputs `[1, kernel - 1, conv_dim]`
    /// and the recurrence's `[1, value_heads, value_head_dim, key_head_dim]` (float32).
    pub fn state_shapes(&self) -> [Vec<i32>; 2] {
        [
            vec![1, self.conv_kernel - 1, self.conv_dim()],
            vec![
                1,
                self.num_value_heads,
                self.value_head_dim,
                self.key_head_dim,
            ],
        ]
    }
}

/// One Gated DeltaNet layer's weights.
#[derive(Clone)]
pub struct GatedDeltaNet {
    in_proj: InputProjections,
    core: Core,
    norm_weight: Array,
    norm_eps: f32,
    out_proj: Linear,
}

/// The part of a layer between its input projections and its output gate (mlx_lm's
/// `GatedDeltaNet.__call__` from the convolution through the recurrence): in one kernel where
/// it can ([`gated_delta_kernel`]), as operations otherwise.
#[derive(Clone)]
struct Core {
    /// `[conv_dim, kernel, 1]` (MLX's layout: out channels, taps, in channels per group).
    conv1d: Array,
    dt_bias: Array,
    /// `-exp(A_log)` in float32, `[value_heads]`, computed at load (the same number mlx_lm
    /// computes every call; two operations fewer a layer and step).
    neg_decay_rate: Array,
    c: GatedDeltaConfig,
    /// Run each token's recurrence step through MLX's compiler ([`recurrence_step`]).
    compiled: bool,
    /// Run the core through [`gated_delta_kernel`] where it applies ([`kernel_usable`]).
    kernel: bool,
}

/// A layer's four input projections — queries, keys and values (`in_proj_qkv`), the output
/// gate (`in_proj_z`), `b` and `a` — separate, or fused at load into one matmul where
/// [`Linear::fuse_if_enabled`] does (GPUs: a decode step is bound by launching its kernels).
#[derive(Clone)]
enum InputProjections {
    Separate([Linear; 4]),
    /// Outputs side by side, in that order; `widths` are each part's.
    Fused {
        proj: Linear,
        widths: [i32; 4],
    },
}

impl InputProjections {
    /// `parts` of `widths` outputs each.
    fn load(parts: [Linear; 4], widths: [i32; 4]) -> Result<Self> {
        Ok(match Linear::fuse_if_enabled(parts)? {
            Ok(proj) => InputProjections::Fused { proj, widths },
            Err(parts) => InputProjections::Separate(parts),
        })
    }

    fn use_mlx_kernels(&mut self) {
        match self {
            InputProjections::Separate(parts) => parts.iter_mut().for_each(Linear::use_mlx_kernels),
            InputProjections::Fused { proj, .. } => proj.use_mlx_kernels(),
        }
    }

    /// `x` `[..., hidden]` → the four projections, `[..., width]` each (slices, views, of one
    /// product when fused), and where the second (`z`) lies: the product it is a slice of and
    /// its offset in each row (`z` itself at 0 when separate).
    fn forward(&self, x: &Array) -> Result<([Array; 4], (Array, i32))> {
        match self {
            InputProjections::Separate([qkv, z, b, a]) => {
                let z = z.forward(x)?;
                Ok((
                    [qkv.forward(x)?, z.clone(), b.forward(x)?, a.forward(x)?],
                    (z, 0),
                ))
            }
            InputProjections::Fused { proj, widths } => {
                let all = proj.forward(x)?;
                let shape = all.shape().to_vec();
                let last = shape.len() - 1;
                let mut from = 0;
                let mut part = |width: i32| -> Result<Array> {
                    let (mut start, mut stop) = (vec![0; shape.len()], shape.clone());
                    (start[last], stop[last]) = (from, from + width);
                    from += width;
                    Ok(slice(&all, &start, &stop)?)
                };
                let parts = [
                    part(widths[0])?,
                    part(widths[1])?,
                    part(widths[2])?,
                    part(widths[3])?,
                ];
                Ok((parts, (all, widths[0])))
            }
        }
    }
}

/// One token's recurrence for every row and value head (mlx_lm's `_gated_delta_step_ops`):
/// inputs `state [B, hv, dv, dk]` (float32), `q`, `k [B, hv, dk]`, `v [B, hv, dv]`, `g`, `beta
/// [B, hv]`; outputs `y [B, hv, dv]` (in q's dtype) and the new state. The state decays by `g`,
/// then moves toward `v` along `k` by `beta` (the delta rule), and `q` reads it.
fn recurrence_step(inputs: &[Array]) -> std::result::Result<Vec<Array>, Exception> {
    let [state, q, k, v, g, beta] = inputs else {
        return Err(Exception::custom("a recurrence step takes 6 arrays"));
    };
    let &[batch, hv, dv, dk] = state.shape() else {
        return Err(Exception::custom(
            "a recurrent state is [rows, heads, dv, dk]",
        ));
    };
    let state = ops::multiply(state, &g.reshape(&[batch, hv, 1, 1])?)?;
    let k_row = k.reshape(&[batch, hv, 1, dk])?;
    let kv_mem = ops::multiply(&state, &k_row)?.sum_axis(-1, None)?;
    let delta = ops::multiply(&ops::subtract(v, &kv_mem)?, &beta.reshape(&[batch, hv, 1])?)?;
    let state = ops::add(
        &state,
        &ops::multiply(&k_row, &delta.reshape(&[batch, hv, dv, 1])?)?,
    )?;
    let y = ops::multiply(&state, &q.reshape(&[batch, hv, 1, dk])?)?
        .sum_axis(-1, None)?
        .as_dtype(q.dtype())?;
    Ok(vec![y, state])
}

type StepFn = Box<dyn FnMut(&[Array]) -> std::result::Result<Vec<Array>, Exception>>;

thread_local! {
    /// [`recurrence_step`] through MLX's compiler: one function for every layer (it captures
    /// no weights), traced once per shape (rows, heads, head sizes, dtype).
    static COMPILED_STEP: RefCell<Option<StepFn>> = const { RefCell::new(None) };
}

fn compiled_recurrence_step(inputs: &[Array]) -> Result<Vec<Array>> {
    COMPILED_STEP.with(|step| {
        let mut step = step.borrow_mut();
        let step = step.get_or_insert_with(|| Box::new(compile(recurrence_step, false)));
        Ok(step(inputs)?)
    })
}

/// The recurrence a step per token ([`Core::run_ops`]): `q`, `k` `[B, T, hk, dk]`, `v` `[B, T,
/// hv, dv]`, `g`, `beta` `[B, T, hv]`, `state` `[B, hv, dv, dk]` float32 → `y` `[B, T, hv, dv]`
/// and the state after the last token.
fn recurrence_steps(
    q: Array,
    k: Array,
    v: Array,
    g: Array,
    beta: Array,
    mut state: Array,
    compiled: bool,
) -> Result<(Array, Array)> {
    let [batch, seq, hk, dk] = q.shape()[..] else {
        unreachable!("q is [B, T, hk, dk]")
    };
    let hv = v.shape()[2];
    // Key heads serve `hv / hk` value heads each, consecutively (mlx_lm's mx.repeat).
    let repeat = hv / hk;
    let widen = |t: Array| -> Result<Array> {
        if repeat == 1 {
            return Ok(t);
        }
        Ok(
            ops::broadcast_to(t.expand_dims(3)?, &[batch, seq, hk, repeat, dk])?
                .reshape(&[batch, seq, hv, dk])?,
        )
    };
    let (q, k) = (widen(q)?, widen(k)?);
    let at = |t: &Array, i: i32| -> Result<Array> {
        let s = t.shape();
        let mut start = vec![0; s.len()];
        let mut stop = s.to_vec();
        start[1] = i;
        stop[1] = i + 1;
        let mut squeezed = s.to_vec();
        squeezed.remove(1);
        Ok(slice(t, &start, &stop)?.reshape(&squeezed)?)
    };
    let mut ys = Vec::with_capacity(seq as usize);
    for t in 0..seq {
        let inputs = [
            state,
            at(&q, t)?,
            at(&k, t)?,
            at(&v, t)?,
            at(&g, t)?,
            at(&beta, t)?,
        ];
        let mut outputs = match compiled {
            true => compiled_recurrence_step(&inputs)?,
            false => recurrence_step(&inputs)?,
        };
        state = outputs.pop().expect("y and the state");
        ys.push(outputs.pop().expect("y"));
    }
    Ok((ops::stack(&ys, 1)?, state))
}

/// One random case of a layer's core through [`gated_delta_kernel::gated_delta`] and through
/// the operations in float32: padded tokens (the last token of every row but the first), `qkv`,
/// `a` and `b` strided (slices of one product, as the fused projection gives them), value heads
/// sharing key heads.
struct KernelCase {
    /// Largest |error| of the output, the recurrent state and the conv state.
    y_error: f32,
    state_error: f32,
    conv_error: f32,
    /// The case's core (in `dtype`) and inputs, for timing.
    core: Core,
    inputs: [Array; 3],
    state: RecurrentState,
    real: Option<RealTokens>,
}

impl KernelCase {
    /// (rows, tokens, key heads, value heads, dk, dv, taps): random inputs from `seed` (MLX's
    /// global random state is left as it was). With `padded` (always when a row has several
    /// tokens) every row but the first feeds one token fewer than the pass: a prompt chunk's
    /// padding, or, at one token, rows that feed nothing (a draft's rows idle in a round).
    fn run(
        sizes: (i32, i32, i32, i32, i32, i32, i32),
        dtype: Dtype,
        seed: u64,
        padded: bool,
    ) -> Result<Self> {
        let (rows, tokens, hk, hv, dk, dv, taps) = sizes;
        let key = |i: u64| mlx_rs::random::key(seed * 8 + i);
        let normal = |shape: &[i32], scale: f32, i: u64| -> Result<Array> {
            Ok(
                mlx_rs::random::normal::<f32>(shape, None, None, Some(&key(i)?))?
                    .multiply(Array::from_f32(scale))?,
            )
        };
        let c = GatedDeltaConfig {
            num_value_heads: hv,
            num_key_heads: hk,
            key_head_dim: dk,
            value_head_dim: dv,
            conv_kernel: taps,
        };
        let channels = c.conv_dim();
        let wide = normal(&[rows, tokens, channels + 2 * hv], 1.0, 0)?;
        // `qkv`, `b` and `a`: strided slices of one product, as the fused projection gives them.
        let split = |wide: &Array| -> Result<[Array; 3]> {
            let part = |from: i32, to: i32| slice(wide, &[0, 0, from], &[rows, tokens, to]);
            Ok([
                part(0, channels)?,
                part(channels, channels + hv)?,
                part(channels + hv, channels + 2 * hv)?,
            ])
        };
        let inputs = split(&wide)?;
        let core = Core {
            conv1d: normal(&[channels, taps, 1], 0.5, 1)?,
            dt_bias: normal(&[hv], 1.0, 2)?,
            neg_decay_rate: ops::negative(&ops::exp(&normal(&[hv], 0.5, 3)?)?)?,
            c,
            compiled: false,
            kernel: false,
        };
        let state = RecurrentState {
            conv: normal(&[rows, taps - 1, channels], 1.0, 4)?,
            ssm: normal(&[rows, hv, dv, dk], 0.1, 5)?,
        };
        let real = (tokens > 1 || padded).then(|| -> Result<RealTokens> {
            let counts: Vec<i32> = (0..rows).map(|r| tokens - (r > 0) as i32).collect();
            let counts = Array::from_slice(&counts, &[rows]);
            let mask = ops::lt(
                &ops::arange::<_, i32>(0, tokens, None)?.reshape(&[1, -1])?,
                &counts.reshape(&[-1, 1])?,
            )?;
            Ok(RealTokens { counts, mask })
        });
        let real = real.transpose()?;
        let (y_ref, state_ref) = core.run_ops(
            &inputs[0],
            &inputs[1],
            &inputs[2],
            state.clone(),
            real.as_ref(),
        )?;
        // The same numbers in `dtype` (the recurrent state stays float32), through the kernel.
        let cast = |a: &Array| a.as_dtype(dtype);
        let core = Core {
            conv1d: cast(&core.conv1d)?,
            dt_bias: cast(&core.dt_bias)?,
            kernel: true,
            ..core
        };
        let inputs = split(&cast(&wide)?)?;
        let state = RecurrentState {
            conv: cast(&state.conv)?,
            ssm: state.ssm,
        };
        let out = gated_delta_kernel::gated_delta(
            &core.kernel_inputs(&inputs[0], &inputs[1], &inputs[2], &state, real.as_ref()),
            &core.kernel_weights(),
        )?;
        let f32 = |a: &Array| a.as_dtype(Dtype::Float32);
        let error = |a: &Array, b: &Array| -> Result<f32> {
            Ok(ops::abs(&ops::subtract(&f32(a)?, &f32(b)?)?)?
                .max(None)?
                .item_exact::<f32>())
        };
        Ok(Self {
            y_error: error(&out.y, &y_ref)?,
            state_error: error(&out.state, &state_ref.ssm)?,
            conv_error: error(&out.conv_state, &state_ref.conv)?,
            core,
            inputs,
            state,
            real,
        })
    }

    fn within(&self, tolerance: f32) -> bool {
        // NaN is never within.
        [self.y_error, self.state_error, self.conv_error]
            .iter()
            .all(|e| *e <= tolerance)
    }
}

/// Whether a layer's core runs through [`gated_delta_kernel`] in this process: on a GPU backend
/// where it is on ([`gated_delta_kernel::backend`]), once it has given the operations' results
/// on a small float32 case ([`kernel_self_test`]).
pub fn kernel_usable() -> bool {
    kernel_self_test().is_ok()
}

/// The small check behind [`kernel_usable`], run once per process at the first model load: 2
/// rows of 3 tokens in float32, the second row padded (a prefill pass), and 2 rows of one token
/// in bfloat16 (a decode step); 2 key and 4 value heads, dk 32, dv 16, 4 taps; tolerances 1e-3
/// and 5e-2. `Err` says why the kernel is not used (no GPU backend, turned off, a failure to
/// compile or run, or results outside the tolerance). The Metal source has not run on a Mac in
/// this project's tests: this is what keeps a broken build of it from serving wrong tokens
/// there. (Other dtypes of each form compile at their first use.)
pub fn kernel_self_test() -> &'static std::result::Result<(), String> {
    static RESULT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    RESULT.get_or_init(|| {
        if gated_delta_kernel::backend().is_none() {
            return Err("no GPU backend, or PERCH_GATED_DELTA_KERNEL=0".into());
        }
        let cases = [
            ((2, 3, 2, 4, 32, 16, 4), Dtype::Float32, 1e-3),
            ((2, 1, 2, 4, 32, 16, 4), Dtype::Bfloat16, 5e-2),
        ];
        for (sizes, dtype, tolerance) in cases {
            match KernelCase::run(sizes, dtype, 3, false) {
                Ok(case) if case.within(tolerance) => {}
                Ok(case) => {
                    return Err(format!(
                        "{dtype:?}, {} tokens: largest errors y {:.2e}, state {:.2e}, conv state \
                         {:.2e} against the operations",
                        sizes.1, case.y_error, case.state_error, case.conv_error
                    ))
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    })
}

/// Checks [`gated_delta_kernel::gated_delta`] against the operations (float32) on random inputs
/// ([`KernelCase`]): decode and prefill shapes, several dtypes. Returns the load check's
/// result, then one line per case; an error names the first case outside its tolerance. On a
/// GPU backend only (`perch check-kernels` on the device).
pub fn check_kernel() -> Result<Vec<String>> {
    use crate::nn::custom_kernel::time_call;
    if gated_delta_kernel::backend().is_none() {
        return Err(crate::EngineError::Request(
            "the Gated DeltaNet kernel runs on MLX's CUDA or Metal backend, with \
             PERCH_GATED_DELTA_KERNEL unset"
                .into(),
        ));
    }
    let mut lines = vec![match kernel_self_test() {
        Ok(()) => "Gated DeltaNet kernel: the load check passed".to_string(),
        Err(why) => {
            return Err(crate::EngineError::Kernel(format!(
                "Gated DeltaNet kernel: the load check failed: {why}"
            )))
        }
    }];
    // The last: a decode step whose rows but the first feed nothing (padded at one token).
    let cases = [
        ((1, 1, 16, 16, 128, 128, 4), Dtype::Bfloat16, false),
        ((32, 1, 16, 32, 128, 128, 4), Dtype::Bfloat16, false),
        ((4, 37, 8, 16, 128, 128, 4), Dtype::Float32, false),
        ((2, 300, 16, 16, 128, 128, 4), Dtype::Bfloat16, false),
        ((3, 20, 4, 8, 64, 96, 3), Dtype::Float16, false),
        ((8, 1, 16, 32, 128, 128, 4), Dtype::Bfloat16, true),
    ];
    for (seed, (sizes, dtype, padded)) in cases.into_iter().enumerate() {
        let case = KernelCase::run(sizes, dtype, seed as u64, padded)?;
        let tolerance = match dtype {
            Dtype::Float32 => 1e-3,
            Dtype::Float16 => 1e-2,
            _ => 5e-2,
        };
        let [qkv, a, b] = &case.inputs;
        let kernel_ms = time_call(&|| {
            let core = &case.core;
            let inputs = core.kernel_inputs(qkv, a, b, &case.state, case.real.as_ref());
            Ok(gated_delta_kernel::gated_delta(&inputs, &core.kernel_weights())?.y)
        })?;
        let ops_ms = time_call(&|| {
            let core = Core {
                compiled: true,
                ..case.core.clone()
            };
            Ok(core
                .run_ops(qkv, a, b, case.state.clone(), case.real.as_ref())?
                .0)
        })?;
        let (rows, tokens, hk, hv, dk, dv, taps) = sizes;
        let fed = match padded {
            true => format!("{tokens} tokens (the first row's; one fewer the others')"),
            false => format!("{tokens} tokens"),
        };
        let line = format!(
            "rows {rows}, {fed}, heads {hk}/{hv}, dk {dk}, dv {dv}, {taps} taps, \
             {dtype:?}: max |error| y {:.2e}, state {:.2e}, conv state {:.2e} (tolerance \
             {tolerance:.0e}); {kernel_ms:.3} ms a call against the operations' {ops_ms:.3} \
             (compiled recurrence steps)",
            case.y_error, case.state_error, case.conv_error
        );
        if !case.within(tolerance) {
            return Err(crate::EngineError::Kernel(format!(
                "Gated DeltaNet kernel: {line}"
            )));
        }
        lines.push(line);
    }
    Ok(lines)
}

impl Core {
    /// The kernel's view of a pass ([`gated_delta_kernel::CoreInputs`]).
    fn kernel_inputs<'a>(
        &self,
        qkv: &'a Array,
        a: &'a Array,
        b: &'a Array,
        state: &'a RecurrentState,
        real: Option<&'a RealTokens>,
    ) -> gated_delta_kernel::CoreInputs<'a> {
        gated_delta_kernel::CoreInputs {
            qkv,
            a,
            b,
            conv_state: &state.conv,
            state: &state.ssm,
            counts: real.map(|r| &r.counts),
        }
    }

    fn kernel_weights(&self) -> gated_delta_kernel::CoreWeights<'_> {
        gated_delta_kernel::CoreWeights {
            conv_weight: &self.conv1d,
            dt_bias: &self.dt_bias,
            neg_rate: &self.neg_decay_rate,
            key_heads: self.c.num_key_heads,
            key_head_dim: self.c.key_head_dim,
        }
    }

    /// `qkv` `[batch, seq, conv_dim]`, `a`, `b` `[batch, seq, value_heads]` from `state` → `y`
    /// `[batch, seq, value_heads, value_dim]` and the state after each row's real tokens (all
    /// `seq`, or with `real` the first `counts[r]` of row `r`: the padding after them neither
    /// moves the convolution's window nor updates the recurrence, a padded step's decay being
    /// 1 and its delta 0). In one kernel launch where this process can ([`kernel_usable`]) and
    /// [`gated_delta_kernel::computes`] it, as operations otherwise ([`Core::run_ops`]).
    fn run(
        &self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        state: RecurrentState,
        real: Option<&RealTokens>,
    ) -> Result<(Array, RecurrentState)> {
        // `kernel` already holds only on a GPU backend where the kernel passed its load check.
        if self.kernel {
            let inputs = self.kernel_inputs(qkv, a, b, &state, real);
            let weights = self.kernel_weights();
            if gated_delta_kernel::computes(&inputs, &weights) {
                let out = gated_delta_kernel::gated_delta(&inputs, &weights)?;
                let state = RecurrentState {
                    conv: out.conv_state,
                    ssm: out.state,
                };
                return Ok((out.y, state));
            }
        }
        self.run_ops(qkv, a, b, state, real)
    }

    /// [`Core::run`] as operations, op for op like mlx_lm: the convolution, the normalisations
    /// and gates, then the recurrence a step per token ([`recurrence_step`], through MLX's
    /// compiler where [`GatedDeltaNet::compile_recurrence`] says), as its `gated_delta_ops`.
    fn run_ops(
        &self,
        qkv: &Array,
        a: &Array,
        b: &Array,
        state: RecurrentState,
        real: Option<&RealTokens>,
    ) -> Result<(Array, RecurrentState)> {
        let s = qkv.shape();
        let (batch, seq) = (s[0], s[1]);
        let c = &self.c;
        let dtype = qkv.dtype();
        let (hv, dv) = (c.num_value_heads, c.value_head_dim);
        let (hk, dk) = (c.num_key_heads, c.key_head_dim);
        let keep = c.conv_kernel - 1;
        let RecurrentState {
            conv: conv_state,
            ssm: state,
        } = state;

        let conv_input = ops::concatenate(&[&conv_state, qkv], 1)?;
        let total = seq + keep;
        let new_conv = match real {
            // Each row's last `keep` inputs up to its real tokens: entries counts[r]..+keep.
            Some(real) => {
                let index = ops::add(
                    &real.counts.reshape(&[-1, 1, 1])?,
                    &ops::arange::<_, i32>(0, keep, None)?.reshape(&[1, -1, 1])?,
                )?;
                let index = ops::broadcast_to(&index, &[batch, keep, c.conv_dim()])?;
                conv_input.take_along_axis(&index, 1)?
            }
            None => slice(
                &conv_input,
                &[0, total - keep, 0],
                &[batch, total, c.conv_dim()],
            )?
            .contiguous()?,
        };
        let conv_out = nn::silu(ops::conv1d(
            &conv_input,
            &self.conv1d,
            1,
            0,
            1,
            c.conv_dim(),
        )?)?;

        let key_dim = c.key_dim();
        let channels = |from: i32, to: i32| slice(&conv_out, &[0, 0, from], &[batch, seq, to]);
        let q = channels(0, key_dim)?.reshape(&[batch, seq, hk, dk])?;
        let k = channels(key_dim, 2 * key_dim)?.reshape(&[batch, seq, hk, dk])?;
        let v = channels(2 * key_dim, c.conv_dim())?.reshape(&[batch, seq, hv, dv])?;

        // mlx_lm's normalize_qk: L2 norms through rms_norm (its eps scaled to match), with the
        // readout scale key_dim^-½ folded into q.
        let inv_scale = (dk as f32).powf(-0.5);
        let rms_eps = 1e-6 * inv_scale * inv_scale;
        let scalar = |v: f32| Array::from_f32(v).as_dtype(dtype);
        let q = ops::multiply(
            &scalar(inv_scale * inv_scale)?,
            &fast::rms_norm(&q, None, rms_eps)?,
        )?;
        let k = ops::multiply(&scalar(inv_scale)?, &fast::rms_norm(&k, None, rms_eps)?)?;

        let beta = ops::sigmoid(b)?;
        // g = exp(-exp(A_log) * softplus(a + dt_bias)), float32 (mlx_lm's compute_g).
        let g = ops::exp(&ops::multiply(
            &self.neg_decay_rate,
            &nn::softplus(ops::add(a, &self.dt_bias)?)?,
        )?)?;
        // Padding keeps the state: decay 1, delta 0.
        let (g, beta) = match real {
            Some(real) => {
                let mask = real.mask.reshape(&[batch, seq, 1])?;
                (
                    ops::select(&mask, &g, &Array::from_f32(1.0).as_dtype(g.dtype())?)?,
                    ops::select(&mask, &beta, &Array::from_f32(0.0).as_dtype(beta.dtype())?)?,
                )
            }
            None => (g, beta),
        };

        let (y, state) = recurrence_steps(q, k, v, g, beta, state, self.compiled)?;
        Ok((
            y,
            RecurrentState {
                conv: new_conv,
                ssm: state,
            },
        ))
    }
}

impl GatedDeltaNet {
    /// Loads `{path}.*` (mlx-community names: `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
    /// `in_proj_a`, `conv1d.weight`, `dt_bias`, `A_log`, `norm.weight`, `out_proj`).
    pub fn load(
        w: &mut Weights,
        q: &Quantization,
        path: &str,
        hidden: i32,
        eps: f32,
        c: &GatedDeltaConfig,
    ) -> Result<Self> {
        let linear = |w: &mut Weights, name: &str, inputs: i32, outputs: i32| {
            Linear::load(w, q, &format!("{path}.{name}"), inputs, outputs, false)
        };
        let hv = c.num_value_heads;
        Ok(Self {
            in_proj: InputProjections::load(
                [
                    linear(w, "in_proj_qkv", hidden, c.conv_dim())?,
                    linear(w, "in_proj_z", hidden, c.value_dim())?,
                    linear(w, "in_proj_b", hidden, hv)?,
                    linear(w, "in_proj_a", hidden, hv)?,
                ],
                [c.conv_dim(), c.value_dim(), hv, hv],
            )?,
            core: Core {
                conv1d: w.take_shaped(
                    &format!("{path}.conv1d.weight"),
                    &[c.conv_dim(), c.conv_kernel, 1],
                )?,
                dt_bias: w.take_shaped(&format!("{path}.dt_bias"), &[hv])?,
                neg_decay_rate: {
                    let a_log = w.take_shaped(&format!("{path}.A_log"), &[hv])?;
                    let rate = ops::negative(&ops::exp(&a_log.as_dtype(Dtype::Float32)?)?)?;
                    rate.eval()?;
                    rate
                },
                c: c.clone(),
                compiled: Backend::current() != Backend::Cpu,
                kernel: kernel_usable(),
            },
            norm_weight: w.take_shaped(&format!("{path}.norm.weight"), &[c.value_head_dim])?,
            norm_eps: eps,
            out_proj: linear(w, "out_proj", c.value_dim(), hidden)?,
        })
    }

    pub fn config(&self) -> &GatedDeltaConfig {
        &self.core.c
    }

    /// Rank `tp.rank()`'s part (mlx_lm's Qwen3.5 `shard`): its share of the key and value heads,
    /// so of the query, key and value projection and convolution channels (each of the three
    /// parts divided), of the output gate, `b`, `a` and the decay rates; the output projection
    /// by inputs ([`Linear::shard_to_all`]), whose output is then a partial sum. Each rank's
    /// value heads read its own key heads, as they do whole (value head `j` reads key head `j /
    /// (value heads / key heads)`). The recurrent states it keeps are its heads'.
    pub fn shard(&self, tp: &TensorParallel) -> Result<Self> {
        let (rank, size) = (tp.rank(), tp.size());
        let whole = &self.core.c;
        let c = GatedDeltaConfig {
            num_key_heads: tp.part("linear-attention key heads", whole.num_key_heads)?,
            num_value_heads: tp.part("linear-attention value heads", whole.num_value_heads)?,
            ..whole.clone()
        };
        let (key_dim, value_dim, hv) = (whole.key_dim(), whole.value_dim(), whole.num_value_heads);
        let channels = [key_dim, key_dim, value_dim];
        let out = |proj: &Linear, segments: &[i32]| {
            proj.shard_segments(Shard::Outputs, segments, rank, size)
        };
        let in_proj = match &self.in_proj {
            // Fused as at load (parts read unfused are fused once divided).
            InputProjections::Separate([qkv, z, b, a]) => {
                let parts = [
                    out(qkv, &channels)?,
                    out(z, &[value_dim])?,
                    out(b, &[hv])?,
                    out(a, &[hv])?,
                ];
                let widths = [&parts[0], &parts[1], &parts[2], &parts[3]].map(|p| p.features().1);
                InputProjections::load(parts, widths)?
            }
            InputProjections::Fused { proj, widths } => InputProjections::Fused {
                proj: out(proj, &[key_dim, key_dim, value_dim, value_dim, hv, hv])?,
                widths: widths.map(|w| w / size as i32),
            },
        };
        let part = |a: &Array, segments: &[i32]| -> Result<Array> {
            let divided = segments.iter().sum();
            ShardParts::new(segments, divided, rank, size)
                .map_err(EngineError::Distributed)?
                .take(a, 0, (1, 1))
        };
        Ok(Self {
            in_proj,
            core: Core {
                conv1d: part(&self.core.conv1d, &channels)?,
                dt_bias: part(&self.core.dt_bias, &[hv])?,
                neg_decay_rate: part(&self.core.neg_decay_rate, &[hv])?,
                c,
                ..self.core.clone()
            },
            norm_weight: self.norm_weight.clone(),
            norm_eps: self.norm_eps,
            out_proj: self.out_proj.shard_to_all(rank, size)?,
        })
    }

    /// Runs each token's recurrence step through MLX's compiler (fused into a few kernels, as
    /// mlx_lm's `@mx.compile` does) or as separate operations. On by default on GPUs, where
    /// each operation is a kernel launch; off on CPU, where MLX's compiler would build its fused
    /// kernels with the system's C++ compiler.
    pub fn compile_recurrence(&mut self, on: bool) {
        self.core.compiled = on;
    }

    /// Every product through MLX's operations (see [`Linear::use_mlx_kernels`]).
    pub fn use_mlx_kernels(&mut self) {
        self.in_proj.use_mlx_kernels();
        self.out_proj.use_mlx_kernels();
    }

    /// `x` `[rows, tokens, hidden]` → `[rows, tokens, hidden]`: each row's state before these
    /// tokens is cache layer `layer`'s of `caches` (none yet: zeros), and the state after its real
    /// tokens replaces it (a padded row's padding leaves it as it was,
    /// [`LayerCaches::real_tokens`]).
    pub fn forward(&self, x: &Array, caches: &mut LayerCaches<'_>, layer: usize) -> Result<Array> {
        let state = match caches.recurrent_state(layer) {
            Some(state) => state,
            None => {
                let (conv, ssm) = self.state_shapes(x.shape()[0]);
                RecurrentState {
                    conv: ops::zeros_dtype(&conv, x.dtype())?,
                    ssm: ops::zeros_dtype(&ssm, Dtype::Float32)?,
                }
            }
        };
        let before = state.clone();
        let (out, state, [qkv, a, b]) = self.mix(x, state, caches.real_tokens())?;
        caches.set_recurrent_state(layer, state, x.shape()[1]);
        caches.keep_replay(layer, || {
            Box::new(Replay {
                core: self.core.clone(),
                inputs: [qkv, a, b],
                before,
            })
        });
        Ok(out)
    }

    /// The state shapes of `rows` rows: the convolution's `[rows, kernel - 1, conv_dim]` and the
    /// recurrence's `[rows, value_heads, value_dim, key_dim]`.
    fn state_shapes(&self, rows: i32) -> (Vec<i32>, Vec<i32>) {
        let c = &self.core.c;
        (
            vec![rows, c.conv_kernel - 1, c.conv_dim()],
            vec![rows, c.num_value_heads, c.value_head_dim, c.key_head_dim],
        )
    }

    /// The layer over `x` `[batch, seq, hidden]` from `state` (`[batch, ..]`) → its output
    /// `[batch, seq, hidden]`, the state after each row's real tokens ([`Core::run`]) and the
    /// core's inputs `qkv`, `a`, `b` (what a [`Replay`] keeps).
    fn mix(
        &self,
        x: &Array,
        state: RecurrentState,
        real: Option<&RealTokens>,
    ) -> Result<(Array, RecurrentState, [Array; 3])> {
        let s = x.shape();
        let (batch, seq) = (s[0], s[1]);
        let c = &self.core.c;
        let (hv, dv) = (c.num_value_heads, c.value_head_dim);

        let ([qkv, z, b, a], (z_source, z_offset)) = self.in_proj.forward(x)?;
        let (y, new_state) = self.core.run(&qkv, &a, &b, state, real)?;

        // RMSNormGated: rms_norm(y) · silu(z), both in float32, back in y's dtype; on CUDA in
        // one kernel reading z in the projection's output.
        let (weight, eps) = (&self.norm_weight, self.norm_eps);
        let gated = match norm_kernel::enabled()
            && norm_kernel::computes_gated(&y, &z_source, z_offset, weight)
        {
            true => norm_kernel::rms_norm_gated(&y, (&z_source, z_offset), weight, eps)?,
            false => {
                let z = z.reshape(&[batch, seq, hv, dv])?;
                norm_kernel::rms_norm_gated_ops(&y, &z, weight, eps)?.reshape(&[
                    batch,
                    seq,
                    c.value_dim(),
                ])?
            }
        };
        let out = self.out_proj.forward(&gated)?;
        Ok((out, new_state, [qkv, a, b]))
    }
}

/// One layer's part of a step recorded to be rewound ([`StateReplay`]): its core and the
/// step's inputs to it, `qkv` `[rows, tokens, conv_dim]`, `a` and `b` `[rows, tokens,
/// value_heads]`, and the state before the step.
struct Replay {
    core: Core,
    inputs: [Array; 3],
    before: RecurrentState,
}

impl StateReplay for Replay {
    /// The core over the same inputs from the same state, each row stopping after its first
    /// `real.counts[r]` tokens (the padding's rule): the state the step would have left had it
    /// fed only those.
    fn replay(&self, real: &RealTokens) -> Result<RecurrentState> {
        let [qkv, a, b] = &self.inputs;
        Ok(self.core.run(qkv, a, b, self.before.clone(), Some(real))?.1)
    }
}
