//! Memory-pressure state with hysteresis: pure, time as an argument (the I/O is in
//! [`crate::psi`]).
//!
//! The kernel's PSI triggers say when memory stalls crossed a threshold within a window
//! (`some`: at least one task stalled; `full`: every non-idle task stalled at once). The
//! state enters a level at once, on a trigger of that level (`full` implies `some`), and
//! leaves it one level at a time, only after `quiet_windows` whole windows in a row in
//! which no trigger of that level fired and the level's stall total grew less than
//! `quiet_stall_us`. A signal that flaps every window or two therefore holds the state
//! instead of toggling it (and with it the shedding) at the rate of the flapping.
//!
//! What each level sheds is [`Level::sheds`]: P3 from `some` on, P2 from `some` on
//! (bulk sampling raised, bulk spool share reduced), P1 coalesced under `full` only, P0
//! never.

/// How much memory pressure the process is under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Level {
    /// No trigger fired, or the state has calmed down since.
    #[default]
    Nominal,
    /// A `some` trigger fired: some tasks stall on memory.
    Some,
    /// A `full` trigger fired: every non-idle task stalls on memory at once.
    Full,
}

impl Level {
    /// The name used in the API, logs and metrics.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Nominal => "nominal",
            Self::Some => "some",
            Self::Full => "full",
        }
    }

    /// The wire code (heartbeat section).
    #[must_use]
    pub const fn code(self) -> u8 {
        match self {
            Self::Nominal => 0,
            Self::Some => 1,
            Self::Full => 2,
        }
    }

    /// The level of a wire code, if it is one.
    #[must_use]
    pub const fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::Nominal),
            1 => Some(Self::Some),
            2 => Some(Self::Full),
            _ => None,
        }
    }

    /// What this level sheds.
    #[must_use]
    pub const fn sheds(self) -> Shedding {
        match self {
            Self::Nominal => Shedding { p3: false, p2: false, p1_coalesced: false },
            Self::Some => Shedding { p3: true, p2: true, p1_coalesced: false },
            Self::Full => Shedding { p3: true, p2: true, p1_coalesced: true },
        }
    }

    const fn down(self) -> Self {
        match self {
            Self::Full => Self::Some,
            Self::Some | Self::Nominal => Self::Nominal,
        }
    }
}

/// Which tiers a level sheds. P0 is never shed and has no flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shedding {
    /// P3: caches, debug logging, pooled buffers.
    pub p3: bool,
    /// P2: bulk (sampling raised, bulk spool share reduced, bulk evicted with loss
    /// records of cause `psi_shed`).
    pub p2: bool,
    /// P1: heartbeats and loss records coalesced (never dropped).
    pub p1_coalesced: bool,
}

/// The two stall totals PSI keeps, in µs since boot (or since the cgroup was created).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Totals {
    pub some_us: u64,
    pub full_us: u64,
}

/// The hysteresis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyConfig {
    /// Quiet windows in a row before the state steps down one level.
    pub quiet_windows: u32,
    /// A window is quiet only if the level's stall total grew less than this (µs).
    pub quiet_stall_us: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self { quiet_windows: 3, quiet_stall_us: 50_000 }
    }
}

/// A change of level, for the log and the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub from: Level,
    pub to: Level,
    /// When (the caller's clock).
    pub at_ns: u64,
}

/// The state machine.
#[derive(Debug, Clone)]
pub struct Policy {
    cfg: PolicyConfig,
    level: Level,
    /// Quiet windows in a row at the current level.
    quiet: u32,
    /// A trigger of the current level (or above) fired since the last window ended.
    fired_since_window: bool,
    /// The totals when the last window ended.
    last: Option<Totals>,
    entered_at_ns: u64,
    transitions: u64,
}

impl Policy {
    #[must_use]
    pub const fn new(cfg: PolicyConfig) -> Self {
        Self {
            cfg,
            level: Level::Nominal,
            quiet: 0,
            fired_since_window: false,
            last: None,
            entered_at_ns: 0,
            transitions: 0,
        }
    }

    #[must_use]
    pub const fn level(&self) -> Level {
        self.level
    }

    /// When the current level was entered (0: never left nominal).
    #[must_use]
    pub const fn entered_at_ns(&self) -> u64 {
        self.entered_at_ns
    }

    /// Level changes so far.
    #[must_use]
    pub const fn transitions(&self) -> u64 {
        self.transitions
    }

