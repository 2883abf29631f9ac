//! Perch's own GPU kernels through MLX's custom-kernel API (`mx.fast.cuda_kernel` and
//! `mx.fast.metal_kernel`, called through mlx-c): MLX compiles the source at its first use
//! (NVRTC on CUDA, the Metal compiler on Metal; cached per process), launches it as one node of
//! its graph, and traces it into compiled steps like any op. Used by
//! [`crate::attention::decode_kernel`] (CUDA, where MLX 0.32.2's CUDA backend has no fused
//! kernel), [`crate::attention::gated_delta_kernel`] (CUDA and Metal),
//! [`crate::nn::expert_kernel`], [`crate::nn::norm_kernel`] and [`crate::nn::rope_kernel`]
//! (CUDA). MLX caches a compiled kernel by its name and template arguments, so an input whose
//! dtype is not fixed by a template argument must have one dtype per kernel name.

use std::ffi::{CStr, CString};

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

use crate::device::Backend;

/// A kernel made by `mlx_fast_cuda_kernel_new` or `mlx_fast_metal_kernel_new`, freed when
/// dropped. Each module keeps its kernels per thread (the engine thread owns MLX's arrays).
pub(crate) struct CustomKernel {
    handle: Handle,
    name: &'static str,
}

enum Handle {
    Cuda(mlx_sys::mlx_fast_cuda_kernel),
    Metal(mlx_sys::mlx_fast_metal_kernel),
}

impl Drop for CustomKernel {
    fn drop(&mut self) {
        // SAFETY: made by the matching `_new`, freed once.
        unsafe {
            match self.handle {
                Handle::Cuda(handle) => mlx_sys::mlx_fast_cuda_kernel_free(handle),
                Handle::Metal(handle) => mlx_sys::mlx_fast_metal_kernel_free(handle),
            };
        }
    }
}

