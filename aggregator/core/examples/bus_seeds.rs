//! Writes seed inputs for the `bus` fuzz target (issue 28) into the directory given:
//! one valid message of each kind the shard roles read from NATS, behind the target's
//! kind byte, so the fuzzer mutates real archives (records with hostile numbers reach
//! the matcher) instead of searching for a valid one.

use ringwatch_core::matcher::Health;
use ringwatch_core::records::{
    Comm, Lifecycle, LifecycleKind, Liveness, LivenessState, LossInterval, NodeId, Progress, Record, StreamKey,
    Watermark,
};
use ringwatch_core::shard::{self, RecordBatch, ShardHealth, VerdictBatch};
use ringwatch_core::verdict::{MatcherEvent, OpRef};

fn main() {
    let dir = std::env::args().nth(1).expect("usage: bus_seeds DIR");
    std::fs::create_dir_all(&dir).expect("seed directory");
    let node = NodeId(7);
    let comm = Comm { hash: 0x1234, disambiguator: 5, instance: 1 };
    let stream = StreamKey { node, epoch: 1, stream_id: 3 };
    let life = |seq: u64, phase: u8| {
        Record::Lifecycle(Lifecycle {
            stream,
            seq,
            flags: 0,
            ts_node_ns: 1_000_000 * seq,
            ts_cluster_ns: 1_000_000 * seq as i64,
            comm,
            local_op_seq: seq,
            rank: 0,
            pid: 100,
            op: 1,
            dtype: 7,
            phase,
            count: 1024,
            group_id: 0,
            status: 0,
            channel: 0,
            n_channels: 1,
            kind: LifecycleKind::Collective {
                comm_op_seq: seq,
                nccl_seq: seq,
                nranks: 2,
                root: 0,
                local_rank: 0,
                cuda_dev: 0,
                graph_id: 0,
                graph_node: 0,
                replay_idx: 0,
            },
        })
    };
    let records = vec![
        life(1, 1),
        life(2, 3),
        Record::Progress(Progress {
            node,
            epoch: 1,
            comm,
            rank: 0,
            pid: 100,
            proc_state: 1,
            exit_code: 0,
            gpu_uuid: [1; 16],
            cgroup_id: 9,
            activation_mask: 1,
            last_enqueued_op: 2,
            last_kernel_started_op: 2,
            last_completed_op: 1,
            last_update_node_ns: 3_000_000,
            snapshot_node_ns: 3_000_000,
            snapshot_cluster_ns: 3_000_000,
            received_at_ns: 3_000_000,
        }),
        Record::Loss(LossInterval {
            id: 1,
            stream,
            first_seq: 3,
            last_seq: 4,
            count: Some(2),
            cause: 1,
            reason: 0,
            from_node_ns: 2_000_000,
            to_node_ns: 5_000_000,
            decided_at_ns: 6_000_000,
        }),
        Record::Watermark(Watermark { node, class: 0, node_ns: 5_000_000, cluster_ns: 5_000_000, epsilon_ns: 1000 }),
        Record::Liveness(Liveness { node, state: LivenessState::Silent, at_ns: 9_000_000, last_heard_ns: 5_000_000 }),
    ];
    let batch = RecordBatch {
        ingest_shard: 0,
        epoch: 1,
        matcher_shards: 2,
        records: records.into_iter().enumerate().map(|(i, r)| (i as u64, 1_000_000 * i as u64, r)).collect(),
    };
    let health = ShardHealth {
        shard: 1,
        at_ns: 9,
        nodes: vec![(node, Health::Degraded)],
        gpus: vec![(node, [1; 16], Health::Suspect)],
    };
    let events = VerdictBatch {
        shard: 0,
        epoch: 1,
        first: 0,
        events: vec![MatcherEvent::Recovered {
            op: OpRef::Coll { comm, seq: 1 },
            rank: 0,
            node: Some(node),
            after_ms: 5,
        }],
    };
    let write = |name: &str, kind: u8, bytes: Vec<u8>| {
        let mut out = vec![kind];
        out.extend(bytes);
        std::fs::write(std::path::Path::new(&dir).join(name), out).expect("write seed");
    };
    write("seed-records", 0, shard::encode(&batch).expect("encodes"));
    write("seed-health", 2, shard::encode(&health).expect("encodes"));
    write("seed-events", 3, shard::encode(&events).expect("encodes"));
}
