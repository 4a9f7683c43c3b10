//! The HTTP API's types, version 1. These are the contract with schedulers; the core's
//! types are not (they may change without notice). Adding fields is compatible; renaming
//! or removing one is a new version (`/v2/...`).
//!
//! Names on the wire are the vocabulary of docs/design.md: outcomes (`completed`,
//! `completed_inferred`, `waiting_on(3)`, `stuck`, `unknown_silent`, …), health
//! (`healthy`, `healthy_lossy`, `suspect`, `degraded`, `silent`, `unreachable`), loss
//! causes (`kernel_ring_full`, `shipper_spool_full`, `rejected`, …).

use std::collections::BTreeMap;

use proto_flat::codes::LossCause;
use proto_flat::header::StreamId;
use ringwatch_core::records::LivenessState;
use ringwatch_core::verdict::{OpRef, Verdict, VerdictTag};
use ringwatch_core::{Health, SeqTracker};
use serde::{Deserialize, Serialize};

/// API version of every DTO here.
pub const API_VERSION: &str = "v1";

/// `GET /healthz`: `200` with status `ok`; `503` with `degraded` (a long-lived task is
/// dead, or the timer task made no progress for [`TIMER_STALL_MS`]) or `failed` (the core
/// failed: the process is exiting to restart from its snapshot).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HealthzDto {
    pub status: String,
    /// This aggregator process (hex).
    pub instance: String,
    pub aggregator_epoch: u64,
    pub uptime_ms: u64,
    pub nodes_connected: u64,
    /// Whether this instance restored its state from a snapshot.
    pub restored: bool,
    /// A snapshot found at start that this build could not read (another format
    /// version): this instance started fresh in its place, with a knowledge gap for
    /// every node from the snapshot's time, and moved the file aside.
    #[serde(default)]
    pub snapshot_skipped: Option<SnapshotSkippedDto>,
    /// What an ack promises shippers: `snapshot` (P0/P1 acked durable once a snapshot
    /// holds them) or `none`.
    #[serde(default)]
    pub durability: String,
    /// Why the core failed (status `failed`).
    pub failure: Option<String>,
    /// Why the status is not `ok` (the same list `/readyz` gives): a failed core, a task
    /// not running or stalled, snapshots failing in a row.
    #[serde(default)]
    pub reasons: Vec<String>,
    /// Every long-lived task: `timers` (the core's), `ingest` (QUIC accept loop),
    /// `http`, `snapshots` (alive only when snapshots are configured).
    pub tasks: Vec<TaskDto>,
    /// Panics caught in a connection's or batch stream's task (the connection was closed
    /// and its shipper reconnected), and in HTTP handlers (answered 500).
    pub connection_panics: u64,
    pub handler_panics: u64,
    /// This aggregator's own memory pressure and its P3 shedding (`None`: the watcher is
    /// off, or unavailable: `pressure_unavailable` says why).
    #[serde(default)]
    pub pressure: Option<AggregatorPressureDto>,
    #[serde(default)]
    pub pressure_unavailable: Option<String>,
    /// Whether the API asks for a bearer token (`api_token_file`): a client learns it
    /// here, without a request answered 401 (the live page asks for the token then).
    #[serde(default)]
    pub api_token_required: bool,
}

/// The aggregator's own memory pressure ([`HealthzDto::pressure`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AggregatorPressureDto {
    /// `nominal`, `some` or `full` (with the watcher's hysteresis).
    pub level: String,
    /// The pressure file watched.
    pub file: String,
    /// `avg10` of `some` and `full`, parts per million of the time.
    pub some_avg10_ppm: u32,
    pub full_avg10_ppm: u32,
    pub some_total_us: u64,
    pub full_total_us: u64,
    /// Triggers fired (`some`, `full`), and level changes.
    #[schema(value_type = Vec<u64>)]
    pub fired: [u64; 2],
    pub transitions: u64,
    /// Times P3 was shed (entering pressure), and the resident bytes the allocator gave
    /// back then.
    pub p3_sheds: u64,
    pub rss_returned_bytes: u64,
    /// Verdict-store ops (and their rank verdicts) forgotten only because pressure cut
    /// its limits to a quarter.
    pub store_ops_shed: u64,
    pub store_verdicts_shed: u64,
}

/// A snapshot this build could not read ([`HealthzDto::snapshot_skipped`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SnapshotSkippedDto {
    /// Its format version.
    pub version: u32,
    /// Where it was moved.
    pub kept_at: String,
}

/// How long the timer task may go without a turn before `/healthz` calls it stalled
/// (it turns at least every 100 ms).
pub const TIMER_STALL_MS: u64 = 10_000;

