//! Decode throughput over a 64 KiB batch of 48-byte bulk packet frames (the P2 shape at
//! 8.3 M packets/s per node). Run with the perf profile:
//!
//! `cargo bench -p proto-flat --profile perf --bench decode`
//!
//! - `envelope`: magic/version/lengths + CRC32C over the whole batch;
//! - `scan_seq`: walk the frame headers in place and read each seq (the bulk path);
//! - `iterate_seq`: decode every frame (typed view of its body) and read its seq;
//! - `validate`: framing, lanes and the summary against the frames (scratch reused);
//! - `full`: envelope + validate + scan_seq, as the aggregator's bulk ingest does per
//!   batch;
//! - `build`: the shipper's side, `BatchWriter::begin` + `push_frame` per frame (16 CPUs'
//!   streams interleaved frame by frame) + `finish` (summary, totals, CRC32C).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use proto_flat::batch::{BatchMeta, BatchView, BatchWriter, RunningTotals, SummaryCheck};
use proto_flat::codes::{Class, WireEnum};
use proto_flat::header::StreamId;
use proto_flat::sample;
use std::hint::black_box;
use zerocopy::IntoBytes;

fn bulk_batch() -> (Vec<u8>, u64) {
    let mut w = BatchWriter::with_capacity(70 * 1024);
    w.begin(&BatchMeta {
        node_id: 3,
        epoch: 1,
        shipper_session: 1,
        batch_seq: 1,
        lane: Class::P2.code(),
        ..Default::default()
    });
    let mut seq = 0u64;
    // Two CPUs' bulk streams interleaved in runs, as a ring drain produces them.
    while w.payload_len() + 48 <= 64 * 1024 {
        let cpu = u16::try_from((seq / 64) % 2).unwrap_or(0);
        let f = sample::bulk_packet(StreamId::new(Class::P2, 1, cpu), seq, 1_000 + seq * 120);
        w.push_frame(f.as_bytes()).expect("frame fits");
        seq += 1;
    }
    let frames = u64::from(w.frame_count());
    (w.finish(&RunningTotals { shipped: frames, ..Default::default() }).to_vec(), frames)
}

fn bench(c: &mut Criterion) {
    let (batch, frames) = bulk_batch();
    let mut g = c.benchmark_group("decode_64KiB_bulk48");
    g.throughput(Throughput::Elements(frames));
    g.bench_function("envelope", |b| b.iter(|| BatchView::parse(black_box(&batch)).expect("valid")));
    let view = BatchView::parse(&batch).expect("valid");
    g.bench_function("scan_seq", |b| {
        b.iter(|| {
            let mut sum = 0u64;
            for h in view.headers() {
                sum = sum.wrapping_add(h.expect("valid").0.seq.get());
            }
            black_box(sum)
        });
    });
    g.bench_function("iterate_seq", |b| {
        b.iter(|| {
            let mut sum = 0u64;
            for f in view.frames() {
                sum = sum.wrapping_add(f.expect("valid").header().seq.get());
            }
            black_box(sum)
        });
    });
    let mut scratch = SummaryCheck::default();
    g.bench_function("validate", |b| b.iter(|| view.validate(black_box(&mut scratch)).expect("valid")));
    g.bench_function("full", |b| {
        b.iter(|| {
            let view = BatchView::parse(black_box(&batch)).expect("valid");
            view.validate(&mut scratch).expect("valid");
            let mut sum = 0u64;
            for h in view.headers() {
                sum = sum.wrapping_add(h.expect("valid").0.seq.get());
            }
            black_box(sum)
        });
    });
    let built: Vec<Vec<u8>> = (0..frames)
        .map(|i| {
            let cpu = u16::try_from(i % 16).unwrap_or(0);
            sample::bulk_packet(StreamId::new(Class::P2, 1, cpu), i / 16, 1_000 + i * 120).as_bytes().to_vec()
        })
        .collect();
    let mut w = BatchWriter::with_capacity(70 * 1024);
    g.bench_function("build", |b| {
        b.iter(|| {
            w.begin(&BatchMeta {
                node_id: 3,
                epoch: 1,
                shipper_session: 1,
                lane: Class::P2.code(),
                ..Default::default()
            });
            for f in &built {
                w.push_frame(black_box(f)).expect("frame fits");
            }
            black_box(w.finish(&RunningTotals::default()).len())
        });
    });
    g.finish();
    println!("batch: {} bytes, {frames} frames of 48 B", batch.len());
}

criterion_group!(benches, bench);
criterion_main!(benches);
