//! Which MLX backend runs the model, the dtype it computes in, and MLX's memory counters.
//!
//! One Perch binary serves every backend: the `libmlx` it loads decides (the CPU wheel here, the
//! Metal wheel on macOS, a CUDA wheel through `LD_LIBRARY_PATH` on NVIDIA machines).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use mlx_rs::{Device, DeviceType, Dtype};
use serde::Serialize;

/// The kind of device MLX computes on by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Cpu,
    Metal,
    Cuda,
}

impl Backend {
    /// The backend of MLX's default device, asked once per process (the loaded `libmlx` decides
    /// it and Perch never changes the default device), so the decode loop may call this freely.
    pub fn current() -> Self {
        static CURRENT: OnceLock<Backend> = OnceLock::new();
        *CURRENT.get_or_init(|| {
            let gpu = matches!(
                Device::try_default().and_then(|d| d.get_type()),
                Ok(DeviceType::Gpu)
            );
            match (gpu, cfg!(target_os = "macos")) {
                (false, _) => Backend::Cpu,
                (true, true) => Backend::Metal,
                (true, false) => Backend::Cuda,
            }
        })
    }

    /// How many GPUs MLX sees (CUDA counts the devices `CUDA_VISIBLE_DEVICES` leaves; 0 where
    /// the build has no GPU backend or the call fails).
    pub fn gpu_count() -> usize {
        let mut count = 0;
        // SAFETY: `count` outlives the call, which only writes it.
        let status =
            unsafe { mlx_sys::mlx_device_count(&mut count, mlx_sys::mlx_device_type__MLX_GPU) };
        if status == 0 {
            usize::try_from(count).unwrap_or(0)
        } else {
            0
        }
    }

    /// The dtype a floating-point weight stored as `stored` is computed in. On CPU everything runs
    /// in float32 (float16/bfloat16 arithmetic there is ~35x slower); on GPU half precision is
    /// kept and float32 becomes bfloat16 (MLX's CUDA quantized matmul is inaccurate in float32).
    pub fn compute_dtype(self, stored: Dtype) -> Dtype {
        match (self, stored) {
            (Backend::Cpu, _) => Dtype::Float32,
            (_, Dtype::Float32) => Dtype::Bfloat16,
            (_, other) => other,
        }
    }
}

/// MLX's switch for its CUDA caches' thrashing check (see [`prepare_mlx_environment`]).
pub const CACHE_THRASHING_CHECK: &str = "MLX_ENABLE_CACHE_THRASHING_CHECK";

/// What [`prepare_mlx_environment`] sets, given how the variables are now (`current`) and
/// whether this is macOS: each variable the user has not set, with Perch's value. The cache
/// thrashing check goes off ("0"); outside macOS a CUDA graph holds [`CUDA_OPS_PER_GRAPH`]
/// operations (on macOS the variable sizes Metal's command buffers, which MLX sizes per chip).
pub fn mlx_environment_settings(
    current: impl Fn(&str) -> Option<String>,
    macos: bool,
) -> Vec<(&'static str, String)> {
    let mut settings = vec![(CACHE_THRASHING_CHECK, "0".to_owned())];
    if !macos {
        settings.push((MAX_OPS_PER_BUFFER, CUDA_OPS_PER_GRAPH.to_string()));
    }
    settings.retain(|(name, _)| current(name).is_none());
    settings
}

/// The temporary directory of a rank of a group (`MLX_RANK` set to a number), given how the
/// variables are now (`current`): `rank-R` under Perch's `perch-ranks` folder in the temporary
/// directory (`TMPDIR`, else `/tmp`). `None` outside a group.
///
/// Why: MLX 0.32's CPU backend compiles fused operations into shared libraries in one folder
/// under the temporary directory, which every process on the machine shares, and loads one as
/// soon as the file exists. Two ranks on one machine compiling the same operation at once
/// (their first steps, in lockstep, on a machine where nothing is compiled yet) meet a
/// half-written library: "Could not load C++ shared library … file too short". A folder per
/// rank number keeps the ranks of a group apart, its libraries still kept from run to run (two
/// groups started at once on one machine still share a rank number's folder). MLX's CUDA
/// backend keeps its compiled kernels under the same directory unless `MLX_PTX_CACHE_DIR` is
/// set, so each rank compiles those once into its own folder too. (The tests' ranks in
/// `tests/distributed.rs` are test processes, not `perch`, and keep the shared folder.)
pub fn rank_temp_dir(current: impl Fn(&str) -> Option<String>) -> Option<String> {
    let rank: usize = current("MLX_RANK")?.trim().parse().ok()?;
    let base = current("TMPDIR")
        .filter(|dir| !dir.is_empty())
        .unwrap_or_else(|| "/tmp".to_owned());
    Some(format!(
        "{}/perch-ranks/rank-{rank}",
        base.trim_end_matches('/')
    ))
}