/// One long-lived task in [`HealthzDto`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TaskDto {
    pub name: String,
    pub alive: bool,
    /// Panics caught, and restarts in place after them (the timer task never restarts:
    /// its panic fails the core).
    pub panics: u64,
    pub restarts: u64,
    /// Real ms since the task's last progress: the timer's last turn, the last accepted
    /// connection, the last request served, the last snapshot written (`None`: none yet).
    pub last_progress_ago_ms: Option<u64>,
    /// The timer task with no turn for [`TIMER_STALL_MS`].
    pub stalled: bool,
}

/// `GET /readyz`: `200` when the aggregator is serving (the core has not failed, the
/// timer task turns, the accept loop and the HTTP server run), else `503` with why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReadyzDto {
    pub ready: bool,
    pub reasons: Vec<String>,
}

/// `GET /v1/ingest`: what the transport and ingest counted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IngestDto {
    pub api_version: String,
    /// How fresh this answer is.
    #[serde(default)]
    pub as_of: AsOfDto,
    pub aggregator_epoch: u64,
    pub connections: u64,
    pub handshake_failures: u64,
    pub identity_refused: u64,
    pub node_mismatch: u64,
    pub batches_applied: u64,
    pub batches_duplicate: u64,
    /// Rejected (nacked) batches by reason name.
    pub rejected: BTreeMap<String, u64>,
    pub stream_errors: u64,
    pub protocol_errors: u64,
    pub connections_closed_abuse: u64,
    pub snapshots_written: u64,
    pub snapshot_failures: u64,
    pub last_snapshot_bytes: u64,
    /// What each cap and retention turned away, by `component.counter` (the core's, and
    /// the verdict store's as `store.*`).
    pub evictions: BTreeMap<String, u64>,
    /// Every bounded map of the core and the verdict store, by `component.map`: its
    /// entries now and its cap.
    pub maps: BTreeMap<String, MapSizeDto>,
    pub verdict_store: VerdictStoreDto,
    /// The core's own counters (frames, duplicates, malformed frames, loss intervals).
    pub frames: u64,
    pub duplicate_frames: u64,
    pub malformed_frames: u64,
    pub loss_intervals: u64,
    pub ops_inferred_from_seq_gap: u64,
    /// Session resumption (a `resume` at every connection): how many were applied, the
    /// batches they settled that this instance had never applied, the streams this
    /// instance had missed part of, and batches refused because a session's dedup window
    /// was full (a restart never causes that).
    pub resumes: u64,
    pub resume_batches_settled: u64,
    pub resume_stream_windows: u64,
    pub dedup_window_full: u64,
    /// Heartbeats written before their connection's `resume` (they waited in the
    /// shipper's spool): their counters count, their send times are not clock samples.
    pub clock_samples_stale: u64,
    /// Batches refused whole (nacked `malformed_frame`) and resumes refused (connection
    /// closed) for a field no real shipper sends: a seq or counter past 2^62, a loss
    /// record that loses more than its range, a held seq above `attempted_seq`, …
    /// (`ringwatch_core::plausible`). Each is also logged with the field.
    pub implausible_batches: u64,
    pub implausible_resumes: u64,
    /// Owner rows (GPU, rank, pod / container / Slurm job) past the per-node cap in one
    /// heartbeat, not kept.
    #[serde(default)]
    pub owners_turned_away: u64,
    /// The last snapshot: how long the core's lock was held to take it (µs), and when
    /// (aggregator ms).
    pub last_snapshot_hold_us: u64,
    pub last_snapshot_at_ms: u64,
    /// P0/P1 batches acked `durable` (a snapshot on disk holds them), and those a
    /// connection could not remember for a durable ack (its 65,536 were awaiting).
    #[serde(default)]
    pub batches_durable: u64,
    #[serde(default)]
    pub durable_untracked: u64,
    /// Connections of control protocol 2 (a shipper one version behind), and connections
    /// refused for a protocol this aggregator does not speak.
    #[serde(default)]
    pub connections_protocol_2: u64,
    #[serde(default)]
    pub protocol_refused: u64,
    /// The HTTP listener itself.
    #[serde(default)]
    pub http: HttpDto,
    /// The event stream's log.
    #[serde(default)]
    pub events: EventLogDto,
    /// A scaled-out aggregator's shard role and its bus traffic (absent with role `all`).
    #[serde(default)]
    pub cluster: Option<ClusterDto>,
}

