//! The few MLX operations Perch needs that mlx-rs 0.33 does not wrap, called through mlx-sys.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

fn from_op(name: &str, f: impl FnOnce(*mut mlx_sys::mlx_array) -> i32) -> Result<Array, Exception> {
    // SAFETY: `mlx_array_new` returns an empty handle that the op fills; ownership passes to Array.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        if f(&mut res) != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::from(format!("mlx {name} failed").as_str()));
        }
        Ok(Array::from_ptr(res))
    }
}

/// `a[start[0]:stop[0], start[1]:stop[1], ...]` with unit strides; `start`/`stop` cover every axis.
pub fn slice(a: &Array, start: &[i32], stop: &[i32]) -> Result<Array, Exception> {
    let strides = vec![1; start.len()];
    let stream = Stream::thread_local_or_default();
    from_op("slice", |res| unsafe {
        mlx_sys::mlx_slice(
            res,
            a.as_ptr(),
            start.as_ptr(),
            start.len(),
            stop.as_ptr(),
            stop.len(),
            strides.as_ptr(),
            strides.len(),
            stream.as_ref().as_ptr(),
        )
    })
}

/// The indices of the `k` largest of `scores` along the last axis (in no particular order, as
/// mlx_lm's `argpartition(kth=-k)[..., -k:]`) and those scores, each `[..., k]`.
pub fn top_k(scores: &Array, k: i32) -> Result<(Array, Array), Exception> {
    let shape = scores.shape();
    let last = shape.len() - 1;
    let all = mlx_rs::ops::argpartition_axis(scores, shape[last] - k, -1)?;
    let mut start = vec![0; shape.len()];
    start[last] = shape[last] - k;
    let indices = slice(&all, &start, shape)?;
    let top = scores.take_along_axis(&indices, -1)?;
    Ok((indices, top))
}

/// A copy of `src` with `src[start:stop] = update` (functional; MLX reuses the buffer when it can).
pub fn slice_update(
    src: &Array,
    update: &Array,
    start: &[i32],
    stop: &[i32],
) -> Result<Array, Exception> {
    let strides = vec![1; start.len()];
    let stream = Stream::thread_local_or_default();
    from_op("slice_update", |res| unsafe {
        mlx_sys::mlx_slice_update(
            res,
            src.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            start.len(),
            stop.as_ptr(),
            stop.len(),
            strides.as_ptr(),
            strides.len(),
            stream.as_ref().as_ptr(),
        )
    })
}

