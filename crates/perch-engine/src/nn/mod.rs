//! Neural-network building blocks on MLX: layers (linear, quantized, embeddings, norms, RoPE, MLP),
//! the weights they load from safetensors files, and small helpers over mlx-rs.

pub(crate) mod custom_kernel;
pub mod expert_kernel;
pub mod gemm_kernel;
pub mod layers;
pub(crate) mod mlx_ext;
pub mod norm_kernel;
pub mod part_reads;
pub mod rope_kernel;
pub mod weights;
