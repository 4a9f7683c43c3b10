//! Tags and emission: each rank's verdict with its tags, kept in the op; an event with
//! its evidence for each that changed and says something; GPU health evidence from final
//! verdicts.

use super::classify::RankEvidence;
use super::finality::Finality;
use super::*;

impl CollectiveMatcher {
    /// Tags and emission: each rank's verdict with its tags, kept in the op; an event for
    /// each that changed and says something (final, or neither in flight nor a plain
    /// completion), with its evidence; GPU health evidence from final verdicts.
    #[allow(clippy::too_many_arguments, reason = "the stage's inputs, each named")]
    pub(super) fn emit(
        &mut self,
        now: u64,
        op: &mut OpState,
        rs: &[RankEvidence],
        outcomes: &[Outcome],
        fin: &Finality,
        stragglers: &BTreeMap<u32, VerdictTag>,
        in_gap: bool,
    ) -> Vec<MatcherEvent> {
        let Finality { is_final, decided_at, .. } = *fin;
        let key = op.key;
        let is_graph = matches!(key, OpRef::Graph { .. });
        let reference = op.observed().find(|x| x.op == op.op).cloned();
        let reference = reference.as_ref();
        let mut new_verdicts = std::mem::take(&mut op.verdicts);
        new_verdicts.resize(op.participants.len(), None);
        let mut events = Vec::new();
        for (r, o) in rs.iter().zip(outcomes.iter()) {
            let mut tags = Vec::new();
            if let Some(n) = r.node.and_then(|n| self.nodes.get(&n))
                && matches!(o, Outcome::CompletedInferred | Outcome::EnteredInferred)
            {
                // The window where the missing record would have been emitted: around
                // this op's frames from the same node, or the node's latest losses when
                // none of them arrived.
                let same_node: Vec<&RankObs> = op.observed().filter(|x| x.node == r.node).collect();
                let ids: Vec<u64> = if same_node.is_empty() {
                    n.p0_losses.iter().rev().take(16).map(|l| l.0).collect()
                } else {
                    let lo = same_node.iter().map(|x| x.first_node_ns).min().unwrap_or(0).saturating_sub(5_000_000_000);
                    let hi = same_node.iter().map(|x| x.last_node_ns).max().unwrap_or(0).saturating_add(5_000_000_000);
                    n.p0_losses.iter().filter(|l| l.1 <= hi && l.2 >= lo).map(|l| l.0).collect()
                };
                if !ids.is_empty() {
                    tags.push(VerdictTag::TelemetryLoss { ids });
                }
            }
            if in_gap {
                tags.push(VerdictTag::AggregatorGap);
            }
            if is_graph {
                tags.push(VerdictTag::GraphCaptured);
            }
            if let Some(t) = stragglers.get(&r.rank) {
                tags.push(t.clone());
            }
            if let Some(obs) = op.slot(r.rank).and_then(|i| op.ranks.get(i)).filter(|o| o.present)
                && let Some(refo) = reference
            {
                {
                    // A P2P op's two sides legitimately differ: one is the send, the other
                    // the recv (issue 11: every real P2P pair was tagged a mismatch).
                    if obs.op != refo.op && !matches!(op.key, OpRef::P2p { .. }) {
                        tags.push(VerdictTag::Mismatch { field: "op".into() });
                    } else if obs.dtype != refo.dtype {
                        tags.push(VerdictTag::Mismatch { field: "dtype".into() });
                    } else if obs.count != refo.count
                        // fr_trace: all_to_allv sizes are undecided; gather/scatter roots
                        // legitimately move a different amount than the other ranks.
                        && !matches!(Op::from_code(op.op), Op::AllToAllv | Op::Gather | Op::Scatter)
                    {
                        tags.push(VerdictTag::Mismatch { field: "count".into() });
                    }
                }
            }
            let slot = op.slot(r.rank).unwrap_or(0);
            // What the rank's verdict was (borrowed, not cloned: most ranks do not change).
            let prev = new_verdicts.get(slot).and_then(Option::as_ref);
            let changed = prev.is_none_or(|p| p.outcome != *o || p.tags != tags || (!p.is_final && is_final));
            if !changed {
                continue;
            }
            let mut revision = prev.map_or(0, |p| p.revision);
            if let Some(p) = prev
                && p.outcome != *o
            {
                if p.is_final {
                    self.stats.revisions_after_final.inc();
                } else if is_decision(&p.outcome) {
                    // A decided outcome changed before it became final. Waiting states
                    // (in flight, waiting on, blocked by) evolving are not revisions.
                    revision = revision.saturating_add(1);
                    self.stats.revisions_before_final.inc();
                }
            }
            // Kept in state, emitted only when it says something: final verdicts, and
            // non-final ones that are neither in flight nor a plain completion.
            let emit = is_final || !matches!(o, Outcome::InFlight | Outcome::Completed);
            let gpu_uuid = r.progress.map_or([0; 16], |p| p.gpu_uuid);
            if let Some(node) = r.node {
                // Every GPU with a verdict is in the health book; final verdicts date its
                // evidence.
                let f = self.gpu_flags.entry((node, gpu_uuid)).or_default();
                let gpu_straggler = tags.iter().any(|t| matches!(t, VerdictTag::Straggler { host: false, .. }));
                match o {
                    Outcome::Stuck if is_final => f.degraded_at_ns = now,
                    _ if is_final && gpu_straggler => f.degraded_at_ns = now,
                    Outcome::NotJoined | Outcome::NotJoinedExited if is_final => f.suspect_at_ns = now,
                    Outcome::WaitingOn(None) if is_final => f.suspect_at_ns = now,
                    // Only a final inference: one revised to `completed` when the late frame
                    // arrived was no loss after all.
                    Outcome::CompletedInferred if is_final && !tags.is_empty() => f.lossy_at_ns = now,
                    _ => {}
                }
            }
            if !emit {
                if let Some(v) = new_verdicts.get_mut(slot) {
                    *v = Some(RankVerdict { outcome: *o, tags, is_final, revision });
                }
                continue;
            }
            if let Some(v) = new_verdicts.get_mut(slot) {
                *v = Some(RankVerdict { outcome: *o, tags: tags.clone(), is_final, revision });
            }
            // The evidence, built only for what is emitted.
            let mut evidence = Evidence::default();
            if let Some(obs) = op.slot(r.rank).and_then(|i| op.ranks.get(i)).filter(|o| o.present) {
                evidence.frames.extend([obs.entered, obs.started, obs.completed].into_iter().flatten());
            }
            if let Some(p) = r.progress {
                evidence.progress.push(ProgressRef {
                    node: p.node.unwrap_or(NodeId(0)),
                    rank: r.rank,
                    last_enqueued_op: p.last_enqueued,
                    last_kernel_started_op: p.last_kernel_started,
                    last_completed_op: p.last_completed,
                    snapshot_cluster_ns: p.snapshot_cluster_ns,
                });
            }
            for t in &tags {
                if let VerdictTag::TelemetryLoss { ids } = t {
                    evidence.loss_intervals.extend(ids);
                }
            }
            if let Some(n) = r.node.and_then(|n| self.nodes.get(&n).map(|v| (n, v.w_p0_cluster_ns))) {
                evidence.watermarks.push(n);
            }
            evidence.rule = rule_for(o);
            events.push(MatcherEvent::Verdict(Verdict {
                op: key,
                rank: r.rank,
                node: r.node,
                gpu_uuid,
                outcome: *o,
                tags,
                is_final,
                decided_at_ns: decided_at,
                evidence,
                revision,
            }));
        }
        op.verdicts = new_verdicts;
        events
    }
}

/// Outcomes that decide something (as opposed to waiting states that evolve).
pub(super) fn is_decision(o: &Outcome) -> bool {
    matches!(
        o,
        Outcome::Completed
            | Outcome::CompletedInferred
            | Outcome::Stuck
            | Outcome::NotJoined
            | Outcome::NotJoinedExited
            | Outcome::Indeterminate(_)
    )
}

pub(super) fn rule_for(o: &Outcome) -> Rule {
    match o {
        Outcome::Completed => Rule::CompletionFrame,
        Outcome::CompletedInferred => Rule::CompletionInferred,
        Outcome::EnteredInferred => Rule::EnteredByPeer,
        Outcome::InFlight => Rule::Pending,
        Outcome::WaitingOn(Some(_)) => Rule::WaitingOnCulprit,
        Outcome::WaitingOn(None) => Rule::HungNoCulprit,
        Outcome::NotJoined => Rule::NotJoined,
        Outcome::NotJoinedExited => Rule::ProcessExited,
        Outcome::Stuck => Rule::Stuck,
        Outcome::BlockedBy(_) => Rule::BlockedBy,
        Outcome::UnknownSilent => Rule::Silent,
        Outcome::Indeterminate(_) => Rule::Indeterminate,
    }
}
