//! The scorer's table: the ground truth's physical facts → the verdict the rules of
//! docs/design.md owe each rank. The truth ([`crate::truth`]) only says what happened;
//! this module is the one place that maps it to the outcome vocabulary of docs/design.md,
//! so every judge (`loadgen`'s scorer, the core's property tests, the real-process tests)
//! uses the same table. It lives here, not in `loadgen`, because the core's tests depend
//! on `loadgen-sim` and not on `loadgen`.
//!
//! | facts of the rank (first match wins) | expected verdict | decidable by the run's end |
//! |---|---|---|
//! | not instrumented | `indeterminate(uninstrumented)` | always |
//! | the op's key is shared with another communicator's op | `indeterminate(key_collision)` | always |
//! | no completion source in the activation mask (not a graph replay) | `indeterminate(no_completion_source)` | always |
//! | ended; its GPU paused inside this op and ended more than the stuck deadline + slack after the op's first start | `stuck` (a `Recovered` follows) | first start + stuck deadline + slack passed |
//! | ended; an earlier op on the communicator had such a pause and a rank entered this op before that pause ended | `blocked_by(comm#k)` | as for the paused op |
//! | ended; entered after that pause ended | `completed` (the pause is over: the op is judged on its own) | always |
//! | ended | `completed` (`completed_inferred` when its frames were lost) | always |
//! | did not end, no rank failed to end (cut by the run's end) | `in_flight` | always |
//! | cause: its node died | `unknown_silent` | always |
//! | cause: not joined, process exited | `not_joined(process_exited)` | join deadline passed |
//! | cause: not joined (pause) | `not_joined` | join deadline passed |
//! | cause: GPU hung (before or after contributing) | `stuck` | stuck deadline passed |
//! | cause: run-ahead or GPU order behind `comm#k` | `blocked_by(comm#r)`, `r` the root of the chain (`k`, or what `k` itself is blocked behind, …: the earliest unresolved op) | stuck deadline passed |
//! | cause: waited on peers; one culprit rank (not a channel hang), on one node | `waiting_on(culprit)` | stuck deadline passed |
//! | cause: waited on peers, otherwise | `waiting_on(unknown)` | stuck deadline passed |
//!
//! Deadlines count from the op's first enqueue or kernel start. Where timing alone
//! decides between two verdicts — a pause that ended within `slack` of the moment the
//! stuck verdict could be final, an op entered within `slack` before the pause's end (it
//! may be judged before or after the recovery is in) — both are right ([`Expected::alternative`]). `slack` is the judge's reorder timeout and two
//! heartbeats in simulated time (the aggregator cannot make a verdict final sooner).

use std::collections::HashMap;

use crate::scenario::JoinReason;
use crate::truth::{Cause, CollectiveTruth, GroundTruth, RankTruth};

/// How far apart two nodes' stamps of one moment may be (the scenarios' clocks are
/// estimated to well within this).
const CLOCK_NOISE_MS: f64 = 100.0;

/// The verdict a rank is owed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// The outcome's name in docs/design.md, e.g. `waiting_on(3)`, `blocked_by(world/0#4)`.
    pub outcome: String,
    /// A second right answer where timing alone decides (see the module docs).
    pub alternative: Option<String>,
    /// A deadline for this outcome had passed by the end of the run (the aggregator
    /// could have given it).
    pub decidable: bool,
}

impl Expected {
    fn new(outcome: impl Into<String>, decidable: bool) -> Self {
        Self { outcome: outcome.into(), alternative: None, decidable }
    }
}

/// A GPU pause inside an op on rank `r`: its end (ms).
fn paused_end(r: &RankTruth) -> Option<f64> {
    r.tags.iter().any(|t| t.starts_with("gpu_pause(")).then_some(r.ended_ms).flatten()
}

/// A GPU pause that ended: on `comm`, in op `seq`, first started at `first_start_ms`,
/// ended at `end_ms`.
#[derive(Debug, Clone)]
struct Pause {
    seq: u64,
    first_start_ms: f64,
    end_ms: f64,
}