/// A template argument of a launch: an integer or a dtype (`T`).
pub(crate) enum TemplateArg {
    Int(&'static CStr, i32),
    Dtype(&'static CStr, Dtype),
}

fn strings(names: &[&str]) -> mlx_sys::mlx_vector_string {
    // SAFETY: a new vector; each name is copied by mlx-c.
    unsafe {
        let vector = mlx_sys::mlx_vector_string_new();
        for name in names {
            let name = CString::new(*name).expect("no NUL in a name");
            mlx_sys::mlx_vector_string_append_value(vector, name.as_ptr());
        }
        vector
    }
}

/// A launch's configuration, for the kernel's backend.
enum Config {
    Cuda(mlx_sys::mlx_fast_cuda_kernel_config),
    Metal(mlx_sys::mlx_fast_metal_kernel_config),
}

impl Config {
    /// A configuration with `outputs`, the grid, the thread group and the template arguments.
    ///
    /// # Safety
    /// Freed by [`Config::free`] only.
    unsafe fn new(
        handle: &Handle,
        outputs: &[(&[i32], Dtype)],
        grid: (i32, i32, i32),
        group: (i32, i32, i32),
        template: &[TemplateArg],
    ) -> Self {
        // The same calls for either backend, through its own mlx-c functions.
        macro_rules! configure {
            ($variant:ident, $new:ident, $output:ident, $grid:ident, $group:ident, $int:ident, $dtype:ident) => {{
                let config = mlx_sys::$new();
                for (shape, dtype) in outputs {
                    mlx_sys::$output(
                        config,
                        shape.as_ptr(),
                        shape.len(),
                        *dtype as mlx_sys::mlx_dtype,
                    );
                }
                mlx_sys::$grid(config, grid.0, grid.1, grid.2);
                mlx_sys::$group(config, group.0, group.1, group.2);
                for arg in template {
                    match arg {
                        TemplateArg::Int(name, value) => {
                            mlx_sys::$int(config, name.as_ptr(), *value)
                        }
                        TemplateArg::Dtype(name, dtype) => {
                            mlx_sys::$dtype(config, name.as_ptr(), *dtype as mlx_sys::mlx_dtype)
                        }
                    };
                }
                Config::$variant(config)
            }};
        }
        match handle {
            Handle::Cuda(_) => configure!(
                Cuda,
                mlx_fast_cuda_kernel_config_new,
                mlx_fast_cuda_kernel_config_add_output_arg,
                mlx_fast_cuda_kernel_config_set_grid,
                mlx_fast_cuda_kernel_config_set_thread_group,
                mlx_fast_cuda_kernel_config_add_template_arg_int,
                mlx_fast_cuda_kernel_config_add_template_arg_dtype
            ),
            Handle::Metal(_) => configure!(
                Metal,
                mlx_fast_metal_kernel_config_new,
                mlx_fast_metal_kernel_config_add_output_arg,
                mlx_fast_metal_kernel_config_set_grid,
                mlx_fast_metal_kernel_config_set_thread_group,
                mlx_fast_metal_kernel_config_add_template_arg_int,
                mlx_fast_metal_kernel_config_add_template_arg_dtype
            ),
        }
    }

    /// # Safety
    /// Once, for a configuration made by [`Config::new`].
    unsafe fn free(self) {
        match self {
            Config::Cuda(config) => mlx_sys::mlx_fast_cuda_kernel_config_free(config),
            Config::Metal(config) => mlx_sys::mlx_fast_metal_kernel_config_free(config),
        };
    }
}

impl CustomKernel {
    /// A kernel for `backend` (CUDA or Metal source) `name` whose body is `source`, reading
    /// `inputs` and writing `outputs` (the parameter names the source uses; `<name>_shape` /
    /// `<name>_strides` of an input are passed where the source reads them). With
    /// `row_contiguous`, MLX copies inputs that are not row-contiguous first; without, the
    /// source must follow their strides.
    pub fn new(
        backend: Backend,
        name: &'static CStr,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        row_contiguous: bool,
    ) -> Self {
        Self::with_header(backend, name, inputs, outputs, source, "", row_contiguous)
    }

    /// [`CustomKernel::new`] with `header` (device functions, includes) placed before the
    /// kernel's function.
    pub fn with_header(
        backend: Backend,
        name: &'static CStr,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
        row_contiguous: bool,
    ) -> Self {
        // The name carries a hash of the code (MLX writes the kernel's signature from the
        // inputs' and outputs' names: they count too), so that no cache keyed by name and
        // template arguments can hand a Perch with another kernel body the old one. (MLX 0.32's
        // CUDA backend looks custom kernels up in its disk cache, `$MLX_PTX_CACHE_DIR`, but never
        // writes them there: each process compiles them with NVRTC, docs/benchmarks.md.)
        let signature = format!("{inputs:?}{outputs:?}{row_contiguous}");
        let mlx_name = CString::new(format!(
            "{}_{:016x}",
            name.to_str().expect("an ASCII kernel name"),
            fnv1a(&[signature.as_bytes(), header.as_bytes(), source.as_bytes()])
        ))
        .expect("no NUL in the name");
        let source = CString::new(source).expect("no NUL in the source");
        let header = CString::new(header).expect("no NUL in the header");
        let (input_names, output_names) = (strings(inputs), strings(outputs));
        // SAFETY: every argument is valid for the call; mlx-c copies the strings.
        let handle = unsafe {
            let handle = match backend {
                Backend::Metal => Handle::Metal(mlx_sys::mlx_fast_metal_kernel_new(
                    mlx_name.as_ptr(),
                    input_names,
                    output_names,
                    source.as_ptr(),
                    header.as_ptr(),
                    row_contiguous,
                    false,
                )),
                _ => Handle::Cuda(mlx_sys::mlx_fast_cuda_kernel_new(
                    mlx_name.as_ptr(),
                    input_names,
                    output_names,
                    source.as_ptr(),
                    header.as_ptr(),
                    row_contiguous,
                    0,
                )),
            };
            mlx_sys::mlx_vector_string_free(input_names);
            mlx_sys::mlx_vector_string_free(output_names);
            handle
        };
        Self {
            handle,
            name: name.to_str().unwrap_or("a custom kernel"),
        }
    }

    /// Launches the kernel lazily (as an op of MLX's graph) on `inputs`, `threads_per_group`
    /// threads a group over a grid of `grid` threads (MLX's convention: threads, not groups, in
    /// all), giving one array per `outputs` entry (shape and dtype).
    pub fn apply(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        grid: (i32, i32, i32),
        threads_per_group: (i32, i32, i32),
        template: &[TemplateArg],
    ) -> Result<Vec<Array>, Exception> {
        let stream = Stream::thread_local_or_default();
        // SAFETY: handles made here are freed here; the arrays outlive the call; each result
        // array is copied out of the vector with a reference of its own.
        unsafe {
            let config = Config::new(&self.handle, outputs, grid, threads_per_group, template);
            let input_vector = mlx_sys::mlx_vector_array_new();
            for a in inputs {
                mlx_sys::mlx_vector_array_append_value(input_vector, a.as_ptr());
            }
            let mut output_vector = mlx_sys::mlx_vector_array_new();
            let stream = stream.as_ref().as_ptr();
            let status = match (&self.handle, &config) {
                (Handle::Cuda(handle), Config::Cuda(config)) => {
                    mlx_sys::mlx_fast_cuda_kernel_apply(
                        &mut output_vector,
                        *handle,
                        input_vector,
                        *config,
                        stream,
                    )
                }
                (Handle::Metal(handle), Config::Metal(config)) => {
                    mlx_sys::mlx_fast_metal_kernel_apply(
                        &mut output_vector,
                        *handle,
                        input_vector,
                        *config,
                        stream,
                    )
                }
                _ => unreachable!("a configuration is made for its kernel's backend"),
            };
            mlx_sys::mlx_vector_array_free(input_vector);
            config.free();
            let result =
                if status == 0 && mlx_sys::mlx_vector_array_size(output_vector) == outputs.len() {
                    let mut arrays = Vec::with_capacity(outputs.len());
                    for i in 0..outputs.len() {
                        let mut out = mlx_sys::mlx_array_new();
                        if mlx_sys::mlx_vector_array_get(&mut out, output_vector, i) != 0 {
                            mlx_sys::mlx_array_free(out);
                            break;
                        }
                        arrays.push(Array::from_ptr(out));
                    }
                    if arrays.len() == outputs.len() {
                        Ok(arrays)
                    } else {
                        Err(Exception::custom(format!(
                            "{}: an output is missing",
                            self.name
                        )))
                    }
                } else {
                    Err(Exception::custom(format!(
                        "{}: MLX's custom kernel failed",
                        self.name
                    )))
                };
            mlx_sys::mlx_vector_array_free(output_vector);
            result
        }
    }
}

/// The 64-bit FNV-1a hash of `parts` in turn (a kernel's name suffix: stable across builds and
/// platforms, unlike `std`'s hasher).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    parts
        .iter()
        .flat_map(|part| part.iter())
        .fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
        })
}

