//! Parsing the GGUF container: header, metadata key/values, tensor infos, tensor bytes.
//!
//! Layout (GGUF spec, `ggml/docs/gguf.md`), all integers little-endian:
//! `"GGUF"` magic, `u32` version, `u64` tensor count, `u64` metadata count, the metadata
//! key/values, the tensor infos, padding to `general.alignment` (default 32), then the tensor
//! data. Every length read from the file is checked against the file size before anything is
//! allocated, so a truncated or hostile file yields an error, never a huge allocation or a panic.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::ggml_type::GgmlType;
use crate::GgufError;

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";

/// Alignment of the tensor data section when `general.alignment` is absent (bytes).
const DEFAULT_ALIGNMENT: u64 = 32;

/// ggml tensors have at most four dimensions (`GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;

/// Arrays may nest (the spec allows arrays of arrays); the limit keeps recursion bounded.
const MAX_ARRAY_NESTING: u32 = 8;

/// One metadata value. GGUF value type codes 0..=12 map to the variants in order
/// (u8, i8, u16, i16, u32, i32, f32, bool, string, array, u64, i64, f64).
#[derive(Debug, Clone, PartialEq)]
pub enum MetadataValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetadataValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetadataValue {
    /// A short type name for error messages (`"u32"`, `"array"`, ...).
    pub fn type_name(&self) -> &'static str {
        match self {
            MetadataValue::U8(_) => "u8",
            MetadataValue::I8(_) => "i8",
            MetadataValue::U16(_) => "u16",
            MetadataValue::I16(_) => "i16",
            MetadataValue::U32(_) => "u32",
            MetadataValue::I32(_) => "i32",
            MetadataValue::F32(_) => "f32",
            MetadataValue::Bool(_) => "bool",
            MetadataValue::String(_) => "string",
            MetadataValue::Array(_) => "array",
            MetadataValue::U64(_) => "u64",
            MetadataValue::I64(_) => "i64",
            MetadataValue::F64(_) => "f64",
        }
    }

    /// Any non-negative integer, whatever width the writer chose (converters differ).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetadataValue::U8(v) => Some(v.into()),
            MetadataValue::U16(v) => Some(v.into()),
            MetadataValue::U32(v) => Some(v.into()),
            MetadataValue::U64(v) => Some(v),
            MetadataValue::I8(v) => u64::try_from(v).ok(),
            MetadataValue::I16(v) => u64::try_from(v).ok(),
            MetadataValue::I32(v) => u64::try_from(v).ok(),
            MetadataValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer as `i64` (token types are stored as i32; other writers may differ).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetadataValue::I8(v) => Some(v.into()),
            MetadataValue::I16(v) => Some(v.into()),
            MetadataValue::I32(v) => Some(v.into()),
            MetadataValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// An `f32` or `f64` value, widened to `f64` (an `f32` keeps its exact value).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetadataValue::F32(v) => Some(v.into()),
            MetadataValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetadataValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetadataValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetadataValue]> {
        match self {
            MetadataValue::Array(items) => Some(items),
            _ => None,
        }
    }
}

/// Where one tensor lives and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// GGUF tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions innermost-first as ggml stores them (`ne[0]` is the contiguous one, i.e.
    /// `in_features` of a linear weight). [`TensorInfo::shape`] gives the row-major order.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset of the data from the start of the file.
    pub data_offset: u64,
    /// Size of the data in bytes; `None` when the type id is unknown to this crate.
    pub n_bytes: Option<u64>,
}

impl TensorInfo {
    /// Row-major shape (outermost first), as PyTorch / MLX / safetensors write it:
    /// a linear weight is `[out_features, in_features]`.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Number of elements (product of the dimensions; 1 for a scalar).
    pub fn n_elements(&self) -> u64 {
        // Checked when the file was opened, so the product does not overflow.
        self.dims.iter().product()
    }
}

/// An open GGUF file: its metadata and tensor infos, parsed and bounds-checked at open time.
/// Tensor data is read on demand with [`GgufFile::read_tensor_bytes`].
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    version: u32,
    file_len: u64,
    alignment: u64,
    metadata: BTreeMap<String, MetadataValue>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    file: Mutex<File>,
}

