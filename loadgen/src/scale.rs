//! `loadgen scale`: what the scale-out roles carry on this machine (issue 29), as a
//! printed table. Run it with the perf profile: `cargo run -p loadgen --profile perf --
//! scale` (it starts its own `nats-server`, one JetStream server per configuration, on
//! loopback; the Debian package).
//!
//! The generator must not be what is measured on 2 cores, so every input is built before
//! the clock starts:
//!
//! 1. **Matcher shards** (1, then 2): record batches (`RecordBatch`, 1,024 records per
//!    message, routed as an ingest shard routes them) are published to JetStream first;
//!    then the matcher roles start — real `aggregator` matcher roles, in this process —
//!    and the clock runs until each has applied its stream to its last message. The
//!    records are a synthetic cluster: 8 GPUs a node, communicators of 32 ranks (4
//!    nodes), each round one all-reduce on every communicator (kernel start and end per
//!    rank), then every node's P0 watermark (which goes to every matcher shard).
//! 2. **Ingest shards** (1, then 2, each on its own thread with its own NATS
//!    connection): pre-built 64 KiB batches through parse + validate +
//!    `Core::receive_batch` of an ingest-role core, and the records it produces routed,
//!    encoded and published to JetStream (awaiting each ack) — the whole ingest shard but
//!    QUIC (`loadgen bench` measures the transport). Two inputs: bulk batches (P2
//!    packets: accounted locally, nothing published but watermarks) and lifecycle
//!    batches (P0 collective frames: a record published per frame).
//! 3. **1,000 nodes** through 2 matcher shards: the same synthetic cluster at 1,000 nodes
//!    in four parts, each produced round by round while the shards consume, then drained
//!    (the sustained rate is reported against the real-time rate of one all-reduce per
//!    communicator every 200 ms), with the process's RSS after each part and each
//!    shard's fullest maps and verdict store against their caps at the end (the store
//!    capped at 32 MiB and final ops remembered 5 s, so the caps are reached in the run).
//!
//! CPU is thread/process time from `/proc` (ringwatch's process, and the NATS server's),
//! per record or frame: the per-item costs ARCHITECTURE.md's estimate rests on.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aggregator::cluster::{self, ClusterConfig, ShardRole};
use aggregator::{Aggregator, certs};
use proto_flat::batch::{BatchMeta, BatchView, BatchWriter, RunningTotals, SummaryCheck};
use proto_flat::codes::{Class, Op, Phase, WireEnum};
use proto_flat::header::StreamId;
use proto_flat::sample;
use ringwatch_core::records::{
    Comm, Lifecycle, LifecycleKind, Liveness, LivenessState, NodeId, Record, StreamKey, Watermark,
};
use ringwatch_core::shard::{RecordBatch, Role, Route};
use ringwatch_core::{Core, IngestConfig, MatcherConfig};
use zerocopy::IntoBytes;

/// GPUs per node and ranks per communicator of the synthetic cluster.
const GPUS: u32 = 8;
const COMM_RANKS: u32 = 32;
/// One all-reduce per communicator this often, in real time (the demo's `world`).
const PERIOD_NS: u64 = 200_000_000;
/// The large run's verdict store cap per matcher shard, and how long its matchers
/// remember final ops (aggregator time).
const BIG_STORE_BYTES: u64 = 32 << 20;
const BIG_FINAL_MEMORY_NS: u64 = 5_000_000_000;

/// Records per bus message (the ingest shard's own figure).
const PER_MESSAGE: usize = 1024;

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct ScaleSpec {
    /// Nodes and rounds of the matcher measurement (1).
    pub nodes: u32,
    pub rounds: u64,
    /// Bulk and lifecycle batches per ingest shard (2).
    pub ingest_batches: usize,
    /// Nodes and rounds of the large run (3).
    pub big_nodes: u32,
    pub big_rounds: u64,
}

impl Default for ScaleSpec {
    fn default() -> Self {
        Self { nodes: 64, rounds: 400, ingest_batches: 4096, big_nodes: 1000, big_rounds: 400 }
    }
}

