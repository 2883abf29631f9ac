//! GGUF → mlx-community model directory: plan every tensor, convert and write into a staging
//! directory beside the target, then rename it into place.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde_json::{json, Map, Value};

use crate::ggml_type::GgmlType;
use crate::llama::{
    map_tensor, LlamaHparams, MappedTensor, ModuleKind, TensorRole, SUPPORTED_ARCHITECTURES,
};
use crate::quant::{
    convert_affine, dequantize_to_f32_bytes, reorder_rows, rope_unpermute_order, AffineParams,
    BlockFormat,
};
use crate::reader::{GgufFile, TensorInfo};
use crate::safetensors_writer::{write_safetensors, PlannedTensor};
use crate::tokenizer::build_tokenizer;
use crate::GgufError;

/// Tensor types the importer converts.
pub(crate) const SUPPORTED_TENSOR_TYPES: &[&str] = &["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"];

/// Name of the single weights file (the layout mlx-lm and the Hub use for small models).
const WEIGHTS_FILE: &str = "model.safetensors";

/// What [`import`] produced.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportSummary {
    /// `general.architecture` of the GGUF, e.g. `"llama"`.
    pub architecture: String,
    /// Number of tensors in the GGUF file (including ones folded into config.json).
    pub tensor_count: usize,
    /// How many GGUF tensors had each type.
    pub tensor_types: BTreeMap<GgmlType, usize>,
    /// Total size of the files written, in bytes.
    pub bytes_written: u64,
    /// The model directory that now exists.
    pub out_dir: PathBuf,
}

/// Converts a llama-family GGUF file into a model directory in the mlx-community layout
/// (`config.json`, `model.safetensors` + `model.safetensors.index.json`, `tokenizer.json`,
/// `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`), loadable by
/// mlx-lm's `load` like a model downloaded from the Hugging Face Hub.
///
/// Quantized tensors (Q4_0, Q4_1, Q8_0) stay quantized, losslessly, as MLX affine
/// quantization with group size 32; F16/BF16/F32 tensors are copied. All checks (architecture,
/// metadata, tensor names, types, shapes, tokenizer) run before anything is written. The
/// output is assembled in a hidden directory next to `out_dir` and renamed into place at the
/// end, so `out_dir` either appears complete or not at all.
///
/// Errors: [`GgufError::OutputExists`] if `out_dir` exists and is not an empty directory (its
/// contents are left untouched); every error [`GgufFile::open`] returns;
/// [`GgufError::UnsupportedArchitecture`], [`GgufError::UnsupportedTensorType`],
/// [`GgufError::MissingMetadata`], [`GgufError::MissingTensor`],
/// [`GgufError::UnexpectedTensor`], [`GgufError::InvalidTensor`], tokenizer errors, and
/// [`GgufError::Io`] while writing.
pub fn import(gguf_path: &Path, out_dir: &Path) -> Result<ImportSummary, GgufError> {
    ensure_output_free(out_dir)?;
    let gguf = GgufFile::open(gguf_path)?;
    let architecture = gguf.architecture()?.to_string();
    if !SUPPORTED_ARCHITECTURES.contains(&architecture.as_str()) {
        return Err(GgufError::UnsupportedArchitecture {
            found: architecture,
            supported: SUPPORTED_ARCHITECTURES,
        });
    }
    let hparams = LlamaHparams::from_gguf(&gguf)?;
    let plan = ImportPlan::new(&gguf, &hparams)?;
    let tokenizer = build_tokenizer(&gguf, hparams.max_position_embeddings)?;

    let staging = StagingDir::create(out_dir)?;
    let dir = staging.path();
    let mut bytes_written = plan.write_weights(&gguf, &dir.join(WEIGHTS_FILE))?;
    bytes_written += write_json(
        &dir.join("model.safetensors.index.json"),
        &plan.index_json(),
        4,
    )?;

    let mut config = hparams.config_fields(plan.tie_word_embeddings);
    let ids = &tokenizer.special_ids;
    if let Some(bos) = ids.bos {
        config.insert("bos_token_id".into(), json!(bos));
    }
    config.insert("eos_token_id".into(), ids.eos_json());
    if let Some(pad) = ids.pad {
        config.insert("pad_token_id".into(), json!(pad));
    }
    if let Some(quantization) = plan.quantization_config() {
        // mlx-lm reads `quantization`; `quantization_config` is what the Hub's tooling reads.
        config.insert("quantization".into(), quantization.clone());
        config.insert("quantization_config".into(), quantization);
    }
    bytes_written += write_json(&dir.join("config.json"), &json!(config), 4)?;

    let tokenizer_json = tokenizer
        .tokenizer
        .to_string(true)
        .map_err(|source| GgufError::Tokenizer { source })?;
    bytes_written += write_file(&dir.join("tokenizer.json"), tokenizer_json.as_bytes())?;
    bytes_written += write_json(
        &dir.join("tokenizer_config.json"),
        &tokenizer.tokenizer_config,
        2,
    )?;
    bytes_written += write_json(
        &dir.join("generation_config.json"),
        &tokenizer.generation_config,
        2,
    )?;
    if let Some(template) = &tokenizer.chat_template {
        bytes_written += write_file(&dir.join("chat_template.jinja"), template.as_bytes())?;
    }

    staging.publish(out_dir)?;
    let mut tensor_types = BTreeMap::new();
    for info in gguf.tensors() {
        *tensor_types.entry(info.ggml_type).or_insert(0) += 1;
    }
    Ok(ImportSummary {
        architecture,
        tensor_count: gguf.tensors().len(),
        tensor_types,
        bytes_written,
        out_dir: out_dir.to_path_buf(),
    })
}

