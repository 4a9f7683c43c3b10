//! The outcome ladder and the culprit rules as pure functions of one op's evidence: no
//! matcher state, no clock — what [`super::CollectiveMatcher`]'s evaluation feeds them
//! is all they see, so each rule is tested by a table (below) instead of a scenario.
//!
//! Stages (see `evaluate.rs`): observe (the matcher's maps → [`RankEvidence`] per rank
//! and an [`OpContext`]) → [`classify`] each rank → [`assign_culprits`] (C3e, C3a
//! candidates, C3c, C4) → finality → tags → emit.

use std::collections::BTreeSet;

use crate::records::{LivenessState, NodeId};
use crate::verdict::{Indeterminate, OpRef, Outcome};

use super::state::{ProgressView, snapshot_at};

/// How a rank's completion of the op is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Completion {
    /// Not known to have completed.
    No,
    /// Its own completion frame (`kernel_end` / `proxy_done`, or every channel's end).
    Direct,
    /// Inferred: PROGRESS `last_completed ≥ k`, a later op of the rank on the
    /// communicator, or a fused group sibling's completion.
    Inferred,
}

impl Completion {
    pub(super) fn done(self) -> bool {
        self != Self::No
    }
}

/// Which kind of op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpKind {
    Collective,
    P2p,
    Graph,
}

/// What the evidence says about one rank of one op.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct RankEvidence {
    pub(super) rank: u32,
    /// Where it lives: its frames, its PROGRESS entry, or where it spoke from before.
    pub(super) node: Option<NodeId>,
    pub(super) entered: bool,
    pub(super) started: bool,
    pub(super) completion: Completion,
    /// It has a PROGRESS entry (its process runs the profiler shim).
    pub(super) instrumented: bool,
    /// Its PROGRESS says no completion source is active.
    pub(super) no_source: bool,
    /// Its PROGRESS says its process exited.
    pub(super) exited: bool,
    pub(super) live: LivenessState,
    pub(super) progress: Option<ProgressView>,
    pub(super) local_op_seq: u64,
    pub(super) pid: u32,
}

/// The op-wide facts the ladder reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OpContext {
    pub(super) kind: OpKind,
    /// `comm_op_seq` (0 for P2P and graph ops).
    pub(super) seq: u64,
    /// Two processes claimed one of its ranks: two communicators share its key.
    pub(super) key_collision: bool,
    pub(super) any_completed: bool,
    /// The stuck / join deadline passed on every gating node's watermark.
    pub(super) past_stuck: bool,
    pub(super) past_join: bool,
    pub(super) stuck_at: u64,
    pub(super) join_at: u64,
    /// It lived through an aggregator knowledge gap of one of its ranks' nodes.
    pub(super) in_gap: bool,
    /// An earlier op of its communicator became final unresolved.
    pub(super) blocked_root: Option<OpRef>,
}

/// A rank named as the reason an op cannot finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Culprit {
    pub(super) rank: u32,
    pub(super) node: Option<NodeId>,
}

/// What [`assign_culprits`] concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Culprits {
    /// The rank the others wait on, when the culprits are on one node.
    pub(super) waiting_on: Option<u32>,
    /// A culprit with real evidence (not only a silent node's rank) exists.
    pub(super) decisive: bool,
}

