//! The README's demo table: per node and GPU, the aggregator's health, one line of
//! evidence from its verdicts, and the ground truth beside it — read through the
//! scheduler's resources ([`rows_from_api`]: `/v1/nodes/{node}`, `/v1/gpus/{uuid}`,
//! `/v1/verdicts?gpu=`), as a scheduler would.

use std::collections::BTreeMap;
use std::fmt::Write;

use aggregator::api::client::{self, ClientError};
use aggregator::api::dto::{GpuDetailDto, NodeDetailDto, NodesDto, VerdictDto, VerdictsDto};
use loadgen_sim::GroundTruth;

/// One row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub node: String,
    pub gpu: u32,
    pub health: String,
    pub evidence: String,
    pub truth: String,
    pub truth_why: String,
}

impl Row {
    /// Whether the aggregator's health equals the truth's (`silent` and `unreachable`
    /// are one answer, "no news": see [`crate::score::same_health`]).
    #[must_use]
    pub fn matches(&self) -> bool {
        crate::score::same_health(&self.health, &self.truth)
    }
}

fn evidence(health: &str, mine: &[&VerdictDto], node_liveness: &str, p0_lost: (u64, u64)) -> String {
    let count = |f: &dyn Fn(&VerdictDto) -> bool| mine.iter().filter(|v| f(v)).count();
    let first = |outcome: &str| mine.iter().find(|v| v.outcome.starts_with(outcome) && v.is_final).copied();
    match health {
        "degraded" => first("stuck").map_or_else(
            || "degraded (GPU-side evidence)".to_owned(),
            |v| format!("stuck in {}#{} — {}", short(&v.op.comm), v.op.seq, v.evidence),
        ),
        "healthy_lossy" => {
            let n = count(&|v| v.outcome == "completed_inferred" && v.tags.iter().any(|t| t == "telemetry_loss"));
            let ids: Vec<u64> = mine
                .iter()
                .flat_map(|v| v.loss_intervals.iter().copied())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .take(3)
                .collect();
            let (lost, attempted) = p0_lost;
            if n > 0 {
                format!(
                    "telemetry loss: {lost} of {attempted} P0 frames lost; {n} completions inferred (PROGRESS / later ops), loss intervals {ids:?}"
                )
            } else {
                format!("telemetry loss: {lost} of {attempted} P0 frames lost; no verdict of this GPU needed them")
            }
        }
        "silent" | "unreachable" => {
            let n = count(&|v| v.outcome == "unknown_silent");
            format!("node {node_liveness}: no frames or heartbeats; {n} rank-verdicts unknown_silent, nobody blamed")
        }
        "suspect" => first("waiting_on").map_or_else(
            || "suspect".to_owned(),
            |v| format!("{} in {}#{} — {}", v.outcome, short(&v.op.comm), v.op.seq, v.evidence),
        ),
        _ => {
            let waiting = mine.iter().filter(|v| v.outcome.starts_with("waiting_on") && v.is_final).count();
            let done = count(&|v| v.outcome == "completed" && v.is_final);
            if waiting > 0 {
                format!("{done} ops completed; waits on a culprit elsewhere in {waiting} rank-verdicts (not blamed)")
            } else {
                format!("{done} ops completed")
            }
        }
    }
}

fn short(comm: &str) -> String {
    comm.chars().take(8).collect()
}