impl GgufFile {
    /// Opens and parses a GGUF file (versions 2 and 3, little-endian).
    ///
    /// Errors: [`GgufError::Io`], [`GgufError::BadMagic`], [`GgufError::UnsupportedVersion`],
    /// [`GgufError::BigEndian`], [`GgufError::Truncated`], [`GgufError::InvalidMetadata`],
    /// [`GgufError::InvalidTensor`], [`GgufError::TensorOutOfBounds`] (checked for every tensor
    /// whose type is known, so a truncated download fails here rather than mid-import).
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = File::open(path).map_err(|e| GgufError::io("open", path, e))?;
        let file_len = file
            .metadata()
            .map_err(|e| GgufError::io("read", path, e))?
            .len();
        let read_handle = file
            .try_clone()
            .map_err(|e| GgufError::io("read", path, e))?;
        let mut reader = HeaderReader {
            inner: BufReader::new(read_handle),
            pos: 0,
            file_len,
            path,
        };

        let magic: [u8; 4] = reader.array("the magic number")?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic {
                path: path.to_path_buf(),
                found: magic,
            });
        }
        let version = reader.u32("the version")?;
        match version {
            2 | 3 => {}
            // A big-endian writer stores 3 as 00 00 00 03.
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(GgufError::BigEndian {
                    path: path.to_path_buf(),
                })
            }
            v => return Err(GgufError::UnsupportedVersion { version: v }),
        }
        let tensor_count = reader.u64("the tensor count")?;
        let kv_count = reader.u64("the metadata count")?;

        let mut metadata = BTreeMap::new();
        for i in 0..kv_count {
            let key = reader.string(&format!("metadata key #{i}"))?;
            let value_type = reader.u32(&format!("the type of metadata `{key}`"))?;
            let value = reader.value(&key, value_type, 0)?;
            metadata.insert(key, value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(value) => match value.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::InvalidMetadata {
                        key: "general.alignment".into(),
                        reason: format!("{value:?} is not a power of two"),
                    })
                }
            },
        };

        // Each tensor info takes at least 24 bytes, so this never over-allocates.
        let mut raw_infos = Vec::with_capacity(capacity_hint(tensor_count, reader.remaining(), 24));
        for i in 0..tensor_count {
            let name = reader.string(&format!("the name of tensor #{i}"))?;
            let n_dims = reader.u32(&format!("the rank of tensor `{name}`"))?;
            if n_dims > MAX_DIMS {
                return Err(GgufError::InvalidTensor {
                    tensor: name,
                    reason: format!("it has {n_dims} dimensions; ggml allows at most {MAX_DIMS}"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(reader.u64(&format!("the shape of tensor `{name}`"))?);
            }
            let ggml_type = GgmlType::from_id(reader.u32(&format!("the type of tensor `{name}`"))?);
            let relative_offset = reader.u64(&format!("the offset of tensor `{name}`"))?;
            raw_infos.push((name, dims, ggml_type, relative_offset));
        }

        let data_start = reader.pos.div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(raw_infos.len());
        let mut tensor_index = HashMap::with_capacity(raw_infos.len());
        for (name, dims, ggml_type, relative_offset) in raw_infos {
            let info = locate_tensor(name, dims, ggml_type, relative_offset, data_start, file_len)?;
            if tensor_index
                .insert(info.name.clone(), tensors.len())
                .is_some()
            {
                return Err(GgufError::InvalidTensor {
                    tensor: info.name,
                    reason: "the name appears twice in the file".into(),
                });
            }
            tensors.push(info);
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            file_len,
            alignment,
            metadata,
            tensors,
            tensor_index,
            file: Mutex::new(file),
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// All metadata key/values, sorted by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetadataValue> {
        &self.metadata
    }

    /// One metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.metadata.get(key)
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor with this GGUF name, if present.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// `general.architecture`, e.g. `"llama"`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.str("general.architecture")
    }

    /// A required string value. Errors: [`GgufError::MissingMetadata`], [`GgufError::MetadataType`].
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        let value = self.require(key)?;
        value
            .as_str()
            .ok_or_else(|| type_error(key, "a string", value))
    }

    /// A required non-negative integer of any width.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        let value = self.require(key)?;
        value
            .as_u64()
            .ok_or_else(|| type_error(key, "a non-negative integer", value))
    }

    /// A required float (`f32` values are widened exactly).
    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        let value = self.require(key)?;
        value
            .as_f64()
            .ok_or_else(|| type_error(key, "a float", value))
    }

    /// An optional string: `Ok(None)` when absent, an error when present with another type.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key).map(|_| self.str(key)).transpose()
    }

    /// An optional non-negative integer.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key).map(|_| self.u64(key)).transpose()
    }

    /// An optional float.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.get(key).map(|_| self.f64(key)).transpose()
    }

    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => value
                .as_bool()
                .map(Some)
                .ok_or_else(|| type_error(key, "a bool", value)),
        }
    }

    /// A required array of strings.
    pub fn str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let value = self.require(key)?;
        let items = value
            .as_array()
            .ok_or_else(|| type_error(key, "an array of strings", value))?;
        items
            .iter()
            .map(|item| {
                item.as_str()
                    .ok_or_else(|| type_error(key, "an array of strings", item))
            })
            .collect()
    }

    /// A required array of integers, as `i64`.
    pub fn int_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        let value = self.require(key)?;
        let items = value
            .as_array()
            .ok_or_else(|| type_error(key, "an array of integers", value))?;
        items
            .iter()
            .map(|item| {
                item.as_i64()
                    .ok_or_else(|| type_error(key, "an array of integers", item))
            })
            .collect()
    }

    fn require(&self, key: &str) -> Result<&MetadataValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingMetadata {
            key: key.to_string(),
        })
    }

    /// Reads a tensor's raw bytes exactly as stored (ggml blocks for quantized types), length
    /// [`TensorInfo::n_bytes`].
    ///
    /// Errors: [`GgufError::UnsupportedTensorType`] for a type id unknown to this crate (its
    /// size cannot be computed), [`GgufError::Io`] / [`GgufError::Truncated`] if the file
    /// changed since it was opened.
    pub fn read_tensor_bytes(&self, info: &TensorInfo) -> Result<Vec<u8>, GgufError> {
        let n_bytes = info
            .n_bytes
            .ok_or_else(|| GgufError::UnsupportedTensorType {
                tensor: info.name.clone(),
                ggml_type: info.ggml_type.to_string(),
                supported: &["the types ggml defines"],
            })?;
        let len = usize::try_from(n_bytes).map_err(|_| GgufError::InvalidTensor {
            tensor: info.name.clone(),
            reason: format!("{n_bytes} bytes do not fit in memory on this platform"),
        })?;
        let mut buf = vec![0u8; len];
        // A poisoned lock only means another reader panicked mid-read; the seek below resets
        // the position, so the handle is still usable.
        let mut file = self
            .file
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        file.seek(SeekFrom::Start(info.data_offset))
            .and_then(|_| file.read_exact(&mut buf))
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => GgufError::Truncated {
                    what: format!("the data of tensor `{}`", info.name),
                    offset: info.data_offset,
                    file_len: self.file_len,
                },
                _ => GgufError::io("read", &self.path, e),
            })?;
        Ok(buf)
    }
}

