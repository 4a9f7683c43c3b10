//! The health book: GPU and node health from final verdicts and liveness.

use super::*;

/// Health of a GPU or node.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Health {
    Healthy,
    HealthyLossy,
    Suspect,
    Degraded,
    Silent,
    Unreachable,
}

/// A GPU's latest health evidence (aggregator times; 0: none): what its health is
/// computed from.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct GpuEvidence {
    /// A final `stuck`, or a GPU-side straggler (degraded until `degraded_clear_ns` after).
    pub(super) degraded_at_ns: u64,
    /// A final `not_joined` or hung-without-culprit verdict (suspect).
    pub(super) suspect_at_ns: u64,
    /// A final completion inferred around telemetry loss (healthy, lossy).
    pub(super) lossy_at_ns: u64,
}

impl GpuEvidence {
    pub(super) fn latest(&self) -> u64 {
        self.degraded_at_ns.max(self.suspect_at_ns).max(self.lossy_at_ns)
    }
}

impl CollectiveMatcher {
    /// Health of every GPU seen, `(node, gpu_uuid) → health`, at `now`: a pure function
    /// of the verdicts so far and liveness. `degraded` clears
    /// `MatcherConfig::degraded_clear_ns` after its last evidence.
    #[must_use]
    pub fn health(&self, now: u64) -> BTreeMap<(NodeId, [u8; 16]), Health> {
        let degraded_clear_ns = self.config.degraded_clear_ns;
        let mut out = BTreeMap::new();
        for ((node, rank_uuid), f) in &self.gpu_flags {
            let (degraded_at, suspect_at, lossy_at) = (f.degraded_at_ns, f.suspect_at_ns, f.lossy_at_ns);
            let live = self.nodes.get(node).and_then(|n| n.liveness);
            let h = match live {
                Some(LivenessState::Unreachable) => Health::Unreachable,
                Some(LivenessState::Silent) => Health::Silent,
                _ if degraded_at > 0 && now.saturating_sub(degraded_at) < degraded_clear_ns => Health::Degraded,
                _ if suspect_at > 0 => Health::Suspect,
                _ if lossy_at > 0 => Health::HealthyLossy,
                _ => Health::Healthy,
            };
            out.insert((*node, *rank_uuid), h);
        }
        out
    }

    /// Node health: its worst GPU.
    #[must_use]
    pub fn node_health(&self, now: u64) -> BTreeMap<NodeId, Health> {
        let mut out: BTreeMap<NodeId, Health> = BTreeMap::new();
        for ((node, _), h) in self.health(now) {
            let e = out.entry(node).or_insert(h);
            *e = (*e).max(h);
        }
        for (node, n) in &self.nodes {
            let live = match n.liveness {
                Some(LivenessState::Unreachable) => Health::Unreachable,
                Some(LivenessState::Silent) => Health::Silent,
                _ => Health::Healthy,
            };
            let e = out.entry(*node).or_insert(live);
            *e = (*e).max(live);
        }
        out
    }
}
