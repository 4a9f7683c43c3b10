//! `GET /v1/events` (issue 24): resume after a disconnect loses nothing; resume from an
//! evicted id or across an aggregator restart gets a `gap`; the bearer token guards the
//! API (and rotates without a restart); heartbeats; bad event queries get 400.
//!
//! Tests are named `net_*`: they run one at a time (nextest group `network-timing`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use aggregator::api::client::{EventStream, SseEvent};
use aggregator::api::dto::{GapEventDto, IngestDto, VerdictDto, VerdictsDto};
use aggregator::events::EventId;
use aggregator::{Aggregator, AggregatorConfig};
use loadgen_sim::{SimOptions, builtin};
use ringwatch_tests::{
    STATE_LIMIT, TempDir, cert_set, get_json, stop, streams_settled, truth, wait_ingest, wait_nodes,
};

fn id(e: &SseEvent) -> EventId {
    e.id.as_deref().expect("every event has an id").parse().expect("an event id")
}

/// Follows `/v1/events` from `after`, reconnecting with `Last-Event-ID` every
/// `reconnect_every` events (0: never), collecting what it gets.
fn follow(
    http: std::net::SocketAddr,
    after: String,
    reconnect_every: usize,
) -> (Arc<Mutex<Vec<SseEvent>>>, tokio::task::JoinHandle<u64>) {
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&got);
    let task = tokio::spawn(async move {
        let mut last = after;
        let mut reconnects = 0u64;
        loop {
            let headers = [("Last-Event-ID", last.as_str())];
            let Ok(mut s) = EventStream::open(http, "/v1/events", &headers).await else { return reconnects };
            let mut n = 0;
            while let Ok(Some(e)) = s.next().await {
                last = e.id.clone().expect("id");
                sink.lock().unwrap().push(e);
                n += 1;
                if reconnect_every > 0 && n == reconnect_every {
                    break;
                }
            }
            // Dropped mid-stream (the connection closes): resume from the last id.
            reconnects += 1;
        }
    });
    (got, task)
}

