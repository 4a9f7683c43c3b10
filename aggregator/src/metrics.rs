//! The aggregator's `/metrics`: every metric it serves is in [`SPECS`] (listed in
//! `docs/metrics.md`, checked by a test). A scrape reads the same answers the API gives
//! (`/v1/ingest`, `/v1/nodes`, `/v1/summary`, `/healthz`'s tasks), so a number here is
//! the API's number: loss by node, class and cause is `/v1/nodes`' streams summed.
//!
//! Label cardinality: node labels only for the nodes the aggregator knows, at most
//! [`MAX_NODES`]; GPU labels at most [`MAX_GPUS`] (one series per GPU: its current
//! health). What the caps leave out is counted in `ringwatch_metrics_series_omitted`.

use crate::api;
use crate::state::{CoreFailed, Shared};
use ringwatch_transport::metrics::{Families, Kind, Spec};
use std::collections::BTreeMap;

/// Nodes with their own series; past it, nodes are left out (and counted).
pub const MAX_NODES: usize = 4_096;
/// GPUs with a health series.
pub const MAX_GPUS: usize = 32_768;

/// Node health states, each a series of `ringwatch_node_health` (1 for the node's
/// state, 0 for the others: alert on `== 1`).
pub const HEALTH_STATES: [&str; 6] = ["healthy", "healthy_lossy", "suspect", "degraded", "silent", "unreachable"];

