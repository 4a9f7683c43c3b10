//! A reference consumer of the scheduler API: lists the nodes, then follows
//! `GET /v1/events` from the list's `as_of.event_id` (list-then-watch), resuming with
//! `Last-Event-ID` after a drop and re-listing after a `gap`, and prints a decision per
//! node whenever it changes — acting on **final** verdicts only, as the README
//! recommends:
//!
//! - `cordon`: the node is `degraded`, or a final verdict says one of its ranks is
//!   `stuck` (a real fault, decided below every participant's watermark). Ranks
//!   `waiting_on` or `blocked_by` another are its victims: their nodes are not cordoned
//!   for it;
//! - `investigate`: the node is `suspect` (a final `not_joined`, or a hang nobody could
//!   be named the culprit of): a person looks before anything is drained;
//! - `investigate telemetry`: the node is `healthy_lossy`, `silent` or `unreachable`,
//!   or its loss rate is in a band of 10 % or more — its telemetry, not its GPUs, is in
//!   question; never a cordon for that alone;
//! - `keep`: healthy.
//!
//! For `cordon` and `investigate` it names the jobs on the node's GPUs (pods, Slurm
//! jobs: the owners the list shows) — the jobs to move or requeue, not just ranks.
//!
//! With `--emit kubectl` or `--emit slurm` it also prints (never runs) the command that
//! would act on a cordon: `kubectl cordon` + `kubectl taint`, or `scontrol update
//! nodename=… state=drain`.
//!
//!     cargo run -p aggregator --example scheduler_hook -- --http 127.0.0.1:8080 [--token-file F] [--emit kubectl|slurm] [--once]
//!
//! `--once`: decide from the list and the events already logged, then exit.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use aggregator::api::client::{self, EventStream};
use aggregator::api::dto::{HealthEventDto, LossRateEventDto, NodesDto, VerdictDto};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Decision {
    Keep,
    InvestigateTelemetry,
    Investigate,
    Cordon,
}

impl Decision {
    const fn name(self) -> &'static str {
        match self {
            Self::Keep => "keep",
            Self::InvestigateTelemetry => "investigate telemetry",
            Self::Investigate => "investigate",
            Self::Cordon => "cordon",
        }
    }
}

/// What the hook knows of one node.
#[derive(Debug, Default)]
struct NodeState {
    health: String,
    /// A final unfinished verdict on one of its ranks (why).
    fault: Option<String>,
    lossy_band: bool,
    decided: Option<Decision>,
    /// The jobs on its GPUs as the last list named them (pods, Slurm jobs).
    jobs: std::collections::BTreeSet<String>,
}

impl NodeState {
    fn decide(&self) -> (Decision, String) {
        if let Some(f) = &self.fault {
            return (Decision::Cordon, f.clone());
        }
        match self.health.as_str() {
            "degraded" => (Decision::Cordon, "node health degraded".into()),
            "suspect" => (
                Decision::Investigate,
                "node health suspect: a hang without a culprit, or a rank that never joined".into(),
            ),
            "healthy_lossy" | "silent" | "unreachable" => {
                (Decision::InvestigateTelemetry, format!("node health {}", self.health))
            }
            _ if self.lossy_band => (Decision::InvestigateTelemetry, "loss rate ≥ 10 %".into()),
            _ => (Decision::Keep, format!("node health {}", self.health)),
        }
    }
}

struct Hook {
    http: SocketAddr,
    auth: Option<String>,
    emit: Option<String>,
    nodes: BTreeMap<String, NodeState>,
    /// Replaying history (`--once`): state is updated, nothing printed.
    quiet: bool,
}

