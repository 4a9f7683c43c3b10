//! Evaluation: an op's evidence → per-rank outcomes → culprits → finality → tags →
//! events.

use super::classify::{Completion, Culprits, OpContext, OpKind, RankEvidence, assign_culprits, classify};
use super::*;

/// Where a rank's kernel started against the op's reference (see
/// [`CollectiveMatcher::stragglers`]), with its uncertainty.
#[derive(Debug, Clone, Copy)]
struct RankStart {
    rank: u32,
    start: i64,
    enqueued: i64,
    epsilon_ns: u64,
}

impl CollectiveMatcher {
    pub(super) fn stuck_deadline(&self, op: &OpState) -> u64 {
        let key = (op.key.comm(), op.op, size_bucket(op.count));
        let p99 = self.durations.get(&key).and_then(|d| {
            let mut v = d.clone();
            v.sort_unstable();
            v.get(v.len().saturating_sub(1).saturating_mul(99) / 100).copied()
        });
        self.config.stuck_min_ns.max(p99.unwrap_or(0).saturating_mul(4))
    }

    /// When op k became the oldest unfinished op: when op k − 1 was decided or completed
    /// by every participant, in cluster time (or k's first sight, if later or if k − 1
    /// was never seen) — not when k − 1's verdict became final, so the deadlines of
    /// consecutive ops do not stack; never while k − 1 is undecided.
    pub(super) fn clock_start(&self, op: &OpState) -> u64 {
        let OpRef::Coll { comm, seq } = op.key else { return op.first_seen_ns };
        if seq > 1
            && let Some(prev) = self.ops.get(&OpRef::Coll { comm, seq: seq.saturating_sub(1) })
            && !prev.is_final
        {
            let decided = prev.decided_now_ns != 0
                && prev.verdicts.len() == prev.participants.len()
                && prev.verdicts.iter().all(|v| v.as_ref().is_some_and(|v| !matches!(v.outcome, Outcome::InFlight)));
            return if decided { prev.decided_at_ns.max(op.first_seen_ns) } else { u64::MAX };
        }
        match self.comm_done.get(&comm) {
            Some(&(done, at)) if done.checked_add(1) == Some(seq) => at.max(op.first_seen_ns),
            _ => op.first_seen_ns,
        }
    }

    /// Durations of completed ops feed the stuck deadline: kernel start to end on each
    /// rank's own clock (never across clocks), the longest rank.
    pub(super) fn learn_duration(&mut self, op: &OpState) {
        let comm = op.key.comm();
        let d = op
            .observed()
            .filter(|o| o.started_node_ns > 0 && o.completed_node_ns > o.started_node_ns)
            .map(|o| o.completed_node_ns.saturating_sub(o.started_node_ns))
            .max();
        if let Some(d) = d {
            let w = self.durations.entry((comm, op.op, size_bucket(op.count))).or_default();
            if w.len() >= self.config.duration_window {
                w.remove(0);
            }
            w.push(d);
        }
    }