/// Every metric the aggregator serves besides the build info and the process
/// collector's ([`ringwatch_transport::metrics::STANDARD`]).
pub const SPECS: &[Spec] = &[
    // Intake.
    Spec::counter("ringwatch_aggregator_connections_total", "1", &[], "QUIC connections accepted."),
    Spec::counter("ringwatch_aggregator_handshake_failures_total", "1", &[], "QUIC/TLS handshakes that failed."),
    Spec::counter(
        "ringwatch_aggregator_identity_refused_total",
        "1",
        &[],
        "Peers refused: no usable DNS name in the client certificate.",
    ),
    Spec::counter(
        "ringwatch_aggregator_node_mismatch_total",
        "1",
        &[],
        "Batches whose node_id disagreed with the certificate's name.",
    ),
    Spec::counter("ringwatch_aggregator_batches_applied_total", "1", &[], "Batches applied to the core."),
    Spec::counter(
        "ringwatch_aggregator_batches_duplicate_total",
        "1",
        &[],
        "Batches received again after being applied (acked, not applied twice).",
    ),
    Spec::counter("ringwatch_aggregator_batches_rejected_total", "1", &["reason"], "Batches nacked, by reason."),
    Spec::counter("ringwatch_aggregator_stream_errors_total", "1", &[], "Batch streams that failed before their end."),
    Spec::counter("ringwatch_aggregator_protocol_errors_total", "1", &[], "Control-stream protocol errors."),
    Spec::counter(
        "ringwatch_aggregator_connections_closed_abuse_total",
        "1",
        &[],
        "Connections closed for too many rejected batches.",
    ),
    Spec::counter("ringwatch_aggregator_frames_applied_total", "frames", &[], "Frames applied (each seq once)."),
    Spec::counter("ringwatch_aggregator_frames_duplicate_total", "frames", &[], "Frames received again."),
    Spec::counter(
        "ringwatch_aggregator_frames_malformed_total",
        "frames",
        &[],
        "Frames whose body did not decode (accounted by seq).",
    ),
    Spec::counter("ringwatch_aggregator_loss_intervals_total", "1", &[], "Loss intervals recorded."),
    Spec::counter("ringwatch_aggregator_resumes_total", "1", &[], "Shipper sessions resumed."),
    Spec::counter(
        "ringwatch_aggregator_resume_batches_settled_total",
        "1",
        &[],
        "Batches a resume settled as already applied.",
    ),
    Spec::counter("ringwatch_aggregator_dedup_window_full_total", "1", &[], "Batches past the dedup window's cap."),
    Spec::counter(
        "ringwatch_aggregator_implausible_batches_total",
        "1",
        &[],
        "Batches refused for implausible numbers.",
    ),
    Spec::counter("ringwatch_aggregator_owners_turned_away_total", "1", &[], "GPU owner entries beyond the cap."),
    Spec::counter(
        "ringwatch_aggregator_evictions_total",
        "1",
        &["cap"],
        "Entries a bounded map or store turned away or evicted, by cap.",
    ),
    Spec::gauge("ringwatch_aggregator_map_entries", "1", &["map"], "Entries held by a bounded map."),
    Spec::gauge("ringwatch_aggregator_map_capacity", "1", &["map"], "The map's cap."),
    // Snapshots.
    Spec::counter(
        "ringwatch_aggregator_snapshots_total",
        "1",
        &["result"],
        "Snapshot attempts, by result (written, failed).",
    ),
    Spec {
        name: "ringwatch_aggregator_snapshot_duration_seconds",
        kind: Kind::Histogram,
        unit: "seconds",
        labels: &[],
        help: "Time to capture and write a snapshot.",
    },
    Spec::histogram(
        "ringwatch_end_to_end_latency_seconds",
        "seconds",
        &["class"],
        "A frame's kernel timestamp (cluster time) to its batch applied; one observation per batch and stream, its oldest frame.",
    ),
    Spec::counter(
        "ringwatch_end_to_end_unsynced_total",
        "1",
        &[],
        "Batch streams not observed for end-to-end latency: their node's clock was not estimated yet.",
    ),
    Spec::counter(
        "ringwatch_otlp_records_total",
        "1",
        &["result"],
        "Events of the event stream given to the OTLP exporter, by result: exported, dropped_evicted (the event log dropped them before export), dropped_rejected (the collector refused them).",
    ),
    Spec::counter(
        "ringwatch_otlp_requests_total",
        "1",
        &["result"],
        "OTLP export requests, by result (ok, failed: sent again unless rejected).",
    ),
    // Certificate rotation (QUIC listener; HTTP listener with TLS on).
    ringwatch_transport::reload::SPECS[0],
    ringwatch_transport::reload::SPECS[1],
    ringwatch_transport::reload::SPECS[2],
    // Loss-aware figures of final collectives (ringwatch_core::matcher::derived).
    Spec::counter(
        "ringwatch_collectives_final_total",
        "1",
        &["op", "timing"],
        "Collectives that became final, by op and timing: complete (every rank's kernel start and completion arrived: the only ones in the duration, skew and bandwidth histograms) or incomplete.",
    ),
    Spec::gauge(
        "ringwatch_collective_timing_coverage_ratio",
        "ratio",
        &["op"],
        "Final collectives with complete timing ÷ final collectives: how much of the work the timing histograms describe (they lean fast when slow ops' frames are lost).",
    ),
    Spec::counter("ringwatch_collective_ranks_final_total", "1", &["op"], "Rank verdicts of final collectives."),
    Spec::counter(
        "ringwatch_collective_ranks_inferred_total",
        "1",
        &["op"],
        "Ranks of final collectives whose completion was inferred (their frames lost): never timed.",
    ),
    Spec::histogram(
        "ringwatch_collective_duration_seconds",
        "seconds",
        &["op"],
        "Per rank of a collective with complete timing: kernel start to completion on its node's own clock.",
    ),
    Spec::histogram(
        "ringwatch_collective_skew_seconds",
        "seconds",
        &["op"],
        "Per collective with complete timing: latest minus earliest rank kernel start, in cluster time.",
    ),
    Spec::histogram(
        "ringwatch_collective_bus_bandwidth_bytes_per_second",
        "bytes_per_second",
        &["op"],
        "Per rank of a collective with complete timing and a known size: bus bandwidth by the nccl-tests formulas (all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n of the total; broadcast, reduce 1).",
    ),
    Spec::histogram(
        "ringwatch_verdict_time_to_final_seconds",
        "seconds",
        &["op"],
        "Per collective that became final: its first frame's arrival to its final verdict (aggregator time).",
    ),
    Spec::gauge("ringwatch_aggregator_snapshot_size_bytes", "bytes", &[], "Size of the last snapshot written."),
    Spec::gauge(
        "ringwatch_aggregator_snapshot_lock_hold_seconds",
        "seconds",
        &[],
        "How long the last snapshot held the core's lock.",
    ),
    // Verdicts.
    Spec::gauge("ringwatch_verdicts", "1", &["outcome"], "Rank verdicts held, by outcome kind."),
    Spec::gauge("ringwatch_verdicts_held", "1", &["final"], "Rank verdicts held, final or open."),
    Spec::gauge("ringwatch_verdict_store_size_bytes", "bytes", &[], "Estimated size of the verdict store."),
    Spec::gauge(
        "ringwatch_hung_collectives",
        "1",
        &[],
        "Ops with a final unfinished rank verdict whose rank has not recovered.",
    ),
    Spec::gauge(
        "ringwatch_correlated_degradation",
        "1",
        &[],
        "1 when more than the configured share of nodes turned degraded or lossy within the window.",
    ),
    Spec::gauge(
        "ringwatch_aggregator_saturated",
        "1",
        &[],
        "1 when the aggregator cannot keep up (memory pressure, a stalled timer, a cap reached).",
    ),
    Spec::gauge("ringwatch_nodes", "1", &["health"], "Nodes by health."),
    // Per node.
    Spec::gauge("ringwatch_node_connected", "1", &["node"], "1 while any connection of the node is live."),
    Spec::gauge("ringwatch_node_health", "1", &["node", "health"], "1 for the node's health, 0 for the other states."),
    Spec::gauge(
        "ringwatch_gpu_health",
        "1",
        &["node", "gpu", "health"],
        "A GPU with a verdict: its health (always 1).",
    ),
    Spec::counter(
        "ringwatch_node_frames_received_total",
        "frames",
        &["node", "class"],
        "Frames received from the node, by class (p0..p3).",
    ),
    Spec::counter(
        "ringwatch_node_frames_lost_total",
        "frames",
        &["node", "class", "cause"],
        "Frames lost, by class and cause (kernel ring full, shipper spool full, psi_shed, ...).",
    ),
    Spec::counter(
        "ringwatch_node_frames_attempted_total",
        "frames",
        &["node", "class"],
        "Events that took a seq, from the node's last heartbeat.",
    ),
    Spec::counter(
        "ringwatch_node_frames_sampled_out_total",
        "frames",
        &["node", "class"],
        "Events the kernel sampled out before taking a seq.",
    ),
    Spec::gauge(
        "ringwatch_node_bulk_events_per_second",
        "events_per_second",
        &["node"],
        "Bulk (P2) events the node's kernel counted per second (attempted + sampled out, whether or not their frames arrived), over the last 10 s of heartbeats (/v1/nodes bulk).",
    ),
    Spec::gauge(
        "ringwatch_node_bulk_coverage_ratio",
        "ratio",
        &["node"],
        "Bulk frames received ÷ bulk events that took a seq (/v1/nodes bulk.coverage).",
    ),
    Spec::gauge(
        "ringwatch_node_bulk_lost_ratio",
        "ratio",
        &["node"],
        "Bulk frames lost (every cause) ÷ bulk events that took a seq (/v1/nodes bulk.lost_share).",
    ),
    Spec::gauge(
        "ringwatch_interface_packets_per_second",
        "packets_per_second",
        &["node", "ifindex"],
        "Packets per second on a node's network interface, from the kernel's per-interface counters (every packet, before sampling and the ring), over the last 10 s of heartbeats; ifindex 0: the interfaces beyond the kernel map's cap (/v1/nodes bulk.interfaces).",
    ),
    Spec::gauge(
        "ringwatch_interface_bytes_per_second",
        "bytes_per_second",
        &["node", "ifindex"],
        "Bytes per second on a node's network interface, counted like ringwatch_interface_packets_per_second.",
    ),
    Spec::counter(
        "ringwatch_node_interfaces_turned_away_total",
        "1",
        &["node"],
        "Interface entries of a node's heartbeats beyond the per-node cap (65), since this aggregator started.",
    ),
    Spec::gauge("ringwatch_node_frames_pending", "frames", &["node"], "Seqs neither received nor resolved yet."),
    Spec::gauge(
        "ringwatch_node_frames_in_transit",
        "frames",
        &["node"],
        "Seqs the shipper reported spooled and not yet received.",
    ),
    Spec::gauge(
        "ringwatch_node_watermark_lag_seconds",
        "seconds",
        &["node", "class"],
        "Aggregator time minus the node's watermark in cluster time (class p0 or bulk).",
    ),
    Spec::gauge(
        "ringwatch_node_shipper_shed_tier",
        "1",
        &["node"],
        "The shipper's memory-pressure shed tier from its last heartbeat (0 none .. 3).",
    ),
    Spec::gauge(
        "ringwatch_node_shipper_spool_bytes",
        "bytes",
        &["node"],
        "The shipper's spool use from its last heartbeat.",
    ),
    Spec::gauge(
        "ringwatch_metrics_series_omitted",
        "1",
        &["label"],
        "Nodes or GPUs left out of this scrape by the label caps.",
    ),
    // The aggregator's own health.
    Spec::gauge(
        "ringwatch_aggregator_task_up",
        "1",
        &["task"],
        "1 while the supervised task runs, 0 once it stopped (tasks never started have no series).",
    ),
    Spec::counter("ringwatch_aggregator_task_panics_total", "1", &["task"], "Panics caught in the task."),
    Spec::counter("ringwatch_aggregator_task_restarts_total", "1", &["task"], "Restarts of the task after a panic."),
    Spec::gauge(
        "ringwatch_aggregator_up",
        "1",
        &[],
        "1 while the core runs (0: the core failed; the API answers 503).",
    ),
    Spec::gauge(
        "ringwatch_aggregator_memory_pressure_level",
        "1",
        &[],
        "The aggregator's own memory-pressure level (0 nominal, 1 some, 2 full).",
    ),
    // Events and HTTP.
    Spec::gauge("ringwatch_events_held", "1", &[], "Events kept for /v1/events resumption."),
    Spec::counter("ringwatch_events_evicted_total", "1", &[], "Events evicted from the log by its cap."),
    Spec::gauge("ringwatch_event_subscribers", "1", &[], "Open /v1/events streams."),
    Spec::counter("ringwatch_event_subscribers_refused_total", "1", &[], "Subscribers refused at the cap."),
    Spec::counter("ringwatch_event_gaps_sent_total", "1", &[], "gap events sent to resuming subscribers."),
    Spec::counter("ringwatch_http_connections_total", "1", &[], "HTTP connections accepted."),
    Spec::gauge("ringwatch_http_connections_open", "1", &[], "HTTP connections open."),
    Spec::counter("ringwatch_http_refused_at_cap_total", "1", &[], "HTTP connections refused at the cap."),
    Spec::counter(
        "ringwatch_http_header_timeouts_total",
        "1",
        &[],
        "HTTP connections closed for not sending headers in time.",
    ),
    Spec::counter("ringwatch_http_unauthorized_total", "1", &[], "HTTP requests without the right bearer token."),
];