/// A shard role's bus traffic (`/v1/ingest` `cluster`; see the aggregator's `cluster`
/// module for the streams).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ClusterDto {
    /// `ingest-<i>`, `matcher-<m>` or `api`.
    pub role: String,
    /// The last publish was acked (false while JetStream is unreachable: publishes are
    /// retried, batch streams wait once the unpublished records reach their cap).
    pub connected: bool,
    /// Ingest: records published, messages carrying them, records not yet published.
    pub records_published: u64,
    /// Records no matcher reads (bulk watermarks, loss intervals of bulk and P1
    /// streams), not published: their accounting reaches the API in the node summaries.
    pub records_kept_local: u64,
    pub record_messages_published: u64,
    pub records_unpublished: u64,
    /// Publishes not acked (retried under the same message id) and retries JetStream
    /// had already stored.
    pub publish_failures: u64,
    pub publish_duplicates: u64,
    /// Times a batch stream (ingest) or the record consumer (matcher) waited for the bus.
    pub backpressure_waits: u64,
    pub node_summaries_published: u64,
    /// Node summaries JetStream did not take (the API keeps the node's previous state).
    pub node_summaries_failed: u64,
    /// Matcher: record batches routed for another matcher shard count (misconfigured
    /// `matcher_shards`; `/healthz` is degraded while it is not 0).
    pub shard_count_mismatches: u64,
    /// Matcher: records applied, records of another shard's communicators (never
    /// expected), events published and not yet published, the stream position applied.
    pub records_applied: u64,
    pub records_not_owned: u64,
    pub events_published: u64,
    pub events_unpublished: u64,
    /// Matcher and API: the stream sequence of the last message applied.
    pub applied_seq: u64,
    /// Consumers: messages the stream dropped before they were read, and messages that
    /// did not decode (skipped, logged).
    pub messages_expired: u64,
    pub undecodable: u64,
    /// API: events, node summaries and shard health reports applied.
    pub events_applied: u64,
    pub node_summaries_applied: u64,
    pub health_applied: u64,
    /// Matcher: nodes nothing was said of on the bus for the ingest's unreachable time
    /// — their ingest shard died without a word — taken as unreachable here;
    /// restorations of what their ingest shard said once records about them came again
    /// (from the shard they failed over to); nodes past the cap; `silent` /
    /// `unreachable` statements ignored as stale (from an ingest shard that had not heard
    /// the node since another said it was fresh: the node failed over).
    #[serde(default)]
    pub bus_liveness_synthesized: u64,
    #[serde(default)]
    pub bus_liveness_restored: u64,
    #[serde(default)]
    pub bus_liveness_turned_away: u64,
    #[serde(default)]
    pub bus_liveness_stale_ignored: u64,
    /// Consumers (matcher, API) made again after they stalled with messages left in the
    /// stream, or ended.
    #[serde(default)]
    pub consumer_remakes: u64,
}

/// The HTTP listener's counters (`/v1/ingest` `http`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HttpDto {
    /// Connections accepted and served, and open now.
    pub connections: u64,
    pub open: u64,
    /// Turned away at the connection cap (answered 503 and closed).
    pub refused_at_cap: u64,
    /// Closed for not sending a request head within the header-read timeout (idle
    /// keep-alive connections included).
    pub header_timeouts: u64,
    /// `accept` failures (the process's file limit, most often).
    pub accept_errors: u64,
    /// Requests answered 401 (no bearer token, or the wrong one).
    #[serde(default)]
    pub unauthorized: u64,
    /// TLS handshakes that failed or timed out (TLS on: `http_tls_cert`).
    #[serde(default)]
    pub tls_handshake_failures: u64,
    /// Times the token file brought a new token.
    #[serde(default)]
    pub token_rotations: u64,
}

/// One bounded map's size against its cap (`/v1/ingest` `maps`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MapSizeDto {
    pub len: u64,
    pub cap: u64,
}

/// `GET /v1/nodes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodesDto {
    pub api_version: String,
    /// How fresh this answer is.
    #[serde(default)]
    pub as_of: AsOfDto,
    pub nodes: Vec<NodeDto>,
}

