//! What a batch or a `resume` may say before the core does arithmetic on it (issue 18).
//!
//! `BatchView::validate` checks a batch's framing (lengths, checksum, summary); it cannot
//! know that a seq of `u64::MAX` leaves no room for `seq + 1`, or that a heartbeat whose
//! counters are all `u64::MAX` describes no stream that ever ran. This module refuses
//! such input before anything of it is applied: the whole batch is refused (the shell
//! nacks it `malformed_frame`, counted), so the core never holds half of a nonsense
//! batch, and every number the core does arithmetic on is below [`MAX_SEQ`] or
//! [`MAX_NODE_NS`] — far enough from `u64::MAX` that sums of two of them, and `+ 1`,
//! cannot overflow.
//!
//! The limits are what a real stream can reach, with centuries to spare: a stream that
//! produced 10⁹ frames a second would reach [`MAX_SEQ`] after 146 years, and a node clock
//! reads [`MAX_NODE_NS`] 146 years after its epoch (realtime: in the year 2116).
//!
//! Rules (each names the field it refuses, for the log and the count):
//! - every frame's `seq` (through the validated stream summary: its `last_seq` is the
//!   largest seq of the stream in the batch) is below [`MAX_SEQ`], its `ts_ns` below
//!   [`MAX_NODE_NS`]; the batch's `batch_seq` below [`MAX_SEQ`];
//! - collective and P2P frames: the op sequence numbers (`comm_op_seq`, `local_op_seq`,
//!   `nccl_seq`, `p2p_seq`) below [`MAX_SEQ`];
//! - heartbeats: `snapshot_ns` below [`MAX_NODE_NS`]; per stream `attempted_seq`, every
//!   drop counter and `sampled_out` at most [`MAX_SEQ`], and `held_from_seq` at most
//!   `attempted_seq` (the shipper cannot hold a seq the kernel never attempted); per
//!   progress entry the three op seqs below [`MAX_SEQ`], `last_update_ns` below
//!   [`MAX_NODE_NS`]; per interface `packets` at most [`MAX_SEQ`] and `bytes` at most
//!   `packets` × [`MAX_PACKET_BYTES`];
//! - loss records: `first_seq ≤ last_seq < MAX_SEQ`, `1 ≤ count ≤ last_seq − first_seq + 1`
//!   (a record cannot lose more seqs than its range holds), `batch_seq` below
//!   [`MAX_SEQ`];
//! - session starts: every `attempted_seq` at most [`MAX_SEQ`];
//! - shipper gaps: `from_ns ≤ to_ns < MAX_NODE_NS`;
//! - a `resume`: `next_batch_seq` and every floor at most [`MAX_SEQ`], every held range
//!   `first ≤ last < MAX_SEQ`, `sent_ns` below [`MAX_NODE_NS`].
//!
//! Nothing here allocates; bulk batches are checked through their summary (one entry per
//! stream), P0 and P1 batches frame by frame.

use proto_flat::Frame;
use proto_flat::batch::BatchView;
use proto_flat::codes::Class;
use proto_flat::sections::Section;

/// The largest seq (and seq count) a stream can have reached: 2⁶².
pub const MAX_SEQ: u64 = 1 << 62;

/// The largest node time (ns) a node clock can read: 2⁶².
pub const MAX_NODE_NS: u64 = 1 << 62;

/// The largest packet an XDP program sees (256 KiB: multi-buffer frames included), for
/// the heartbeat's per-interface byte counters.
pub const MAX_PACKET_BYTES: u64 = 1 << 18;

/// A field whose value no real stream or clock produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Implausible {
    /// The field, as `frame.field` (`heartbeat.attempted_seq`, `loss_record.count`, …).
    pub field: &'static str,
    pub value: u64,
}

impl std::fmt::Display for Implausible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} = {} is past what any stream or clock produces", self.field, self.value)
    }
}

impl std::error::Error for Implausible {}

/// `Err` naming `field` unless `ok`.
fn need(ok: bool, field: &'static str, value: u64) -> Result<(), Implausible> {
    if ok { Ok(()) } else { Err(Implausible { field, value }) }
}

fn seq(field: &'static str, value: u64) -> Result<(), Implausible> {
    need(value < MAX_SEQ, field, value)
}

/// A count of seqs (an `attempted_seq` is one past the last seq attempted).
fn seq_count(field: &'static str, value: u64) -> Result<(), Implausible> {
    need(value <= MAX_SEQ, field, value)
}

fn node_ns(field: &'static str, value: u64) -> Result<(), Implausible> {
    need(value < MAX_NODE_NS, field, value)
}

/// Checks a batch that passed `BatchView::parse` and `validate` (so its summary agrees
/// with its frames).
///
/// # Errors
/// The first field past what a real shipper sends.
pub fn check_batch(view: &BatchView<'_>) -> Result<(), Implausible> {
    seq("batch.batch_seq", view.header.batch_seq.get())?;
    for e in view.summary.iter() {
        seq("frame.seq", e.last_seq.get())?;
        node_ns("frame.ts_ns", e.last_ts.get())?;
    }
    match view.lane() {
        Class::P0 => check_lifecycle(view),
        Class::P1 => check_p1(view),
        _ => Ok(()),
    }
}

