//! The matcher's records of ops, ranks, processes and nodes.

use super::*;

#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub(super) struct RankObs {
    /// Whether any frame of this rank for this op arrived.
    pub(super) present: bool,
    pub(super) node: Option<NodeId>,
    pub(super) entered: Option<FrameRef>,
    pub(super) started: Option<FrameRef>,
    pub(super) completed: Option<FrameRef>,
    pub(super) completed_cluster_ns: i64,
    pub(super) first_cluster_ns: i64,
    pub(super) first_node_ns: u64,
    pub(super) last_node_ns: u64,
    pub(super) started_node_ns: u64,
    pub(super) completed_node_ns: u64,
    pub(super) started_cluster_ns: i64,
    pub(super) enqueued_cluster_ns: i64,
    /// Per-channel ends seen (bit per channel < 64), for graph replays.
    pub(super) channels_ended: u64,
    /// Fused group (ncclGroupStart/End) id; 0 = none.
    pub(super) group_id: u64,
    pub(super) n_channels: u16,
    pub(super) local_op_seq: u64,
    pub(super) pid: u32,
    pub(super) op: u8,
    pub(super) dtype: u8,
    pub(super) count: u64,
    pub(super) nranks: u32,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(super) struct RankVerdict {
    pub(super) outcome: Outcome,
    pub(super) tags: Vec<VerdictTag>,
    pub(super) is_final: bool,
    pub(super) revision: u32,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub(super) struct OpState {
    pub(super) key: OpRef,
    /// Aggregator time first seen.
    pub(super) first_seen_ns: u64,
    /// Participants: comm ranks (0..nranks for collectives, {src, dst} for P2P).
    pub(super) participants: Vec<u32>,
    /// Per participant, in `participants` order.
    pub(super) ranks: Vec<RankObs>,
    pub(super) op: u8,
    pub(super) count: u64,
    /// Per participant, in `participants` order.
    pub(super) verdicts: Vec<Option<RankVerdict>>,
    /// Distinct nodes of the participants seen so far (for watermark marking).
    pub(super) nodes: Vec<NodeId>,
    pub(super) decided_at_ns: u64,
    /// Aggregator time when the current outcomes were first reached (0: never decided):
    /// a decision with no frame time of its own is dated then, and stays dated then while
    /// it holds, so its finality can catch up with it.
    pub(super) decided_now_ns: u64,
    pub(super) is_final: bool,
    pub(super) key_collision: bool,
    /// Its entry in `deadlines` (0: none), so an op holds at most one.
    pub(super) due_ns: u64,
    /// It is in the matcher's `dirty` list (at most once).
    pub(super) dirty: bool,
    /// A P0 watermark of one of its nodes below this cannot change its evaluation (see
    /// `evaluate`); a watermark record wakes it only from here on.
    pub(super) wake_w: i64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Default)]
pub(super) struct ProgressView {
    pub(super) node: Option<NodeId>,
    pub(super) pid: u32,
    pub(super) gpu_uuid: [u8; 16],
    pub(super) proc_state: u8,
    pub(super) activation_mask: u32,
    pub(super) last_enqueued: u64,
    pub(super) last_kernel_started: u64,
    pub(super) last_completed: u64,
    pub(super) snapshot_cluster_ns: i64,
    pub(super) received_at_ns: u64,
    /// The node epoch and node time of the heartbeat snapshot it came from: a later
    /// entry replaces it only if it is newer (heartbeats can arrive out of order).
    pub(super) epoch: u64,
    pub(super) snapshot_node_ns: u64,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub(super) struct NodeView {
    pub(super) w_p0_cluster_ns: i64,
    pub(super) epsilon_ns: u64,
    /// Completion residuals of strong collectives (last 32), for clock refinement.
    pub(super) residuals: Vec<i64>,
    /// Their median (the correction) and the 90th percentile of deviations from it,
    /// recomputed when a residual is added.
    pub(super) correction_ns: i64,
    pub(super) residual_spread_ns: u64,
    pub(super) liveness: Option<LivenessState>,
    /// When this node, unreachable, is presumed dead and stops gating finality
    /// (aggregator time; 0: reachable).
    pub(super) dead_at_ns: u64,
    /// `(interval id, from, to)` of P0 losses, node time; the last 256.
    pub(super) p0_losses: Vec<(u64, u64, u64)>,
    pub(super) knowledge_gaps: Vec<(u64, u64)>,
}

/// Hash map with FxHash: fast on the per-frame path, deterministic iteration.
pub(super) type FxMap<K, V> = HashMap<K, V, FxBuildHasher>;
pub(super) type FxSet<K> = HashSet<K, FxBuildHasher>;

/// A rank whose final verdict left it unfinished (stuck, waiting, blocked, not joined):
/// its completion, if it comes, is a recovery.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Unfinished {
    /// Aggregator time the verdict became final.
    pub(super) final_at_ns: u64,
    /// Its verdict was `stuck` (its GPU's degraded evidence).
    pub(super) stuck: bool,
    pub(super) gpu_uuid: [u8; 16],
}

