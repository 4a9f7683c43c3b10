//! QUIC ingest: accept shippers, check who they are, validate their batches, feed the
//! core, answer with acks and nacks.
//!
//! Per connection: the peer's identity is its client certificate's DNS SAN (verified
//! against the configured CA during the handshake); `node_id` = first 8 bytes of
//! SHA-256(name). The shipper's control stream must open with the preface of a control
//! protocol this aggregator speaks (this build's, 3, or the one before, 2: a rolling
//! upgrade of either side keeps working; others are closed with `close::VERSION`); then
//! every unidirectional stream carries one batch. A batch is validated in place (envelope,
//! CRC, frames, stream summary), its `node_id` checked against the certificate, and
//! handed to `Core::receive_batch`; the answer goes back on the control stream. With
//! snapshots configured (durability `snapshot`) a protocol-3 connection's P0/P1 batches
//! are also acked `durable` once a snapshot on disk holds them (at most 65,536 awaiting
//! per connection).
//!
//! Memory per connection is bounded by the transport's receive window (unread stream
//! data) plus [`STREAMS_IN_PROGRESS`] batches of at most [`MAX_BATCH_READ`] being read
//! or validated (224 MiB worst case, a few MiB typically), plus a header per waiting
//! stream (at most `max_streams`).
//!
//! Numbers from the wire: the core refuses a batch or a resume whose fields no real
//! shipper sends (`ringwatch_core::plausible`; nacked `malformed_frame` / connection
//! closed, counted, logged with the field); arithmetic here is checked or saturating
//! (`clippy::arithmetic_side_effects`).
#![warn(clippy::arithmetic_side_effects)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use proto_flat::batch::{BatchHeader, BatchView, SummaryCheck};
use proto_flat::codes::{AckStatus, Class, Durability, NackReason, WireEnum};
use proto_flat::control::{MIN_CONTROL_VERSION, encode_ack, encode_hello, encode_nack, preface_version};
use ringwatch_core::{NodeId, Receipt};
use ringwatch_transport::{CONTROL_PREFACE, close, peer_name};
use tokio::sync::mpsc;
use zerocopy::FromBytes;

use crate::state::{Counters, LOG_SUMMARY_MS, NodeEntry, Shared};
use crate::supervise::guard;

/// After this many rejected batches a connection is closed (a broken or hostile peer
/// must not make us validate garbage forever).
pub const REJECT_THRESHOLD: u64 = 64;

/// Batch streams read at once per connection, per lane (P0, P1, bulk). Streams beyond
/// it wait with only their header read; with [`MAX_BATCH_READ`] this bounds what one
/// peer can make us hold.
pub const STREAMS_IN_PROGRESS: [usize; 3] = [32, 16, 64];

