//! Reading model weights: one or sharded `*.safetensors` files, validated before MLX sees them.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};

use crate::device::Backend;
use crate::error::{EngineError, Result};
use crate::nn::part_reads::{self, TensorSource};

/// All tensors of a model by their Hugging Face names (`model.layers.0.self_attn.q_proj.weight`).
/// Builders `take` what they use, so leftovers can be reported.
pub struct Weights {
    tensors: HashMap<String, Array>,
    /// Floating-point tensors are cast to the backend's compute dtype when taken.
    backend: Backend,
    /// Read lazily ([`Weights::load_lazily`]): the model's folder, named when a tensor taken
    /// cannot be read.
    lazily_from: Option<PathBuf>,
    /// Read lazily: where each tensor's bytes lie, to read a rank's part of it alone
    /// ([`crate::nn::part_reads`]).
    sources: HashMap<String, TensorSource>,
}

/// How far a model load has come: bytes of weight files read, of their total size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LoadProgress {
    pub bytes_read: u64,
    pub bytes_total: u64,
}

impl Weights {
    /// Loads every `*.safetensors` file of `model_dir` (the shards named by
    /// `model.safetensors.index.json` when it exists).
    ///
    /// Errors: [`EngineError::Io`] when a file cannot be read, [`EngineError::CorruptWeights`]
    /// when a header is malformed or the file is shorter than its header says (truncated download).
    ///
    /// Tensors are read, cast to the backend's compute dtype and evaluated here, one at a time
    /// (bounding the peak to one tensor in two dtypes): afterwards they are plain data that any
    /// thread may use, and a damaged file has failed here rather than mid-generation.
    pub fn load(model_dir: &Path, backend: Backend) -> Result<Self> {
        Self::load_with_progress(model_dir, backend, &mut |_| {})
    }

    /// [`Weights::load`], calling `progress` after each tensor is read (and once at the start
    /// with nothing read), with bytes counted against the files' total size.
    pub fn load_with_progress(
        model_dir: &Path,
        backend: Backend,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let mut weights = Self::empty(backend);
        let files = shard_files(model_dir)?;
        let sizes = files
            .iter()
            .map(|file| {
                std::fs::metadata(file)
                    .map(|m| m.len())
                    .map_err(|source| EngineError::Io {
                        path: file.clone(),
                        source,
                    })
            })
            .collect::<Result<Vec<u64>>>()?;
        let mut report = LoadProgress {
            bytes_read: 0,
            bytes_total: sizes.iter().sum(),
        };
        // Every header is checked, and what the tensors take once cast counted, before any
        // tensor is read.
        // The peak: everything kept, and the largest tensor's stored copy while it is cast.
        let (resident, largest_cast) = validated_sizes(&files, backend)?;
        check_room(model_dir, resident + largest_cast, backend)?;
        progress(report);
        let mut files_done = 0;
        for (file, size) in files.iter().zip(sizes) {
            let corrupt = |e: &dyn std::fmt::Display| EngineError::CorruptWeights {
                path: file.clone(),
                message: e.to_string(),
            };
            let loaded = Array::load_safetensors(file).map_err(|e| corrupt(&e))?;
            let mut in_file = 0;
            for (name, tensor) in loaded {
                // Stored bytes (before the cast); the file's header is counted at its end.
                in_file += tensor.nbytes() as u64;
                let tensor = weights.for_backend(&name, tensor)?;
                tensor.eval().map_err(|e| corrupt(&e))?;
                weights.tensors.insert(name, tensor);
                report.bytes_read = files_done + in_file.min(size);
                progress(report);
            }
            files_done += size;
            report.bytes_read = files_done;
            progress(report);
        }
        Ok(weights)
    }