/// A rank of a communicator.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[rkyv(derive(Debug, PartialEq, Eq, Hash))]
pub(super) struct RankKey {
    pub(super) comm: Comm,
    pub(super) rank: u32,
}

/// Final ops remembered for late frames, at most (see `MatcherConfig::final_memory_ns`).
pub(super) const FINAL_MEMORY: usize = 65_536;

/// Where each rank of a communicator spoke from: `(node, pid)`. Dense below
/// [`DENSE_RANKS`] (the participant cap: compact and cache-friendly, a communicator's
/// ranks are looked up together), sparse above — a rank number from the wire costs one
/// entry whatever its value (a dense Vec once let one frame with rank 65,535 allocate
/// 1.5 MiB, issue 18).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct Homes {
    pub(super) dense: Vec<Option<(NodeId, u32)>>,
    pub(super) sparse: BTreeMap<u32, (NodeId, u32)>,
}

/// What [`Homes::claim`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claim {
    /// The rank's home is this one (now, or already).
    Known,
    /// Another process speaks for the rank: two communicators share a key.
    Collision,
    /// A sparse rank past the cap: not remembered (counted).
    Refused,
}

/// Ranks kept in [`Homes`]'s dense part (the participants a collective tracks).
pub(super) const DENSE_RANKS: u32 = 4096;

impl Homes {
    pub(super) fn get(&self, rank: u32) -> Option<(NodeId, u32)> {
        if rank < DENSE_RANKS {
            self.dense.get(usize::try_from(rank).ok()?).copied().flatten()
        } else {
            self.sparse.get(&rank).copied()
        }
    }

    /// Records `home` for `rank` unless one is known; true when a different one is (two
    /// processes speak for one rank: the communicators' keys collide).
    pub(super) fn claim(&mut self, rank: u32, home: (NodeId, u32)) -> Claim {
        if rank >= DENSE_RANKS {
            if let Some(known) = self.sparse.get(&rank) {
                return if *known == home { Claim::Known } else { Claim::Collision };
            }
            if self.sparse.len() >= usize::try_from(DENSE_RANKS).unwrap_or(usize::MAX) {
                return Claim::Refused;
            }
            self.sparse.insert(rank, home);
            return Claim::Known;
        }
        let i = usize::try_from(rank).unwrap_or(0);
        if self.dense.len() <= i {
            self.dense.resize(i.saturating_add(1), None);
        }
        match self.dense.get_mut(i) {
            Some(Some(known)) if *known != home => Claim::Collision,
            Some(Some(_)) | None => Claim::Known,
            Some(slot) => {
                *slot = Some(home);
                Claim::Known
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        self.dense.iter().flatten().count().saturating_add(self.sparse.len())
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &(NodeId, u32)> + '_ {
        self.dense.iter().flatten().chain(self.sparse.values())
    }
}

/// Ops remembered per rank process for `blocked_by` (the oldest are dropped).
pub(super) const RANK_OPS_CAP: usize = 1024;
/// (op code, size bucket) keys of durations kept per communicator, on average, before
/// communicators are forgotten (a communicator runs a few op kinds at a few sizes).
pub(super) const DURATION_KEYS_PER_COMM: usize = 16;
/// Fused groups remembered as done.
pub(super) const GROUPS_CAP: usize = 65_536;
/// How soon an op whose deadline passed by arrival time, but not yet by every gating
/// node's watermark, is evaluated again (the aggregator's timer turns at least this
/// often anyway).
pub(super) const WATERMARK_RECHECK_NS: u64 = 100_000_000;
/// Final ops remembered for recovery (and stuck ops for `blocked_by` across
/// communicators).
pub(super) const RECOVERABLE_CAP: usize = 4096;
/// Unfinished ranks remembered for recovery, over all those ops.
pub(super) const RECOVERABLE_RANKS_CAP: usize = 262_144;

/// A rank process's recent ops, in its own order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub(super) struct ProcOps {
    /// Aggregator time of its last op.
    pub(super) active_ns: u64,
    /// Its last ops' local_op_seqs, ascending (ops arrive almost in order: an append,
    /// rarely an insert), at most 2 × [`RANK_OPS_CAP`] (trimmed to the newest
    /// [`RANK_OPS_CAP`] when past it); searched apart from `ops`, so a lookup touches
    /// 8 bytes an entry.
    pub(super) seqs: Vec<u64>,
    /// The op at the same index, and whether the rank completed it.
    pub(super) ops: Vec<(OpRef, bool)>,
}

impl ProcOps {
    /// Records `op` as the rank's `local_op_seq`-th, completed or not.
    pub(super) fn note(&mut self, local_op_seq: u64, op: OpRef, completed: bool) {
        match self.seqs.last() {
            Some(&last) if last >= local_op_seq => match self.seqs.binary_search(&local_op_seq) {
                Ok(i) => {
                    if let Some(o) = self.ops.get_mut(i) {
                        *o = (op, completed);
                    }
                }
                Err(i) => {
                    self.seqs.insert(i, local_op_seq);
                    self.ops.insert(i, (op, completed));
                }
            },
            _ => {
                self.seqs.push(local_op_seq);
                self.ops.push((op, completed));
            }
        }
        if self.seqs.len() > RANK_OPS_CAP.saturating_mul(2) {
            let drop = self.seqs.len().saturating_sub(RANK_OPS_CAP);
            self.seqs.drain(..drop);
            self.ops.drain(..drop);
        }
    }