fn secs_of_ns(ns: i128) -> f64 {
    #[allow(clippy::cast_precision_loss, reason = "seconds for a dashboard")]
    let s = ns as f64 / 1e9;
    s
}

/// One scrape. The core failed: only the build info, the process and `up` 0.
pub fn scrape(s: &Shared) -> String {
    let mut f = Families::new(SPECS);
    f.standard("aggregator", env!("CARGO_PKG_VERSION"));
    if let Err(CoreFailed) = fill(s, &mut f) {
        f.gauge("ringwatch_aggregator_up", &[], 0.0);
    }
    if !f.refused().is_empty() {
        tracing::error!(refused = ?f.refused(), "metrics outside the table (a bug)");
    }
    f.render()
}

#[allow(clippy::cast_precision_loss, reason = "seconds for a dashboard")]
fn end_to_end(f: &mut Families, e: &ringwatch_core::ingest::EndToEnd) {
    use ringwatch_core::ingest::E2E_BOUNDS_NS;
    // P1 is the shipper's own records: not observed.
    for (class, name) in [(0, "p0"), (2, "p2"), (3, "p3")] {
        let mut n = 0;
        let buckets: Vec<(f64, u64)> = E2E_BOUNDS_NS
            .iter()
            .zip(&e.counts[class])
            .map(|(&le, &c)| {
                n += c;
                (le as f64 / 1e9, n)
            })
            .collect();
        f.histogram(
            "ringwatch_end_to_end_latency_seconds",
            &[name],
            &buckets,
            e.sum_ns[class] as f64 / 1e9,
            e.count(class),
        );
    }
    f.count("ringwatch_end_to_end_unsynced_total", &[], e.unsynced);
}