    /// [`Weights::load`] reading no tensor yet: every header is validated and the room checked
    /// for `share` of what the tensors take (a rank's part of a divided model) plus the largest
    /// tensor, then each tensor is read (cast and evaluated) when a layer takes it
    /// ([`Weights::take`]), so that tensors dropped unread (another stage's layers) cost nothing
    /// and a layer divided as it loads holds its whole tensors only meanwhile. A file damaged
    /// past its header fails where its tensor is taken, within the model's load.
    pub fn load_lazily(model_dir: &Path, backend: Backend, share: f64) -> Result<Self> {
        let mut weights = Self::empty(backend);
        weights.lazily_from = Some(model_dir.to_path_buf());
        let files = shard_files(model_dir)?;
        let (resident, largest) = validated_sizes(&files, backend)?;
        check_room(
            model_dir,
            (resident as f64 * share) as u64 + largest,
            backend,
        )?;
        for file in &files {
            let loaded =
                Array::load_safetensors(file).map_err(|e| EngineError::CorruptWeights {
                    path: file.clone(),
                    message: e.to_string(),
                })?;
            for (name, tensor) in loaded {
                let tensor = weights.for_backend(&name, tensor)?;
                weights.tensors.insert(name, tensor);
            }
            weights.sources.extend(tensor_sources(file, backend)?);
        }
        Ok(weights)
    }

    /// Read lazily ([`Weights::load_lazily`]): deferred reads of the layers built while the
    /// answer lives ([`crate::nn::part_reads`]); `None` otherwise.
    pub(crate) fn defer_reads(&self) -> Option<part_reads::DeferredReads> {
        let dir = self.lazily_from.clone()?;
        Some(part_reads::DeferredReads::begin(dir))
    }

    /// No tensors: every [`Weights::take`] is [`EngineError::MissingWeight`].
    pub(crate) fn empty(backend: Backend) -> Self {
        Self {
            tensors: HashMap::new(),
            backend,
            lazily_from: None,
            sources: HashMap::new(),
        }
    }

    /// Adds a one-element tensor named `name` (unit tests of what reads names).
    #[cfg(test)]
    pub(crate) fn insert_for_test(&mut self, name: &str) {
        self.tensors.insert(name.into(), Array::from_f32(0.0));
    }

    /// Adds `array` as the tensor `name`, as it is (the checks and tests that build a layer
    /// from tensors they made).
    pub(crate) fn insert(&mut self, name: &str, array: Array) {
        self.tensors.insert(name.into(), array);
    }

