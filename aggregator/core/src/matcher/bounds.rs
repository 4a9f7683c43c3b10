//! Bounded state: caps, retirement of idle communicators and processes, eviction.

use super::*;

impl CollectiveMatcher {
    /// Its maps, with their sizes and caps (see [`crate::bounds`]).
    #[must_use]
    pub fn map_sizes(&self) -> Vec<crate::MapSize> {
        use crate::MapSize;
        let c = &self.config;
        let comms = c.max_comms;
        let rank_ops: usize = self.rank_ops.values().map(ProcOps::len).sum();
        let homes: usize = self.homes.values().map(Homes::len).sum();
        vec![
            MapSize::new("matcher.ops", self.ops.len(), c.max_ops),
            MapSize::new("matcher.open_by_comm", self.open_by_comm.len(), comms),
            MapSize::new("matcher.deadlines", self.deadlines.len(), c.max_ops),
            MapSize::new("matcher.dirty", self.dirty.len(), c.max_ops.saturating_add(comms)),
            MapSize::new("matcher.nodes", self.nodes.len(), c.max_nodes),
            MapSize::new("matcher.comm_active", self.comm_active.len(), comms),
            MapSize::new("matcher.progress", self.progress.len(), c.max_ranks),
            MapSize::new("matcher.completed_through", self.completed_through.len(), c.max_ranks),
            MapSize::new("matcher.lag_history", self.lag_history.len(), c.max_ranks),
            MapSize::new("matcher.durations", self.durations.len(), comms.saturating_mul(DURATION_KEYS_PER_COMM)),
            MapSize::new("matcher.comm_done", self.comm_done.len(), comms),
            MapSize::new("matcher.seen_through", self.seen_through.len(), comms),
            MapSize::new("matcher.homes", self.homes.len(), comms),
            MapSize::new(
                "matcher.homes_ranks",
                homes,
                comms.saturating_mul(usize::try_from(DENSE_RANKS).unwrap_or(usize::MAX).saturating_mul(2)),
            ),
            MapSize::new("matcher.collided", self.collided.len(), comms),
            MapSize::new("matcher.unresolved", self.unresolved.len(), comms),
            MapSize::new("matcher.rank_ops", self.rank_ops.len(), c.max_procs),
            MapSize::new(
                "matcher.rank_ops_entries",
                rank_ops,
                c.max_procs.saturating_mul(RANK_OPS_CAP.saturating_mul(2)),
            ),
            MapSize::new("matcher.groups_done", self.groups_done.len(), GROUPS_CAP),
            MapSize::new("matcher.final_recent", self.final_recent.len(), FINAL_MEMORY),
            MapSize::new("matcher.final_order", self.final_order.len(), FINAL_MEMORY.saturating_mul(2)),
            MapSize::new("matcher.final_stuck", self.final_stuck.len(), RECOVERABLE_CAP),
            MapSize::new("matcher.recoverable", self.recoverable.len(), RECOVERABLE_CAP),
            MapSize::new("matcher.recoverable_ranks", self.recoverable_ranks, RECOVERABLE_RANKS_CAP),
            MapSize::new("matcher.gpu_flags", self.gpu_flags.len(), c.max_gpus),
            MapSize::new("matcher.dead_due", self.dead_due.len(), c.max_nodes),
        ]
    }

    /// Bounded memory: drops the oldest open op (not `keep`), counted.
    pub(super) fn evict_oldest(&mut self, keep: OpRef) {
        let Some((&oldest, _)) = self.ops.iter().filter(|(k, _)| **k != keep).min_by_key(|(_, o)| o.first_seen_ns)
        else {
            return;
        };
        if let Some(o) = self.ops.remove(&oldest) {
            self.deadlines.remove(&(o.due_ns, oldest));
        }
        if let OpRef::Coll { comm, seq } = oldest
            && let Some(open) = self.open_by_comm.get_mut(&comm)
        {
            open.remove(&seq);
        }
        self.stats.ops_evicted.inc();
    }

    // ---------------------------------------------------------------- bounds

    /// A node's view, created if new; at `max_nodes` an unreachable node (else the one
    /// with the oldest watermark) is forgotten first, counted.
    pub(super) fn node_view(&mut self, node: NodeId) -> &mut NodeView {
        if !self.nodes.contains_key(&node) && self.nodes.len() >= self.config.max_nodes.max(1) {
            let victim = self
                .nodes
                .iter()
                .min_by_key(|(_, v)| (v.liveness != Some(LivenessState::Unreachable), v.w_p0_cluster_ns))
                .map(|(k, _)| *k);
            if let Some(v) = victim {
                if let Some(view) = self.nodes.remove(&v) {
                    self.dead_due.remove(&(view.dead_at_ns, v));
                }
                self.stats.nodes_evicted.inc();
            }
        }
        self.nodes.entry(node).or_default()
    }

    /// Whether a communicator-keyed map is past its cap.
    pub(super) fn over_comm_caps(&self) -> bool {
        let ranks = self.config.max_ranks;
        self.comm_active.len() > self.config.max_comms
            || self.progress.len() > ranks
            || self.completed_through.len() > ranks
            || self.lag_history.len() > ranks
            || self.durations.len() > self.config.max_comms.saturating_mul(DURATION_KEYS_PER_COMM)
    }

