//! Reading only a rank's part of a tensor from its weight file (tensor parallelism).
//!
//! While a divided model's layer is built and divided ([`DeferredReads`], over each layer of
//! [`crate::models::load_divided`] by heads), the tensors it takes from lazily read weights
//! ([`Weights::load_lazily`]) stay unread: [`Weights::take`] registers where each one's bytes lie
//! in its file ([`TensorSource`]). Dividing one ([`crate::nn::layers::ShardParts::take`]) copies
//! just the part's bytes from the file ([`read_part`]): rows of a matrix divided by outputs are
//! one run of bytes, columns divided by inputs one run a row. What the layer keeps whole (norms,
//! a router) is read by MLX when the layer is done ([`DeferredReads::finish_layer`]), with what
//! was built on it ([`settle`]: a dense layer's transposed views); what was built on a tensor
//! that was divided is dropped unevaluated. A registered tensor that a layer transforms before
//! dividing it (stacked per-expert tensors, say) is read whole when the transform is evaluated,
//! as without deferral.
//!
//! Registered tensors are known by their MLX identity (`mlx_sys::perch_mlx_array_id`), the same
//! for every handle to one array.
//!
//! [`Weights::load_lazily`]: crate::nn::weights::Weights::load_lazily
//! [`Weights::take`]: crate::nn::weights::Weights::take

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mlx_rs::{Array, Dtype};

use crate::error::{EngineError, Result};

/// Where a tensor's bytes lie in its weight file, and the dtype it is used in.
#[derive(Clone)]
pub(crate) struct TensorSource {
    /// The whole file, mapped read-only.
    pub(crate) map: Arc<memmap2::Mmap>,
    pub(crate) path: Arc<PathBuf>,
    /// Its first byte in the file.
    pub(crate) offset: usize,
    pub(crate) shape: Vec<i32>,
    /// As stored, and its bytes an element.
    pub(crate) stored: Dtype,
    pub(crate) item: usize,
    /// As used: the backend's compute dtype for floating point ([`Weights::take`]'s cast).
    ///
    /// [`Weights::take`]: crate::nn::weights::Weights::take
    pub(crate) target: Dtype,
}

impl TensorSource {
    /// Its bytes in the file.
    pub(crate) fn len(&self) -> usize {
        self.shape.iter().map(|&d| d as usize).product::<usize>() * self.item
    }

    /// The runs `parts` (`(first, count)` entries along `axis`) of this tensor, side by side in
    /// that order along `axis`, as one array in the dtype it is used in, evaluated. Reads only
    /// those bytes of the file (a run a row of the axes before `axis`).
    fn read(&self, axis: usize, parts: &[(usize, usize)]) -> Result<Array> {
        let along = self.shape[axis] as usize;
        let outer: usize = self.shape[..axis].iter().map(|&d| d as usize).product();
        let inner: usize = self.shape[axis + 1..]
            .iter()
            .map(|&d| d as usize)
            .product::<usize>()
            * self.item;
        let kept: usize = parts.iter().map(|&(_, count)| count).sum();
        if parts.iter().any(|&(first, count)| first + count > along)
            || self.offset + self.len() > self.map.len()
        {
            return Err(EngineError::CorruptWeights {
                path: self.path.to_path_buf(),
                message: "a tensor's part lies outside it".into(),
            });
        }
        let data = &self.map[self.offset..self.offset + self.len()];
        let mut bytes = Vec::with_capacity(outer * kept * inner);
        for row in 0..outer {
            for &(first, count) in parts {
                let at = (row * along + first) * inner;
                bytes.extend_from_slice(&data[at..at + count * inner]);
            }
        }
        let mut shape = self.shape.clone();
        shape[axis] = kept as i32;
        // SAFETY: `bytes` holds exactly `shape`'s elements of `stored` (little-endian, as
        // safetensors stores them and MLX reads them); MLX copies them.
        let part = unsafe { Array::from_raw_data(bytes.as_ptr().cast(), &shape, self.stored) };
        let part = match self.target == self.stored {
            true => part,
            false => part.as_dtype(self.target)?,
        };
        part.eval()?;
        PART_BYTES_READ.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(part)
    }
}

/// A registered tensor: the array handed out, where its bytes lie, whether a part of it was
/// read (it is then never read whole here), and the arrays built on it to evaluate with it when
/// it is kept whole ([`settle`]).
struct Unread {
    array: Array,
    source: TensorSource,
    divided: bool,
    built_on: Vec<Array>,
}

