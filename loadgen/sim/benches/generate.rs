//! Generator throughput: frames produced per second of one core, for one node at its full
//! bulk rate (8 × 100 Gbit/s at 1,500 B) plus its collectives. Run with the perf profile:
//!
//! `cargo bench -p loadgen-sim --profile perf --bench generate`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use loadgen_sim::sim::{EpochInfo, Sink, Snapshot};
use loadgen_sim::{Scenario, SimOptions, Simulation};
use std::hint::black_box;

const SCENARIO: &str = r#"
name = "bench-one-node"
duration_ms = 40
[cluster]
nodes = 1
gpus_per_node = 8
[[comms]]
name = "tp"
group = "tensor"
[[comms.ops]]
op = "all_reduce"
bytes = 67108864
period_ms = 5
jitter_ms = 0.1
duration = { median_ms = 1, p99_ms = 2 }
"#;

#[derive(Default)]
struct Count {
    frames: u64,
    bytes: u64,
}

impl Sink for Count {
    fn frame(&mut self, _node: u32, frame: &[u8]) {
        self.frames += 1;
        self.bytes += frame.len() as u64;
        black_box(frame);
    }
    fn snapshot(&mut self, _node: u32, s: &Snapshot<'_>) {
        black_box(s.streams.len());
    }
    fn epoch(&mut self, _node: u32, _e: &EpochInfo) {}
}

fn run(s: &Scenario) -> Count {
    let mut sim = Simulation::new(s, SimOptions::default()).expect("valid");
    let mut c = Count::default();
    sim.run(&mut c);
    c
}

fn bench(c: &mut Criterion) {
    let s = Scenario::parse(SCENARIO).expect("valid");
    let probe = run(&s);
    let rate = s.bulk.events_per_sec();
    println!(
        "one node, 40 ms simulated: {} frames ({} B) = {:.1} M frames/s of simulated time (bulk {:.1} M/s)",
        probe.frames,
        probe.bytes,
        probe.frames as f64 / 0.040 / 1e6,
        rate / 1e6
    );
    let mut g = c.benchmark_group("generate_one_node");
    g.throughput(Throughput::Elements(probe.frames));
    g.sample_size(10);
    g.bench_function("40ms_full_rate", |b| b.iter(|| black_box(run(&s).frames)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
