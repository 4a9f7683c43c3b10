//! Scale-out over NATS JetStream (issue 28): the shard roles' I/O.
//!
//! One aggregator binary, four roles (`--role`): `all` (one process, no NATS: the
//! default), `ingest`, `matcher` and `api`. What travels, and where:
//!
//! | stream | subjects | written by | read by |
//! |---|---|---|---|
//! | `RINGWATCH_RECORDS_<m>` | `ringwatch.records.<m>` | every ingest shard | matcher shard `m` |
//! | `RINGWATCH_VERDICTS` | `ringwatch.verdicts.<m>` | matcher shard `m` | the API role |
//! | `RINGWATCH_STATE` | `ringwatch.nodes.<node>`, `ringwatch.health.<m>` (the last of each kept) | ingest / matcher shards | the API role |
//!
//! - An **ingest shard** runs today's QUIC ingest, seq accounting and bulk path; its
//!   core keeps the records it produces unpublished (`Core::unpublished`), and
//!   [`publish_records`] sends them, in production order, each to the subject of the
//!   matcher shard [`ringwatch_core::shard::route`] names (a node's watermarks to every
//!   one, after the records they cover), one message in flight per matcher shard,
//!   retried under the same `Nats-Msg-Id` until JetStream acks it; only then are they
//!   dropped from the core (a snapshot holds what is not yet acked). While more than
//!   [`ringwatch_core::shard::MAX_UNPUBLISHED`] wait, batch streams are not read (QUIC
//!   flow control holds the shippers back, their spools keep the batches).
//!   [`publish_nodes`] publishes each node's ingest state (trackers, watermarks,
//!   liveness) with its name twice a second.
//! - A **matcher shard** reads its stream from the start with an ordered consumer
//!   ([`consume_records`]: a restart replays what the stream holds), applies the
//!   records it owns, and publishes its events ([`publish_verdicts`]) and its node and
//!   GPU health ([`publish_health`]).
//! - The **API role** reads the verdict stream from the start and the state stream's
//!   last message per subject, into a core in the `Api` role: the HTTP API and the
//!   event stream serve them as they serve one process's.
//!
//! Time: every role's aggregator time is the wall clock since `time_origin_unix_ms`
//! (times `time_scale`), so records, deadlines and health evidence mean the same in
//! every process.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use ringwatch_core::Core;
use ringwatch_core::records::NodeId;
use ringwatch_core::shard::{self, NodeSummary, RecordBatch, ShardHealth, VerdictBatch};
use ringwatch_core::verdict::MatcherEvent;

use crate::state::Shared;

/// Which shard role this process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardRole {
    Ingest { shard: u32 },
    Matcher { shard: u32 },
    Api,
}

/// The shard roles' configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    pub role: ShardRole,
    /// NATS servers (`nats://host:port`), any of the cluster's.
    pub nats: Vec<String>,
    /// How many matcher shards there are (every ingest and matcher shard must agree).
    pub matcher_shards: u32,
    /// JetStream replicas of each stream (3 on a 3-server cluster).
    pub replicas: usize,
    /// Each records stream's byte cap (the oldest go first past it: a matcher shard
    /// that far behind counts what it missed).
    pub stream_max_bytes: i64,
    /// How long the verdict stream keeps verdicts (the API role replays it at start).
    pub verdict_max_age: Duration,
    /// Aggregator time zero, as Unix ms (every role's clock).
    pub time_origin_unix_ms: u64,
}

impl ClusterConfig {
    /// The core's role for this shard role.
    #[must_use]
    pub fn core_role(&self) -> shard::Role {
        match self.role {
            ShardRole::Ingest { shard } => shard::Role::Ingest { shard },
            ShardRole::Matcher { shard } => shard::Role::Matcher { shard, shards: self.matcher_shards },
            ShardRole::Api => shard::Role::Api,
        }
    }