    /// The dtype of the tensor of that name, when there is one.
    pub(crate) fn dtype(&self, name: &str) -> Option<mlx_rs::Dtype> {
        self.tensors.get(name).map(Array::dtype)
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Removes and returns a tensor (already in the compute dtype when it is floating point).
    pub fn take(&mut self, name: &str) -> Result<Array> {
        let tensor = self
            .tensors
            .remove(name)
            .ok_or_else(|| EngineError::MissingWeight {
                name: name.to_string(),
            })?;
        if let Some(dir) = &self.lazily_from {
            let source = self.sources.remove(name);
            // Building a layer that will be divided: left unread, its part read as it is divided.
            if part_reads::deferring() {
                if let Some(source) = source {
                    part_reads::register(&tensor, source);
                    return Ok(tensor);
                }
            }
            // Read now, so that a read error is the load's.
            tensor.eval().map_err(|e| EngineError::CorruptWeights {
                path: dir.clone(),
                message: e.to_string(),
            })?;
        }
        Ok(tensor)
    }

    /// Like [`Weights::take`], checking the shape.
    pub fn take_shaped(&mut self, name: &str, expected: &[i32]) -> Result<Array> {
        let tensor = self.take(name)?;
        check_shape(name, &tensor, expected)?;
        Ok(tensor)
    }

    /// Drops tensors a model does not use (e.g. precomputed rotary frequencies).
    pub fn discard(&mut self, name: &str) {
        self.tensors.remove(name);
        self.sources.remove(name);
    }

    /// Drops every tensor whose name `unused` accepts (e.g. a multimodal checkpoint's vision
    /// tower, when only its text model is loaded).
    pub fn discard_where(&mut self, unused: impl Fn(&str) -> bool) {
        self.tensors.retain(|name, _| !unused(name));
        self.sources.retain(|name, _| !unused(name));
    }

    /// Renames every tensor whose name starts with `from` to start with `to` instead (a
    /// checkpoint layout that nests the same tensors differently, e.g. Hugging Face's
    /// `model.language_model.` against mlx-community's `language_model.model.`).
    pub fn rename_prefix(&mut self, from: &str, to: &str) {
        let names: Vec<String> = self
            .tensors
            .keys()
            .filter(|name| name.starts_with(from))
            .cloned()
            .collect();
        for name in names {
            let renamed = format!("{to}{}", &name[from.len()..]);
            if let Some(source) = self.sources.remove(&name) {
                self.sources.insert(renamed.clone(), source);
            }
            if let Some(tensor) = self.tensors.remove(&name) {
                self.tensors.insert(renamed, tensor);
            }
        }
    }

    /// Names of tensors nobody took, sorted.
    pub fn remaining(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }

    /// A tensor as read, in the dtype it is used in ([`used_dtype`]).
    fn for_backend(&self, name: &str, tensor: Array) -> Result<Array> {
        let target = used_dtype(self.backend, name, tensor.dtype());
        match target == tensor.dtype() {
            true => Ok(tensor),
            false => Ok(tensor.as_dtype(target)?),
        }
    }
}

/// The dtype a tensor `name` stored as `stored` is used in on `backend`: floating point in the
/// backend's compute dtype ([`Backend::compute_dtype`]: float32 on CPU), but Gated DeltaNet's
/// decay rates (`A_log`), which mlx_lm keeps in their stored dtype (its `cast_predicate`);
/// others (packed quantized weights, integer tables) as stored.
fn used_dtype(backend: Backend, name: &str, stored: Dtype) -> Dtype {
    let float = matches!(stored, Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32);
    match float && !name.ends_with("A_log") {
        true => backend.compute_dtype(stored),
        false => stored,
    }
}

/// A safetensors dtype as MLX's, and its bytes an element; `None` for those MLX does not
/// load as such.
fn mlx_dtype(stored: safetensors::Dtype) -> Option<(Dtype, usize)> {
    use safetensors::Dtype as Stored;
    Some(match stored {
        Stored::F16 => (Dtype::Float16, 2),
        Stored::BF16 => (Dtype::Bfloat16, 2),
        Stored::F32 => (Dtype::Float32, 4),
        Stored::U32 => (Dtype::Uint32, 4),
        Stored::I32 => (Dtype::Int32, 4),
        Stored::U8 => (Dtype::Uint8, 1),
        Stored::I8 => (Dtype::Int8, 1),
        Stored::U16 => (Dtype::Uint16, 2),
        Stored::I16 => (Dtype::Int16, 2),
        Stored::I64 => (Dtype::Int64, 8),
        Stored::U64 => (Dtype::Uint64, 8),
        _ => return None,
    })
}

/// Errors with [`EngineError::ShapeMismatch`] unless `tensor` has exactly `expected` shape.
pub fn check_shape(name: &str, tensor: &Array, expected: &[i32]) -> Result<()> {
    if tensor.shape() != expected {
        return Err(EngineError::ShapeMismatch {
            name: name.to_string(),
            found: tensor.shape().to_vec(),
            expected: expected.to_vec(),
        });
    }
    Ok(())
}

fn shard_files(model_dir: &Path) -> Result<Vec<PathBuf>> {
    let index = model_dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = crate::limits::read_text_capped(&index, crate::limits::MAX_CONFIG_BYTES)?;
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: HashMap<String, String>,
        }
        let parsed: Index =
            serde_json::from_str(&text).map_err(|e| EngineError::CorruptWeights {
                path: index.clone(),
                message: e.to_string(),
            })?;
        let mut files: Vec<String> = parsed.weight_map.into_values().collect();
        files.sort();
        files.dedup();
        // The index comes with the download: a shard named `../x` or `/etc/x` must not make
        // Perch read a file outside the model directory.
        if let Some(bad) = files.iter().find(|f| !is_plain_file_name(f)) {
            return Err(EngineError::CorruptWeights {
                path: index,
                message: format!("the shard `{bad}` is not a file name inside the model directory"),
            });
        }
        return Ok(files.into_iter().map(|f| model_dir.join(f)).collect());
    }
    let entries = std::fs::read_dir(model_dir).map_err(|source| EngineError::Io {
        path: model_dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(EngineError::Io {
            path: model_dir.join("model.safetensors"),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no *.safetensors file in the model directory",
            ),
        });
    }
    Ok(files)
}

