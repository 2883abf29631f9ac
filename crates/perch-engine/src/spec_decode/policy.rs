//! When verify steps pay: from the tokens a second the batch's decode steps have given lately,
//! with and without proposals, at each row count. A verify step feeds `1 + k` tokens a row and
//! waits for the device before the next step is built (its acceptance decides that step's
//! inputs), where a plain decode step is pipelined: on a GPU a small batch's plain step is bound
//! by launching its kernels, which a verify step pays on top of the device's time, so a lone
//! row needs more accepted tokens to gain than eight do; on the CPU a verify step costs with every
//! token it feeds. So the batch measures both kinds and takes the faster, trying the other now and
//! then ([`SpecPolicy::PROBE_EVERY`]) since the text, the rows and the acceptance change.

/// Decaying sums of tokens and seconds of one kind of step at one row count.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Rate {
    tokens: f64,
    seconds: f64,
    steps: u32,
}

impl Rate {
    /// Weight of the newest step (the sums decay by `1 - SMOOTHING` a step).
    const SMOOTHING: f64 = 0.2;

    fn record(&mut self, tokens: usize, seconds: f64) {
        let keep = if self.steps == 0 {
            0.0
        } else {
            1.0 - Self::SMOOTHING
        };
        self.tokens = self.tokens * keep + tokens as f64;
        self.seconds = self.seconds * keep + seconds;
        self.steps = self.steps.saturating_add(1);
    }

    /// Adds `seconds` to the newest step's (time a later step spent finishing it).
    fn charge(&mut self, seconds: f64) {
        self.seconds += seconds;
    }

    /// Tokens a second, once [`SpecPolicy::MIN_STEPS`] steps were measured.
    fn per_second(&self) -> Option<f64> {
        (self.steps >= SpecPolicy::MIN_STEPS).then(|| self.tokens / self.seconds.max(1e-9))
    }
}

/// Chooses, a decode step at a time, between a verify step and a plain one; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct SpecPolicy {
    /// Per row count: plain steps' rate, then verify steps'.
    rates: Vec<[Rate; 2]>,
    /// Eligible steps since the kind not chosen last ran.
    since_probe: u32,
}

impl SpecPolicy {
    /// Steps of a kind measured before its rate counts (a step after a verify step is not
    /// pipelined and hands out no tokens, so a rate needs a few).
    pub const MIN_STEPS: u32 = 3;
    /// Every this many eligible steps, the kind that looks slower runs once.
    pub const PROBE_EVERY: u32 = 24;

    /// Whether the next decode step, of `rows` rows that may all verify proposals, should.
    /// Until both kinds are measured at that row count, verify steps are tried first.
    pub fn verify_next(&mut self, rows: usize) -> bool {
        let [plain, verify] = self.at(rows).map(|r| r.per_second());
        let (Some(plain), Some(verify)) = (plain, verify) else {
            // Measure verify steps first, then plain ones (the latter run whenever nothing
            // proposes, so they are usually measured already).
            return verify.is_none();
        };
        self.since_probe += 1;
        let faster = verify > plain;
        if self.since_probe >= Self::PROBE_EVERY {
            self.since_probe = 0;
            return !faster;
        }
        faster
    }

    /// A decode step of `rows` rows (without a prefill pass beside it) took `seconds` and handed
    /// out `tokens` tokens; `verified`: it was a verify step.
    pub fn record(&mut self, rows: usize, verified: bool, tokens: usize, seconds: f64) {
        let rates = self.at_mut(rows);
        rates[usize::from(verified)].record(tokens, seconds);
    }

    /// Adds `seconds` to the last plain step measured at `rows` rows: a verify step that
    /// followed it waited that long for its tokens (the plain step's device time, which a
    /// pipelined step otherwise hands to the step after it).
    pub fn charge_plain(&mut self, rows: usize, seconds: f64) {
        self.at_mut(rows)[0].charge(seconds);
    }

    /// Feeds everything the choice reads to `hasher` (a divided batch's digest: every rank
    /// must choose alike).
    pub fn hash_into(&self, hasher: &mut impl std::hash::Hasher) {
        use std::hash::Hash;
        for rate in self.rates.iter().flatten() {
            (rate.tokens.to_bits(), rate.seconds.to_bits(), rate.steps).hash(hasher);
        }
        self.since_probe.hash(hasher);
    }

    fn at(&self, rows: usize) -> [Rate; 2] {
        self.rates.get(rows).copied().unwrap_or_default()
    }

    fn at_mut(&mut self, rows: usize) -> &mut [Rate; 2] {
        if self.rates.len() <= rows {
            self.rates.resize(rows + 1, Default::default());
        }
        &mut self.rates[rows]
    }
}

#[cfg(test)]
mod tests {
    use super::SpecPolicy;

    /// Runs `steps` decode steps of `rows` rows where a plain step gives `rows` tokens in
    /// `plain_s` and a verify step `verify_tokens` in `verify_s`; returns the verify steps run.
    fn simulate(
        policy: &mut SpecPolicy,
        rows: usize,
        steps: usize,
        (plain_s, verify_tokens, verify_s): (f64, usize, f64),
    ) -> usize {
        let mut verified = 0;
        for _ in 0..steps {
            if policy.verify_next(rows) {
                verified += 1;
                policy.record(rows, true, verify_tokens, verify_s);
            } else {
                policy.record(rows, false, rows, plain_s);
            }
        }
        verified
    }

    #[test]
    fn verify_steps_run_where_they_give_more_tokens_a_second() {
        let mut policy = SpecPolicy::default();
        // One row: a verify step gives 2 tokens in 4.4 ms, a plain one 1 in 1.7 ms.
        let verified = simulate(&mut policy, 1, 200, (1.7e-3, 2, 4.4e-3));
        assert!(verified < 20, "{verified} verify steps of 200");
        // Eight rows: 24 tokens in 4.4 ms against 8 in 2.9 ms.
        let verified = simulate(&mut policy, 8, 200, (2.9e-3, 24, 4.4e-3));
        assert!(verified > 180, "{verified} verify steps of 200");
        // The row counts are judged apart: one row still prefers plain steps.
        assert!(simulate(&mut policy, 1, 50, (1.7e-3, 2, 4.4e-3)) < 5);
    }

    #[test]
    fn a_change_in_acceptance_is_found_by_the_probes() {
        let mut policy = SpecPolicy::default();
        assert!(simulate(&mut policy, 4, 100, (2.0e-3, 12, 4.0e-3)) > 90);
        // The text stops repeating its prompt: a verify step gives one token a row.
        let late = simulate(&mut policy, 4, 200, (2.0e-3, 4, 4.0e-3));
        assert!(late < 40, "{late} verify steps after acceptance fell");
        // And starts again.
        let again = simulate(&mut policy, 4, 300, (2.0e-3, 16, 4.0e-3));
        assert!(again > 200, "{again} verify steps after acceptance rose");
    }
}
