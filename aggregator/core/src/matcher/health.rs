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

impl CollectiveMatcher {
    /// Health of every GPU seen, `(node, gpu_uuid) → health`, at `now`: a pure function
    /// of the verdicts so far and liveness. `degraded` clears
    /// `MatcherConfig::degraded_clear_ns` after its last evidence.
    #[must_use]
    pub fn health(&self, now: u64) -> BTreeMap<(NodeId, [u8; 16]), Health> {
        let degraded_clear_ns = self.config.degraded_clear_ns;
        let mut out = BTreeMap::new();
        for ((node, rank_uuid), &(degraded_at, suspect_at, lossy_at)) in &self.gpu_flags {
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
