//! Hostile peers while honest shippers flow (issue 8): no client certificate, a
//! certificate from another CA, one node's certificate claiming another node, garbage,
//! truncated batches, wrong versions, lengths past the buffer, a replayed batch — each
//! refused or rejected and counted by reason, the offender disconnected after the
//! threshold, the honest nodes' accounting exact, nothing panics.
//!
//! Named `net_*`: real timers, run alone.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aggregator::api::dto::{HealthzDto, IngestDto, NodesDto};
use aggregator::certs::{self, CertSet};
use aggregator::ingest::REJECT_THRESHOLD;
use aggregator::{Aggregator, AggregatorConfig};
use loadgen_sim::{SimOptions, builtin};
use proto_flat::batch::{BatchMeta, BatchWriter, RunningTotals, reseal};
use proto_flat::codes::{Class, NackReason, WireEnum};
use proto_flat::control::{ControlMessage, encode_resume, parse_control};
use proto_flat::header::StreamId;
use proto_flat::sample;
use ringwatch_tests::{TempDir, cert_set, get_json, stop, streams_settled, truth, wait_nodes};
use ringwatch_transport::{CONTROL_PREFACE, TlsFiles, Tuning};
use rustls::pki_types::pem::PemObject;
use zerocopy::IntoBytes;

/// A valid bulk batch as `node` would send it.
fn batch(node: &str, session: u64, batch_seq: u64) -> Vec<u8> {
    let frames: Vec<Vec<u8>> = (0..20)
        .map(|seq| sample::bulk_packet(StreamId::new(Class::P2, 1, 0), batch_seq * 100 + seq, seq).as_bytes().to_vec())
        .collect();
    batch_of(node, session, batch_seq, Class::P2, &frames)
}

/// A batch of `node` on `lane` holding `frames` (which must be of that lane's class).
fn batch_of(node: &str, session: u64, batch_seq: u64, lane: Class, frames: &[Vec<u8>]) -> Vec<u8> {
    let mut w = BatchWriter::with_capacity(4096);
    w.begin(&BatchMeta {
        node_id: proto_flat::node_id_of(node),
        epoch: 1,
        shipper_session: session,
        batch_seq,
        lane: lane.code(),
        clock_mono_ns: 0,
        clock_realtime_ns: 0,
    });
    for f in frames {
        w.push_frame(f).expect("frame fits");
    }
    w.finish(&RunningTotals::default()).to_vec()
}

/// Honest shippers for every node of `s`, fed by the simulator in real time; returns once
/// each is shipping, with the ground truth.
async fn honest_shippers(
    s: &loadgen_sim::Scenario,
    options: SimOptions,
    set: &CertSet,
    agg: &Aggregator,
) -> (Vec<ringwatch_tests::Running>, loadgen_sim::GroundTruth) {
    let start = Instant::now();
    let honest = ringwatch_tests::spawn_sim_shippers(s, options, set, agg.quic_addr, start, |_, _, _| {});
    let nodes = s.cluster.nodes;
    wait_nodes(agg.http_addr, "every honest node is shipping", |n| {
        (0..nodes).all(|i| n.nodes.iter().any(|x| x.name == certs::node_name(i) && !x.streams.is_empty()))
    })
    .await;
    (honest, truth(s, options))
}

/// A raw client with `files`: opens the control stream (preface and an empty `resume`),
/// then sends each payload on its own stream; returns the nack reasons it got back and
/// whether the aggregator closed the connection.
async fn attack(
    aggregator: SocketAddr,
    files: TlsFiles<'_>,
    payloads: &[Vec<u8>],
) -> Result<(Vec<NackReason>, bool), String> {
    let mut resume = Vec::new();
    encode_resume(&mut resume, 0, 1, 0, 0, &[], &[]).map_err(|e| e.to_string())?;
    attack_with(aggregator, files, &resume, payloads).await
}