/// A kernel kept per thread in `cell` (the engine thread owns MLX's arrays): `make` makes it on
/// the thread's first call, `run` launches it.
pub(crate) fn with_kernel<R>(
    cell: &'static std::thread::LocalKey<std::cell::RefCell<Option<CustomKernel>>>,
    make: impl FnOnce() -> CustomKernel,
    run: impl FnOnce(&CustomKernel) -> R,
) -> R {
    cell.with(|kernel| run(kernel.borrow_mut().get_or_insert_with(make)))
}

/// Milliseconds one evaluated call of `f` takes, averaged over 20 after a first (for the
/// device checks' timings against MLX).
pub(crate) fn time_call(f: &dyn Fn() -> crate::Result<Array>) -> crate::Result<f64> {
    f()?.eval()?;
    let start = std::time::Instant::now();
    for _ in 0..20 {
        f()?.eval()?;
    }
    Ok(start.elapsed().as_secs_f64() * 1e3 / 20.0)
}

/// The largest `|a − b|` over two arrays of one shape, compared in float32 (the device checks).
pub(crate) fn max_abs_error(a: &Array, b: &Array) -> crate::Result<f32> {
    let f32 = |x: &Array| x.as_dtype(Dtype::Float32);
    Ok(
        mlx_rs::ops::abs(&mlx_rs::ops::subtract(&f32(a)?, &f32(b)?)?)?
            .max(None)?
            .item_exact::<f32>(),
    )
}