/// The loss-aware figures of final collectives, per op kind with any.
fn collectives(f: &mut Families, d: &ringwatch_core::matcher::Derived) {
    use ringwatch_core::matcher::derived::{BUSBW_BOUNDS, Derived, SECONDS_BOUNDS, TO_FINAL_BOUNDS};
    for (i, fig) in d.by_op.iter().enumerate().filter(|(_, g)| g.decided > 0) {
        let op = Derived::name(i);
        f.count("ringwatch_collectives_final_total", &[op, "complete"], fig.complete);
        f.count("ringwatch_collectives_final_total", &[op, "incomplete"], fig.decided.saturating_sub(fig.complete));
        if let Some(c) = fig.coverage() {
            f.gauge("ringwatch_collective_timing_coverage_ratio", &[op], c);
        }
        f.count("ringwatch_collective_ranks_final_total", &[op], fig.ranks_decided);
        f.count("ringwatch_collective_ranks_inferred_total", &[op], fig.ranks_inferred);
        for (name, h, bounds) in [
            ("ringwatch_collective_duration_seconds", &fig.duration, &SECONDS_BOUNDS[..]),
            ("ringwatch_collective_skew_seconds", &fig.skew, &SECONDS_BOUNDS[..]),
            ("ringwatch_collective_bus_bandwidth_bytes_per_second", &fig.busbw, &BUSBW_BOUNDS[..]),
            ("ringwatch_verdict_time_to_final_seconds", &fig.time_to_final, &TO_FINAL_BOUNDS[..]),
        ] {
            f.histogram(name, &[op], &h.cumulative(bounds), h.sum, h.count);
        }
    }
}