/// The layer being built: its registered tensors by identity, and the arrays to evaluate when
/// it is done.
#[derive(Default)]
struct Deferred {
    unread: HashMap<usize, Unread>,
    settle: Vec<Array>,
}

thread_local! {
    /// Set while [`DeferredReads`] lives on this thread (the loading thread).
    static DEFERRED: RefCell<Option<Deferred>> = const { RefCell::new(None) };
}

/// Bytes of weight files copied by part reads ([`read_part`]) in this process (whole tensors
/// are read by MLX).
static PART_BYTES_READ: AtomicU64 = AtomicU64::new(0);

/// [`PART_BYTES_READ`] so far.
pub fn part_bytes_read() -> u64 {
    PART_BYTES_READ.load(Ordering::Relaxed)
}

fn id(a: &Array) -> usize {
    // SAFETY: reads the identity of a live array.
    unsafe { mlx_sys::perch_mlx_array_id(a.as_ptr()) }
}

/// Whether a layer's reads are deferred on this thread now.
pub(crate) fn deferring() -> bool {
    DEFERRED.with(|d| d.borrow().is_some())
}

/// Registers `array`, unread, as the tensor at `source` (while [`deferring`]).
pub(crate) fn register(array: &Array, source: TensorSource) {
    DEFERRED.with(|d| {
        if let Some(deferred) = d.borrow_mut().as_mut() {
            deferred.unread.insert(
                id(array),
                Unread {
                    array: array.clone(),
                    source,
                    divided: false,
                    built_on: Vec::new(),
                },
            );
        }
    });
}

/// Evaluates `arrays` now or, while a layer's reads are deferred, when the layer is done (so
/// that building a layer reads none of its tensors before it is divided). When one of them is a
/// registered tensor, they are evaluated only if that tensor is kept whole: they are built on it
/// (a dense layer's weight and its views), and evaluating them would read all of it.
pub(crate) fn settle(arrays: &[&Array]) -> Result<()> {
    let deferred = DEFERRED.with(|d| match d.borrow_mut().as_mut() {
        Some(deferred) => {
            let clones = arrays.iter().map(|&a| a.clone());
            let on = arrays
                .iter()
                .map(|a| id(a))
                .find(|k| deferred.unread.contains_key(k));
            match on.and_then(|k| deferred.unread.get_mut(&k)) {
                Some(unread) => unread.built_on.extend(clones),
                None => deferred.settle.extend(clones),
            }
            true
        }
        None => false,
    });
    if !deferred {
        mlx_rs::transforms::eval(arrays.iter().copied())?;
    }
    Ok(())
}

/// Reads `arrays` whole now (and what was built on them, [`settle`]): a layer every rank keeps
/// whole, or tensors a transform has read anyway; those registered are let go here, so that
/// they are neither held until the layer is done nor read again.
pub(crate) fn read_whole(arrays: &[&Array]) -> Result<()> {
    let built_on: Vec<Array> = DEFERRED.with(|d| match d.borrow_mut().as_mut() {
        Some(deferred) => arrays
            .iter()
            .filter_map(|a| deferred.unread.remove(&id(a)))
            .flat_map(|unread| unread.built_on)
            .collect(),
        None => Vec::new(),
    });
    mlx_rs::transforms::eval(arrays.iter().copied().chain(built_on.iter()))?;
    Ok(())
}

/// Whether `a` is a registered tensor none of which has been read here.
pub(crate) fn is_unread(a: &Array) -> bool {
    DEFERRED.with(|d| {
        d.borrow()
            .as_ref()
            .and_then(|deferred| deferred.unread.get(&id(a)))
            .is_some_and(|unread| !unread.divided)
    })
}

/// When `a` is a registered tensor: the runs `parts` (`(first, count)` entries along `axis`)
/// of it read from its file ([`TensorSource::read`]); `None` otherwise.
pub(crate) fn read_part(a: &Array, axis: usize, parts: &[(usize, usize)]) -> Option<Result<Array>> {
    let source = DEFERRED.with(|d| {
        let mut deferred = d.borrow_mut();
        let unread = deferred.as_mut()?.unread.get_mut(&id(a))?;
        unread.divided = true;
        Some(unread.source.clone())
    })?;
    Some(source.read(axis, parts))
}