/// Sets, for this process, what MLX reads from the environment before its first GPU call; call
/// it first thing in `main`, before other threads start (it sets environment variables). A
/// rank of a group gets a temporary directory of its own ([`rank_temp_dir`]) where it can make
/// one (otherwise the shared one stays).
///
/// MLX 0.32's CUDA backend keeps its cuDNN attention plans (256), CUDA graphs (400) and
/// convolution plans (128) in LRU caches that throw "Cache thrashing is happening" once a
/// process has missed twice a cache's capacity in all, evictions included: a process that
/// meets 512 distinct prompt-chunk attention shapes over its life fails every new one after.
/// Perch buckets shapes so that a run meets few, but a menu-bar app or server lives for days of
/// prompts of every length: the check goes off unless the user set [`CACHE_THRASHING_CHECK`].
/// The caches stay bounded; a shape met again after its eviction is planned again (tens of
/// milliseconds), as a new one is. No effect on CPU or Metal. Outside macOS it also sizes
/// MLX's CUDA graphs ([`CUDA_OPS_PER_GRAPH`]).
///
/// On Linux with glibc it also fixes malloc's mmap threshold at [`MMAP_THRESHOLD`]: MLX's CPU
/// backend takes every array from `malloc`, and glibc's threshold otherwise rises to the
/// largest block freed (up to 32 MiB), after which KV caches and activations come from the heap
/// and their memory stays with the process when freed. Measured (docs/reliability.md): 16
/// concurrent 300-token requests on the default model in a 600 MiB cgroup were OOM-killed
/// with the moving threshold and finished with this one; decode throughput is unchanged within
/// run-to-run noise (a 128 KiB threshold cost a third of it).
pub fn prepare_mlx_environment() {
    let current = |name: &str| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned());
    for (name, value) in mlx_environment_settings(current, cfg!(target_os = "macos")) {
        std::env::set_var(name, value);
    }
    if let Some(dir) = rank_temp_dir(current) {
        if std::fs::create_dir_all(&dir).is_ok() {
            std::env::set_var("TMPDIR", dir);
        }
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; called before any engine thread.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        }
    }
}

/// The variable that bounds how many operations MLX's GPU backends put in one command buffer
/// (Metal) or CUDA graph (CUDA) before launching it.
pub const MAX_OPS_PER_BUFFER: &str = "MLX_MAX_OPS_PER_BUFFER";

/// Operations a CUDA graph holds before MLX launches it, as Perch sets [`MAX_OPS_PER_BUFFER`]
/// outside macOS unless the user set it ([`prepare_mlx_environment`]; the CPU backend does not
/// read it). MLX 0.32 launches a graph every 100 operations on Hopper and Blackwell GPUs (20 on
/// an A100, a DGX Spark and GPUs it does not list, where 30 is a little larger, not measured);
/// a batched decode step is 150–300 operations, and on an H200 the host's time to update and
/// launch a cached graph grows with its size. Measured on an H200 at 32 concurrent, Perch
/// alone (docs/benchmarks.md, "CUDA graph size"): MLX launching a `qwen3_moe` decode step took
/// 2.23 ms of the engine thread at 30 operations a graph against 2.73 at 100 and 3.64 at 1,000,
/// and peak memory fell by a tenth or more for every model measured.
pub const CUDA_OPS_PER_GRAPH: usize = 30;

/// glibc's mmap threshold Perch sets ([`prepare_mlx_environment`]): allocations this large or
/// larger are mapped on their own and unmapped when freed. glibc's `MALLOC_MMAP_THRESHOLD_`
/// overrides it.
pub const MMAP_THRESHOLD: i32 = 1 << 20;

