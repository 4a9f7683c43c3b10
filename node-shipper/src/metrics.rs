//! The shipper's `/metrics` (served on `http_listen` beside `/healthz`): every metric in
//! [`SPECS`] (listed in `docs/metrics.md`, checked by a test). Values come from what the
//! core, the kernel counters and the network side already count, read when scraped:
//! nothing here is on the per-frame path.
//!
//! The ring's write-pointer advance (the lap detector) is
//! `rate(ringwatch_ring_read_bytes_total[1m])`: a dropped reserve never moves it, and
//! what was written was read (the reader drains everything). Against
//! `ringwatch_ring_size_bytes` and the drain gap's p99 it says whether a ring is sized for
//! its traffic (the alert rules use exactly that).

use crate::core::ringstats::RingMetrics;
use crate::core::shipper::{LaneLatency, STAGES};
use crate::core::{ShipperStats, SourceCounters};
use proto_flat::LossCause;
use ringwatch_transport::metrics::{Families, Spec};

/// Every metric the shipper serves besides the build info and the process collector's
/// ([`ringwatch_transport::metrics::STANDARD`]).
pub const SPECS: &[Spec] = &[
    // The kernel side, per (ring, CPU) stream of the current epoch.
    Spec::counter(
        "ringwatch_kernel_events_attempted_total",
        "1",
        &["ring", "cpu"],
        "Events that took a seq (written to the ring or dropped).",
    ),
    Spec::counter(
        "ringwatch_kernel_drops_total",
        "1",
        &["ring", "cpu", "cause"],
        "Events the kernel could not write, by cause (ring full, ...).",
    ),
    Spec::counter(
        "ringwatch_kernel_sampled_out_total",
        "1",
        &["ring", "cpu"],
        "Events the sampler skipped before taking a seq.",
    ),
    Spec::gauge(
        "ringwatch_ring_fill_max_ratio",
        "ratio",
        &["ring", "cpu"],
        "Highest ring fill seen by the reader since the last heartbeat (0..1).",
    ),
    Spec::histogram(
        "ringwatch_ring_fill_ratio",
        "ratio",
        &["ring"],
        "Ring fill found by each drain pass (bytes read before the ring was empty, over its size).",
    ),
    Spec::gauge("ringwatch_ring_size_bytes", "bytes", &["ring"], "Each ring's size."),
    Spec::counter(
        "ringwatch_ring_read_bytes_total",
        "bytes",
        &["ring"],
        "Record bytes read from each ring, 8-byte record headers included.",
    ),
    Spec::histogram(
        "ringwatch_ring_drain_gap_seconds",
        "seconds",
        &[],
        "Time between the starts of consecutive drain passes.",
    ),
    Spec::histogram(
        "ringwatch_kernel_drop_burst_frames",
        "frames",
        &["ring"],
        "Kernel drops per burst: a run of seqs missing between consecutive frames of one stream.",
    ),
    Spec::histogram(
        "ringwatch_kernel_drop_burst_seconds",
        "seconds",
        &["ring"],
        "Time between the frames either side of a kernel drop burst.",
    ),
    Spec::gauge("ringwatch_shipper_sampling_level", "1", &[], "The kernel's bulk sampling level (keep 1 in 2^level)."),
    // The shipper core.
    Spec::counter("ringwatch_shipper_frames_read_total", "frames", &[], "Ring records handed to the core."),
    Spec::counter(
        "ringwatch_shipper_frames_malformed_total",
        "frames",
        &[],
        "Ring records that were not a frame (counted, not shipped).",
    ),
    Spec::counter(
        "ringwatch_shipper_frames_batched_total",
        "frames",
        &["lane"],
        "Frames put into batches, by lane (p1 holds the shipper's own).",
    ),
    Spec::counter(
        "ringwatch_shipper_frames_acked_total",
        "frames",
        &["lane"],
        "Frames of batches the aggregator acked, by lane.",
    ),
    Spec::counter(
        "ringwatch_shipper_frames_unacked_total",
        "frames",
        &["lane"],
        "Frames of batches that left the spool unacked (named in loss records), by lane.",
    ),
    Spec::counter(
        "ringwatch_shipper_frames_lost_total",
        "frames",
        &["cause"],
        "Ring frames named in loss records, by cause.",
    ),
    Spec::counter(
        "ringwatch_shipper_frames_shed_total",
        "frames",
        &[],
        "Ring frames the reader shed before the spool (its queue full); also in frames_lost.",
    ),
    Spec::counter(
        "ringwatch_shipper_batches_total",
        "1",
        &["event"],
        "Batches cut, acked, nacked, shed by the reader, evicted by the spool, shed for memory pressure.",
    ),
    Spec::counter("ringwatch_shipper_heartbeats_total", "1", &[], "Heartbeats sent."),
    Spec::counter("ringwatch_shipper_loss_records_total", "1", &[], "Loss records sent."),
    Spec::counter(
        "ringwatch_shipper_lane_resends_total",
        "1",
        &["lane"],
        "Lanes sent again because their acks stalled.",
    ),
    Spec::counter("ringwatch_shipper_send_failures_total", "1", &[], "Batches sent again because their stream failed."),
    Spec::gauge("ringwatch_shipper_spool_bytes", "bytes", &["lane"], "Bytes held in the spool, by lane."),
    Spec::gauge("ringwatch_shipper_spool_cap_bytes", "bytes", &[], "The spool's cap in force."),
    Spec::gauge(
        "ringwatch_shipper_reader_queue_bytes",
        "bytes",
        &[],
        "Staged bytes between the ring reader and the core.",
    ),
    Spec::gauge(
        "ringwatch_shipper_reader_queue_cap_bytes",
        "bytes",
        &[],
        "The reader queue's cap (past it the reader sheds bulk).",
    ),
    Spec::gauge("ringwatch_shipper_pool_bytes", "bytes", &["pool"], "Recycled batch buffers held (core, reader)."),
    Spec::counter(
        "ringwatch_shipper_pool_turned_away_total",
        "1",
        &["pool"],
        "Buffers the pool's byte cap turned away.",
    ),
    Spec::histogram(
        "ringwatch_shipper_stage_seconds",
        "seconds",
        &["stage"],
        "Per delivered batch, the time in each stage: read (bulk: first frame's kernel timestamp to the drain pass that read it), batch (to sealed), send (to first sent), ack (to applied ack).",
    ),
    Spec::histogram(
        "ringwatch_shipper_delivery_seconds",
        "seconds",
        &["lane"],
        "Per delivered batch, its first frame read to the aggregator's applied ack.",
    ),
    Spec::histogram(
        "ringwatch_shipper_durable_lag_seconds",
        "seconds",
        &[],
        "Per P0/P1 batch kept until durable, its first frame read to the durable ack.",
    ),
    // The network side.
    Spec::gauge("ringwatch_shipper_connected", "1", &[], "1 while a session with the aggregator is established."),
    Spec::counter("ringwatch_shipper_connect_attempts_total", "1", &[], "Connection attempts."),
    Spec::counter("ringwatch_shipper_connections_total", "1", &[], "Connections made (handshake done)."),
    Spec::counter(
        "ringwatch_shipper_connections_refused_total",
        "1",
        &[],
        "Attempts the aggregator refused (certificate, identity, abuse).",
    ),
    Spec::counter(
        "ringwatch_shipper_failovers_total",
        "1",
        &[],
        "Moves to the next ingest shard of the aggregator list (rendezvous order): the one in use could not be reached.",
    ),
    // Memory pressure.
    Spec::gauge(
        "ringwatch_shipper_memory_pressure_level",
        "1",
        &[],
        "The pressure watcher's level (0 nominal, 1 some, 2 full).",
    ),
    Spec::counter("ringwatch_shipper_p3_sheds_total", "1", &[], "Times P3 work was shed under pressure."),
    // Certificate rotation.
    ringwatch_transport::reload::SPECS[0],
    ringwatch_transport::reload::SPECS[1],
    ringwatch_transport::reload::SPECS[2],
];