    /// Straggler tags of a final op every rank completed (3 of a rank's last 5 lagging
    /// beyond the bound).
    pub(super) fn stragglers(&mut self, op: &OpState, rs: &[RankEvidence]) -> BTreeMap<u32, VerdictTag> {
        let comm = op.key.comm();
        let mut stragglers: BTreeMap<u32, VerdictTag> = BTreeMap::new();
        // Where each rank's kernel started, relative to a common reference, with the
        // reference's uncertainty. A strong collective ends at one moment on every
        // rank (its last step needs everyone), so its own end is the reference: a
        // rank's start measured back from its end on its own clock, no cross-node
        // clock in it (ε 0: under a CPU hog the heartbeat estimate's ε grew past a
        // 200 ms lag, and a GPU-side straggler went untagged). Other collectives:
        // kernel starts on one cluster clock, each node's residual correction
        // (learned from strong collectives' completions) applied, ± ε.
        let same_clock = strong(op.op);
        let per_rank: Vec<RankStart> = rs
            .iter()
            .filter_map(|r| {
                let o = op.slot(r.rank).and_then(|i| op.ranks.get(i))?;
                if same_clock {
                    if o.completed.is_none() || o.started_node_ns == 0 || o.completed_node_ns < o.started_node_ns {
                        return None;
                    }
                    let start =
                        i64::try_from(o.completed_node_ns.saturating_sub(o.started_node_ns)).ok()?.saturating_neg();
                    let host_gap = if o.enqueued_cluster_ns != 0 {
                        o.enqueued_cluster_ns.saturating_sub(o.started_cluster_ns)
                    } else {
                        0
                    };
                    return Some(RankStart {
                        rank: r.rank,
                        start,
                        enqueued: start.saturating_add(host_gap),
                        epsilon_ns: 0,
                    });
                }
                if o.started_cluster_ns == 0 {
                    return None;
                }
                let c = o.node.map_or(0, |n| self.correction_ns(n));
                let eps = r.node.map_or(u64::MAX / 8, |n| self.epsilon_ns(n));
                Some(RankStart {
                    rank: r.rank,
                    start: o.started_cluster_ns.saturating_sub(c),
                    enqueued: o.enqueued_cluster_ns.saturating_sub(c),
                    epsilon_ns: eps,
                })
            })
            .collect();
        let mut starts: Vec<i64> = per_rank.iter().map(|x| x.start).collect();
        if starts.len() >= 3 {
            starts.sort_unstable();
            let median = starts[starts.len() / 2];
            let eps_max = per_rank.iter().map(|x| x.epsilon_ns).max();
            for &RankStart { rank, start, enqueued, epsilon_ns: eps_a } in &per_rank {
                let bound = self.config.straggler_threshold_ns.max(
                    3u64.saturating_mul(eps_a.min(u64::MAX / 8).saturating_add(eps_max.unwrap_or(0).min(u64::MAX / 8))),
                );
                let lag = start.saturating_sub(median);
                let lagging = lag > i64::try_from(bound).unwrap_or(i64::MAX);
                // Host-side when the rank's own enqueue was already late by most of
                // the lag (the GPU started as soon as the host let it).
                let host = enqueued.saturating_sub(median) > lag / 2;
                let h = self.lag_history.entry(RankKey { comm, rank }).or_default();
                if h.len() >= 5 {
                    h.remove(0);
                }
                h.push(Lag { lagging, host });
                let lagging_count = h.iter().filter(|x| x.lagging).count();
                if lagging && lagging_count >= 3 {
                    let host_count = h.iter().filter(|x| x.lagging && x.host).count();
                    stragglers.insert(
                        rank,
                        VerdictTag::Straggler {
                            lag_ns: lag,
                            bound_ns: bound,
                            host: host_count.saturating_mul(2) >= lagging_count,
                        },
                    );
                }
            }
        }
        stragglers
    }

    /// Observe: what the matcher's maps say about each participant of `op`.
    pub(super) fn observe(&self, op: &OpState, seq: u64, is_coll: bool) -> Vec<RankEvidence> {
        let comm = op.key.comm();
        let mut rs = Vec::with_capacity(op.participants.len());
        for &rank in &op.participants {
            let obs = op.slot(rank).and_then(|i| op.ranks.get(i)).filter(|o| o.present);
            let prog = self.progress.get(&RankKey { comm, rank }).copied();
            // Where the rank lives: its frames, its PROGRESS entry, or (an op none of whose
            // frames arrived) where it spoke from before.
            let node = obs.and_then(|o| o.node).or(prog.and_then(|p| p.node)).or_else(|| self.home_node(comm, rank));
            let direct = obs.is_some_and(|o| o.completed.is_some());
            let by_progress = is_coll && prog.is_some_and(|p| p.last_completed >= seq);
            let by_later = is_coll && self.completed_through.get(&RankKey { comm, rank }).is_some_and(|&c| c > seq);
            // A fused group ran as one kernel: one of its ops completing completes all.
            let by_group = obs.is_some_and(|o| {
                o.group_id != 0
                    && o.node.is_some_and(|n| self.groups_done.contains(&(ProcKey { node: n, pid: o.pid }, o.group_id)))
            });
            let completion = if direct {
                Completion::Direct
            } else if by_progress || by_later || by_group {
                Completion::Inferred
            } else {
                Completion::No
            };
            let entered = completion.done()
                || obs.is_some_and(|o| o.entered.is_some())
                || (is_coll && prog.is_some_and(|p| p.last_enqueued >= seq));
            let started = completion.done()
                || obs.is_some_and(|o| o.started.is_some())
                || (is_coll && prog.is_some_and(|p| p.last_kernel_started >= seq));
            let live = node.and_then(|n| self.nodes.get(&n)).and_then(|n| n.liveness).unwrap_or(LivenessState::Fresh);
            rs.push(RankEvidence {
                rank,
                node,
                entered,
                started,
                completion,
                instrumented: prog.is_some(),
                no_source: prog.is_some_and(|p| p.activation_mask & activation::COMPLETION_SOURCES == 0),
                exited: prog.is_some_and(|p| p.proc_state == ProcState::Exited.code()),
                live,
                progress: prog,
                local_op_seq: obs.map_or(0, |o| o.local_op_seq),
                pid: obs.map_or(0, |o| o.pid),
            });
        }
        rs
    }