/// How one GGUF tensor becomes safetensors tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conversion {
    /// Block-quantized weight → MLX affine `weight`/`scales`/`biases`.
    Affine(BlockFormat),
    /// Unquantized: bytes copied (rows reordered for q/k).
    Copy(Dtype),
    /// A quantized 1-D tensor (norm or bias), which MLX only holds unquantized → f32.
    Dequantize(BlockFormat),
}

struct TensorPlan<'a> {
    info: &'a TensorInfo,
    mapped: MappedTensor,
    conversion: Conversion,
}

impl TensorPlan<'_> {
    /// `[rows, cols]` of a 2-D tensor, `[len, 1]` of a 1-D one.
    fn rows_cols(&self) -> (usize, usize) {
        let shape = &self.mapped.expected_shape;
        (shape[0] as usize, shape.get(1).map_or(1, |&c| c as usize))
    }

    /// The safetensors tensors this tensor becomes, in the order [`Self::convert`] returns them.
    fn outputs(&self) -> Vec<PlannedTensor> {
        let base = &self.mapped.module;
        let shape: Vec<usize> = self
            .mapped
            .expected_shape
            .iter()
            .map(|&d| d as usize)
            .collect();
        match self.conversion {
            Conversion::Affine(format) => {
                let params = format.params();
                let (rows, cols) = (shape[0], shape[1]);
                let groups = cols / params.group_size as usize;
                vec![
                    PlannedTensor {
                        name: format!("{base}.weight"),
                        dtype: Dtype::U32,
                        shape: vec![rows, cols * params.bits as usize / 32],
                    },
                    PlannedTensor {
                        name: format!("{base}.scales"),
                        dtype: Dtype::F16,
                        shape: vec![rows, groups],
                    },
                    PlannedTensor {
                        name: format!("{base}.biases"),
                        dtype: Dtype::F16,
                        shape: vec![rows, groups],
                    },
                ]
            }
            Conversion::Copy(dtype) => vec![PlannedTensor {
                name: format!("{base}.{}", self.mapped.param),
                dtype,
                shape,
            }],
            Conversion::Dequantize(_) => {
                vec![PlannedTensor {
                    name: format!("{base}.{}", self.mapped.param),
                    dtype: Dtype::F32,
                    shape,
                }]
            }
        }
    }

    /// Reads and converts the tensor: the bytes of each of [`Self::outputs`], in that order.
    fn convert(&self, gguf: &GgufFile) -> Result<Vec<Vec<u8>>, GgufError> {
        let data = gguf.read_tensor_bytes(self.info)?;
        let order = self.row_order()?;
        let (rows, cols) = self.rows_cols();
        let reordered = |bytes: Vec<u8>, row_bytes: usize| match &order {
            Some(order) => reorder_rows(&bytes, row_bytes, order),
            None => bytes,
        };
        Ok(match self.conversion {
            Conversion::Affine(format) => {
                let converted =
                    convert_affine(format, &data, rows, cols, order.as_deref(), &self.info.name)?;
                vec![converted.weight, converted.scales, converted.biases]
            }
            Conversion::Copy(dtype) => vec![reordered(data, cols * dtype.bitsize() / 8)],
            Conversion::Dequantize(format) => {
                vec![reordered(dequantize_to_f32_bytes(format, &data), cols * 4)]
            }
        })
    }

    /// Source row of each output row: llama.cpp's RoPE permutation undone for q/k.
    fn row_order(&self) -> Result<Option<Vec<usize>>, GgufError> {
        let Some(n_head) = self.mapped.rope_heads else {
            return Ok(None);
        };
        let (rows, _) = self.rows_cols();
        rope_unpermute_order(rows, n_head as usize)
            .map(Some)
            .map_err(|reason| GgufError::InvalidTensor {
                tensor: self.info.name.clone(),
                reason,
            })
    }
}

