//! Scenario files: the cluster, its workload and the faults to inject (TOML).
//!
//! Every field is documented in `loadgen/scenarios/README.md`; units are in the field
//! names. `Scenario::parse` reads a file and [`Scenario::validate`] reports every
//! problem at once, so a bad file is fixed in one round.

use serde::{Deserialize, Serialize};

/// Profiler activation mask bits (NCCL's `ncclProfile*` event types, as
/// `proto_flat::codes::activation` defines them).
pub mod mask {
    use proto_flat::codes::activation;
    /// Collective / P2P enqueue events.
    pub const COLL: u32 = activation::COLL | activation::P2P;
    /// Kernel-channel events (GPU timer): the completion source.
    pub const KERNEL_CH: u32 = activation::KERNEL_CH;
    /// Proxy operation events.
    pub const PROXY: u32 = activation::PROXY_OP;
    /// What the scenarios enable by default.
    pub const ALL: u32 = COLL | KERNEL_CH | PROXY;
}

/// A whole scenario.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Seeds every random choice; the same seed gives the same frames.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Simulated time to run.
    pub duration_ms: u64,
    pub cluster: ClusterSpec,
    #[serde(default)]
    pub comms: Vec<CommSpec>,
    #[serde(default)]
    pub bulk: BulkSpec,
    #[serde(default)]
    pub timers: Timers,
    #[serde(default)]
    pub faults: Vec<Fault>,
}

fn default_seed() -> u64 {
    1
}

/// Nodes, GPUs and the per-node kernel side.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub nodes: u32,
    /// One rank per GPU.
    pub gpus_per_node: u32,
    /// GPUs are split evenly between pods (cgroups) on a node.
    #[serde(default = "one")]
    pub pods_per_node: u32,
    /// CPUs with their own (ring, CPU) streams on each node.
    #[serde(default = "two_cpus")]
    pub cpus_per_node: u16,
    /// How far the host enqueue runs ahead of completion, in ops (NCCL's default
    /// behaviour with CUDA streams; 64 is what PyTorch workloads reach).
    #[serde(default = "default_enqueue_ahead")]
    pub enqueue_ahead: u32,
    /// Profiler activation mask (`mask::*` bits); default: every kind.
    #[serde(default = "default_mask")]
    pub activation_mask: u32,
    /// Per-node clock offset and drift; nodes not listed are exact.
    #[serde(default)]
    pub clocks: Vec<ClockSpec>,
}

fn one() -> u32 {
    1
}
fn two_cpus() -> u16 {
    2
}
fn default_enqueue_ahead() -> u32 {
    64
}
fn default_mask() -> u32 {
    mask::ALL
}

/// One node's clock error: node time = true time × (1 + drift_ppm·10⁻⁶) + offset.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClockSpec {
    pub node: u32,
    #[serde(default)]
    pub offset_ms: f64,
    #[serde(default)]
    pub drift_ppm: f64,
}

/// How a communicator group is carved out of the ranks.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    /// Every rank: one communicator.
    World,
    /// Tensor parallel: the GPUs of one node; one communicator per node.
    Tensor,
    /// Data parallel: the same GPU index on every node; one communicator per index.
    Data,
    /// Pipeline parallel: GPU g of node n and GPU g of node n+1, for even n; P2P sends
    /// go from the first to the second stage.
    Pipeline,
}

/// One communicator group and its schedule.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CommSpec {
    pub name: String,
    pub group: Group,
    #[serde(default)]
    pub ops: Vec<OpSpec>,
    /// Pipeline sends/recvs on the same communicators as the collectives.
    #[serde(default)]
    pub p2p: Option<P2pSpec>,
}

