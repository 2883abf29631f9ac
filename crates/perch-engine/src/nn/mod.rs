//! Neural-network building blocks on MLX: layers (linear, quantized, embeddings, norms, RoPE, MLP),
//! the weights they load from safetensors files, and small helpers over mlx-rs.

pub(crate) mod custom_kernel;
pub mod expert_kernel;
pub mod layers;
pub(crate) mod mlx_ext;
pub mod norm_kernel;
pub mod rope_kernel;
pub mod weights;

use std::cell::Cell;
use std::thread::LocalKey;

/// Runs `f` with the thread-local `cell` holding `value`, and puts back what it held however `f`
/// ends (a panic included): a setting scoped to one call on one thread.
pub(crate) fn with_thread_local<T: Copy + 'static, R>(
    cell: &'static LocalKey<Cell<T>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static LocalKey<Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(cell, cell.with(|c| c.replace(value)));
    f()
}