/// The table over one run's truth (indexes built once; [`Table::expected`] per rank).
#[derive(Debug)]
pub struct Table<'a> {
    t: &'a GroundTruth,
    slack_ms: f64,
    /// Communicator name → its ended pauses, by seq.
    pauses: HashMap<&'a str, Vec<Pause>>,
    /// `comm#seq` → index in `collectives`.
    by_name: HashMap<String, usize>,
}

impl<'a> Table<'a> {
    /// `reorder_ms`: the judge's reorder timeout in simulated ms (see the module docs).
    #[must_use]
    pub fn new(t: &'a GroundTruth, reorder_ms: f64) -> Self {
        #[allow(clippy::cast_precision_loss, reason = "ms")]
        let slack_ms = reorder_ms + 2.0 * t.timers.heartbeat_ms as f64;
        let mut pauses: HashMap<&str, Vec<Pause>> = HashMap::new();
        for c in t.collectives.iter().filter(|c| c.comm_op_seq > 0) {
            if let Some(end_ms) = c.ranks.iter().find_map(paused_end) {
                pauses.entry(c.comm.as_str()).or_default().push(Pause {
                    seq: c.comm_op_seq,
                    first_start_ms: c.first_start_ms,
                    end_ms,
                });
            }
        }
        for v in pauses.values_mut() {
            v.sort_by_key(|p| p.seq);
        }
        let by_name = (0..t.collectives.len())
            .filter(|&i| t.collectives[i].comm_op_seq > 0)
            .map(|i| (format!("{}#{}", t.collectives[i].comm, t.collectives[i].comm_op_seq), i))
            .collect();
        Self { t, slack_ms, pauses, by_name }
    }

    /// The op at the root of a chain of blocked ops: `behind` is blocked for rank
    /// `global` too, and so on, until an op where the rank did not end for a cause of its
    /// own. `blocked_by` (docs/design.md) names that root (the earliest unresolved op).
    fn root_of(&self, behind: &str, global: u32) -> String {
        let mut cur = behind.to_owned();
        for _ in 0..self.t.collectives.len() {
            let Some(c) = self.by_name.get(&cur).map(|&i| &self.t.collectives[i]) else { break };
            let Some(r) = c.ranks.iter().find(|x| x.global_rank == global) else { break };
            match &r.cause {
                Some(Cause::RunAhead { behind } | Cause::GpuOrder { behind }) => cur.clone_from(behind),
                _ => break,
            }
        }
        cur
    }

    /// How a pause ending at `end_ms` in an op first started at `first_start_ms` compares
    /// with the moment a stuck verdict on it can be final: `Some(true)` clearly after
    /// (stuck), `Some(false)` by the deadline (completed), `None` within the slack (either).
    fn outlived_deadline(&self, first_start_ms: f64, end_ms: f64) -> Option<bool> {
        #[allow(clippy::cast_precision_loss, reason = "ms")]
        let deadline = first_start_ms + self.t.timers.stuck_deadline_ms as f64;
        if end_ms <= deadline {
            Some(false)
        } else if end_ms > deadline + self.slack_ms {
            Some(true)
        } else {
            None
        }
    }

