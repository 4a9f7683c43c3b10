//! Matcher throughput: lifecycle records for 1,000 communicators × 64 ranks in flight
//! (four phases per rank per op), evaluated once per round, with watermarks advancing
//! so ops finalize.
//!
//! `cargo bench -p ringwatch-core --profile perf --bench matcher`

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use proto_flat::codes::{Op, Phase, WireEnum};
use ringwatch_core::records::{Comm, Lifecycle, LifecycleKind, NodeId, Record, StreamKey, Watermark};
use ringwatch_core::{CollectiveMatcher, MatcherConfig};
use std::hint::black_box;

const COMMS: u64 = 1_000;
const RANKS: u32 = 64;
const ROUNDS: u64 = 3;
const MS: u64 = 1_000_000;

fn rounds() -> Vec<(u64, Vec<Record>)> {
    let mut out = Vec::new();
    let mut seq = 0;
    for round in 1..=ROUNDS {
        let t = round * 100 * MS;
        let mut recs = Vec::new();
        for phase in [Phase::EnqueueStart, Phase::EnqueueEnd, Phase::KernelStart, Phase::KernelEnd] {
            for c in 0..COMMS {
                for rank in 0..RANKS {
                    seq += 1;
                    let node = NodeId(u64::from(rank / 8));
                    recs.push(Record::Lifecycle(Lifecycle {
                        stream: StreamKey { node, epoch: 1, stream_id: rank % 8 },
                        seq,
                        flags: 0,
                        ts_node_ns: t + u64::from(phase.code()) * MS,
                        ts_cluster_ns: i64::try_from(t + u64::from(phase.code()) * MS).unwrap_or(0),
                        comm: Comm { hash: c, disambiguator: 1, instance: 1 },
                        local_op_seq: round * COMMS + c,
                        rank,
                        pid: 1000 + rank,
                        op: Op::AllReduce.code(),
                        dtype: 8,
                        phase: phase.code(),
                        count: 1 << 20,
                        group_id: 0,
                        status: 0,
                        channel: 0,
                        n_channels: 8,
                        kind: LifecycleKind::Collective {
                            comm_op_seq: round,
                            nccl_seq: round,
                            nranks: RANKS,
                            root: u32::MAX,
                            local_rank: 0,
                            cuda_dev: 0,
                            graph_id: 0,
                            graph_node: 0,
                            replay_idx: 0,
                        },
                    }));
                }
            }
        }
        for n in 0..u64::from(RANKS / 8) {
            let w = t + 90 * MS;
            recs.push(Record::Watermark(Watermark {
                node: NodeId(n),
                class: 0,
                node_ns: w,
                cluster_ns: i64::try_from(w).unwrap_or(0),
                epsilon_ns: 100_000,
            }));
        }
        out.push((t, recs));
    }
    out
}

fn bench(c: &mut Criterion) {
    let input = rounds();
    let events: u64 = input.iter().map(|(_, r)| r.len() as u64).sum();
    println!("{COMMS} communicators × {RANKS} ranks, {ROUNDS} ops each: {events} records");
    let mut g = c.benchmark_group("matcher");
    g.throughput(Throughput::Elements(events));
    g.sample_size(10);
    g.bench_function("lifecycle_1000x64", |b| {
        b.iter_batched(
            || CollectiveMatcher::new(MatcherConfig::default()),
            |mut m| {
                let mut verdicts = 0u64;
                for (t, recs) in &input {
                    for r in recs {
                        m.handle_record(*t, r);
                    }
                    m.handle_timeout(*t + 95 * MS);
                    while m.poll_event().is_some() {
                        verdicts += 1;
                    }
                }
                black_box((verdicts, m.in_flight()))
            },
            BatchSize::LargeInput,
        );
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