/// A periodic collective.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OpSpec {
    /// `all_reduce`, `all_gather`, `reduce_scatter`, `reduce`, `broadcast`,
    /// `all_to_all`, `gather`, `scatter`, `barrier`, `all_to_allv`.
    pub op: String,
    /// Bytes per rank.
    pub bytes: u64,
    #[serde(default = "default_dtype")]
    pub dtype: String,
    pub period_ms: f64,
    #[serde(default)]
    pub start_ms: f64,
    /// Host-side jitter of the issue time (uniform ±).
    #[serde(default = "default_jitter")]
    pub jitter_ms: f64,
    pub duration: DurationSpec,
    #[serde(default = "default_channels")]
    pub channels: u16,
    /// Root rank (communicator rank) for rooted ops.
    #[serde(default)]
    pub root: Option<u32>,
}

fn default_dtype() -> String {
    "bfloat16".into()
}
fn default_jitter() -> f64 {
    0.5
}
fn default_channels() -> u16 {
    8
}

/// A log-normal duration given by its median and 99th percentile.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DurationSpec {
    pub median_ms: f64,
    pub p99_ms: f64,
}

/// Periodic pipeline P2P traffic.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct P2pSpec {
    pub period_ms: f64,
    pub bytes: u64,
    pub duration: DurationSpec,
    #[serde(default = "one_channel")]
    pub channels: u16,
    #[serde(default)]
    pub start_ms: f64,
}

fn one_channel() -> u16 {
    1
}

/// Which bulk source a node has.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum BulkKind {
    /// XDP/tc packet frames (48 B).
    #[default]
    Packet,
    /// NCCL proxy/net frames (RDMA fabrics, where XDP sees no data path).
    Proxy,
}

/// The bulk event rate of each node: `links × link_gbps × 10⁹ / (8 × packet_bytes)`
/// events/s, times the run's scale.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BulkSpec {
    #[serde(default = "default_links")]
    pub links: u32,
    #[serde(default = "default_link_gbps")]
    pub link_gbps: f64,
    #[serde(default = "default_packet_bytes")]
    pub packet_bytes: u32,
    /// Keep one event in N (the kernel's sampling level); 1 keeps every event.
    #[serde(default = "one")]
    pub sample_every: u32,
    #[serde(default)]
    pub kind: BulkKind,
}

fn default_links() -> u32 {
    8
}
fn default_link_gbps() -> f64 {
    100.0
}
fn default_packet_bytes() -> u32 {
    1500
}

impl Default for BulkSpec {
    fn default() -> Self {
        Self {
            links: default_links(),
            link_gbps: default_link_gbps(),
            packet_bytes: default_packet_bytes(),
            sample_every: 1,
            kind: BulkKind::Packet,
        }
    }
}

impl BulkSpec {
    /// Events per second per node at scale 1.
    #[must_use]
    pub fn events_per_sec(&self) -> f64 {
        f64::from(self.links) * self.link_gbps * 1e9 / (8.0 * f64::from(self.packet_bytes.max(1)))
    }
}

/// The timers the evidence rules use (defaults from docs/design.md, "Timers").
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Timers {
    #[serde(default = "default_heartbeat")]
    pub heartbeat_ms: u64,
    /// A hang is identifiable only once this has passed (max(20 s, 4 × p99) in
    /// docs/design.md).
    #[serde(default = "default_stuck")]
    pub stuck_deadline_ms: u64,
    /// A missing rank is `not_joined` only after this (PyTorch's watchdog: 600 s).
    #[serde(default = "default_join")]
    pub join_deadline_ms: u64,
    #[serde(default = "default_silent")]
    pub silent_ms: u64,
    #[serde(default = "default_straggler_threshold")]
    pub straggler_threshold_ms: f64,
    /// Cluster-time uncertainty ε per node the aggregator can reach (for the straggler
    /// bound `max(threshold, 3·(ε_a + ε_b))`).
    #[serde(default = "default_epsilon")]
    pub clock_epsilon_ms: f64,
    /// How long after its last evidence a `degraded` GPU clears (the aggregator's
    /// `degraded_clear`). Unset: it does not clear within the run (the aggregator is
    /// given more than the run and its settle phase).
    #[serde(default)]
    pub degraded_clear_ms: Option<u64>,
}

