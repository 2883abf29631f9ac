//! A streaming safetensors writer: the header is written first from the planned tensor list,
//! then each tensor's bytes as it is converted, so memory holds one tensor at a time rather
//! than the whole model.
//!
//! Format (huggingface/safetensors `README.md`): `u64` little-endian header length `N`, `N`
//! bytes of JSON (`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`,
//! padded with spaces to a multiple of 8), then the tensor bytes, offsets relative to the end of
//! the header. The tests read every file back with the `safetensors` crate.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::GgufError;

/// Element type of an output tensor, with its safetensors name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dtype {
    U32,
    F16,
    BF16,
    F32,
}

impl Dtype {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Dtype::U32 => "U32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F32 => "F32",
        }
    }

    /// Bytes per element.
    pub(crate) fn size(self) -> u64 {
        match self {
            Dtype::U32 | Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }
}

/// One tensor the file will hold.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PlannedTensor {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    /// Row-major shape.
    pub(crate) shape: Vec<u64>,
}

impl PlannedTensor {
    pub(crate) fn byte_len(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size()
    }
}

/// Writes tensors in exactly the planned order; anything else is an error, so a file on disk
/// always matches its header.
pub(crate) struct SafetensorsWriter {
    path: PathBuf,
    out: BufWriter<File>,
    planned: Vec<PlannedTensor>,
    next: usize,
    bytes_written: u64,
}

impl SafetensorsWriter {
    /// Creates the file and writes the header for `planned` (data in that order) and
    /// `metadata` (`__metadata__`, e.g. `{"format": "mlx"}`).
    pub(crate) fn create(
        path: &Path,
        planned: Vec<PlannedTensor>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<Self, GgufError> {
        let mut header = Map::new();
        let mut offset = 0u64;
        for tensor in &planned {
            let end = offset + tensor.byte_len();
            header.insert(
                tensor.name.clone(),
                json!({ "dtype": tensor.dtype.name(), "shape": tensor.shape, "data_offsets": [offset, end] }),
            );
            offset = end;
        }
        header.insert("__metadata__".into(), json!(metadata));
        let mut header_bytes = serde_json::to_vec(&Value::Object(header))
            .map_err(|e| GgufError::io("encode", path, e.into()))?;
        // Keeps tensor data 8-byte aligned, as the reference writer does.
        header_bytes.resize(header_bytes.len().div_ceil(8) * 8, b' ');

        let file = File::create(path).map_err(|e| GgufError::io("create", path, e))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let write_error = |e| GgufError::io("write", path, e);
        out.write_all(&(header_bytes.len() as u64).to_le_bytes())
            .map_err(write_error)?;
        out.write_all(&header_bytes).map_err(write_error)?;
        Ok(SafetensorsWriter {
            path: path.to_path_buf(),
            out,
            planned,
            next: 0,
            bytes_written: 8 + header_bytes.len() as u64,
        })
    }

    /// Appends the next planned tensor's bytes (little-endian).
    pub(crate) fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<(), GgufError> {
        let expected = self
            .planned
            .get(self.next)
            .ok_or_else(|| internal(name, "more tensors than planned"))?;
        if expected.name != name || expected.byte_len() != bytes.len() as u64 {
            return Err(internal(
                name,
                &format!(
                    "expected `{}` with {} bytes, got {} bytes",
                    expected.name,
                    expected.byte_len(),
                    bytes.len()
                ),
            ));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| GgufError::io("write", &self.path, e))?;
        self.next += 1;
        self.bytes_written += bytes.len() as u64;
        Ok(())
    }

    /// Flushes and syncs the file; returns its size in bytes.
    pub(crate) fn finish(self) -> Result<u64, GgufError> {
        if self.next != self.planned.len() {
            let missing = &self.planned[self.next].name;
            return Err(internal(missing, "the import stopped before writing it"));
        }
        let file = self
            .out
            .into_inner()
            .map_err(|e| GgufError::io("write", &self.path, e.into_error()))?;
        file.sync_all()
            .map_err(|e| GgufError::io("sync", &self.path, e))?;
        Ok(self.bytes_written)
    }
}

/// A plan/data mismatch is a bug in this crate, reported rather than written.
fn internal(tensor: &str, reason: &str) -> GgufError {
    GgufError::InvalidTensor {
        tensor: tensor.to_string(),
        reason: format!("internal error while writing safetensors: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_file_parses_with_the_safetensors_crate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let planned = vec![
            PlannedTensor {
                name: "b".into(),
                dtype: Dtype::F16,
                shape: vec![3],
            },
            PlannedTensor {
                name: "a".into(),
                dtype: Dtype::U32,
                shape: vec![2, 1],
            },
        ];
        let metadata = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
        let mut writer = SafetensorsWriter::create(&path, planned, &metadata).unwrap();
        writer.write_tensor("b", &[1, 0, 2, 0, 3, 0]).unwrap();
        assert!(writer.write_tensor("b", &[0; 8]).is_err(), "out of plan");
        writer.write_tensor("a", &[9, 0, 0, 0, 7, 0, 0, 0]).unwrap();
        let size = writer.finish().unwrap();

        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(size, bytes.len() as u64);
        let (_, parsed_metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            parsed_metadata.metadata().as_ref().unwrap()["format"],
            "mlx"
        );
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let a = st.tensor("a").unwrap();
        assert_eq!(
            (a.dtype(), a.shape()),
            (safetensors::Dtype::U32, &[2usize, 1][..])
        );
        assert_eq!(a.data(), &[9, 0, 0, 0, 7, 0, 0, 0]);
        assert_eq!(st.tensor("b").unwrap().data(), &[1, 0, 2, 0, 3, 0]);
    }

    #[test]
    fn finishing_early_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let planned = vec![PlannedTensor {
            name: "x".into(),
            dtype: Dtype::F32,
            shape: vec![1],
        }];
        let writer = SafetensorsWriter::create(&path, planned, &BTreeMap::new()).unwrap();
        assert!(writer.finish().is_err());
    }
}