/// One node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeDto {
    /// Its certificate's DNS name — or, for a node this instance knows only from its
    /// snapshot (it has not connected since the restart), its `node_id`.
    pub name: String,
    /// First 8 bytes of SHA-256(name), hex.
    pub node_id: String,
    /// Whether any of its connections is open (`live_connections` > 0).
    pub connected: bool,
    /// Its connections open now: a reconnecting shipper's old connection may close after
    /// its new one opened.
    #[serde(default)]
    pub live_connections: u32,
    /// `fresh`, `silent`, `unreachable`.
    pub liveness: String,
    /// Worst health over its GPUs: `healthy`, `healthy_lossy`, `suspect`, `degraded`,
    /// `silent`, `unreachable`; an otherwise healthy node whose P0 streams lost frames is
    /// `healthy_lossy` (loss rate: `p0_frames_lost` / `p0_frames_attempted`); a node
    /// not heard from (no batch yet) is `silent` while connected, else `unreachable`.
    pub health: String,
    /// Connections ever accepted from it by this instance.
    pub connections: u64,
    /// Node time (ns) through which every P0 / bulk seq is received or resolved: no
    /// verdict about this node rests on anything later.
    pub watermark_p0_node_ns: u64,
    pub watermark_bulk_node_ns: u64,
    /// Cluster time = node time + offset, ± epsilon (absent before the first heartbeat).
    pub clock_offset_ns: Option<i64>,
    pub clock_epsilon_ns: Option<u64>,
    /// The aggregator's own gaps in what it knows of this node (a restart: from the
    /// snapshot's time to the node's first batch after it), aggregator ms.
    pub knowledge_gaps: Vec<GapDto>,
    /// Health per GPU (hex UUID) that has any verdict; absent GPUs are healthy.
    pub gpus: Vec<GpuDto>,
    /// Restored from a snapshot and no batch from this node since: a gap still open.
    pub awaiting_first_batch: bool,
    /// Seqs of this node's streams that another aggregator instance received or resolved
    /// (before a restart this instance did not restore from): not loss.
    pub prior_instance: u64,
    /// Frames of its P0 (lifecycle) streams lost by any cause, net of revivals, over every
    /// epoch this instance knows.
    pub p0_frames_lost: u64,
    /// Frames its P0 streams attempted as far as this instance knows (received, lost,
    /// another instance's, pending or in transit).
    pub p0_frames_attempted: u64,
    /// The shipper's own state from its last heartbeat (absent before the first one
    /// this instance received): memory pressure — a separate dimension from `health`:
    /// shedding under pressure is accounted `psi_shed` bulk loss and never makes a node
    /// `degraded`, but a node under `full` pressure is one a scheduler may act on.
    #[serde(default)]
    pub shipper: Option<ShipperStateDto>,
    /// Its bulk (P2) traffic from the exact counters (absent before its first
    /// heartbeat this instance received).
    #[serde(default)]
    pub bulk: Option<BulkDto>,
    pub streams: Vec<StreamDto>,
}

/// A node's bulk (P2) events: what the kernel counted — every event, whether or not its
/// frame arrived — beside how much of it the aggregator saw, so a rate never silently
/// drops with the telemetry. Over the streams of every epoch this instance knows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BulkDto {
    /// Events per second (attempted + sampled out) over `window_s` of node time between
    /// heartbeats of the current epoch; absent before two heartbeats of it.
    pub events_per_second: Option<f64>,
    pub window_s: f64,
    /// From the last heartbeats: events that took a seq, and events sampled out.
    pub attempted: u64,
    pub sampled_out: u64,
    /// Frames received, and lost (every cause).
    pub received: u64,
    pub lost: u64,
    /// `received ÷ attempted` (the share of counted events whose frames arrived; the
    /// rest is lost or not yet resolved), `lost ÷ attempted`, `sampled_out ÷ (attempted
    /// + sampled_out)`; absent when their divisor is 0.
    pub coverage: Option<f64>,
    pub lost_share: Option<f64>,
    pub sampled_share: Option<f64>,
    /// Per network interface, from the kernel's per-interface counters: every packet the
    /// bulk XDP program saw, counted before sampling and before the ring, so these rates
    /// hold whatever the telemetry lost (`coverage` and `lost_share` above say how much
    /// of the node's bulk frames arrived). Empty where the node counts no interfaces.
    pub interfaces: Vec<InterfaceRateDto>,
    /// Interface entries refused for the per-node cap, since this aggregator started.
    pub interfaces_turned_away: u64,
}

/// One network interface of a node: its packet and byte counters this epoch and their
/// rates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InterfaceRateDto {
    /// The interface's index on the node; 0 stands for every interface beyond the
    /// kernel map's cap (64).
    pub ifindex: u32,
    /// Running totals of the node's current epoch, from its latest heartbeat kept for the
    /// rate (one under 625 ms after the previous kept one is skipped).
    pub packets: u64,
    pub bytes: u64,
    /// Per second over `window_s` of node time (up to 10 s of heartbeats); absent before
    /// two heartbeats of the epoch named the interface.
    pub packets_per_second: Option<f64>,
    pub bytes_per_second: Option<f64>,
    pub window_s: f64,
}

