//! The shapes a batch's steps are padded to: rows, KV capacity and prefill chunk widths, each
//! rounded up to one of a few sizes per doubling, so that a run meets few distinct shapes (MLX
//! builds a graph, and on CUDA a cuDNN plan and a CUDA graph, per new shape).

/// Positions by which a KV cache's buffers grow (mlx-lm's `KVCache.step`).
pub const CAPACITY_STEP: usize = 256;

/// `n` rounded up to a multiple of a quarter of the power of two below it, and of `min_step`:
/// four sizes per doubling, at most 25% padding once `n >= 4 * min_step`.
pub fn quarter_step_bucket(n: usize, min_step: usize) -> usize {
    let power = 1usize << (usize::BITS - 1 - n.max(1).leading_zeros());
    let step = (power / 4).max(min_step);
    n.max(1).div_ceil(step) * step
}

/// Rows for `n` occupied slots: 1, 2, 4, 8, then four sizes per doubling (at least 4 apart): at
/// most 25% padding from 16 rows on, 28 shapes up to 512 rows.
pub fn row_bucket(n: usize) -> usize {
    match n {
        0..=1 => 1,
        2 => 2,
        3..=4 => 4,
        5..=8 => 8,
        _ => quarter_step_bucket(n, 4),
    }
}

/// Capacity for `n` positions: a multiple of [`CAPACITY_STEP`] (256) up to 1,024, then four
/// sizes per doubling: at most 25% padding from 1,024 on, 44 shapes up to a million tokens.
pub fn capacity_bucket(n: usize) -> usize {
    quarter_step_bucket(n, CAPACITY_STEP)
}

/// The padded width of a batched prefill pass whose longest chunk is `n` tokens: a multiple of 16
/// up to 64, then four sizes per doubling (at most 25% padding), so that prompts of every length
/// meet few distinct graphs.
pub fn prefill_chunk_bucket(n: usize) -> usize {
    quarter_step_bucket(n, 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_size_with_bounded_padding() {
        let mut rows = std::collections::BTreeSet::new();
        for n in 1..=512 {
            let r = row_bucket(n);
            assert!(r >= n);
            assert!(n < 8 || r * 4 <= n * 5 + 28, "{n} -> {r}");
            rows.insert(r);
        }
        assert!(rows.len() <= 28, "{} row shapes", rows.len());
        let mut caps = std::collections::BTreeSet::new();
        for n in (1..=1 << 20).step_by(97) {
            let c = capacity_bucket(n);
            assert!(c >= n && (n < 1024 || c * 4 <= n * 5), "{n} -> {c}");
            assert_eq!(c % 256, 0, "{n} -> {c}");
            caps.insert(c);
        }
        assert!(caps.len() <= 44, "{} capacity shapes", caps.len());
    }
}