    /// Its ops before `local_op_seq` among the newest [`RANK_OPS_CAP`], oldest first.
    pub(super) fn before(&self, local_op_seq: u64) -> &[(OpRef, bool)] {
        let start = self.seqs.len().saturating_sub(RANK_OPS_CAP);
        let end = self.seqs.partition_point(|&s| s < local_op_seq);
        self.ops.get(start..end.max(start)).unwrap_or(&[])
    }

    /// Ops held.
    pub(super) fn len(&self) -> usize {
        self.seqs.len()
    }
}

/// A rank process.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[rkyv(derive(Debug, PartialEq, Eq, Hash))]
pub(super) struct ProcKey {
    pub(super) node: NodeId,
    pub(super) pid: u32,
}

impl OpState {
    pub(super) fn new(key: OpRef, participants: Vec<u32>, op: u8, count: u64) -> Self {
        Self {
            key,
            // Cluster time of the earliest frame (0 while only frames from before clock
            // sync were seen), so no decision depends on arrival order.
            first_seen_ns: 0,
            ranks: vec![RankObs::default(); participants.len()],
            participants,
            op,
            count,
            verdicts: Vec::new(),
            nodes: Vec::new(),
            decided_at_ns: 0,
            decided_now_ns: 0,
            is_final: false,
            key_collision: false,
            due_ns: 0,
            dirty: false,
            wake_w: i64::MIN,
        }
    }

    /// Index of a communicator rank among the participants.
    pub(super) fn slot(&self, rank: u32) -> Option<usize> {
        let i = usize::try_from(rank).ok()?;
        if self.participants.get(i) == Some(&rank) {
            return Some(i);
        }
        self.participants.iter().position(|&p| p == rank)
    }

    pub(super) fn observed(&self) -> impl Iterator<Item = &RankObs> {
        self.ranks.iter().filter(|r| r.present)
    }
}

/// Whether a node's watermark gates deadlines and finality. A `silent` node still does:
/// its connection is open and its data may be queued on either side (under a CPU hog a
/// live node's heartbeats were processed seconds late, and a hung op of its own went
/// final as `unknown_silent` for it). Only an `unreachable` node — connection closed, or
/// unheard for the unreachable timeout — stops gating deadlines; finality it gates until
/// it is presumed dead ([`gates_finality`]).
pub(super) fn gates(live: LivenessState) -> bool {
    live != LivenessState::Unreachable
}

/// Whether a node's watermark gates finality at `now`: every node does, an unreachable
/// one until it is presumed dead (`MatcherConfig::dead_after_ns`) — a partition past the
/// connection's idle timeout makes a live node unreachable, and its spooled frames
/// arrive when it is back.
pub(super) fn gates_finality(view: Option<&NodeView>, now: u64) -> bool {
    view.is_none_or(|v| v.liveness != Some(LivenessState::Unreachable) || v.dead_at_ns > now)
}

pub(super) fn strong(op: u8) -> bool {
    matches!(
        Op::from_code(op),
        Op::AllReduce | Op::AllGather | Op::ReduceScatter | Op::AllToAll | Op::Barrier | Op::AllToAllv
    )
}

/// A map size as a counter increment.
pub(super) fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

pub(super) fn size_bucket(count: u64) -> u8 {
    u8::try_from(64u32.saturating_sub(count.leading_zeros())).unwrap_or(64)
}

/// When a PROGRESS entry was snapshotted, cluster time (arrival time before the node's
/// clock was estimated).
pub(super) fn snapshot_at(p: &ProgressView) -> u64 {
    u64::try_from(p.snapshot_cluster_ns).ok().filter(|&t| t > 0).unwrap_or(p.received_at_ns)
}

/// One instance of a rank's straggler history.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Lag {
    /// It lagged beyond the bound.
    pub(super) lagging: bool,
    /// Host-side: its own enqueue was already late by most of the lag.
    pub(super) host: bool,
}