fn fill(s: &Shared, f: &mut Families) -> Result<(), CoreFailed> {
    let ingest = api::ingest_dto(s)?;
    let nodes = api::nodes_dto(s)?;
    let summary = api::resources::summary_dto(s)?;
    f.gauge("ringwatch_aggregator_up", &[], 1.0);
    f.count("ringwatch_aggregator_connections_total", &[], ingest.connections);
    f.count("ringwatch_aggregator_handshake_failures_total", &[], ingest.handshake_failures);
    f.count("ringwatch_aggregator_identity_refused_total", &[], ingest.identity_refused);
    f.count("ringwatch_aggregator_node_mismatch_total", &[], ingest.node_mismatch);
    f.count("ringwatch_aggregator_batches_applied_total", &[], ingest.batches_applied);
    f.count("ringwatch_aggregator_batches_duplicate_total", &[], ingest.batches_duplicate);
    for (reason, n) in &ingest.rejected {
        f.count("ringwatch_aggregator_batches_rejected_total", &[reason], *n);
    }
    f.count("ringwatch_aggregator_stream_errors_total", &[], ingest.stream_errors);
    f.count("ringwatch_aggregator_protocol_errors_total", &[], ingest.protocol_errors);
    f.count("ringwatch_aggregator_connections_closed_abuse_total", &[], ingest.connections_closed_abuse);
    f.count("ringwatch_aggregator_frames_applied_total", &[], ingest.frames);
    f.count("ringwatch_aggregator_frames_duplicate_total", &[], ingest.duplicate_frames);
    f.count("ringwatch_aggregator_frames_malformed_total", &[], ingest.malformed_frames);
    f.count("ringwatch_aggregator_loss_intervals_total", &[], ingest.loss_intervals);
    f.count("ringwatch_aggregator_resumes_total", &[], ingest.resumes);
    f.count("ringwatch_aggregator_resume_batches_settled_total", &[], ingest.resume_batches_settled);
    f.count("ringwatch_aggregator_dedup_window_full_total", &[], ingest.dedup_window_full);
    f.count("ringwatch_aggregator_implausible_batches_total", &[], ingest.implausible_batches);
    f.count("ringwatch_aggregator_owners_turned_away_total", &[], ingest.owners_turned_away);
    for (cap, n) in &ingest.evictions {
        f.count("ringwatch_aggregator_evictions_total", &[cap], *n);
    }
    for (map, m) in &ingest.maps {
        f.level("ringwatch_aggregator_map_entries", &[map], m.len);
        f.level("ringwatch_aggregator_map_capacity", &[map], m.cap);
    }
    f.count("ringwatch_aggregator_snapshots_total", &["written"], ingest.snapshots_written);
    f.count("ringwatch_aggregator_snapshots_total", &["failed"], ingest.snapshot_failures);
    {
        use prometheus::core::Collector as _;
        f.extend(s.snapshot_seconds.collect());
    }
    f.level("ringwatch_aggregator_snapshot_size_bytes", &[], ingest.last_snapshot_bytes);
    ringwatch_transport::reload::fill(f, "quic", &s.tls_quic);
    if let Some(http) = &s.tls_http {
        ringwatch_transport::reload::fill(f, "http", http);
    }
    let o = &s.otlp;
    for (result, n) in
        [("exported", &o.exported), ("dropped_evicted", &o.dropped_evicted), ("dropped_rejected", &o.dropped_rejected)]
    {
        f.count("ringwatch_otlp_records_total", &[result], n.load(std::sync::atomic::Ordering::Relaxed));
    }
    f.count("ringwatch_otlp_requests_total", &["ok"], o.requests_ok.load(std::sync::atomic::Ordering::Relaxed));
    f.count(
        "ringwatch_otlp_requests_total",
        &["failed"],
        o.request_failures.load(std::sync::atomic::Ordering::Relaxed),
    );
    let (e2e, derived) = {
        let core = s.core()?;
        (core.ingest().end_to_end().clone(), core.matcher().derived().clone())
    };
    end_to_end(f, &e2e);
    collectives(f, &derived);
    #[allow(clippy::cast_precision_loss, reason = "seconds for a dashboard")]
    f.gauge("ringwatch_aggregator_snapshot_lock_hold_seconds", &[], ingest.last_snapshot_hold_us as f64 / 1e6);

    for (outcome, n) in &summary.verdicts_by_outcome {
        f.level("ringwatch_verdicts", &[outcome], *n);
    }
    let st = &ingest.verdict_store;
    f.level("ringwatch_verdicts_held", &["true"], st.finals);
    f.level("ringwatch_verdicts_held", &["false"], st.verdicts.saturating_sub(st.finals));
    f.level("ringwatch_verdict_store_size_bytes", &[], st.bytes);
    f.level("ringwatch_hung_collectives", &[], summary.hung_collectives);
    f.level("ringwatch_correlated_degradation", &[], u64::from(summary.correlated_degradation));
    f.level("ringwatch_aggregator_saturated", &[], u64::from(summary.aggregator_saturated));
    for h in HEALTH_STATES {
        f.level("ringwatch_nodes", &[h], summary.nodes_by_health.get(h).copied().unwrap_or(0));
    }

    let now_ns = i128::from(ingest.as_of.aggregator_ms) * 1_000_000;
    let mut gpus = 0usize;
    let (mut nodes_left_out, mut gpus_left_out) = (0u64, 0u64);
    for (i, n) in nodes.nodes.iter().enumerate() {
        if i >= MAX_NODES {
            nodes_left_out = nodes_left_out.saturating_add(1);
            continue;
        }
        let node = n.name.as_str();
        f.level("ringwatch_node_connected", &[node], u64::from(n.connected));
        for h in HEALTH_STATES {
            f.level("ringwatch_node_health", &[node, h], u64::from(n.health == h));
        }
        for gpu in &n.gpus {
            if gpus >= MAX_GPUS {
                gpus_left_out = gpus_left_out.saturating_add(1);
                continue;
            }
            gpus += 1;
            f.gauge("ringwatch_gpu_health", &[node, &gpu.gpu_uuid, &gpu.health], 1.0);
        }
        // Per class (and cause), summed over the node's streams and epochs.
        let mut received: BTreeMap<&str, u64> = BTreeMap::new();
        let mut attempted: BTreeMap<&str, u64> = BTreeMap::new();
        let mut sampled: BTreeMap<&str, u64> = BTreeMap::new();
        let mut lost: BTreeMap<(&str, &str), u64> = BTreeMap::new();
        let (mut pending, mut in_transit) = (0u64, 0u64);
        for st in &n.streams {
            let class = st.class.as_str();
            for (m, v) in [(&mut received, st.received), (&mut attempted, st.attempted), (&mut sampled, st.sampled_out)]
            {
                let e = m.entry(class).or_default();
                *e = e.saturating_add(v);
            }
            for (cause, v) in &st.lost {
                let e = lost.entry((class, cause.as_str())).or_default();
                *e = e.saturating_add(*v);
            }
            pending = pending.saturating_add(st.pending);
            in_transit = in_transit.saturating_add(st.in_transit);
        }
        for (class, v) in received {
            f.count("ringwatch_node_frames_received_total", &[node, class], v);
        }
        for (class, v) in attempted {
            f.count("ringwatch_node_frames_attempted_total", &[node, class], v);
        }
        for (class, v) in sampled {
            f.count("ringwatch_node_frames_sampled_out_total", &[node, class], v);
        }
        for ((class, cause), v) in lost {
            f.count("ringwatch_node_frames_lost_total", &[node, class, cause], v);
        }
        if let Some(b) = &n.bulk {
            if let Some(r) = b.events_per_second {
                f.gauge("ringwatch_node_bulk_events_per_second", &[node], r);
            }
            if let Some(c) = b.coverage {
                f.gauge("ringwatch_node_bulk_coverage_ratio", &[node], c);
            }
            if let Some(l) = b.lost_share {
                f.gauge("ringwatch_node_bulk_lost_ratio", &[node], l);
            }
            for i in &b.interfaces {
                let ifindex = i.ifindex.to_string();
                if let Some(r) = i.packets_per_second {
                    f.gauge("ringwatch_interface_packets_per_second", &[node, &ifindex], r);
                }
                if let Some(r) = i.bytes_per_second {
                    f.gauge("ringwatch_interface_bytes_per_second", &[node, &ifindex], r);
                }
            }
            f.count("ringwatch_node_interfaces_turned_away_total", &[node], b.interfaces_turned_away);
        }
        f.level("ringwatch_node_frames_pending", &[node], pending);
        f.level("ringwatch_node_frames_in_transit", &[node], in_transit);
        if let Some(offset) = n.clock_offset_ns {
            for (class, w) in [("p0", n.watermark_p0_node_ns), ("bulk", n.watermark_bulk_node_ns)] {
                if w > 0 {
                    let lag = now_ns - (i128::from(w) + i128::from(offset));
                    f.gauge("ringwatch_node_watermark_lag_seconds", &[node, class], secs_of_ns(lag));
                }
            }
        }
        if let Some(sh) = &n.shipper {
            f.level("ringwatch_node_shipper_shed_tier", &[node], u64::from(sh.shed_tier));
            f.level("ringwatch_node_shipper_spool_bytes", &[node], sh.spool_bytes);
        }
    }
    f.level("ringwatch_metrics_series_omitted", &["node"], nodes_left_out);
    f.level("ringwatch_metrics_series_omitted", &["gpu"], gpus_left_out);

    for t in api::tasks(s) {
        // A task this configuration never starts (snapshots off, no pressure watcher)
        // has no series: `task_up == 0` means a task that ran has stopped.
        if !t.alive && t.panics == 0 && t.last_progress_ago_ms.is_none() {
            continue;
        }
        f.level("ringwatch_aggregator_task_up", &[&t.name], u64::from(t.alive));
        f.count("ringwatch_aggregator_task_panics_total", &[&t.name], t.panics);
        f.count("ringwatch_aggregator_task_restarts_total", &[&t.name], t.restarts);
    }
    let level = api::pressure_dto(s).map_or(0, |p| match p.level.as_str() {
        "some" => 1,
        "full" => 2,
        _ => 0,
    });
    f.level("ringwatch_aggregator_memory_pressure_level", &[], level);

    let ev = &ingest.events;
    f.level("ringwatch_events_held", &[], ev.held);
    f.count("ringwatch_events_evicted_total", &[], ev.evicted);
    f.level("ringwatch_event_subscribers", &[], ev.subscribers);
    f.count("ringwatch_event_subscribers_refused_total", &[], ev.subscribers_refused);
    f.count("ringwatch_event_gaps_sent_total", &[], ev.gaps_sent);
    let h = &ingest.http;
    f.count("ringwatch_http_connections_total", &[], h.connections);
    f.level("ringwatch_http_connections_open", &[], h.open);
    f.count("ringwatch_http_refused_at_cap_total", &[], h.refused_at_cap);
    f.count("ringwatch_http_header_timeouts_total", &[], h.header_timeouts);
    f.count("ringwatch_http_unauthorized_total", &[], h.unauthorized);
    Ok(())
}