/// A shipper's state, from its last heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ShipperStateDto {
    /// `nominal`, `some` (bulk shed), `full` (bulk shed, P1 coalesced), `unknown`.
    pub pressure: String,
    /// The node cgroup's `memory.pressure` avg10s, percent of the time.
    pub psi_some_avg10: f64,
    pub psi_full_avg10: f64,
    /// The heartbeat's shed tier (0 nothing, 1 P3, 2 P2 too, 3 P1 coalesced too).
    pub shed_tier: u8,
    /// The kernel's bulk sampling level (bulk keeps 1 in 2^level).
    pub sampling_level: u8,
    pub spool_bytes: u64,
    pub spool_cap_bytes: u64,
    /// How long ago it arrived, ms.
    pub age_ms: u64,
}

/// One GPU's health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GpuDto {
    pub gpu_uuid: String,
    pub health: String,
    /// Who owns the processes on it (one per process), from the node's last heartbeat
    /// (empty: none known — no process, or a cgroup that names no pod, container or
    /// Slurm job).
    #[serde(default)]
    pub owners: Vec<OwnerDto>,
}

/// Who owns a rank process: resolved by the node's shipper from the process's cgroup
/// (`/proc/<pid>/cgroup`). Act on the pod or the job, not the rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OwnerDto {
    pub pid: u32,
    /// Kubernetes pod UID (8-4-4-4-12 hex).
    pub pod_uid: Option<String>,
    /// Container id (64 hex digits).
    pub container_id: Option<String>,
    pub slurm_job_id: Option<u64>,
}

/// A time range, aggregator (= cluster) ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GapDto {
    pub from_ms: u64,
    pub to_ms: u64,
}

/// Accounting of one stream `(node, epoch, stream_id)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StreamDto {
    pub epoch: u64,
    pub stream_id: u32,
    /// `p0`, `p1`, `p2`, `p3`.
    pub class: String,
    pub ring: u8,
    pub cpu: u16,
    /// Frames received (each once).
    pub received: u64,
    /// Lost frames by cause name.
    pub lost: BTreeMap<String, u64>,
    pub lost_total: u64,
    /// Seqs another aggregator instance received or resolved (a resume floor above what
    /// this instance saw): not loss.
    pub prior_instance: u64,
    /// Seqs neither received nor resolved yet.
    pub pending: u64,
    /// Seqs the shipper reported spooled and not yet received.
    pub in_transit: u64,
    /// From the last heartbeat: events that took a seq, and events sampled out.
    pub attempted: u64,
    pub sampled_out: u64,
    pub duplicates: u64,
}

/// The verdict store, in `GET /v1/ingest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
pub struct VerdictStoreDto {
    /// Rank verdicts held, and how many are final.
    pub verdicts: u64,
    pub finals: u64,
    pub ops: u64,
    /// Estimated size, and its cap.
    pub bytes: u64,
    pub max_bytes: u64,
    pub retention_s: u64,
    /// Ops compacted to summaries (every rank final `completed`, untagged).
    pub ops_compacted: u64,
    /// Recoveries applied to held verdicts.
    pub recoveries: u64,
}

/// How fresh an answer is (`as_of` in `/v1/nodes`, `/v1/verdicts`, `/v1/ingest`): the
/// aggregator's epoch and time when the answer was built, and the oldest P0 watermark
/// among the nodes — every node's collective events up to that cluster time are in (or
/// accounted as lost). A verdict may change until it is `final`: act on final ones only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
pub struct AsOfDto {
    pub aggregator_epoch: u64,
    /// Aggregator time (ms) the answer was built at.
    pub aggregator_ms: u64,
    /// The lowest P0 watermark of the nodes with one, in cluster time (ns: the node's
    /// clock corrected by its offset); `None` before any node reported one.
    pub p0_watermark_min_cluster_ns: Option<i64>,
    /// The node that holds it back (its name), and how many nodes have a watermark.
    pub p0_watermark_min_node: Option<String>,
    pub nodes_with_watermark: u64,
    /// The newest event (`GET /v1/events`) this answer reflects: watch from it
    /// (`after=` or `Last-Event-ID`) to miss nothing after this list.
    #[serde(default)]
    pub event_id: String,
}

/// `GET /v1/verdicts`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VerdictsDto {
    pub api_version: String,
    /// How fresh this page is.
    #[serde(default)]
    pub as_of: AsOfDto,
    /// Verdicts matching the query, where the store counts them without a scan (no
    /// filter, or `final` alone); absent for `node` / `outcome` filters — page through
    /// with `next_cursor`.
    #[serde(default)]
    pub total: Option<u64>,
    /// Rank verdicts the store holds.
    #[serde(default)]
    pub stored: u64,
    /// Pass as `cursor=` for the next page; absent on the last page.
    #[serde(default)]
    pub next_cursor: Option<String>,
    /// In (op, rank) order.
    pub verdicts: Vec<VerdictDto>,
}