fn type_error(key: &str, expected: &'static str, found: &MetadataValue) -> GgufError {
    GgufError::MetadataType {
        key: key.to_string(),
        expected,
        found: found.type_name().to_string(),
    }
}

/// Resolves a tensor's absolute offset and size and checks both against the file.
fn locate_tensor(
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    relative_offset: u64,
    data_start: u64,
    file_len: u64,
) -> Result<TensorInfo, GgufError> {
    let invalid = |reason: String| GgufError::InvalidTensor {
        tensor: name.clone(),
        reason,
    };
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            invalid(format!(
                "its shape {dims:?} overflows a 64-bit element count"
            ))
        })?;
    let data_offset = data_start
        .checked_add(relative_offset)
        .ok_or_else(|| invalid(format!("its offset {relative_offset} overflows")))?;

    let n_bytes = match ggml_type.block_layout() {
        None => None,
        Some((block_elems, block_bytes)) => {
            let row_len = dims.first().copied().unwrap_or(1);
            if row_len % block_elems != 0 {
                return Err(invalid(format!(
                    "its row length {row_len} is not a multiple of the {ggml_type} block size {block_elems}"
                )));
            }
            let n_bytes = (n_elements / block_elems)
                .checked_mul(block_bytes)
                .ok_or_else(|| invalid("its byte size overflows".into()))?;
            let end = data_offset
                .checked_add(n_bytes)
                .ok_or_else(|| invalid("its byte range overflows".into()))?;
            if end > file_len {
                return Err(GgufError::TensorOutOfBounds {
                    tensor: name,
                    start: data_offset,
                    end,
                    file_len,
                });
            }
            Some(n_bytes)
        }
    };
    Ok(TensorInfo {
        name,
        dims,
        ggml_type,
        data_offset,
        n_bytes,
    })
}

