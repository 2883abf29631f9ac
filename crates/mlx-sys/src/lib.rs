//! Raw bindings to mlx-c 0.7.0, linked against the `libmlx` of the official MLX 0.32.2 wheel.
//!
//! This crate stands in for crates.io's `mlx-sys` 0.7.0 (see `[patch.crates-io]` in the workspace
//! manifest) so that `mlx-rs` builds on Linux (CPU, CUDA) and macOS (Metal) without network access
//! beyond PyPI. `build.rs` explains every step; `README.md` lists the environment variables.
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// Directory holding the `libmlx` this crate was linked against (for rpaths and diagnostics).
pub const MLX_LIB_DIR: &str = env!("PERCH_MLX_LIB_DIR");

/// The MLX version of the wheel this crate was built against, e.g. `"0.32.2"`.
pub const MLX_VERSION: &str = env!("PERCH_MLX_VERSION");

/// `mlx-rs` seeds its default random state from the macOS-only `mach_approximate_time`;
/// elsewhere we provide it, counting nanoseconds on the monotonic clock.
#[cfg(not(target_os = "macos"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    // Never 0, so two processes seeded at start-up still differ by their wall-clock nanos.
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    wall.wrapping_add(start.elapsed().as_nanos() as u64)
}

extern "C" {
    /// The identity of `arr` (`mlx::core::array::id`): the same for every handle to one array,
    /// before and after it is evaluated, and distinct from any other live array's
    /// (`native/array_id.cpp`).
    pub fn perch_mlx_array_id(arr: mlx_array) -> usize;
}
