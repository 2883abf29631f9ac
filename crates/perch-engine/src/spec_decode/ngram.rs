//! Prompt lookup (n-gram) proposals, as vLLM's `NgramProposer` and the prompt-lookup decoding
//! of Saxena (2023) make them: the row's last `n` tokens are looked up earlier in its own tokens
//! (prompt and output), and the tokens that followed the latest earlier occurrence of the
//! longest such suffix (`min_ngram <= n <= max_ngram`) are proposed. No draft model runs: what
//! pays is output that repeats its input, as an agent's edits of a file in its prompt do.

/// Prompt lookup's settings (`perch serve --prompt-lookup`; [`crate::testing::BatchConfig`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PromptLookup {
    /// Tokens proposed a row at most (vLLM's `num_speculative_tokens`).
    pub num_draft_tokens: usize,
    /// The shortest suffix looked up (vLLM's `prompt_lookup_min`).
    pub min_ngram: usize,
    /// The longest (vLLM's `prompt_lookup_max`).
    pub max_ngram: usize,
    /// Verify steps run while at most this many rows decode: above it a pass of `1 +
    /// num_draft_tokens` tokens a row costs more than the tokens it accepts save, and every step
    /// decodes one token a row (pipelined).
    pub max_rows: usize,
    /// Within `max_rows`, verify only where verify steps have lately given more tokens a second
    /// than plain ones at that row count ([`crate::spec_decode::policy::SpecPolicy`]); off:
    /// verify whenever a row proposes (tests, and measuring verify steps alone).
    pub adaptive: bool,
}

impl Default for PromptLookup {
    /// 4 tokens proposed after suffixes of 2 to 8 tokens, while at most 8 rows decode, each
    /// step choosing by measurement. With the choice, 8 rows neither lose nor gain much on the
    /// CPU, where a verify pass costs with every token it feeds (SmolLM2-135M on 2 cores,
    /// output repeating its prompt: 1.5× the tokens a second at 1 row, 1.1× at 4 and 8; without
    /// the choice 0.9× at 8; `docs/benchmarks.md`).
    fn default() -> Self {
        Self {
            num_draft_tokens: 4,
            min_ngram: 2,
            max_ngram: 8,
            max_rows: crate::spec_decode::DEFAULT_MAX_ROWS,
            adaptive: true,
        }
    }
}

impl PromptLookup {
    /// The most tokens a round may propose, and the longest n-gram looked up.
    pub const MAX_DRAFT_TOKENS: usize = 16;
    /// How far back a suffix is looked up, in tokens: a step's scan costs at most this much per
    /// row on the host, however long the conversation.
    pub const MAX_LOOKBACK: usize = 16_384;

    /// Checks the settings: at least one token proposed and at most
    /// [`PromptLookup::MAX_DRAFT_TOKENS`], `1 <= min_ngram <= max_ngram <=`
    /// [`PromptLookup::MAX_DRAFT_TOKENS`], `max_rows` at least 1.
    pub fn validate(&self) -> Result<(), String> {
        let most = Self::MAX_DRAFT_TOKENS;
        if !(1..=most).contains(&self.num_draft_tokens) {
            return Err(format!(
                "prompt lookup proposes 1 to {most} tokens, not {}",
                self.num_draft_tokens
            ));
        }
        if self.min_ngram == 0 || self.min_ngram > self.max_ngram || self.max_ngram > most {
            return Err(format!(
                "prompt lookup's n-grams must be 1 <= min ({}) <= max ({}) <= {most}",
                self.min_ngram, self.max_ngram
            ));
        }
        if self.max_rows == 0 {
            return Err("prompt lookup's max_rows must be at least 1".into());
        }
        Ok(())
    }

    /// Up to `limit` (and [`PromptLookup::num_draft_tokens`]) tokens to propose after
    /// `tokens`: those after the latest earlier occurrence of `tokens`' longest suffix of
    /// `min_ngram..=max_ngram` tokens; empty when none occurs earlier. One pass over the last
    /// [`PromptLookup::MAX_LOOKBACK`] tokens, from the end.
    pub fn propose<'t>(&self, tokens: &'t [u32], limit: usize) -> &'t [u32] {
        let limit = limit.min(self.num_draft_tokens);
        let (min, len) = (self.min_ngram.max(1), tokens.len());
        let max = self.max_ngram.max(min);
        if limit == 0 || len <= min {
            return &[];
        }
        let suffix = &tokens[len - min..];
        // (length of the match, end of the earlier occurrence), the longest and latest.
        let mut best: Option<(usize, usize)> = None;
        for end in (min.max(len.saturating_sub(Self::MAX_LOOKBACK))..len).rev() {
            if tokens[end - min..end] != *suffix {
                continue;
            }
            let mut n = min;
            while n < max && n < end && tokens[end - n - 1] == tokens[len - n - 1] {
                n += 1;
            }
            if best.is_none_or(|(longest, _)| n > longest) {
                best = Some((n, end));
                if n == max {
                    break;
                }
            }
        }
        best.map_or(&[], |(_, end)| &tokens[end..(end + limit).min(len)])
    }
}