/// How long one batch stream may take to arrive once its header did.
pub const STREAM_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest batch read (the shipper's `max_batch_bytes` is at most 1 MiB of payload;
/// header and summary add little). Longer streams are refused `too_large`.
pub const MAX_BATCH_READ: usize = 2 << 20;

/// Accepts connections until the endpoint closes. Each connection runs in its own task,
/// supervised ([`guard`]): a panic there closes that connection, counted.
pub async fn serve(endpoint: quinn::Endpoint, shared: Arc<Shared>) {
    while let Some(incoming) = endpoint.accept().await {
        shared.progress(&shared.tasks.ingest);
        let shared = Arc::clone(&shared);
        let remote = incoming.remote_address();
        tokio::spawn(async move {
            match incoming.await {
                Ok(conn) => {
                    let c = conn.clone();
                    if guard(&shared, "connection", connection(conn, Arc::clone(&shared))).await.is_none() {
                        c.close(close::PROTOCOL.into(), b"aggregator task failed");
                    }
                }
                Err(e) => {
                    Counters::inc(&shared.counters.handshake_failures);
                    if let Some(held_back) = shared.handshake_log.allow(shared.real_ms(), LOG_SUMMARY_MS) {
                        tracing::warn!(
                            %remote,
                            error = %e,
                            held_back,
                            total = shared.counters.handshake_failures.load(Ordering::Relaxed),
                            "handshake failed (one line per 10 s at most: held_back failed since the last)"
                        );
                    }
                }
            }
        });
    }
}

/// The answer to one batch.
enum Answer {
    /// `(session, status, batch_seq, capture)`: `capture` is the snapshot capture number
    /// the batch was applied under, when its connection gets a durable ack for it (a
    /// P0/P1 batch, control protocol 3, durability `snapshot`).
    Ack(u64, AckStatus, u64, Option<u64>),
    Nack(u64, u64, NackReason),
    /// The core's node cap is reached: nothing applied, the connection is closed (the
    /// shipper keeps its batches and resends them on a later connection).
    CloseNodeCap,
    /// The core failed (the process is exiting): nothing is answered, the connection is
    /// closed; the shipper resends what was not acked to the restarted aggregator.
    CloseFailed,
}

async fn connection(conn: quinn::Connection, shared: Arc<Shared>) {
    let remote = conn.remote_address();
    let name = match peer_name(&conn) {
        Ok(n) => n,
        Err(e) => {
            Counters::inc(&shared.counters.identity_refused);
            if let Some(held_back) = shared.handshake_log.allow(shared.real_ms(), LOG_SUMMARY_MS) {
                tracing::warn!(%remote, error = %e, held_back, "peer refused");
            }
            conn.close(close::REFUSED.into(), e.to_string().as_bytes());
            return;
        }
    };
    let node = NodeId(proto_flat::node_id_of(&name));
    Counters::inc(&shared.counters.connections);
    shared
        .nodes
        .entry(node)
        .and_modify(|e| {
            e.live = e.live.saturating_add(1);
            e.connections = e.connections.saturating_add(1);
        })
        .or_insert_with(|| NodeEntry { name: name.clone(), live: 1, connections: 1, last_shipper_session: 0 });
    tracing::info!(%remote, node = %name, "shipper connected");
    // However this task ends — a return, or a panic caught by its supervisor — the node
    // is marked disconnected.
    let _registered = Registered { shared: Arc::clone(&shared), node };

    let (ctl_send, ctl_recv) = match tokio::time::timeout(Duration::from_secs(10), conn.accept_bi()).await {
        Ok(Ok(s)) => s,
        _ => {
            Counters::inc(&shared.counters.protocol_errors);
            conn.close(close::PROTOCOL.into(), b"no control stream");
            return;
        }
    };
    let mut ctl_recv = ctl_recv;
    let version = match preface(&mut ctl_recv, shared.max_control_version).await {
        Preface::Speaks(v) => v,
        Preface::Unsupported(v) => {
            Counters::inc(&shared.counters.protocol_refused);
            tracing::warn!(%remote, node = %name, version = v, "control protocol not spoken here: closing");
            let why =
                format!("control protocol {v} not supported: {MIN_CONTROL_VERSION}..={}", shared.max_control_version);
            conn.close(close::VERSION.into(), why.as_bytes());
            return;
        }
        Preface::Bad => {
            Counters::inc(&shared.counters.protocol_errors);
            conn.close(close::PROTOCOL.into(), b"bad control preface");
            return;
        }
    };
    if version < 3 {
        Counters::inc(&shared.counters.connections_protocol_2);
    }
    // Durable acks only where the aggregator keeps anything and the shipper understands.
    let durable = version >= 3 && matches!(shared.durability, Durability::Snapshot | Durability::Jetstream);
    // The session's resume, applied before any batch of this connection is read.
    match read_resume(&mut ctl_recv).await {
        Ok(r) => {
            let now = shared.now();
            let Ok(mut core) = shared.core() else {
                conn.close(close::SHUTDOWN.into(), b"aggregator restarting");
                return;
            };
            let rtt = shared.aggregator_ns(conn.rtt());
            let clock = (r.sent_ns, rtt);
            let done = core.handle_resume(now, node, r.session, r.epoch, r.next_batch_seq, clock, &r.held, &r.floors);
            shared.drain_events(&mut core);
            drop(core);
            let done = match done {
                Ok(d) => d,
                Err(why) => {
                    Counters::inc(&shared.counters.protocol_errors);
                    tracing::warn!(%remote, node = %name, error = %why, "implausible resume: closing");
                    conn.close(close::PROTOCOL.into(), b"implausible resume");
                    return;
                }
            };
            if done.refused {
                conn.close(close::REFUSED.into(), b"aggregator node cap reached");
                return;
            }
            if done.batches_settled > 0 || done.stream_windows > 0 {
                tracing::info!(
                    node = %name,
                    session = format!("{:016x}", r.session),
                    batches_settled = done.batches_settled,
                    stream_windows = done.stream_windows,
                    "session resumed: settled what another instance (or a loss report) took"
                );
            }
        }
        Err(why) => {
            Counters::inc(&shared.counters.protocol_errors);
            tracing::warn!(%remote, node = %name, error = %why, "bad resume");
            conn.close(close::PROTOCOL.into(), b"bad resume");
            return;
        }
    }
    let (tx, rx) = mpsc::channel::<Answer>(4096);
    let writer = {
        let (sh, c) = (Arc::clone(&shared), conn.clone());
        tokio::spawn(async move {
            if guard(&sh, "control writer", control_writer(ctl_send, rx, Arc::clone(&sh), version)).await.is_none() {
                c.close(close::PROTOCOL.into(), b"aggregator task failed");
            }
        })
    };
    let rejected = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // Per lane, how many batches may be read at once: a stream's lane is known from its
    // header, so P0 and P1 never queue behind bulk streams being read (unread bulk data
    // waits in quinn's flow-controlled buffers instead).
    let lanes: Arc<[tokio::sync::Semaphore; 3]> = Arc::new(STREAMS_IN_PROGRESS.map(tokio::sync::Semaphore::new));
    loop {
        let stream = match conn.accept_uni().await {
            Ok(s) => s,
            Err(e) => {
                tracing::info!(node = %name, reason = %e, "shipper disconnected");
                break;
            }
        };
        let (shared, tx, conn2, rejected) = (Arc::clone(&shared), tx.clone(), conn.clone(), Arc::clone(&rejected));
        let lanes = Arc::clone(&lanes);
        tokio::spawn(async move {
            let sh = Arc::clone(&shared);
            let c = conn2.clone();
            let stream_task = async move {
                let mut stream = stream;
                let mut head = [0u8; size_of::<BatchHeader>()];
                let got = match stream.read_exact(&mut head).await {
                    Ok(()) => head.len(),
                    // Shorter than a header: validated (and rejected) as it is.
                    Err(quinn::ReadExactError::FinishedEarly(n)) => n,
                    Err(_) => {
                        Counters::inc(&shared.counters.stream_errors);
                        return;
                    }
                };
                let lane = BatchHeader::read_from_bytes(&head).map_or(2, |h| usize::from(h.lane).min(2));
                let Some(pool) = lanes.get(lane) else { return };
                let Ok(_permit) = pool.acquire().await else { return };
                let mut bytes = head.get(..got).unwrap_or(&[]).to_vec();
                if got == head.len() {
                    // A stream that stalls must not hold its lane's permit forever: the
                    // shipper sends the batch again when its acks stall.
                    let read = tokio::time::timeout(
                        STREAM_READ_TIMEOUT,
                        stream.read_to_end(MAX_BATCH_READ.saturating_sub(head.len())),
                    );
                    let Ok(read) = read.await else {
                        Counters::inc(&shared.counters.stream_errors);
                        let _ = stream.stop(0u32.into());
                        return;
                    };
                    match read {
                        Ok(rest) => bytes.extend_from_slice(&rest),
                        Err(quinn::ReadToEndError::TooLong) => {
                            let ids = BatchHeader::read_from_bytes(&head)
                                .ok()
                                .map(|h| (h.shipper_session.get(), h.batch_seq.get()));
                            reject(&shared, &rejected, &conn2, &tx, ids, NackReason::TooLarge).await;
                            return;
                        }
                        Err(_) => {
                            Counters::inc(&shared.counters.stream_errors);
                            return;
                        }
                    }
                }
                if shared.draining.load(Ordering::Relaxed) {
                    // Stopping: the shipper keeps it for the next instance.
                    return;
                }
                let rtt = shared.aggregator_ns(conn2.rtt());
                // An ingest shard whose records wait for the bus reads nothing more
                // until they drain: QUIC flow control holds the shipper back.
                while shared.cluster_role.is_some() && shared.core().is_ok_and(|c| crate::cluster::backlogged(&c)) {
                    shared.cluster.backpressure_waits.fetch_add(1, Ordering::Relaxed);
                    shared.publish_drained.notified().await;
                }
                match apply(&shared, node, rtt, &bytes, durable) {
                    Ok(Answer::CloseNodeCap) => conn2.close(close::REFUSED.into(), b"aggregator node cap reached"),
                    Ok(Answer::CloseFailed) => conn2.close(close::SHUTDOWN.into(), b"aggregator restarting"),
                    Ok(answer) => {
                        let _ = tx.send(answer).await;
                    }
                    Err((ids, reason)) => reject(&shared, &rejected, &conn2, &tx, ids, reason).await,
                }
            };
            if guard(&sh, "batch stream", stream_task).await.is_none() {
                c.close(close::PROTOCOL.into(), b"aggregator task failed");
            }
        });
    }
    drop(tx);
    let _ = writer.await;
}

/// A registered connection: dropped when its task ends, however it ends.
struct Registered {
    shared: Arc<Shared>,
    node: NodeId,
}

impl Drop for Registered {
    fn drop(&mut self) {
        closed(&self.shared, self.node);
    }
}

/// One of `node`'s connections ended: the node is disconnected (and unreachable for the
/// core) only when it was the last one open.
fn closed(shared: &Shared, node: NodeId) {
    let last = shared.nodes.get_mut(&node).is_none_or(|mut e| {
        e.live = e.live.saturating_sub(1);
        e.live == 0
    });
    // An ingest shard stopping in order closes every connection itself: its nodes are
    // moving to the next instance (or another shard), not dying. Saying `unreachable` on
    // the bus would start the matchers' presumed-dead clock for live nodes, and a slow
    // handover then made their ranks final `unknown_silent` (wrong). A node that does not
    // come back is taken unreachable by the matchers' bus liveness timer.
    if !last || shared.draining.load(Ordering::Relaxed) {
        return;
    }
    let now = shared.now();
    if let Ok(mut core) = shared.core() {
        core.handle_connection_closed(now, node);
        shared.drain_events(&mut core);
    }
}

/// What a connection's control preface said.
enum Preface {
    /// A control protocol this aggregator speaks.
    Speaks(u16),
    /// A control protocol it does not (closed with `close::VERSION`).
    Unsupported(u16),
    /// Not a preface, or none within 10 s.
    Bad,
}

/// Reads the control preface: protocol `MIN_CONTROL_VERSION..=max` is spoken (this
/// build's and the one before, so a rolling upgrade of either side keeps working).
async fn preface(recv: &mut quinn::RecvStream, max: u16) -> Preface {
    let mut buf = [0u8; CONTROL_PREFACE.len()];
    let read = tokio::time::timeout(Duration::from_secs(10), recv.read_exact(&mut buf)).await;
    if !matches!(read, Ok(Ok(()))) {
        return Preface::Bad;
    }
    match preface_version(&buf) {
        Some(v) if (MIN_CONTROL_VERSION..=max).contains(&v) => Preface::Speaks(v),
        Some(v) => Preface::Unsupported(v),
        None => Preface::Bad,
    }
}

/// A decoded `resume`, owned.
struct Resume {
    session: u64,
    epoch: u64,
    next_batch_seq: u64,
    sent_ns: u64,
    held: Vec<(u64, u64)>,
    floors: Vec<(u32, u64)>,
}

/// Reads the one `resume` that follows the preface (within 10 s, at most
/// `MAX_CONTROL_LEN` bytes: the length is checked before anything is buffered).
async fn read_resume(recv: &mut quinn::RecvStream) -> Result<Resume, String> {
    use proto_flat::control::{ControlHeader, ControlMessage, MAX_CONTROL_LEN, parse_control};
    let read = async {
        let mut head = [0u8; size_of::<ControlHeader>()];
        recv.read_exact(&mut head).await.map_err(|e| e.to_string())?;
        let len = ControlHeader::read_from_bytes(&head).map_or(0, |h| h.length.get() as usize);
        if !(head.len()..=MAX_CONTROL_LEN).contains(&len) {
            return Err(format!("resume length {len} outside {}..={MAX_CONTROL_LEN}", head.len()));
        }
        let mut msg = vec![0u8; len];
        msg[..head.len()].copy_from_slice(&head);
        recv.read_exact(&mut msg[head.len()..]).await.map_err(|e| e.to_string())?;
        match parse_control(&msg) {
            Ok(Some((
                ControlMessage::Resume { shipper_session, epoch, next_batch_seq, sent_ns, held, streams },
                _,
            ))) => Ok(Resume {
                session: shipper_session,
                epoch,
                next_batch_seq,
                sent_ns,
                held: held.iter().map(|r| (r.first.get(), r.last.get())).collect(),
                floors: streams.iter().map(|s| (s.stream_id.get(), s.floor_seq.get())).collect(),
            }),
            Ok(Some((other, _))) => Err(format!("expected resume, got {other:?}")),
            Ok(None) => Err("truncated resume".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read).await.map_err(|_| "no resume within 10 s".to_owned())?
}

/// Validates and applies one batch. `Err` carries the (session, batch_seq) if the
/// header was readable, and the reason. `durable`: the connection gets durable acks, so
/// an applied (or duplicate) P0/P1 batch's answer carries the snapshot capture number it
/// was applied under (read under the core's lock, as the capture increments it).
#[allow(clippy::type_complexity, reason = "a private helper's pair of ids")]
fn apply(
    shared: &Shared,
    node: NodeId,
    rtt: u64,
    bytes: &[u8],
    durable: bool,
) -> Result<Answer, (Option<(u64, u64)>, NackReason)> {
    let ids = BatchHeader::read_from_prefix(bytes).ok().map(|(h, _)| (h.shipper_session.get(), h.batch_seq.get()));
    let view = BatchView::parse(bytes).map_err(|e| (ids, e.nack_reason()))?;
    let mut scratch = SummaryCheck::default();
    view.validate(&mut scratch).map_err(|e| (ids, e.nack_reason()))?;
    let (session, seq) = (view.header.shipper_session.get(), view.header.batch_seq.get());
    if view.header.node_id.get() != node.0 {
        Counters::inc(&shared.counters.node_mismatch);
        return Err((Some((session, seq)), NackReason::NodeMismatch));
    }
    if let Some(mut e) = shared.nodes.get_mut(&node) {
        e.last_shipper_session = session;
    }
    let now = shared.now();
    let keep = durable && matches!(view.lane(), Class::P0 | Class::P1);
    let (receipt, capture) = {
        let Ok(mut core) = shared.core() else { return Ok(Answer::CloseFailed) };
        let r = core.receive_batch(now, node, rtt, &view);
        shared.drain_events(&mut core);
        // Durable once a snapshot captured after now is on disk — or, for an ingest
        // shard, once every record produced so far is on the bus (`durable_gen` is then
        // the count of records published, plus one).
        let generation = if shared.durability == Durability::Jetstream {
            core.records()
        } else {
            shared.capture_gen.load(Ordering::Relaxed)
        };
        (r, keep.then_some(generation))
    };
    match receipt {
        Receipt::Applied => {
            Counters::inc(&shared.counters.batches_applied);
            Ok(Answer::Ack(session, AckStatus::Applied, seq, capture))
        }
        Receipt::Duplicate => {
            // Applied before — maybe after the last snapshot: durable with the next one.
            Counters::inc(&shared.counters.batches_duplicate);
            Ok(Answer::Ack(session, AckStatus::Duplicate, seq, capture))
        }
        Receipt::DedupWindowFull => Err((Some((session, seq)), NackReason::DedupWindowFull)),
        Receipt::NodeCapReached => Ok(Answer::CloseNodeCap),
        Receipt::Implausible(why) => {
            tracing::warn!(node = node.0, session, batch_seq = seq, error = %why, "implausible batch: nacked");
            Err((Some((session, seq)), NackReason::MalformedFrame))
        }
    }
}

async fn reject(
    shared: &Shared,
    rejected: &std::sync::atomic::AtomicU64,
    conn: &quinn::Connection,
    tx: &mpsc::Sender<Answer>,
    ids: Option<(u64, u64)>,
    reason: NackReason,
) {
    let slot = usize::from(reason.code()).min(15);
    Counters::inc(&shared.counters.rejected_by_reason[slot]);
    if let Some((session, seq)) = ids {
        let _ = tx.send(Answer::Nack(session, seq, reason)).await;
    }
    if rejected.fetch_add(1, Ordering::Relaxed).saturating_add(1) == REJECT_THRESHOLD {
        Counters::inc(&shared.counters.connections_closed_abuse);
        tracing::warn!(remote = %conn.remote_address(), "closing: too many rejected batches");
        conn.close(close::ABUSE.into(), b"too many rejected batches");
    }
}

/// P0/P1 batches one connection remembers for a durable ack (beyond: counted in
/// `durable_untracked`; the shipper keeps them until its next connection).
const MAX_AWAITING_DURABLE: usize = 65_536;

/// Writes `hello` (protocol `version`), then every answer, on the control stream;
/// consecutive acks of one session and status are merged into ranges. Batches applied
/// under snapshot capture `g` are acked `durable` once a snapshot numbered above `g` is
/// on disk.
async fn control_writer(
    mut send: quinn::SendStream,
    mut rx: mpsc::Receiver<Answer>,
    shared: Arc<Shared>,
    version: u16,
) {
    let _ = send.set_priority(ringwatch_transport::CONTROL_PRIORITY);
    let mut out = Vec::with_capacity(4096);
    encode_hello(&mut out, shared.instance, shared.epoch, version, shared.durability);
    if send.write_all(&out).await.is_err() {
        return;
    }
    let mut durable_rx = shared.durable_gen.subscribe();
    let mut awaiting: Vec<(u64, u64, u64)> = Vec::new();
    let mut pending = Vec::new();
    loop {
        out.clear();
        tokio::select! {
            first = rx.recv() => {
                let Some(first) = first else { break };
                pending.clear();
                pending.push(first);
                while pending.len() < 1024 {
                    match rx.try_recv() {
                        Ok(a) => pending.push(a),
                        Err(_) => break,
                    }
                }
                encode_answers(&mut out, &mut pending, &shared, &mut awaiting);
                // What is already durable need not wait for the next change.
                let on_disk = *durable_rx.borrow();
                encode_durable(&mut out, &mut awaiting, on_disk, &shared);
            }
            changed = durable_rx.changed() => {
                if changed.is_err() {
                    break;
                }
                let on_disk = *durable_rx.borrow_and_update();
                encode_durable(&mut out, &mut awaiting, on_disk, &shared);
            }
        }
        if !out.is_empty() && send.write_all(&out).await.is_err() {
            shared.awaiting_durable.fetch_sub(awaiting.len() as u64, Ordering::Relaxed);
            return;
        }
    }
    shared.awaiting_durable.fetch_sub(awaiting.len() as u64, Ordering::Relaxed);
    let _ = send.finish();
}

/// `ack durable` for every awaiting batch applied before capture `on_disk` (ranges per
/// session).
fn encode_durable(out: &mut Vec<u8>, awaiting: &mut Vec<(u64, u64, u64)>, on_disk: u64, shared: &Shared) {
    if shared.holding_acks() {
        return;
    }
    let mut done: Vec<(u64, u8, u64)> = Vec::new();
    awaiting.retain(|&(session, seq, capture)| {
        if capture < on_disk {
            done.push((session, AckStatus::Durable.code(), seq));
            false
        } else {
            true
        }
    });
    shared.counters.batches_durable.fetch_add(done.len() as u64, Ordering::Relaxed);
    shared.awaiting_durable.fetch_sub(done.len() as u64, Ordering::Relaxed);
    encode_acks(out, &mut done);
}

fn encode_answers(out: &mut Vec<u8>, pending: &mut [Answer], shared: &Shared, awaiting: &mut Vec<(u64, u64, u64)>) {
    let holding = shared.holding_acks();
    let mut acks: Vec<(u64, u8, u64)> = Vec::new();
    for a in pending.iter() {
        match *a {
            Answer::Ack(session, status, seq, capture) => {
                if holding {
                    Counters::inc(&shared.counters.acks_held);
                } else {
                    acks.push((session, status.code(), seq));
                    if let Some(c) = capture {
                        if awaiting.len() < MAX_AWAITING_DURABLE {
                            awaiting.push((session, seq, c));
                            shared.awaiting_durable.fetch_add(1, Ordering::Relaxed);
                        } else {
                            Counters::inc(&shared.counters.durable_untracked);
                        }
                    }
                }
            }
            Answer::Nack(session, seq, reason) => encode_nack(out, session, seq, reason),
            Answer::CloseNodeCap | Answer::CloseFailed => {}
        }
    }
    encode_acks(out, &mut acks);
}

/// `(session, status, batch_seq)` as ack messages: sorted, consecutive seqs of one
/// session and status merged into ranges.
fn encode_acks(out: &mut Vec<u8>, acks: &mut [(u64, u8, u64)]) {
    acks.sort_unstable();
    let mut i = 0;
    while let Some(&(session, status, _)) = acks.get(i) {
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        while let Some(&(s, st, seq)) = acks.get(i) {
            if s != session || st != status || ranges.len() >= 4000 {
                break;
            }
            match ranges.last_mut() {
                Some(r) if r.1.checked_add(1) == Some(seq) => r.1 = seq,
                _ => ranges.push((seq, seq)),
            }
            i = i.saturating_add(1);
        }
        // ≤ 4,000 ranges fit a control message (64 KiB), so this cannot fail.
        let _ = encode_ack(out, session, AckStatus::from_code(status), &ranges);
    }
}