/// The latest verdict for one rank in one op.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VerdictDto {
    pub op: OpDto,
    pub rank: u32,
    /// The rank's node name (absent when no frame of the rank was seen).
    pub node: Option<String>,
    pub gpu_uuid: String,
    pub outcome: String,
    pub tags: Vec<String>,
    #[serde(rename = "final")]
    pub is_final: bool,
    pub decided_at_ms: u64,
    /// The rule that decided, in words.
    pub evidence: String,
    pub loss_intervals: Vec<u64>,
    pub revision: u32,
    /// Aggregator time (ms) the verdict became final.
    pub final_at_ms: Option<u64>,
    /// Aggregator time (ms) a final unfinished verdict (`stuck`, `waiting_on`,
    /// `blocked_by`, `not_joined`) saw the rank complete the op after all: the verdict
    /// stands (it was true when final), the rank recovered.
    #[serde(default)]
    pub recovered_at_ms: Option<u64>,
    /// From an op the store compacted (every rank final `completed`, untagged): its
    /// per-rank evidence (frame references) is no longer held.
    #[serde(default)]
    pub compacted: bool,
    /// Who owns the rank's process: the process on its GPU, communicator and rank in the
    /// node's last heartbeat (absent when unknown, or when that communicator is no longer
    /// in it — an earlier job's verdict). On list and resource responses; not on events.
    #[serde(default)]
    pub owner: Option<OwnerDto>,
    /// The op's id in `/v1/collectives/{id}`.
    #[serde(default)]
    pub collective_id: String,
}

/// Which op.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OpDto {
    /// `collective`, `p2p`, `graph`.
    pub kind: String,
    /// Communicator hash (hex), disambiguator (hex) and instance: together the
    /// communicator's key (two communicators sharing a hash differ in the disambiguator).
    pub comm: String,
    pub comm_disambiguator: String,
    pub comm_instance: u64,
    /// `comm_op_seq`, `p2p_seq` or `replay_idx`.
    pub seq: u64,
}

/// A bad query.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ErrorDto {
    pub error: String,
}

/// Health name.
#[must_use]
pub fn health_name(h: Health) -> &'static str {
    match h {
        Health::Healthy => "healthy",
        Health::HealthyLossy => "healthy_lossy",
        Health::Suspect => "suspect",
        Health::Degraded => "degraded",
        Health::Silent => "silent",
        Health::Unreachable => "unreachable",
    }
}

/// Liveness name.
#[must_use]
pub fn liveness_name(l: LivenessState) -> &'static str {
    match l {
        LivenessState::Fresh => "fresh",
        LivenessState::Silent => "silent",
        LivenessState::Unreachable => "unreachable",
    }
}

impl StreamDto {
    /// From a tracker.
    #[must_use]
    pub fn from_tracker(t: &SeqTracker) -> Self {
        let sid = StreamId(t.key.stream_id);
        let c = t.counts();
        let lost = c
            .lost
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .filter_map(|(slot, n)| LossCause::from_cause_slot(slot).map(|cause| (cause.to_string(), *n)))
            .collect();
        let hb = t.heartbeat();
        Self {
            epoch: t.key.epoch,
            stream_id: t.key.stream_id,
            class: sid.class().to_string(),
            ring: sid.ring(),
            cpu: sid.cpu(),
            received: c.received,
            lost,
            lost_total: c.lost_total(),
            prior_instance: c.prior_instance,
            pending: t.pending(),
            in_transit: t.in_transit(),
            attempted: hb.map_or(0, |h| h.attempted),
            sampled_out: hb.map_or(0, |h| h.sampled_out),
            duplicates: c.duplicates,
        }
    }
}

impl OpDto {
    /// From the core's op reference.
    #[must_use]
    pub fn of(op: &OpRef) -> Self {
        let (kind, comm, seq) = match *op {
            OpRef::Coll { comm, seq } => ("collective", comm, seq),
            OpRef::P2p { comm, p2p_seq, .. } => ("p2p", comm, p2p_seq),
            OpRef::Graph { comm, replay_idx, .. } => ("graph", comm, u64::from(replay_idx)),
        };
        Self {
            kind: kind.into(),
            comm: format!("{:016x}", comm.hash),
            comm_disambiguator: format!("{:016x}", comm.disambiguator),
            comm_instance: comm.instance,
            seq,
        }
    }
}

