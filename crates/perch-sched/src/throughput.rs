//! Tokens per second over a sliding time window, for live engine stats (the dashboard's tok/s
//! graphs): a rate that reflects the last few seconds rather than the whole uptime.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Token counts recorded with their time; [`ThroughputWindow::rate`] is tokens per second over the
/// last `window`.
#[derive(Debug)]
pub struct ThroughputWindow {
    window: Duration,
    samples: VecDeque<(Instant, usize)>,
}

impl ThroughputWindow {
    pub fn new(window: Duration) -> Self {
        Self {
            window,
            samples: VecDeque::new(),
        }
    }

    /// Records `tokens` processed now.
    pub fn record(&mut self, tokens: usize) {
        self.record_at(Instant::now(), tokens);
    }

    pub fn record_at(&mut self, at: Instant, tokens: usize) {
        if tokens > 0 {
            self.samples.push_back((at, tokens));
        }
        self.evict(at);
    }

    /// Tokens per second over the window ending now; 0 when nothing was recorded in it.
    pub fn rate(&mut self) -> f64 {
        self.rate_at(Instant::now())
    }

    pub fn rate_at(&mut self, now: Instant) -> f64 {
        self.evict(now);
        let tokens: usize = self.samples.iter().map(|(_, n)| n).sum();
        tokens as f64 / self.window.as_secs_f64()
    }

    fn evict(&mut self, now: Instant) {
        while let Some(&(at, _)) = self.samples.front() {
            if now.duration_since(at) > self.window {
                self.samples.pop_front();
            } else {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_covers_only_the_window() {
        let t0 = Instant::now();
        let mut w = ThroughputWindow::new(Duration::from_secs(5));
        w.record_at(t0, 100);
        w.record_at(t0 + Duration::from_secs(2), 50);
        assert_eq!(w.rate_at(t0 + Duration::from_secs(3)), 30.0);
        // The first sample leaves the window after 5 s.
        assert_eq!(w.rate_at(t0 + Duration::from_secs(6)), 10.0);
        assert_eq!(w.rate_at(t0 + Duration::from_secs(60)), 0.0);
    }
}