/// One rank's outcome (the rules of docs/design.md as a ladder, first match wins).
/// `blocked_by` finds the rank's earlier unresolved op on another communicator; it is
/// asked only on that rung.
pub(super) fn classify(r: &RankEvidence, ctx: &OpContext, blocked_by: impl FnOnce() -> Option<OpRef>) -> Outcome {
    // Only this op's own evidence of two processes claiming one rank makes it a key
    // collision: a communicator that once shared its key with another still has ops no
    // one else claimed, judged on their merits.
    if ctx.key_collision {
        return Outcome::Indeterminate(Indeterminate::KeyCollision);
    }
    match r.completion {
        Completion::Direct => return Outcome::Completed,
        Completion::Inferred => return Outcome::CompletedInferred,
        Completion::No => {}
    }
    if ctx.kind == OpKind::Graph {
        // Graph replays are excluded from ordering and inference: complete when every
        // channel ended, otherwise still running; never not_joined.
        return if r.live == LivenessState::Fresh { Outcome::InFlight } else { Outcome::UnknownSilent };
    }
    if r.no_source {
        return Outcome::Indeterminate(Indeterminate::NoCompletionSource);
    }
    if r.live != LivenessState::Fresh {
        return Outcome::UnknownSilent;
    }
    if !r.instrumented && ctx.any_completed {
        // No PROGRESS and no completion frame: peers finished, this rank cannot be
        // decided either way.
        return Outcome::Indeterminate(Indeterminate::Uninstrumented);
    }
    if let Some(root) = ctx.blocked_root {
        // The process is gone: it will never join this op either. Otherwise an earlier op
        // on this communicator ended unresolved: this one cannot run.
        return if !r.entered && r.exited { Outcome::NotJoinedExited } else { Outcome::BlockedBy(root) };
    }
    if !r.entered {
        if !ctx.past_join && !ctx.past_stuck {
            return Outcome::InFlight;
        }
        if ctx.in_gap {
            return Outcome::Indeterminate(Indeterminate::AggregatorGap);
        }
        if !r.instrumented {
            return Outcome::Indeterminate(Indeterminate::Uninstrumented);
        }
        // Not joined needs a fresh PROGRESS entry (after the join deadline) showing the
        // rank behind.
        let fresh =
            ctx.past_join && r.progress.is_some_and(|p| snapshot_at(&p) >= ctx.join_at && p.last_enqueued < ctx.seq);
        return match (fresh, r.exited) {
            (true, true) => Outcome::NotJoinedExited,
            (true, false) => Outcome::NotJoined,
            (false, _) => Outcome::InFlight,
        };
    }
    if !ctx.past_stuck {
        return Outcome::InFlight;
    }
    if ctx.in_gap {
        return Outcome::Indeterminate(Indeterminate::AggregatorGap);
    }
    if !r.instrumented {
        return Outcome::Indeterminate(Indeterminate::Uninstrumented);
    }
    if ctx.any_completed && ctx.kind == OpKind::Collective {
        // Every peer that could finish did; this rank entered and did not: stuck, once
        // PROGRESS past the deadline still shows last_completed < k.
        let frozen = r.progress.is_some_and(|p| snapshot_at(&p) >= ctx.stuck_at && p.last_completed < ctx.seq);
        return if frozen { Outcome::Stuck } else { Outcome::InFlight };
    }
    if r.started {
        // Its kernel started: whatever else the rank has in flight on other streams, it
        // is inside this op, waiting on peers (not blocked by an earlier op).
        return Outcome::WaitingOn(None);
    }
    blocked_by().map_or(Outcome::WaitingOn(None), Outcome::BlockedBy)
}