/// [`attack`] with `opening` written after the preface instead of a valid `resume`.
async fn attack_with(
    aggregator: SocketAddr,
    files: TlsFiles<'_>,
    opening: &[u8],
    payloads: &[Vec<u8>],
) -> Result<(Vec<NackReason>, bool), String> {
    let tuning = Tuning::default();
    let client = ringwatch_transport::client_config(files, &tuning).map_err(|e| e.to_string())?;
    let mut ep = tuning.endpoint(SocketAddr::from(([127, 0, 0, 1], 0)), None).map_err(|e| e.to_string())?;
    ep.set_default_client_config(client);
    let conn = ep.connect(aggregator, "localhost").map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
    send.write_all(&CONTROL_PREFACE).await.map_err(|e| e.to_string())?;
    send.write_all(opening).await.map_err(|e| e.to_string())?;
    for p in payloads {
        let Ok(mut s) = conn.open_uni().await else { break };
        if s.write_all(p).await.is_err() {
            break;
        }
        let _ = s.finish();
    }
    // Read answers until the connection closes or goes quiet.
    let mut buf = Vec::new();
    let mut nacks = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_millis(500), recv.read_chunk(65_536, true)).await {
            Ok(Ok(Some(c))) => buf.extend_from_slice(&c.bytes),
            Ok(_) => break,
            Err(_) if nacks.len() >= payloads.len().min(usize::try_from(REJECT_THRESHOLD).unwrap_or(64)) => break,
            Err(_) => {}
        }
        let mut used = 0;
        while let Ok(Some((m, n))) = parse_control(&buf[used..]) {
            used += n;
            if let ControlMessage::Nack { reason, .. } = m {
                nacks.push(reason);
            }
        }
        buf.drain(..used);
    }
    let closed = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await.is_ok();
    ep.close(0u32.into(), b"done");
    Ok((nacks, closed))
}

/// A batch node 5 may send (for the bad-resume case: it must never be read).
fn b7_again() -> Vec<u8> {
    batch("node-05", 31, 1)
}

