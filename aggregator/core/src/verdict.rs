//! Verdict records: per rank and op, `{outcome, tags, final, decided_at, evidence}`.

use rkyv::{Archive, Deserialize, Serialize};

use crate::records::{Comm, NodeId};

/// Which op a verdict is about.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[rkyv(derive(Debug, PartialEq, Eq, PartialOrd, Ord, Hash))]
pub enum OpRef {
    /// A collective: `(communicator, comm_op_seq)`.
    Coll { comm: Comm, seq: u64 },
    /// A point-to-point op: `(communicator, src, dst, p2p_seq)`.
    P2p { comm: Comm, src: u32, dst: u32, p2p_seq: u64 },
    /// One replay of a CUDA-graph-captured collective: `(communicator instance,
    /// graph_id, graph_node, replay_idx)`, matched from kernel-channel records only.
    Graph { comm: Comm, graph_id: u64, graph_node: u32, replay_idx: u32 },
}

impl OpRef {
    /// The communicator.
    #[must_use]
    pub fn comm(&self) -> Comm {
        match *self {
            Self::Coll { comm, .. } | Self::P2p { comm, .. } | Self::Graph { comm, .. } => comm,
        }
    }
}

/// Why an outcome cannot be decided.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Indeterminate {
    /// The activation mask has neither kernel-channel nor proxy events.
    NoCompletionSource,
    /// No PROGRESS entry for the rank.
    Uninstrumented,
    /// `nranks` disagree at one key.
    KeyCollision,
    /// The op overlaps the aggregator's own knowledge gap.
    AggregatorGap,
}

/// A rank's outcome for one op (the set in docs/design.md).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    /// Completion proven by PROGRESS or by a later op's completion on the same
    /// communicator (its own completion frame was not seen).
    CompletedInferred,
    /// Entry proven without an own frame (a peer's completion of a strong collective).
    EnteredInferred,
    InFlight,
    /// Entered and waiting on a culprit rank (`None`: culprit unknown).
    WaitingOn(Option<u32>),
    NotJoined,
    /// Not joined, and PROGRESS shows the process exited.
    NotJoinedExited,
    Stuck,
    /// An earlier unresolved op of the same rank blocks this one.
    BlockedBy(OpRef),
    /// The rank's node is silent or unreachable.
    UnknownSilent,
    Indeterminate(Indeterminate),
}

/// The outcome names up to their first `(`: what `Outcome::name` starts with, and what
/// the API's `outcome=` filter takes (one of these, or one followed by `(…`).
pub const OUTCOME_KINDS: [&str; 10] = [
    "completed",
    "completed_inferred",
    "entered_inferred",
    "in_flight",
    "waiting_on",
    "not_joined",
    "stuck",
    "blocked_by",
    "unknown_silent",
    "indeterminate",
];

impl Outcome {
    /// Short name as docs/design.md spells it.
    #[must_use]
    pub fn name(&self) -> String {
        match self {
            Self::Completed => "completed".into(),
            Self::CompletedInferred => "completed_inferred".into(),
            Self::EnteredInferred => "entered_inferred".into(),
            Self::InFlight => "in_flight".into(),
            Self::WaitingOn(Some(r)) => format!("waiting_on({r})"),
            Self::WaitingOn(None) => "waiting_on(unknown)".into(),
            Self::NotJoined => "not_joined".into(),
            Self::NotJoinedExited => "not_joined(process_exited)".into(),
            Self::Stuck => "stuck".into(),
            Self::BlockedBy(OpRef::Coll { seq, .. }) => format!("blocked_by(#{seq})"),
            Self::BlockedBy(OpRef::P2p { p2p_seq, .. }) => format!("blocked_by(p2p#{p2p_seq})"),
            Self::BlockedBy(OpRef::Graph { replay_idx, .. }) => format!("blocked_by(graph#{replay_idx})"),
            Self::UnknownSilent => "unknown_silent".into(),
            Self::Indeterminate(i) => format!(
                "indeterminate({})",
                match i {
                    Indeterminate::NoCompletionSource => "no_completion_source",
                    Indeterminate::Uninstrumented => "uninstrumented",
                    Indeterminate::KeyCollision => "key_collision",
                    Indeterminate::AggregatorGap => "aggregator_gap",
                }
            ),
        }
    }
}

/// Tags on a verdict.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum VerdictTag {
    /// A P0 loss interval of the rank's node overlaps the op (interval ids).
    TelemetryLoss {
        ids: Vec<u64>,
    },
    /// A consistency check failed (proto-flat field name).
    Mismatch {
        field: String,
    },
    GraphCaptured,
    AggregatorGap,
    /// The rank's kernel started `lag_ns` after its peers' median (cluster time) beyond
    /// `bound_ns` in at least 3 of its last 5 collectives on this communicator. `host`:
    /// its own enqueue was already late by most of the lag — host-side, never degrading.
    Straggler {
        lag_ns: i64,
        bound_ns: u64,
        host: bool,
    },
}