/// Whether the checkpoint in `model_dir` holds a tensor named `name`, from its weight index or
/// its files' headers (nothing loaded); `false` when they cannot be read.
pub fn has_tensor(model_dir: &Path, name: &str) -> bool {
    let index = model_dir.join("model.safetensors.index.json");
    if index.is_file() {
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: HashMap<String, String>,
        }
        return crate::limits::read_text_capped(&index, crate::limits::MAX_CONFIG_BYTES)
            .ok()
            .and_then(|text| serde_json::from_str::<Index>(&text).ok())
            .is_some_and(|index| index.weight_map.contains_key(name));
    }
    shard_files(model_dir).is_ok_and(|files| {
        files.iter().any(|file| {
            map_file(file).is_ok_and(|bytes| {
                safetensors::SafeTensors::read_metadata(&bytes)
                    .is_ok_and(|(_, metadata)| metadata.tensors().contains_key(name))
            })
        })
    })
}

/// Bytes at each end of a weight file's tensor data that [`weights_digest`] reads.
const DIGEST_SAMPLE_BYTES: usize = 1 << 20;

/// A SHA-256 digest of the checkpoint's weight files in `model_dir` (the shards of its index,
/// or every `*.safetensors`), read without loading them: each file's name, size and header
/// (its tensors' names, types, shapes and offsets), and the first and last MiB of its tensor
/// data. Copies of one checkpoint give the same digest wherever they are; a different
/// checkpoint of the same shapes (another fine-tune, other random weights) differs in the data
/// read. Errors: a file that cannot be read ([`EngineError::Io`]), a file shorter than its
/// header's length field ([`EngineError::CorruptWeights`]).
pub fn weights_digest(model_dir: &Path) -> Result<[u8; 32]> {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for file in shard_files(model_dir)? {
        let bytes = map_file(&file)?;
        let header_end = bytes
            .get(..8)
            .map(|n| u64::from_le_bytes(n.try_into().expect("8 bytes")))
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| n.checked_add(8))
            .filter(|&end| end <= bytes.len())
            .ok_or_else(|| EngineError::CorruptWeights {
                path: file.clone(),
                message: "the file is shorter than its header says".into(),
            })?;
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
        hasher.update(name.unwrap_or_default().as_bytes());
        hasher.update((bytes.len() as u64).to_le_bytes());
        let data = &bytes[header_end..];
        hasher.update(&bytes[..header_end]);
        hasher.update(&data[..DIGEST_SAMPLE_BYTES.min(data.len())]);
        hasher.update(&data[data.len().saturating_sub(DIGEST_SAMPLE_BYTES)..]);
    }
    Ok(hasher.finalize().into())
}

/// One normal path component: no separator, no `..`, not absolute, not empty.
fn is_plain_file_name(name: &str) -> bool {
    let mut components = Path::new(name).components();
    matches!(
        (components.next(), components.next()),
        (Some(std::path::Component::Normal(_)), None)
    ) && !name.contains(['/', '\\'])
}

/// Checks the header and that the file holds every byte the header promises. MLX reads tensor
/// data lazily, so without this a truncated download would fail (or read garbage) mid-generation.
pub(crate) fn validate_safetensors(path: &Path) -> Result<()> {
    check_safetensors_header(&map_file(path)?).map_err(|message| EngineError::CorruptWeights {
        path: path.to_path_buf(),
        message,
    })
}

/// [`validate_safetensors`] and what the file's tensors take once loaded on `backend` with
/// its largest cast tensor's stored bytes ([`resident_bytes`]), from one reading of the header.
/// Every file's header validated ([`validated_resident_bytes`]): the bytes all tensors take once
/// cast, and the largest tensor's stored copy while it is cast.
fn validated_sizes(files: &[PathBuf], backend: Backend) -> Result<(u64, u64)> {
    let (mut resident, mut largest_cast) = (0, 0);
    for file in files {
        let (kept, cast) = validated_resident_bytes(file, backend)?;
        resident += kept;
        largest_cast = largest_cast.max(cast);
    }
    Ok((resident, largest_cast))
}

fn validated_resident_bytes(path: &Path, backend: Backend) -> Result<(u64, u64)> {
    resident_bytes(&map_file(path)?, backend).map_err(|message| EngineError::CorruptWeights {
        path: path.to_path_buf(),
        message,
    })
}

/// The file mapped read-only.
fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let file = File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the map is read-only and dropped by the caller; a concurrent truncation by another
    // process could fault, as with any reader of a file being rewritten.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Where each tensor of the safetensors file `path` lies ([`TensorSource`]), used in the dtype