/// What one scrape reads (taken from the shipper's shared state by the driver).
#[derive(Debug, Default)]
pub struct Reading {
    pub stats: ShipperStats,
    pub counters: SourceCounters,
    pub sampling_level: u8,
    pub spool_lane_bytes: [usize; 4],
    pub spool_cap_bytes: usize,
    pub spool_evicted: u64,
    pub spool_shed_pressure: u64,
    pub queue_bytes: usize,
    pub queue_cap_bytes: usize,
    pub pools: [(usize, u64); 2],
    pub connected: bool,
    pub connect_attempts: u64,
    pub connections: u64,
    pub connections_refused: u64,
    pub failovers: u64,
    pub pressure_level: u8,
    pub p3_sheds: u64,
    /// The core's batch latency histograms.
    pub latency: Option<LaneLatency>,
    /// The ring reader's histograms (sources that read rings).
    pub ring: Option<RingMetrics>,
    /// The certificate reloads.
    pub tls: Option<std::sync::Arc<ringwatch_transport::reload::ReloadCounters>>,
}

/// Bounds of the shipper's latency histograms, seconds.
pub const LATENCY_BOUNDS: &[f64] =
    &[0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

const LANES: [&str; 4] = ["p0", "p1", "p2", "p3"];

/// The text of one scrape.
#[must_use]
pub fn render(r: &Reading) -> String {
    let mut f = Families::new(SPECS);
    f.standard("node-shipper", env!("CARGO_PKG_VERSION"));
    fill(&mut f, r);
    if !f.refused().is_empty() {
        tracing::error!(refused = ?f.refused(), "metrics outside the table (a bug)");
    }
    f.render()
}

/// Fills `f` from `r` (pure).
#[allow(clippy::cast_precision_loss, reason = "ratios for a dashboard")]
pub fn fill(f: &mut Families, r: &Reading) {
    for e in &r.counters.streams {
        let id = e.stream();
        let (ring, cpu) = (id.ring().to_string(), id.cpu().to_string());
        f.count("ringwatch_kernel_events_attempted_total", &[&ring, &cpu], e.attempted_seq.get());
        for (slot, n) in e.drops.iter().enumerate() {
            let Some(cause) = LossCause::from_drop_slot(slot) else { continue };
            if matches!(cause, LossCause::KernelRingFull | LossCause::Oversized) {
                f.count("ringwatch_kernel_drops_total", &[&ring, &cpu, &cause.to_string()], n.get());
            }
        }
        f.count("ringwatch_kernel_sampled_out_total", &[&ring, &cpu], e.sampled_out.get());
        f.gauge("ringwatch_ring_fill_max_ratio", &[&ring, &cpu], f64::from(e.fill_max_ppm.get()) / 1e6);
    }
    f.level("ringwatch_shipper_sampling_level", &[], u64::from(r.sampling_level));
    if let Some(tls) = &r.tls {
        ringwatch_transport::reload::fill(f, "quic", tls);
    }
    let s = &r.stats;
    f.count("ringwatch_shipper_frames_read_total", &[], s.frames_in);
    f.count("ringwatch_shipper_frames_malformed_total", &[], s.frames_malformed);
    for (i, lane) in LANES.iter().enumerate() {
        let at = |a: &[u64; 4]| a.get(i).copied().unwrap_or(0);
        f.count("ringwatch_shipper_frames_batched_total", &[lane], at(&s.frames_in_by_lane));
        f.count("ringwatch_shipper_frames_acked_total", &[lane], at(&s.frames_acked_by_lane));
        f.count("ringwatch_shipper_frames_unacked_total", &[lane], at(&s.frames_lost_by_lane));
        f.count("ringwatch_shipper_lane_resends_total", &[lane], at(&s.lane_resends_by_lane));
        f.level("ringwatch_shipper_spool_bytes", &[lane], r.spool_lane_bytes.get(i).map_or(0, |&b| b as u64));
    }
    for (slot, n) in s.frames_lost.iter().enumerate() {
        if let Some(cause) = LossCause::from_drop_slot(slot) {
            f.count("ringwatch_shipper_frames_lost_total", &[&cause.to_string()], *n);
        }
    }
    f.count("ringwatch_shipper_frames_shed_total", &[], s.frames_shed);
    for (event, n) in [
        ("cut", s.batches_cut),
        ("acked", s.batches_acked),
        ("nacked", s.batches_nacked),
        ("shed_by_reader", s.batches_shed),
        ("evicted", r.spool_evicted),
        ("shed_pressure", r.spool_shed_pressure),
    ] {
        f.count("ringwatch_shipper_batches_total", &[event], n);
    }
    f.count("ringwatch_shipper_heartbeats_total", &[], s.heartbeats);
    f.count("ringwatch_shipper_loss_records_total", &[], s.loss_records);
    f.count("ringwatch_shipper_send_failures_total", &[], s.send_failures);
    f.level("ringwatch_shipper_spool_cap_bytes", &[], r.spool_cap_bytes as u64);
    f.level("ringwatch_shipper_reader_queue_bytes", &[], r.queue_bytes as u64);
    f.level("ringwatch_shipper_reader_queue_cap_bytes", &[], r.queue_cap_bytes as u64);
    for (pool, (bytes, turned_away)) in ["core", "reader"].iter().zip(r.pools) {
        f.level("ringwatch_shipper_pool_bytes", &[pool], bytes as u64);
        f.count("ringwatch_shipper_pool_turned_away_total", &[pool], turned_away);
    }
    f.level("ringwatch_shipper_connected", &[], u64::from(r.connected));
    f.count("ringwatch_shipper_connect_attempts_total", &[], r.connect_attempts);
    f.count("ringwatch_shipper_connections_total", &[], r.connections);
    f.count("ringwatch_shipper_connections_refused_total", &[], r.connections_refused);
    f.count("ringwatch_shipper_failovers_total", &[], r.failovers);
    f.level("ringwatch_shipper_memory_pressure_level", &[], u64::from(r.pressure_level));
    f.count("ringwatch_shipper_p3_sheds_total", &[], r.p3_sheds);
    if let Some(l) = &r.latency {
        for (stage, h) in STAGES.iter().zip(&l.stages) {
            f.hdr("ringwatch_shipper_stage_seconds", &[stage], h, 1e6, LATENCY_BOUNDS);
        }
        for (lane, h) in LANES.iter().zip(&l.lanes) {
            f.hdr("ringwatch_shipper_delivery_seconds", &[lane], h, 1e6, LATENCY_BOUNDS);
        }
        f.hdr("ringwatch_shipper_durable_lag_seconds", &[], &l.durable, 1e6, LATENCY_BOUNDS);
    }
    if let Some(m) = &r.ring {
        for ring in 0..2 {
            let label = ring.to_string();
            f.buckets("ringwatch_ring_fill_ratio", &[&label], &m.fill[ring]);
            f.level("ringwatch_ring_size_bytes", &[&label], u64::from(m.ring_bytes[ring]));
            f.count("ringwatch_ring_read_bytes_total", &[&label], m.read_bytes[ring]);
            f.buckets("ringwatch_kernel_drop_burst_frames", &[&label], &m.burst_frames[ring]);
            f.buckets("ringwatch_kernel_drop_burst_seconds", &[&label], &m.burst_seconds[ring]);
        }
        f.buckets("ringwatch_ring_drain_gap_seconds", &[], &m.drain_gap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto_flat::sections::StreamEntry;
    use zerocopy::FromZeros as _;

    #[test]
    fn the_table_follows_the_naming_rules_and_a_reading_fills_every_family() {
        assert_eq!(ringwatch_transport::metrics::problems(SPECS), Vec::<String>::new());
        let mut entry = StreamEntry::new_zeroed();
        entry.stream_id.set(proto_flat::StreamId::new(proto_flat::Class::P2, 1, 3).0);
        entry.attempted_seq.set(100);
        entry.fill_max_ppm.set(500_000);
        let slot = LossCause::KernelRingFull.drop_slot().unwrap();
        entry.drops[slot].set(7);
        let r = Reading {
            counters: SourceCounters { streams: vec![entry], ..SourceCounters::default() },
            latency: Some(LaneLatency::default()),
            ring: Some(RingMetrics::new([4096, 8192])),
            tls: Some(std::sync::Arc::default()),
            ..Reading::default()
        };
        let mut f = Families::new(SPECS);
        f.standard("node-shipper", "t");
        fill(&mut f, &r);
        assert_eq!(f.refused(), &[] as &[String]);
        let names = f.names();
        for s in SPECS.iter().chain(&ringwatch_transport::metrics::STANDARD) {
            assert!(names.contains(&s.name), "{} has no sample", s.name);
        }
        let text = f.render();
        assert!(
            text.contains("ringwatch_kernel_drops_total{ring=\"1\",cpu=\"3\",cause=\"kernel_ring_full\"} 7"),
            "{text}"
        );
        assert!(text.contains("ringwatch_ring_fill_max_ratio{ring=\"1\",cpu=\"3\"} 0.5"), "{text}");
    }
}