impl Hook {
    fn headers<'a>(&'a self, last: Option<&'a str>) -> Vec<(&'a str, &'a str)> {
        let mut h = Vec::new();
        if let Some(a) = &self.auth {
            h.push(("Authorization", a.as_str()));
        }
        if let Some(l) = last {
            h.push(("Last-Event-ID", l));
        }
        h
    }

    /// Lists the nodes; returns the event id to watch from.
    async fn list(&mut self) -> Result<String, client::ClientError> {
        let (status, body) = client::get_with(self.http, "/v1/nodes", &self.headers(None)).await?;
        if status != 200 {
            return Err(client::ClientError::Status { path: "/v1/nodes".into(), status, body });
        }
        let nodes: NodesDto = serde_json::from_str(&body)
            .map_err(|source| client::ClientError::Json { path: "/v1/nodes".into(), source })?;
        for n in &nodes.nodes {
            let st = self.nodes.entry(n.name.clone()).or_default();
            st.health.clone_from(&n.health);
            st.jobs = n
                .gpus
                .iter()
                .flat_map(|g| &g.owners)
                .filter_map(|o| match (&o.pod_uid, o.slurm_job_id) {
                    (Some(pod), _) => Some(format!("pod {pod}")),
                    (None, Some(job)) => Some(format!("slurm job {job}")),
                    (None, None) => None,
                })
                .collect();
        }
        for name in nodes.nodes.iter().map(|n| n.name.clone()).collect::<Vec<_>>() {
            self.report(&name);
        }
        Ok(nodes.as_of.event_id)
    }

    fn report(&mut self, node: &str) {
        if self.quiet {
            return;
        }
        let Some(st) = self.nodes.get_mut(node) else { return };
        let (d, why) = st.decide();
        if st.decided == Some(d) {
            return;
        }
        st.decided = Some(d);
        println!("{node}: {} ({why})", d.name());
        if d >= Decision::Investigate && !st.jobs.is_empty() {
            let jobs: Vec<&str> = st.jobs.iter().map(String::as_str).collect();
            println!("  jobs on its GPUs: {}", jobs.join(", "));
        }
        if d == Decision::Cordon {
            match self.emit.as_deref() {
                Some("kubectl") => {
                    println!("  kubectl cordon {node}");
                    println!("  kubectl taint nodes {node} ringwatch.io/degraded=true:NoSchedule --overwrite");
                }
                Some("slurm") => println!("  scontrol update nodename={node} state=drain reason=\"ringwatch: {why}\""),
                _ => {}
            }
        }
    }

    fn apply(&mut self, e: &client::SseEvent) {
        match e.event.as_str() {
            "verdict" | "revision" => {
                let Ok(v) = serde_json::from_str::<VerdictDto>(&e.data) else { return };
                let kind = v.outcome.split('(').next().unwrap_or_default();
                // Final verdicts only: an open one may still change.
                if !v.is_final || kind != "stuck" {
                    return;
                }
                let Some(node) = v.node.clone() else { return };
                let st = self.nodes.entry(node.clone()).or_default();
                st.fault = Some(format!("final {} on rank {} of {} {}", v.outcome, v.rank, v.op.kind, v.op.seq));
                self.report(&node);
            }
            "health" => {
                let Ok(h) = serde_json::from_str::<HealthEventDto>(&e.data) else { return };
                if h.gpu_uuid.is_some() {
                    return;
                }
                self.nodes.entry(h.node.clone()).or_default().health = h.health;
                self.report(&h.node);
            }
            "loss_rate" => {
                let Ok(l) = serde_json::from_str::<LossRateEventDto>(&e.data) else { return };
                self.nodes.entry(l.node.clone()).or_default().lossy_band = l.band == "10%_or_more";
                self.report(&l.node);
            }
            _ => {}
        }
    }
}

async fn follow(hook: &mut Hook, once: bool) -> Result<(), client::ClientError> {
    let mut last = hook.list().await?;
    let mut until = None;
    if once {
        // The whole log up to the list (a gap first if part of it is gone).
        let id: aggregator::events::EventId =
            last.parse().map_err(|_| client::ClientError::NotHttp { path: last.clone() })?;
        if id.seq == 0 {
            return Ok(());
        }
        until = Some(id.seq);
        last = aggregator::events::EventId { seq: 0, ..id }.to_string();
        hook.quiet = true;
    }
    // `--once` stops at the list's event id, so it must see that event whatever its kind.
    let path = if once { "/v1/events" } else { "/v1/events?kind=verdict,revision,health,loss_rate&final=true" };
    loop {
        let mut stream = EventStream::open(hook.http, path, &hook.headers(Some(&last))).await?;
        // Until the stream drops: then resume after the last id seen.
        while let Ok(Some(e)) = stream.next().await {
            if let Some(id) = &e.id {
                last.clone_from(id);
            }
            if e.event == "gap" {
                // What was missed is gone: the state is re-listed, and the watch goes on
                // from the list's own event id (older events would be stale).
                eprintln!("gap ({}): re-listing", e.data);
                last = hook.list().await?;
                if until.is_some() {
                    hook.quiet = false;
                    return Ok(());
                }
                break;
            }
            hook.apply(&e);
            let seq = e.id.as_deref().and_then(|i| i.parse::<aggregator::events::EventId>().ok()).map(|i| i.seq);
            if until.is_some_and(|u| seq.is_some_and(|s| s >= u)) {
                // History replayed: decide on the state as listed now.
                hook.quiet = false;
                let _ = hook.list().await?;
                return Ok(());
            }
        }
        if once {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let http = value("--http").unwrap_or_else(|| "127.0.0.1:8080".into());
    let Ok(http) = http.parse::<SocketAddr>() else {
        eprintln!("scheduler_hook: --http {http:?} is not an address");
        return std::process::ExitCode::from(2);
    };
    let auth = match value("--token-file").map(|f| aggregator::api::auth::read_token(std::path::Path::new(&f))) {
        None => None,
        Some(Ok(t)) => Some(format!("Bearer {t}")),
        Some(Err(e)) => {
            eprintln!("scheduler_hook: --token-file {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let emit = value("--emit");
    if emit.as_deref().is_some_and(|e| e != "kubectl" && e != "slurm") {
        eprintln!("scheduler_hook: --emit takes kubectl or slurm");
        return std::process::ExitCode::from(2);
    }
    let mut hook = Hook { http, auth, emit, nodes: BTreeMap::new(), quiet: false };
    match follow(&mut hook, args.iter().any(|a| a == "--once")).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scheduler_hook: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
