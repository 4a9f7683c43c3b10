//! Which background cgroups to throttle at which memory-pressure level (pure; the cgroup
//! writes are `crate::throttle`).
//!
//! An operator lists cgroups by tier: P3 (caches, prefetchers, anything that can stop
//! for a while) is throttled from `some` pressure on, P2 (batch work that should yield
//! before the node runs out) only under `full`. A throttled cgroup is released when the
//! level falls below its tier's again — the level carries the watcher's hysteresis
//! (quiet windows before stepping down), so the throttle does not flap with the signal.
//! Only listed cgroups are ever named in a step.

use ringwatch_transport::pressure::Level;

/// A background cgroup's tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    P2,
    P3,
}

impl Tier {
    /// The least level at which this tier is throttled.
    #[must_use]
    pub const fn engages_at(self) -> Level {
        match self {
            Self::P3 => Level::Some,
            Self::P2 => Level::Full,
        }
    }

    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::P2 => "p2",
            Self::P3 => "p3",
        }
    }
}

/// What to do to the listed cgroup at this index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Hold(usize),
    Release(usize),
}

/// The listed cgroups' tiers and whether each is held now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    tiers: Vec<Tier>,
    held: Vec<bool>,
}

impl Plan {
    #[must_use]
    pub fn new(tiers: Vec<Tier>) -> Self {
        let held = vec![false; tiers.len()];
        Self { tiers, held }
    }

    /// The steps that bring the cgroups in line with `level`; held-ness is updated as if
    /// each step succeeded (a failed step is the caller's to report, and is tried again
    /// on the next level change).
    pub fn on_level(&mut self, level: Level) -> Vec<Step> {
        let mut steps = Vec::new();
        for (i, (tier, held)) in self.tiers.iter().zip(self.held.iter_mut()).enumerate() {
            let want = level >= tier.engages_at();
            if want != *held {
                steps.push(if want { Step::Hold(i) } else { Step::Release(i) });
                *held = want;
            }
        }
        steps
    }

    /// Marks a step that failed as not done.
    pub fn failed(&mut self, step: Step) {
        match step {
            Step::Hold(i) => self.set(i, false),
            Step::Release(i) => self.set(i, true),
        }
    }

    fn set(&mut self, i: usize, v: bool) {
        if let Some(h) = self.held.get_mut(i) {
            *h = v;
        }
    }

    /// Releases everything held (shutdown, or the watcher stopped).
    pub fn release_all(&mut self) -> Vec<Step> {
        self.on_level(Level::Nominal)
    }

    #[must_use]
    pub fn is_held(&self, i: usize) -> bool {
        self.held.get(i).copied().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p3_is_held_from_some_p2_only_under_full_and_both_released_as_the_level_falls() {
        let mut p = Plan::new(vec![Tier::P3, Tier::P2, Tier::P3]);
        let table: [(Level, &[Step]); 7] = [
            (Level::Nominal, &[]),
            (Level::Some, &[Step::Hold(0), Step::Hold(2)]),
            (Level::Some, &[]),
            (Level::Full, &[Step::Hold(1)]),
            (Level::Some, &[Step::Release(1)]),
            (Level::Full, &[Step::Hold(1)]),
            (Level::Nominal, &[Step::Release(0), Step::Release(1), Step::Release(2)]),
        ];
        for (level, want) in table {
            assert_eq!(p.on_level(level), want, "at {}", level.name());
        }
    }

    #[test]
    fn a_failed_step_is_tried_again_and_release_all_frees_what_is_held() {
        let mut p = Plan::new(vec![Tier::P3]);
        let s = p.on_level(Level::Some);
        assert_eq!(s, [Step::Hold(0)]);
        p.failed(s[0]);
        assert!(!p.is_held(0));
        assert_eq!(p.on_level(Level::Full), [Step::Hold(0)], "tried again on the next change");
        assert_eq!(p.release_all(), [Step::Release(0)]);
        assert_eq!(p.release_all(), []);
    }
}
