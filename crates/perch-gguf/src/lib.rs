//! Reads GGUF files and imports llama-family GGUF models as MLX model directories.
//!
//! Perch runs models with MLX, whose models come as Hugging Face-style directories
//! (safetensors + `config.json` + `tokenizer.json`), while many local models are shared as
//! llama.cpp GGUF files. [`import`] turns a GGUF file into a directory in the exact layout of
//! the `mlx-community` models on the Hub, so the engine (or Python mlx-lm) loads it like any
//! downloaded model. [`GgufFile`] is the reader underneath: metadata, tensor infos and raw
//! tensor bytes.
//!
//! # Format facts this crate relies on
//! - **Container** (GGUF spec, `ggml/docs/gguf.md` in ggml-org/ggml or llama.cpp):
//!   little-endian; `"GGUF"`, `u32` version (2 and 3 read here), `u64` tensor count, `u64`
//!   key/value count, typed key/values, tensor infos (name, rank, dims innermost-first, ggml
//!   type, offset), then tensor data aligned to `general.alignment` (default 32 bytes).
//! - **Dims order**: ggml's `ne[0]` is the contiguous dimension, so a linear weight stored as
//!   `[in, out]` in GGUF is `[out, in]` in PyTorch/MLX; [`TensorInfo::shape`] reverses.
//! - **Blocks** (`ggml/src/ggml-common.h`; gguf-py `quants.py`): Q4_0, Q4_1 and Q8_0 pack 32
//!   consecutive weights of a row per block with an f16 scale (and f16 minimum for Q4_1). They
//!   map one-to-one, losslessly, onto MLX affine quantization with group size 32 (see
//!   `quant.rs` for the exact layouts and the proof of exactness).
//! - **Names** (gguf-py `constants.py`, `tensor_mapping.py`): `token_embd`, `blk.N.attn_q`,
//!   ... map to `model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ...; without
//!   `output.weight` the output head is tied to the embeddings.
//! - **RoPE row order**: llama.cpp's converter permutes the rows of q and k per head
//!   (`convert_hf_to_gguf.py`, `LlamaModel.permute`); the import undoes it.
//! - **Target layout** (mlx-lm `utils.py`: `load_model`, `save_config`; `mlx.core.quantize`):
//!   `weight` uint32 / `scales` / `biases` per quantized module, and a `quantization` entry
//!   in config.json with per-module overrides (`false` for modules left unquantized).
//!
//! # Example
//! ```no_run
//! let summary = perch_gguf::import(
//!     std::path::Path::new("SmolLM2-135M-Instruct.Q4_1.gguf"),
//!     std::path::Path::new("models/SmolLM2-135M-Instruct-Q4_1"),
//! )?;
//! println!("{} tensors, {} bytes written", summary.tensor_count, summary.bytes_written);
//! # Ok::<(), perch_gguf::GgufError>(())
//! ```

mod error;
mod ggml_type;
mod import;
mod llama;
mod quant;
mod reader;
mod safetensors_writer;
mod tokenizer;

#[cfg(test)]
mod test_gguf;

pub use error::GgufError;
pub use ggml_type::GgmlType;
pub use import::{import, ImportSummary};
pub use reader::{GgufFile, MetadataValue, TensorInfo, GGUF_MAGIC};