    #[allow(clippy::too_many_lines, reason = "the rules read best in one place, in DESIGN's order")]
    pub(super) fn evaluate(&mut self, now: u64, key: OpRef) {
        // Taken out while evaluated (no clone); put back unless final.
        let Some(mut op) = self.ops.remove(&key) else { return };
        op.dirty = false;
        let seq = match key {
            OpRef::Coll { seq, .. } => seq,
            OpRef::P2p { .. } | OpRef::Graph { .. } => 0,
        };
        let comm = key.comm();
        let is_coll = matches!(key, OpRef::Coll { .. });
        let is_graph = matches!(key, OpRef::Graph { .. });
        let kind = match key {
            OpRef::Coll { .. } => OpKind::Collective,
            OpRef::P2p { .. } => OpKind::P2p,
            OpRef::Graph { .. } => OpKind::Graph,
        };
        let mut rs = self.observe(&op, seq, is_coll);
        let any_completed = rs.iter().any(|r| r.completion.done());
        let all_completed = rs.iter().all(|r| r.completion.done());
        if is_coll && strong(op.op) && any_completed {
            for r in &mut rs {
                r.entered = true; // C1
            }
        }
        // A completed recv proves the send entered (participants are [src, dst]).
        if matches!(key, OpRef::P2p { .. })
            && rs.get(1).is_some_and(|d| d.completion.done())
            && let Some(src) = rs.get_mut(0)
        {
            src.entered = true;
        }
        let start = self.clock_start(&op);
        let stuck_at = start.saturating_add(self.stuck_deadline(&op));
        let join_at = start.saturating_add(self.config.join_deadline_ns);
        // Deadlines pass on the participants' watermarks, not on arrival time: a deadline
        // has passed only when every gating node's data up to it is in (so any
        // interleaving of the same records decides the same).
        let rank_nodes: Vec<NodeId> = rs.iter().filter_map(|r| r.node).collect();
        let horizon = rs
            .iter()
            .filter(|r| gates(r.live))
            .map(|r| {
                r.node.and_then(|n| self.nodes.get(&n)).and_then(|v| u64::try_from(v.w_p0_cluster_ns).ok()).unwrap_or(0)
            })
            .min()
            .unwrap_or(now);
        let past_stuck = horizon >= stuck_at;
        let past_join = horizon >= join_at;
        let blocked_root = match key {
            OpRef::Coll { comm, seq } => self.unresolved.get(&comm).copied().filter(|(root, _)| match root {
                OpRef::Coll { seq: r, .. } => *r < seq,
                OpRef::P2p { .. } | OpRef::Graph { .. } => false,
            }),
            OpRef::P2p { .. } | OpRef::Graph { .. } => None,
        };
        let in_gap = rs.iter().any(|r| {
            // A gap of positive length that the op lived through (it was first seen
            // before the gap ended).
            r.node
                .and_then(|n| self.nodes.get(&n))
                .is_some_and(|n| n.knowledge_gaps.iter().any(|&(from, to)| to > from && op.first_seen_ns <= to))
        });

        // Per-rank outcomes (the ladder), then the culprit rules.
        let ctx = OpContext {
            kind,
            seq,
            key_collision: op.key_collision,
            any_completed,
            past_stuck,
            past_join,
            stuck_at,
            join_at,
            in_gap,
            blocked_root: blocked_root.map(|(root, _)| root),
        };
        let mut outcomes: Vec<Outcome> =
            rs.iter().map(|r| classify(r, &ctx, || self.blocked_by(r.node, r.pid, r.local_op_seq, key))).collect();
        let Culprits { decisive, .. } = assign_culprits(&rs, &mut outcomes, &ctx, comm);

        // Decision time and finality. A decision resting on evidence with no frame time of
        // its own (an inference from PROGRESS or a later op, an undecidable rank) is dated
        // when these outcomes were first reached, and keeps that date while they hold: the
        // evidence arrived by then, so once every gating watermark passes that date (+ the
        // reorder timeout) any frame stamped before the evidence is in — a completion frame
        // overtaken by a PROGRESS entry or a later op cannot turn up after finality.
        let same_as_before = op.decided_now_ns != 0
            && rs.iter().zip(&outcomes).all(|(r, o)| {
                op.slot(r.rank)
                    .and_then(|i| op.verdicts.get(i))
                    .and_then(Option::as_ref)
                    .is_some_and(|v| v.outcome == *o)
            });
        let decided_now = if same_as_before { op.decided_now_ns } else { now };
        let last_completion = op
            .observed()
            .filter(|o| o.completed.is_some())
            .map(|o| o.completed_cluster_ns)
            .max()
            .and_then(|t| u64::try_from(t).ok());
        let any_inferred = rs.iter().any(|r| r.completion == Completion::Inferred);
        // The latest frame this op's decision can rest on.
        let latest_frame = op
            .observed()
            .map(|o| o.enqueued_cluster_ns.max(o.started_cluster_ns).max(o.first_cluster_ns))
            .max()
            .and_then(|t| u64::try_from(t).ok())
            .unwrap_or(0);
        // Ranks that will never say more: completed, or undecidable for good. A rank
        // without PROGRESS only when the cluster's size is known and every node's data is
        // in past the decision: otherwise it looks the same as a rank of a node that has
        // not connected yet (CI saw a late node's ranks go final as `uninstrumented`).
        // Not a rank on an unreachable node: under a CPU hog a live node's connection
        // closed, it was unreachable for a moment, and a hung op's verdicts went final as
        // `unknown_silent` for it. Those wait for the stuck deadline.
        // With the cluster's size known, a rank without PROGRESS settles once every node's
        // watermark has passed the decision (see `MatcherConfig::expected_nodes`).
        let expected = usize::try_from(self.config.expected_nodes).unwrap_or(usize::MAX);
        let quiet = |o: &Outcome| expected > 0 && matches!(o, Outcome::Indeterminate(Indeterminate::Uninstrumented));
        let settled_rank = |r: &RankEvidence, o: &Outcome| {
            r.completion.done()
                || quiet(o)
                || matches!(o, Outcome::Indeterminate(Indeterminate::NoCompletionSource | Indeterminate::KeyCollision))
        };
        let every_node_in = || {
            let at = last_completion.map_or(decided_now, |t| t.max(decided_now));
            let need = i64::try_from(at.saturating_add(self.config.reorder_timeout_ns)).unwrap_or(i64::MAX);
            self.nodes.values().filter(|v| v.w_p0_cluster_ns >= need).count() >= expected
        };
        let resolved = !all_completed
            && rs.iter().zip(&outcomes).all(|(r, o)| settled_rank(r, o))
            && (!outcomes.iter().any(quiet) || every_node_in());
        let decided_at = if all_completed && !any_inferred {
            last_completion.map_or(decided_now, |t| t.min(decided_now))
        } else if all_completed || resolved {
            last_completion.map_or(decided_now, |t| t.max(decided_now))
        } else if past_stuck {
            // Never before the latest frame the decision rests on: a rank paused past the
            // deadline that then enqueues and starts k makes every rank "started, waiting"
            // at that moment, and its completion follows milliseconds later — dated at the
            // deadline, the decision was final before that completion could arrive (a
            // checkpoint pause at 1x: `waiting_on(unknown)` final, every later op
            // `blocked_by` it). A state known from PROGRESS alone is dated when reached.
            let progress_only = rs.iter().any(|r| {
                let obs = op.slot(r.rank).and_then(|i| op.ranks.get(i)).filter(|o| o.present);
                (r.entered && obs.is_none_or(|o| o.entered.is_none() && o.started.is_none()))
                    || (r.started && obs.is_none_or(|o| o.started.is_none()))
            });
            if progress_only { decided_now } else { stuck_at.max(latest_frame).min(decided_now) }
        } else if decisive && past_join {
            join_at.min(decided_now)
        } else if let Some((_, root_decided)) = blocked_root {
            // Never before this op's own frames: the root's culprit participates here
            // too, so once its node's watermark passes them, a recovery of the root
            // stamped before them is in (and lifted the block) — an op entered after a
            // paused GPU came back is not called blocked by the pause.
            root_decided.max(latest_frame).min(decided_now)
        } else {
            decided_now
        };
        // Finality waits for an unreachable node until it is presumed dead (its
        // deadlines did not: `horizon` above).
        let gating: Vec<NodeId> =
            rs.iter().filter_map(|r| r.node).filter(|n| gates_finality(self.nodes.get(n), now)).collect();
        let need = i64::try_from(decided_at.saturating_add(self.config.reorder_timeout_ns)).unwrap_or(i64::MAX);
        let settled = |m: &Self| gating.iter().all(|n| m.nodes.get(n).is_some_and(|v| v.w_p0_cluster_ns >= need));
        let terminal = all_completed || outcomes.iter().all(|o| !matches!(o, Outcome::InFlight));
        let is_final = terminal
            && settled(self)
            && (all_completed || resolved || past_stuck || decisive || blocked_root.is_some());

        if all_completed && is_coll {
            self.learn_duration(&op);
        }
        // Stragglers: once per op, when it is final and every rank completed.
        if is_final && all_completed && is_coll && strong(op.op) {
            self.learn_residuals(&op);
        }
        let stragglers = if is_final && all_completed && is_coll { self.stragglers(&op, &rs) } else { BTreeMap::new() };

        // Emit changes.
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
        self.out.extend(events);
        if is_final {
            self.deadlines.remove(&(op.due_ns, key));
            self.stats.ops_final.inc();
            self.remember_final(now, key);
            let stuck: BTreeMap<u32, u64> = rs
                .iter()
                .zip(outcomes.iter())
                .filter(|(_, o)| matches!(o, Outcome::Stuck))
                .map(|(r, _)| (r.rank, now))
                .collect();
            let unresolved = !all_completed
                && outcomes.iter().any(|o| {
                    matches!(o, Outcome::Stuck | Outcome::NotJoined | Outcome::NotJoinedExited | Outcome::WaitingOn(_))
                });
            if unresolved && let OpRef::Coll { comm, .. } = key {
                self.unresolved.entry(comm).or_insert((key, decided_at));
                if let Some(open) = self.open_by_comm.get(&comm) {
                    for &seq in open {
                        mark(&mut self.ops, &mut self.dirty, OpRef::Coll { comm, seq });
                    }
                }
            }
            if !stuck.is_empty() {
                self.final_stuck.insert(key, stuck);
                while self.final_stuck.len() > RECOVERABLE_CAP {
                    self.final_stuck.pop_first();
                    self.stats.final_stuck_evicted.inc();
                }
            }
            let unfinished: BTreeMap<u32, Unfinished> = rs
                .iter()
                .zip(outcomes.iter())
                .filter(|(_, o)| {
                    matches!(
                        o,
                        Outcome::Stuck
                            | Outcome::WaitingOn(_)
                            | Outcome::BlockedBy(_)
                            | Outcome::NotJoined
                            | Outcome::UnknownSilent
                    )
                })
                .map(|(r, o)| {
                    let gpu_uuid = r.progress.map_or([0; 16], |p| p.gpu_uuid);
                    (r.rank, Unfinished { final_at_ns: now, stuck: matches!(o, Outcome::Stuck), gpu_uuid })
                })
                .collect();
            if !unfinished.is_empty() {
                self.recoverable_ranks = self.recoverable_ranks.saturating_add(unfinished.len());
                if let Some(old) = self.recoverable.insert(key, unfinished) {
                    self.recoverable_ranks = self.recoverable_ranks.saturating_sub(old.len());
                }
                while self.recoverable.len() > RECOVERABLE_CAP || self.recoverable_ranks > RECOVERABLE_RANKS_CAP {
                    // Forget the op that became final longest ago — a communicator's
                    // blocking root last (its recovery is what unblocks the communicator).
                    let roots: BTreeSet<OpRef> = self.unresolved.values().map(|r| r.0).collect();
                    let oldest = self
                        .recoverable
                        .iter()
                        .min_by_key(|(k, w)| (roots.contains(k), w.values().map(|u| u.final_at_ns).min().unwrap_or(0)))
                        .map(|(k, _)| *k);
                    let Some(k) = oldest else { break };
                    if let Some(w) = self.recoverable.remove(&k) {
                        self.recoverable_ranks = self.recoverable_ranks.saturating_sub(w.len());
                    }
                    self.stats.recoverable_evicted.inc();
                }
            }
            if let OpRef::Coll { comm, seq } = key
                && let Some(open) = self.open_by_comm.get_mut(&comm)
            {
                open.remove(&seq);
                if open.is_empty() {
                    self.open_by_comm.remove(&comm);
                }
            }
            // The next op's clock starts now.
            if let OpRef::Coll { comm, seq } = key {
                // k + 1 became the oldest unfinished op when k completed, not when the
                // verdict on k became final.
                let e = self.comm_done.entry(comm).or_insert((0, 0));
                if seq > e.0 {
                    *e = (seq, decided_at);
                }
                mark(&mut self.ops, &mut self.dirty, OpRef::Coll { comm, seq: seq.saturating_add(1) });
            }
        } else {
            let mut o = op;
            // A rank known only from PROGRESS (a hung rank often is) still gates: its
            // node's watermark and liveness must wake the op.
            for n in rank_nodes {
                if !o.nodes.contains(&n) {
                    o.nodes.push(n);
                }
            }
            o.verdicts = new_verdicts;
            o.decided_at_ns = decided_at;
            o.decided_now_ns = decided_now;
            // The lowest watermark that could change this evaluation: a deadline not yet
            // passed, or (decided) the finality threshold; a rank settled by every node's
            // watermark (`quiet`) depends on nodes beyond the gating ones: always.
            o.wake_w = if outcomes.iter().any(quiet) {
                i64::MIN
            } else {
                let at = |t: u64| i64::try_from(t).unwrap_or(i64::MAX);
                let mut wake = i64::MAX;
                if !past_stuck {
                    wake = wake.min(at(stuck_at));
                }
                if !past_join {
                    wake = wake.min(at(join_at));
                }
                if terminal {
                    wake = wake.min(need);
                }
                wake
            };
            let due = if past_stuck {
                now.saturating_add(self.config.reorder_timeout_ns)
            } else {
                // The nearest deadline still ahead; one already passed by arrival time but
                // not yet by the watermarks is looked at again shortly (and whenever a
                // watermark of the op's nodes moves) — never at a time already past, which
                // re-inserted the op at `now` on every evaluation and spun the timer
                // (found by the issue 18 overflow test, watermarks held back).
                [stuck_at, join_at]
                    .into_iter()
                    .filter(|&d| d > now)
                    .min()
                    .unwrap_or_else(|| now.saturating_add(WATERMARK_RECHECK_NS.min(self.config.reorder_timeout_ns)))
            };
            if o.due_ns != due {
                self.deadlines.remove(&(o.due_ns, key));
                o.due_ns = 0;
                if due != u64::MAX {
                    self.deadlines.insert((due, key));
                    o.due_ns = due;
                }
            }
            self.ops.insert(key, o);
        }
    }

    pub(super) fn blocked_by(&self, node: Option<NodeId>, pid: u32, local_op_seq: u64, me: OpRef) -> Option<OpRef> {
        let proc_ops = self.rank_ops.get(&ProcKey { node: node?, pid })?;
        proc_ops
            .before(local_op_seq)
            .iter()
            .find(|(op, completed)| {
                !completed && *op != me && (self.ops.contains_key(op) || self.final_stuck.contains_key(op))
            })
            .map(|(op, _)| *op)
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
