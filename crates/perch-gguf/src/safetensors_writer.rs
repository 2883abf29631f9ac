//! Writes a safetensors file with the `safetensors` crate while holding one tensor in memory.
//!
//! `safetensors::serialize_to_file` builds the header from each tensor's `dtype`, `shape` and
//! `data_len`, then calls `View::data` once per tensor as it writes (into a temporary file it
//! renames over the target). So each [`LazyTensor`] makes its bytes only when asked for them.
//! The crate orders tensors by dtype, then name, not in the order given.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::OpenOptions;
use std::path::Path;

use safetensors::{Dtype, SafeTensorError, View};

use crate::GgufError;

/// One tensor the file will hold.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PlannedTensor {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    /// Row-major shape.
    pub(crate) shape: Vec<usize>,
}

impl PlannedTensor {
    /// Size of the data in bytes (every dtype used here is a whole number of bytes).
    pub(crate) fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// Writes `tensors` and `metadata` (`__metadata__`, e.g. `{"format": "mlx"}`) to `path`;
/// `tensor_bytes(i)` gives the little-endian bytes of the `i`-th tensor when the writer reaches
/// it. Returns the file size in bytes.
///
/// Errors: the first error of `tensor_bytes`; [`GgufError::InvalidTensor`] when it returns the
/// wrong number of bytes (a bug in this crate); [`GgufError::Io`] while writing. On error no
/// file is left at `path`.
pub(crate) fn write_safetensors<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = &'a PlannedTensor>,
    metadata: HashMap<String, String>,
    tensor_bytes: impl Fn(usize) -> Result<Vec<u8>, GgufError>,
) -> Result<u64, GgufError> {
    // `View::data` cannot fail, but reading and converting can, and only show it then (an I/O
    // error, a scale that overflows float16); a validating first pass would do all that work
    // twice. So the first error waits here, later tensors are skipped, and the file is removed.
    let failure = RefCell::new(None);
    let views = tensors.into_iter().enumerate().map(|(index, planned)| {
        let view = LazyTensor {
            planned,
            index,
            tensor_bytes: &tensor_bytes,
            failure: &failure,
        };
        (planned.name.as_str(), view)
    });
    let written = safetensors::serialize_to_file(views, Some(metadata), path);
    let result = match (failure.into_inner(), written) {
        (Some(error), _) => Err(error),
        (None, Err(error)) => Err(write_error(path, error)),
        (None, Ok(())) => sync(path),
    };
    if result.is_err() {
        // Best effort: the caller gets the original error either way.
        let _ = std::fs::remove_file(path);
    }
    result
}

/// A planned tensor whose bytes are made when the writer asks for them.
struct LazyTensor<'a, F> {
    planned: &'a PlannedTensor,
    index: usize,
    tensor_bytes: &'a F,
    failure: &'a RefCell<Option<GgufError>>,
}

impl<F: Fn(usize) -> Result<Vec<u8>, GgufError>> View for LazyTensor<'_, F> {
    fn dtype(&self) -> Dtype {
        self.planned.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.planned.shape
    }

    fn data_len(&self) -> usize {
        self.planned.byte_len()
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if self.failure.borrow().is_some() {
            // The file is discarded; skip the work.
            return Cow::Borrowed(&[]);
        }
        let bytes = (self.tensor_bytes)(self.index).and_then(|bytes| {
            // The crate trusts `data_len`; a mismatch would shift every later tensor.
            if bytes.len() == self.data_len() {
                return Ok(bytes);
            }
            Err(GgufError::InvalidTensor {
                tensor: self.planned.name.clone(),
                reason: format!(
                    "internal error while writing safetensors: expected {} bytes, got {}",
                    self.data_len(),
                    bytes.len()
                ),
            })
        });
        match bytes {
            Ok(bytes) => Cow::Owned(bytes),
            Err(error) => {
                *self.failure.borrow_mut() = Some(error);
                Cow::Borrowed(&[])
            }
        }
    }
}

/// Syncs the written file like every other output file (the crate only flushes it); returns
/// its size in bytes.
fn sync(path: &Path) -> Result<u64, GgufError> {
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| GgufError::io("open", path, e))?;
    file.sync_all()
        .map_err(|e| GgufError::io("sync", path, e))?;
    let metadata = file
        .metadata()
        .map_err(|e| GgufError::io("inspect", path, e))?;
    Ok(metadata.len())
}

fn write_error(path: &Path, error: SafeTensorError) -> GgufError {
    let source = match error {
        SafeTensorError::IoError(e) => e,
        other => std::io::Error::other(other),
    };
    GgufError::io("write", path, source)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(name: &str, dtype: Dtype, shape: &[usize]) -> PlannedTensor {
        PlannedTensor {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn written_file_parses_with_the_safetensors_crate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let tensors = [
            planned("b", Dtype::F16, &[3]),
            planned("a", Dtype::U32, &[2, 1]),
        ];
        let data: [&[u8]; 2] = [&[1, 0, 2, 0, 3, 0], &[9, 0, 0, 0, 7, 0, 0, 0]];
        let metadata = HashMap::from([("format".to_string(), "mlx".to_string())]);
        let size = write_safetensors(&path, &tensors, metadata, |i| Ok(data[i].to_vec())).unwrap();

        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(size, bytes.len() as u64);
        let (_, parsed_metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            parsed_metadata.metadata().as_ref().unwrap()["format"],
            "mlx"
        );
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let a = st.tensor("a").unwrap();
        assert_eq!((a.dtype(), a.shape()), (Dtype::U32, &[2usize, 1][..]));
        assert_eq!(a.data(), data[1]);
        assert_eq!(st.tensor("b").unwrap().data(), data[0]);
    }

    #[test]
    fn a_failing_tensor_is_returned_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let tensors = [
            planned("x", Dtype::F32, &[1]),
            planned("y", Dtype::F32, &[1]),
        ];
        let calls = std::cell::Cell::new(0);
        let err = write_safetensors(&path, &tensors, HashMap::new(), |_| {
            calls.set(calls.get() + 1);
            Err(GgufError::MissingTensor { tensor: "x".into() })
        })
        .unwrap_err();
        assert!(matches!(err, GgufError::MissingTensor { .. }), "{err}");
        assert_eq!(calls.get(), 1, "tensors after the failure are skipped");
        assert!(!path.exists());
    }

    #[test]
    fn a_wrong_number_of_bytes_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let tensors = [planned("x", Dtype::F32, &[2])];
        let err =
            write_safetensors(&path, &tensors, HashMap::new(), |_| Ok(vec![0; 4])).unwrap_err();
        assert!(err.to_string().contains("expected 8 bytes, got 4"), "{err}");
        assert!(!path.exists());
    }
}