/// MLX's allocator counters, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryStats {
    /// Memory held by live arrays.
    pub active_bytes: usize,
    /// Highest `active_bytes` since start or the last [`reset_peak_memory`].
    pub peak_bytes: usize,
    /// Freed buffers MLX keeps for reuse ([`clear_cache`] returns them).
    pub cache_bytes: usize,
    /// The Metal wired (resident) limit Perch set; `None` on backends without one.
    pub wired_limit_bytes: Option<usize>,
}

static WIRED_LIMIT: AtomicUsize = AtomicUsize::new(0);

/// Reads the counters. Never fails: a counter MLX cannot report reads as 0.
pub fn memory_stats() -> MemoryStats {
    let wired = WIRED_LIMIT.load(Ordering::Relaxed);
    let active_bytes = mlx_rs::memory::active_memory().unwrap_or(0);
    MemoryStats {
        active_bytes,
        // MLX's reset sets its peak to 0, not to what is live; what is live counts.
        peak_bytes: mlx_rs::memory::peak_memory().unwrap_or(0).max(active_bytes),
        cache_bytes: mlx_rs::memory::cache_memory().unwrap_or(0),
        wired_limit_bytes: (Backend::current() == Backend::Metal && wired > 0).then_some(wired),
    }
}

/// Starts a new peak measurement.
pub fn reset_peak_memory() {
    let _ = mlx_rs::memory::reset_peak_memory();
}

/// Returns MLX's buffer cache to the system.
pub fn clear_cache() {
    let _ = mlx_rs::memory::clear_cache();
}

/// [`clear_cache`] and [`trim_heap`]: MLX's buffer cache and the heap's free memory go back to
/// the system.
pub fn release_freed_memory() {
    clear_cache();
    trim_heap();
}

/// On Linux with glibc, `malloc_trim(0)`: the free pages of every malloc arena go back to the
/// system (elsewhere nothing). MLX's CPU backend takes arrays below [`MMAP_THRESHOLD`] from
/// malloc's heap; freed ones leave MLX's counters but stay resident, scattered between live
/// ones (a prefix cache's block copies and a step's activations interleave), until trimmed.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Sets the Metal wired limit in bytes (memory kept resident so weights are not paged out).
/// A no-op returning `false` on backends without one (CPU, CUDA).
pub fn set_wired_limit(bytes: usize) -> bool {
    swap_wired_limit(bytes).is_some()
}

/// [`set_wired_limit`], returning the limit it replaced (`None`: not set).
fn swap_wired_limit(bytes: usize) -> Option<usize> {
    if Backend::current() != Backend::Metal {
        return None;
    }
    let previous = mlx_rs::memory::set_wired_limit(bytes).ok()?;
    WIRED_LIMIT.store(bytes, Ordering::Relaxed);
    Some(previous)
}

/// A size entry (bytes) of MLX's device info for the default device, e.g. Metal's
/// `max_recommended_working_set_size`; `None` where the device has no such entry (the CPU's
/// info holds only its name and architecture).
pub fn device_info_size(key: &str) -> Option<usize> {
    let key = std::ffi::CString::new(key).ok()?;
    // Through mlx-rs first, which installs its error handler (mlx-c's own exits the process
    // on an error).
    Device::try_default().ok()?;
    // SAFETY: the device and info objects are made and freed here; `value` is written by mlx-c
    // only on success.
    unsafe {
        let mut device = mlx_sys::mlx_device_new();
        let mut info = mlx_sys::mlx_device_info_new();
        let mut value = 0usize;
        let found = mlx_sys::mlx_get_default_device(&mut device) == 0
            && mlx_sys::mlx_device_info_get(&mut info, device) == 0
            && mlx_sys::mlx_device_info_get_size(&mut value, info, key.as_ptr()) == 0;
        mlx_sys::mlx_device_info_free(info);
        mlx_sys::mlx_device_free(device);
        found.then_some(value)
    }
}

/// The wired limit raised to the GPU's recommended working set while a model is loaded, as
/// mlx_lm's `wired_limit` does around generation, so macOS keeps the weights and KV cache
/// resident instead of paging them out under pressure; the limit it replaced is restored when
/// this is dropped (an idle unload, the engine stopping). Metal only: elsewhere it does nothing
/// (not testable on the Linux machines this project has; see docs/reliability.md).
pub struct WiredLimit {
    previous: Option<usize>,
}