fn files(set: &CertSet, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    set.node(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_hostile_peers_are_refused_and_counted_while_honest_accounting_stays_exact() {
    let dir = TempDir::new("hostile");
    let foreign = TempDir::new("hostile-foreign");
    let s = builtin::builtin("pipeline-p2p").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), 8);
    certs::init_foreign(foreign.path(), &[certs::node_name(0)]).expect("foreign CA");
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");

    // Honest shippers, nodes 0..4.
    let (honest, truth) = honest_shippers(&s, options, &set, &agg).await;
    let ca = set.ca.clone();

    // 1. No client certificate: the handshake fails.
    let no_cert = {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls::pki_types::CertificateDer::pem_file_iter(&ca).expect("ca").flatten() {
            roots.add(c).expect("root");
        }
        let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("tls13")
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![ringwatch_transport::ALPN.to_vec()];
        let qc = quinn::crypto::rustls::QuicClientConfig::try_from(tls).expect("quic tls");
        let mut ep = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).expect("endpoint");
        ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(qc)));
        let r = async {
            let c =
                ep.connect(agg.quic_addr, "localhost").map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
            let (mut s, _) = c.open_bi().await.map_err(|e| e.to_string())?;
            s.write_all(&CONTROL_PREFACE).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(tokio::time::timeout(Duration::from_secs(2), c.closed()).await.map(|e| e.to_string()))
        }
        .await;
        ep.close(0u32.into(), b"");
        r
    };
    println!("no client certificate: {no_cert:?}");

    // 2. A certificate from another CA (same node name).
    let (fc, fk) = (foreign.path().join("node-00.pem"), foreign.path().join("node-00.key"));
    let other_ca = attack(agg.quic_addr, TlsFiles { ca: &ca, cert: &fc, key: &fk }, &[batch("node-00", 9, 1)]).await;
    println!("another CA: {other_ca:?}");
    assert!(other_ca.as_ref().map_or(true, |(n, _)| n.is_empty()), "nothing from a foreign CA is processed");

    // 3. Node 5's certificate sending batches that claim node 0.
    let (c5, k5) = files(&set, "node-05");
    let claims: Vec<Vec<u8>> = (1..=3).map(|i| batch("node-00", 77, i)).collect();
    let (nacks, _) = attack(agg.quic_addr, TlsFiles { ca: &ca, cert: &c5, key: &k5 }, &claims).await.expect("connects");
    assert_eq!(nacks, vec![NackReason::NodeMismatch; 3], "each claim nacked node_mismatch");

    // 4. Garbage, truncated, wrong version, lengths past the buffer — then enough garbage
    // to pass the threshold: the connection is closed.
    let (c6, k6) = files(&set, "node-06");
    let good = batch("node-06", 5, 1);
    let mut wrong_version = good.clone();
    wrong_version[4] = 9;
    reseal(&mut wrong_version);
    let mut past_end = good.clone();
    // payload_len (u32 at offset 44) claims more bytes than the buffer holds.
    past_end[44..48].copy_from_slice(&(u32::MAX / 2).to_le_bytes());
    reseal(&mut past_end);
    let mut bad =
        vec![b"garbage, not a batch at all".to_vec(), good[..good.len() / 2].to_vec(), wrong_version, past_end];
    while bad.len() < usize::try_from(REJECT_THRESHOLD).unwrap_or(64) + 8 {
        bad.push(vec![0xAB; 200]);
    }
    let (nacks, closed) =
        attack(agg.quic_addr, TlsFiles { ca: &ca, cert: &c6, key: &k6 }, &bad).await.expect("connects");
    println!("malformed: {} nacks, closed {closed}", nacks.len());
    assert!(closed, "the offender is disconnected after {REJECT_THRESHOLD} rejections");

    // 5. Node 7 sends a batch, then replays it on a new connection: applied once.
    let (c7, k7) = files(&set, "node-07");
    let b7 = batch("node-07", 4242, 1);
    let first = attack(agg.quic_addr, TlsFiles { ca: &ca, cert: &c7, key: &k7 }, std::slice::from_ref(&b7))
        .await
        .expect("connects");
    let replay = attack(agg.quic_addr, TlsFiles { ca: &ca, cert: &c7, key: &k7 }, &[b7]).await.expect("connects");
    assert!(first.0.is_empty() && replay.0.is_empty(), "a replay is acked duplicate, not nacked");

    // 6. Hostile resumes (issue 16): garbage where the resume belongs, and a resume whose
    // counts are far past its caps; each closes the connection as a protocol error.
    let (c5b, k5b) = files(&set, "node-05");
    let garbage = attack_with(agg.quic_addr, TlsFiles { ca: &ca, cert: &c5b, key: &k5b }, &[0xEE; 64], &[])
        .await
        .expect("connects");
    let mut huge = Vec::new();
    encode_resume(&mut huge, 1, 1, u64::MAX, 0, &[(1, 1)], &[]).expect("encodes");
    huge[8 + 24..8 + 28].copy_from_slice(&u32::MAX.to_le_bytes()); // range_count
    let over = attack_with(agg.quic_addr, TlsFiles { ca: &ca, cert: &c5b, key: &k5b }, &huge, &[b7_again()])
        .await
        .expect("connects");
    assert!(garbage.1 && over.1, "bad resumes close the connection: {garbage:?} {over:?}");
    assert!(over.0.is_empty(), "no batch is read after a bad resume");

    // Let the honest run finish: the run ends on state, every honest stream settled.
    wait_nodes(agg.http_addr, "every honest stream settled", |n| streams_settled(n, &truth, |_| true)).await;
    let ingest: IngestDto = get_json(agg.http_addr, "/v1/ingest").await;
    let nodes: NodesDto = get_json(agg.http_addr, "/v1/nodes").await;
    let health: HealthzDto = get_json(agg.http_addr, "/healthz").await;
    let reports = stop(honest).await;
    agg.shutdown();
    println!("{ingest:?}");
    assert_eq!(health.status, "ok", "still serving: nothing panicked");

    // Counted by reason.
    assert!(ingest.handshake_failures >= 2, "no certificate and another CA: {ingest:?}");
    assert_eq!(ingest.node_mismatch, 3);
    for reason in ["node_mismatch", "bad_magic", "unsupported_version", "length_mismatch"] {
        assert!(ingest.rejected.get(reason).copied().unwrap_or(0) > 0, "{reason} not counted: {:?}", ingest.rejected);
    }
    assert!(ingest.rejected.keys().any(|k| k == "too_short" || k == "length_mismatch"), "truncated batch");
    assert!(ingest.connections_closed_abuse >= 1);
    assert_eq!(ingest.batches_duplicate, 1, "the replayed batch, applied once");

    assert!(ingest.protocol_errors >= 2, "the two bad resumes: {ingest:?}");
    // Honest accounting is exact, and no honest batch was nacked.
    for r in &reports {
        assert_eq!(r.batches_nacked, 0, "{}", r.node_name);
        assert!(r.flushed, "{}", r.node_name);
    }
    for t in &truth.streams {
        let name = certs::node_name(t.node);
        let node = nodes.nodes.iter().find(|n| n.name == name).expect("honest node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        assert_eq!(got.received, t.delivered, "{name} {:#x}", t.stream_id);
        assert_eq!(got.lost, t.dropped, "{name} {:#x}", t.stream_id);
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{name} {:#x}", t.stream_id);
    }
    // The claimed node 0 got nothing from node 5's batches (its streams matched the truth
    // above), and node 5 is known only under its own name.
    assert!(nodes.nodes.iter().any(|n| n.name == "node-05"));
}

/// Issue 18: the inputs that once panicked the core, sent by a certified peer while
/// honest shippers run — the heartbeat with every counter at u64::MAX (it froze every
/// verdict: the timer task died in `SeqTracker::settle`), a frame with seq u64::MAX and a
/// loss record ending there (they panicked the batch path: no ack, no nack), a PROGRESS
/// entry whose op seqs are u64::MAX — each batch nacked `malformed_frame` and counted; a
/// resume with a floor at u64::MAX closes its connection. Verdicts keep flowing, no task
/// dies, the honest accounting stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn net_overflow_inputs_from_a_certified_peer_are_nacked_while_verdicts_flow() {
    use aggregator::api::dto::VerdictsDto;
    use proto_flat::codes::{LossCause, Phase};
    use proto_flat::encode::SectionedFrameWriter;
    use proto_flat::sections::{ProgressEntry, StreamEntry};
    use zerocopy::FromZeros;
    use zerocopy::little_endian::{U32, U64};

    let dir = TempDir::new("hostile-overflow");
    let s = builtin::builtin("pipeline-p2p").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), 8);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let (honest, truth) = honest_shippers(&s, options, &set, &agg).await;
    let before: VerdictsDto = get_json(agg.http_addr, "/v1/verdicts?final=true&limit=100000").await;

    let me = "node-06";
    let p0 = StreamId::new(Class::P0, 0, 0);
    let mut all_max = StreamEntry::new_zeroed();
    all_max.stream_id = U32::new(p0.0);
    all_max.attempted_seq = U64::new(u64::MAX);
    all_max.held_from_seq = U64::new(u64::MAX);
    all_max.drops[LossCause::KernelRingFull.drop_slot().expect("slot")] = U64::new(u64::MAX);
    all_max.drops[LossCause::Oversized.drop_slot().expect("slot")] = U64::new(u64::MAX);
    let mut w = SectionedFrameWriter::heartbeat(sample::SHIPPER_STREAM, 0, 1_000, 1_000);
    w.section(&[all_max]);
    let heartbeat = w.finish();
    let seq_max = sample::collective(p0, u64::MAX, 2_000, 1, Phase::EnqueueStart).as_bytes().to_vec();
    let mut record = sample::loss_record(1, 3_000, p0, 5, u64::MAX, LossCause::ShipperSpoolFull);
    record.batch_seq = U64::new(0);
    let mut progress = ProgressEntry::new_zeroed();
    progress.last_enqueued_op = U64::new(u64::MAX);
    progress.last_completed_op = U64::new(u64::MAX);
    let mut w = SectionedFrameWriter::heartbeat(sample::SHIPPER_STREAM, 2, 4_000, 4_000);
    w.section(&[] as &[StreamEntry]).section(&[progress]);
    let progress_hb = w.finish();
    let payloads = vec![
        batch_of(me, 61, 1, Class::P1, &[heartbeat]),
        batch_of(me, 61, 2, Class::P0, &[seq_max]),
        batch_of(me, 61, 3, Class::P1, &[record.as_bytes().to_vec()]),
        batch_of(me, 61, 4, Class::P1, &[progress_hb]),
    ];
    let (c6, k6) = files(&set, me);
    let ca = set.ca.clone();
    let (nacks, _) =
        attack(agg.quic_addr, TlsFiles { ca: &ca, cert: &c6, key: &k6 }, &payloads).await.expect("connects");
    assert_eq!(nacks, vec![NackReason::MalformedFrame; 4], "each overflow input nacked malformed_frame");
    // A resume with a stream floor at u64::MAX.
    let mut resume = Vec::new();
    encode_resume(&mut resume, 62, 1, 1, 0, &[], &[(p0.0, u64::MAX)]).expect("encodes");
    let (c6b, k6b) = files(&set, me);
    let over =
        attack_with(agg.quic_addr, TlsFiles { ca: &ca, cert: &c6b, key: &k6b }, &resume, &[]).await.expect("connects");
    assert!(over.1, "an implausible resume closes its connection: {over:?}");

    // The run ends on state: every honest stream settled; verdicts went on being final.
    wait_nodes(agg.http_addr, "every honest stream settled", |n| streams_settled(n, &truth, |_| true)).await;
    let after: VerdictsDto = get_json(agg.http_addr, "/v1/verdicts?final=true&limit=100000").await;
    let ingest: IngestDto = get_json(agg.http_addr, "/v1/ingest").await;
    let nodes: NodesDto = get_json(agg.http_addr, "/v1/nodes").await;
    let health: HealthzDto = get_json(agg.http_addr, "/healthz").await;
    let (ready_status, _) = aggregator::api::client::get(agg.http_addr, "/readyz").await.expect("readyz");
    let reports = stop(honest).await;
    agg.shutdown();
    println!("final verdicts {} → {}; {ingest:?}; {health:?}", before.total.unwrap_or(0), after.total.unwrap_or(0));
    assert!(after.total.unwrap_or(0) > before.total.unwrap_or(0), "verdicts kept flowing after the attack");
    assert_eq!(ingest.implausible_batches, 4);
    assert_eq!(ingest.implausible_resumes, 1);
    assert_eq!(ingest.rejected.get("malformed_frame"), Some(&4), "{:?}", ingest.rejected);
    assert_eq!(health.status, "ok");
    assert_eq!(ready_status, 200);
    for t in &health.tasks {
        // Snapshots and the pressure watcher are not configured here; the cluster tasks
        // run only in the shard roles.
        let must_run = !matches!(t.name.as_str(), "snapshots" | "pressure" | "otlp" | "cluster" | "cluster_state");
        assert!(t.alive == must_run && t.panics == 0 && !t.stalled, "{t:?}");
    }
    assert_eq!((health.connection_panics, health.handler_panics), (0, 0));
    for r in &reports {
        assert_eq!(r.batches_nacked, 0, "{}", r.node_name);
    }
    for t in &truth.streams {
        let name = certs::node_name(t.node);
        let node = nodes.nodes.iter().find(|n| n.name == name).expect("honest node");
        let got = node.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{name} {:#x}", t.stream_id);
    }
    // Nothing of the refused batches reached the attacker's node state.
    let attacker = nodes.nodes.iter().find(|n| n.name == me);
    assert!(attacker.is_none_or(|n| n.streams.is_empty()), "{attacker:?}");
}