    /// Forgets the least recently active eighth of the communicators (at least one),
    /// counted: a map keyed by communicator or rank is past its cap.
    pub(super) fn evict_comms(&mut self) {
        let mut by_age: Vec<(u64, Comm)> = self.comm_active.iter().map(|(c, t)| (*t, *c)).collect();
        by_age.sort_unstable();
        let n = (by_age.len() / 8).max(1);
        let victims: FxSet<Comm> = by_age.into_iter().take(n).map(|(_, c)| c).collect();
        self.stats.comms_evicted = self.stats.comms_evicted.saturating_add(count(victims.len()));
        self.retire_comms(&victims, true);
    }

    /// Forgets everything known about `comms`. `evicting`: also their open ops (a cap,
    /// counted in `ops_evicted`); otherwise they have none open (idle retirement).
    pub(super) fn retire_comms(&mut self, comms: &FxSet<Comm>, evicting: bool) {
        if comms.is_empty() {
            return;
        }
        let gone = |c: &Comm| comms.contains(c);
        let before = self.ops.len();
        let mut dropped = Vec::new();
        self.ops.retain(|k, o| {
            let keep = !gone(&k.comm());
            if !keep {
                dropped.push((o.due_ns, *k));
            }
            keep
        });
        for d in dropped {
            self.deadlines.remove(&d);
        }
        self.dirty.retain(|k| !gone(&k.comm()));
        if evicting {
            let n = before.saturating_sub(self.ops.len());
            self.stats.ops_evicted = self.stats.ops_evicted.saturating_add(count(n));
        }
        self.comm_active.retain(|c, _| !gone(c));
        self.open_by_comm.retain(|c, _| !gone(c));
        self.progress.retain(|k, _| !gone(&k.comm));
        self.completed_through.retain(|k, _| !gone(&k.comm));
        self.lag_history.retain(|k, _| !gone(&k.comm));
        self.durations.retain(|k, _| !gone(&k.0));
        self.comm_done.retain(|c, _| !gone(c));
        self.seen_through.retain(|c, _| !gone(c));
        self.homes.retain(|c, _| !gone(c));
        self.collided.retain(|c| !gone(c));
        self.unresolved.retain(|c, _| !gone(c));
    }

    /// Remembers a final op for late frames: the last `final_memory_ns` of them, at most
    /// [`FINAL_MEMORY`] (oldest forgotten first).
    pub(super) fn remember_final(&mut self, now: u64, key: OpRef) {
        self.final_recent.insert(key);
        self.final_order.push((now, key));
        let cutoff = now.saturating_sub(self.config.final_memory_ns);
        let mut head = self.final_head;
        while let Some(&(at, old)) = self.final_order.get(head) {
            let held = self.final_order.len().saturating_sub(head);
            if held <= FINAL_MEMORY && (now < self.config.final_memory_ns || at >= cutoff) {
                break;
            }
            self.final_recent.remove(&old);
            head = head.saturating_add(1);
        }
        if head > self.final_order.len() / 2 {
            self.final_order.drain(..head);
            head = 0;
        }
        self.final_head = head;
    }

    /// Forgets the least recently active eighth of the rank processes, counted.
    pub(super) fn evict_procs(&mut self) {
        let mut by_age: Vec<(u64, ProcKey)> = self.rank_ops.iter().map(|(k, p)| (p.active_ns, *k)).collect();
        by_age.sort_unstable();
        let n = (by_age.len() / 8).max(1);
        for (_, k) in by_age.into_iter().take(n) {
            self.rank_ops.remove(&k);
            self.stats.procs_evicted.inc();
        }
    }

    /// Forgets the eighth of the GPUs with the oldest health evidence, counted.
    pub(super) fn evict_gpus(&mut self) {
        let mut by_age: Vec<(u64, (NodeId, [u8; 16]))> = self.gpu_flags.iter().map(|(k, f)| (f.latest(), *k)).collect();
        by_age.sort_unstable();
        let n = (by_age.len() / 8).max(1);
        for (_, k) in by_age.into_iter().take(n) {
            self.gpu_flags.remove(&k);
            self.stats.gpus_evicted.inc();
        }
    }

    /// Forgets communicators with no open collective and rank processes idle for
    /// `comm_retention_ns`, counted; next looked at an eighth of that later.
    pub(super) fn sweep(&mut self, now: u64) {
        let retention = self.config.comm_retention_ns;
        self.next_sweep_ns = now.saturating_add((retention / 8).max(1));
        let cutoff = now.saturating_sub(retention);
        if now < retention {
            return;
        }
        let idle: FxSet<Comm> = self
            .comm_active
            .iter()
            .filter(|(c, t)| **t < cutoff && !self.open_by_comm.contains_key(c))
            .map(|(c, _)| *c)
            .collect();
        self.stats.comms_retired = self.stats.comms_retired.saturating_add(count(idle.len()));
        self.retire_comms(&idle, false);
        let before = self.rank_ops.len();
        self.rank_ops.retain(|_, p| p.active_ns >= cutoff);
        let retired = before.saturating_sub(self.rank_ops.len());
        self.stats.procs_retired = self.stats.procs_retired.saturating_add(count(retired));
    }
}
