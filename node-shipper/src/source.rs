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
                    let (streams, progress) = snapshot_counters(&heartbeat);
                    self.counters = SourceCounters {
                        epoch: self.counters.epoch,
                        mono_ns: heartbeat.head.snapshot_ns.get(),
                        streams,
                        progress,
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