/// Waits until `got` holds the event `target` (bounded).
async fn wait_for(got: &Mutex<Vec<SseEvent>>, target: EventId, who: &str) {
    let started = Instant::now();
    loop {
        if got.lock().unwrap().last().is_some_and(|e| id(e).seq >= target.seq) {
            return;
        }
        assert!(started.elapsed() < STATE_LIMIT, "{who} did not reach {target} in time");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_events_resumed_after_disconnects_lose_nothing_and_match_the_verdict_list() {
    let dir = TempDir::new("events");
    let s = builtin::builtin("seed-case").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let truth = truth(&s, options);
    let set = cert_set(dir.path(), s.cluster.nodes);
    let mut cfg = loadgen::cluster::aggregator_config(&set, &s, 1.0);
    // Everything of the run stays in the log: this test is about disconnects, not eviction.
    cfg.events.capacity = 1_000_000;
    let agg = Aggregator::start(cfg).await.expect("aggregator starts");
    let http = agg.http_addr;

    // List, then watch from the list's event id (nothing has happened yet: seq 0).
    let listed: IngestDto = get_json(http, "/v1/ingest").await;
    let from = listed.as_of.event_id.clone();
    assert_eq!(from.parse::<EventId>().expect("id").seq, 0, "{from}");
    let (steady, steady_task) = follow(http, from.clone(), 0);
    let (choppy, choppy_task) = follow(http, from, 97);

    let shippers = ringwatch_tests::spawn_sim_shippers(&s, options, &set, agg.quic_addr, Instant::now(), |_, _, _| {});
    wait_nodes(http, "every stream settled", |n| streams_settled(n, &truth, |_| true)).await;
    let decidable = ringwatch_tests::wait_decidable_final(http, &truth).await;
    // The list and the event id it reflects, read together.
    let verdicts = aggregator::api::client::get_all_verdicts(http, "").await.expect("verdicts");
    let target: EventId = verdicts.as_of.event_id.parse().expect("id");
    wait_for(&steady, target, "the steady subscriber").await;
    wait_for(&choppy, target, "the reconnecting subscriber").await;
    check_resources(http, &verdicts).await;
    let _ = stop(shippers).await;
    let ingest: IngestDto = get_json(http, "/v1/ingest").await;
    agg.shutdown();
    let reconnects = choppy_task.await.expect("follower");
    let _ = steady_task.await.expect("follower");

    let upto = |v: &Mutex<Vec<SseEvent>>| -> Vec<SseEvent> {
        v.lock().unwrap().iter().filter(|e| id(e).seq <= target.seq).cloned().collect()
    };
    let (steady, choppy) = (upto(&steady), upto(&choppy));
    // The steady subscriber got every event once, in order: seqs 1..=target.
    let seqs: Vec<u64> = steady.iter().map(|e| id(e).seq).collect();
    assert_eq!(seqs, (1..=target.seq).collect::<Vec<_>>(), "contiguous, no gap, no repeat");
    assert!(steady.iter().all(|e| e.event != "gap"));
    // The one that disconnected every 97 events got exactly the same.
    assert!(reconnects >= 10, "{reconnects} reconnects");
    assert_eq!(choppy.len(), steady.len(), "{reconnects} reconnects");
    for (a, b) in steady.iter().zip(&choppy) {
        assert_eq!(a, b, "the same event under the same id");
    }
    println!("{} events, {reconnects} resumes, log {:?}", steady.len(), ingest.events);

    // Events and state agree: the last verdict or revision event of each (op, rank) is
    // the listed verdict, for every final one.
    let mut latest: BTreeMap<(String, u64, u32), VerdictDto> = BTreeMap::new();
    let mut kinds: BTreeMap<String, u64> = BTreeMap::new();
    for e in &steady {
        *kinds.entry(e.event.clone()).or_default() += 1;
        if e.event == "verdict" || e.event == "revision" {
            let v: VerdictDto = serde_json::from_str(&e.data).expect("a verdict");
            assert_eq!(e.event == "revision", v.revision > 0, "{v:?}");
            latest.insert((v.op.comm.clone(), v.op.seq, v.rank), v);
        }
    }
    let mut checked = 0;
    for v in verdicts.verdicts.iter().filter(|v| v.is_final) {
        let e = latest.get(&(v.op.comm.clone(), v.op.seq, v.rank)).unwrap_or_else(|| panic!("no event for {v:?}"));
        assert_eq!((&e.outcome, e.is_final), (&v.outcome, true), "{v:?}");
        // A compacted op keeps one revision for all its ranks (the highest).
        assert!(e.revision == v.revision || (v.compacted && e.revision <= v.revision), "{e:?} {v:?}");
        checked += 1;
    }
    assert!(checked as u64 >= decidable, "{checked} of {decidable}");
    println!("{checked} final verdicts match their last event; kinds {kinds:?}");
    // Node 3's P0 overflow: a P0 loss event and its health turning healthy_lossy.
    let node3 = aggregator::certs::node_name(3);
    let has = |kind: &str, needle: &str| {
        steady
            .iter()
            .any(|e| e.event == kind && e.data.contains(&format!("\"node\":\"{node3}\"")) && e.data.contains(needle))
    };
    assert!(has("p0_loss", "frames_lost"), "{kinds:?}");
    assert!(has("health", "\"health\":\"healthy_lossy\""), "{kinds:?}");
    assert!(has("liveness", "\"connected\":true"), "{kinds:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_events_resumed_from_an_evicted_id_or_across_a_restart_get_a_gap() {
    let dir = TempDir::new("events-gap");
    let s = builtin::builtin("seed-case").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let mut cfg: AggregatorConfig = loadgen::cluster::aggregator_config(&set, &s, 1.0);
    cfg.events.capacity = 64;
    cfg.snapshot_path = Some(dir.path().join("core.snap"));
    let agg = Aggregator::start(cfg.clone()).await.expect("aggregator starts");
    let http = agg.http_addr;
    let shippers = ringwatch_tests::spawn_sim_shippers(&s, options, &set, agg.quic_addr, Instant::now(), |_, _, _| {});

    // A subscriber takes its first event, then goes away while the log moves on.
    let mut first = EventStream::open(http, "/v1/events?after=", &[]).await.err();
    assert!(matches!(first.take(), Some(aggregator::api::client::ClientError::Status { status: 400, .. })));
    let listed: IngestDto = get_json(http, "/v1/ingest").await;
    let mut sub =
        EventStream::open(http, &format!("/v1/events?after={}", listed.as_of.event_id), &[]).await.expect("open");
    let seen = sub.next().await.expect("read").expect("an event");
    let seen_id = id(&seen);
    drop(sub);
    let ingest =
        wait_ingest(http, "the log evicted past the subscriber", |i| i.events.evicted > seen_id.seq + 100).await;
    assert_eq!(ingest.events.capacity, 64);
    assert!(ingest.events.held <= 64, "{:?}", ingest.events);
    let mut back =
        EventStream::open(http, "/v1/events", &[("Last-Event-ID", &seen_id.to_string())]).await.expect("resume");
    let gap = back.next().await.expect("read").expect("an event");
    assert_eq!(gap.event, "gap", "{gap:?}");
    let g: GapEventDto = serde_json::from_str(&gap.data).expect("gap body");
    let to: EventId = g.to_id.parse().expect("id");
    assert_eq!((g.from_id.as_str(), g.reason.as_str()), (seen_id.to_string().as_str(), "evicted"), "{g:?}");
    assert_eq!(g.missed, Some(to.seq - seen_id.seq), "{g:?}");
    assert_eq!(gap.id.as_deref(), Some(g.to_id.as_str()), "resuming after the gap continues after it");
    let next = back.next().await.expect("read").expect("an event");
    assert_eq!(id(&next).seq, to.seq + 1, "the stream goes on right after the gap: {next:?}");
    drop(back);

    // Restart from the snapshot: an id of the previous process gets a gap, whatever its
    // sequence number (the new one counts from 1 again).
    let last: IngestDto = get_json(http, "/v1/ingest").await;
    let old: EventId = last.events.last_id.parse().expect("id");
    let _ = stop(shippers).await;
    assert!(agg.shutdown_with_snapshot().await, "final snapshot");
    drop(agg);
    let agg = Aggregator::start(cfg).await.expect("restarts");
    let http = agg.http_addr;
    let mut after = EventStream::open(http, "/v1/events", &[("Last-Event-ID", &old.to_string())]).await.expect("open");
    let gap = after.next().await.expect("read").expect("an event");
    assert_eq!(gap.event, "gap", "{gap:?}");
    let g: GapEventDto = serde_json::from_str(&gap.data).expect("gap body");
    let to: EventId = g.to_id.parse().expect("id");
    assert_eq!((g.reason.as_str(), g.missed), ("other_instance", None), "{g:?}");
    assert_eq!(to.epoch, old.epoch + 1, "the restart's epoch: {g:?}");
    assert_ne!(to.instance, old.instance);
    // The restored nodes' state is announced in the new process (first sight: no
    // `previous`), right after the gap.
    let first_new = after.next().await.expect("read").expect("an event");
    assert_eq!(id(&first_new), EventId { seq: to.seq + 1, ..to }, "{first_new:?}");
    agg.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_api_token_rotates_without_restart_and_event_queries_are_checked() {
    use aggregator::api::client::get_with;
    let dir = TempDir::new("token");
    let set = cert_set(dir.path(), 1);
    let token = dir.path().join("token");
    std::fs::write(&token, "first-token\n").expect("write");
    let mut cfg = AggregatorConfig::local(&set);
    cfg.api_token_file = Some(token.clone());
    cfg.events.heartbeat_ms = 100;
    let agg = Aggregator::start(cfg).await.expect("aggregator starts");
    let http = agg.http_addr;
    let bearer = |t: &str| format!("Bearer {t}");

    for path in ["/v1/nodes", "/v1/verdicts", "/v1/ingest", "/v1/events", "/v1/nowhere"] {
        let (code, body) = get_with(http, path, &[]).await.expect("answer");
        assert_eq!(code, 401, "{path}: {body}");
        assert!(body.contains("bearer token"), "{body}");
        let (code, _) = get_with(http, path, &[("Authorization", &bearer("wrong"))]).await.expect("answer");
        assert_eq!(code, 401, "{path} with a wrong token");
    }
    for path in ["/healthz", "/readyz"] {
        let (code, body) = get_with(http, path, &[]).await.expect("answer");
        assert_eq!(code, 200, "{path} is exempt: {body}");
    }
    let (code, body) = get_with(http, "/v1/nodes", &[("Authorization", &bearer("first-token"))]).await.expect("answer");
    assert_eq!(code, 200, "{body}");

    // Rotation: the new token file replaces the old one (by rename, as a Secret volume
    // does); the old token stops working, the new one works, no restart.
    std::fs::write(dir.path().join("token.new"), "second-token").expect("write");
    std::fs::rename(dir.path().join("token.new"), &token).expect("rename");
    let started = Instant::now();
    loop {
        let (old, _) = get_with(http, "/v1/nodes", &[("Authorization", &bearer("first-token"))]).await.expect("answer");
        let (new, _) =
            get_with(http, "/v1/nodes", &[("Authorization", &bearer("second-token"))]).await.expect("answer");
        if (old, new) == (401, 200) {
            break;
        }
        assert!(started.elapsed() < STATE_LIMIT, "rotation not in force: old {old} new {new}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let auth = bearer("second-token");
    let with = [("Authorization", auth.as_str())];
    let (code, body) = get_with(http, "/v1/ingest", &with).await.expect("answer");
    assert_eq!(code, 200);
    let ingest: IngestDto = serde_json::from_str(&body).expect("ingest");
    assert!(ingest.http.unauthorized >= 11 && ingest.http.token_rotations == 1, "{:?}", ingest.http);

    // Bad event queries get 400 with a reason; an id of this process ahead of it too.
    let ahead = format!("{}.999999@{}", ingest.aggregator_epoch, ingest.events.last_id.rsplit('@').next().unwrap());
    for (query, says) in [
        ("kind=verdict,bogus", "bogus\\\": expected a comma-separated list"),
        ("final=maybe", "final="),
        ("after=12", "<epoch>.<seq>@<instance>"),
        (&format!("after={ahead}"), "ahead of this stream"),
        ("since=0", "unknown query parameter"),
    ] {
        let (code, body) = get_with(http, &format!("/v1/events?{query}"), &with).await.expect("answer");
        assert_eq!(code, 400, "{query}: {body}");
        assert!(body.contains(says), "{query}: {body}");
    }

    // Every documented path is served (none falls to the router's "no route").
    let (code, doc) = get_with(http, "/openapi.json", &with).await.expect("answer");
    assert_eq!(code, 200);
    let doc: serde_json::Value = serde_json::from_str(&doc).expect("OpenAPI JSON");
    assert_eq!(doc["openapi"].as_str().map(|v| v.starts_with("3.")), Some(true));
    for path in doc["paths"].as_object().expect("paths").keys() {
        let concrete = path.replace("{node}", "nope").replace("{uuid}", &"0f".repeat(16)).replace("{id}", "c.1.2.3.4");
        if concrete == "/v1/events" {
            continue; // a stream: opened above and below
        }
        let (code, body) = get_with(http, &concrete, &with).await.expect("answer");
        assert!(!body.contains("no route for"), "{path} → {concrete}: {code} {body}");
        assert!([200, 404].contains(&code), "{concrete}: {code} {body}");
    }

    // `until=` ends the stream once past it (here: the newest id, before any event).
    let mut upto =
        EventStream::open(http, &format!("/v1/events?until={}", ingest.events.last_id), &with).await.expect("open");
    let ended = tokio::time::timeout(std::time::Duration::from_secs(30), upto.next()).await;
    assert!(matches!(ended, Ok(Ok(None))), "the stream ends: {ended:?}");

    // A quiet stream carries heartbeat comments (every 100 ms here).
    let mut quiet = EventStream::open(http, "/v1/events?kind=verdict", &with).await.expect("open");
    let waited = tokio::time::timeout(std::time::Duration::from_millis(1500), quiet.next()).await;
    assert!(waited.is_err(), "no event on a quiet stream: {waited:?}");
    assert!(quiet.comments >= 2, "{} heartbeats", quiet.comments);
    agg.shutdown();
}

/// The resources agree with the verdict list and the node list of the same settled run.
async fn check_resources(http: std::net::SocketAddr, verdicts: &VerdictsDto) {
    use aggregator::api::dto::{
        CollectiveDto, CollectivesDto, GpuDetailDto, LossDto, NodeDetailDto, NodesDto, SummaryDto,
    };
    use ringwatch_tests::http_get;
    let nodes: NodesDto = get_json(http, "/v1/nodes").await;
    let node3 = aggregator::certs::node_name(3);

    // Summary: every node counted by health; every held verdict by outcome.
    let sum: SummaryDto = get_json(http, "/v1/summary").await;
    assert_eq!(sum.nodes, 8, "{sum:?}");
    assert_eq!(sum.nodes_by_health.values().sum::<u64>(), 8, "{sum:?}");
    assert_eq!(sum.nodes_by_health.get("healthy_lossy"), Some(&1), "{sum:?}");
    assert!(sum.counts_complete);
    let held: u64 = sum.verdicts_by_outcome.values().sum();
    assert!(held >= verdicts.verdicts.len() as u64, "{held} {}", verdicts.verdicts.len());
    assert_eq!(sum.recently_degraded_or_lossy, vec![node3.clone()], "{sum:?}");
    assert!(!sum.correlated_degradation, "1 of 8 nodes is under the 25 % share: {sum:?}");
    assert!(!sum.aggregator_saturated, "{sum:?}");
    assert!(!sum.as_of.event_id.is_empty());

    // One node: the same as in the list, its P0 loss by cause, its latest verdicts.
    let one: NodeDetailDto = get_json(http, &format!("/v1/nodes/{node3}")).await;
    let listed = nodes.nodes.iter().find(|n| n.name == node3).expect("listed");
    assert_eq!((&one.node.name, &one.node.health, &one.node.gpus), (&listed.name, &listed.health, &listed.gpus));
    let by_id: NodeDetailDto = get_json(http, &format!("/v1/nodes/{}", listed.node_id)).await;
    assert_eq!(by_id.node.name, node3, "a node by its id");
    let p0 = one.loss.iter().find(|l| l.class == "p0").expect("a p0 row");
    assert!(p0.lost_total > 0 && p0.lost_share > 0.0 && p0.lost_share < 1.0, "{p0:?}");
    assert_eq!(p0.lost_total, listed.streams.iter().filter(|s| s.class == "p0").map(|s| s.lost_total).sum::<u64>());
    assert!(
        !one.recent_verdicts.is_empty()
            && one.recent_verdicts.iter().all(|v| v.node.as_deref() == Some(node3.as_str()))
    );

    // One GPU of it.
    let gpu = listed.gpus.iter().find(|g| g.gpu_uuid.bytes().any(|b| b != b'0')).expect("a GPU with a uuid");
    let uuid = &gpu.gpu_uuid;
    let g: GpuDetailDto = get_json(http, &format!("/v1/gpus/{}", uuid.to_uppercase())).await;
    assert_eq!((&g.node, &g.gpu_uuid, &g.health), (&node3, uuid, &gpu.health));
    assert!(g.recent_verdicts.iter().all(|v| v.gpu_uuid == *uuid));

    // Collectives, paged 37 at a time: every op of the verdict list once, each one's
    // ranks and outcomes as listed.
    let mut by_op: BTreeMap<(String, u64), Vec<&VerdictDto>> = BTreeMap::new();
    for v in &verdicts.verdicts {
        by_op.entry((v.op.comm.clone(), v.op.seq)).or_default().push(v);
    }
    let (mut seen, mut cursor, mut pages) = (Vec::new(), String::new(), 0);
    loop {
        let q = if cursor.is_empty() { String::new() } else { format!("&cursor={cursor}") };
        let page: CollectivesDto = get_json(http, &format!("/v1/collectives?limit=37{q}")).await;
        pages += 1;
        seen.extend(page.collectives);
        match page.next_cursor {
            Some(c) => cursor = c,
            None => break,
        }
    }
    assert!(pages > 2, "{pages} pages");
    assert_eq!(seen.len(), by_op.len(), "every op once");
    for c in &seen {
        let ranks = by_op.get(&(c.op.comm.clone(), c.op.seq)).expect("listed op");
        assert_eq!(c.ranks, ranks.len() as u64, "{c:?}");
        assert_eq!(c.outcomes.values().sum::<u64>(), c.ranks);
        assert_eq!(c.state == "final", ranks.iter().all(|v| v.is_final), "{c:?}");
    }
    for c in seen.iter().step_by(seen.len() / 10 + 1) {
        let one: CollectiveDto = get_json(http, &format!("/v1/collectives/{}", c.id)).await;
        let listed = by_op.get(&(c.op.comm.clone(), c.op.seq)).expect("listed op");
        let got: Vec<(u32, &str)> = one.verdicts.iter().map(|v| (v.rank, v.outcome.as_str())).collect();
        let want: Vec<(u32, &str)> = listed.iter().map(|v| (v.rank, v.outcome.as_str())).collect();
        assert_eq!(got, want, "{}", c.id);
    }
    // Filters: a node's collectives each have a rank there; open and final split them.
    let on3: CollectivesDto = get_json(http, &format!("/v1/collectives?node={node3}&limit=10000")).await;
    let want3 = by_op.values().filter(|rs| rs.iter().any(|v| v.node.as_deref() == Some(node3.as_str()))).count();
    assert_eq!(on3.collectives.len(), want3);
    let fin: CollectivesDto = get_json(http, "/v1/collectives?state=final&limit=10000").await;
    let open: CollectivesDto = get_json(http, "/v1/collectives?state=open&limit=10000").await;
    assert_eq!(fin.collectives.len() + open.collectives.len(), seen.len());
    let comm = &seen[0].op.comm;
    let of_comm: CollectivesDto = get_json(http, &format!("/v1/collectives?comm={comm}&limit=10000")).await;
    assert!(!of_comm.collectives.is_empty() && of_comm.collectives.iter().all(|c| &c.op.comm == comm));

    // Loss: node 3's P0 rows add up to its node answer.
    let loss: LossDto = get_json(http, &format!("/v1/loss?node={node3}&class=p0")).await;
    assert!(loss.streams.iter().all(|s| s.node == node3 && s.class == "p0"));
    assert_eq!(loss.streams.iter().map(|s| s.lost_total).sum::<u64>(), p0.lost_total);
    let causes: LossDto = get_json(http, "/v1/loss?cause=kernel_ring_full").await;
    assert!(causes.streams.iter().all(|s| s.lost.contains_key("kernel_ring_full")) && !causes.streams.is_empty());

    // Not found, and bad ids and queries, each with a reason.
    for (path, code) in [
        ("/v1/nodes/nope", 404),
        ("/v1/gpus/00000000000000000000000000000000", 404),
        ("/v1/gpus/0000000000000000000000000000000f", 404),
        ("/v1/gpus/xyz", 400),
        ("/v1/collectives/c.1.2.3.4", 404),
        ("/v1/collectives/zz", 400),
        ("/v1/collectives?state=done", 400),
        ("/v1/collectives?limit=0", 400),
        ("/v1/collectives?from_ms=soon", 400),
        ("/v1/collectives?cursor=zz", 400),
        ("/v1/loss?class=p9", 400),
        ("/v1/loss?cause=gremlins", 400),
        ("/v1/summary?x=1", 400),
    ] {
        let (got, body) = http_get(http, path).await;
        assert_eq!(got, code, "{path}: {body}");
        assert!(body.contains("\"error\""), "{path}: {body}");
    }
}

/// `GET path` over TLS, trusting `ca`, presenting `client` (certificate, key) if given.
async fn tls_get(
    addr: std::net::SocketAddr,
    ca: &std::path::Path,
    client: Option<(&std::path::Path, &std::path::Path)>,
    path: &str,
) -> Result<(u16, String), String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).map_err(|e| e.to_string())? {
        roots.add(c.map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    }
    let b = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let cfg = match client {
        Some((cert, key)) => {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                .map_err(|e| e.to_string())?
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())?;
            b.with_client_auth_cert(certs, PrivateKeyDer::from_pem_file(key).map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?
        }
        None => b.with_no_client_auth(),
    };
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
    let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp).await.map_err(|e| e.to_string())?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    // A peer that ends without close_notify still gave its answer: keep what was read.
    if let Err(e) = s.read_to_end(&mut raw).await
        && raw.is_empty()
    {
        return Err(e.to_string());
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or(format!("not HTTP: {text:?}"))?;
    Ok((status, text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_the_api_over_tls_and_with_client_certificates() {
    let dir = TempDir::new("http-tls");
    let set = cert_set(dir.path(), 1);
    // TLS alone: any client that trusts the CA; plain HTTP gets no answer.
    let mut cfg = AggregatorConfig::local(&set);
    cfg.http_tls =
        Some(aggregator::HttpTls { cert: set.server_cert.clone(), key: set.server_key.clone(), client_ca: None });
    let agg = Aggregator::start(cfg.clone()).await.expect("aggregator starts");
    let (code, body) = tls_get(agg.http_addr, &set.ca, None, "/healthz").await.expect("TLS answer");
    assert_eq!(code, 200, "{body}");
    let plain = aggregator::api::client::get(agg.http_addr, "/healthz").await;
    assert!(!matches!(plain, Ok((200, _))), "plain HTTP on the TLS port: {plain:?}");
    agg.shutdown();

    // mTLS: a client certificate the CA signed is needed.
    cfg.http_tls = Some(aggregator::HttpTls {
        cert: set.server_cert.clone(),
        key: set.server_key.clone(),
        client_ca: Some(set.ca.clone()),
    });
    let agg = Aggregator::start(cfg).await.expect("aggregator starts");
    let node = aggregator::certs::node_name(0);
    let (cert, key) = (dir.path().join(format!("{node}.pem")), dir.path().join(format!("{node}.key")));
    let (code, body) = tls_get(agg.http_addr, &set.ca, Some((&cert, &key)), "/v1/ingest").await.expect("mTLS answer");
    assert_eq!(code, 200, "{body}");
    let refused = tls_get(agg.http_addr, &set.ca, None, "/v1/ingest").await;
    assert!(refused.is_err(), "no client certificate: {refused:?}");
    let (_, body) = tls_get(agg.http_addr, &set.ca, Some((&cert, &key)), "/v1/ingest").await.expect("mTLS answer");
    let json = body.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    let ingest: IngestDto = serde_json::from_str(json).expect("ingest JSON");
    assert!(ingest.http.tls_handshake_failures >= 1, "{:?}", ingest.http);
    agg.shutdown();
}

/// A directory of TLS files updated the way a Kubernetes Secret volume is: every file is
/// a symlink through `..data`, which is swapped in one rename to a new directory holding
/// the whole new set (so a reader never sees half a rotation).
struct Projected {
    dir: std::path::PathBuf,
    generation: u32,
}

impl Projected {
    /// `ca.pem`, `cert.pem` and `key.pem` in `dir`, from `files` (same order).
    fn new(dir: std::path::PathBuf, files: [&std::path::Path; 3]) -> Self {
        std::fs::create_dir_all(&dir).expect("projected dir");
        let mut p = Self { dir, generation: 0 };
        p.rotate(files);
        for name in Self::NAMES {
            std::os::unix::fs::symlink(format!("..data/{name}"), p.dir.join(name)).expect("file symlink");
        }
        p
    }

    const NAMES: [&'static str; 3] = ["ca.pem", "cert.pem", "key.pem"];

    fn paths(&self) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
        (self.dir.join("ca.pem"), self.dir.join("cert.pem"), self.dir.join("key.pem"))
    }

    /// The whole set replaced at once.
    fn rotate(&mut self, files: [&std::path::Path; 3]) {
        self.generation += 1;
        let data = format!("..gen-{}", self.generation);
        std::fs::create_dir_all(self.dir.join(&data)).expect("generation dir");
        for (name, from) in Self::NAMES.iter().zip(files) {
            std::fs::copy(from, self.dir.join(&data).join(name)).expect("copy a TLS file");
        }
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&data, &tmp).expect("data symlink");
        std::fs::rename(&tmp, self.dir.join("..data")).expect("swap ..data");
    }
}

/// `GET path` over TLS (trusting `ca`) until `done` holds on its JSON (at most
/// [`STATE_LIMIT`]).
async fn tls_wait<T: serde::de::DeserializeOwned + std::fmt::Debug>(
    addr: std::net::SocketAddr,
    ca: &std::path::Path,
    path: &str,
    what: &str,
    done: impl Fn(&T) -> bool,
) -> T {
    let start = Instant::now();
    let mut last = None;
    while start.elapsed() < STATE_LIMIT {
        if let Ok((200, text)) = tls_get(addr, ca, None, path).await
            && let Some((_, body)) = text.split_once("\r\n\r\n")
            && let Ok(v) = serde_json::from_str::<T>(body)
        {
            if done(&v) {
                println!("{what}: after {} ms", start.elapsed().as_millis());
                return v;
            }
            last = Some(v);
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("{what}: not reached in {STATE_LIMIT:?}; last answer {last:?}");
}

/// The value of one sample line of a Prometheus text page (`name{labels}`).
fn sample(page: &str, series: &str) -> Option<f64> {
    page.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Certificate rotation (issue 27): both binaries look at their TLS files and use a
/// rotated set for new connections, with no restart; a connection already up stays; a
/// set that does not load leaves the one in force and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_rotated_certificates_are_used_for_new_connections_without_a_restart() {
    use aggregator::api::dto::NodesDto;
    let dir = TempDir::new("rotate");
    let names = [aggregator::certs::node_name(0), aggregator::certs::node_name(1)];
    let a = aggregator::certs::init(&dir.path().join("a"), &names).expect("set a");
    let b = aggregator::certs::init(&dir.path().join("b"), &names).expect("set b");
    let both = dir.path().join("both-ca.pem");
    let pem = |p: &std::path::Path| std::fs::read_to_string(p).expect("read a CA");
    std::fs::write(&both, pem(&a.ca) + &pem(&b.ca)).expect("CA bundle");

    // The aggregator on set A, its API over TLS on the same files, looking every 50 ms.
    let mut agg_files = Projected::new(dir.path().join("agg"), [&a.ca, &a.server_cert, &a.server_key]);
    let (agg_ca, agg_cert, agg_key) = agg_files.paths();
    let mut cfg = AggregatorConfig::local(&a);
    (cfg.ca, cfg.cert, cfg.key) = (agg_ca.clone(), agg_cert.clone(), agg_key.clone());
    cfg.http_tls = Some(aggregator::HttpTls { cert: agg_cert.clone(), key: agg_key.clone(), client_ca: None });
    cfg.tls_reload_interval_ms = 50;
    let agg = Aggregator::start(cfg).await.expect("aggregator starts");
    let http = agg.http_addr;

    // node-00 trusts A's aggregator but presents B's certificate (A's CA did not sign it);
    // node-01 has all of B: it does not trust A's aggregator.
    let s = builtin::builtin("mixed").expect("built in").expect("valid");
    let start = Instant::now();
    let shipper = |node: u32, files: [&std::path::Path; 3]| {
        let projected = Projected::new(dir.path().join(format!("s{node}")), files);
        let (ca, cert, key) = projected.paths();
        let source = node_shipper::source::SimSource::new(&s, SimOptions::default(), node, start).expect("source");
        let placeholder =
            node_shipper::config::Source::Sim { scenario: s.name.clone(), node, bulk_scale_ppm: 0, seed: None };
        let mut c = ringwatch_tests::shipper_config(&a, agg.quic_addr, node, placeholder);
        (c.ca, c.cert, c.key) = (ca, cert, key);
        c.tls_reload_interval_ms = 50;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let metrics = listener.local_addr().expect("addr");
        let opts = node_shipper::driver::RunOptions {
            http: Some((Arc::new(listener), ringwatch_transport::http::HttpLimits::default())),
            ..node_shipper::driver::RunOptions::default()
        };
        (ringwatch_tests::spawn_shipper(c, Box::new(source), opts), metrics, projected)
    };
    let (b0_cert, b0_key) = b.node(&names[0]);
    let (s0, s0_metrics, mut s0_files) = shipper(0, [&a.ca, &b0_cert, &b0_key]);
    let (b1_cert, b1_key) = b.node(&names[1]);
    let (s1, _, _s1_files) = shipper(1, [&b.ca, &b1_cert, &b1_key]);

    // Both fail their handshakes; neither is a node of the aggregator's.
    tls_wait(http, &a.ca, "/v1/ingest", "handshakes failing", |i: &IngestDto| i.handshake_failures >= 4).await;
    let nodes: NodesDto = tls_wait(http, &a.ca, "/v1/nodes", "nodes", |_: &NodesDto| true).await;
    assert!(nodes.nodes.iter().all(|n| n.connections == 0), "{nodes:?}");

    // The shipper's side: node-00 gets A's certificate for its node and connects.
    let (a0_cert, a0_key) = a.node(&names[0]);
    s0_files.rotate([&a.ca, &a0_cert, &a0_key]);
    let nodes = tls_wait(http, &a.ca, "/v1/nodes", "node-00 connected after its rotation", |n: &NodesDto| {
        n.nodes.iter().any(|n| n.name == names[0] && n.connected)
    })
    .await;
    let conns_0 = nodes.nodes.iter().find(|n| n.name == names[0]).map(|n| n.connections);
    let page = ringwatch_tests::http_get(s0_metrics, "/metrics").await.1;
    assert_eq!(sample(&page, r#"ringwatch_tls_reloads_total{listener="quic",result="applied"}"#), Some(1.0), "{page}");
    assert_eq!(sample(&page, r#"ringwatch_tls_reload_failing{listener="quic"}"#), Some(0.0));

    // The aggregator's side: B's server certificate and both CAs. node-01 (trusting only
    // B) connects; node-00's connection, made under A, stays as it was.
    agg_files.rotate([&both, &b.server_cert, &b.server_key]);
    let nodes =
        tls_wait(http, &both, "/v1/nodes", "node-01 connected after the aggregator's rotation", |n: &NodesDto| {
            n.nodes.iter().any(|n| n.name == names[1] && n.connected)
        })
        .await;
    let n0 = nodes.nodes.iter().find(|n| n.name == names[0]).expect("node-00");
    assert!(n0.connected && Some(n0.connections) == conns_0, "node-00 kept its connection: {n0:?}");
    // The API's listener serves B's certificate now: a client trusting only B gets in.
    let (code, _) = tls_get(http, &b.ca, None, "/healthz").await.expect("the API over B's certificate");
    assert_eq!(code, 200);
    let page = tls_get(http, &b.ca, None, "/metrics").await.expect("metrics").1;
    for l in ["quic", "http"] {
        let applied = format!(r#"ringwatch_tls_reloads_total{{listener="{l}",result="applied"}}"#);
        assert_eq!(sample(&page, &applied), Some(1.0), "{l}: {page}");
        let expiry = format!(r#"ringwatch_tls_certificate_expiry_timestamp_seconds{{listener="{l}"}}"#);
        assert!(sample(&page, &expiry).is_some_and(|t| t > 1.7e9), "{l}: {page}");
    }

    // A key that does not match its certificate: refused, the set in force stays, said.
    agg_files.rotate([&both, &b.server_cert, &a.server_key]);
    let failing = r#"ringwatch_tls_reload_failing{listener="quic"}"#;
    let start_wait = Instant::now();
    let page = loop {
        let page = tls_get(http, &b.ca, None, "/metrics").await.expect("metrics").1;
        if sample(&page, failing) == Some(1.0) || start_wait.elapsed() > STATE_LIMIT {
            break page;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(sample(&page, failing), Some(1.0), "{page}");
    assert_eq!(sample(&page, r#"ringwatch_tls_reloads_total{listener="quic",result="failed"}"#), Some(1.0));
    let (code, _) = tls_get(http, &b.ca, None, "/healthz").await.expect("still served over B's certificate");
    assert_eq!(code, 200);

    let reports = stop(vec![s0, s1]).await;
    assert!(reports.iter().all(|r| r.ended == node_shipper::driver::Ended::Shutdown), "{reports:?}");
    agg.shutdown();
}