/// One tensor of `model.safetensors` and where its bytes come from.
struct OutputTensor {
    /// Index of the GGUF tensor in [`ImportPlan::tensors`].
    source: usize,
    /// Index among that tensor's [`TensorPlan::outputs`].
    position: usize,
    planned: PlannedTensor,
}

/// The outputs of one converted GGUF tensor; those already written are emptied.
struct ConvertedTensor {
    source: usize,
    outputs: Vec<Vec<u8>>,
}

struct ImportPlan<'a> {
    tensors: Vec<TensorPlan<'a>>,
    tie_word_embeddings: bool,
}

impl<'a> ImportPlan<'a> {
    /// Maps and checks every tensor; nothing is read or written yet.
    fn new(gguf: &'a GgufFile, hp: &LlamaHparams) -> Result<Self, GgufError> {
        let mut tensors = Vec::new();
        for info in gguf.tensors() {
            let mapped = match map_tensor(&info.name, hp)? {
                TensorRole::Mapped(mapped) => mapped,
                TensorRole::RopeFreqs => continue,
            };
            let block_format = BlockFormat::from_ggml(info.ggml_type);
            let conversion = match (info.ggml_type, block_format) {
                (GgmlType::F32, _) => Conversion::Copy(Dtype::F32),
                (GgmlType::F16, _) => Conversion::Copy(Dtype::F16),
                (GgmlType::BF16, _) => Conversion::Copy(Dtype::BF16),
                (_, Some(format)) if mapped.expected_shape.len() == 1 => {
                    Conversion::Dequantize(format)
                }
                (_, Some(format)) => Conversion::Affine(format),
                (other, None) => {
                    return Err(GgufError::UnsupportedTensorType {
                        tensor: info.name.clone(),
                        ggml_type: other.to_string(),
                        supported: SUPPORTED_TENSOR_TYPES,
                    })
                }
            };
            if info.shape() != mapped.expected_shape {
                return Err(GgufError::InvalidTensor {
                    tensor: info.name.clone(),
                    reason: format!(
                        "its shape {:?} does not match {:?}, the shape the metadata implies",
                        info.shape(),
                        mapped.expected_shape
                    ),
                });
            }
            tensors.push(TensorPlan {
                info,
                mapped,
                conversion,
            });
        }
        for name in hp.required_tensors() {
            if gguf.tensor(&name).is_none() {
                return Err(GgufError::MissingTensor { tensor: name });
            }
        }
        Ok(ImportPlan {
            tensors,
            tie_word_embeddings: gguf.tensor("output.weight").is_none(),
        })
    }

