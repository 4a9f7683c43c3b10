//! `loadgen size SCENARIO`: ring, spool and aggregator sizing from a scenario's rates.
//! Pure: the scenario and the measured figures in, a table out.
//!
//! Rules (seed 000's sizing rule for rings; the rest follows the budgets of docs/design.md):
//! - **ring bytes** = peak bytes/s into the ring × the measured p99.9 drain gap × 3,
//!   rounded up to a power of two (BPF rings must be), at least one page. Peak: the
//!   average rate, or for P0 a burst of every op spec issuing at once (all collectives
//!   of a step aligned), whichever needs more. A ring record costs the frame + 8 bytes of
//!   ring header.
//! - **spool bytes** = P0 + P1 bytes/s × 60 s (a partition up to NCCL RAS's "dead" timer
//!   loses no collective event) + bulk bytes/s × 0.25 s (bulk rides out a quarter-second
//!   stall; beyond that it is evicted first, with loss records, and the shipper raises the
//!   kernel's sampling level), rounded up to MiB, at least the shipper's floor (reserves +
//!   two batches).
//! - **aggregator cores** = the cluster's frames/s ÷ the measured ingest frames/s per
//!   core (pre-built batches, `loadgen bench`), and with transport (the whole aggregator's
//!   measured CPU per frame, QUIC included).
//!
//! The measured figures default to this machine's (`loadgen bench --profile perf`), and
//! can be given for another (`--drain-gap-us`, `--ingest-ns`, `--aggregator-ns`).

use std::fmt::Write as _;

use loadgen_sim::Scenario;

/// `loadgen bench` on this machine (2 vCPUs shared by the XDP producer, the reader, QUIC
/// and the aggregator): p99.9 of the gap between drain passes of the ring source, 1 ms
/// timer, 3.3 M events/s: 4.7–5.0 ms (max 6–8.6 ms).
pub const MEASURED_DRAIN_GAP_P999_US: f64 = 4_800.0;
/// `loadgen bench`: aggregator ingest, ns per frame (parse + validate + core).
pub const MEASURED_INGEST_NS: f64 = 12.8;
/// `loadgen bench`: the whole aggregator (quinn + ingest + API) at 8.3 M frames/s used
/// 0.56 cores: ns per frame.
pub const MEASURED_AGGREGATOR_NS: f64 = 0.56e9 / 8.3e6;

/// Bytes a ring record takes: frame + the ring's 8-byte header, 8-aligned.
const fn record(frame: u64) -> u64 {
    (frame + 8).next_multiple_of(8)
}
const COLLECTIVE_RECORD: u64 = record(144);
const P2P_RECORD: u64 = record(120);
const BULK_RECORD: u64 = record(48);
/// Shipper heartbeats and loss records: a heartbeat per second of ≈ 100 B per stream.
const P1_BYTES_PER_STREAM_S: f64 = 100.0;

/// The measured inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    pub drain_gap_p999_us: f64,
    pub ingest_ns: f64,
    pub aggregator_ns: f64,
}

impl Default for Measured {
    fn default() -> Self {
        Self {
            drain_gap_p999_us: MEASURED_DRAIN_GAP_P999_US,
            ingest_ns: MEASURED_INGEST_NS,
            aggregator_ns: MEASURED_AGGREGATOR_NS,
        }
    }
}

/// One class of identical nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeClass {
    pub name: String,
    pub nodes: u32,
    pub p0_events_per_s: f64,
    pub p0_bytes_per_s: f64,
    /// Bytes one step's burst puts into the P0 ring (every op spec at once).
    pub p0_burst_bytes: f64,
    pub bulk_events_per_s: f64,
    pub bulk_bytes_per_s: f64,
    pub p0_ring_bytes: u64,
    pub bulk_ring_bytes: u64,
    pub spool_bytes: u64,
}

/// The sizing of a scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Sizing {
    pub scenario: String,
    pub classes: Vec<NodeClass>,
    pub cluster_frames_per_s: f64,
    pub aggregator_ingest_cores: f64,
    pub aggregator_cores: f64,
    pub measured: Measured,
}

fn ring_for(bytes: f64) -> u64 {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "bytes of a ring")]
    let b = bytes.ceil().max(4096.0) as u64;
    b.next_power_of_two()
}