fn tag_name(t: &VerdictTag) -> String {
    match t {
        VerdictTag::TelemetryLoss { .. } => "telemetry_loss".into(),
        VerdictTag::Mismatch { field } => format!("mismatch({field})"),
        VerdictTag::GraphCaptured => "graph_captured".into(),
        VerdictTag::AggregatorGap => "aggregator_gap".into(),
        VerdictTag::Straggler { host: true, .. } => "straggler(host)".into(),
        VerdictTag::Straggler { host: false, .. } => "straggler(gpu)".into(),
    }
}

impl VerdictDto {
    /// From a core verdict; `name` maps node ids to names.
    #[must_use]
    pub fn from_verdict(v: &Verdict, name: impl Fn(u64) -> Option<String>) -> Self {
        Self {
            op: OpDto::of(&v.op),
            rank: v.rank,
            node: v.node.and_then(|n| name(n.0)),
            gpu_uuid: v.gpu_uuid.iter().map(|b| format!("{b:02x}")).collect(),
            outcome: v.outcome.name(),
            tags: v.tags.iter().map(tag_name).collect(),
            is_final: v.is_final,
            decided_at_ms: v.decided_at_ns / 1_000_000,
            evidence: v.evidence.rule.describe().to_owned(),
            loss_intervals: v.evidence.loss_intervals.clone(),
            revision: v.revision,
            final_at_ms: None,
            recovered_at_ms: None,
            compacted: false,
            owner: None,
            collective_id: super::resources::op_id(&v.op),
        }
    }
}

/// `GET /v1/events`: the kinds of event (the SSE `event:` field); `data:` is one JSON
/// object — a [`VerdictDto`] for `verdict` and `revision`, otherwise the DTO named here.
pub const EVENT_KINDS: &[&str] =
    &["verdict", "revision", "recovery", "health", "liveness", "p0_loss", "loss_rate", "gap"];

/// `recovery`: a final unfinished verdict (`stuck`, `waiting_on`, …) saw its rank
/// complete the op after all; the verdict stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RecoveryEventDto {
    pub op: OpDto,
    pub rank: u32,
    pub node: Option<String>,
    /// How long after the verdict the completion came (ms).
    pub after_ms: u64,
}

/// `health`: a node's (no `gpu_uuid`) or one GPU's health changed (`previous` absent:
/// first seen by this aggregator process).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct HealthEventDto {
    pub node: String,
    pub gpu_uuid: Option<String>,
    pub health: String,
    pub previous: Option<String>,
}

/// `liveness`: a node's liveness (`fresh`, `silent`, `unreachable`) or connection changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LivenessEventDto {
    pub node: String,
    pub liveness: String,
    pub connected: bool,
    pub previous_liveness: Option<String>,
    pub previous_connected: Option<bool>,
}

/// `p0_loss`: P0 (collective) frames of a node were lost since the last such event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct P0LossEventDto {
    pub node: String,
    pub frames_lost: u64,
    pub frames_lost_total: u64,
    pub frames_attempted_total: u64,
}

/// `loss_rate`: the share of a node's non-P0 frames lost over a window moved to another
/// band (`none`, `below_0.1%`, `below_1%`, `below_10%`, `10%_or_more`); sent on a
/// change of band, not for every loss interval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LossRateEventDto {
    pub node: String,
    pub band: String,
    pub previous_band: String,
    pub frames_lost: u64,
    pub frames: u64,
    pub window_ms: u64,
}

/// `gap`: events after `from_id` up to and including `to_id` will never reach this
/// subscriber — evicted from the bounded log (`reason` `evicted`, `missed` counts them),
/// or `from_id` is of another aggregator process (`other_instance`: a restart; nothing
/// carries over). Re-list (`GET /v1/nodes`, `/v1/verdicts`), then go on: the stream
/// continues after `to_id` (the gap's own id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GapEventDto {
    pub from_id: String,
    pub to_id: String,
    pub reason: String,
    pub missed: Option<u64>,
}

/// The event log, in `/v1/ingest`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
pub struct EventLogDto {
    /// The newest event's id.
    pub last_id: String,
    pub held: u64,
    pub capacity: u64,
    /// Events pushed out of the log by newer ones.
    pub evicted: u64,
    pub subscribers: u64,
    /// Subscriptions refused at `events_max_subscribers` (answered 503).
    pub subscribers_refused: u64,
    /// Gap events sent to subscribers (resumes from evicted or other-instance ids,
    /// subscribers that fell behind).
    pub gaps_sent: u64,
}