/// [`Weights::load_lazily`] gives it on `backend`; tensors of a dtype MLX does not read so are
/// left out (they are read whole). The header was validated before.
fn tensor_sources(path: &Path, backend: Backend) -> Result<Vec<(String, TensorSource)>> {
    let map = map_file(path)?;
    // Parts are read a run a row: read-ahead around each would bring in the rest.
    #[cfg(unix)]
    let _ = map.advise(memmap2::Advice::Random);
    let map = std::sync::Arc::new(map);
    let corrupt = |message: String| EngineError::CorruptWeights {
        path: path.to_path_buf(),
        message,
    };
    let (header, metadata) =
        safetensors::SafeTensors::read_metadata(&map[..]).map_err(|e| corrupt(e.to_string()))?;
    let data_start = 8 + header;
    let shared_path = std::sync::Arc::new(path.to_path_buf());
    let mut sources = Vec::new();
    for (name, info) in metadata.tensors() {
        let Some((stored, item)) = mlx_dtype(info.dtype) else {
            continue;
        };
        let Ok(shape) = info
            .shape
            .iter()
            .map(|&d| i32::try_from(d))
            .collect::<std::result::Result<Vec<i32>, _>>()
        else {
            continue;
        };
        let target = used_dtype(backend, &name, stored);
        sources.push((
            name.clone(),
            TensorSource {
                map: std::sync::Arc::clone(&map),
                path: std::sync::Arc::clone(&shared_path),
                offset: data_start + info.data_offsets.0,
                shape,
                stored,
                item,
                target,
            },
        ));
    }
    Ok(sources)
}

