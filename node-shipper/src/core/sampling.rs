//! When to raise the kernel's bulk sampling level: spool pressure (docs/design.md,
//! "Priorities, backpressure, shedding": aggregator slow → flow control → spool fills →
//! raise the sampling level, bulk only → then, if still full, evict bulk with loss
//! records).
//!
//! Pure: one decision per heartbeat from the spool's fill. One step at a time with
//! hysteresis: up when the spool is at least `raise_ppm` full, down when at most
//! `lower_ppm`, never below the configured floor or above the ceiling.
//!
//! Invariant: the level is always within `[floor, ceiling]`; a sampled-out event is
//! counted in the kernel (`sampled_out`), so raising it never loses anything silently.

/// The policy's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplingConfig {
    /// The operator's level: bulk keeps 1 in 2^floor events even without pressure.
    pub floor: u8,
    /// The most pressure may raise it to.
    pub ceiling: u8,
    pub raise_ppm: u32,
    pub lower_ppm: u32,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        // Half full: bulk already competes with P0/P1's reserve for the rest; a quarter:
        // enough hysteresis that one heartbeat's burst does not flap the level.
        Self { floor: 0, ceiling: 8, raise_ppm: 500_000, lower_ppm: 250_000 }
    }
}

/// The current level and the rule that moves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplingPolicy {
    config: SamplingConfig,
    level: u8,
    /// Times the level went up.
    pub raised: u64,
}

impl SamplingPolicy {
    /// Starts at the floor.
    #[must_use]
    pub fn new(config: SamplingConfig) -> Self {
        let ceiling = config.ceiling.max(config.floor);
        Self { config: SamplingConfig { ceiling, ..config }, level: config.floor, raised: 0 }
    }

    /// The level in force.
    #[must_use]
    pub fn level(&self) -> u8 {
        self.level
    }

    /// One decision from the spool's use; returns the new level.
    pub fn decide(&mut self, spool_used: usize, spool_cap: usize) -> u8 {
        let ppm = if spool_cap == 0 {
            0
        } else {
            u64::try_from(spool_used as u128 * 1_000_000 / spool_cap as u128).unwrap_or(u64::MAX)
        };
        if ppm >= u64::from(self.config.raise_ppm) && self.level < self.config.ceiling {
            self.level += 1;
            self.raised += 1;
        } else if ppm <= u64::from(self.config.lower_ppm) && self.level > self.config.floor {
            self.level -= 1;
        }
        self.level
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raises_one_step_per_decision_under_pressure_and_comes_back_to_the_floor() {
        let mut p = SamplingPolicy::new(SamplingConfig { floor: 1, ceiling: 3, ..SamplingConfig::default() });
        assert_eq!(p.level(), 1);
        let table = [
            (600, 2), // ≥ 50 %: up
            (600, 3),
            (900, 3), // ceiling
            (400, 3), // between the marks: hold
            (200, 2), // ≤ 25 %: down
            (0, 1),
            (0, 1), // floor
        ];
        for (used, want) in table {
            assert_eq!(p.decide(used, 1000), want, "used {used}");
        }
        assert_eq!(p.raised, 2);
    }

    #[test]
    fn a_ceiling_below_the_floor_is_the_floor() {
        let mut p = SamplingPolicy::new(SamplingConfig { floor: 4, ceiling: 2, ..SamplingConfig::default() });
        assert_eq!(p.decide(1000, 1000), 4);
        assert_eq!(p.decide(0, 1000), 4);
    }
}
