//! Finality: an op's deadlines on its gating nodes' watermarks, when its outcomes were
//! decided and whether they are final; then the op leaves the table (`on_final`) or goes
//! back into it with its one deadline and the watermark that wakes it (`rearm`).

use super::classify::{Completion, RankEvidence};
use super::*;

/// An op's deadlines, and whether its gating nodes' watermarks passed them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Deadlines {
    pub(super) stuck_at: u64,
    pub(super) join_at: u64,
    pub(super) past_stuck: bool,
    pub(super) past_join: bool,
}

/// What the finality stage found.
#[derive(Debug, Clone, Copy)]
pub(super) struct Finality {
    /// When these outcomes were first reached (aggregator time), kept while they hold.
    pub(super) decided_now: u64,
    /// The decision's date: the evidence's frame time, or `decided_now`.
    pub(super) decided_at: u64,
    /// The watermark every gating node must pass: `decided_at` + the reorder timeout.
    pub(super) need: i64,
    /// Every rank is past in flight.
    pub(super) terminal: bool,
    pub(super) is_final: bool,
    /// A rank settles only once every node's watermark passed the decision
    /// (`indeterminate(uninstrumented)` with the cluster's size known).
    pub(super) quiet: bool,
}

impl CollectiveMatcher {
    /// Deadlines: the op's stuck and join deadlines, passed only on the watermarks of its
    /// gating nodes (an unreachable node does not hold them back).
    pub(super) fn deadlines_of(&self, op: &OpState, rs: &[RankEvidence], now: u64) -> Deadlines {
        let start = self.clock_start(op);
        let stuck_at = start.saturating_add(self.stuck_deadline(op));
        let join_at = start.saturating_add(self.config.join_deadline_ns);
        // Deadlines pass on the participants' watermarks, not on arrival time: a deadline
        // has passed only when every gating node's data up to it is in (so any
        // interleaving of the same records decides the same).
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
        Deadlines { stuck_at, join_at, past_stuck, past_join }
    }

    /// Finality: when the outcomes were decided (`decided_at`, see the module docs) and
    /// whether every gating node's watermark has passed it by the reorder timeout.
    #[allow(clippy::too_many_arguments, reason = "the stage's inputs, each named")]
    pub(super) fn finality(
        &self,
        now: u64,
        op: &OpState,
        rs: &[RankEvidence],
        outcomes: &[Outcome],
        dl: &Deadlines,
        all_completed: bool,
        decisive: bool,
        blocked_root: Option<(OpRef, u64)>,
    ) -> Finality {
        let Deadlines { stuck_at, join_at, past_stuck, past_join } = *dl;
        // Decision time and finality. A decision resting on evidence with no frame time of
        // its own (an inference from PROGRESS or a later op, an undecidable rank) is dated
        // when these outcomes were first reached, and keeps that date while they hold: the
        // evidence arrived by then, so once every gating watermark passes that date (+ the
        // reorder timeout) any frame stamped before the evidence is in — a completion frame
        // overtaken by a PROGRESS entry or a later op cannot turn up after finality.
        let same_as_before = op.decided_now_ns != 0
            && rs.iter().zip(outcomes).all(|(r, o)| {
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
        // The latest frame this op's decision can rest on — at least the frame that made
        // the op known: an op known only from a seq gap (a later op's frame came first:
        // batches are applied in any order) has no frames of its own yet, and dated at
        // 0 it went final at once, `blocked_by` or `completed_inferred`, before its own
        // batch was applied (a sweep under a CPU hog: 100 wrong final verdicts).
        let latest_frame = op
            .observed()
            .map(|o| o.enqueued_cluster_ns.max(o.started_cluster_ns).max(o.first_cluster_ns))
            .max()
            .and_then(|t| u64::try_from(t).ok())
            .unwrap_or(0)
            .max(op.first_seen_ns);
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
            && rs.iter().zip(outcomes).all(|(r, o)| settled_rank(r, o))
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
        // An inferred completion is never dated before its evidence arrived (PROGRESS, a
        // later op): whatever the branch above, a frame stamped before the inference was
        // reached is in once the gating watermarks pass this date.
        let decided_at = if any_inferred { decided_at.max(decided_now) } else { decided_at };
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
        Finality { decided_now, decided_at, need, terminal, is_final, quiet: outcomes.iter().any(quiet) }
    }

    /// An op that became final: it leaves the table (remembered for late frames); its
    /// unfinished ranks wait for recovery, an unresolved op blocks its communicator's
    /// later ops, and the next op's clock starts.
    pub(super) fn on_final(
        &mut self,
        now: u64,
        op: &OpState,
        rs: &[RankEvidence],
        outcomes: &[Outcome],
        all_completed: bool,
        decided_at: u64,
    ) {
        let key = op.key;
        self.deadlines.remove(&(op.due_ns, key));
        self.stats.ops_final.inc();
        if matches!(key, OpRef::Coll { .. }) {
            self.observe_derived(now, op, outcomes);
        }
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
    }

    /// A collective that became final, into the loss-aware figures: each participant's
    /// timing as its frames gave it (an inferred completion is no timing).
    fn observe_derived(&mut self, now: u64, op: &OpState, outcomes: &[Outcome]) {
        use super::derived::{FinalOp, RankTiming};
        let ranks: Vec<RankTiming> = op
            .ranks
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let inferred = matches!(outcomes.get(i), Some(Outcome::CompletedInferred));
                if !r.present {
                    return RankTiming { inferred, ..RankTiming::default() };
                }
                RankTiming {
                    started_node_ns: if r.started.is_some() { r.started_node_ns } else { 0 },
                    completed_node_ns: if r.completed.is_some() { r.completed_node_ns } else { 0 },
                    started_cluster_ns: r.started_cluster_ns,
                    inferred,
                }
            })
            .collect();
        let dtype = op.observed().map(|r| r.dtype).next().unwrap_or(0);
        self.derived.observe(&FinalOp {
            op: op.op,
            dtype,
            count: op.count,
            nranks: u32::try_from(op.participants.len()).unwrap_or(u32::MAX),
            ranks: &ranks,
            first_seen_ns: op.first_seen_ns,
            final_ns: now,
        });
    }

    /// An op not yet final goes back into the table with its verdicts, the nodes that
    /// can wake it, the lowest watermark that could change its evaluation and its one
    /// deadline.
    pub(super) fn rearm(&mut self, now: u64, mut o: OpState, rs: &[RankEvidence], dl: &Deadlines, fin: &Finality) {
        let key = o.key;
        let Deadlines { stuck_at, join_at, past_stuck, past_join } = *dl;
        let Finality { decided_at, decided_now, need, terminal, quiet, .. } = *fin;
        let rank_nodes = rs.iter().filter_map(|r| r.node);
        // A rank known only from PROGRESS (a hung rank often is) still gates: its
        // node's watermark and liveness must wake the op.
        for n in rank_nodes {
            if !o.nodes.contains(&n) {
                o.nodes.push(n);
            }
        }
        o.decided_at_ns = decided_at;
        o.decided_now_ns = decided_now;
        // The lowest watermark that could change this evaluation: a deadline not yet
        // passed, or (decided) the finality threshold; a rank settled by every node's
        // watermark (`quiet`) depends on nodes beyond the gating ones: always.
        o.wake_w = if quiet {
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