fn default_heartbeat() -> u64 {
    1000
}
fn default_stuck() -> u64 {
    20_000
}
fn default_join() -> u64 {
    600_000
}
fn default_silent() -> u64 {
    5000
}
fn default_straggler_threshold() -> f64 {
    50.0
}
fn default_epsilon() -> f64 {
    1.0
}

impl Default for Timers {
    fn default() -> Self {
        Self {
            heartbeat_ms: default_heartbeat(),
            stuck_deadline_ms: default_stuck(),
            join_deadline_ms: default_join(),
            silent_ms: default_silent(),
            straggler_threshold_ms: default_straggler_threshold(),
            clock_epsilon_ms: default_epsilon(),
            degraded_clear_ms: None,
        }
    }
}

/// Which ring a kernel-side fault hits.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RingKind {
    P0,
    Bulk,
}

/// Where a GPU hang happens relative to the collective it hangs in.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum HangMode {
    /// The GPU never starts the next kernel: every peer's completion is blocked.
    BeforeContributing,
    /// The GPU contributed, then hung: peers complete, it never does.
    AfterContributing,
}

/// Why a rank did not join.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum JoinReason {
    Checkpoint,
    Recompile,
    /// The process exited (an exception): it never comes back.
    Exited,
}

/// A field a mismatch corrupts.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MismatchField {
    Op,
    Dtype,
    Count,
}

/// A fault with its time window and target. Kernel-side and workload faults are applied
/// by the simulator; `shipper_restart` and `aggregator_restart` by `loadgen run`'s
/// restart driver (the simulated pair harness refuses them). The other shipper and
/// transport faults (`spool_overflow`, `partition`, `duplicate_batches`) are parsed and
/// refused by [`Scenario::validate`]: no harness applies them yet.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// The ring overflows: events in the window take a seq and are dropped
    /// (`kernel_ring_full`) with probability `fraction`.
    RingOverflow {
        node: u32,
        ring: RingKind,
        from_ms: u64,
        until_ms: u64,
        #[serde(default = "full")]
        fraction: f64,
    },
    /// Shipper spool overflow (refused: no harness applies it yet).
    SpoolOverflow { node: u32, from_ms: u64, until_ms: u64 },
    /// A rank stops issuing ops (late join, or an exited process when `reason = exited`).
    NotJoined {
        node: u32,
        gpu: u32,
        from_ms: u64,
        #[serde(default)]
        until_ms: Option<u64>,
        reason: JoinReason,
        #[serde(default = "one_i32")]
        exit_code: i32,
    },
    /// A GPU hangs at `at_ms`.
    GpuHang { node: u32, gpu: u32, at_ms: u64, mode: HangMode },
    /// The GPU contributes to the first collective it starts at or after `at_ms`, then
    /// stalls inside it for `pause_ms` before that op ends on it (peers complete; its
    /// later ops start behind the stall); then it runs normally again.
    GpuPause { node: u32, gpu: u32, at_ms: u64, pause_ms: u64 },
    /// One channel of the next collective on `comm` after `at_ms` never finishes.
    ChannelHang { node: u32, gpu: u32, comm: String, at_ms: u64, channel: u16 },
    /// The GPU starts kernels `lag_ms` late (GPU-side straggler).
    GpuStraggler { node: u32, gpu: u32, lag_ms: f64, from_ms: u64, until_ms: u64 },
    /// The host enqueues `lag_ms` late (host-side straggler: never a GPU fault).
    HostStraggler { node: u32, gpu: u32, lag_ms: f64, from_ms: u64, until_ms: u64 },
    /// The rank's first op on `comm` after `at_ms` disagrees in `field`.
    Mismatch { node: u32, gpu: u32, comm: String, at_ms: u64, field: MismatchField },
    /// The node dies: no frames, no heartbeats; its collectives block.
    NodeDead { node: u32, at_ms: u64 },
    /// The shipper stops (SIGTERM: it flushes, or reports what it cannot) and a new
    /// session takes the node's kernel side over `down_ms` later: same epoch, a new
    /// shipper session (applied by `loadgen run`).
    ShipperRestart { node: u32, at_ms: u64, down_ms: u64 },
    /// The kernel counters are recreated: a new epoch, seqs from 0.
    CounterReset { node: u32, at_ms: u64 },
    /// Events of a rank alternate between CPUs and commit out of order.
    Reorder { node: u32, from_ms: u64, until_ms: u64 },
    /// Communicator `comm` reuses the key of communicator `with` (first instance of each).
    KeyCollision { comm: String, with: String },
    /// Ops on `comm` in the window are CUDA-graph replays (kernel-channel records only).
    Graph { comm: String, from_ms: u64, until_ms: u64 },
    /// A rank without the profiler shim: no P0 frames, no PROGRESS.
    Uninstrumented { node: u32, gpu: u32 },
    /// The aggregator stops and starts again `down_ms` later from its snapshot: after a
    /// final snapshot (SIGTERM), or with `kill = true` without one (SIGKILL: it restores
    /// the last periodic snapshot). Applied by `loadgen run`.
    AggregatorRestart {
        at_ms: u64,
        down_ms: u64,
        #[serde(default)]
        kill: bool,
    },
    /// Transport: the node is cut off (refused: no harness applies it yet).
    Partition { node: u32, from_ms: u64, until_ms: u64 },
    /// Transport: batches are delivered twice (refused: no harness applies it yet).
    DuplicateBatches { node: u32, from_ms: u64, until_ms: u64 },
}

