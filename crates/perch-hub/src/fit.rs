//! Whether a model fits in this machine's memory, judged before downloading it.

use serde::Serialize;

/// The share of RAM a model and its KV cache may use: macOS lets the GPU wire about this much
/// of unified memory by default (Metal's `recommendedMaxWorkingSetSize` is roughly 2/3 to 3/4
/// of RAM), and the rest is the system's and the apps'. Elsewhere it is the same rule of thumb.
pub const USABLE_MEMORY_FRACTION: f64 = 0.75;

/// How a model's weights and a KV cache budget compare with the usable memory
/// ([`USABLE_MEMORY_FRACTION`] of RAM).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryFit {
    /// Weights plus the whole KV cache budget fit.
    Fits,
    /// The weights fit, but not with the whole KV cache budget: it runs with a smaller one
    /// (shorter or fewer conversations).
    Tight,
    /// The weights alone are more than the usable memory.
    TooLarge,
    /// The size is not known (the Hub has no safetensors metadata for it).
    Unknown,
}

/// The machine's RAM in bytes (0 when the OS does not say), from `sysinfo`.
pub fn total_memory_bytes() -> u64 {
    let mut system = sysinfo::System::new();
    system.refresh_memory();
    system.total_memory()
}

/// Judges `weights_bytes` (`None`: unknown) plus `kv_cache_bytes` against `total_memory_bytes`
/// of RAM.
pub fn memory_fit(
    weights_bytes: Option<u64>,
    kv_cache_bytes: u64,
    total_memory_bytes: u64,
) -> MemoryFit {
    let Some(weights) = weights_bytes else {
        return MemoryFit::Unknown;
    };
    let usable = total_memory_bytes as f64 * USABLE_MEMORY_FRACTION;
    if weights.saturating_add(kv_cache_bytes) as f64 <= usable {
        MemoryFit::Fits
    } else if weights as f64 <= usable {
        MemoryFit::Tight
    } else {
        MemoryFit::TooLarge
    }
}

/// Judges a model divided evenly over the ranks of a group of machines (`perch serve --hosts`,
/// tensor or pipeline parallel), given each machine's RAM in bytes and the ranks it runs: every
/// rank holds an even share of `weights_bytes` (what each rank keeps whole, embeddings and
/// norms, is small beside it) and a KV cache budget of `kv_cache_bytes` of its own, and each
/// machine is judged by [`memory_fit`] on what its ranks hold together; the group fits as its
/// worst machine does. [`MemoryFit::Unknown`] without machines or ranks, or when a machine's
/// memory is not known (0).
pub fn group_memory_fit(
    weights_bytes: Option<u64>,
    kv_cache_bytes: u64,
    machines: &[(u64, usize)],
) -> MemoryFit {
    let ranks: u64 = machines.iter().map(|&(_, r)| r as u64).sum();
    if ranks == 0 || machines.iter().any(|&(total, _)| total == 0) {
        return MemoryFit::Unknown;
    }
    let worst = |a: MemoryFit, b: MemoryFit| {
        let rank = |f: MemoryFit| match f {
            MemoryFit::Fits => 0,
            MemoryFit::Tight => 1,
            MemoryFit::TooLarge => 2,
            MemoryFit::Unknown => 3,
        };
        if rank(b) > rank(a) {
            b
        } else {
            a
        }
    };
    machines
        .iter()
        .map(|&(total, here)| {
            let here = here as u64;
            memory_fit(
                weights_bytes.map(|w| w.div_ceil(ranks).saturating_mul(here)),
                kv_cache_bytes.saturating_mul(here),
                total,
            )
        })
        .fold(MemoryFit::Fits, worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn a_group_holds_what_one_host_cannot() {
        // 20 GiB of weights: too large for one 16 GiB host (12 GiB usable); 10 GiB a rank over
        // two machines, with the 3 GiB KV budget 13 GiB: tight.
        let one = memory_fit(Some(20 * GIB), 3 * GIB, 16 * GIB);
        assert_eq!(one, MemoryFit::TooLarge);
        let group = |machines: &[(u64, usize)]| group_memory_fit(Some(20 * GIB), 3 * GIB, machines);
        assert_eq!(group(&[(16 * GIB, 1), (16 * GIB, 1)]), MemoryFit::Tight);
        assert_eq!(
            group(&[(16 * GIB, 1), (64 * GIB, 1), (16 * GIB, 1)]),
            MemoryFit::Fits
        );
        // The worst machine decides: 10 GiB a rank does not fit an 8 GiB one.
        assert_eq!(group(&[(64 * GIB, 1), (8 * GIB, 1)]), MemoryFit::TooLarge);
        // Two ranks on one machine hold all the weights and two KV budgets there.
        assert_eq!(group(&[(16 * GIB, 2)]), MemoryFit::TooLarge);
        assert_eq!(group(&[(32 * GIB, 2)]), MemoryFit::Tight);
        assert_eq!(group(&[(16 * GIB, 1)]), one);
        // Unknown memory, no machines or no size: unknown.
        assert_eq!(group(&[(16 * GIB, 1), (0, 1)]), MemoryFit::Unknown);
        assert_eq!(group(&[]), MemoryFit::Unknown);
        assert_eq!(
            group_memory_fit(None, GIB, &[(16 * GIB, 1)]),
            MemoryFit::Unknown
        );
        // A hostile size does not overflow.
        assert_eq!(
            group_memory_fit(Some(u64::MAX), u64::MAX, &[(16 * GIB, 3)]),
            MemoryFit::TooLarge
        );
    }

    #[test]
    fn a_16_gib_machine() {
        // 12 GiB usable.
        assert_eq!(
            memory_fit(Some(4 * GIB), 2 * GIB, 16 * GIB),
            MemoryFit::Fits
        );
        assert_eq!(
            memory_fit(Some(10 * GIB), 2 * GIB, 16 * GIB),
            MemoryFit::Fits
        );
        assert_eq!(
            memory_fit(Some(11 * GIB), 2 * GIB, 16 * GIB),
            MemoryFit::Tight
        );
        assert_eq!(memory_fit(Some(13 * GIB), 0, 16 * GIB), MemoryFit::TooLarge);
        assert_eq!(memory_fit(None, 0, 16 * GIB), MemoryFit::Unknown);
    }
}