    /// The role's name (logs, `/healthz`).
    #[must_use]
    pub fn role_name(&self) -> String {
        match self.role {
            ShardRole::Ingest { shard } => format!("ingest-{shard}"),
            ShardRole::Matcher { shard } => format!("matcher-{shard}"),
            ShardRole::Api => "api".into(),
        }
    }
}

/// What the shard roles count (`/v1/ingest` `cluster`).
#[derive(Debug, Default)]
pub struct ClusterCounters {
    /// Connected to NATS and the streams exist.
    pub connected: std::sync::atomic::AtomicBool,
    pub records_published: std::sync::atomic::AtomicU64,
    /// Records no matcher reads (bulk watermarks, loss intervals of bulk and P1 streams):
    /// not published; the node summaries carry their accounting.
    pub records_kept_local: std::sync::atomic::AtomicU64,
    pub record_messages_published: std::sync::atomic::AtomicU64,
    /// Publishes JetStream did not ack (each retried under the same message id).
    pub publish_failures: std::sync::atomic::AtomicU64,
    /// Publishes JetStream said it already held (a retry of one that had landed).
    pub publish_duplicates: std::sync::atomic::AtomicU64,
    /// Times a batch stream waited for the unpublished records to drain.
    pub backpressure_waits: std::sync::atomic::AtomicU64,
    pub node_summaries_published: std::sync::atomic::AtomicU64,
    /// Node summaries JetStream did not take (too large for the server's payload cap,
    /// or the bus unreachable); the next one follows half a second later.
    pub node_summaries_failed: std::sync::atomic::AtomicU64,
    /// Record batches routed for another number of matcher shards than this matcher's
    /// (a misconfiguration: `/healthz` says so; the records are applied as routed).
    pub shard_count_mismatches: std::sync::atomic::AtomicU64,
    pub records_applied: std::sync::atomic::AtomicU64,
    /// Records in a matcher shard's stream owned by another shard (never expected).
    pub records_not_owned: std::sync::atomic::AtomicU64,
    /// Messages a consumer could not decode (counted, logged, skipped).
    pub undecodable: std::sync::atomic::AtomicU64,
    /// Stream messages a consumer never saw: the stream dropped them past its limits
    /// before they were read.
    pub messages_expired: std::sync::atomic::AtomicU64,
    pub events_published: std::sync::atomic::AtomicU64,
    pub events_applied: std::sync::atomic::AtomicU64,
    pub node_summaries_applied: std::sync::atomic::AtomicU64,
    pub health_applied: std::sync::atomic::AtomicU64,
    /// Consumers made again after they stalled or ended ([`Reader`]).
    pub consumer_remakes: std::sync::atomic::AtomicU64,
    /// Per stream this role publishes to (records stream `m`, or the verdict stream's
    /// shard subject), the stream sequence of its last acked publish.
    pub acked_seq: std::sync::Mutex<std::collections::BTreeMap<u32, u64>>,
    /// The stream sequence of the last message a consumer applied (a matcher shard's
    /// records stream, the API role's verdict stream).
    pub applied_seq: std::sync::atomic::AtomicU64,
}

impl ClusterCounters {
    fn acked(&self, key: u32, seq: u64) {
        let mut g = self.acked_seq.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = g.entry(key).or_insert(0);
        *e = (*e).max(seq);
    }

