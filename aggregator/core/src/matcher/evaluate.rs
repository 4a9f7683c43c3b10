//! Evaluation: an op's evidence → per-rank outcomes → culprits → finality → tags →
//! events.

use super::classify::{Completion, Culprits, OpContext, OpKind, RankEvidence, assign_culprits, classify};
use super::finality::Deadlines;
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

    /// One op through the fixed pipeline: observe (+ C1) → deadlines → `classify` per rank
    /// → culprits → finality → durations, residuals, stragglers → tags and emit → on final
    /// (leave the table) or rearm (back in it, woken by a deadline or a watermark).
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
        let dl = self.deadlines_of(&op, &rs, now);
        let Deadlines { stuck_at, join_at, past_stuck, past_join } = dl;
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

        let fin = self.finality(now, &op, &rs, &outcomes, &dl, all_completed, decisive, blocked_root);
        let is_final = fin.is_final;

        if all_completed && is_coll {
            self.learn_duration(&op);
        }
        // Stragglers: once per op, when it is final and every rank completed.
        if is_final && all_completed && is_coll && strong(op.op) {
            self.learn_residuals(&op);
        }
        let stragglers = if is_final && all_completed && is_coll { self.stragglers(&op, &rs) } else { BTreeMap::new() };

        let events = self.emit(now, &mut op, &rs, &outcomes, &fin, &stragglers, in_gap);
        self.out.extend(events);
        if is_final {
            self.on_final(now, &op, &rs, &outcomes, all_completed, fin.decided_at);
        } else {
            self.rearm(now, op, &rs, &dl, &fin);
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