impl WiredLimit {
    pub fn raise() -> Self {
        let previous = match Backend::current() {
            Backend::Metal => {
                device_info_size("max_recommended_working_set_size").and_then(swap_wired_limit)
            }
            _ => None,
        };
        Self { previous }
    }

    /// Whether a limit was set (and will be restored).
    pub fn is_set(&self) -> bool {
        self.previous.is_some()
    }
}

impl Drop for WiredLimit {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            // As mlx_lm does, never changed while the device still runs work of the model's
            // (a step dispatched and never read, copies under way).
            let stream = mlx_rs::Stream::thread_local_or_default();
            // SAFETY: the stream handle is valid for the call.
            let _ = unsafe { mlx_sys::mlx_synchronize(stream.as_ref().as_ptr()) };
            if mlx_rs::memory::set_wired_limit(previous).is_ok() {
                WIRED_LIMIT.store(previous, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn perch_sets_only_what_the_user_left_unset() {
        let unset = |_: &str| None;
        let settings = super::mlx_environment_settings(unset, false);
        assert_eq!(
            settings,
            vec![
                ("MLX_ENABLE_CACHE_THRASHING_CHECK", "0".to_owned()),
                ("MLX_MAX_OPS_PER_BUFFER", "30".to_owned()),
            ]
        );
        // Metal's command buffers keep MLX's sizes.
        let settings = super::mlx_environment_settings(unset, true);
        assert_eq!(
            settings,
            vec![("MLX_ENABLE_CACHE_THRASHING_CHECK", "0".to_owned())]
        );
        // A value the user set, even an empty one, stays.
        let user = |name: &str| (name != "MLX_ENABLE_CACHE_THRASHING_CHECK").then(String::new);
        let settings = super::mlx_environment_settings(user, false);
        assert_eq!(
            settings,
            vec![("MLX_ENABLE_CACHE_THRASHING_CHECK", "0".to_owned())]
        );
        let user = |_: &str| Some("1".to_owned());
        assert!(super::mlx_environment_settings(user, false).is_empty());
    }

    /// A rank's temporary directory is its own, under the one it was given; outside a group, or
    /// with a rank that is not a number, there is none.
    #[test]
    fn each_rank_compiles_in_a_folder_of_its_own() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(
            super::rank_temp_dir(env(&[("MLX_RANK", "1")])).as_deref(),
            Some("/tmp/perch-ranks/rank-1")
        );
        assert_eq!(
            super::rank_temp_dir(env(&[("MLX_RANK", "0"), ("TMPDIR", "/var/t/")])).as_deref(),
            Some("/var/t/perch-ranks/rank-0")
        );
        assert_eq!(super::rank_temp_dir(env(&[])), None);
        assert_eq!(super::rank_temp_dir(env(&[("MLX_RANK", "../x")])), None);
    }

    use super::*;

    #[test]
    fn memory_counters_follow_allocations() {
        let before = memory_stats();
        let a = mlx_rs::ops::ones::<f32>(&[1024, 1024]).unwrap();
        a.eval().unwrap();
        let during = memory_stats();
        assert!(
            during.active_bytes >= before.active_bytes + 4 * 1024 * 1024 - 4096,
            "{before:?} -> {during:?}"
        );
        assert!(during.peak_bytes >= during.active_bytes);
        drop(a);
        let after = memory_stats();
        assert!(after.active_bytes < during.active_bytes);
        assert_eq!(after.wired_limit_bytes, None, "no wired limit on CPU");
        assert!(!set_wired_limit(1 << 30), "CPU has no wired limit to set");
        assert!(!super::WiredLimit::raise().is_set(), "nor one to raise");
        assert_eq!(
            super::device_info_size("max_recommended_working_set_size"),
            None,
            "the CPU's device info has no working set"
        );
        assert_eq!(
            super::device_info_size("device_name"),
            None,
            "a string, not a size"
        );
    }

    #[test]
    fn cpu_computes_in_float32() {
        for stored in [Dtype::Float16, Dtype::Bfloat16, Dtype::Float32] {
            assert_eq!(Backend::Cpu.compute_dtype(stored), Dtype::Float32);
        }
        assert_eq!(Backend::Cuda.compute_dtype(Dtype::Float32), Dtype::Bfloat16);
        assert_eq!(Backend::Metal.compute_dtype(Dtype::Float16), Dtype::Float16);
    }
}