/// A preallocation size that a hostile count cannot inflate: at most what the remaining bytes
/// could hold at `min_item_bytes` each.
fn capacity_hint(count: u64, remaining: u64, min_item_bytes: u64) -> usize {
    usize::try_from(count.min(remaining / min_item_bytes)).unwrap_or(0)
}

/// Sequential little-endian reader over the header that knows the file size, so every read
/// can be checked before allocating.
struct HeaderReader<'p> {
    inner: BufReader<File>,
    pos: u64,
    file_len: u64,
    path: &'p Path,
}

impl HeaderReader<'_> {
    fn remaining(&self) -> u64 {
        self.file_len.saturating_sub(self.pos)
    }

    fn truncated(&self, what: &str) -> GgufError {
        GgufError::Truncated {
            what: what.to_string(),
            offset: self.pos,
            file_len: self.file_len,
        }
    }

    fn fill(&mut self, buf: &mut [u8], what: &str) -> Result<(), GgufError> {
        if (buf.len() as u64) > self.remaining() {
            return Err(self.truncated(what));
        }
        self.inner.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => self.truncated(what),
            _ => GgufError::io("read", self.path, e),
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut buf = [0u8; N];
        self.fill(&mut buf, what)?;
        Ok(buf)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(self.truncated(what));
        }
        // `len` fits: it is at most the file size, and the bytes are about to be read.
        let mut bytes = vec![0u8; len as usize];
        self.fill(&mut bytes, what)?;
        String::from_utf8(bytes).map_err(|e| GgufError::InvalidMetadata {
            key: what.to_string(),
            reason: format!("the string is not valid UTF-8 ({e})"),
        })
    }

    fn value(
        &mut self,
        key: &str,
        value_type: u32,
        depth: u32,
    ) -> Result<MetadataValue, GgufError> {
        let what = format!("the value of metadata `{key}`");
        Ok(match value_type {
            0 => MetadataValue::U8(u8::from_le_bytes(self.array(&what)?)),
            1 => MetadataValue::I8(i8::from_le_bytes(self.array(&what)?)),
            2 => MetadataValue::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => MetadataValue::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => MetadataValue::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => MetadataValue::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => MetadataValue::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => match self.array::<1>(&what)?[0] {
                0 => MetadataValue::Bool(false),
                1 => MetadataValue::Bool(true),
                other => {
                    return Err(GgufError::InvalidMetadata {
                        key: key.to_string(),
                        reason: format!("a bool must be 0 or 1, found {other}"),
                    })
                }
            },
            8 => MetadataValue::String(self.string(&what).map_err(|e| rekey(e, key))?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(GgufError::InvalidMetadata {
                        key: key.to_string(),
                        reason: format!("arrays nest deeper than {MAX_ARRAY_NESTING} levels"),
                    });
                }
                let item_type = self.u32(&what)?;
                let count = self.u64(&what)?;
                let min_item_bytes = match item_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => return Err(unknown_value_type(key, other)),
                };
                if count
                    .checked_mul(min_item_bytes)
                    .is_none_or(|n| n > self.remaining())
                {
                    return Err(self.truncated(&what));
                }
                let mut items =
                    Vec::with_capacity(capacity_hint(count, self.remaining(), min_item_bytes));
                for _ in 0..count {
                    items.push(self.value(key, item_type, depth + 1)?);
                }
                MetadataValue::Array(items)
            }
            10 => MetadataValue::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => MetadataValue::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => MetadataValue::F64(f64::from_le_bytes(self.array(&what)?)),
            other => return Err(unknown_value_type(key, other)),
        })
    }
}

fn unknown_value_type(key: &str, code: u32) -> GgufError {
    GgufError::InvalidMetadata {
        key: key.to_string(),
        reason: format!("unknown value type code {code} (GGUF defines 0..=12)"),
    }
}