/// The rule behind an outcome.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rule {
    #[default]
    Pending,
    CompletionFrame,
    CompletionInferred,
    EnteredByPeer,
    WaitingOnCulprit,
    HungNoCulprit,
    NotJoined,
    ProcessExited,
    Stuck,
    BlockedBy,
    Silent,
    Indeterminate,
}

impl Rule {
    /// One sentence for people.
    #[must_use]
    pub fn describe(self) -> &'static str {
        match self {
            Self::Pending => "no completion yet; deadline not passed",
            Self::CompletionFrame => "rank-level kernel_end/proxy_done frame",
            Self::CompletionInferred => {
                "PROGRESS last_completed ≥ k, or the rank completed a later op on this communicator"
            }
            Self::EnteredByPeer => "a peer completed a strong collective (C1)",
            Self::WaitingOnCulprit => "entered; waiting on the culprit (C4)",
            Self::HungNoCulprit => "entered; hung with no discriminating evidence (C3: culprit unknown)",
            Self::NotJoined => "fresh PROGRESS shows the rank never entered, past the join deadline (C3a)",
            Self::ProcessExited => "PROGRESS shows the process exited without entering (C3a)",
            Self::Stuck => "did not finish: peers finished, or its GPU alone never started k (C3e)",
            Self::BlockedBy => "an earlier op of this rank is unresolved (C3b)",
            Self::Silent => "the rank's node is silent or unreachable (C3c): not gating",
            Self::Indeterminate => "the evidence cannot decide",
        }
    }
}

/// A frame the verdict rests on.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRef {
    pub node: NodeId,
    pub stream_id: u32,
    pub seq: u64,
    pub phase: u8,
}

/// A PROGRESS value the verdict rests on.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgressRef {
    pub node: NodeId,
    pub rank: u32,
    pub last_enqueued_op: u64,
    pub last_kernel_started_op: u64,
    pub last_completed_op: u64,
    pub snapshot_cluster_ns: i64,
}

/// Evidence a person can follow.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct Evidence {
    pub frames: Vec<FrameRef>,
    pub loss_intervals: Vec<u64>,
    /// `(node, w_p0 in cluster ns)` of the participants when decided.
    pub watermarks: Vec<(NodeId, i64)>,
    pub progress: Vec<ProgressRef>,
    /// The rule that decided it ([`Rule::describe`] says it in a sentence).
    pub rule: Rule,
}

/// One rank's verdict on one op.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub op: OpRef,
    pub rank: u32,
    pub node: Option<NodeId>,
    pub gpu_uuid: [u8; 16],
    pub outcome: Outcome,
    pub tags: Vec<VerdictTag>,
    /// No late data stamped ≤ `decided_at` can change it.
    pub is_final: bool,
    /// Aggregator time.
    pub decided_at_ns: u64,
    pub evidence: Evidence,
    /// Changes of this rank's outcome before it became final.
    pub revision: u32,
}

/// What the matcher emits.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant, reason = "verdicts are the common case; boxing them would cost an allocation each")]
pub enum MatcherEvent {
    Verdict(Verdict),
    /// A final `stuck` op completed after all (not a revision).
    Recovered {
        op: OpRef,
        rank: u32,
        node: Option<NodeId>,
        after_ms: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_name_starts_with_one_of_the_kinds() {
        let comm = Comm { hash: 1, disambiguator: 2, instance: 3 };
        let all = [
            Outcome::Completed,
            Outcome::CompletedInferred,
            Outcome::EnteredInferred,
            Outcome::InFlight,
            Outcome::WaitingOn(Some(3)),
            Outcome::WaitingOn(None),
            Outcome::NotJoined,
            Outcome::NotJoinedExited,
            Outcome::Stuck,
            Outcome::BlockedBy(OpRef::Coll { comm, seq: 1 }),
            Outcome::BlockedBy(OpRef::P2p { comm, src: 0, dst: 1, p2p_seq: 2 }),
            Outcome::BlockedBy(OpRef::Graph { comm, graph_id: 1, graph_node: 2, replay_idx: 3 }),
            Outcome::UnknownSilent,
            Outcome::Indeterminate(Indeterminate::NoCompletionSource),
            Outcome::Indeterminate(Indeterminate::Uninstrumented),
            Outcome::Indeterminate(Indeterminate::KeyCollision),
            Outcome::Indeterminate(Indeterminate::AggregatorGap),
        ];
        for o in all {
            let name = o.name();
            let kind = name.split('(').next().unwrap_or_default();
            assert!(OUTCOME_KINDS.contains(&kind), "{name}");
        }
    }
}