/// The largest |`ours` − `reference`| over the largest |`reference`|, in float32 (the device
/// checks' measure for products). Both are evaluated before they are read, so that a kernel
/// that fails to compile or launch is an error here (a load check then turns it off), not a
/// panic.
pub(crate) fn relative_error(ours: &Array, reference: &Array) -> crate::Result<f32> {
    use mlx_rs::ops;
    let f32 = |x: &Array| x.as_dtype(Dtype::Float32);
    let (ours, reference) = (f32(ours)?, f32(reference)?);
    let largest = ops::abs(&reference)?.max(None)?;
    let difference = ops::abs(&ops::subtract(&ours, &reference)?)?.max(None)?;
    mlx_rs::transforms::eval([&largest, &difference])?;
    Ok(difference.item_exact::<f32>() / largest.item_exact::<f32>().max(1e-6))
}

/// A load check's verdict on case `name`: `Err` when its largest error is above `tolerance`
/// or NaN.
pub(crate) fn within(name: &str, error: f32, tolerance: f32) -> Result<(), String> {
    match error.is_nan() || error > tolerance {
        true => Err(format!("{name}: largest error {error:.2e}")),
        false => Ok(()),
    }
}

/// One unit in the last place relative to 1 in `dtype` (float32: 1e-5, for sums reduced in
/// another order): a device check's tolerance is a few of these times its largest output.
pub(crate) fn unit_in_last_place(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Float32 => 1e-5,
        Dtype::Float16 => 2f32.powi(-10),
        _ => 2f32.powi(-7),
    }
}

/// A device check's case `line` as its report, or the kernel's error when `error` is NaN or
/// past `tolerance`.
pub(crate) fn judged(
    kernel: &str,
    line: String,
    error: f32,
    tolerance: f32,
) -> crate::Result<String> {
    if error.is_nan() || error > tolerance {
        return Err(crate::EngineError::Kernel(format!("{kernel}: {line}")));
    }
    Ok(line)
}

/// Random packed quantized words of `shape` (uint32, every bit pattern as likely), their low
/// and high 16 bits drawn from the keys of `seeds` (the device checks' random weights).
pub(crate) fn random_words(shape: &[i32], seeds: (u64, u64)) -> crate::Result<Array> {
    use mlx_rs::random::{key, randint};
    let half = |seed: u64| -> crate::Result<Array> {
        Ok(randint::<_, i32>(0, 1 << 16, shape, Some(&key(seed)?))?.as_dtype(Dtype::Uint32)?)
    };
    let high = mlx_rs::ops::multiply(&half(seeds.1)?, Array::from_slice(&[1u32 << 16], &[1]))?;
    Ok(mlx_rs::ops::add(&half(seeds.0)?, &high)?)
}

/// Zeros of `shape` and `dtype` (the kernels' unit tests of what they take).
#[cfg(test)]
pub(crate) fn zeros(shape: &[i32], dtype: Dtype) -> Array {
    mlx_rs::ops::zeros_dtype(shape, dtype).unwrap()
}

#[cfg(test)]
mod tests {
    use super::fnv1a;

    #[test]
    fn kernel_names_hash_their_code() {
        // FNV-1a's published 64-bit vectors.
        assert_eq!(fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(&[b"a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(&[b"foobar"]), 0x8594_4171_f739_67e8);
        // Split anywhere, the same bytes hash alike; one changed byte does not.
        assert_eq!(fnv1a(&[b"foo", b"bar"]), fnv1a(&[b"foobar"]));
        assert_ne!(
            fnv1a(&[b"", b"y[i] = x[i];"]),
            fnv1a(&[b"", b"y[i] = x[j];"])
        );
    }
}