/// The rows, one per GPU of the truth.
#[must_use]
pub fn rows(truth: &GroundTruth, nodes: &NodesDto, verdicts: &VerdictsDto) -> Vec<Row> {
    let mut by_gpu: BTreeMap<&str, Vec<&VerdictDto>> = BTreeMap::new();
    for v in &verdicts.verdicts {
        by_gpu.entry(v.gpu_uuid.as_str()).or_default().push(v);
    }
    truth
        .gpus
        .iter()
        .map(|g| {
            let name = aggregator::certs::node_name(g.node);
            let node = nodes.nodes.iter().find(|n| n.name == name);
            let liveness = node.map_or("unreachable", |n| n.liveness.as_str());
            let health = match liveness {
                "silent" | "unreachable" => liveness.to_owned(),
                _ => node
                    .and_then(|n| n.gpus.iter().find(|x| x.gpu_uuid == g.gpu_uuid))
                    .map_or_else(|| "healthy".to_owned(), |x| x.health.clone()),
            };
            let mine = by_gpu.get(g.gpu_uuid.as_str()).cloned().unwrap_or_default();
            Row {
                node: name,
                gpu: g.gpu,
                evidence: evidence(
                    &health,
                    &mine,
                    liveness,
                    node.map_or((0, 0), |n| (n.p0_frames_lost, n.p0_frames_attempted)),
                ),
                health,
                truth: g.health.clone(),
                truth_why: g.why.first().cloned().unwrap_or_default(),
            }
        })
        .collect()
}

/// The rows, one per GPU of the truth, each read through the API at `http`: the node
/// (`/v1/nodes/{node}`: liveness, P0 loss), the GPU (`/v1/gpus/{uuid}`: health) and its
/// verdicts (`/v1/verdicts?gpu=`, every page). A node or GPU the aggregator never heard
/// of reads as unreachable / healthy, as in [`rows`].
///
/// # Errors
/// The API cannot be reached or answers something else than 200 or 404.
pub async fn rows_from_api(http: std::net::SocketAddr, truth: &GroundTruth) -> Result<Vec<Row>, ClientError> {
    async fn get_opt<T: serde::de::DeserializeOwned>(
        http: std::net::SocketAddr,
        path: &str,
    ) -> Result<Option<T>, ClientError> {
        match client::get_json(http, path).await {
            Ok(v) => Ok(Some(v)),
            Err(ClientError::Status { status: 404, .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
    let mut nodes: BTreeMap<String, Option<NodeDetailDto>> = BTreeMap::new();
    let mut out = Vec::new();
    for g in &truth.gpus {
        let name = aggregator::certs::node_name(g.node);
        if !nodes.contains_key(&name) {
            let n = get_opt(http, &format!("/v1/nodes/{name}")).await?;
            nodes.insert(name.clone(), n);
        }
        let node = nodes.get(&name).and_then(Option::as_ref);
        let gpu: Option<GpuDetailDto> = get_opt(http, &format!("/v1/gpus/{}", g.gpu_uuid)).await?;
        let verdicts = client::get_all_verdicts(http, &format!("gpu={}", g.gpu_uuid)).await?;
        let liveness = node.map_or("unreachable", |n| n.node.liveness.as_str());
        let health = match liveness {
            "silent" | "unreachable" => liveness.to_owned(),
            _ => gpu.map_or_else(|| "healthy".to_owned(), |x| x.health),
        };
        let mine: Vec<&VerdictDto> = verdicts.verdicts.iter().collect();
        out.push(Row {
            node: name.clone(),
            gpu: g.gpu,
            evidence: evidence(
                &health,
                &mine,
                liveness,
                node.map_or((0, 0), |n| (n.node.p0_frames_lost, n.node.p0_frames_attempted)),
            ),
            health,
            truth: g.health.clone(),
            truth_why: g.why.first().cloned().unwrap_or_default(),
        });
    }
    Ok(out)
}

/// The table.
#[must_use]
pub fn table(rows: &[Row]) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{:<8} {:>3}  {:<14} {:<14} {:<5}  evidence (ground truth's reason)",
        "node", "gpu", "verdict", "truth", "match"
    );
    for r in rows {
        let why = if r.truth_why.is_empty() { String::new() } else { format!("  ({})", r.truth_why) };
        let _ = writeln!(
            o,
            "{:<8} {:>3}  {:<14} {:<14} {:<5}  {}{why}",
            r.node,
            r.gpu,
            r.health,
            r.truth,
            if r.matches() { "yes" } else { "NO" },
            r.evidence
        );
    }
    o
}