    /// The last acked stream sequence of each stream published to.
    #[must_use]
    pub fn acked_seqs(&self) -> std::collections::BTreeMap<u32, u64> {
        self.acked_seq.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

pub use ringwatch_core::shard::MAX_UNPUBLISHED_EVENTS;

/// How long a records stream keeps records (a matcher shard without a snapshot replays
/// this far back at start).
pub const RECORDS_MAX_AGE: Duration = Duration::from_secs(86_400);

/// Records per message, at most (NATS's default payload cap is 1 MiB).
const RECORDS_PER_MESSAGE: usize = 1024;
/// Events per message, at most, and the encoded size a message keeps under (NATS's
/// default payload cap is 1 MiB: a message over it would be refused every time, and
/// the events behind it would never go).
const EVENTS_PER_MESSAGE: usize = 1024;
const EVENT_MESSAGE_BYTES: usize = 768 << 10;

/// The records stream of matcher shard `m`.
#[must_use]
pub fn records_stream(m: u32) -> String {
    format!("RINGWATCH_RECORDS_{m}")
}

/// The subject matcher shard `m` reads its records from.
#[must_use]
pub fn records_subject(m: u32) -> String {
    format!("ringwatch.records.{m}")
}

/// The verdict stream.
pub const VERDICTS_STREAM: &str = "RINGWATCH_VERDICTS";
/// The state stream (node summaries, shard health: the last of each subject kept).
pub const STATE_STREAM: &str = "RINGWATCH_STATE";

/// Aggregator time at this instant for `cfg` (wall clock since the origin, scaled).
#[must_use]
pub fn now_ns(cfg: &ClusterConfig, time_scale: f64) -> u64 {
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    let since = wall.saturating_sub(cfg.time_origin_unix_ms.saturating_mul(1_000_000));
    crate::state::scale_ns(since, time_scale)
}

/// Connects to NATS and makes sure every stream exists (created with this
/// configuration if missing; an existing one is used as it is).
///
/// # Errors
/// No server answered, or a stream could not be created.
pub async fn connect(cfg: &ClusterConfig, name: &str) -> Result<jetstream::Context, String> {
    let addrs: Vec<async_nats::ServerAddr> =
        cfg.nats.iter().map(|u| u.parse().map_err(|e| format!("NATS server {u:?}: {e}"))).collect::<Result<_, _>>()?;
    let client = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .connect(addrs)
        .await
        .map_err(|e| format!("connecting to NATS {:?}: {e}", cfg.nats))?;
    let js = jetstream::new(client);
    let base = stream::Config {
        storage: stream::StorageType::File,
        num_replicas: cfg.replicas,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    };
    for m in 0..cfg.matcher_shards {
        ensure(
            &js,
            stream::Config {
                name: records_stream(m),
                subjects: vec![records_subject(m)],
                max_bytes: cfg.stream_max_bytes,
                // Full: publishes fail and are retried, the ingest shards stop reading
                // batches (backpressure), never a record acked durable thrown away. Kept
                // a day: a matcher shard restarting without a snapshot replays that far.
                discard: stream::DiscardPolicy::New,
                max_age: RECORDS_MAX_AGE,
                ..base.clone()
            },
        )
        .await?;
    }
    ensure(
        &js,
        stream::Config {
            name: VERDICTS_STREAM.into(),
            subjects: vec!["ringwatch.verdicts.*".into()],
            max_age: cfg.verdict_max_age,
            max_bytes: cfg.stream_max_bytes,
            discard: stream::DiscardPolicy::Old,
            ..base.clone()
        },
    )
    .await?;
    ensure(
        &js,
        stream::Config {
            name: STATE_STREAM.into(),
            subjects: vec!["ringwatch.nodes.*".into(), "ringwatch.health.*".into()],
            max_messages_per_subject: 1,
            discard: stream::DiscardPolicy::Old,
            ..base
        },
    )
    .await?;
    Ok(js)
}

async fn ensure(js: &jetstream::Context, config: stream::Config) -> Result<(), String> {
    let name = config.name.clone();
    js.get_or_create_stream(config).await.map(|_| ()).map_err(|e| format!("stream {name}: {e}"))
}

/// Publishes `payload` to `subject` under `id` until JetStream acks it (the same id on
/// every try: a retry of a publish that landed is a duplicate JetStream drops).
async fn publish_acked(s: &Shared, js: &jetstream::Context, subject: String, id: String, payload: Vec<u8>) -> u64 {
    let c = &s.cluster;
    let mut wait = Duration::from_millis(50);
    let mut retry = false;
    loop {
        let msg = jetstream::message::PublishMessage::build().payload(payload.clone().into()).message_id(&id);
        let res = match js.send_publish(subject.clone(), msg).await {
            Ok(ack) => ack.await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match res {
            Ok(ack) => {
                if ack.duplicate {
                    c.publish_duplicates.fetch_add(1, Relaxed);
                    if !retry {
                        // Not a retry of ours: another process publishes under this id
                        // (two shards given one index?). JetStream kept the first.
                        tracing::error!(subject, id, "JetStream already held this message id on a first publish");
                    }
                }
                c.connected.store(true, Relaxed);
                return ack.sequence;
            }
            Err(e) => {
                if c.publish_failures.fetch_add(1, Relaxed).is_multiple_of(100) {
                    tracing::warn!(subject, id, error = %e, "publish not acked: retrying under the same id");
                }
                c.connected.store(false, Relaxed);
                retry = true;
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Ingest shard: publishes the core's unpublished records (see the module docs).
pub async fn publish_records(s: Arc<Shared>, cfg: ClusterConfig, js: jetstream::Context) {
    if !matches!(cfg.role, ShardRole::Ingest { .. }) {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        s.progress(&s.tasks.cluster);
        if publish_round(&s, &cfg, &js).await.is_none() {
            return;
        }
    }
}

/// Ingest shard, at an orderly stop (after the QUIC endpoint closed, so nothing new is
/// applied): publishes what is still unpublished, until `deadline`. Returns how many
/// records are left (0: everything is on the bus).
pub async fn flush_records(s: &Shared, cfg: &ClusterConfig, js: &jetstream::Context, deadline: Duration) -> usize {
    let left = || s.core().map_or(0, |c| c.unpublished().len());
    let _ = tokio::time::timeout(deadline, async {
        while left() > 0 {
            if publish_round(s, cfg, js).await.is_none() {
                return;
            }
        }
    })
    .await;
    left()
}

/// One round: up to [`RECORDS_PER_MESSAGE`] of the oldest unpublished records, one
/// message per matcher shard they go to, each retried until acked; then dropped from the
/// core and their batches made durable. How many records it took (`None`: the core
/// failed).
async fn publish_round(s: &Shared, cfg: &ClusterConfig, js: &jetstream::Context) -> Option<usize> {
    let ShardRole::Ingest { shard: me } = cfg.role else { return Some(0) };
    let shards = cfg.matcher_shards.max(1);
    let taken: Vec<(u64, u64, ringwatch_core::records::Record)> = {
        let core = s.core().ok()?;
        core.unpublished().iter().take(RECORDS_PER_MESSAGE).copied().collect()
    };
    let Some(&(last, _, _)) = taken.last() else { return Some(0) };
    let mut per: Vec<Vec<(u64, u64, ringwatch_core::records::Record)>> = vec![Vec::new(); shards as usize];
    let mut local = 0u64;
    for r in &taken {
        match shard::route(&r.2, shards) {
            shard::Route::One(m) => per.get_mut(m as usize).into_iter().for_each(|v| v.push(*r)),
            shard::Route::All => per.iter_mut().for_each(|v| v.push(*r)),
            shard::Route::Nowhere => local += 1,
        }
    }
    let sends = per.into_iter().enumerate().filter(|(_, v)| !v.is_empty()).map(|(m, records)| {
        let m = u32::try_from(m).unwrap_or(0);
        let first = records.first().map_or(0, |r| r.0);
        let batch = RecordBatch { ingest_shard: me, epoch: s.epoch, matcher_shards: shards, records };
        // The process's random instance in the id: a restarted shard numbers its records
        // from 0 again and must not be taken for a retry of its predecessor's.
        let id = format!("i{me}.{:016x}.m{m}.r{first}", s.instance);
        async move {
            match shard::encode(&batch) {
                Ok(payload) => {
                    let seq = publish_acked(s, js, records_subject(m), id, payload).await;
                    s.cluster.acked(m, seq);
                }
                Err(e) => tracing::error!(error = %e, "a record batch could not be encoded"),
            }
        }
    });
    futures_util::future::join_all(sends).await;
    s.cluster.records_published.fetch_add((taken.len() as u64).saturating_sub(local), Relaxed);
    s.cluster.records_kept_local.fetch_add(local, Relaxed);
    s.cluster.record_messages_published.fetch_add(1, Relaxed);
    s.core().ok()?.mark_published(last);
    // Batches whose records are all on the bus are durable: every record below index
    // `last + 1` is (`durable_gen` = records published + 1; see ingest).
    let upto = last.saturating_add(2);
    s.durable_gen.send_if_modified(|d| {
        let newer = upto > *d;
        if newer {
            *d = upto;
        }
        newer
    });
    s.publish_drained.notify_waiters();
    Some(taken.len())
}

/// Ingest shard: whether batch streams must wait for the bus (see the module docs).
pub fn backlogged(core: &Core) -> bool {
    core.unpublished().len() >= shard::MAX_UNPUBLISHED
}

/// Ingest shard: each node's ingest state, twice a second.
pub async fn publish_nodes(s: Arc<Shared>, cfg: ClusterConfig, js: jetstream::Context) {
    let ShardRole::Ingest { shard: me } = cfg.role else { return };
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        s.progress(&s.tasks.cluster_state);
        let summaries: Vec<NodeSummary> = {
            let Ok(core) = s.core() else { return };
            core.node_ids()
                .filter_map(|id| {
                    let state = core.node_state(id)?.clone();
                    let (shipper, owners) = (state.shipper, state.owners.clone());
                    let (name, live, connections) = s
                        .nodes
                        .get(&id)
                        .map_or_else(|| (format!("{:016x}", id.0), 0, 0), |e| (e.name.clone(), e.live, e.connections));
                    Some(NodeSummary { ingest_shard: me, node: id, name, live, connections, state, shipper, owners })
                })
                .collect()
        };
        for n in summaries {
            let subject = format!("ringwatch.nodes.{:016x}", n.node.0);
            match shard::encode(&n) {
                Ok(payload) => {
                    let res = match js.publish(subject, payload.into()).await {
                        Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    match res {
                        Ok(()) => {
                            s.cluster.node_summaries_published.fetch_add(1, Relaxed);
                        }
                        Err(e) => {
                            // The API keeps the node's previous state meanwhile.
                            if s.cluster.node_summaries_failed.fetch_add(1, Relaxed).is_multiple_of(100) {
                                tracing::warn!(node = %format!("{:016x}", n.node.0), error = %e, "node summary not published (the next one follows)");
                            }
                        }
                    }
                }
                Err(e) => tracing::error!(error = %e, "a node summary could not be encoded"),
            }
        }
    }
}

/// An ordered consumer of `stream` (only `filter`, when given) from sequence `from` (or,
/// with `last_per_subject`, from the last message of each subject), its messages as a
/// stream. Retried every second until it exists (a stream still being created, a
/// cluster still electing its leader), with a WARN each time.
async fn ordered(
    js: &jetstream::Context,
    stream: &str,
    filter: Option<&str>,
    last_per_subject: bool,
    from: u64,
) -> consumer::pull::Ordered {
    loop {
        let made = async {
            let st = js.get_stream(stream).await.map_err(|e| format!("stream {stream}: {e}"))?;
            let deliver_policy = match (last_per_subject, from) {
                (true, _) => consumer::DeliverPolicy::LastPerSubject,
                (false, 0 | 1) => consumer::DeliverPolicy::All,
                (false, start_sequence) => consumer::DeliverPolicy::ByStartSequence { start_sequence },
            };
            let c = st
                .create_consumer(consumer::pull::OrderedConfig {
                    deliver_policy,
                    filter_subject: filter.unwrap_or_default().to_owned(),
                    ..Default::default()
                })
                .await
                .map_err(|e| format!("consumer on {stream}: {e}"))?;
            c.messages().await.map_err(|e| format!("messages of {stream}: {e}"))
        };
        match made.await {
            Ok(m) => return m,
            Err(e) => {
                tracing::warn!(error = %e, "consumer not created; trying again in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// How long a consumer may go without a message before the stream is asked whether it
/// holds more (unfiltered), or the consumer is made again (filtered: their publishers
/// write at least twice a second, so a quiet this long is a stall or no publisher).
const STALL_CHECK: Duration = Duration::from_secs(1);
const FILTERED_QUIET: Duration = Duration::from_secs(10);

/// An ordered consumer that is made again when it ends or stalls. JetStream's ordered
/// pull consumers can stop delivering with messages still in the stream and no error
/// (nats.rs issues 860 and 1285; measured here: `loadgen scale`'s matcher stopped at 250
/// of 426 messages and never moved again). Each remake reads on after the last stream
/// sequence handed out (a filtered last-per-subject consumer reads the last of each
/// subject again: its readers keep only what is newer) and is counted
/// (`consumer_remakes`).
struct Reader {
    js: jetstream::Context,
    stream: &'static str,
    name: String,
    filter: Option<&'static str>,
    last_per_subject: bool,
    msgs: consumer::pull::Ordered,
    /// The last stream sequence handed out (0: none).
    last: u64,
}

impl Reader {
    async fn new(
        js: &jetstream::Context,
        stream: &'static str,
        filter: Option<&'static str>,
        last_per_subject: bool,
        from: u64,
    ) -> Self {
        Self::named(js, stream, stream.to_owned(), filter, last_per_subject, from).await
    }

    async fn named(
        js: &jetstream::Context,
        stream: &'static str,
        name: String,
        filter: Option<&'static str>,
        last_per_subject: bool,
        from: u64,
    ) -> Self {
        let msgs = ordered(js, &name, filter, last_per_subject, from).await;
        Self { js: js.clone(), stream, name, filter, last_per_subject, msgs, last: from.saturating_sub(1) }
    }

    /// The next message; `None` never (the loop runs until the task is aborted).
    async fn next(&mut self, s: &Shared) -> jetstream::Message {
        loop {
            let quiet = if self.filter.is_some() { FILTERED_QUIET } else { STALL_CHECK };
            let remake = match tokio::time::timeout(quiet, self.msgs.next()).await {
                Ok(Some(Ok(m))) => {
                    if let Ok(info) = m.info() {
                        self.last = self.last.max(info.stream_sequence);
                    }
                    return m;
                }
                Ok(Some(Err(e))) => {
                    tracing::warn!(error = %e, stream = self.stream, "consumer");
                    false
                }
                Ok(None) => true,
                Err(_) if self.filter.is_some() => true,
                Err(_) => match self.js.get_stream(&self.name).await {
                    Ok(mut st) => st.info().await.is_ok_and(|i| i.state.last_sequence > self.last),
                    Err(_) => false,
                },
            };
            if remake {
                s.cluster.consumer_remakes.fetch_add(1, Relaxed);
                tracing::warn!(stream = %self.name, filter = ?self.filter, after = self.last, "the consumer stalled or ended: made again");
                let from = if self.last_per_subject { 1 } else { self.last.saturating_add(1) };
                self.msgs = ordered(&self.js, &self.name, self.filter, self.last_per_subject, from).await;
            }
        }
    }
}

/// Counts stream sequences a consumer skipped (the stream dropped them past its limits).
fn count_gap(s: &Shared, last: &mut u64, seq: u64) {
    if *last != 0 && seq > last.saturating_add(1) {
        let lost = seq - *last - 1;
        s.cluster.messages_expired.fetch_add(lost, Relaxed);
        tracing::warn!(from = *last + 1, to = seq - 1, "stream messages expired before they were read");
    }
    *last = (*last).max(seq);
}

/// Matcher shard: applies its records stream (see the module docs).
pub async fn consume_records(s: Arc<Shared>, cfg: ClusterConfig, js: jetstream::Context) {
    let ShardRole::Matcher { shard: me } = cfg.role else { return };
    // A restored shard reads on after the last message its snapshot applied (its nodes'
    // silence is timed by the records' own production times: `Core::apply_bus_records`).
    let from = s.core().map_or(0, |c| c.bus_position());
    let mut reader = Reader::named(&js, "records", records_stream(me), None, false, from.saturating_add(1)).await;
    let mut last = from;
    loop {
        let m = reader.next(&s).await;
        s.progress(&s.tasks.cluster);
        if let Ok(info) = m.info() {
            count_gap(&s, &mut last, info.stream_sequence);
        }
        let Some(batch) = decoded::<RecordBatch>(&s, &m, "record batch") else { continue };
        if batch.matcher_shards != cfg.matcher_shards
            && s.cluster.shard_count_mismatches.fetch_add(1, Relaxed).is_multiple_of(1000)
        {
            tracing::error!(
                ingest_shard = batch.ingest_shard,
                theirs = batch.matcher_shards,
                ours = cfg.matcher_shards,
                "an ingest shard routes for another matcher shard count: fix matcher_shards"
            );
        }
        while s.unpublished_events() >= MAX_UNPUBLISHED_EVENTS {
            s.cluster.backpressure_waits.fetch_add(1, Relaxed);
            s.publish_drained.notified().await;
        }
        let now = s.now();
        let Ok(mut core) = s.core() else { return };
        let (applied, skipped) = core.apply_bus_records(now, &batch.records);
        // Evaluate what these records changed now, not at the timer task's next turn: a
        // shard's `applied_seq` then means its verdicts for them are made (in `for_bus`),
        // which is what a reader of it (an operator, a drained check) takes it to mean.
        core.handle_timeout(now);
        core.set_bus_position(last);
        s.drain_events(&mut core);
        drop(core);
        s.cluster.records_applied.fetch_add(applied, Relaxed);
        s.cluster.records_not_owned.fetch_add(skipped, Relaxed);
        s.cluster.applied_seq.store(last, Relaxed);
    }
}

/// Matcher shard: publishes the events its core produced (the same order).
pub async fn publish_verdicts(s: Arc<Shared>, cfg: ClusterConfig, js: jetstream::Context) {
    let ShardRole::Matcher { shard: me } = cfg.role else { return };
    let mut next = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut backlog = false;
    loop {
        // A backlog goes out message after message; otherwise every 5 ms.
        if !backlog {
            tick.tick().await;
        }
        s.progress(&s.tasks.cluster_state);
        let mut events: Vec<MatcherEvent> = match s.core() {
            Ok(core) => {
                backlog = core.for_bus().len() > EVENTS_PER_MESSAGE;
                core.for_bus().iter().take(EVENTS_PER_MESSAGE).cloned().collect()
            }
            Err(_) => return,
        };
        if events.is_empty() {
            continue;
        }
        // Under the size bound: halve until it fits (one event alone always goes).
        let encoded = loop {
            let batch = VerdictBatch { shard: me, epoch: s.epoch, first: next, events };
            let enc = shard::encode(&batch);
            events = batch.events;
            match enc {
                Ok(p) if p.len() > EVENT_MESSAGE_BYTES && events.len() > 1 => {
                    events.truncate(events.len() / 2);
                    backlog = true;
                }
                other => break other,
            }
        };
        let n = events.len() as u64;
        match encoded {
            Ok(payload) => {
                let id = format!("m{me}.{:016x}.v{next}", s.instance);
                let seq = publish_acked(&s, &js, format!("ringwatch.verdicts.{me}"), id, payload).await;
                s.cluster.acked(me, seq);
            }
            Err(e) => tracing::error!(error = %e, "an event batch could not be encoded"),
        }
        next = next.saturating_add(n);
        if let Ok(mut core) = s.core() {
            core.mark_sent(usize::try_from(n).unwrap_or(usize::MAX));
        }
        s.cluster.events_published.fetch_add(n, Relaxed);
        s.publish_drained.notify_waiters();
    }
}

/// Matcher shard: its node and GPU health, four times a second.
pub async fn publish_health(s: Arc<Shared>, cfg: ClusterConfig, js: jetstream::Context) {
    let ShardRole::Matcher { shard: me } = cfg.role else { return };
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = s.now();
        let h = {
            let Ok(core) = s.core() else { return };
            core.shard_health(me, now)
        };
        if let Ok(payload) = shard::encode(&h)
            && let Ok(ack) = js.publish(format!("ringwatch.health.{me}"), payload.into()).await
        {
            let _ = ack.await;
        }
    }
}

/// API role: the verdict stream into the core's mirror (and so into the store and the
/// event log).
pub async fn consume_verdicts(s: Arc<Shared>, js: jetstream::Context) {
    let mut reader = Reader::new(&js, VERDICTS_STREAM, None, false, 1).await;
    let mut last = 0u64;
    loop {
        let m = reader.next(&s).await;
        s.progress(&s.tasks.cluster);
        if let Ok(info) = m.info() {
            count_gap(&s, &mut last, info.stream_sequence);
        }
        let Some(batch) = decoded::<VerdictBatch>(&s, &m, "verdict batch") else { continue };
        let n = batch.events.len() as u64;
        let Ok(mut core) = s.core() else { return };
        core.inject_events(batch.events);
        s.drain_events(&mut core);
        drop(core);
        s.cluster.events_applied.fetch_add(n, Relaxed);
        s.cluster.applied_seq.store(last, Relaxed);
    }
}

/// API role: node summaries and shard health into the core's mirror and the registry
/// (two consumers: NATS 2.9 delivers the last message per subject only under a filter).
pub async fn consume_state(s: Arc<Shared>, js: jetstream::Context) {
    let nodes = async {
        let mut reader = Reader::new(&js, STATE_STREAM, Some("ringwatch.nodes.*"), true, 1).await;
        loop {
            let m = reader.next(&s).await;
            s.progress(&s.tasks.cluster_state);
            if let Some(n) = decoded::<NodeSummary>(&s, &m, "node summary") {
                apply_summary(&s, n);
            }
        }
    };
    let health = async {
        let mut reader = Reader::new(&js, STATE_STREAM, Some("ringwatch.health.*"), true, 1).await;
        loop {
            let m = reader.next(&s).await;
            if let Some(h) = decoded::<ShardHealth>(&s, &m, "shard health") {
                if let Ok(mut core) = s.core() {
                    core.set_shard_health(h);
                }
                s.cluster.health_applied.fetch_add(1, Relaxed);
            }
        }
    };
    tokio::join!(nodes, health);
}

/// A bus message decoded (validated), or counted `undecodable`, logged and skipped.
fn decoded<T>(s: &Shared, m: &jetstream::Message, what: &'static str) -> Option<T>
where
    T: rkyv::Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    match shard::decode::<T>(&m.payload, what) {
        Ok(v) => Some(v),
        Err(e) => {
            s.cluster.undecodable.fetch_add(1, Relaxed);
            tracing::warn!(error = %e, subject = %m.subject, "skipped");
            None
        }
    }
}

fn apply_summary(s: &Shared, n: NodeSummary) {
    let id: NodeId = n.node;
    let (name, live, connections) = (n.name.clone(), n.live, n.connections);
    let installed = match s.core() {
        Ok(mut core) => core.install_node(id, n),
        Err(_) => return,
    };
    if installed {
        let mut e = s.nodes.entry(id).or_default();
        e.name = name;
        e.live = live;
        e.connections = connections;
        s.cluster.node_summaries_applied.fetch_add(1, Relaxed);
    }
}
