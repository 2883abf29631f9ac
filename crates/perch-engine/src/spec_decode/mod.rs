//! Speculative decoding inside the batch (vLLM v1's `spec_decode`): proposers guess a decode
//! row's next tokens on the host, the batch's verify step feeds each row its last token and the
//! guesses in one forward pass, and the guesses are kept while they equal the model's own
//! tokens ([`accepted`]): its greedy tokens, or a sampled row's draws (mlx_lm's rule). The
//! emitted tokens are the model's own exactly (up to the reduction order of a pass of several
//! tokens a row), each verify step emitting between one and `1 + guesses` of them a row.
//!
//! Rows that propose nothing but may verify (greedy, or sampled without logits processors)
//! feed their last token alone, drawing as in a plain step.
//!
//! Proposers: prompt lookup ([`ngram`]), which needs no draft model (greedy rows), and a draft
//! model in the batch ([`crate::worker::draft`]) for the requests that ask for it, greedy or
//! sampled (with logits processors they run one sequence beside the batch,
//! [`crate::sequence::speculative`]).
//! Each verify step is chosen against a plain step by the tokens a second each has given
//! lately ([`policy`]).

pub mod ngram;
pub mod policy;

/// The most decode rows a verify step has by default: beyond them a plain step's rows already
/// keep the device busy, and verifying costs more than it saves.
pub const DEFAULT_MAX_ROWS: usize = 8;

/// How many of `proposed` a verify pass accepts, given `targets`: the model's token after the
/// row's last token and after each proposal (its greedy token, or a sampled row's draw;
/// `targets.len() == proposed.len() + 1`).
/// Proposals are accepted while each equals the model's token at its place; the model's token
/// after the last accepted one is emitted too (a correction, or a bonus token when all were
/// accepted), so a round emits `targets[..=accepted]`.
pub fn accepted(proposed: &[u32], targets: &[u32]) -> usize {
    debug_assert_eq!(targets.len(), proposed.len() + 1, "a target per place");
    proposed
        .iter()
        .zip(targets)
        .take_while(|(p, t)| p == t)
        .count()
}

#[cfg(test)]
mod tests {
    use super::accepted;

    #[test]
    fn proposals_are_accepted_up_to_the_first_difference() {
        assert_eq!(accepted(&[], &[7]), 0);
        assert_eq!(accepted(&[1, 2, 3], &[1, 2, 3, 4]), 3);
        assert_eq!(accepted(&[1, 2, 3], &[1, 5, 3, 4]), 1);
        assert_eq!(accepted(&[1, 2, 3], &[9, 2, 3, 4]), 0);
    }
}