/// One local JetStream server, killed (by pid) and its store removed when dropped.
struct Nats {
    child: Child,
    url: String,
    dir: PathBuf,
}

impl Nats {
    fn start() -> Result<Self, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("a free port: {e}"))?
            .port();
        let dir = std::env::temp_dir().join(format!("rw-scale-nats-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let child = Command::new("nats-server")
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("nats-server (Debian package nats-server): {e}"))?;
        let nats = Self { child, url: format!("nats://127.0.0.1:{port}"), dir };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let started = Instant::now();
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err() {
            if started.elapsed() > Duration::from_secs(20) {
                return Err("nats-server did not listen within 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(nats)
    }

    fn cpu_s(&self) -> f64 {
        proc_cpu_s(&self.child.id().to_string())
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// CPU time (ns) of every thread of process `pid` ("self" for this one), summed from
/// `/proc/<pid>/task/*/schedstat` (nanoseconds; a thread that has exited is not in it).
fn proc_cpu_s(pid: &str) -> f64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0.0 };
    let ns: u64 = dir
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
        .sum();
    #[allow(clippy::cast_precision_loss, reason = "seconds")]
    let s = ns as f64 / 1e9;
    s
}

/// This thread's CPU time, seconds.
fn thread_cpu_s() -> f64 {
    let ns: u64 = std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0);
    #[allow(clippy::cast_precision_loss, reason = "seconds")]
    let s = ns as f64 / 1e9;
    s
}

fn self_cpu_s() -> f64 {
    proc_cpu_s("self")
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    #[allow(clippy::cast_precision_loss, reason = "MiB")]
    let m = kb as f64 / 1024.0;
    m
}

fn cluster_config(url: &str, role: ShardRole, matcher_shards: u32, origin_ms: u64) -> ClusterConfig {
    ClusterConfig {
        role,
        nats: vec![url.to_owned()],
        matcher_shards,
        replicas: 1,
        stream_max_bytes: 8 << 30,
        verdict_max_age: Duration::from_secs(3600),
        time_origin_unix_ms: origin_ms,
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The synthetic cluster's records: its nodes announced fresh.
fn announce(nodes: u32) -> Vec<Record> {
    (0..nodes)
        .map(|n| {
            Record::Liveness(Liveness {
                node: NodeId(u64::from(n) + 1),
                state: LivenessState::Fresh,
                at_ns: 0,
                last_heard_ns: 0,
            })
        })
        .collect()
}

/// Round `r` of the synthetic cluster: one all-reduce on each communicator (kernel start
/// and end per rank), then every node's P0 watermark past it. `seqs`: each node's P0
/// stream seq.
fn round(nodes: u32, r: u64, seqs: &mut [u64]) -> Vec<Record> {
    let ranks = nodes * GPUS;
    let t0 = r * PERIOD_NS;
    let mut out = Vec::with_capacity(ranks as usize * 2 + nodes as usize);
    for rank in 0..ranks {
        let (c, local) = (rank / COMM_RANKS, rank % COMM_RANKS);
        let node = rank / GPUS;
        let comm = Comm { hash: (u64::from(c) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15), disambiguator: 1, instance: 1 };
        let size = COMM_RANKS.min(ranks - c * COMM_RANKS);
        for (phase, dt) in [(Phase::KernelStart, 1_000_000), (Phase::KernelEnd, 21_000_000)] {
            let Some(seq) = seqs.get_mut(node as usize) else { continue };
            *seq += 1;
            let ts = t0 + dt + u64::from(rank % 7) * 10_000;
            out.push(Record::Lifecycle(Lifecycle {
                stream: StreamKey { node: NodeId(u64::from(node) + 1), epoch: 1, stream_id: 0 },
                seq: *seq,
                flags: 0,
                ts_node_ns: ts,
                ts_cluster_ns: i64::try_from(ts).unwrap_or(i64::MAX),
                comm,
                local_op_seq: r + 1,
                rank: local,
                pid: 10_000 + rank,
                op: Op::AllReduce.code(),
                dtype: 7,
                phase: phase.code(),
                count: 1 << 20,
                group_id: 0,
                status: 0,
                channel: 0,
                n_channels: 1,
                kind: LifecycleKind::Collective {
                    comm_op_seq: r + 1,
                    nccl_seq: r + 1,
                    nranks: size,
                    root: u32::MAX,
                    local_rank: u16::try_from(rank % GPUS).unwrap_or(0),
                    cuda_dev: u16::try_from(rank % GPUS).unwrap_or(0),
                    graph_id: 0,
                    graph_node: 0,
                    replay_idx: 0,
                },
            }));
        }
    }
    let wm = t0 + 100_000_000;
    for n in 0..nodes {
        out.push(Record::Watermark(Watermark {
            node: NodeId(u64::from(n) + 1),
            class: 0,
            node_ns: wm,
            cluster_ns: i64::try_from(wm).unwrap_or(i64::MAX),
            epsilon_ns: 0,
        }));
    }
    out
}

/// Routes records as an ingest shard does and publishes them, `PER_MESSAGE` a message
/// per matcher shard, awaiting each ack. Returns the messages published.
struct Publisher {
    js: async_nats::jetstream::Context,
    shards: u32,
    ingest_shard: u32,
    bufs: Vec<Vec<(u64, u64, Record)>>,
    next_idx: u64,
    messages: u64,
}

impl Publisher {
    fn new(js: async_nats::jetstream::Context, shards: u32, ingest_shard: u32) -> Self {
        Self { js, shards, ingest_shard, bufs: (0..shards).map(|_| Vec::new()).collect(), next_idx: 1, messages: 0 }
    }

    async fn push(&mut self, r: &Record) -> Result<(), String> {
        let idx = self.next_idx;
        self.next_idx += 1;
        let targets: Vec<u32> = match ringwatch_core::shard::route(r, self.shards) {
            Route::One(m) => vec![m],
            Route::All => (0..self.shards).collect(),
            Route::Nowhere => Vec::new(),
        };
        for m in targets {
            let Some(buf) = self.bufs.get_mut(m as usize) else { continue };
            buf.push((idx, 0, *r));
            if buf.len() >= PER_MESSAGE {
                self.flush_one(m).await?;
            }
        }
        Ok(())
    }

    async fn flush_one(&mut self, m: u32) -> Result<(), String> {
        let Some(buf) = self.bufs.get_mut(m as usize) else { return Ok(()) };
        if buf.is_empty() {
            return Ok(());
        }
        let batch = RecordBatch {
            ingest_shard: self.ingest_shard,
            epoch: 1,
            matcher_shards: self.shards,
            records: std::mem::take(buf),
        };
        let bytes = ringwatch_core::shard::encode(&batch).map_err(|e| format!("encode: {e}"))?;
        self.js
            .publish(cluster::records_subject(m), bytes.into())
            .await
            .map_err(|e| format!("publish: {e}"))?
            .await
            .map_err(|e| format!("publish ack: {e}"))?;
        self.messages += 1;
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), String> {
        for m in 0..self.shards {
            self.flush_one(m).await?;
        }
        Ok(())
    }
}

/// Matcher roles, in this process, reading the streams of `url`.
async fn start_matchers(
    url: &str,
    shards: u32,
    origin_ms: u64,
    certs_dir: &std::path::Path,
    store_max_bytes: Option<u64>,
) -> Result<Vec<Aggregator>, String> {
    let set = certs::init(certs_dir, &[certs::node_name(0)]).map_err(|e| format!("certificates: {e}"))?;
    let mut out = Vec::new();
    for shard in 0..shards {
        let mut cfg = aggregator::AggregatorConfig::local(&set);
        cfg.cluster = Some(cluster_config(url, ShardRole::Matcher { shard }, shards, origin_ms));
        if let Some(b) = store_max_bytes {
            // The large run: caps and retention small enough to be reached in the run
            // (the verdict store's bytes; final ops remembered 5 s, not 10 min).
            cfg.store.max_bytes = b;
            cfg.matcher.final_memory_ns = BIG_FINAL_MEMORY_NS;
        }
        out.push(Aggregator::start(cfg).await.map_err(|e| format!("matcher {shard}: {e}"))?);
    }
    Ok(out)
}

async fn last_seq(js: &async_nats::jetstream::Context, m: u32) -> Result<u64, String> {
    let mut s = js.get_stream(cluster::records_stream(m)).await.map_err(|e| format!("stream: {e}"))?;
    Ok(s.info().await.map_err(|e| format!("stream info: {e}"))?.state.last_sequence)
}

/// Whether a matcher role has put every event it made on the bus.
fn drained(a: &Aggregator) -> bool {
    a.shared.core().is_ok_and(|c| c.for_bus().is_empty())
}

/// Waits until every matcher role applied its stream to `last` and its events are out
/// and stopped coming (its timers judge what the records allowed); returns the seconds
/// from `t0` to the last change seen (the quiet wait after it is not counted).
async fn settle(roles: &[Aggregator], last: &[u64], t0: Instant, limit: Duration) -> Result<(f64, f64), String> {
    let events = || -> u64 {
        roles.iter().map(|a| a.shared.cluster.events_published.load(std::sync::atomic::Ordering::Relaxed)).sum()
    };
    let (mut seen, mut changed_at, mut quiet, mut applied_at) = (u64::MAX, t0.elapsed(), 0, None);
    loop {
        let all_applied = roles
            .iter()
            .zip(last)
            .all(|(a, &l)| a.shared.cluster.applied_seq.load(std::sync::atomic::Ordering::Relaxed) >= l);
        if all_applied && applied_at.is_none() {
            applied_at = Some(t0.elapsed().as_secs_f64());
        }
        let applied = all_applied && roles.iter().all(drained);
        let e = events();
        if !applied || e != seen {
            seen = e;
            changed_at = t0.elapsed();
            quiet = 0;
        } else {
            quiet += 1;
            if quiet >= 40 {
                return Ok((applied_at.unwrap_or(0.0), changed_at.as_secs_f64()));
            }
        }
        if t0.elapsed() > limit {
            let state: Vec<String> = roles
                .iter()
                .zip(last)
                .map(|(a, l)| {
                    let c = &a.shared.cluster;
                    format!(
                        "applied seq {}/{l}, {} events out, {} waiting, consumer task alive {}",
                        c.applied_seq.load(std::sync::atomic::Ordering::Relaxed),
                        c.events_published.load(std::sync::atomic::Ordering::Relaxed),
                        a.shared.core().map_or(0, |c| c.for_bus().len()),
                        a.shared.tasks.cluster.alive.load(std::sync::atomic::Ordering::Relaxed)
                    )
                })
                .collect();
            return Err(format!("the matcher shards did not settle within {limit:?}: {state:?}"));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A row of the table.
#[derive(Default)]
struct Row {
    what: String,
    shards: u32,
    items: u64,
    unit: &'static str,
    secs: f64,
    cpu_s: f64,
    nats_cpu_s: f64,
    note: String,
}

impl Row {
    fn records(shards: u32, items: u64, secs: f64, (cpu_s, nats_cpu_s): (f64, f64)) -> Self {
        Self { shards, items, unit: "records", secs, cpu_s, nats_cpu_s, ..Self::default() }
    }
}

/// 1: records/s through `shards` matcher shards, the streams filled first.
async fn matchers(spec: &ScaleSpec, shards: u32) -> Result<Row, String> {
    let nats = Nats::start()?;
    let span_ms = spec.rounds * PERIOD_NS / 1_000_000;
    // Aggregator time: the records' span ends about now (their deadlines are past).
    let origin_ms = unix_ms().saturating_sub(span_ms + 2_000);
    let js = cluster::connect(&cluster_config(&nats.url, ShardRole::Api, shards, origin_ms), "loadgen-scale").await?;
    let mut p = Publisher::new(js.clone(), shards, 0);
    let mut seqs = vec![0u64; spec.nodes as usize];
    for r in announce(spec.nodes) {
        p.push(&r).await?;
    }
    for r in 0..spec.rounds {
        for rec in round(spec.nodes, r, &mut seqs) {
            p.push(&rec).await?;
        }
    }
    p.flush().await?;
    let mut last = Vec::new();
    for m in 0..shards {
        last.push(last_seq(&js, m).await?);
    }
    let dir = std::env::temp_dir().join(format!("rw-scale-certs-{}-{shards}", std::process::id()));
    let (cpu0, ncpu0, t0) = (self_cpu_s(), nats.cpu_s(), Instant::now());
    let roles = start_matchers(&nats.url, shards, origin_ms, &dir, None).await?;
    let limit = Duration::from_secs(std::env::var("RW_SCALE_LIMIT_S").ok().and_then(|v| v.parse().ok()).unwrap_or(600));
    let (applied_s, secs) = settle(&roles, &last, t0, limit).await?;
    let (cpu, ncpu) = (self_cpu_s() - cpu0, nats.cpu_s() - ncpu0);
    let applied: u64 =
        roles.iter().map(|a| a.shared.cluster.records_applied.load(std::sync::atomic::Ordering::Relaxed)).sum();
    let events: u64 =
        roles.iter().map(|a| a.shared.cluster.events_published.load(std::sync::atomic::Ordering::Relaxed)).sum();
    let remakes: u64 =
        roles.iter().map(|a| a.shared.cluster.consumer_remakes.load(std::sync::atomic::Ordering::Relaxed)).sum();
    for a in &roles {
        a.shutdown();
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Row {
        what: format!("matcher ({} nodes, {} rounds)", spec.nodes, spec.rounds),
        note: format!(
            "{} messages in, applied at {applied_s:.2} s; {events} events out; consumers remade {remakes}",
            p.messages
        ),
        ..Row::records(shards, applied, secs, (cpu, ncpu))
    })
}

fn batch_of(node: u64, batch_seq: u64, lane: Class, frames: impl Iterator<Item = Vec<u8>>) -> Vec<u8> {
    let mut w = BatchWriter::with_capacity(70_000);
    w.begin(&BatchMeta {
        node_id: node,
        epoch: 1,
        shipper_session: 1,
        batch_seq,
        lane: lane.code(),
        clock_mono_ns: 0,
        clock_realtime_ns: 0,
    });
    for f in frames {
        let _ = w.push_frame(&f);
    }
    w.finish(&RunningTotals::default()).to_vec()
}

/// Pre-built batches for one ingest shard: `n` batches over 8 nodes of its own, bulk
/// (64 KiB of 48-byte packets) or lifecycle (P0 collective frames).
fn ingest_input(shard: u32, n: usize, lifecycle: bool) -> Vec<(NodeId, Vec<u8>)> {
    let per_bulk = 65_536 / 48 - 4;
    let per_p0 = 512;
    let mut seqs = [0u64; 8];
    (0..n)
        .map(|b| {
            let k = b % 8;
            let node = u64::from(shard) * 100 + k as u64 + 1;
            let batch_seq = (b / 8) as u64 + 1;
            let seq0 = seqs[k];
            let bytes = if lifecycle {
                seqs[k] += per_p0;
                batch_of(
                    node,
                    batch_seq,
                    Class::P0,
                    (0..per_p0).map(|i| {
                        let seq = seq0 + i;
                        let phase = if i % 2 == 0 { Phase::KernelStart } else { Phase::KernelEnd };
                        sample::collective(StreamId::new(Class::P0, 0, 0), seq, seq * 1000, seq / 2 + 1, phase)
                            .as_bytes()
                            .to_vec()
                    }),
                )
            } else {
                seqs[k] += per_bulk as u64 / 2;
                batch_of(
                    node,
                    batch_seq,
                    Class::P2,
                    (0..per_bulk).map(|i| {
                        let cpu = u16::try_from(i % 2).unwrap_or(0);
                        let seq = seq0 + (i / 2) as u64;
                        sample::bulk_packet(StreamId::new(Class::P2, 1, cpu), seq, seq).as_bytes().to_vec()
                    }),
                )
            };
            (NodeId(node), bytes)
        })
        .collect()
}

/// One ingest shard on this thread: its batches through an ingest-role core, its
/// records to JetStream. Returns (frames, records published, this thread's CPU seconds).
fn ingest_shard(url: String, shard: u32, input: Vec<(NodeId, Vec<u8>)>) -> Result<(u64, u64, f64), String> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let js = cluster::connect(&cluster_config(&url, ShardRole::Ingest { shard }, 2, unix_ms()), "loadgen-ingest")
            .await?;
        let mut p = Publisher::new(js, 2, shard);
        let mut core = Core::new(IngestConfig::default(), MatcherConfig::default(), 0);
        core.set_role(Role::Ingest { shard });
        let mut scratch = SummaryCheck::default();
        let (mut frames, mut published) = (0u64, 0u64);
        let cpu0 = thread_cpu_s();
        for (i, (node, b)) in input.iter().enumerate() {
            let Ok(view) = BatchView::parse(b) else { continue };
            if view.validate(&mut scratch).is_err() {
                continue;
            }
            frames += u64::from(view.header.frame_count.get());
            let now = i as u64 * 100_000;
            let _ = core.receive_batch(now, *node, 100_000, &view);
            if i % 64 == 63 {
                core.handle_timeout(now);
            }
            while core.poll_event().is_some() {}
            if core.unpublished().len() >= PER_MESSAGE {
                let through = core.unpublished().last().map_or(0, |u| u.0);
                for (_, _, r) in core.unpublished() {
                    p.push(r).await?;
                }
                published += core.unpublished().len() as u64;
                core.mark_published(through);
            }
        }
        for (_, _, r) in core.unpublished() {
            p.push(r).await?;
        }
        p.flush().await?;
        published += core.unpublished().len() as u64;
        Ok((frames, published, thread_cpu_s() - cpu0))
    })
}

/// 2: frames/s through `shards` ingest shards, one thread each.
fn ingests(spec: &ScaleSpec, shards: u32, lifecycle: bool) -> Result<Row, String> {
    let nats = Nats::start()?;
    // Streams made before the clock starts.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(cluster::connect(&cluster_config(&nats.url, ShardRole::Api, 2, unix_ms()), "loadgen-setup"))?;
    let inputs: Vec<_> = (0..shards).map(|s| ingest_input(s, spec.ingest_batches, lifecycle)).collect();
    let (ncpu0, t0) = (nats.cpu_s(), Instant::now());
    let handles: Vec<_> = inputs
        .into_iter()
        .enumerate()
        .map(|(s, input)| {
            let url = nats.url.clone();
            std::thread::spawn(move || ingest_shard(url, u32::try_from(s).unwrap_or(0), input))
        })
        .collect();
    let (mut frames, mut published, mut cpu) = (0u64, 0u64, 0.0);
    for h in handles {
        let (f, p, c) = h.join().map_err(|_| "an ingest thread panicked".to_owned())??;
        frames += f;
        published += p;
        cpu += c;
    }
    let (secs, ncpu) = (t0.elapsed().as_secs_f64(), nats.cpu_s() - ncpu0);
    Ok(Row {
        what: format!("ingest, {} batches", if lifecycle { "lifecycle (P0)" } else { "bulk (P2)" }),
        shards,
        items: frames,
        unit: "frames",
        secs,
        cpu_s: cpu,
        nats_cpu_s: ncpu,
        note: format!("{published} records published"),
    })
}

/// 3: the large run, produced while two matcher shards consume.
async fn big(spec: &ScaleSpec, out: &mut String) -> Result<Row, String> {
    let shards = 2;
    let nats = Nats::start()?;
    let span_ms = spec.big_rounds * PERIOD_NS / 1_000_000;
    // The run is slower than real time: its records' times run ahead of nothing.
    let origin_ms = unix_ms().saturating_sub(span_ms + 2_000);
    let js = cluster::connect(&cluster_config(&nats.url, ShardRole::Api, shards, origin_ms), "loadgen-big").await?;
    let dir = std::env::temp_dir().join(format!("rw-scale-certs-big-{}", std::process::id()));
    // Each shard's verdict store (its local API's copy) capped at 32 MiB and final ops
    // remembered 5 s, so the run reaches its caps and shows where memory stops.
    let roles = Arc::new(start_matchers(&nats.url, shards, origin_ms, &dir, Some(BIG_STORE_BYTES)).await?);
    let mut p = Publisher::new(js.clone(), shards, 0);
    let mut seqs = vec![0u64; spec.big_nodes as usize];
    let (cpu0, ncpu0) = (self_cpu_s(), nats.cpu_s());
    let mut produced = 0u64;
    for r in announce(spec.big_nodes) {
        p.push(&r).await?;
    }
    let _ = writeln!(
        out,
        "  {}-node run, in 4 equal parts, each produced then drained: RSS after each (this process: both matcher shards, their NATS clients, the producer)",
        spec.big_nodes
    );
    // Produced in parts, each drained before the next: memory that is bounded stops
    // growing once the caps are reached and the clients' prefetch is full.
    let mut secs = 0.0;
    let part = (spec.big_rounds / 4).max(1);
    let mut r = 0;
    while r < spec.big_rounds {
        let started = Instant::now();
        let end = (r + part).min(spec.big_rounds);
        for round_no in r..end {
            for rec in round(spec.big_nodes, round_no, &mut seqs) {
                p.push(&rec).await?;
                produced += 1;
            }
        }
        p.flush().await?;
        let mut last = Vec::new();
        for m in 0..shards {
            last.push(last_seq(&js, m).await?);
        }
        secs += settle(&roles, &last, started, Duration::from_secs(900)).await?.1;
        let _ = writeln!(out, "    rounds {:>4}..{:<4} drained: RSS {:>7.1} MiB", r, end, rss_mib());
        r = end;
    }
    let (cpu, ncpu) = (self_cpu_s() - cpu0, nats.cpu_s() - ncpu0);
    let applied: u64 =
        roles.iter().map(|a| a.shared.cluster.records_applied.load(std::sync::atomic::Ordering::Relaxed)).sum();
    for (m, a) in roles.iter().enumerate() {
        if let Ok(core) = a.shared.core() {
            let mut maps = core.map_sizes();
            maps.sort_by_key(|x| std::cmp::Reverse(x.len.saturating_mul(1000) / x.cap.max(1)));
            let top: Vec<String> = maps.iter().take(3).map(|x| format!("{} {}/{}", x.name, x.len, x.cap)).collect();
            drop(core);
            let (bytes, max) = {
                let st = a.shared.store();
                (st.bytes(), st.config().max_bytes)
            };
            #[allow(clippy::cast_precision_loss, reason = "MiB")]
            let _ = writeln!(
                out,
                "    matcher {m}: fullest maps {}; verdict store {:.1} of {:.0} MiB",
                top.join(", "),
                bytes as f64 / f64::from(1u32 << 20),
                max as f64 / f64::from(1u32 << 20)
            );
        }
    }
    for a in roles.iter() {
        a.shutdown();
    }
    let _ = std::fs::remove_dir_all(&dir);
    #[allow(clippy::cast_precision_loss, reason = "rates")]
    let realtime = f64::from(spec.big_nodes) * f64::from(GPUS) * 2.0 / (PERIOD_NS as f64 / 1e9)
        + f64::from(spec.big_nodes) / (PERIOD_NS as f64 / 1e9);
    #[allow(clippy::cast_precision_loss, reason = "rates")]
    let sustained = applied as f64 / secs;
    Ok(Row {
        what: format!("matcher, {} nodes, 4 parts produced, drained", spec.big_nodes),
        note: format!(
            "{produced} produced; real time needs {realtime:.0} records/s: {:.2}x real time",
            sustained / realtime.max(1.0)
        ),
        ..Row::records(shards, applied, secs, (cpu, ncpu))
    })
}

/// Runs the whole measurement; returns the table.
///
/// # Errors
/// `nats-server` missing or failing, or a role that did not start.
pub async fn run(spec: ScaleSpec) -> Result<String, String> {
    let mut out = String::new();
    let host = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned()))
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let _ = writeln!(out, "loadgen scale — this machine: {cores} cores, {host}; one local nats-server (JetStream, R1)");
    // The large run first: this process's RSS is then its own.
    let mut extra = String::new();
    let big_row = big(&spec, &mut extra).await?;
    let mut rows = Vec::new();
    for shards in [1, 2] {
        rows.push(matchers(&spec, shards).await?);
    }
    for lifecycle in [false, true] {
        for shards in [1, 2] {
            let s = spec;
            rows.push(
                tokio::task::spawn_blocking(move || ingests(&s, shards, lifecycle))
                    .await
                    .map_err(|e| e.to_string())??,
            );
        }
    }
    rows.push(big_row);
    let _ = writeln!(
        out,
        "{:<46} {:>6} {:>12} {:>8} {:>14} {:>12} {:>12}  note",
        "what", "shards", "items", "seconds", "items/s", "cpu ns/item", "nats ns/item"
    );
    for r in &rows {
        #[allow(clippy::cast_precision_loss, reason = "rates")]
        let (rate, ns, nns) = (
            r.items as f64 / r.secs.max(1e-9),
            r.cpu_s * 1e9 / (r.items.max(1) as f64),
            r.nats_cpu_s * 1e9 / (r.items.max(1) as f64),
        );
        let _ = writeln!(
            out,
            "{:<46} {:>6} {:>12} {:>8.2} {:>8.0} {:<5} {:>12.0} {:>12.0}  {}",
            r.what, r.shards, r.items, r.secs, rate, r.unit, ns, nns, r.note
        );
    }
    out.push_str(&extra);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{PERIOD_NS, announce, round};
    use ringwatch_core::shard::Role;
    use ringwatch_core::verdict::MatcherEvent;
    use ringwatch_core::{Core, IngestConfig, MatcherConfig};

    #[test]
    fn the_synthetic_cluster_s_ops_are_judged_completed_by_a_matcher_core() {
        let (nodes, rounds) = (8u32, 10u64);
        let mut core = Core::new(IngestConfig::default(), MatcherConfig::default(), 0);
        core.set_role(Role::Matcher { shard: 0, shards: 1 });
        let mut seqs = vec![0u64; nodes as usize];
        let now = rounds * PERIOD_NS + 2_000_000_000;
        core.apply_records(now, &announce(nodes));
        for r in 0..rounds {
            core.apply_records(now, &round(nodes, r, &mut seqs));
        }
        core.handle_timeout(now);
        let mut events = Vec::new();
        while let Some(e) = core.poll_event() {
            events.push(e);
        }
        let kinds: Vec<String> = events.iter().take(3).map(|e| format!("{e:?}")).collect();
        // A matcher shard's message of 256 events stays far under NATS's 1 MiB default
        // payload cap.
        let b = ringwatch_core::shard::VerdictBatch {
            shard: 0,
            epoch: 1,
            first: 0,
            events: events.iter().take(256).cloned().collect(),
        };
        let bytes = ringwatch_core::shard::encode(&b).unwrap().len();
        assert!(bytes < 256 << 10, "{bytes} bytes");
        assert!(events.iter().any(|e| matches!(e, MatcherEvent::Verdict(_))), "{} events: {kinds:?}", events.len());
    }
}