fn full() -> f64 {
    1.0
}
fn one_i32() -> i32 {
    1
}

impl Fault {
    /// The fault's kind as written in the file.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Self::RingOverflow { .. } => "ring_overflow",
            Self::SpoolOverflow { .. } => "spool_overflow",
            Self::NotJoined { .. } => "not_joined",
            Self::GpuHang { .. } => "gpu_hang",
            Self::GpuPause { .. } => "gpu_pause",
            Self::ChannelHang { .. } => "channel_hang",
            Self::GpuStraggler { .. } => "gpu_straggler",
            Self::HostStraggler { .. } => "host_straggler",
            Self::Mismatch { .. } => "mismatch",
            Self::NodeDead { .. } => "node_dead",
            Self::ShipperRestart { .. } => "shipper_restart",
            Self::CounterReset { .. } => "counter_reset",
            Self::Reorder { .. } => "reorder",
            Self::KeyCollision { .. } => "key_collision",
            Self::Graph { .. } => "graph",
            Self::Uninstrumented { .. } => "uninstrumented",
            Self::AggregatorRestart { .. } => "aggregator_restart",
            Self::Partition { .. } => "partition",
            Self::DuplicateBatches { .. } => "duplicate_batches",
        }
    }

    /// Whether `loadgen run`'s restart driver applies it (a shipper or aggregator restart).
    #[must_use]
    pub fn is_restart(&self) -> bool {
        matches!(self, Self::ShipperRestart { .. } | Self::AggregatorRestart { .. })
    }

    /// Whether the simulator applies it (kernel side and workload) or only schedules it
    /// for a shipper or transport harness.
    #[must_use]
    pub fn applied_by_simulator(&self) -> bool {
        !matches!(
            self,
            Self::SpoolOverflow { .. }
                | Self::ShipperRestart { .. }
                | Self::AggregatorRestart { .. }
                | Self::Partition { .. }
                | Self::DuplicateBatches { .. }
        )
    }

    fn node(&self) -> Option<u32> {
        match *self {
            Self::RingOverflow { node, .. }
            | Self::SpoolOverflow { node, .. }
            | Self::NotJoined { node, .. }
            | Self::GpuHang { node, .. }
            | Self::GpuPause { node, .. }
            | Self::ChannelHang { node, .. }
            | Self::GpuStraggler { node, .. }
            | Self::HostStraggler { node, .. }
            | Self::Mismatch { node, .. }
            | Self::NodeDead { node, .. }
            | Self::ShipperRestart { node, .. }
            | Self::CounterReset { node, .. }
            | Self::Reorder { node, .. }
            | Self::Uninstrumented { node, .. }
            | Self::Partition { node, .. }
            | Self::DuplicateBatches { node, .. } => Some(node),
            Self::KeyCollision { .. } | Self::Graph { .. } | Self::AggregatorRestart { .. } => None,
        }
    }

    fn gpu(&self) -> Option<u32> {
        match *self {
            Self::NotJoined { gpu, .. }
            | Self::GpuHang { gpu, .. }
            | Self::GpuPause { gpu, .. }
            | Self::ChannelHang { gpu, .. }
            | Self::GpuStraggler { gpu, .. }
            | Self::HostStraggler { gpu, .. }
            | Self::Mismatch { gpu, .. }
            | Self::Uninstrumented { gpu, .. } => Some(gpu),
            _ => None,
        }
    }

    fn comms(&self) -> Vec<&str> {
        match self {
            Self::ChannelHang { comm, .. } | Self::Mismatch { comm, .. } | Self::Graph { comm, .. } => vec![comm],
            Self::KeyCollision { comm, with } => vec![comm, with],
            _ => vec![],
        }
    }
}

