//! Reconnect delays: capped exponential backoff with jitter ("equal jitter": half the
//! step fixed, half random), so a fleet of shippers does not reconnect in lockstep after
//! an aggregator restart. Pure: the random draw is an argument.

/// Backoff state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base_ms: u64,
    cap_ms: u64,
    attempt: u32,
}

impl Backoff {
    /// Starts at `base_ms`, doubles per failure, never above `cap_ms`.
    #[must_use]
    pub fn new(base_ms: u64, cap_ms: u64) -> Self {
        Self { base_ms: base_ms.max(1), cap_ms: cap_ms.max(base_ms.max(1)), attempt: 0 }
    }

    /// A connection proved good (the aggregator acked a batch on it).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// The aggregator refused this shipper (its certificate, or an abuse close): retrying
    /// soon cannot help, so the next delays are drawn at the cap.
    pub fn to_cap(&mut self) {
        self.attempt = self.attempt.max(31);
    }

    /// The step the next delay is drawn from (half of it fixed, half jitter).
    #[must_use]
    pub fn step_ms(&self) -> u64 {
        self.base_ms.saturating_mul(1u64 << self.attempt.min(30)).min(self.cap_ms)
    }

    /// The delay before the next attempt; `unit` is a uniform draw in [0, 1).
    pub fn next_ms(&mut self, unit: f64) -> u64 {
        let step = self.step_ms();
        self.attempt = self.attempt.saturating_add(1);
        let half = step / 2;
        #[allow(clippy::cast_possible_truncation, reason = "a fraction of a u64 step")]
        let jitter = (unit.clamp(0.0, 1.0) * (step - half) as f64) as u64;
        half + jitter
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_with_jitter_within_half_a_step() {
        let mut b = Backoff::new(100, 5_000);
        let lows: Vec<u64> = (0..10).map(|_| b.next_ms(0.0)).collect();
        assert_eq!(lows, [50, 100, 200, 400, 800, 1600, 2500, 2500, 2500, 2500]);
        b.reset();
        assert_eq!(b.next_ms(0.999_999), 99);
        assert_eq!(b.next_ms(0.5), 150);
    }

    #[test]
    fn a_refusal_jumps_to_the_cap_and_a_good_connection_starts_over() {
        let mut b = Backoff::new(100, 5_000);
        b.to_cap();
        assert_eq!(b.step_ms(), 5_000);
        let delays: Vec<u64> = (0..4).map(|_| b.next_ms(0.0)).collect();
        assert_eq!(delays, [2_500; 4], "every retry after a refusal waits at least half the cap");
        // 30 s of refusals: at most 1 + 30 / 2.5 = 13 attempts.
        let mut t = 0;
        let mut attempts = 1;
        loop {
            b.to_cap();
            t += b.next_ms(0.0);
            if t > 30_000 {
                break;
            }
            attempts += 1;
        }
        assert_eq!(attempts, 13);
        b.reset();
        assert_eq!(b.step_ms(), 100);
    }
}