/// Deferred reads over the layers built while it lives, one layer at a time
/// ([`DeferredReads::finish_layer`]).
/// Not `Send`: the registry it clears is its thread's.
pub(crate) struct DeferredReads {
    /// The model's folder, named when a tensor read whole fails.
    model_dir: PathBuf,
    thread_bound: std::marker::PhantomData<*const ()>,
}

impl DeferredReads {
    /// Deferred reads of the model in `model_dir` on this thread, until dropped.
    pub(crate) fn begin(model_dir: PathBuf) -> Self {
        DEFERRED.with(|d| {
            let mut d = d.borrow_mut();
            debug_assert!(d.is_none(), "deferred reads do not nest");
            *d = Some(Deferred::default());
        });
        Self {
            model_dir,
            thread_bound: std::marker::PhantomData,
        }
    }

    /// The layer built since the last call is divided: reads what it keeps whole (its
    /// registered tensors of which no part was read, with what was built on them) and evaluates
    /// the rest it deferred ([`settle`]); the registered tensors are let go, those divided
    /// unread.
    pub(crate) fn finish_layer(&self) -> Result<()> {
        let Some(deferred) = DEFERRED.with(|d| d.borrow_mut().as_mut().map(std::mem::take)) else {
            return Ok(());
        };
        let mut all = deferred.settle;
        for unread in deferred.unread.into_values().filter(|u| !u.divided) {
            all.push(unread.array);
            all.extend(unread.built_on);
        }
        mlx_rs::transforms::eval(all.iter()).map_err(|e| EngineError::CorruptWeights {
            path: self.model_dir.clone(),
            message: e.to_string(),
        })
    }
}

impl Drop for DeferredReads {
    fn drop(&mut self) {
        DEFERRED.with(|d| *d.borrow_mut() = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Backend;
    use crate::nn::layers::ShardParts;
    use crate::nn::weights::Weights;
    use mlx_rs::ops::indexing::IndexOp;

    /// A tensor's parts read from its file equal the same parts of the tensor read whole: rows,
    /// and columns of two segments (a fused projection's); float16 stored, float32 used (the
    /// CPU's cast). Reading a part lets the tensor go unread; reading another whole lets it go.
    #[test]
    fn parts_read_from_the_file_equal_the_whole_tensor_s() {
        let dir = tempfile::tempdir().unwrap();
        let a = mlx_rs::random::normal::<f32>(&[6, 8], None, None, None)
            .unwrap()
            .as_dtype(Dtype::Float16)
            .unwrap();
        let b = mlx_rs::random::normal::<f32>(&[4, 8], None, None, None)
            .unwrap()
            .as_dtype(Dtype::Float16)
            .unwrap();
        Array::save_safetensors(
            [("a", &a), ("b", &b)],
            None,
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        let a = a.as_dtype(Dtype::Float32).unwrap();
        let mut weights = Weights::load_lazily(dir.path(), Backend::Cpu, 1.0).unwrap();
        let deferred = DeferredReads::begin(dir.path().to_path_buf());
        let taken = weights.take("a").unwrap();
        assert!(is_unread(&taken));
        let copied = part_bytes_read();
        // Rank 1 of 2 by rows: rows 3..6.
        let rows = ShardParts::new(&[6], 6, 1, 2)
            .unwrap()
            .take(&taken, 0, (1, 1))
            .unwrap();
        assert_eq!(part_bytes_read() - copied, 3 * 8 * 2);
        assert!(!is_unread(&taken));
        let expected = a.index((3..6, ..));
        assert_eq!(rows.dtype(), Dtype::Float32);
        assert!(rows.eq_values(&expected).unwrap());
        // Rank 0 of 2 by columns of segments [4, 4]: columns 0..2 and 4..6.
        let columns = ShardParts::new(&[4, 4], 8, 0, 2)
            .unwrap()
            .take(&taken, 1, (1, 1))
            .unwrap();
        let expected =
            mlx_rs::ops::concatenate(&[a.index((.., 0..2)), a.index((.., 4..6))], 1).unwrap();
        assert!(columns.eq_values(&expected).unwrap());
        let whole = weights.take("b").unwrap();
        assert!(is_unread(&whole));
        read_whole(&[&whole]).unwrap();
        assert!(!is_unread(&whole));
        let b = b.as_dtype(Dtype::Float32).unwrap();
        assert!(whole.eq_values(&b).unwrap());
        deferred.finish_layer().unwrap();
        drop(deferred);
        assert!(!deferring());
    }
}