    fn outputs(&self) -> Vec<OutputTensor> {
        let mut outputs = Vec::new();
        for (source, tensor) in self.tensors.iter().enumerate() {
            for (position, planned) in tensor.outputs().into_iter().enumerate() {
                outputs.push(OutputTensor {
                    source,
                    position,
                    planned,
                });
            }
        }
        outputs
    }

    /// Converts and writes every tensor; returns the file size in bytes.
    fn write_weights(&self, gguf: &GgufFile, path: &Path) -> Result<u64, GgufError> {
        let outputs = self.outputs();
        let metadata = HashMap::from([("format".to_string(), "mlx".to_string())]);
        // The writer asks for tensors by dtype, then name: every uint32 `weight` before any
        // float16 `biases`/`scales`, and a module's `biases` and `scales` one after the other.
        // Keeping the unwritten outputs of the last conversion makes that two conversions per
        // quantized weight instead of three, with at most one converted tensor in memory.
        let last = RefCell::new(None::<ConvertedTensor>);
        write_safetensors(
            path,
            outputs.iter().map(|output| &output.planned),
            metadata,
            |index| {
                let output = &outputs[index];
                let mut last = last.borrow_mut();
                // `filter` drops another tensor's leftovers before the next conversion.
                let cached = last.take().filter(|c| c.source == output.source);
                let mut converted = match cached {
                    Some(converted) => converted,
                    None => ConvertedTensor {
                        source: output.source,
                        outputs: self.tensors[output.source].convert(gguf)?,
                    },
                };
                // An output asked for twice comes back empty, which the writer reports.
                let bytes = converted
                    .outputs
                    .get_mut(output.position)
                    .map(std::mem::take)
                    .unwrap_or_default();
                *last = Some(converted);
                Ok(bytes)
            },
        )
    }

    /// `model.safetensors.index.json` as mlx-lm writes it.
    fn index_json(&self) -> Value {
        let outputs = self.outputs();
        let total_size: usize = outputs.iter().map(|o| o.planned.byte_len()).sum();
        let total_parameters: u64 = self.tensors.iter().map(|t| t.info.n_elements()).sum();
        let weight_map: BTreeMap<String, &str> = outputs
            .into_iter()
            .map(|o| (o.planned.name, WEIGHTS_FILE))
            .collect();
        json!({
            "metadata": { "total_size": total_size, "total_parameters": total_parameters },
            "weight_map": weight_map,
        })
    }

    /// The `quantization` entry of config.json, `None` when nothing is quantized.
    ///
    /// mlx-lm convention (`utils.py` `load_model`, `class_predicate`): top-level `group_size`,
    /// `bits` and `mode` apply to every quantizable module (linear layers, embeddings); a module
    /// path key overrides them with its own `{group_size, bits}`, or `false` to keep it
    /// unquantized. The most common parameters become the default.
    fn quantization_config(&self) -> Option<Value> {
        let mut counts: BTreeMap<AffineParams, usize> = BTreeMap::new();
        for tensor in &self.tensors {
            if let Conversion::Affine(format) = tensor.conversion {
                *counts.entry(format.params()).or_insert(0) += 1;
            }
        }
        let default = counts
            .iter()
            .max_by_key(|(params, count)| (**count, std::cmp::Reverse(**params)))?
            .0;
        let entry = |p: &AffineParams| json!({ "group_size": p.group_size, "bits": p.bits, "mode": "affine" });
        let mut config = match entry(default) {
            Value::Object(map) => map,
            _ => Map::new(),
        };
        for tensor in &self.tensors {
            let quantizable = matches!(
                tensor.mapped.kind,
                ModuleKind::Linear | ModuleKind::Embedding
            );
            if !quantizable || tensor.mapped.param != "weight" {
                continue;
            }
            match tensor.conversion {
                Conversion::Affine(format) if format.params() == *default => {}
                Conversion::Affine(format) => {
                    config.insert(tensor.mapped.module.clone(), entry(&format.params()));
                }
                Conversion::Copy(_) | Conversion::Dequantize(_) => {
                    config.insert(tensor.mapped.module.clone(), Value::Bool(false));
                }
            }
        }
        Some(Value::Object(config))
    }
}

