//! A sampler's random stream on the host: MLX's keys and random bits (Threefry-2x32 with 20
//! rounds, Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; laid out as
//! MLX's `RandomBits` primitive lays out a key's counters), so that splitting a request's key
//! and drawing its uniform for a step cost no device operations, with the values MLX's
//! `random::split` and `random::uniform` give for the same key (asserted against them below).

/// An MLX random key: `random::key(seed)` is `[seed >> 32, seed & 0xffff_ffff]`.
pub(crate) type Key = [u32; 2];

/// MLX's `random::key(seed)`.
pub(crate) fn key(seed: u64) -> Key {
    [(seed >> 32) as u32, seed as u32]
}

/// Threefry-2x32 of the counter pair `count` under `key` (20 rounds, rotations and key
/// schedule of the paper's reference; MLX's `threefry2x32_hash`).
fn hash(key: Key, count: [u32; 2]) -> [u32; 2] {
    const ROTATIONS: [[u32; 4]; 2] = [[13, 15, 26, 6], [17, 29, 16, 24]];
    let ks = [key[0], key[1], key[0] ^ key[1] ^ 0x1BD1_1BDA];
    let (mut x0, mut x1) = (count[0].wrapping_add(ks[0]), count[1].wrapping_add(ks[1]));
    for i in 0..5 {
        for r in ROTATIONS[i % 2] {
            x0 = x0.wrapping_add(x1);
            x1 = x1.rotate_left(r) ^ x0;
        }
        x0 = x0.wrapping_add(ks[(i + 1) % 3]);
        x1 = x1.wrapping_add(ks[(i + 2) % 3]).wrapping_add(i as u32 + 1);
    }
    [x0, x1]
}

/// MLX's `random::split(key, 2)`: the key the stream continues with and the one a draw uses
/// (MLX's `KeySequence::next` keeps the first and returns the second). Four random words, the
/// first half's counters `(0, 2)` and `(1, 3)`.
pub(crate) fn split(key: Key) -> (Key, Key) {
    let a = hash(key, [0, 2]);
    let b = hash(key, [1, 3]);
    ([a[0], b[0]], [a[1], b[1]])
}

/// MLX's `random::uniform(0, 1, [1], float32, key)`: one random word (counter `(0, 0)`),
/// scaled into `[0, 1)` in float32 as MLX scales it.
pub(crate) fn uniform(key: Key) -> f32 {
    let bits = hash(key, [0, 0])[0];
    // MLX divides by `uint32` max as a float32 (2^32 after rounding) and keeps the result
    // below 1.
    (bits as f32 / u32::MAX as f32).min(1.0f32.next_down())
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::{random, Array};

    fn mlx_key(key: Key) -> Array {
        Array::from_slice(&key, &[2])
    }

    #[test]
    fn keys_and_uniforms_are_mlxs() {
        for seed in [0u64, 1, 7, 42, 1 << 40, u64::MAX, 0x1234_5678_9abc_def0] {
            let mut ours = key(seed);
            let theirs = random::key(seed).unwrap();
            assert_eq!(theirs.as_slice::<u32>(), &ours, "seed {seed}");
            let mut theirs = theirs;
            // A stream of draws, as a sampler takes them.
            for step in 0..6 {
                let (next, sub) = split(ours);
                let (mlx_next, mlx_sub) = random::split(&theirs, 2).unwrap();
                assert_eq!(mlx_next.as_slice::<u32>(), &next, "seed {seed} step {step}");
                assert_eq!(mlx_sub.as_slice::<u32>(), &sub, "seed {seed} step {step}");
                let u = random::uniform::<f32, f32>(0.0, 1.0, &[1], Some(&mlx_key(sub))).unwrap();
                assert_eq!(
                    u.as_slice::<f32>(),
                    &[uniform(sub)],
                    "seed {seed} step {step}"
                );
                let scalar =
                    random::uniform::<f32, f32>(0.0, 1.0, &[] as &[i32], Some(&mlx_key(sub)))
                        .unwrap();
                assert_eq!(scalar.as_slice::<f32>(), &[uniform(sub)]);
                (ours, theirs) = (next, mlx_next);
            }
        }
    }
}