/// A sequence's record of its proposals: after a round whose proposals were all rejected it
/// proposes nothing for 2, then 4, 8 and at most 16 tokens, so that text whose n-grams occur
/// earlier but does not repeat what followed them keeps one-token, pipelined steps; a round that
/// accepts something ends the pause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backoff {
    /// Rounds in a row that accepted nothing.
    misses: u32,
    /// No proposals before the sequence holds this many tokens.
    paused_until: usize,
}

impl Backoff {
    /// Whether a sequence of `tokens` tokens proposes.
    pub fn proposes(&self, tokens: usize) -> bool {
        tokens >= self.paused_until
    }

    /// A round of `proposed` tokens, `accepted` of them kept, ending at `tokens` tokens.
    pub fn record(&mut self, proposed: usize, accepted: usize, tokens: usize) {
        if proposed == 0 {
            return;
        }
        if accepted > 0 {
            self.misses = 0;
            return;
        }
        self.misses += 1;
        self.paused_until = tokens + (1 << self.misses.min(4));
    }
}

#[cfg(test)]
mod tests {
    use super::{Backoff, PromptLookup};

    fn lookup(num_draft_tokens: usize, min_ngram: usize, max_ngram: usize) -> PromptLookup {
        PromptLookup {
            num_draft_tokens,
            min_ngram,
            max_ngram,
            max_rows: crate::spec_decode::DEFAULT_MAX_ROWS,
            adaptive: true,
        }
    }

    #[test]
    fn the_longest_latest_suffix_match_proposes_what_followed_it() {
        let l = lookup(3, 2, 4);
        // The suffix [3, 4] occurs at 2..4 (followed by 5, 6, 7).
        assert_eq!(l.propose(&[1, 2, 3, 4, 5, 6, 7, 9, 3, 4], 8), &[5, 6, 7]);
        // [1, 3, 4] matches a later occurrence longer than [3, 4]'s latest one.
        let tokens = [1, 3, 4, 8, 8, 2, 3, 4, 9, 9, 1, 3, 4];
        assert_eq!(l.propose(&tokens, 8), &[8, 8, 2]);
        // Equal lengths: the latest occurrence.
        assert_eq!(l.propose(&[5, 6, 1, 5, 6, 2, 5, 6], 8), &[2, 5, 6]);
        // The limit, and a continuation cut by the end of the tokens.
        assert_eq!(l.propose(&[1, 2, 3, 4, 5, 6, 7, 9, 3, 4], 1), &[5]);
        assert_eq!(l.propose(&[7, 7, 7], 8), &[7]);
    }

    #[test]
    fn no_proposal_without_an_earlier_occurrence() {
        let l = lookup(3, 2, 4);
        assert!(l.propose(&[1, 2, 3, 4, 5], 8).is_empty());
        assert!(l.propose(&[1, 2], 8).is_empty());
        assert!(l.propose(&[], 8).is_empty());
        assert!(l.propose(&[1, 2, 1, 2], 0).is_empty());
        // A one-token suffix only with min_ngram 1.
        assert!(l.propose(&[4, 1, 5, 4], 8).is_empty());
        assert_eq!(lookup(3, 1, 4).propose(&[4, 1, 5, 4], 8), &[1, 5, 4]);
    }

    #[test]
    fn lookups_reach_back_a_bounded_number_of_tokens() {
        let l = lookup(3, 2, 4);
        let between = |n: u32| (10..10 + n).collect::<Vec<u32>>();
        let tokens = [&[1, 2, 3][..], &between(100), &[1, 2]].concat();
        assert_eq!(l.propose(&tokens, 8), &[3, 10, 11]);
        let far = [
            &[1, 2, 3][..],
            &between(PromptLookup::MAX_LOOKBACK as u32),
            &[1, 2],
        ]
        .concat();
        assert!(l.propose(&far, 8).is_empty());
    }

    #[test]
    fn settings_are_checked() {
        assert!(PromptLookup::default().validate().is_ok());
        assert!(lookup(0, 2, 4).validate().is_err());
        assert!(lookup(17, 2, 4).validate().is_err());
        assert!(lookup(4, 0, 4).validate().is_err());
        assert!(lookup(4, 3, 2).validate().is_err());
        let rows = PromptLookup {
            max_rows: 0,
            ..PromptLookup::default()
        };
        assert!(rows.validate().is_err());
    }

    #[test]
    fn rejected_rounds_pause_proposals_longer_each_time() {
        let mut b = Backoff::default();
        assert!(b.proposes(10));
        b.record(0, 0, 10);
        assert!(b.proposes(10), "no round, no pause");
        b.record(4, 0, 10);
        assert!(!b.proposes(11));
        assert!(b.proposes(12));
        b.record(4, 0, 12);
        assert!(!b.proposes(15));
        assert!(b.proposes(16));
        for _ in 0..6 {
            b.record(4, 0, 16);
        }
        assert!(!b.proposes(31));
        assert!(b.proposes(32), "at most 16 tokens");
        b.record(4, 1, 32);
        b.record(4, 0, 40);
        assert!(b.proposes(42), "an accepting round starts the pauses over");
    }
}