/// The snapshot-duration histogram's buckets (seconds).
pub const SNAPSHOT_BUCKETS: [f64; 12] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// The histogram the snapshot task observes.
#[must_use]
pub fn snapshot_histogram() -> prometheus::Histogram {
    let spec = SPECS.iter().find(|s| s.name == "ringwatch_aggregator_snapshot_duration_seconds");
    let (name, help) =
        spec.map_or(("ringwatch_aggregator_snapshot_duration_seconds", "snapshots"), |s| (s.name, s.help));
    let opts = prometheus::HistogramOpts::new(name, help).buckets(SNAPSHOT_BUCKETS.to_vec());
    // Only a bad name or bucket list fails, and both are fixed here (tested below).
    #[allow(clippy::expect_used, reason = "a fixed, valid name and bucket list")]
    prometheus::Histogram::with_opts(opts).expect("valid histogram options")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_follows_the_naming_rules() {
        assert_eq!(ringwatch_transport::metrics::problems(SPECS), Vec::<String>::new());
        assert!(
            prometheus::Histogram::with_opts(prometheus::HistogramOpts::new(
                "ringwatch_aggregator_snapshot_duration_seconds",
                "x"
            ))
            .is_ok()
        );
        assert_eq!(snapshot_histogram().get_sample_count(), 0);
    }
}