/// Sizes `s` with `m`.
#[must_use]
pub fn size(s: &Scenario, m: Measured) -> Sizing {
    let c = &s.cluster;
    let ranks = f64::from(c.gpus_per_node);
    // Lifecycle frames per rank and op: enqueue start/end, kernel start/end, and
    // proxy_done when proxy ops are profiled.
    let phases = if c.activation_mask & proto_flat::codes::activation::PROXY_OP != 0 { 5.0 } else { 4.0 };
    // Periodic ops as (period, ring record): every collective spec, and the pipeline's
    // P2P (every GPU of a pair does one side per period).
    let periodic = s.comms.iter().flat_map(|comm| {
        comm.ops
            .iter()
            .map(|op| (op.period_ms, COLLECTIVE_RECORD))
            .chain(comm.p2p.iter().map(|p| (p.period_ms, P2P_RECORD)))
    });
    let (mut p0_events, mut p0_bytes, mut burst) = (0.0, 0.0, 0.0);
    for (period_ms, record) in periodic {
        let per_s = 1_000.0 / period_ms.max(0.001);
        let frames = ranks * phases;
        #[allow(clippy::cast_precision_loss, reason = "bytes")]
        let bytes = frames * record as f64;
        p0_events += frames * per_s;
        p0_bytes += bytes * per_s;
        burst += bytes;
    }
    let b = &s.bulk;
    let bulk_events = f64::from(b.links) * b.link_gbps * 1e9
        / (8.0 * f64::from(b.packet_bytes.max(1)))
        / f64::from(b.sample_every.max(1));
    #[allow(clippy::cast_precision_loss, reason = "bytes")]
    let bulk_bytes = bulk_events * BULK_RECORD as f64;
    let gap_s = m.drain_gap_p999_us / 1e6;
    let p1_bytes = P1_BYTES_PER_STREAM_S * f64::from(c.cpus_per_node) * 2.0;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "bytes of a spool")]
    let spool = (((p0_bytes + p1_bytes) * 60.0 + bulk_bytes * 0.25) / f64::from(1u32 << 20)).ceil() as u64;
    let class = NodeClass {
        name: format!("gpu node ({} GPUs, {} × {} Gbit/s)", c.gpus_per_node, b.links, b.link_gbps),
        nodes: c.nodes,
        p0_events_per_s: p0_events,
        p0_bytes_per_s: p0_bytes,
        p0_burst_bytes: burst,
        bulk_events_per_s: bulk_events,
        bulk_bytes_per_s: bulk_bytes,
        p0_ring_bytes: ring_for((p0_bytes * gap_s).max(burst) * 3.0),
        bulk_ring_bytes: ring_for(bulk_bytes * gap_s * 3.0),
        // The shipper's floor: reserves (8 MiB each) + two 64 KiB batches, rounded up.
        spool_bytes: (spool.max(17) << 20),
    };
    let frames = f64::from(c.nodes) * (p0_events + bulk_events);
    Sizing {
        scenario: s.name.clone(),
        cluster_frames_per_s: frames,
        aggregator_ingest_cores: frames * m.ingest_ns / 1e9,
        aggregator_cores: frames * m.aggregator_ns / 1e9,
        classes: vec![class],
        measured: m,
    }
}

fn human(bytes: u64) -> String {
    #[allow(clippy::cast_precision_loss, reason = "display")]
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", b / f64::from(1u32 << 30))
    } else if bytes >= 1 << 20 {
        format!("{:.0} MiB", b / f64::from(1u32 << 20))
    } else {
        format!("{:.0} KiB", b / 1024.0)
    }
}

/// The table `loadgen size` prints.
#[must_use]
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "display of a byte count")]
pub fn table(z: &Sizing) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "loadgen size {} — drain gap p99.9 {:.0} µs, ingest {:.1} ns/frame, whole aggregator {:.0} ns/frame (measured: loadgen bench)",
        z.scenario, z.measured.drain_gap_p999_us, z.measured.ingest_ns, z.measured.aggregator_ns
    );
    for c in &z.classes {
        let _ = writeln!(o, "{} × {}:", c.nodes, c.name);
        let _ = writeln!(
            o,
            "  P0   {:>12.0} events/s {:>10.2} MB/s  burst {:>8}  → p0_ring_bytes   = {:>10} ({})",
            c.p0_events_per_s,
            c.p0_bytes_per_s / 1e6,
            human(c.p0_burst_bytes as u64),
            c.p0_ring_bytes,
            human(c.p0_ring_bytes)
        );
        let _ = writeln!(
            o,
            "  bulk {:>12.0} events/s {:>10.2} MB/s                    → bulk_ring_bytes = {:>10} ({})",
            c.bulk_events_per_s,
            c.bulk_bytes_per_s / 1e6,
            c.bulk_ring_bytes,
            human(c.bulk_ring_bytes)
        );
        let _ = writeln!(
            o,
            "  spool: P0+P1 × 60 s + bulk × 0.25 s                             → spool_bytes     = {:>10} ({})",
            c.spool_bytes,
            human(c.spool_bytes)
        );
    }
    let _ = writeln!(
        o,
        "cluster: {:.1} M frames/s → aggregator ingest {:.2} cores; with QUIC + API {:.2} cores",
        z.cluster_frames_per_s / 1e6,
        z.aggregator_ingest_cores,
        z.aggregator_cores
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(name: &str) -> Scenario {
        loadgen_sim::builtin::builtin(name).expect("built in").expect("valid")
    }

    #[test]
    fn rings_follow_the_rule_and_are_powers_of_two() {
        let s = scenario("seed-case");
        let z = size(&s, Measured::default());
        let c = &z.classes[0];
        let gap = MEASURED_DRAIN_GAP_P999_US / 1e6;
        assert!(c.bulk_ring_bytes.is_power_of_two() && c.p0_ring_bytes.is_power_of_two());
        #[allow(clippy::cast_precision_loss, reason = "a check")]
        let bulk = c.bulk_ring_bytes as f64;
        // At least the rule's bytes, less than twice them (the next power of two).
        assert!(bulk >= c.bulk_bytes_per_s * gap * 3.0 && bulk < c.bulk_bytes_per_s * gap * 6.0 + 4096.0);
        #[allow(clippy::cast_precision_loss, reason = "a check")]
        let p0 = c.p0_ring_bytes as f64;
        assert!(p0 >= c.p0_burst_bytes * 3.0, "a whole step's burst fits three times");
    }

    #[test]
    fn a_longer_drain_gap_needs_a_bigger_ring() {
        let s = scenario("seed-case");
        let a = size(&s, Measured::default());
        let b = size(&s, Measured { drain_gap_p999_us: 20_000.0, ..Measured::default() });
        assert!(b.classes[0].bulk_ring_bytes > a.classes[0].bulk_ring_bytes);
        assert!((b.aggregator_cores - a.aggregator_cores).abs() < 1e-9);
    }
}
