//! GGUF → mlx-community model directory: plan every tensor, convert and write into a staging
//! directory beside the target, then rename it into place.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

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
use crate::safetensors_writer::{Dtype, PlannedTensor, SafetensorsWriter};
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

    fn outputs(&self) -> Vec<PlannedTensor> {
        let base = &self.mapped.module;
        let shape = self.mapped.expected_shape.clone();
        match self.conversion {
            Conversion::Affine(format) => {
                let params = format.params();
                let (rows, cols) = (shape[0], shape[1]);
                let groups = cols / u64::from(params.group_size);
                vec![
                    PlannedTensor {
                        name: format!("{base}.weight"),
                        dtype: Dtype::U32,
                        shape: vec![rows, cols * u64::from(params.bits) / 32],
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

    fn outputs(&self) -> Vec<PlannedTensor> {
        self.tensors.iter().flat_map(TensorPlan::outputs).collect()
    }

    /// Converts and writes every tensor; returns the file size in bytes.
    fn write_weights(&self, gguf: &GgufFile, path: &Path) -> Result<u64, GgufError> {
        let metadata = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
        let mut writer = SafetensorsWriter::create(path, self.outputs(), &metadata)?;
        for tensor in &self.tensors {
            let data = gguf.read_tensor_bytes(tensor.info)?;
            let order = tensor.row_order()?;
            let (rows, cols) = tensor.rows_cols();
            let base = &tensor.mapped.module;
            match tensor.conversion {
                Conversion::Affine(format) => {
                    let converted = convert_affine(
                        format,
                        &data,
                        rows,
                        cols,
                        order.as_deref(),
                        &tensor.info.name,
                    )?;
                    writer.write_tensor(&format!("{base}.weight"), &converted.weight)?;
                    writer.write_tensor(&format!("{base}.scales"), &converted.scales)?;
                    writer.write_tensor(&format!("{base}.biases"), &converted.biases)?;
                }
                Conversion::Copy(dtype) => {
                    let name = format!("{base}.{}", tensor.mapped.param);
                    match order {
                        Some(order) => {
                            let row_bytes = cols * dtype.size() as usize;
                            writer.write_tensor(&name, &reorder_rows(&data, row_bytes, &order))?
                        }
                        None => writer.write_tensor(&name, &data)?,
                    }
                }
                Conversion::Dequantize(format) => {
                    let mut values = dequantize_to_f32_bytes(format, &data);
                    if let Some(order) = order {
                        values = reorder_rows(&values, cols * 4, &order);
                    }
                    writer.write_tensor(&format!("{base}.{}", tensor.mapped.param), &values)?;
                }
            }
        }
        writer.finish()
    }

    /// `model.safetensors.index.json` as mlx-lm writes it.
    fn index_json(&self) -> Value {
        let outputs = self.outputs();
        let total_size: u64 = outputs.iter().map(PlannedTensor::byte_len).sum();
        let total_parameters: u64 = self.tensors.iter().map(|t| t.info.n_elements()).sum();
        let weight_map: BTreeMap<String, &str> = outputs
            .into_iter()
            .map(|t| (t.name, WEIGHTS_FILE))
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
