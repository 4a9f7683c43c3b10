//! Bulk ingest throughput: 64 KiB batches of 48-byte bulk frames through the summary +
//! seq scan into the SeqTrackers (what happens to every bulk frame at the aggregator).
//!
//! `cargo bench -p ringwatch-core --profile perf --bench ingest`
//!
//! What overflow checks would cost the core (issue 18; they are off in release builds,
//! see `Cargo.toml`): run once with `-- --save-baseline nochecks`, then with
//! `[profile.release.package.ringwatch-core] overflow-checks = true` and `-- --baseline
//! nochecks`: criterion prints the change.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use proto_flat::batch::{BatchMeta, BatchView, BatchWriter, RunningTotals, SummaryCheck};
use proto_flat::codes::{Class, WireEnum};
use proto_flat::header::StreamId;
use proto_flat::sample;
use ringwatch_core::{Ingest, NodeId};
use std::hint::black_box;
use zerocopy::IntoBytes;

const BATCHES: u64 = 32;

fn batches() -> (Vec<Vec<u8>>, u64) {
    let mut out = Vec::new();
    let mut seqs = [0u64; 2];
    let mut frames = 0;
    for b in 0..BATCHES {
        let mut w = BatchWriter::with_capacity(70 * 1024);
        w.begin(&BatchMeta {
            node_id: 1,
            epoch: 1,
            shipper_session: 1,
            batch_seq: b + 1,
            lane: Class::P2.code(),
            ..Default::default()
        });
        let mut i = 0u64;
        while w.payload_len() + 48 <= 64 * 1024 {
            // Two CPUs' streams in runs of 64, as a ring drain yields them.
            let cpu = u16::from((i / 64) % 2 == 1);
            let slot = usize::from(cpu);
            let f = sample::bulk_packet(StreamId::new(Class::P2, 1, cpu), seqs[slot], 1_000 + i);
            seqs[slot] += 1;
            w.push_frame(f.as_bytes()).expect("fits");
            i += 1;
        }
        frames += u64::from(w.frame_count());
        out.push(w.finish(&RunningTotals::default()).to_vec());
    }
    (out, frames)
}

fn bench(c: &mut Criterion) {
    let (batches, frames) = batches();
    println!("{BATCHES} batches of {} B, {frames} frames of 48 B", batches[0].len());
    let mut g = c.benchmark_group("bulk_ingest_64KiB");
    g.throughput(Throughput::Elements(frames));
    g.bench_function("summary_seq_scan", |b| {
        let views: Vec<BatchView<'_>> = batches.iter().map(|x| BatchView::parse(x).expect("valid")).collect();
        b.iter_batched(
            || Ingest::new(Default::default(), 0),
            |mut ingest| {
                for v in &views {
                    ingest.handle_batch(1, NodeId(1), 0, v);
                }
                black_box(ingest.stats().frames)
            },
            BatchSize::SmallInput,
        );
    });
    // The aggregator's whole path: parse, validate, (with `check`) the plausibility check
    // of issue 18, the scan.
    for (name, check) in [("parse_validate_scan", false), ("parse_validate_check_scan", true)] {
        g.bench_function(name, |b| {
            let mut scratch = SummaryCheck::default();
            b.iter_batched(
                || Ingest::new(Default::default(), 0),
                |mut ingest| {
                    for x in &batches {
                        let v = BatchView::parse(x).expect("valid");
                        v.validate(&mut scratch).expect("valid");
                        if check {
                            ingest.check_batch(&v).expect("plausible");
                        }
                        ingest.handle_batch(1, NodeId(1), 0, &v);
                    }
                    black_box(ingest.stats().frames)
                },
                BatchSize::SmallInput,
            );
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
