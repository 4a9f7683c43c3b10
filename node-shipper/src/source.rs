//! Frame sources: where ring records come from.
//!
//! A [`Source`] yields ring records exactly as a reader sees them (unparsed proto-flat
//! frames), epoch starts, and kernel counters. Contract: counters are yielded only after
//! every frame they count was yielded (or dropped in the kernel), so a heartbeat built
//! from them never claims a seq that has not been read, and everything below their
//! `attempted_seq` has been read (or dropped) when the shipper computes `held_from_seq`.
//!
//! Sources now: [`CaptureSource`] (loadgen-sim capture files, one node's records, paced
//! by their timestamps) and `SimSource` (feature `sim-source`: the simulator in process,
//! one node of the simulated cluster, in real time); the eBPF rings are
//! [`crate::bpf::RingSource`].
//!
//! Sources read the clock (they pace themselves); the shipper core never does.

use std::time::Instant;

use loadgen_sim::capture::{CaptureError, CaptureReader, CaptureRecord, snapshot_counters};

use crate::core::{EpochStart, SourceCounters};

/// One thing a source yields.
#[derive(Debug)]
pub enum SourceEvent<'a> {
    /// One ring record.
    Frame(&'a [u8]),
    /// Kernel counters were (re)created.
    Epoch(EpochStart),
    /// Fresh kernel counters (see the module's contract).
    Counters(&'a SourceCounters),
    /// This shipper session took over kernel counters an earlier session left running
    /// (same epoch): every stream's `attempted_seq` at the takeover.
    SessionStart(&'a [proto_flat::sections::SessionStreamEntry]),
}

/// Whether a source has more to give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceState {
    /// More will come.
    Running,
    /// Nothing more will come; the node lives on (the shipper keeps heartbeating).
    Finished,
    /// The node died (simulated): the shipper must stop at once, flushing nothing.
    NodeDead,
}

/// A frame source. See the module docs.
pub trait Source: Send {
    /// Hands everything due by now to `out`, at most about `budget` frames. Never waits.
    fn poll(&mut self, budget: usize, out: &mut dyn FnMut(SourceEvent<'_>)) -> SourceState;

    /// The latest kernel counters: attempted_seq, drops by cause, sampled_out per stream,
    /// PROGRESS entries.
    fn counters(&self) -> &SourceCounters;

    /// The node's monotonic clock now (what frames are stamped with).
    fn node_mono_ns(&self) -> u64;

    /// For logs.
    fn describe(&self) -> String;

    /// Index of this session's own P1 stream within the epoch (0 unless the source's
    /// counters outlive shipper sessions).
    fn shipper_stream_index(&self) -> u16 {
        0
    }

    /// The shipper session reading this source ended (orderly: it flushed or reported
    /// what it read) and a new session takes it over, as a restarted shipper reopens its
    /// pinned rings. False if this source cannot be handed on.
    fn next_session(&mut self) -> bool {
        false
    }

    /// Sets the kernel's bulk sampling level; false if this source has no such control.
    fn set_sampling_level(&mut self, _level: u8) -> bool {
        false
    }

    /// Ring drain and fill figures, for sources that read rings.
    fn ring_stats(&self) -> Option<crate::bpf::RingStats> {
        None
    }

    /// Ring fill, drain-gap and drop-burst histograms, for sources that read rings.
    fn ring_metrics(&self) -> Option<crate::core::ringstats::RingMetrics> {
        None
    }

    /// Whether the pids in its PROGRESS entries are processes on this host, whose owners
    /// (pod, container, Slurm job) the reader looks up in `/proc/<pid>/cgroup`. Replayed
    /// and simulated sources' pids are not.
    fn pids_are_local(&self) -> bool {
        false
    }

    /// Whether frames are stamped as they happen on [`Self::node_mono_ns`]'s clock, so
    /// the reader can tell how long one waited before it was read (the `read` stage). A
    /// replayed capture's timestamps are its recording's.
    fn stamps_frames_now(&self) -> bool {
        false
    }
}

/// Errors opening a source.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("capture file {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("capture file {path}: {source}")]
    Capture { path: String, source: CaptureError },
    #[error("capture file {path} has {nodes} node(s); node {node} is not one of them")]
    NoSuchNode { path: String, nodes: u32, node: u32 },
    #[error("scenario: {0}")]
    Scenario(String),
    #[error("eBPF: {0}")]
    Bpf(#[from] crate::bpf::LoadError),
}

/// Replays one node's records of a capture file, paced by their node timestamps
/// (`speed` × real time; 0 = as fast as the shipper reads).
#[derive(Debug)]
pub struct CaptureSource {
    path: String,
    bytes: Vec<u8>,
    offset: usize,
    node: u32,
    speed: f64,
    start: Instant,
    /// Node time of the first record (the epoch start), the pacing origin.
    base_mono: Option<u64>,
    counters: SourceCounters,
    done: bool,
    /// Records that failed to decode (the replay stops at the first).
    pub errors: u64,
}

impl CaptureSource {
    /// Opens `path` and checks its header.
    ///
    /// # Errors
    /// The file cannot be read, is not a capture, or lacks `node`.
    pub fn open(path: &str, node: u32, speed: f64) -> Result<Self, SourceError> {
        let bytes = std::fs::read(path).map_err(|source| SourceError::Io { path: path.to_owned(), source })?;
        let r = CaptureReader::new(&bytes).map_err(|source| SourceError::Capture { path: path.to_owned(), source })?;
        if node >= r.node_count() {
            return Err(SourceError::NoSuchNode { path: path.to_owned(), nodes: r.node_count(), node });
        }
        let offset = r.offset();
        Ok(Self {
            path: path.to_owned(),
            bytes,
            offset,
            node,
            speed,
            start: Instant::now(),
            base_mono: None,
            counters: SourceCounters::default(),
            done: false,
            errors: 0,
        })
    }

    fn due_mono(&self) -> u64 {
        let base = self.base_mono.unwrap_or(0);
        if self.speed <= 0.0 {
            return u64::MAX;
        }
        #[allow(clippy::cast_possible_truncation, reason = "ns of a replay fit u64")]
        let elapsed = (self.start.elapsed().as_nanos() as f64 * self.speed) as u64;
        base.saturating_add(elapsed)
    }
}

fn record_mono(r: &CaptureRecord<'_>) -> u64 {
    match r {
        CaptureRecord::Frame { frame, .. } => frame.header().ts_ns.get(),
        CaptureRecord::Snapshot { heartbeat, .. } => heartbeat.head.snapshot_ns.get(),
        CaptureRecord::Epoch { frame, .. } => frame.hdr.ts_ns.get(),
    }
}

impl Source for CaptureSource {
    fn poll(&mut self, budget: usize, out: &mut dyn FnMut(SourceEvent<'_>)) -> SourceState {
        if self.done {
            return SourceState::Finished;
        }
        let Ok(mut reader) = CaptureReader::resume(&self.bytes, self.offset) else {
            self.done = true;
            return SourceState::Finished;
        };
        let mut due = self.due_mono();
        let mut n = 0;
        loop {
            if n >= budget {
                break;
            }
            let before = reader.offset();
            let Some(item) = reader.next() else {
                self.done = true;
                break;
            };
            let record = match item {
                Ok(r) => r,
                Err(_) => {
                    self.errors += 1;
                    self.done = true;
                    break;
                }
            };
            let node = match &record {
                CaptureRecord::Frame { node, .. }
                | CaptureRecord::Snapshot { node, .. }
                | CaptureRecord::Epoch { node, .. } => *node,
            };
            if node != self.node {
                continue;
            }
            let mono = record_mono(&record);
            if self.base_mono.is_none() {
                self.base_mono = Some(mono);
                self.start = Instant::now();
                due = self.due_mono();
            }
            if mono > due {
                // Not due yet: read it again next time.
                self.offset = before;
                return SourceState::Running;
            }
            match record {
                CaptureRecord::Frame { bytes, .. } => {
                    out(SourceEvent::Frame(bytes));
                    n += 1;
                }
                CaptureRecord::Snapshot { heartbeat, .. } => {
                    let c = snapshot_counters(&heartbeat);
                    self.counters = SourceCounters {
                        epoch: self.counters.epoch,
                        mono_ns: heartbeat.head.snapshot_ns.get(),
                        streams: c.streams,
                        progress: c.progress,
                        owners: Vec::new(),
                        interfaces: c.interfaces,
                    };
                    out(SourceEvent::Counters(&self.counters));
                }
                CaptureRecord::Epoch { frame, .. } => {
                    let e = EpochStart {
                        epoch: frame.epoch.get(),
                        boot_id: frame.boot_id,
                        mono_ns: frame.hdr.ts_ns.get(),
                        start_realtime_ns: frame.start_realtime_ns.get(),
                    };
                    self.counters = SourceCounters { epoch: e.epoch, mono_ns: e.mono_ns, ..SourceCounters::default() };
                    out(SourceEvent::Epoch(e));
                }
            }
        }
        self.offset = reader.offset();
        if self.done { SourceState::Finished } else { SourceState::Running }
    }

    fn counters(&self) -> &SourceCounters {
        &self.counters
    }

    fn node_mono_ns(&self) -> u64 {
        let base = self.base_mono.unwrap_or(0);
        #[allow(clippy::cast_possible_truncation, reason = "ns of a replay fit u64")]
        let elapsed = (self.start.elapsed().as_nanos() as f64 * self.speed.max(1.0)) as u64;
        base.saturating_add(elapsed)
    }

    fn describe(&self) -> String {
        format!("capture {} node {}", self.path, self.node)
    }
}

/// A synthetic bulk source: 48-byte bulk frames round-robin over `cpus` streams of one
/// ring, offered at `rate` frames/s (`f64::INFINITY`: as fast as the reader takes them —
/// an unthrottled producer, as a ring in a burst is), with exact counters every
/// `counters_every_ns` (every frame generated is handed on: `attempted_seq` counts
/// them). Once `stop` is set it generates nothing more and says `Finished`. Benchmarks
/// and the overload tests.
#[derive(Debug)]
pub struct SyntheticSource {
    rate: f64,
    start: Instant,
    next: u64,
    cpus: u16,
    frame: Vec<u8>,
    counters: SourceCounters,
    epoch_sent: bool,
    counters_every_ns: u64,
    next_counters_ns: u64,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// A P0 collective frame every this many ns (0: none), and how many so far.
    p0_every_ns: u64,
    p0_next: u64,
    /// A ring of this many frames between the producer and the reader (0: none — every
    /// frame due waits for the reader): frames due beyond it are dropped as the kernel
    /// does (`kernel_ring_full`: they took their seq, counted per stream).
    ring_frames: u64,
    dropped: Vec<u64>,
    /// Event index ranges in the ring, oldest first; their total; dropping until half
    /// empty.
    kept: std::collections::VecDeque<(u64, u64)>,
    kept_len: u64,
    ring_shedding: bool,
}

impl SyntheticSource {
    /// Adds one P0 lifecycle frame (a collective's `enqueue_end`, one communicator)
    /// every `every_ns` on its own stream: P0 latency under bulk load.
    #[must_use]
    pub fn with_p0(mut self, every_ns: u64) -> Self {
        self.p0_every_ns = every_ns;
        let mut e = <proto_flat::sections::StreamEntry as zerocopy::FromZeros>::new_zeroed();
        e.stream_id = zerocopy::little_endian::U32::new(Self::P0_STREAM.0);
        self.counters.streams.push(e);
        self
    }

    const P0_STREAM: proto_flat::header::StreamId = proto_flat::header::StreamId::new(proto_flat::Class::P0, 0, 0);

    /// Puts a ring of `frames` between the producer and the reader (with a finite
    /// rate): what the reader does not take in time overflows it, counted as kernel
    /// drops — a real ring in a burst.
    #[must_use]
    pub fn with_ring(mut self, frames: u64) -> Self {
        self.ring_frames = frames;
        self
    }

    /// Frames the ring dropped so far.
    #[must_use]
    pub fn ring_dropped(&self) -> u64 {
        self.dropped.iter().sum()
    }

    /// A source at `rate` frames/s over `cpus` streams (at least 1).
    #[must_use]
    pub fn new(
        rate: f64,
        cpus: u16,
        counters_every_ns: u64,
        stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ) -> Self {
        use zerocopy::IntoBytes;
        let cpus = cpus.max(1);
        let stream = |cpu: u16| proto_flat::header::StreamId::new(proto_flat::Class::P2, 1, cpu);
        let template = proto_flat::sample::bulk_packet(stream(0), 0, 0);
        let streams = (0..cpus)
            .map(|cpu| {
                let mut e = <proto_flat::sections::StreamEntry as zerocopy::FromZeros>::new_zeroed();
                e.stream_id = zerocopy::little_endian::U32::new(stream(cpu).0);
                e
            })
            .collect();
        Self {
            rate,
            start: Instant::now(),
            next: 0,
            cpus,
            frame: template.as_bytes().to_vec(),
            counters: SourceCounters { epoch: 1, mono_ns: 0, streams, ..SourceCounters::default() },
            epoch_sent: false,
            counters_every_ns,
            next_counters_ns: counters_every_ns,
            stop,
            p0_every_ns: 0,
            p0_next: 0,
            ring_frames: 0,
            dropped: vec![0; usize::from(cpus)],
            kept: std::collections::VecDeque::new(),
            kept_len: 0,
            ring_shedding: false,
        }
    }

    /// Frames produced so far (handed to the reader, waiting in the ring, or dropped by
    /// it).
    #[must_use]
    pub fn generated(&self) -> u64 {
        self.next
    }

    fn refresh_counters(&mut self) {
        let cpus = u64::from(self.cpus);
        let (next, mono) = (self.next, self.node_mono_ns());
        let p0 = self.p0_next;
        if let Some(e) = self.counters.streams.iter_mut().find(|e| e.stream_id.get() == Self::P0_STREAM.0) {
            e.attempted_seq = zerocopy::little_endian::U64::new(p0);
        }
        let slot = proto_flat::LossCause::KernelRingFull.drop_slot().unwrap_or(0);
        for ((cpu, e), dropped) in
            (0u64..).zip(self.counters.streams.iter_mut().take(usize::from(self.cpus))).zip(self.dropped.iter())
        {
            // Stream `cpu` got seqs 0.. for frames cpu, cpu + cpus, …: those below `next`.
            let attempted = next.saturating_sub(cpu).div_ceil(cpus);
            e.attempted_seq = zerocopy::little_endian::U64::new(attempted);
            if let Some(d) = e.drops.get_mut(slot) {
                *d = zerocopy::little_endian::U64::new(*dropped);
            }
        }
        self.counters.mono_ns = mono;
    }
}

impl SyntheticSource {
    /// Hands on the frame of event `e` (stream `e % cpus`, seq `e / cpus`).
    fn emit(&mut self, e: u64, ts: u64, out: &mut dyn FnMut(SourceEvent<'_>)) {
        let cpus = u64::from(self.cpus);
        let (cpu, seq) = (e % cpus, e / cpus);
        // Only the header's stream, seq and time change.
        if let Ok((h, _)) = <proto_flat::FrameHeader as zerocopy::FromBytes>::mut_from_prefix(self.frame.as_mut_slice())
        {
            h.stream_id = zerocopy::little_endian::U32::new(
                proto_flat::header::StreamId::new(proto_flat::Class::P2, 1, u16::try_from(cpu).unwrap_or(0)).0,
            );
            h.seq = zerocopy::little_endian::U64::new(seq);
            h.ts_ns = zerocopy::little_endian::U64::new(ts);
        }
        out(SourceEvent::Frame(&self.frame));
    }

    /// Events `a..b` took their seqs and found the ring full.
    fn drop_run(&mut self, a: u64, b: u64) {
        let cpus = u64::from(self.cpus);
        for (cpu, d) in (0u64..).zip(self.dropped.iter_mut()) {
            *d += b.saturating_sub(cpu).div_ceil(cpus) - a.saturating_sub(cpu).div_ceil(cpus);
        }
    }

    /// The ring model: events due go into the ring while it has room; once it is full
    /// they are dropped until the reader has emptied it to half (as the eBPF producer
    /// does: one hole per overflow, not one per record the reader frees).
    fn produce_into_ring(&mut self) {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "frames due")]
        let due = (self.start.elapsed().as_secs_f64() * self.rate) as u64;
        if self.next >= due {
            return;
        }
        if self.ring_shedding && self.kept_len <= self.ring_frames / 2 {
            self.ring_shedding = false;
        }
        if !self.ring_shedding {
            let take = self.ring_frames.saturating_sub(self.kept_len).min(due - self.next);
            if take > 0 {
                self.kept.push_back((self.next, self.next + take));
                self.kept_len += take;
                self.next += take;
            }
            self.ring_shedding = self.next < due;
        }
        if self.next < due {
            self.drop_run(self.next, due);
            self.next = due;
        }
    }

    /// Up to `n` frames out of the ring, oldest first.
    fn drain_ring(&mut self, mut n: u64, ts: u64, out: &mut dyn FnMut(SourceEvent<'_>)) {
        while n > 0 {
            let Some(&(first, end)) = self.kept.front() else { break };
            let upto = end.min(first.saturating_add(n));
            for e in first..upto {
                self.emit(e, ts, out);
            }
            n -= upto - first;
            self.kept_len -= upto - first;
            if upto == end {
                self.kept.pop_front();
            } else if let Some(f) = self.kept.front_mut() {
                f.0 = upto;
            }
        }
    }
}

impl Source for SyntheticSource {
    fn poll(&mut self, budget: usize, out: &mut dyn FnMut(SourceEvent<'_>)) -> SourceState {
        if !self.epoch_sent {
            self.epoch_sent = true;
            out(SourceEvent::Epoch(EpochStart { epoch: 1, boot_id: [1; 16], mono_ns: 0, start_realtime_ns: 0 }));
        }
        let ts = self.node_mono_ns();
        if self.stop.load(std::sync::atomic::Ordering::Relaxed) {
            // What the ring holds is read out first: counters count only what was handed
            // on or dropped.
            if self.kept_len > 0 {
                self.drain_ring(u64::MAX, ts, out);
            }
            self.refresh_counters();
            return SourceState::Finished;
        }
        if self.p0_every_ns > 0 && ts / self.p0_every_ns >= self.p0_next {
            use zerocopy::IntoBytes;
            let seq = self.p0_next;
            let f =
                proto_flat::sample::collective(Self::P0_STREAM, seq, ts, seq + 1, proto_flat::codes::Phase::EnqueueEnd);
            out(SourceEvent::Frame(f.as_bytes()));
            self.p0_next += 1;
        }
        let counters_due = ts >= self.next_counters_ns;
        if self.ring_frames > 0 && self.rate.is_finite() {
            self.produce_into_ring();
            // Counters go out after a drain to empty (every seq they count was handed on
            // or dropped), as the ring source does.
            self.drain_ring(if counters_due { u64::MAX } else { budget as u64 }, ts, out);
        } else {
            let upto = if self.rate.is_finite() {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, reason = "frames due")]
                let due = (self.start.elapsed().as_secs_f64() * self.rate) as u64;
                due.min(self.next + budget as u64)
            } else {
                self.next + budget as u64
            };
            while self.next < upto {
                self.emit(self.next, ts, out);
                self.next += 1;
            }
        }
        if counters_due {
            self.next_counters_ns = ts.saturating_add(self.counters_every_ns);
            self.refresh_counters();
            out(SourceEvent::Counters(&self.counters));
        }
        SourceState::Running
    }

    fn counters(&self) -> &SourceCounters {
        &self.counters
    }

    fn node_mono_ns(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn describe(&self) -> String {
        if self.rate.is_finite() {
            format!("synthetic bulk at {:.1} M frames/s", self.rate / 1e6)
        } else {
            "synthetic bulk, unthrottled".to_owned()
        }
    }
}

#[cfg(feature = "sim-source")]
pub use sim::SimSource;

#[cfg(feature = "sim-source")]
mod sim {
    use std::time::Instant;

    use loadgen_sim::sim::{EpochInfo, Sink, Snapshot};
    use loadgen_sim::{Scenario, SimOptions, Simulation};

    use super::{Source, SourceError, SourceEvent, SourceState};
    use crate::core::{EpochStart, SourceCounters};

    #[derive(Debug, Clone, Copy)]
    enum Kind {
        Frame(usize, usize),
        Epoch(EpochStart),
        Counters,
    }

    /// Collects one node's output of a simulation step.
    #[derive(Debug, Default)]
    struct Collect {
        node: u32,
        arena: Vec<u8>,
        events: Vec<Kind>,
        counters: Vec<SourceCounters>,
    }

    impl Sink for Collect {
        fn frame(&mut self, node: u32, frame: &[u8]) {
            if node == self.node {
                let start = self.arena.len();
                self.arena.extend_from_slice(frame);
                self.events.push(Kind::Frame(start, self.arena.len()));
            }
        }

        fn snapshot(&mut self, node: u32, s: &Snapshot<'_>) {
            if node == self.node {
                self.counters.push(SourceCounters {
                    epoch: s.epoch,
                    mono_ns: s.mono_ns,
                    streams: s.streams.to_vec(),
                    progress: s.progress.to_vec(),
                    owners: Vec::new(),
                    interfaces: s.interfaces.to_vec(),
                });
                self.events.push(Kind::Counters);
            }
        }

        fn epoch(&mut self, node: u32, info: &EpochInfo) {
            if node == self.node {
                self.events.push(Kind::Epoch(EpochStart {
                    epoch: info.epoch,
                    boot_id: info.boot_id,
                    mono_ns: info.mono_ns,
                    start_realtime_ns: info.start_realtime_ns,
                }));
            }
        }
    }

    /// One node of a simulated cluster, in real time from `start` (pass the same
    /// `start` to every node's source so their clocks agree, as a real cluster's do).
    #[derive(Debug)]
    pub struct SimSource {
        sim: Simulation,
        start: Instant,
        collect: Collect,
        counters: SourceCounters,
        /// Sim time through which output was handed on.
        through_ns: u64,
        /// Simulated time per real time (1: real time).
        speed: f64,
        /// The epoch in force (handed again to a later shipper session).
        epoch: Option<EpochStart>,
        /// Shipper sessions that took this simulated kernel side over before the current
        /// one (the current session's own P1 stream index).
        sessions: u16,
        /// A new session took over: its first poll says the epoch again and where every
        /// stream stood (`session_start`), as a reopened eBPF ring does.
        takeover: Option<Vec<proto_flat::sections::SessionStreamEntry>>,
    }

    impl SimSource {
        /// Node `node` of `scenario`.
        ///
        /// # Errors
        /// The scenario does not validate, or has no such node.
        pub fn new(scenario: &Scenario, options: SimOptions, node: u32, start: Instant) -> Result<Self, SourceError> {
            if node >= scenario.cluster.nodes {
                return Err(SourceError::Scenario(format!(
                    "node {node} is not in the scenario's {} nodes",
                    scenario.cluster.nodes
                )));
            }
            let sim = Simulation::new(scenario, options).map_err(|e| SourceError::Scenario(e.to_string()))?;
            Ok(Self {
                sim,
                start,
                collect: Collect { node, ..Collect::default() },
                counters: SourceCounters::default(),
                through_ns: 0,
                speed: 1.0,
                epoch: None,
                sessions: 0,
                takeover: None,
            })
        }

        /// The shipper session that read this source ended (SIGTERM: it flushed or
        /// reported everything it read), and a new one takes the simulated kernel side
        /// over — as a restarted shipper reopens pinned rings: same epoch, its own P1
        /// stream, a `session_start` naming every stream's `attempted_seq` as the last
        /// counters said. (A SIGKILLed shipper would take the in-process simulator with
        /// it: simulated restarts are SIGTERMs; the eBPF kernel tests cover SIGKILL.)
        fn take_over(&mut self) {
            self.sessions = self.sessions.saturating_add(1);
            let entries = self
                .counters
                .streams
                .iter()
                .map(|e| {
                    let mut s = <proto_flat::sections::SessionStreamEntry as zerocopy::FromZeros>::new_zeroed();
                    s.stream_id = e.stream_id;
                    s.attempted_seq = e.attempted_seq;
                    s
                })
                .collect();
            self.takeover = Some(entries);
        }

        /// Runs simulated time `speed` times faster than real time (the aggregator's clock
        /// must run as fast: `AggregatorConfig::time_scale`).
        #[must_use]
        pub fn with_speed(mut self, speed: f64) -> Self {
            self.speed = if speed > 0.0 { speed } else { 1.0 };
            self
        }

        /// Simulated time reached so far, and the run's end.
        #[must_use]
        pub fn progress(&self) -> (u64, u64) {
            (self.through_ns, self.sim.horizon_ns())
        }

        fn sim_now(&self) -> u64 {
            let elapsed = self.start.elapsed().as_nanos();
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss,
                reason = "ns of a run"
            )]
            let scaled = (elapsed as f64 * self.speed) as u64;
            scaled
        }
    }

    impl Source for SimSource {
        fn stamps_frames_now(&self) -> bool {
            true
        }

        fn poll(&mut self, _budget: usize, out: &mut dyn FnMut(SourceEvent<'_>)) -> SourceState {
            if let Some(entries) = self.takeover.take() {
                if let Some(e) = self.epoch {
                    out(SourceEvent::Epoch(e));
                }
                out(SourceEvent::SessionStart(&entries));
            }
            let node = self.collect.node;
            let now = self.sim_now();
            let dead_at = self.sim.model().dead_at.get(node as usize).copied().unwrap_or(u64::MAX);
            if now > self.through_ns && !self.sim.is_done() {
                // Step in slices of at most 10 ms of sim time: bounded work per poll.
                let until = now.min(self.through_ns + 10_000_000);
                self.sim.step(until, &mut self.collect);
                self.through_ns = until;
                let mut counters = std::mem::take(&mut self.collect.counters).into_iter();
                for e in std::mem::take(&mut self.collect.events) {
                    match e {
                        Kind::Frame(a, b) => {
                            if let Some(f) = self.collect.arena.get(a..b) {
                                out(SourceEvent::Frame(f));
                            }
                        }
                        Kind::Epoch(e) => {
                            // The old epoch's counters say nothing of the new one (what a
                            // shutdown before the new epoch's first snapshot would send).
                            self.counters =
                                SourceCounters { epoch: e.epoch, mono_ns: e.mono_ns, ..SourceCounters::default() };
                            self.epoch = Some(e);
                            out(SourceEvent::Epoch(e));
                        }
                        Kind::Counters => {
                            if let Some(c) = counters.next() {
                                self.counters = c;
                                out(SourceEvent::Counters(&self.counters));
                            }
                        }
                    }
                }
                self.collect.arena.clear();
            }
            if self.through_ns >= dead_at {
                SourceState::NodeDead
            } else if self.sim.is_done() {
                SourceState::Finished
            } else {
                SourceState::Running
            }
        }

        fn counters(&self) -> &SourceCounters {
            &self.counters
        }

        fn node_mono_ns(&self) -> u64 {
            self.sim.node_mono(self.collect.node, self.sim_now())
        }

        fn describe(&self) -> String {
            format!("simulator {} node {}", self.sim.scenario().name, self.collect.node)
        }

        fn shipper_stream_index(&self) -> u16 {
            self.sessions
        }

        fn next_session(&mut self) -> bool {
            self.take_over();
            true
        }
    }
}

/// Opens the configured source. `start` is the instant simulated time 0 maps to (give
/// every in-process shipper of one simulated cluster the same one).
///
/// # Errors
/// The capture cannot be read, the scenario is unknown or invalid, or this build lacks
/// the `sim-source` feature.
pub fn open(source: &crate::config::Source, start: Instant) -> Result<Box<dyn Source>, SourceError> {
    #[cfg(not(feature = "sim-source"))]
    let _ = start;
    match source {
        crate::config::Source::Capture { path, node, speed_pct } => {
            #[allow(clippy::cast_precision_loss, reason = "a percentage")]
            let speed = *speed_pct as f64 / 100.0;
            Ok(Box::new(CaptureSource::open(&path.display().to_string(), *node, speed)?))
        }
        #[cfg(feature = "sim-source")]
        crate::config::Source::Sim { scenario, node, bulk_scale_ppm, seed } => {
            let s = match loadgen_sim::builtin::builtin(scenario) {
                Some(parsed) => parsed.map_err(|e| SourceError::Scenario(e.to_string()))?,
                None => {
                    let text = std::fs::read_to_string(scenario)
                        .map_err(|e| SourceError::Scenario(format!("{scenario}: not a built-in scenario, and {e}")))?;
                    loadgen_sim::Scenario::parse(&text).map_err(|e| SourceError::Scenario(e.to_string()))?
                }
            };
            #[allow(clippy::cast_precision_loss, reason = "ppm")]
            let options = loadgen_sim::SimOptions { bulk_scale: *bulk_scale_ppm as f64 / 1e6, seed: *seed };
            Ok(Box::new(SimSource::new(&s, options, *node, start)?))
        }
        crate::config::Source::Bpf(cfg) => Ok(Box::new(crate::bpf::RingSource::open(cfg.clone())?)),
        #[cfg(not(feature = "sim-source"))]
        crate::config::Source::Sim { .. } => {
            Err(SourceError::Scenario("this node-shipper was built without the `sim-source` feature".into()))
        }
    }
}
