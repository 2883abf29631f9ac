//! Stop sequences over streamed text: text that might be the start of a stop string is held back
//! until it is known not to be, and a match cuts the output where the stop string begins.

/// What [`StopMatcher::push`] decided for the text seen so far.
#[derive(Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text safe to show now (may be empty).
    Continue(String),
    /// A stop string matched: the text before it, to show before finishing, and the stop string.
    Stopped { text: String, stop: String },
}

/// Scans streamed text for any of a set of stop strings.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    /// Empty strings are ignored.
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    /// Adds a text delta.
    pub fn push(&mut self, delta: &str) -> StopOutcome {
        self.pending.push_str(delta);
        let first_match = self
            .stops
            .iter()
            .filter_map(|stop| self.pending.find(stop.as_str()).map(|at| (at, stop)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = first_match {
            let outcome = StopOutcome::Stopped {
                text: self.pending[..at].to_string(),
                stop: stop.clone(),
            };
            self.pending.clear();
            return outcome;
        }
        let held = self.longest_partial_match();
        let cut = self.pending.len() - held;
        let ready = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutcome::Continue(ready)
    }

    /// Releases held-back text when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length in bytes of the longest suffix of `pending` that is a proper prefix of a stop string.
    fn longest_partial_match(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            for (len, _) in stop.char_indices().skip(1) {
                if len > best && self.pending.ends_with(&stop[..len]) {
                    best = len;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stopped(text: &str, stop: &str) -> StopOutcome {
        StopOutcome::Stopped {
            text: text.into(),
            stop: stop.into(),
        }
    }

    #[test]
    fn holds_back_a_possible_stop_then_releases_it() {
        let mut m = StopMatcher::new(["</end>".to_string()]);
        assert_eq!(m.push("Hello </"), StopOutcome::Continue("Hello ".into()));
        assert_eq!(m.push("b>"), StopOutcome::Continue("</b>".into()));
        assert_eq!(m.push(" ok </e"), StopOutcome::Continue(" ok ".into()));
        assert_eq!(m.push("nd> tail"), stopped("", "</end>"));
    }

    #[test]
    fn cuts_at_the_earliest_stop_and_flushes_on_finish() {
        let mut m = StopMatcher::new(["STOP".to_string(), "\n\n".to_string()]);
        assert_eq!(m.push("a\n\nbSTOP"), stopped("a", "\n\n"));
        let mut m = StopMatcher::new(["STOP".to_string()]);
        assert_eq!(m.push("xyzST"), StopOutcome::Continue("xyz".into()));
        assert_eq!(m.finish(), "ST");
    }

    #[test]
    fn multibyte_stop_strings() {
        let mut m = StopMatcher::new(["日本".to_string()]);
        assert_eq!(m.push("今日"), StopOutcome::Continue("今".into()));
        assert_eq!(m.push("本"), stopped("", "日本"));
    }
}