fn check_lifecycle(view: &BatchView<'_>) -> Result<(), Implausible> {
    for item in view.frames() {
        let Ok(frame) = item else { break };
        match frame {
            Frame::Collective(f) => {
                seq("collective.comm_op_seq", f.comm_op_seq.get())?;
                seq("collective.local_op_seq", f.local_op_seq.get())?;
                seq("collective.nccl_seq", f.nccl_seq.get())?;
            }
            Frame::P2p(f) => {
                seq("p2p.local_op_seq", f.local_op_seq.get())?;
                seq("p2p.p2p_seq", f.p2p_seq.get())?;
            }
            _ => {}
        }
    }
    Ok(())
}

fn check_p1(view: &BatchView<'_>) -> Result<(), Implausible> {
    for item in view.frames() {
        let Ok(frame) = item else { break };
        match frame {
            Frame::Heartbeat(hb) => {
                node_ns("heartbeat.snapshot_ns", hb.head.snapshot_ns.get())?;
                for section in hb.sections() {
                    match section {
                        Section::Streams(entries) => {
                            for e in entries.iter() {
                                let attempted = e.attempted_seq.get();
                                seq_count("heartbeat.attempted_seq", attempted)?;
                                let held = e.held_from_seq.get();
                                need(held <= attempted, "heartbeat.held_from_seq", held)?;
                                for d in &e.drops {
                                    seq_count("heartbeat.drops", d.get())?;
                                }
                                seq_count("heartbeat.sampled_out", e.sampled_out.get())?;
                            }
                        }
                        Section::ShipperState(entries) => {
                            // PSI averages are a share of the time; sampling keeps 1 in
                            // 2^level (the shipper's ceiling is 15). The shed tier stays
                            // open: a newer shipper's tier shows as `unknown`.
                            for e in entries.iter() {
                                for (f, ppm) in [
                                    ("shipper_state.psi_some_avg10_ppm", e.psi_some_avg10_ppm.get()),
                                    ("shipper_state.psi_full_avg10_ppm", e.psi_full_avg10_ppm.get()),
                                ] {
                                    need(ppm <= 1_000_000, f, u64::from(ppm))?;
                                }
                                need(
                                    e.sampling_level <= 15,
                                    "shipper_state.sampling_level",
                                    u64::from(e.sampling_level),
                                )?;
                            }
                        }
                        Section::Progress(entries) => {
                            for p in entries.iter() {
                                seq("progress.last_enqueued_op", p.last_enqueued_op.get())?;
                                seq("progress.last_kernel_started_op", p.last_kernel_started_op.get())?;
                                seq("progress.last_completed_op", p.last_completed_op.get())?;
                                node_ns("progress.last_update_ns", p.last_update_ns.get())?;
                            }
                        }
                        Section::Interfaces(entries) => {
                            for e in entries.iter() {
                                let packets = e.packets.get();
                                seq_count("interfaces.packets", packets)?;
                                let bytes = e.bytes.get();
                                need(bytes <= packets.saturating_mul(MAX_PACKET_BYTES), "interfaces.bytes", bytes)?;
                            }
                        }
                        _ => {}
                    }
                }
            }
            Frame::LossRecord(r) => {
                let (first, last, count) = (r.first_seq.get(), r.last_seq.get(), r.count.get());
                seq("loss_record.last_seq", last)?;
                need(first <= last, "loss_record.first_seq", first)?;
                // Both below MAX_SEQ: the range's size cannot overflow.
                let range = last.saturating_sub(first).saturating_add(1);
                need((1..=range).contains(&count), "loss_record.count", count)?;
                seq("loss_record.batch_seq", r.batch_seq.get())?;
            }
            Frame::SessionStart(s) => {
                for section in s.sections() {
                    if let Section::SessionStreams(entries) = section {
                        for e in entries.iter() {
                            seq_count("session_start.attempted_seq", e.attempted_seq.get())?;
                        }
                    }
                }
            }
            Frame::ShipperGap(g) => {
                let (from, to) = (g.from_ns.get(), g.to_ns.get());
                node_ns("shipper_gap.to_ns", to)?;
                need(from <= to, "shipper_gap.from_ns", from)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Checks a shipper's `resume`: `next_batch_seq`, the held batch ranges, the stream
/// floors and the node time it was sent at.
///
/// # Errors
/// The first field past what a real shipper sends.
pub fn check_resume(
    next_batch_seq: u64,
    sent_ns: u64,
    held: &[(u64, u64)],
    floors: &[(u32, u64)],
) -> Result<(), Implausible> {
    seq_count("resume.next_batch_seq", next_batch_seq)?;
    node_ns("resume.sent_ns", sent_ns)?;
    for &(first, last) in held {
        seq("resume.held.last", last)?;
        need(first <= last, "resume.held.first", first)?;
    }
    for &(_, floor) in floors {
        seq_count("resume.floor_seq", floor)?;
    }
    Ok(())
}