    /// Whether the caller should end windows (read the totals once per trigger window):
    /// only while the state is above nominal — at nominal nothing is read until a trigger
    /// fires.
    #[must_use]
    pub fn needs_windows(&self) -> bool {
        self.level != Level::Nominal
    }

    fn go(&mut self, to: Level, now_ns: u64) -> Option<Transition> {
        if to == self.level {
            return None;
        }
        let t = Transition { from: self.level, to, at_ns: now_ns };
        self.level = to;
        self.quiet = 0;
        self.entered_at_ns = now_ns;
        self.transitions = self.transitions.saturating_add(1);
        Some(t)
    }

    /// A trigger of `level` fired (`Some` or `Full`; `Nominal` is ignored). `totals`, if
    /// the caller read them on the wake, start the first window's baseline.
    pub fn trigger(&mut self, level: Level, totals: Option<Totals>, now_ns: u64) -> Option<Transition> {
        if level == Level::Nominal {
            return None;
        }
        if level >= self.level {
            self.fired_since_window = true;
            self.quiet = 0;
        }
        if self.level == Level::Nominal {
            // Entering from nominal: no window was ended since the last pressure, so the
            // baseline starts here (unknown if the caller read nothing).
            self.last = totals;
        }
        if level > self.level { self.go(level, now_ns) } else { None }
    }

