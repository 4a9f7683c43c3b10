//! Records: what ingest produces and the matcher consumes. Owned and serializable
//! (rkyv), so a distributed log can sit between ingest and the matcher later.
//!
//! Invariants:
//! - bulk (P2) frames never become records one by one: they update sequence tracking and
//!   yield only [`LossInterval`] and [`Watermark`] records;
//! - every record about a node carries the node and, where it concerns frames, the epoch
//!   and stream, so records from any interleaving of nodes are self-describing;
//! - times: `*_node_ns` are the node's monotonic clock, `*_cluster_ns` the cluster-time
//!   estimate, `at_ns`/`decided_at_ns` aggregator time.

use rkyv::{Archive, Deserialize, Serialize};

/// A node: the first 8 bytes of SHA-256 of its certificate name.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[rkyv(derive(Debug, PartialEq, Eq, PartialOrd, Ord, Hash))]
pub struct NodeId(pub u64);

/// A stream: `(node, epoch, stream_id)`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[rkyv(derive(Debug, PartialEq, Eq, PartialOrd, Ord))]
pub struct StreamKey {
    pub node: NodeId,
    pub epoch: u64,
    pub stream_id: u32,
}

/// Communicator identity.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[rkyv(derive(Debug, PartialEq, Eq, PartialOrd, Ord, Hash))]
pub struct Comm {
    pub hash: u64,
    pub disambiguator: u64,
    pub instance: u64,
}

/// What a lifecycle frame was.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LifecycleKind {
    Collective {
        comm_op_seq: u64,
        nccl_seq: u64,
        nranks: u32,
        root: u32,
        local_rank: u16,
        cuda_dev: u16,
        graph_id: u64,
        graph_node: u32,
        replay_idx: u32,
    },
    P2p {
        src: u32,
        dst: u32,
        p2p_seq: u64,
    },
}

/// One P0 frame, as the matcher needs it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifecycle {
    pub stream: StreamKey,
    pub seq: u64,
    pub flags: u32,
    pub ts_node_ns: u64,
    /// Cluster time; 0 before the node's clock is estimated (unknown).
    pub ts_cluster_ns: i64,
    pub comm: Comm,
    pub local_op_seq: u64,
    pub rank: u32,
    pub pid: u32,
    /// proto-flat `op` code.
    pub op: u8,
    pub dtype: u8,
    pub phase: u8,
    pub count: u64,
    pub group_id: u64,
    pub status: i32,
    pub channel: u16,
    pub n_channels: u16,
    pub kind: LifecycleKind,
}

/// Frames of a stream that will never arrive (or, with `count: None`, an explicitly
/// unknown tail after an epoch ended).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct LossInterval {
    /// Unique per core; evidence refers to it.
    pub id: u64,
    pub stream: StreamKey,
    /// First lost seq (inclusive).
    pub first_seq: u64,
    /// Last lost seq (inclusive); `u64::MAX` for an unknown tail.
    pub last_seq: u64,
    /// Lost frames in the range; `None` when unknown (an epoch's unknown tail).
    pub count: Option<u64>,
    /// proto-flat `loss_cause` code.
    pub cause: u16,
    /// proto-flat `nack_reason` code for `rejected`.
    pub reason: u16,
    /// Node time bounds: the frames around the hole (0 when unknown).
    pub from_node_ns: u64,
    pub to_node_ns: u64,
    pub decided_at_ns: u64,
}

/// A watermark moved.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watermark {
    pub node: NodeId,
    /// proto-flat class code (0 = P0, 2 = bulk).
    pub class: u8,
    /// Every seq of the class's streams before this node time is received or resolved.
    pub node_ns: u64,
    pub cluster_ns: i64,
    /// The node's cluster-time uncertainty ε when it was computed.
    pub epsilon_ns: u64,
}

/// A PROGRESS entry from a heartbeat.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub node: NodeId,
    pub epoch: u64,
    pub comm: Comm,
    pub rank: u32,
    pub pid: u32,
    pub proc_state: u8,
    pub exit_code: i32,
    pub gpu_uuid: [u8; 16],
    pub cgroup_id: u64,
    pub activation_mask: u32,
    pub last_enqueued_op: u64,
    pub last_kernel_started_op: u64,
    pub last_completed_op: u64,
    pub last_update_node_ns: u64,
    /// The heartbeat's snapshot time (node) and its cluster estimate.
    pub snapshot_node_ns: u64,
    pub snapshot_cluster_ns: i64,
    pub received_at_ns: u64,
}

/// Liveness of a node.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LivenessState {
    /// Heard from within `silent_ms`.
    Fresh,
    /// Nothing for `silent_ms`: its own verdicts wait, and so do final verdicts of ops it
    /// takes part in, until it is unreachable or heard from again.
    Silent,
    /// Nothing for `unreachable_ms`, or its connection closed.
    Unreachable,
}

/// A node's liveness changed.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    pub node: NodeId,
    pub state: LivenessState,
    pub at_ns: u64,
    pub last_heard_ns: u64,
}

/// Where the aggregator itself knows nothing about a node: from its last snapshot (or
/// its start) to the first batch it received after that.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnowledgeGap {
    pub node: NodeId,
    pub from_ns: u64,
    pub to_ns: u64,
}

/// The shipper reported it could not keep recording (node time).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShipperGap {
    pub node: NodeId,
    pub epoch: u64,
    pub from_node_ns: u64,
    pub to_node_ns: u64,
    pub reason: u16,
}

/// A node's epoch changed (the previous one is closed).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochChange {
    pub node: NodeId,
    pub old_epoch: u64,
    pub new_epoch: u64,
    pub boot_id: [u8; 16],
    pub at_ns: u64,
}

/// Every record kind.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    Lifecycle(Lifecycle),
    Loss(LossInterval),
    Watermark(Watermark),
    Progress(Progress),
    Liveness(Liveness),
    KnowledgeGap(KnowledgeGap),
    ShipperGap(ShipperGap),
    Epoch(EpochChange),
}

impl Record {
    /// The node the record is about.
    #[must_use]
    pub fn node(&self) -> NodeId {
        match self {
            Self::Lifecycle(r) => r.stream.node,
            Self::Loss(r) => r.stream.node,
            Self::Watermark(r) => r.node,
            Self::Progress(r) => r.node,
            Self::Liveness(r) => r.node,
            Self::KnowledgeGap(r) => r.node,
            Self::ShipperGap(r) => r.node,
            Self::Epoch(r) => r.node,
        }
    }
}