/// `value` in `dtype` (rounded as `as_dtype` rounds it), made and evaluated once per value, dtype
/// and thread: a constant an operation takes every step or pass launches no cast besides (a
/// fresh scalar's `as_dtype` is a copy kernel of its own on GPUs). Keep it to a few fixed values
/// a model uses (the cache holds every one asked for on the thread).
pub fn scalar(value: f32, dtype: Dtype) -> Result<Array, Exception> {
    thread_local! {
        static SCALARS: std::cell::RefCell<Vec<(u32, Array)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    SCALARS.with(|scalars| {
        let mut scalars = scalars.borrow_mut();
        let bits = value.to_bits();
        if let Some((_, a)) = scalars
            .iter()
            .find(|(b, a)| *b == bits && a.dtype() == dtype)
        {
            return Ok(a.clone());
        }
        let a = Array::from_f32(value).as_dtype(dtype)?;
        a.eval()?;
        scalars.push((bits, a.clone()));
        Ok(a)
    })
}

/// `a` in a buffer of its own. A slice is a view that keeps its whole source alive, and MLX's
/// `copy`/`contiguous` may share the source's buffer, so this multiplies by one (exact for every
/// float, `-0.0` and infinities included), which always writes a new array. The one is a cached
/// [`scalar`], so a copy launches one kernel, not a cast besides (the prefix cache copies
/// hundreds of block runs per prefill pass on GPUs).
pub fn owned_copy(a: &Array) -> Result<Array, Exception> {
    mlx_rs::ops::multiply(a, &scalar(1.0, a.dtype())?)
}

/// An optional int for mlx-c.
fn some_int(value: i32) -> mlx_sys::mlx_optional_int {
    mlx_sys::mlx_optional_int {
        value,
        has_value: true,
    }
}

/// A null array handle: mlx-c's "none" for an optional array argument.
fn none_array() -> mlx_sys::mlx_array {
    // SAFETY: an empty handle, which mlx-c reads as an absent array.
    unsafe { mlx_sys::mlx_array_new() }
}

/// `x @ dequantize(w).T` (or `x @ dequantize(w)` without `transpose`) for weights quantized in
/// MLX mode `mode` (`c"affine"`, `c"mxfp4"`, `c"mxfp8"`): mlx-rs 0.33 wraps only affine.
/// `biases`: the affine zero points (none for the microscaling modes).
#[allow(clippy::too_many_arguments)]
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    transpose: bool,
    (group_size, bits): (i32, i32),
    mode: &std::ffi::CStr,
) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    from_op("quantized_matmul", |res| unsafe {
        mlx_sys::mlx_quantized_matmul(
            res,
            x.as_ptr(),
            w.as_ptr(),
            scales.as_ptr(),
            biases.map_or_else(none_array, |b| b.as_ptr()),
            transpose,
            some_int(group_size),
            some_int(bits),
            mode.as_ptr(),
            stream.as_ref().as_ptr(),
        )
    })
}

/// [`quantized_matmul`] with the weights of expert `rhs_indices[...]` for each row (MLX's
/// `gather_qmm`, transposed weights).
#[allow(clippy::too_many_arguments)]
pub fn gather_qmm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    rhs_indices: &Array,
    (group_size, bits): (i32, i32),
    mode: &std::ffi::CStr,
    sorted: bool,
) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    from_op("gather_qmm", |res| unsafe {
        mlx_sys::mlx_gather_qmm(
            res,
            x.as_ptr(),
            w.as_ptr(),
            scales.as_ptr(),
            biases.map_or_else(none_array, |b| b.as_ptr()),
            none_array(),
            rhs_indices.as_ptr(),
            true,
            some_int(group_size),
            some_int(bits),
            mode.as_ptr(),
            sorted,
            stream.as_ref().as_ptr(),
        )
    })
}

/// The dense matrix of weights quantized in MLX mode `mode`, in `dtype`; without one, in the
/// scales' dtype for affine (the microscaling modes' uint8 scales carry none: give one).
pub fn dequantize(
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    (group_size, bits): (i32, i32),
    mode: &std::ffi::CStr,
    dtype: Option<mlx_rs::Dtype>,
) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    let dtype = mlx_sys::mlx_optional_dtype {
        value: dtype.map_or(mlx_sys::mlx_dtype__MLX_FLOAT32, |d| d as mlx_sys::mlx_dtype),
        has_value: dtype.is_some(),
    };
    from_op("dequantize", |res| unsafe {
        mlx_sys::mlx_dequantize(
            res,
            w.as_ptr(),
            scales.as_ptr(),
            biases.map_or_else(none_array, |b| b.as_ptr()),
            some_int(group_size),
            some_int(bits),
            mode.as_ptr(),
            none_array(),
            dtype,
            stream.as_ref().as_ptr(),
        )
    })
}

/// Waits until the default device's stream has finished all work queued on it (MLX's
/// `synchronize`): what an engine thread does before it ends, so that no kernel is still
/// running when the process exits.
pub fn synchronize() -> Result<(), Exception> {
    let stream = Stream::thread_local_or_default();
    // SAFETY: the stream handle is valid for the call.
    match unsafe { mlx_sys::mlx_synchronize(stream.as_ref().as_ptr()) } {
        0 => Ok(()),
        _ => Err(Exception::from("mlx synchronize failed")),
    }
}