    /// A trigger window ended with the stall totals read now. Counts it quiet or not, and
    /// steps down one level after `quiet_windows` quiet ones in a row.
    pub fn window(&mut self, totals: Totals, now_ns: u64) -> Option<Transition> {
        let last = self.last.replace(totals);
        if self.level == Level::Nominal {
            self.fired_since_window = false;
            return None;
        }
        let grew = last.map(|l| match self.level {
            Level::Full => totals.full_us.saturating_sub(l.full_us),
            Level::Some | Level::Nominal => totals.some_us.saturating_sub(l.some_us),
        });
        // Without a baseline the growth is unknown: not quiet.
        let quiet = !self.fired_since_window && grew.is_some_and(|g| g < self.cfg.quiet_stall_us);
        self.fired_since_window = false;
        if !quiet {
            self.quiet = 0;
            return None;
        }
        self.quiet = self.quiet.saturating_add(1);
        if self.quiet >= self.cfg.quiet_windows.max(1) {
            let to = self.level.down();
            self.go(to, now_ns)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = 2_000_000_000; // a 2 s window, in ns

    /// A step of a table: a trigger or the end of a window with totals.
    #[derive(Debug, Clone, Copy)]
    enum Step {
        Fire(Level),
        /// End of a window; the stall totals grew by (some, full) µs during it.
        Window(u64, u64),
    }
    use Step::{Fire, Window};

    /// Runs `steps`, returning the level after each.
    fn run(cfg: PolicyConfig, steps: &[Step]) -> (Vec<Level>, u64) {
        let mut p = Policy::new(cfg);
        let mut totals = Totals { some_us: 1_000, full_us: 500 };
        let mut now = 0;
        let mut out = Vec::new();
        for s in steps {
            match *s {
                Fire(l) => {
                    p.trigger(l, Some(totals), now);
                }
                Window(some, full) => {
                    now += W;
                    totals.some_us += some;
                    totals.full_us += full;
                    p.window(totals, now);
                }
            }
            out.push(p.level());
        }
        (out, p.transitions())
    }

    use Level::{Full as F, Nominal as N, Some as S};

    #[test]
    fn transitions_table() {
        let cfg = PolicyConfig { quiet_windows: 3, quiet_stall_us: 50_000 };
        let busy = Window(400_000, 0);
        let calm = Window(10_000, 0);
        #[rustfmt::skip]
        let cases: &[(&str, &[Step], &[Level])] = &[
            ("a some trigger enters some at once",
             &[Fire(S)], &[S]),
            ("full enters full at once, from nominal",
             &[Fire(F)], &[F]),
            ("some then full escalates",
             &[Fire(S), busy, Fire(F)], &[S, S, F]),
            ("a some trigger under full changes nothing",
             &[Fire(F), Fire(S)], &[F, F]),
            ("the trigger's own window is never quiet; three calm ones after it leave some",
             &[Fire(S), calm, calm, calm, calm], &[S, S, S, S, N]),
            ("a busy window (growth ≥ threshold) restarts the count",
             &[Fire(S), calm, calm, busy, calm, calm, calm], &[S, S, S, S, S, S, N]),
            ("a trigger inside a window makes it not quiet even if growth was small",
             &[Fire(S), calm, calm, Fire(S), calm, calm, calm, calm], &[S, S, S, S, S, S, S, N]),
            ("full steps down to some first, then to nominal",
             &[Fire(F), Window(10_000, 1_000), Window(10_000, 1_000), Window(10_000, 1_000),
               Window(10_000, 1_000), calm, calm, calm],
             &[F, F, F, F, S, S, S, N]),
            ("under full, some stalls keep growing: only full growth counts there",
             &[Fire(F), Window(900_000, 0), Window(900_000, 0), Window(900_000, 0), Window(900_000, 0)],
             &[F, F, F, F, S]),
            ("full growth at or over the threshold holds full",
             &[Fire(F), Window(0, 50_000), Window(0, 50_000), Window(0, 50_000), Window(0, 49_999)],
             &[F, F, F, F, F]),
            ("windows at nominal do nothing",
             &[calm, busy, calm], &[N, N, N]),
            ("a nominal trigger is ignored",
             &[Fire(N)], &[N]),
        ];
        for (name, steps, want) in cases {
            let (got, _) = run(cfg, steps);
            assert_eq!(&got[..], *want, "{name}");
        }
    }

    #[test]
    fn a_signal_that_flaps_every_window_does_not_oscillate() {
        let cfg = PolicyConfig { quiet_windows: 3, quiet_stall_us: 50_000 };
        // 100 windows: a trigger in every other window (the stall crossing the threshold
        // and falling back each time), also with small growth in the quiet ones.
        let mut steps = vec![Fire(S)];
        for i in 0..100 {
            steps.push(Window(10_000, 0));
            if i % 2 == 0 {
                steps.push(Fire(S));
            }
        }
        let (levels, transitions) = run(cfg, &steps);
        assert!(levels.iter().all(|&l| l == S), "held at some");
        assert_eq!(transitions, 1, "entered once, never left");
        // A trigger every third window: two quiet windows in a row at most, still held.
        let mut steps = vec![Fire(F)];
        for i in 0..99 {
            steps.push(Window(0, 0));
            if i % 3 == 1 {
                steps.push(Fire(F));
            }
        }
        let (levels, transitions) = run(cfg, &steps);
        assert!(levels.iter().all(|&l| l == F));
        assert_eq!(transitions, 1);
        // Once it stops flapping the state comes down, one level at a time.
        steps.extend([Window(0, 0); 6]);
        let (levels, transitions) = run(cfg, &steps);
        assert_eq!(levels[levels.len() - 4..], [S, S, S, N]);
        assert_eq!(transitions, 3);
    }

    #[test]
    fn without_a_baseline_the_first_window_is_not_quiet() {
        let mut p = Policy::new(PolicyConfig { quiet_windows: 1, quiet_stall_us: 50_000 });
        p.trigger(Level::Some, None, 0);
        assert_eq!(p.window(Totals { some_us: 5, full_us: 0 }, W), None, "no baseline yet");
        let t = p.window(Totals { some_us: 6, full_us: 0 }, 2 * W).expect("quiet");
        assert_eq!((t.from, t.to, t.at_ns), (Level::Some, Level::Nominal, 2 * W));
        assert!(!p.needs_windows());
        // Totals that go backwards (a new cgroup) are not growth.
        p.trigger(Level::Some, Some(Totals { some_us: 1_000_000, full_us: 0 }), 3 * W);
        assert_eq!(p.window(Totals { some_us: 1_000_000, full_us: 0 }, 4 * W), None, "the trigger's window");
        assert!(p.window(Totals { some_us: 10, full_us: 0 }, 5 * W).is_some());
    }

    #[test]
    fn shedding_by_level_never_touches_p0_and_coalesces_p1_only_under_full() {
        assert_eq!(Level::Nominal.sheds(), Shedding { p3: false, p2: false, p1_coalesced: false });
        assert_eq!(Level::Some.sheds(), Shedding { p3: true, p2: true, p1_coalesced: false });
        assert_eq!(Level::Full.sheds(), Shedding { p3: true, p2: true, p1_coalesced: true });
        for l in [Level::Nominal, Level::Some, Level::Full] {
            assert_eq!(Level::from_code(l.code()), Some(l));
        }
        assert_eq!(Level::from_code(3), None);
    }
}