/// The culprit rules over every rank's outcome: C3(e) turns the only GPU that never
/// started k while every live peer's did into `stuck`; culprits are the ranks stuck, not
/// joined, silent or blocked (or, when none, C3(a) candidates: instrumented ranks whose
/// fresh PROGRESS shows them behind, before their join deadline); C3(c): a silent node's
/// ranks name no culprit when a rank with real evidence does; C4: ranks waiting (or
/// entered and in flight, once a culprit is decisive) wait on the culprit when all
/// culprits are on one node, else on `unknown`. `comm`: the op's communicator.
pub(super) fn assign_culprits(
    rs: &[RankEvidence],
    outcomes: &mut [Outcome],
    ctx: &OpContext,
    comm: crate::records::Comm,
) -> Culprits {
    if ctx.past_stuck && !ctx.any_completed && !ctx.in_gap && !ctx.key_collision {
        let not_started: Vec<usize> = rs
            .iter()
            .zip(outcomes.iter())
            .enumerate()
            .filter(|(_, (r, o))| {
                r.entered
                    && !r.started
                    && r.live == LivenessState::Fresh
                    // Behind its own earlier op on this communicator it cannot start k (a
                    // GPU runs a communicator's ops in order): that is the earlier op's
                    // doing, not a stall of its own. Behind an op on another communicator
                    // (another stream) it could have.
                    && match o {
                        Outcome::WaitingOn(_) => true,
                        Outcome::BlockedBy(b) => b.comm() != comm,
                        _ => false,
                    }
                    && r.progress.is_some_and(|p| snapshot_at(&p) >= ctx.stuck_at && p.last_kernel_started < ctx.seq)
            })
            .map(|(i, _)| i)
            .collect();
        let others_started = rs
            .iter()
            .zip(outcomes.iter())
            .enumerate()
            .filter(|(i, _)| !not_started.contains(i))
            .all(|(_, (r, o))| r.started || !matches!(o, Outcome::WaitingOn(_) | Outcome::BlockedBy(_)));
        if let [only] = not_started.as_slice()
            && others_started
            && let Some(o) = outcomes.get_mut(*only)
        {
            *o = Outcome::Stuck;
        }
    }
    let mut culprits: Vec<Culprit> = rs
        .iter()
        .zip(outcomes.iter())
        .filter(|(_, o)| {
            matches!(
                o,
                Outcome::Stuck
                    | Outcome::NotJoined
                    | Outcome::NotJoinedExited
                    | Outcome::UnknownSilent
                    | Outcome::BlockedBy(_)
            )
        })
        .map(|(r, _)| Culprit { rank: r.rank, node: r.node })
        .collect();
    if ctx.past_stuck && culprits.is_empty() {
        culprits = rs
            .iter()
            .zip(outcomes.iter())
            .filter(|(r, o)| {
                let behind = r.progress.is_some_and(|p| snapshot_at(&p) >= ctx.stuck_at && p.last_enqueued < ctx.seq);
                matches!(o, Outcome::InFlight) && !r.entered && r.instrumented && behind
            })
            .map(|(r, _)| Culprit { rank: r.rank, node: r.node })
            .collect();
    }
    let silent =
        |rank: u32| rs.iter().zip(outcomes.iter()).any(|(r, o)| r.rank == rank && matches!(o, Outcome::UnknownSilent));
    let evidenced: Vec<Culprit> = culprits.iter().copied().filter(|c| !silent(c.rank)).collect();
    let named = if evidenced.is_empty() { &culprits } else { &evidenced };
    let culprit_nodes: BTreeSet<Option<NodeId>> = named.iter().map(|c| c.node).collect();
    let waiting_on = if culprit_nodes.len() == 1 { named.first().map(|c| c.rank) } else { None };
    let decisive = !evidenced.is_empty();
    for (r, o) in rs.iter().zip(outcomes.iter_mut()) {
        match o {
            Outcome::WaitingOn(w) => *w = waiting_on,
            Outcome::InFlight if decisive && r.entered && waiting_on.is_some() => *o = Outcome::WaitingOn(waiting_on),
            _ => {}
        }
    }
    Culprits { waiting_on, decisive }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::Comm;

    const K: u64 = 10;
    const S: u64 = 1_000_000_000;

    fn progress(enqueued: u64, started: u64, completed: u64, at: u64) -> ProgressView {
        ProgressView {
            node: Some(NodeId(1)),
            last_enqueued: enqueued,
            last_kernel_started: started,
            last_completed: completed,
            snapshot_cluster_ns: i64::try_from(at).unwrap_or(i64::MAX),
            activation_mask: proto_flat::codes::activation::COMPLETION_SOURCES,
            ..ProgressView::default()
        }
    }

    fn rank(rank: u32) -> RankEvidence {
        RankEvidence {
            rank,
            node: Some(NodeId(u64::from(rank))),
            entered: true,
            started: true,
            completion: Completion::No,
            instrumented: true,
            no_source: false,
            exited: false,
            live: LivenessState::Fresh,
            progress: Some(progress(K, K, K - 1, 100 * S)),
            local_op_seq: 0,
            pid: 1,
        }
    }

    fn ctx() -> OpContext {
        OpContext {
            kind: OpKind::Collective,
            seq: K,
            key_collision: false,
            any_completed: false,
            past_stuck: true,
            past_join: false,
            stuck_at: 20 * S,
            join_at: 600 * S,
            in_gap: false,
            blocked_root: None,
        }
    }

    fn root() -> OpRef {
        OpRef::Coll { comm: Comm { hash: 1, disambiguator: 0, instance: 1 }, seq: K - 1 }
    }

    /// The ladder, rung by rung: (what differs from a started, instrumented, fresh rank
    /// past the stuck deadline; the outcome).
    #[test]
    fn the_outcome_ladder_rule_by_rule() {
        type Case = (&'static str, fn(&mut RankEvidence, &mut OpContext), Outcome);
        let cases: &[Case] = &[
            (
                "key collision beats everything",
                |r, c| {
                    c.key_collision = true;
                    r.completion = Completion::Direct;
                },
                Outcome::Indeterminate(Indeterminate::KeyCollision),
            ),
            ("own completion frame", |r, _| r.completion = Completion::Direct, Outcome::Completed),
            ("inferred completion", |r, _| r.completion = Completion::Inferred, Outcome::CompletedInferred),
            ("graph replay, fresh: still running", |_, c| c.kind = OpKind::Graph, Outcome::InFlight),
            (
                "graph replay, silent node",
                |r, c| {
                    c.kind = OpKind::Graph;
                    r.live = LivenessState::Silent;
                },
                Outcome::UnknownSilent,
            ),
            (
                "no completion source",
                |r, _| r.no_source = true,
                Outcome::Indeterminate(Indeterminate::NoCompletionSource),
            ),
            ("silent node", |r, _| r.live = LivenessState::Silent, Outcome::UnknownSilent),
            ("unreachable node", |r, _| r.live = LivenessState::Unreachable, Outcome::UnknownSilent),
            (
                "uninstrumented, peers finished",
                |r, c| {
                    r.instrumented = false;
                    c.any_completed = true;
                },
                Outcome::Indeterminate(Indeterminate::Uninstrumented),
            ),
            ("blocked by an unresolved earlier op", |_, c| c.blocked_root = Some(root()), Outcome::BlockedBy(root())),
            (
                "blocked, but the process exited before entering",
                |r, c| {
                    c.blocked_root = Some(root());
                    r.entered = false;
                    r.exited = true;
                },
                Outcome::NotJoinedExited,
            ),
            (
                "not entered, no deadline passed",
                |r, c| {
                    r.entered = false;
                    c.past_stuck = false;
                },
                Outcome::InFlight,
            ),
            (
                "not entered, in a knowledge gap",
                |r, c| {
                    r.entered = false;
                    c.in_gap = true;
                },
                Outcome::Indeterminate(Indeterminate::AggregatorGap),
            ),
            (
                "not entered, uninstrumented",
                |r, _| {
                    r.entered = false;
                    r.instrumented = false;
                },
                Outcome::Indeterminate(Indeterminate::Uninstrumented),
            ),
            (
                "not entered, past join, fresh PROGRESS behind",
                |r, c| {
                    r.entered = false;
                    c.past_join = true;
                    r.progress = Some(progress(K - 1, K - 1, K - 1, 700 * S));
                },
                Outcome::NotJoined,
            ),
            (
                "not entered, past join, fresh PROGRESS behind, exited",
                |r, c| {
                    r.entered = false;
                    r.exited = true;
                    c.past_join = true;
                    r.progress = Some(progress(K - 1, K - 1, K - 1, 700 * S));
                },
                Outcome::NotJoinedExited,
            ),
            (
                "not entered, past join, PROGRESS from before the deadline",
                |r, c| {
                    r.entered = false;
                    c.past_join = true;
                    r.progress = Some(progress(K - 1, K - 1, K - 1, 500 * S));
                },
                Outcome::InFlight,
            ),
            ("entered, stuck deadline not passed", |_, c| c.past_stuck = false, Outcome::InFlight),
            (
                "entered, in a knowledge gap",
                |_, c| c.in_gap = true,
                Outcome::Indeterminate(Indeterminate::AggregatorGap),
            ),
            (
                "entered, uninstrumented",
                |r, _| r.instrumented = false,
                Outcome::Indeterminate(Indeterminate::Uninstrumented),
            ),
            ("peers finished, PROGRESS frozen past the deadline", |_, c| c.any_completed = true, Outcome::Stuck),
            (
                "peers finished, PROGRESS from before the deadline",
                |r, c| {
                    c.any_completed = true;
                    r.progress = Some(progress(K, K, K - 1, 10 * S));
                },
                Outcome::InFlight,
            ),
            (
                "peers finished a P2P op: no stuck without a collective",
                |_, c| {
                    c.any_completed = true;
                    c.kind = OpKind::P2p;
                },
                Outcome::WaitingOn(None),
            ),
            ("started, hung with peers", |_, _| {}, Outcome::WaitingOn(None)),
            ("not started, an earlier op of the rank unresolved", |r, _| r.started = false, Outcome::BlockedBy(root())),
        ];
        for (name, change, want) in cases {
            let (mut r, mut c) = (rank(3), ctx());
            change(&mut r, &mut c);
            let got = classify(&r, &c, || Some(root()));
            assert_eq!(got, *want, "{name}");
        }
        // Not started and nothing earlier unresolved: waiting.
        let mut r = rank(3);
        r.started = false;
        assert_eq!(classify(&r, &ctx(), || None), Outcome::WaitingOn(None));
    }

    /// C3(e), C3(a), C3(c) and C4 by table: (the ranks' outcomes and starts; the
    /// outcomes after, and who is waited on).
    #[test]
    fn the_culprit_rules() {
        let comm = Comm { hash: 1, disambiguator: 0, instance: 1 };
        // C3(e): rank 2 alone never started k, its PROGRESS fresh past the deadline.
        let mut rs: Vec<RankEvidence> = (0..4).map(rank).collect();
        rs[2].started = false;
        rs[2].progress = Some(progress(K, K - 1, K - 1, 100 * S));
        let mut out = vec![Outcome::WaitingOn(None); 4];
        let c = assign_culprits(&rs, &mut out, &ctx(), comm);
        assert_eq!(out[2], Outcome::Stuck);
        assert_eq!(c, Culprits { waiting_on: Some(2), decisive: true });
        assert!(out.iter().enumerate().all(|(i, o)| i == 2 || *o == Outcome::WaitingOn(Some(2))));
        // Two never started: no single culprit, all hung with culprit unknown.
        rs[1].started = false;
        rs[1].progress = rs[2].progress;
        let mut out = vec![Outcome::WaitingOn(None); 4];
        let c = assign_culprits(&rs, &mut out, &ctx(), comm);
        assert_eq!(c, Culprits { waiting_on: None, decisive: false });
        assert!(out.iter().all(|o| *o == Outcome::WaitingOn(None)));
        // C3(c): a silent node's rank and a not-joined rank: the others wait on the one
        // with evidence.
        let rs: Vec<RankEvidence> = (0..4).map(rank).collect();
        let mut out = vec![Outcome::UnknownSilent, Outcome::NotJoined, Outcome::WaitingOn(None), Outcome::InFlight];
        let c = assign_culprits(&rs, &mut out, &ctx(), comm);
        assert_eq!(c, Culprits { waiting_on: Some(1), decisive: true });
        assert_eq!(out[2], Outcome::WaitingOn(Some(1)));
        assert_eq!(out[3], Outcome::WaitingOn(Some(1)), "C4: an entered rank in flight waits on the culprit");
        // Only silent culprits: not decisive, an in-flight rank stays in flight.
        let mut out = vec![Outcome::UnknownSilent, Outcome::InFlight];
        let c = assign_culprits(&rs[..2], &mut out, &ctx(), comm);
        assert_eq!(c, Culprits { waiting_on: Some(0), decisive: false });
        assert_eq!(out[1], Outcome::InFlight);
        // C3(a) candidate before its join deadline: named, its own outcome in flight.
        let mut rs: Vec<RankEvidence> = (0..3).map(rank).collect();
        rs[0].entered = false;
        rs[0].started = false;
        rs[0].progress = Some(progress(K - 1, K - 1, K - 1, 100 * S));
        let mut out = vec![Outcome::InFlight, Outcome::WaitingOn(None), Outcome::WaitingOn(None)];
        let c = assign_culprits(&rs, &mut out, &ctx(), comm);
        assert_eq!(c, Culprits { waiting_on: Some(0), decisive: true });
        assert_eq!(out, vec![Outcome::InFlight, Outcome::WaitingOn(Some(0)), Outcome::WaitingOn(Some(0))]);
    }
}
