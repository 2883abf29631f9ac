//! The last, partial block of next-token-logprobs calls that left the batch, kept so that a
//! later prompt that extends one of them reads its KV instead of recomputing up to
//! `block_size - 1` tokens.
//!
//! The prefix cache holds full blocks only (vLLM's rule: a block is hashed once it is full).
//! Scoring a sequence that grows one token per call (genlm's samplers do this through
//! `next_token_logprobs`) would then recompute the partial block every call; with its tail
//! kept, each call computes the new token only. Entries are few and bounded by count
//! ([`TAIL_CACHE_ENTRIES`]), outside the block pool's budget: each holds at most
//! `block_size - 1` tokens of KV.

use std::collections::VecDeque;

use mlx_rs::Array;

/// Tails kept, least recently used dropped first.
pub const TAIL_CACHE_ENTRIES: usize = 32;

/// A sequence's tokens and the KV of those after its last full block: per layer, the parts of
/// positions `tokens.len() / block_size * block_size .. tokens.len()` (see
/// [`crate::kv::cache::KvCache::copy_parts`]).
pub(crate) struct Tail {
    pub tokens: Vec<u32>,
    pub parts: Vec<Vec<Array>>,
}

impl Tail {
    fn nbytes(&self) -> usize {
        self.parts.iter().flatten().map(Array::nbytes).sum()
    }
}

#[derive(Default)]
pub(crate) struct TailCache {
    entries: VecDeque<Tail>,
}

impl TailCache {
    /// The longest kept tail that `tokens` extends (at least one token past it) and whose full
    /// blocks are exactly the `cached_tokens` the prefix cache gave, marked recently used.
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        cached_tokens: usize,
        block_size: usize,
    ) -> Option<&Tail> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, tail)| {
                let len = tail.tokens.len();
                len > cached_tokens
                    && len < tokens.len()
                    && len / block_size * block_size == cached_tokens
                    && tokens.starts_with(&tail.tokens)
            })
            .max_by_key(|(_, tail)| tail.tokens.len())
            .map(|(i, _)| i)?;
        let tail = self.entries.remove(best)?;
        self.entries.push_back(tail);
        self.entries.back()
    }

    /// Keeps `tail` (replacing one with the same tokens), dropping the least recently used
    /// beyond [`TAIL_CACHE_ENTRIES`].
    pub fn insert(&mut self, tail: Tail) {
        self.entries.retain(|t| t.tokens != tail.tokens);
        self.entries.push_back(tail);
        while self.entries.len() > TAIL_CACHE_ENTRIES {
            self.entries.pop_front();
        }
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Bytes of KV held.
    pub fn nbytes(&self) -> usize {
        self.entries.iter().map(Tail::nbytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail(tokens: &[u32]) -> Tail {
        Tail {
            tokens: tokens.to_vec(),
            parts: Vec::new(),
        }
    }

    #[test]
    fn finds_the_longest_tail_a_prompt_extends_past_its_cached_blocks() {
        let mut cache = TailCache::default();
        cache.insert(tail(&[1, 2, 3, 4, 5]));
        cache.insert(tail(&[1, 2, 3, 4, 5, 6]));
        cache.insert(tail(&[1, 2, 9]));
        // Block size 4: one full block (4 tokens) cached.
        let found =
            |c: &mut TailCache, p: &[u32], cached| c.lookup(p, cached, 4).map(|t| t.tokens.clone());
        assert_eq!(
            found(&mut cache, &[1, 2, 3, 4, 5, 6, 7], 4),
            Some(vec![1, 2, 3, 4, 5, 6])
        );
        assert_eq!(
            found(&mut cache, &[1, 2, 3, 4, 5, 8], 4),
            Some(vec![1, 2, 3, 4, 5])
        );
        // At least one token must be left to compute.
        assert_eq!(
            found(&mut cache, &[1, 2, 3, 4, 5, 6], 4),
            Some(vec![1, 2, 3, 4, 5])
        );
        // The tail's full blocks must be the cached ones.
        assert_eq!(found(&mut cache, &[1, 2, 3, 4, 5, 6, 7], 0), None);
        assert_eq!(found(&mut cache, &[1, 2, 9, 1], 0), Some(vec![1, 2, 9]));
        assert_eq!(found(&mut cache, &[7, 7, 7, 7, 7, 7], 4), None);
    }

    #[test]
    fn keeps_the_most_recently_used() {
        let mut cache = TailCache::default();
        for i in 0..TAIL_CACHE_ENTRIES as u32 {
            cache.insert(tail(&[i, 100]));
        }
        // Using the oldest keeps it past the next insert.
        assert!(cache.lookup(&[0, 100, 1], 0, 4).is_some());
        cache.insert(tail(&[999, 100]));
        assert!(cache.lookup(&[0, 100, 1], 0, 4).is_some());
        assert!(
            cache.lookup(&[1, 100, 1], 0, 4).is_none(),
            "the least recently used went"
        );
        cache.insert(tail(&[999, 100]));
        assert_eq!(
            cache.entries.len(),
            TAIL_CACHE_ENTRIES,
            "same tokens replace"
        );
    }
}