/// Writes MLX's listing of the graph that computes `outputs` (`mlx_print_graph`: one line per
/// operation, with its inputs and outputs) to the file at `path`, replacing it. A diagnostic:
/// what a step launches, counted by operation (`PERCH_DECODE_GRAPH_DIR`, docs/benchmarks.md).
pub fn print_graph(path: &std::path::Path, outputs: &[&Array]) -> Result<(), Exception> {
    let fail = |what: &str| Exception::from(format!("{what} {}", path.display()).as_str());
    let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| fail("a NUL in the path"))?;
    // SAFETY: the file and the vector are created, used and freed here; the arrays are valid
    // handles for the call.
    unsafe {
        let file = mlx_sys::fopen(name.as_ptr(), c"w".as_ptr());
        if file.is_null() {
            return Err(fail("cannot write"));
        }
        let vector = mlx_sys::mlx_vector_array_new();
        for a in outputs {
            mlx_sys::mlx_vector_array_append_value(vector, a.as_ptr());
        }
        let namer = mlx_sys::mlx_node_namer_new();
        let status = mlx_sys::mlx_print_graph(file, namer, vector);
        mlx_sys::mlx_node_namer_free(namer);
        mlx_sys::mlx_vector_array_free(vector);
        mlx_sys::fclose(file);
        match status {
            0 => Ok(()),
            _ => Err(fail("mlx print_graph failed for")),
        }
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::{Array, Dtype};

    use super::{owned_copy, scalar, slice};

    /// A cached scalar is the value `as_dtype` gives, asked again or after another value or
    /// dtype.
    #[test]
    fn cached_scalars_are_the_values_as_dtype_rounds_them() {
        let values = [1.0f32, 0.0, -0.0, 1.0986123, -1.6e38, 3.5];
        for _ in 0..2 {
            for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
                for &v in &values {
                    let cached = scalar(v, dtype).unwrap();
                    let fresh = Array::from_f32(v).as_dtype(dtype).unwrap();
                    assert_eq!(cached.dtype(), dtype);
                    let (a, b): (f32, f32) = (
                        cached.as_dtype(Dtype::Float32).unwrap().item_exact(),
                        fresh.as_dtype(Dtype::Float32).unwrap().item_exact(),
                    );
                    assert_eq!(a.to_bits(), b.to_bits(), "{v} in {dtype:?}");
                }
            }
        }
    }

    /// A copy is exact in every float dtype (the one it multiplies by is cached per dtype), and
    /// owns its data: the slice it was made from can go.
    #[test]
    fn owned_copies_are_exact_in_every_float_dtype() {
        let values = [1.5f32, -0.0, -3.25, f32::INFINITY, f32::NEG_INFINITY, 7.0];
        for dtype in [
            Dtype::Float32,
            Dtype::Bfloat16,
            Dtype::Float16,
            Dtype::Float32,
        ] {
            let source = Array::from_slice(&values, &[2, 3]).as_dtype(dtype).unwrap();
            let copy = {
                let view = slice(&source, &[0, 1], &[2, 3]).unwrap();
                owned_copy(&view).unwrap()
            };
            assert_eq!(copy.dtype(), dtype);
            let copied: Vec<f32> = copy.as_dtype(Dtype::Float32).unwrap().as_slice().to_vec();
            // Columns 1..3 of both rows, exact in every dtype here.
            let expected = [-0.0f32, -3.25, f32::NEG_INFINITY, 7.0];
            assert_eq!(copied.len(), 4);
            assert_eq!(
                copied[0].to_bits(),
                (-0.0f32).to_bits(),
                "{dtype:?}: -0.0 kept"
            );
            for (a, b) in copied.iter().zip(&expected) {
                assert_eq!(a.to_bits(), b.to_bits(), "{dtype:?}");
            }
        }
    }
}