/// Every problem found in a scenario.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scenario {name:?} is invalid:\n  - {}", problems.join("\n  - "))]
pub struct ScenarioError {
    pub name: String,
    pub problems: Vec<String>,
}

impl Scenario {
    /// Parses a scenario from TOML and validates it.
    pub fn parse(text: &str) -> Result<Self, ScenarioError> {
        let scenario: Self = toml::from_str(text)
            .map_err(|e| ScenarioError { name: "<unparsed>".into(), problems: vec![e.to_string()] })?;
        scenario.validate()?;
        Ok(scenario)
    }

    /// Checks the scenario and reports every problem at once.
    pub fn validate(&self) -> Result<(), ScenarioError> {
        let mut p = Vec::new();
        let c = &self.cluster;
        if self.duration_ms == 0 {
            p.push("duration_ms must be > 0".to_owned());
        }
        if c.nodes == 0 || c.nodes > 4096 {
            p.push(format!("cluster.nodes = {} must be in 1..=4096", c.nodes));
        }
        if c.gpus_per_node == 0 || c.gpus_per_node > 64 {
            p.push(format!("cluster.gpus_per_node = {} must be in 1..=64", c.gpus_per_node));
        }
        if c.pods_per_node == 0 || !c.gpus_per_node.is_multiple_of(c.pods_per_node.max(1)) {
            p.push(format!(
                "cluster.pods_per_node = {} must divide gpus_per_node = {}",
                c.pods_per_node, c.gpus_per_node
            ));
        }
        if c.cpus_per_node == 0 {
            p.push("cluster.cpus_per_node must be > 0".to_owned());
        }
        if c.enqueue_ahead == 0 {
            p.push("cluster.enqueue_ahead must be > 0".to_owned());
        }
        for clock in &c.clocks {
            if clock.node >= c.nodes {
                p.push(format!("cluster.clocks: node {} does not exist", clock.node));
            }
            if clock.offset_ms < 0.0 && -clock.offset_ms * 1e6 > 1e15 {
                p.push(format!("cluster.clocks: node {} offset out of range", clock.node));
            }
        }
        if self.timers.heartbeat_ms == 0 {
            p.push("timers.heartbeat_ms must be > 0".to_owned());
        }
        if self.bulk.packet_bytes == 0 || self.bulk.sample_every == 0 {
            p.push("bulk.packet_bytes and bulk.sample_every must be > 0".to_owned());
        }
        let mut names = std::collections::BTreeSet::new();
        for comm in &self.comms {
            if !names.insert(comm.name.as_str()) {
                p.push(format!("comms: name {:?} used twice", comm.name));
            }
            if comm.group == Group::Pipeline && c.nodes < 2 {
                p.push(format!("comms.{}: a pipeline group needs at least 2 nodes", comm.name));
            }
            if comm.p2p.is_some() && comm.group != Group::Pipeline {
                p.push(format!("comms.{}: p2p is only generated on pipeline groups", comm.name));
            }
            for op in &comm.ops {
                if crate::model::parse_op(&op.op).is_none() {
                    p.push(format!("comms.{}: unknown op {:?}", comm.name, op.op));
                }
                if crate::model::parse_dtype(&op.dtype).is_none() {
                    p.push(format!("comms.{}: unknown dtype {:?}", comm.name, op.dtype));
                }
                if op.period_ms <= 0.0 || op.channels == 0 {
                    p.push(format!("comms.{}.{}: period_ms and channels must be > 0", comm.name, op.op));
                }
                check_duration(&mut p, &comm.name, &op.duration);
                if op.jitter_ms < 0.0 || op.jitter_ms * 2.0 >= op.period_ms {
                    p.push(format!("comms.{}.{}: jitter_ms must be ≥ 0 and below half the period", comm.name, op.op));
                }
            }
            if let Some(p2p) = &comm.p2p {
                if p2p.period_ms <= 0.0 || p2p.channels == 0 {
                    p.push(format!("comms.{}.p2p: period_ms and channels must be > 0", comm.name));
                }
                check_duration(&mut p, &comm.name, &p2p.duration);
            }
        }
        for (i, f) in self.faults.iter().enumerate() {
            if let Some(node) = f.node()
                && node >= c.nodes
            {
                p.push(format!("faults[{i}] ({}): node {node} does not exist", f.kind()));
            }
            if let Some(gpu) = f.gpu()
                && gpu >= c.gpus_per_node
            {
                p.push(format!("faults[{i}] ({}): gpu {gpu} does not exist", f.kind()));
            }
            for comm in f.comms() {
                if !names.contains(comm) {
                    p.push(format!("faults[{i}] ({}): communicator {comm:?} does not exist", f.kind()));
                }
            }
            if !f.applied_by_simulator() && !f.is_restart() {
                // Parsed so the error can say what it is, but nothing applies it yet: a
                // scenario that names it would run without it and be scored as if it
                // happened.
                p.push(format!(
                    "faults[{i}] ({}): no harness applies this fault kind yet (`loadgen run` and the \
                     core simulation would run without it); the real-process tests exercise \
                     shipper and aggregator restarts, partitions and spool overflow directly",
                    f.kind()
                ));
            }
            if let Fault::GpuPause { pause_ms, .. } = f
                && *pause_ms == 0
            {
                p.push(format!("faults[{i}] (gpu_pause): pause_ms must be > 0"));
            }
            if let Fault::RingOverflow { fraction, from_ms, until_ms, .. } = f
                && (!(0.0..=1.0).contains(fraction) || from_ms >= until_ms)
            {
                p.push(format!("faults[{i}] (ring_overflow): fraction in 0..=1 and from_ms < until_ms"));
            }
        }
        if p.is_empty() { Ok(()) } else { Err(ScenarioError { name: self.name.clone(), problems: p }) }
    }
}

fn check_duration(p: &mut Vec<String>, comm: &str, d: &DurationSpec) {
    if d.median_ms <= 0.0 || d.p99_ms < d.median_ms {
        p.push(format!("comms.{comm}: duration needs 0 < median_ms ≤ p99_ms"));
    }
}
