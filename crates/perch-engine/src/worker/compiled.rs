//! A slot-cache step compiled by MLX (`mx.compile`): the forward pass of
//! [`Model::forward`] over slot caches traced once per input shape and replayed after that, instead of
//! building its graph op by op from Rust every step.
//!
//! Why: a decode step of a small model on a GPU is bound by the host, not the device (the step
//! in flight finishes before the next is dispatched). MLX replays the traced graph in C++ and
//! fuses its elementwise chains (SwiGLU's `silu(gate) * up`, the mask and softmax of an explicit
//! read) into single kernels, so there is less to build and fewer kernels to launch (a 1.07B
//! Llama's step at one row: 2.1 ms compiled, 2.7 ms or more built op by op). MLX's CUDA backend
//! compiles fused kernels at run time (seconds, once per machine), which is why warm-up meets
//! every read a run will use.
//!
//! The function's inputs are the step's token ids, its arrays ([`SlotStep::arrays`]) and every
//! layer's buffers; its outputs the logits and the updated buffers, which replace the cache's
//! (the old ones are then referenced by the graph alone, so MLX updates them in place). The
//! weights are captured as constants of the trace: each [`CompiledSlotForward`] owns a copy of
//! the model (shared arrays, no memory) and compile ids of its own (one a traced function: with
//! and without the step's real tokens), erased from MLX's cache when it is dropped, so a
//! replaced model's weights are not kept alive by its traces. How a step reads its cache
//! ([`SlotKvCache::read`]) depends on the backend, the cache's setting and the buffers' shape
//! only, so one trace per shape is right for every call of that shape.
//!
//! Shapes are bucketed ([`crate::kv::slot_cache::row_bucket`], [`crate::kv::slot_cache::capacity_bucket`]),
//! so a run traces few of them.

use std::cell::RefCell;
use std::rc::Rc;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::Array;

use crate::device::Backend;
use crate::error::{EngineError, Result};
use crate::kv::slot_cache::{SlotKvCache, SlotStep};
use crate::kv::LayerCaches;
use crate::models::{Model, Output};

type StepFn = Box<dyn FnMut(&[Array]) -> std::result::Result<Vec<Array>, Exception>>;

/// `forward_slots` through MLX's compiler, for the slot caches of one setting (the
/// template's layers, quantization and attention setting).
pub(crate) struct CompiledSlotForward {
    /// The step whose tokens are all real, and the one whose step also says which are
    /// ([`SlotStep::real_tokens`]: a recurrent cache's padded rows, or rows that feed nothing),
    /// whose recurrent layers must not advance past them: two functions, as their inputs differ.
    steps_by_real: [StepFn; 2],
    /// The message of the trace's last failure: MLX reports only that the traced function
    /// failed.
    failure: Rc<RefCell<Option<String>>>,
    /// Steps run compiled so far.
    steps: usize,
}

impl CompiledSlotForward {
    /// Compiles `model`'s slot step for caches set up as `template`.
    pub fn new(model: &dyn Model, template: &SlotKvCache) -> Self {
        let model: Rc<dyn Model> = Rc::from(model.clone_for_compile());
        let template = Rc::new(template.empty_like());
        let failure = Rc::new(RefCell::new(None));
        let steps_by_real = [false, true]
            .map(|real| Self::step_fn(Rc::clone(&model), Rc::clone(&template), real, &failure));
        Self {
            steps_by_real,
            failure,
            steps: 0,
        }
    }

    /// The compiled step of [`CompiledSlotForward::new`], with the real tokens among its
    /// step's arrays or not.
    fn step_fn(
        model: Rc<dyn Model>,
        template: Rc<SlotKvCache>,
        real: bool,
        failure: &Rc<RefCell<Option<String>>>,
    ) -> StepFn {
        let step_arrays = template.step_arrays(real);
        let rings = template.has_rings();
        let failed = Rc::clone(failure);
        let trace = move |inputs: &[Array]| -> Result<Vec<Array>> {
            if inputs.len() < 1 + step_arrays {
                return Err(EngineError::from(Exception::custom(
                    "a compiled slot step takes ids, its step's arrays and buffers",
                )));
            }
            let (ids, rest) = (&inputs[0], &inputs[1..]);
            let (step, buffers) = rest.split_at(step_arrays);
            let mut cache = template.over_buffers(buffers);
            let read = cache.read(Backend::current(), ids.shape()[1] as usize);
            let step = SlotStep::with_arrays(step.to_vec(), read, rings);
            let logits = model
                .forward(
                    ids,
                    None,
                    &mut LayerCaches::Slots {
                        cache: &mut cache,
                        step: &step,
                    },
                    Output::Logits,
                )?
                .expect("logits were asked for");
            let mut outputs = vec![logits];
            outputs.extend(cache.into_buffers());
            Ok(outputs)
        };
        let traced = move |inputs: &[Array]| {
            trace(inputs).map_err(|e| {
                let message = e.to_string();
                *failed.borrow_mut() = Some(message.clone());
                Exception::custom(message)
            })
        };
        Box::new(compile(traced, false))
    }

    /// Decode steps run compiled so far (the others, before the cache had buffers, ran
    /// uncompiled).
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// As `forward_slots`: token ids `[rows, tokens]` → logits `[rows, tokens,
    /// vocab]`, slot `r` holding `new_tokens[r]` more positions afterwards. A cache with no
    /// buffers yet (nothing written) runs `model`'s step uncompiled, which creates them.
    pub fn forward(
        &mut self,
        model: &dyn Model,
        ids: &Array,
        slots: &mut SlotKvCache,
        new_tokens: &[usize],
    ) -> Result<Array> {
        if !slots.has_buffers() {
            return model.forward_slots(ids, slots, new_tokens);
        }
        let step = slots.begin_step(ids.shape()[1] as usize, new_tokens)?;
        let step_arrays = step.arrays();
        let mut inputs = Vec::with_capacity(1 + step_arrays.len() + slots.num_layers() * 6);
        inputs.push(ids.clone());
        inputs.extend(step_arrays.iter().map(|a| (*a).clone()));
        inputs.extend(slots.buffers());
        let buffers = inputs.len() - 1 - step_arrays.len();
        let step_fn = &mut self.steps_by_real[step.real_tokens().is_some() as usize];
        let mut outputs = step_fn(&inputs).map_err(|e| match self.failure.take() {
            Some(message) => {
                Exception::custom(format!("in a compiled slot step: {message}")).into()
            }
            None => EngineError::from(e),
        })?;
        drop(inputs);
        if outputs.len() != 1 + buffers {
            return Err(EngineError::from(Exception::custom(format!(
                "a compiled slot step returned {} arrays for {buffers} buffers",
                outputs.len()
            ))));
        }
        let logits = outputs.remove(0);
        // The old buffers are now the graph's alone, so MLX may update them in place.
        slots.set_buffers(outputs);
        slots.end_step(new_tokens)?;
        self.steps += 1;
        Ok(logits)
    }
}