/// `Ok` when `out_dir` is absent or an empty directory.
fn ensure_output_free(out_dir: &Path) -> Result<(), GgufError> {
    match fs::metadata(out_dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(GgufError::io("inspect", out_dir, e)),
        Ok(meta) if !meta.is_dir() => Err(GgufError::OutputExists {
            path: out_dir.to_path_buf(),
        }),
        Ok(_) => {
            let mut entries =
                fs::read_dir(out_dir).map_err(|e| GgufError::io("list", out_dir, e))?;
            match entries.next() {
                None => Ok(()),
                Some(_) => Err(GgufError::OutputExists {
                    path: out_dir.to_path_buf(),
                }),
            }
        }
    }
}

/// A hidden directory beside the output, removed on drop unless published.
struct StagingDir {
    path: PathBuf,
    published: bool,
}

impl StagingDir {
    fn create(out_dir: &Path) -> Result<Self, GgufError> {
        let no_name = || {
            GgufError::io(
                "create",
                out_dir,
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "the output path must end in a directory name",
                ),
            )
        };
        let name = out_dir
            .file_name()
            .ok_or_else(no_name)?
            .to_string_lossy()
            .into_owned();
        let parent = match out_dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(|e| GgufError::io("create", &parent, e))?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        for attempt in 0..100u32 {
            let path = parent.join(format!(
                ".{name}.partial-{}-{nanos}-{attempt}",
                std::process::id()
            ));
            match fs::create_dir(&path) {
                Ok(()) => {
                    return Ok(StagingDir {
                        path,
                        published: false,
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(GgufError::io("create", &path, e)),
            }
        }
        Err(GgufError::io(
            "create",
            &parent,
            std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "no free name for a staging directory",
            ),
        ))
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the staging directory to `out_dir`. An empty `out_dir` is replaced; a
    /// non-empty one (even one filled while the import ran) is left as it is.
    fn publish(mut self, out_dir: &Path) -> Result<(), GgufError> {
        ensure_output_free(out_dir)?;
        if let Err(first) = fs::rename(&self.path, out_dir) {
            // POSIX replaces an empty directory atomically; other systems need it removed first.
            // `remove_dir` only removes an empty directory, so nothing saved can be lost.
            if out_dir.is_dir() && fs::remove_dir(out_dir).is_ok() {
                fs::rename(&self.path, out_dir)
                    .map_err(|e| GgufError::io("rename into", out_dir, e))?;
            } else if out_dir.exists() {
                return Err(GgufError::OutputExists {
                    path: out_dir.to_path_buf(),
                });
            } else {
                return Err(GgufError::io("rename into", out_dir, first));
            }
        }
        self.published = true;
        Ok(())
    }
}

impl Drop for StagingDir {
    fn drop(&mut self) {
        if !self.published {
            // Best effort: a leftover hidden directory is harmless, and there is no caller
            // left to report to.
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<u64, GgufError> {
    let mut file = fs::File::create(path).map_err(|e| GgufError::io("create", path, e))?;
    file.write_all(bytes)
        .map_err(|e| GgufError::io("write", path, e))?;
    file.sync_all()
        .map_err(|e| GgufError::io("sync", path, e))?;
    Ok(bytes.len() as u64)
}

/// Pretty JSON with `indent` spaces (mlx-lm writes config.json with 4, transformers uses 2).
fn write_json(path: &Path, value: &Value, indent: usize) -> Result<u64, GgufError> {
    let indent = vec![b' '; indent];
    let mut bytes = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(&indent);
    let mut serializer = serde_json::Serializer::with_formatter(&mut bytes, formatter);
    serde::Serialize::serialize(value, &mut serializer)
        .map_err(|e| GgufError::io("encode", path, e.into()))?;
    bytes.push(b'\n');
    write_file(path, &bytes)
}

#[cfg(test)]
#[path = "import_tests.rs"]
mod tests;