/// The check [`Weights::load`] makes on every weight file, on the file's bytes: a well-formed
/// safetensors header (length, JSON, dtypes, shapes, non-overlapping offsets) whose tensors the
/// bytes hold in full. Errors: the reason, in a sentence.
pub fn check_safetensors_header(bytes: &[u8]) -> std::result::Result<(), String> {
    safetensors::SafeTensors::read_metadata(bytes)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// Bytes the tensors of a safetensors file (`bytes`; its header checked here as
/// [`check_safetensors_header`] does: an error is the reason) take once loaded on
/// `backend`: floating-point tensors in the backend's compute dtype
/// ([`Backend::compute_dtype`]: float32 on CPU, twice a bfloat16 file's size), except those
/// [`Weights::load`] keeps as stored (`A_log`); the others (packed quantized weights, integer
/// tables) as stored. Also the stored bytes of its largest tensor that is cast: while it is,
/// both copies are held (the load's peak beyond what stays).
fn resident_bytes(bytes: &[u8], backend: Backend) -> std::result::Result<(u64, u64), String> {
    let (_, metadata) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    let (mut total, mut largest_cast) = (0u64, 0u64);
    for (name, info) in metadata.tensors() {
        let elements = info.shape.iter().map(|&d| d as u64).product::<u64>();
        let stored = (info.data_offsets.1 - info.data_offsets.0) as u64;
        total += match mlx_dtype(info.dtype) {
            Some((dtype, _)) if used_dtype(backend, &name, dtype) != dtype => {
                largest_cast = largest_cast.max(stored);
                let width = match used_dtype(backend, &name, dtype) {
                    Dtype::Float32 => 4,
                    _ => 2,
                };
                elements * width
            }
            _ => stored,
        };
    }
    Ok((total, largest_cast))
}

/// Refuses to read `bytes` of weights that the process's memory cannot hold
/// ([`crate::memory::available`]): what the tensors take once cast ([`resident_bytes`]). On
/// CUDA the weights live in the GPU's own memory, which this does not judge.
fn check_room(model_dir: &Path, bytes: u64, backend: Backend) -> Result<()> {
    let Some(available) = crate::memory::available_for(backend) else {
        return Ok(());
    };
    if bytes > available.bytes {
        let name = model_dir.file_name().map_or_else(
            || model_dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        return Err(EngineError::OutOfMemory {
            what: format!("the model {name}"),
            needed: bytes,
            available,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_named_outside_the_model_directory_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let model = root.path().join("model");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(root.path().join("outside.safetensors"), b"not weights").unwrap();
        for bad in [
            "../outside.safetensors",
            "/etc/passwd",
            "sub/../../outside.safetensors",
            "",
            "..",
            "a\\..\\..\\outside.safetensors",
        ] {
            let index = serde_json::json!({"weight_map": {"w": "model-1.safetensors", "v": bad}});
            std::fs::write(
                model.join("model.safetensors.index.json"),
                index.to_string(),
            )
            .unwrap();
            match shard_files(&model) {
                Err(EngineError::CorruptWeights { message, .. }) => {
                    assert!(message.contains("not a file name"), "{bad:?}: {message}")
                }
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        let index = serde_json::json!({"weight_map": {
            "w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"}});
        std::fs::write(
            model.join("model.safetensors.index.json"),
            index.to_string(),
        )
        .unwrap();
        assert_eq!(
            shard_files(&model).unwrap(),
            [
                model.join("model-00001-of-00002.safetensors"),
                model.join("model-00002-of-00002.safetensors")
            ]
        );
    }

    /// Copies of a checkpoint digest alike wherever they are; other data of the same shapes,
    /// at either end of the data, another tensor name or a file cut short do not.
    #[test]
    fn the_weights_digest_tells_checkpoints_apart_not_their_copies() {
        use safetensors::tensor::TensorView;
        use safetensors::Dtype as Stored;
        let root = tempfile::tempdir().unwrap();
        let write = |dir: &str, name: &str, data: &[u8]| -> PathBuf {
            let dir = root.path().join(dir);
            std::fs::create_dir_all(&dir).unwrap();
            let view = TensorView::new(Stored::U8, vec![data.len()], data).unwrap();
            let bytes = safetensors::serialize([(name, view)], None).unwrap();
            std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
            dir
        };
        let data: Vec<u8> = (0..3 << 20).map(|i| (i % 251) as u8).collect();
        let digest = |dir: &Path| weights_digest(dir).unwrap();
        let original = digest(&write("a", "w", &data));
        assert_eq!(digest(&write("copy", "w", &data)), original);
        let mut first = data.clone();
        first[0] ^= 1;
        assert_ne!(digest(&write("first", "w", &first)), original);
        let mut last = data.clone();
        *last.last_mut().unwrap() ^= 1;
        assert_ne!(digest(&write("last", "w", &last)), original);
        assert_ne!(digest(&write("renamed", "v", &data)), original);
        let cut = write("cut", "w", &data).join("model.safetensors");
        std::fs::write(&cut, &std::fs::read(&cut).unwrap()[..6]).unwrap();
        match weights_digest(cut.parent().unwrap()) {
            Err(EngineError::CorruptWeights { message, .. }) => {
                assert!(message.contains("shorter than its header"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// The load's memory check counts floating-point tensors in the backend's compute dtype
    /// (float32 on CPU: twice a bfloat16 file's bytes), `A_log` and packed integers as stored,
    /// and the largest cast tensor's stored bytes.
    #[test]
    fn resident_bytes_count_the_cast_to_the_compute_dtype() {
        use safetensors::tensor::TensorView;
        use safetensors::Dtype as Stored;
        let bf16 = vec![0u8; 2 * 100];
        let packed = vec![0u8; 4 * 64];
        let decay = vec![0u8; 2 * 8];
        let f32 = vec![0u8; 4 * 10];
        let tensors = [
            (
                "embed.weight",
                TensorView::new(Stored::BF16, vec![10, 10], &bf16).unwrap(),
            ),
            (
                "proj.weight",
                TensorView::new(Stored::U32, vec![8, 8], &packed).unwrap(),
            ),
            (
                "mixer.A_log",
                TensorView::new(Stored::BF16, vec![8], &decay).unwrap(),
            ),
            (
                "norm.weight",
                TensorView::new(Stored::F32, vec![10], &f32).unwrap(),
            ),
        ];
        let bytes = safetensors::serialize(tensors, None).unwrap();
        // CPU: 100 floats at 4 bytes, 256 packed bytes, A_log's 16 as stored, 10 floats at 4;
        // the largest cast is the embedding's 200 stored bytes.
        assert_eq!(
            resident_bytes(&bytes, Backend::Cpu),
            Ok((400 + 256 + 16 + 40, 200))
        );
        // GPUs keep bfloat16 and make float32 bfloat16 (the norm's 40 bytes cast).
        assert_eq!(
            resident_bytes(&bytes, Backend::Cuda),
            Ok((200 + 256 + 16 + 20, 40))
        );
        assert!(resident_bytes(&bytes[..bytes.len() / 2], Backend::Cpu).is_err());
    }
}