/// `GET /v1/nodes/{node}`: one node (by name or 16-hex-digit id), its loss by class and
/// cause, and its latest verdict events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NodeDetailDto {
    pub api_version: String,
    pub as_of: AsOfDto,
    pub node: NodeDto,
    /// Frames lost by class and cause (running totals over its streams), with the share
    /// of the class's frames (received + lost).
    pub loss: Vec<LossClassDto>,
    /// Its ranks' latest verdict and revision events still in the event log, newest
    /// first (at most 50).
    pub recent_verdicts: Vec<VerdictDto>,
}

/// Loss of one class of one node (or of the cluster), by cause.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LossClassDto {
    pub class: String,
    pub received: u64,
    pub lost: BTreeMap<String, u64>,
    pub lost_total: u64,
    /// lost_total ÷ (received + lost_total); 0 without frames.
    pub lost_share: f64,
}

/// `GET /v1/gpus/{uuid}`: one GPU's health, node and latest verdict events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GpuDetailDto {
    pub api_version: String,
    pub as_of: AsOfDto,
    pub gpu_uuid: String,
    pub node: String,
    pub health: String,
    /// Who owns the rank processes on it (as in [`GpuDto::owners`]).
    pub owners: Vec<OwnerDto>,
    /// Its latest verdict and revision events still in the event log, newest first (at
    /// most 50).
    pub recent_verdicts: Vec<VerdictDto>,
}

/// `GET /v1/collectives`: ops (collectives, p2p, graph replays), in op order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CollectivesDto {
    pub api_version: String,
    pub as_of: AsOfDto,
    /// Pass as `cursor=` for the next page; absent on the last page.
    pub next_cursor: Option<String>,
    pub collectives: Vec<CollectiveSummaryDto>,
}

/// One op in a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CollectiveSummaryDto {
    /// Opaque, stable: `GET /v1/collectives/{id}`.
    pub id: String,
    pub op: OpDto,
    /// `final` (every held rank verdict final) or `open`.
    pub state: String,
    pub ranks: u64,
    pub finals: u64,
    /// Rank verdicts by outcome.
    pub outcomes: BTreeMap<String, u64>,
    /// The earliest decision among its ranks (aggregator ms).
    pub decided_at_ms: u64,
}

/// `GET /v1/collectives/{id}`: one op with every held rank verdict (evidence, revision).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CollectiveDto {
    pub api_version: String,
    pub as_of: AsOfDto,
    pub id: String,
    pub op: OpDto,
    pub state: String,
    /// In rank order.
    pub verdicts: Vec<VerdictDto>,
}

/// `GET /v1/loss`: frames lost, per node, stream and cause (running totals since each
/// stream's epoch began), with per-class totals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LossDto {
    pub api_version: String,
    pub as_of: AsOfDto,
    pub by_class: Vec<LossClassDto>,
    pub streams: Vec<LossStreamDto>,
}

/// One stream's loss by cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct LossStreamDto {
    pub node: String,
    pub epoch: u64,
    pub stream_id: u32,
    pub class: String,
    pub ring: u8,
    pub cpu: u16,
    pub received: u64,
    pub lost: BTreeMap<String, u64>,
    pub lost_total: u64,
}

/// `GET /v1/summary`: the cluster at a glance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SummaryDto {
    pub api_version: String,
    pub as_of: AsOfDto,
    /// Rank verdicts held, by outcome kind.
    pub verdicts_by_outcome: BTreeMap<String, u64>,
    /// Ops with a final unfinished rank verdict (`stuck`, `waiting_on`, `blocked_by`,
    /// `not_joined`) whose rank has not recovered.
    pub hung_collectives: u64,
    /// Whether every op was counted (false: past the scan budget of 100,000 ops).
    pub counts_complete: bool,
    pub nodes: u64,
    /// Nodes by health (`healthy`, `healthy_lossy`, `suspect`, `degraded`, `silent`,
    /// `unreachable`).
    pub nodes_by_health: BTreeMap<String, u64>,
    /// Nodes whose health turned `degraded` or `healthy_lossy` within the last
    /// `correlated_window_s`, and whether they are more than `correlated_share` of the
    /// nodes: many nodes turning at once points at a shared cause (a switch, the
    /// aggregator's own intake), not at each node.
    pub recently_degraded_or_lossy: Vec<String>,
    pub correlated_degradation: bool,
    /// The aggregator cannot keep up (reasons in `saturated_reasons`): memory pressure,
    /// a stalled timer task, HTTP connections refused at the cap, or event subscribers
    /// refused.
    pub aggregator_saturated: bool,
    pub saturated_reasons: Vec<String>,
}
