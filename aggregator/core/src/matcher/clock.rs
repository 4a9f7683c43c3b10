//! Clock refinement: each node's completion residuals against the median of strong
//! collectives refine its cluster-time correction and uncertainty.

use super::*;

impl CollectiveMatcher {
    /// Cluster-time refinement: in a strong collective every rank finishes at the same
    /// moment (the last step needs everyone), so each node's completion residual against
    /// the median of the nodes is its clock error left over by the heartbeat estimate.
    pub(super) fn learn_residuals(&mut self, op: &OpState) {
        let mut per_node: BTreeMap<NodeId, i64> = BTreeMap::new();
        for o in op.observed().filter(|o| o.completed.is_some() && o.completed_cluster_ns != 0) {
            if let Some(n) = o.node {
                let e = per_node.entry(n).or_insert(o.completed_cluster_ns);
                *e = (*e).min(o.completed_cluster_ns);
            }
        }
        if per_node.len() < 3 {
            return;
        }
        let mut ends: Vec<i64> = per_node.values().copied().collect();
        ends.sort_unstable();
        let median = ends[ends.len() / 2];
        for (n, end) in per_node {
            let v = self.node_view(n);
            if v.residuals.len() >= 32 {
                v.residuals.remove(0);
            }
            v.residuals.push(end.saturating_sub(median));
            let mut r = v.residuals.clone();
            r.sort_unstable();
            v.correction_ns = r.get(r.len() / 2).copied().unwrap_or(0);
            let mut dev: Vec<u64> = v.residuals.iter().map(|x| x.abs_diff(v.correction_ns)).collect();
            dev.sort_unstable();
            v.residual_spread_ns = dev.get(dev.len().saturating_mul(9) / 10).copied().unwrap_or(0);
        }
    }

    /// A node's learned clock correction (median completion residual; 0 before any).
    pub(super) fn correction_ns(&self, node: NodeId) -> i64 {
        self.nodes.get(&node).map_or(0, |v| v.correction_ns)
    }

    /// A node's cluster-time uncertainty: the heartbeat estimate's ε, narrowed by the
    /// residuals' spread once at least 5 strong collectives refined it.
    pub(super) fn epsilon_ns(&self, node: NodeId) -> u64 {
        let Some(v) = self.nodes.get(&node) else { return u64::MAX / 8 };
        if v.residuals.len() < 5 {
            return v.epsilon_ns;
        }
        v.epsilon_ns.min(v.residual_spread_ns.saturating_add(1_000_000))
    }
}
