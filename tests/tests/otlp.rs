//! OTLP export (issue 25): with `otlp_export` on, every event of `GET /v1/events` reaches
//! an OTLP/HTTP receiver as one log record — the same id, kind and JSON — even when the
//! receiver fails its first requests (sent again); the exporter's counters account for
//! every event. The receiver here decodes with `opentelemetry-proto`'s types.
//!
//! Named `net_*`: real sockets and timing, run one at a time.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use aggregator::Aggregator;
use aggregator::api::client::EventStream;
use aggregator::api::dto::VerdictsDto;
use aggregator::events::EventId;
use aggregator::otlp::OtlpConfig;
use axum::http::StatusCode;
use loadgen_sim::{SimOptions, builtin};
use opentelemetry_proto::tonic::collector::logs::v1::{
    ExportLogsPartialSuccess, ExportLogsServiceRequest, ExportLogsServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;
use ringwatch_tests::{STATE_LIMIT, TempDir, cert_set, stop, streams_settled, truth, wait_nodes};

/// What the receiver got: every request decoded, and how many it turned away.
#[derive(Default)]
struct Received {
    requests: Vec<ExportLogsServiceRequest>,
    refused: u32,
}

/// Answers 503 to the first `refuse` requests, then 200.
async fn receiver(refuse: u32) -> (std::net::SocketAddr, Arc<Mutex<Received>>) {
    let got = Arc::new(Mutex::new(Received::default()));
    let state = Arc::clone(&got);
    let app = axum::Router::new().route(
        "/v1/logs",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let state = Arc::clone(&state);
            async move {
                assert_eq!(headers.get("content-type").map(|v| v.as_bytes()), Some(&b"application/x-protobuf"[..]));
                let mut r = state.lock().unwrap();
                if r.refused < refuse {
                    r.refused += 1;
                    return (StatusCode::SERVICE_UNAVAILABLE, Vec::new());
                }
                let req = ExportLogsServiceRequest::decode(body).expect("an OTLP logs request");
                r.requests.push(req);
                // The first request it takes is answered with a partial success: one
                // record refused (the exporter counts it dropped_rejected).
                if r.requests.len() == 1 {
                    let partial = ExportLogsServiceResponse {
                        partial_success: Some(ExportLogsPartialSuccess {
                            rejected_log_records: 1,
                            error_message: "one record refused by the test".into(),
                        }),
                    };
                    return (StatusCode::OK, partial.encode_to_vec());
                }
                (StatusCode::OK, Vec::new())
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, got)
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attrs.iter().find(|a| a.key == key).and_then(|a| a.value.as_ref()).and_then(|v| v.value.as_ref())
}

fn text(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_otlp_export_sends_every_event_once_as_a_log_record_and_retries_a_failing_receiver() {
    let (otlp_addr, got) = receiver(2).await;
    let dir = TempDir::new("otlp");
    let s = builtin::builtin("seed-case").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let truth = truth(&s, options);
    let set = cert_set(dir.path(), s.cluster.nodes);
    let mut cfg = loadgen::cluster::aggregator_config(&set, &s, 1.0);
    cfg.events.capacity = 1_000_000;
    let endpoint = format!("http://{otlp_addr}");
    cfg.otlp = Some(
        OtlpConfig::from_env(|k| match k {
            "OTEL_EXPORTER_OTLP_ENDPOINT" => Some(endpoint.clone()),
            "OTEL_RESOURCE_ATTRIBUTES" => Some("deployment.environment=test".into()),
            _ => None,
        })
        .expect("OTLP configuration"),
    );
    let agg = Aggregator::start(cfg).await.expect("aggregator starts");
    let http = agg.http_addr;
    let shippers = ringwatch_tests::spawn_sim_shippers(&s, options, &set, agg.quic_addr, Instant::now(), |_, _, _| {});
    wait_nodes(http, "every stream settled", |n| streams_settled(n, &truth, |_| true)).await;
    ringwatch_tests::wait_decidable_final(http, &truth).await;
    let verdicts: VerdictsDto = ringwatch_tests::get_json(http, "/v1/verdicts?limit=1").await;
    let target: EventId = verdicts.as_of.event_id.parse().expect("id");
    assert!(target.seq > 0, "events happened");

    // The stream's own account of events 1..=target.
    let from = EventId { seq: 0, ..target };
    let path = format!("/v1/events?after={from}&until={target}");
    let mut stream = EventStream::open(http, &path, &[]).await.expect("event stream");
    let mut sse = Vec::new();
    while let Some(e) = stream.next().await.expect("event") {
        sse.push((e.id.clone().unwrap_or_default(), e.event.clone(), e.data.clone()));
    }
    assert_eq!(sse.len() as u64, target.seq, "the stream holds every event");

    // The receiver's, once it has them all.
    let started = Instant::now();
    let records = loop {
        let records: Vec<(String, String, String, i32)> = {
            let r = got.lock().unwrap();
            r.requests
                .iter()
                .flat_map(|q| &q.resource_logs)
                .flat_map(|rl| &rl.scope_logs)
                .flat_map(|sl| &sl.log_records)
                .map(|l| {
                    let body = text(l.body.as_ref().and_then(|b| b.value.as_ref())).unwrap_or_default();
                    let id = text(attr(&l.attributes, "ringwatch.event.id")).unwrap_or_default();
                    let kind = text(attr(&l.attributes, "ringwatch.event.kind")).unwrap_or_default();
                    (id, kind, body, l.severity_number)
                })
                .collect()
        };
        let have = records.iter().filter(|(id, ..)| id.parse::<EventId>().is_ok_and(|i| i.seq <= target.seq)).count();
        if have as u64 >= target.seq {
            break records;
        }
        assert!(started.elapsed() < STATE_LIMIT, "{have} of {} events exported", target.seq);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let _ = stop(shippers).await;
    // The exporter counts a batch once the receiver answered: wait for the count too.
    let started = Instant::now();
    let metrics = loop {
        let (_, m) = aggregator::api::client::get(http, "/metrics").await.expect("/metrics");
        let exported = m
            .lines()
            .find_map(|l| l.strip_prefix("ringwatch_otlp_records_total{result=\"exported\"}"))
            .and_then(|v| v.trim().parse::<f64>().ok());
        if exported.is_some_and(|e| e + 1.0 >= target.seq as f64) {
            break m;
        }
        assert!(started.elapsed() < STATE_LIMIT, "exported {exported:?} of {}", target.seq);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    agg.shutdown();

    // Every event once, with the stream's id, kind and JSON.
    let mut by_id: BTreeMap<String, (String, String, i32)> = BTreeMap::new();
    for (id, kind, body, sev) in &records {
        assert!(by_id.insert(id.clone(), (kind.clone(), body.clone(), *sev)).is_none(), "{id} exported twice");
    }
    for (id, kind, data) in &sse {
        let (k, body, _) = by_id.get(id).unwrap_or_else(|| panic!("event {id} ({kind}) was not exported"));
        assert_eq!((k, body), (kind, data), "event {id}");
    }
    // Node 3 lost telemetry (healthy_lossy) and nothing is degraded in this case: every
    // record is INFO, none WARN (which severity each kind gets is the exporter's unit test).
    let info = opentelemetry_proto::tonic::logs::v1::SeverityNumber::Info as i32;
    assert!(by_id.values().any(|(k, body, _)| k == "health" && body.contains("\"health\":\"healthy_lossy\"")));
    assert!(by_id.values().all(|(.., s)| *s == info), "a healthy_lossy node is no warning");
    let r = got.lock().unwrap();
    assert_eq!(r.refused, 2, "the first two requests were refused and sent again");
    let resource = r.requests[0].resource_logs[0].resource.as_ref().expect("resource");
    assert_eq!(text(attr(&resource.attributes, "service.name")).as_deref(), Some("ringwatch-aggregator"));
    assert_eq!(text(attr(&resource.attributes, "deployment.environment")).as_deref(), Some("test"));
    // The exporter's account: what it counted exported the receiver has (it counts after
    // the receiver's answer), every event up to the target among them; nothing evicted.
    let counter = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<f64>().ok()))
            .unwrap_or_else(|| panic!("{name} in:\n{metrics}"))
    };
    let exported = counter("ringwatch_otlp_records_total{result=\"exported\"}");
    let received: usize = r
        .requests
        .iter()
        .flat_map(|q| &q.resource_logs)
        .flat_map(|rl| &rl.scope_logs)
        .map(|sl| sl.log_records.len())
        .sum();
    // One record of the first accepted request was refused (a partial success).
    assert!(
        exported + 1.0 >= target.seq as f64 && exported + 1.0 <= received as f64,
        "exported {exported}, received {received}"
    );
    assert_eq!(counter("ringwatch_otlp_records_total{result=\"dropped_evicted\"}"), 0.0);
    assert_eq!(counter("ringwatch_otlp_records_total{result=\"dropped_rejected\"}"), 1.0);
    assert_eq!(counter("ringwatch_otlp_requests_total{result=\"failed\"}"), 2.0);
    println!(
        "{} events exported as OTLP log records in {} requests (2 refused and sent again)",
        records.len(),
        r.requests.len()
    );
}