    /// The verdict rank `r` of op `c` is owed (the table in the module docs).
    #[must_use]
    pub fn expected(&self, c: &CollectiveTruth, r: &RankTruth) -> Expected {
        let t = self.t;
        #[allow(clippy::cast_precision_loss, reason = "ms")]
        let (horizon, stuck, join) =
            (t.duration_ms as f64, t.timers.stuck_deadline_ms as f64, t.timers.join_deadline_ms as f64);
        if !r.instrumented {
            return Expected::new("indeterminate(uninstrumented)", true);
        }
        if c.key_collision {
            return Expected::new("indeterminate(key_collision)", true);
        }
        if !c.completion_source && c.graph_replay.is_none() {
            return Expected::new("indeterminate(no_completion_source)", true);
        }
        if r.completed {
            return self.completed_late(c, r).unwrap_or_else(|| Expected::new("completed", true));
        }
        let Some(cause) = &r.cause else { return Expected::new("in_flight", true) };
        let deadline = |d: f64| horizon >= c.first_start_ms + d;
        match cause {
            Cause::NodeDead => Expected::new("unknown_silent", true),
            Cause::NotJoined { reason: JoinReason::Exited } => {
                Expected::new("not_joined(process_exited)", deadline(join))
            }
            Cause::NotJoined { .. } => Expected::new("not_joined", deadline(join)),
            Cause::GpuHungBefore | Cause::GpuHungAfter => Expected::new("stuck", deadline(stuck)),
            Cause::RunAhead { behind } | Cause::GpuOrder { behind } => {
                Expected::new(format!("blocked_by({})", self.root_of(behind, r.global_rank)), deadline(stuck))
            }
            Cause::Peers => {
                // Culprits: ranks that did not end for a cause of their own.
                let culprits: Vec<&RankTruth> =
                    c.ranks.iter().filter(|x| x.cause.as_ref().is_some_and(|k| *k != Cause::Peers)).collect();
                let one_node = culprits.windows(2).all(|w| w[0].node == w[1].node);
                if culprits.len() == 1 && one_node && c.hung_channel.is_none() {
                    Expected::new(format!("waiting_on({})", culprits[0].rank), deadline(stuck))
                } else {
                    Expected::new("waiting_on(unknown)", deadline(stuck))
                }
            }
        }
    }

    /// A rank that ended, but behind a GPU pause that outlived the stuck deadline:
    /// `stuck` for the paused rank itself, `blocked_by` for later ops on the communicator
    /// entered before the pause ended. `None`: plain `completed`.
    fn completed_late(&self, c: &CollectiveTruth, r: &RankTruth) -> Option<Expected> {
        #[allow(clippy::cast_precision_loss, reason = "ms")]
        let (horizon, stuck) = (self.t.duration_ms as f64, self.t.timers.stuck_deadline_ms as f64);
        let slack = self.slack_ms;
        if let Some(end) = paused_end(r) {
            let decidable = horizon >= c.first_start_ms + stuck + slack;
            return match self.outlived_deadline(c.first_start_ms, end) {
                Some(false) => None,
                Some(true) => Some(Expected::new("stuck", decidable)),
                None => Some(Expected { alternative: Some("completed".into()), ..Expected::new("stuck", decidable) }),
            };
        }
        if c.comm_op_seq == 0 {
            return None;
        }
        let entered = c.ranks.iter().filter_map(|x| x.enqueued_ms.or(x.started_ms)).reduce(f64::min)?;
        // The earliest earlier pause on this communicator that outlived its deadline and
        // had not ended when this op was first entered.
        self.pauses.get(c.comm.as_str())?.iter().take_while(|p| p.seq < c.comm_op_seq).find_map(|p| {
            let outlived = self.outlived_deadline(p.first_start_ms, p.end_ms);
            // Entered after the pause ended (beyond clock noise): judged on its own.
            if outlived == Some(false) || entered >= p.end_ms + CLOCK_NOISE_MS {
                return None;
            }
            let blocked = format!("blocked_by({}#{})", c.comm, p.seq);
            if entered >= p.end_ms {
                // Within clock noise after the end: judged on its own, or blocked by
                // timing alone.
                return Some(Expected { alternative: Some(blocked), ..Expected::new("completed", true) });
            }
            let clear = outlived == Some(true) && entered < p.end_ms - slack;
            let decidable = horizon >= p.first_start_ms + stuck + slack;
            let e = Expected::new(blocked, decidable);
            Some(if clear { e } else { Expected { alternative: Some("completed".into()), ..e } })
        })
    }

    /// Every rank of every op with the verdict it is owed.
    pub fn ranks(&self) -> impl Iterator<Item = (&'a CollectiveTruth, &'a RankTruth, Expected)> + '_ {
        self.t.collectives.iter().flat_map(move |c| c.ranks.iter().map(move |r| (c, r, self.expected(c, r))))
    }
}