/// Names the key in a UTF-8 error raised while the string was read under a generic label.
fn rekey(error: GgufError, key: &str) -> GgufError {
    match error {
        GgufError::InvalidMetadata { reason, .. } => GgufError::InvalidMetadata {
            key: key.to_string(),
            reason,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_gguf::GgufBuilder;

    #[test]
    fn reads_back_metadata_and_tensors_of_a_built_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut builder = GgufBuilder::new();
        builder.kv(
            "general.architecture",
            MetadataValue::String("llama".into()),
        );
        builder.kv("a.count", MetadataValue::U32(7));
        builder.kv("a.eps", MetadataValue::F32(1e-5));
        builder.kv(
            "a.list",
            MetadataValue::Array(vec![
                MetadataValue::String("x".into()),
                MetadataValue::String("yz".into()),
            ]),
        );
        builder.tensor("w", &[4, 2], GgmlType::F32, vec![1u8; 32]);
        builder.tensor("v", &[32], GgmlType::Q8_0, vec![2u8; 34]);
        builder.write(&path);

        let file = GgufFile::open(&path).unwrap();
        assert_eq!(file.version(), 3);
        assert_eq!(file.architecture().unwrap(), "llama");
        assert_eq!(file.u64("a.count").unwrap(), 7);
        assert_eq!(file.f64("a.eps").unwrap(), f64::from(1e-5f32));
        assert_eq!(file.str_array("a.list").unwrap(), vec!["x", "yz"]);
        let w = file.tensor("w").unwrap();
        assert_eq!(w.shape(), vec![2, 4]);
        assert_eq!(w.n_bytes, Some(32));
        assert_eq!(file.read_tensor_bytes(w).unwrap(), vec![1u8; 32]);
        let v = file.tensor("v").unwrap();
        assert_eq!(v.data_offset % 32, 0, "tensor data is aligned");
        assert_eq!(file.read_tensor_bytes(v).unwrap(), vec![2u8; 34]);
    }

    #[test]
    fn typed_getters_name_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut builder = GgufBuilder::new();
        builder.kv("k.str", MetadataValue::String("s".into()));
        builder.write(&path);
        let file = GgufFile::open(&path).unwrap();
        let missing = file.u64("k.absent").unwrap_err();
        assert!(missing.to_string().contains("`k.absent`"), "{missing}");
        let wrong = file.u64("k.str").unwrap_err();
        assert!(matches!(wrong, GgufError::MetadataType { .. }), "{wrong}");
        assert_eq!(file.opt_u64("k.absent").unwrap(), None);
    }

    #[test]
    fn rejects_bad_magic_and_versions() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        std::fs::write(&path, b"GGML\x03\0\0\0").unwrap();
        let err = GgufFile::open(&path).unwrap_err();
        assert!(matches!(err, GgufError::BadMagic { .. }), "{err}");
        assert!(err.to_string().contains("not a GGUF file"), "{err}");

        let mut builder = GgufBuilder::new();
        builder.version = 1;
        builder.write(&path);
        let err = GgufFile::open(&path).unwrap_err();
        assert!(
            matches!(err, GgufError::UnsupportedVersion { version: 1 }),
            "{err}"
        );

        builder.version = 3u32.swap_bytes();
        builder.write(&path);
        assert!(matches!(
            GgufFile::open(&path).unwrap_err(),
            GgufError::BigEndian { .. }
        ));
    }

    #[test]
    fn a_huge_declared_string_length_is_truncation_not_allocation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut bytes = Vec::new();
        bytes.extend_from_slice(b"GGUF");
        bytes.extend_from_slice(&3u32.to_le_bytes());
        bytes.extend_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&1u64.to_le_bytes());
        bytes.extend_from_slice(&u64::MAX.to_le_bytes()); // key length
        std::fs::write(&path, bytes).unwrap();
        let err = GgufFile::open(&path).unwrap_err();
        assert!(matches!(err, GgufError::Truncated { .. }), "{err}");
    }

    #[test]
    fn unknown_tensor_types_open_but_cannot_be_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut builder = GgufBuilder::new();
        builder.tensor("odd", &[32], GgmlType::Other(200), vec![0u8; 32]);
        builder.write(&path);
        let file = GgufFile::open(&path).unwrap();
        let info = file.tensor("odd").unwrap();
        assert_eq!(info.n_bytes, None);
        let err = file.read_tensor_bytes(info).unwrap_err();
        assert!(err.to_string().contains("unknown ggml type 200"), "{err}");
    }

    #[test]
    fn tensor_data_past_the_end_is_out_of_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut builder = GgufBuilder::new();
        builder.tensor("w", &[64], GgmlType::F32, vec![0u8; 256]);
        builder.write(&path);
        let len = std::fs::metadata(&path).unwrap().len();
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(len - 4).unwrap();
        let err = GgufFile::open(&path).unwrap_err();
        assert!(
            matches!(err, GgufError::TensorOutOfBounds { ref tensor, .. } if tensor == "w"),
            "{err}"
        );
    }
}
