//! The built-in scenarios, embedded from `loadgen/scenarios/*.toml`.

use crate::scenario::{Scenario, ScenarioError};

/// `(name, TOML)` of every built-in scenario.
pub const BUILTIN: &[(&str, &str)] = &[
    ("seed-case", include_str!("../../scenarios/seed-case.toml")),
    ("counter-case", include_str!("../../scenarios/counter-case.toml")),
    ("late-join", include_str!("../../scenarios/late-join.toml")),
    ("exited-process", include_str!("../../scenarios/exited-process.toml")),
    ("collective-hang", include_str!("../../scenarios/collective-hang.toml")),
    ("dead-node", include_str!("../../scenarios/dead-node.toml")),
    ("gpu-straggler-skew", include_str!("../../scenarios/gpu-straggler-skew.toml")),
    ("host-straggler", include_str!("../../scenarios/host-straggler.toml")),
    ("mismatch", include_str!("../../scenarios/mismatch.toml")),
    ("bulk-heavy-loss", include_str!("../../scenarios/bulk-heavy-loss.toml")),
    ("pipeline-p2p", include_str!("../../scenarios/pipeline-p2p.toml")),
    ("enqueue-only", include_str!("../../scenarios/enqueue-only.toml")),
    ("mixed", include_str!("../../scenarios/mixed.toml")),
    ("demo", include_str!("../../scenarios/demo.toml")),
    ("host-pause", include_str!("../../scenarios/host-pause.toml")),
    ("uninstrumented-rank", include_str!("../../scenarios/uninstrumented-rank.toml")),
    ("epoch-tail", include_str!("../../scenarios/epoch-tail.toml")),
    ("gpu-pause", include_str!("../../scenarios/gpu-pause.toml")),
];

/// The built-in scenario `name`.
pub fn builtin(name: &str) -> Option<Result<Scenario, ScenarioError>> {
    BUILTIN.iter().find(|(n, _)| *n == name).map(|(_, text)| Scenario::parse(text))
}

/// Every built-in scenario, parsed.
pub fn all() -> Result<Vec<Scenario>, ScenarioError> {
    BUILTIN.iter().map(|(_, text)| Scenario::parse(text)).collect()
}
