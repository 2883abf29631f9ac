//! The few MLX operations Perch needs that mlx-rs 0.33 does not wrap, called through mlx-sys.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};

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

/// `a` in a buffer of its own. A slice is a view that keeps its whole source alive, and MLX's
/// `copy`/`contiguous` may share the source's buffer, so this multiplies by one (exact for every
/// float, `-0.0` and infinities included), which always writes a new array.
pub fn owned_copy(a: &Array) -> Result<Array, Exception> {
    mlx_rs::ops::multiply(a, &Array::from_f32(1.0).as_dtype(a.dtype())?)
}
