//! The eBPF ring source: loads `bpf/ringwatch.bpf.c` (compiled by `build.rs`), pins its
//! maps and programs under bpffs, and reads the P0 and bulk rings zero-copy.
//!
//! - **Pinning.** Rings, counters, the sampling control and the epoch metadata are pinned
//!   in the configured directory (`bpf_pin_dir`) by name, so the kernel keeps recording and
//!   counting while the shipper is down; a restarted shipper reopens them: same epoch, a
//!   `session_start` carrying every stream's exact `attempted_seq` at takeover, its own P1
//!   stream (index = sessions so far, so the new session's seqs never collide with the
//!   old one's). Programs are pinned too (replaced by each new session); XDP links to
//!   configured interfaces are pinned and kept across restarts.
//! - **Reading.** One pass drains the P0 ring, then the bulk ring. Producers submit with
//!   `BPF_RB_NO_WAKEUP`, so passes run on a timer (`ring_drain_interval_us`), never on
//!   epoll. A record is handed on as a borrow of the ring's mmap and copied once, into the
//!   batch ([aya's `RingBuf`](https://docs.rs/aya/0.14.0/aya/maps/ring_buf/struct.RingBuf.html)
//!   advances the consumer position when the item drops; the kernel side's protocol is in
//!   [kernel/bpf/ringbuf.c](https://github.com/torvalds/linux/blob/v6.18/kernel/bpf/ringbuf.c)).
//! - **Counters.** Every heartbeat interval the per-(ring, CPU) counters are read first,
//!   then both rings are drained to empty, then the counters are handed on: every seq they
//!   count was yielded or dropped in the kernel (the [`Source`] contract), except a record
//!   still being written by a producer on another CPU, which arrives next pass.
//! - **Fill.** A pass that starts from a drained ring finds what accumulated since the
//!   last one: its bytes (record + 8-byte ring header) over the ring size is the fill at
//!   that drain; the maximum since the last heartbeat goes into the heartbeat
//!   (`fill_max_ppm`) and [`RingStats`] (for the metrics issue).

#![allow(
    unsafe_code,
    reason = "four libc calls with no safe std equivalent: sysconf, sched_setaffinity, statfs, clock_gettime; each has a SAFETY note"
)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aya::maps::{Array, MapData, PerCpuArray, PerCpuHashMap, RingBuf};
use aya::programs::{TestRun, TestRunOptions, Xdp};
use aya::{Ebpf, EbpfLoader};
use proto_flat::kernel::{
    EpochMeta, IfCounters, PIN_LAYOUT, ProgressKey, ProgressStats, RING_BULK, RING_COUNT, RING_P0, RingCounters,
    SamplingControl,
};
use proto_flat::sections::{IFINDEX_OVERFLOW, InterfaceEntry, ProgressEntry, SessionStreamEntry, StreamEntry};
use proto_flat::{Class, StreamId};
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use crate::core::ringstats::{BurstTracker, RingMetrics};
use crate::core::{EpochStart, SourceCounters};
use crate::source::{Source, SourceEvent, SourceState};

/// The object `build.rs` compiled, if it could.
#[cfg(ringwatch_bpf)]
static EMBEDDED: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/ringwatch.bpf.o"));
#[cfg(not(ringwatch_bpf))]
static EMBEDDED: &[u8] = &[];

/// Why this build has no embedded object (empty when it has one).
pub const BUILD_MISSING: &str = env!("RINGWATCH_BPF_MISSING");
/// The clang that compiled the embedded object.
pub const BUILT_WITH: &str = env!("RINGWATCH_BPF_BUILT_WITH");

const P0_RING: &str = "rw_p0_ring";
const BULK_RING: &str = "rw_bulk_ring";
const COUNTERS: &str = "rw_counters";
const CONTROL: &str = "rw_control";
const META: &str = "rw_meta";
const LAYOUT: &str = "rw_layout";
const PROGRESS: &str = "rw_progress";
const PROGRESS_STATS: &str = "rw_progress_stats";
const IF_COUNTERS: &str = "rw_if_counters";
const IF_OVERFLOW: &str = "rw_if_overflow";
const PINNED_MAPS: [&str; 10] =
    [P0_RING, BULK_RING, COUNTERS, CONTROL, META, LAYOUT, PROGRESS, PROGRESS_STATS, IF_COUNTERS, IF_OVERFLOW];
const BULK_PROG: &str = "rw_bulk_xdp";
const P0_TEST_PROG: &str = "rw_p0_test_xdp";
/// uprobe program → the shim's probe function it attaches to.
const NCCL_PROBES: [(&str, &str); 4] = [
    ("rw_uprobe_comm_init", "rw_probe_comm_init"),
    ("rw_uprobe_collective", "rw_probe_collective"),
    ("rw_uprobe_p2p", "rw_probe_p2p"),
    ("rw_uprobe_proxy_step", "rw_probe_proxy_step"),
];
/// Probe functions a shim built before them lacks: such a shim is probed without them.
const NCCL_OPTIONAL_PROBES: [&str; 1] = ["rw_probe_proxy_step"];
const EXIT_PROG: &str = "rw_on_exit";
/// PROGRESS entries one heartbeat carries at most (the most recently updated first): a
/// heartbeat must fit one batch.
pub const MAX_PROGRESS_PER_HEARTBEAT: usize = 256;

/// How to load and read the rings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpfConfig {
    /// bpffs directory for the pins (one per shipper instance).
    pub pin_dir: PathBuf,
    pub p0_ring_bytes: u32,
    pub bulk_ring_bytes: u32,
    /// A compiled object to load instead of the embedded one.
    pub object: Option<PathBuf>,
    /// Checked before loading: the programs are built against this kernel's BTF.
    pub kernel_btf: PathBuf,
    pub drain_interval_us: u64,
    /// How often the counters are read and handed on (the heartbeat interval).
    pub counters_interval_ms: u64,
    /// Interfaces to attach the bulk XDP program to (links pinned, kept across restarts).
    pub xdp_interfaces: Vec<String>,
    /// The NCCL profiler shim (`libnccl-profiler-ringwatch.so`) whose probe functions get
    /// uprobes (links pinned, kept across restarts), with the process-exit hook for
    /// PROGRESS. None: no collective events.
    pub nccl_shim: Option<PathBuf>,
}

impl BpfConfig {
    /// Defaults for `pin_dir`: 1 MiB P0 ring, 16 MiB bulk ring, 1 ms drains.
    #[must_use]
    pub fn new(pin_dir: PathBuf) -> Self {
        Self {
            pin_dir,
            p0_ring_bytes: 1 << 20,
            bulk_ring_bytes: 16 << 20,
            object: None,
            kernel_btf: PathBuf::from("/sys/kernel/btf/vmlinux"),
            drain_interval_us: 1_000,
            counters_interval_ms: 1_000,
            xdp_interfaces: Vec::new(),
            nccl_shim: None,
        }
    }
}

/// Loader errors: each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "this node-shipper was built without its eBPF object ({why}); rebuild with clang and libbpf-dev installed, or set bpf_object to a compiled ringwatch.bpf.o"
    )]
    NotBuilt { why: String },
    #[error(
        "no kernel BTF at {path}: ringwatch's eBPF programs need a kernel built with CONFIG_DEBUG_INFO_BTF=y (it provides /sys/kernel/btf/vmlinux)"
    )]
    NoBtf { path: PathBuf },
    #[error("{dir} is not on a bpffs: mount one (mount -t bpf bpf /sys/fs/bpf) or set bpf_pin_dir inside one")]
    NoBpfFs { dir: PathBuf },
    #[error(
        "permission denied {what}: loading eBPF needs root, or CAP_BPF + CAP_PERFMON (+ CAP_NET_ADMIN to attach XDP) ({source})"
    )]
    Permission { what: String, source: std::io::Error },
    #[error("bad BPF object {origin}: {detail}")]
    BadObject { origin: String, detail: String },
    #[error(
        "ring {ring} of {bytes} bytes could not be created ({detail}); a size that fits: {fits} bytes (set {field} = {fits})"
    )]
    RingTooLarge { ring: &'static str, field: &'static str, bytes: u32, detail: String, fits: u32 },
    #[error(
        "{field} = {bytes}: a BPF ring's size must be a power of two and a multiple of the page size ({page} bytes)"
    )]
    RingSize { field: &'static str, bytes: u32, page: u32 },
    #[error("{what}: {detail}")]
    Kernel { what: String, detail: String },
}

/// Ring fill and drain figures (exported by the metrics issue). Index 0: P0 ring, 1: bulk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct RingStats {
    /// Drain passes that reached an empty ring.
    pub drains: u64,
    pub records: [u64; 2],
    pub bytes: [u64; 2],
    /// Records too short to be a frame (counted, not shipped).
    pub malformed: u64,
    /// Max fill at a drain since the last heartbeat, and over the run (ppm of the ring).
    pub fill_max_ppm: [u32; 2],
    pub fill_max_ppm_ever: [u32; 2],
    pub ring_bytes: [u32; 2],
    /// PROGRESS: entries now, entries LRU-evicted so far, process exits recorded, entries
    /// left out of the last heartbeat (over [`MAX_PROGRESS_PER_HEARTBEAT`]).
    pub progress_entries: u64,
    pub progress_evicted: u64,
    pub progress_exits: u64,
    pub progress_truncated: u64,
    /// Time between the starts of consecutive drain passes (µs): the p99.9 and the
    /// maximum so far. A ring must hold peak bytes/s × this gap (× 3 headroom).
    pub drain_gap_p999_us: u64,
    pub drain_gap_max_us: u64,
    /// Kernel drop bursts the reader saw (runs of missing seqs, see
    /// [`crate::core::ringstats`]) and the frames they held, per ring.
    pub drop_bursts: [u64; 2],
    pub drop_burst_frames: [u64; 2],
}

fn page_size() -> u32 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(p).unwrap_or(4096)
}

/// Checks a ring size: a power of two, a multiple of the page size.
///
/// # Errors
/// [`LoadError::RingSize`].
pub fn check_ring_size(field: &'static str, bytes: u32) -> Result<(), LoadError> {
    let page = page_size();
    if bytes.is_power_of_two() && bytes >= page && bytes.is_multiple_of(page) {
        Ok(())
    } else {
        Err(LoadError::RingSize { field, bytes, page })
    }
}

/// Pins the calling thread to `cpus` (empty: leaves it alone).
///
/// # Errors
/// `sched_setaffinity` failed (a CPU that does not exist or is not allowed).
pub fn pin_current_thread(cpus: &[usize]) -> std::io::Result<()> {
    if cpus.is_empty() {
        return Ok(());
    }
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write inside it; pid 0 = this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &raw const set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The loaded object with its pinned maps.
struct Loaded {
    ebpf: Ebpf,
    /// The pins existed before this load (a restart).
    reopened: bool,
    ring_bytes: [u32; 2],
    /// Pins of this other layout were found and removed (a new epoch starts).
    replaced_layout: Option<u32>,
}

fn first_io_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a std::io::Error> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return Some(io);
        }
        cur = err.source();
    }
    None
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        // Wrappers often print their source already ("map error: {0}"): say it once.
        let t = err.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = err.source();
    }
    s
}

/// The memory cgroup's limit and usage of this process, if it has a limit (v2
/// `memory.max`/`memory.current`, else v1 `memory.limit_in_bytes`/`usage_in_bytes`).
fn memcg_room() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read = |p: PathBuf| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrl, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        if ctrl == "memory" {
            let dir = Path::new("/sys/fs/cgroup/memory").join(path);
            if let (Some(limit), Some(usage)) =
                (read(dir.join("memory.limit_in_bytes")), read(dir.join("memory.usage_in_bytes")))
                && limit < (1 << 60)
            {
                return Some((limit, usage));
            }
        }
        if ctrl.is_empty() {
            for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                let dir = Path::new(root).join(path);
                if let (Some(limit), Some(usage)) = (read(dir.join("memory.max")), read(dir.join("memory.current"))) {
                    return Some((limit, usage));
                }
            }
        }
    }
    None
}

/// The largest ring that leaves half the cgroup's free memory to the rest of the shipper.
fn ring_that_fits(requested: u32) -> (u32, String) {
    let page = page_size();
    let (room, detail) = match memcg_room() {
        Some((limit, usage)) => {
            (limit.saturating_sub(usage) / 2, format!("memory cgroup limit {limit} bytes, {usage} in use"))
        }
        None => (u64::from(requested / 4), "no memory cgroup limit found; the kernel refused the allocation".into()),
    };
    let mut fits = page;
    while u64::from(fits) * 2 <= room && fits * 2 < requested {
        fits *= 2;
    }
    (fits, detail)
}

fn classify(e: &aya::EbpfError, origin: &str, cfg: &BpfConfig) -> LoadError {
    let io = first_io_error(e);
    let code = io.and_then(std::io::Error::raw_os_error);
    let what = chain(e);
    if matches!(code, Some(libc::EPERM | libc::EACCES)) {
        return LoadError::Permission {
            what: format!("loading {origin} ({what})"),
            source: std::io::Error::from_raw_os_error(code.unwrap_or(libc::EPERM)),
        };
    }
    if let aya::EbpfError::MapError(aya::maps::MapError::CreateError { name, .. }) = e
        && matches!(code, Some(libc::ENOMEM | libc::E2BIG))
    {
        let (ring, field, bytes) = if name == BULK_RING {
            (BULK_RING, "bulk_ring_bytes", cfg.bulk_ring_bytes)
        } else {
            (P0_RING, "p0_ring_bytes", cfg.p0_ring_bytes)
        };
        let (fits, detail) = ring_that_fits(bytes);
        return LoadError::RingTooLarge { ring, field, bytes, detail: format!("{what}; {detail}"), fits };
    }
    match e {
        aya::EbpfError::ParseError(_) | aya::EbpfError::BtfError(_) | aya::EbpfError::RelocationError(_) => {
            LoadError::BadObject { origin: origin.to_owned(), detail: what }
        }
        aya::EbpfError::MapError(_) => {
            LoadError::Kernel { what: format!("creating the maps of {origin}"), detail: what }
        }
        _ => LoadError::Kernel { what: format!("loading {origin}"), detail: what },
    }
}

fn is_bpffs(dir: &Path) -> bool {
    // BPF_FS_MAGIC
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: statfs writes into the zeroed struct; the path is NUL-terminated.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &raw mut st) == 0 && st.f_type == BPF_FS_MAGIC
    }
}

/// The pinned ring's size, if a pin exists (a pinned ring keeps its size: resizing means
/// removing the pins, which ends the epoch).
fn pinned_size(dir: &Path, name: &str) -> Option<u32> {
    let m = MapData::from_pin(dir.join(name)).ok()?;
    m.info().ok().map(|i| i.max_entries())
}

fn load(cfg: &BpfConfig) -> Result<Loaded, LoadError> {
    let (bytes, origin): (std::borrow::Cow<'_, [u8]>, String) = match &cfg.object {
        Some(p) => (
            std::fs::read(p)
                .map_err(|e| LoadError::BadObject { origin: p.display().to_string(), detail: e.to_string() })?
                .into(),
            p.display().to_string(),
        ),
        None if EMBEDDED.is_empty() => return Err(LoadError::NotBuilt { why: BUILD_MISSING.to_owned() }),
        None => (EMBEDDED.into(), "the embedded ringwatch.bpf.o".to_owned()),
    };
    if !cfg.kernel_btf.exists() {
        return Err(LoadError::NoBtf { path: cfg.kernel_btf.clone() });
    }
    check_ring_size("p0_ring_bytes", cfg.p0_ring_bytes)?;
    check_ring_size("bulk_ring_bytes", cfg.bulk_ring_bytes)?;
    std::fs::create_dir_all(&cfg.pin_dir).map_err(|e| match e.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => {
            LoadError::Permission { what: format!("creating {}", cfg.pin_dir.display()), source: e }
        }
        _ => LoadError::NoBpfFs { dir: cfg.pin_dir.clone() },
    })?;
    if !is_bpffs(&cfg.pin_dir) {
        return Err(LoadError::NoBpfFs { dir: cfg.pin_dir.clone() });
    }
    let replaced_layout = retire_other_layout(&cfg.pin_dir)?;
    let reopened = cfg.pin_dir.join(META).exists();
    let p0 = pinned_size(&cfg.pin_dir, P0_RING).unwrap_or(cfg.p0_ring_bytes);
    let bulk = pinned_size(&cfg.pin_dir, BULK_RING).unwrap_or(cfg.bulk_ring_bytes);
    if (p0, bulk) != (cfg.p0_ring_bytes, cfg.bulk_ring_bytes) {
        tracing::warn!(
            p0_ring_bytes = p0,
            bulk_ring_bytes = bulk,
            "pinned rings keep their sizes; remove {} to resize (that starts a new epoch)",
            cfg.pin_dir.display()
        );
    }
    let paths: Vec<(&str, PathBuf)> = PINNED_MAPS.iter().map(|m| (*m, cfg.pin_dir.join(m))).collect();
    let mut loader = EbpfLoader::new();
    loader.map_max_entries(P0_RING, p0).map_max_entries(BULK_RING, bulk);
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    let aligned: Vec<u8>;
    let data: &[u8] = if bytes.as_ptr().align_offset(8) == 0 {
        &bytes
    } else {
        // The ELF parser wants alignment; a file read into a Vec usually has it anyway.
        aligned = bytes.to_vec();
        &aligned
    };
    let mut ebpf = loader.load(data).map_err(|e| classify(&e, &origin, cfg))?;
    if !reopened {
        // Whoever creates the pins (a shipper, or a producer in tests) says their layout.
        let map =
            ebpf.map_mut(LAYOUT).ok_or_else(|| LoadError::Kernel { what: LAYOUT.into(), detail: "missing".into() })?;
        let mut layout = Array::<_, u32>::try_from(map)
            .map_err(|e| LoadError::Kernel { what: LAYOUT.into(), detail: e.to_string() })?;
        layout
            .set(0, PIN_LAYOUT, 0)
            .map_err(|e| LoadError::Kernel { what: "writing rw_layout".into(), detail: e.to_string() })?;
    }
    load_programs(&mut ebpf, &origin)?;
    Ok(Loaded { ebpf, reopened, ring_bytes: [p0, bulk], replaced_layout })
}

/// The layout of the pins under `dir`: `rw_layout`'s value (written by whoever created
/// them, right after; 0 if that one died first — then it is unknown, and treated as
/// another layout), 1 for pins from before it existed, `None` when nothing is pinned.
fn pinned_layout(dir: &Path) -> Option<u32> {
    if !dir.join(META).exists() {
        return None;
    }
    let Ok(data) = MapData::from_pin(dir.join(LAYOUT)) else { return Some(1) };
    // A map that does not read as one u32 is some other layout too.
    Some(
        Array::<MapData, u32>::try_from(aya::maps::Map::Array(data))
            .ok()
            .and_then(|a| a.get(&0, 0).ok())
            .unwrap_or(u32::MAX),
    )
}

/// Pins of another layout than [`PIN_LAYOUT`] are never read: every ringwatch pin under
/// `dir` (maps, programs, links) is removed, so this session creates its maps afresh and
/// starts a new epoch — the aggregator closes the old one explicitly when the new
/// `epoch_start` arrives. Returns the layout it found and retired.
fn retire_other_layout(dir: &Path) -> Result<Option<u32>, LoadError> {
    let found = match pinned_layout(dir) {
        Some(l) if l != PIN_LAYOUT => l,
        _ => return Ok(None),
    };
    tracing::warn!(
        pin_dir = %dir.display(),
        found,
        expected = PIN_LAYOUT,
        "pins of another layout: removing them; a new epoch starts (the old one ends here)"
    );
    let entries = std::fs::read_dir(dir)
        .map_err(|e| LoadError::Kernel { what: format!("listing {}", dir.display()), detail: e.to_string() })?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("rw_") || name.starts_with("link_") {
            std::fs::remove_file(e.path()).map_err(|err| LoadError::Kernel {
                what: format!("removing the old pin {}", e.path().display()),
                detail: err.to_string(),
            })?;
        }
    }
    Ok(Some(found))
}

fn verifier_error(name: &str, e: &aya::programs::ProgramError) -> LoadError {
    let io = first_io_error(e).and_then(std::io::Error::raw_os_error);
    if matches!(io, Some(libc::EPERM | libc::EACCES)) {
        LoadError::Permission {
            what: format!("loading program {name}"),
            source: std::io::Error::from_raw_os_error(io.unwrap_or(libc::EPERM)),
        }
    } else {
        LoadError::Kernel { what: format!("the verifier refused {name}"), detail: chain(e) }
    }
}

fn load_programs(ebpf: &mut Ebpf, origin: &str) -> Result<(), LoadError> {
    let missing = |name: &str| LoadError::BadObject { origin: origin.to_owned(), detail: format!("no program {name}") };
    for (name, _) in NCCL_PROBES {
        let prog: &mut aya::programs::UProbe =
            ebpf.program_mut(name).ok_or_else(|| missing(name))?.try_into().map_err(
                |e: aya::programs::ProgramError| LoadError::BadObject {
                    origin: origin.to_owned(),
                    detail: format!("{name}: {e}"),
                },
            )?;
        prog.load().map_err(|e| verifier_error(name, &e))?;
    }
    let exit: &mut aya::programs::TracePoint =
        ebpf.program_mut(EXIT_PROG).ok_or_else(|| missing(EXIT_PROG))?.try_into().map_err(
            |e: aya::programs::ProgramError| LoadError::BadObject {
                origin: origin.to_owned(),
                detail: format!("{EXIT_PROG}: {e}"),
            },
        )?;
    exit.load().map_err(|e| verifier_error(EXIT_PROG, &e))?;
    for name in [BULK_PROG, P0_TEST_PROG] {
        let prog: &mut Xdp = ebpf.program_mut(name).ok_or_else(|| missing(name))?.try_into().map_err(
            |e: aya::programs::ProgramError| LoadError::BadObject {
                origin: origin.to_owned(),
                detail: format!("{name}: {e}"),
            },
        )?;
        prog.load().map_err(|e| verifier_error(name, &e))?;
    }
    Ok(())
}

fn take_array<V: aya::Pod>(ebpf: &mut Ebpf, name: &str) -> Result<Array<MapData, V>, LoadError> {
    let map = ebpf.take_map(name).ok_or_else(|| LoadError::Kernel { what: name.into(), detail: "missing".into() })?;
    Array::try_from(map).map_err(|e| LoadError::Kernel { what: name.into(), detail: e.to_string() })
}

type CounterBytes = [u8; size_of::<RingCounters>()];
type IfBytes = [u8; size_of::<IfCounters>()];
type ProgressKeyBytes = [u8; size_of::<ProgressKey>()];
type ProgressBytes = [u8; size_of::<ProgressEntry>()];

fn take_counters(ebpf: &mut Ebpf) -> Result<PerCpuArray<MapData, CounterBytes>, LoadError> {
    let map =
        ebpf.take_map(COUNTERS).ok_or_else(|| LoadError::Kernel { what: COUNTERS.into(), detail: "missing".into() })?;
    PerCpuArray::try_from(map).map_err(|e| LoadError::Kernel { what: COUNTERS.into(), detail: e.to_string() })
}

type InterfaceMaps = (PerCpuHashMap<MapData, u32, IfBytes>, PerCpuArray<MapData, IfBytes>);

fn take_interface_maps(ebpf: &mut Ebpf) -> Result<InterfaceMaps, LoadError> {
    let missing = |name: &str| LoadError::Kernel { what: name.into(), detail: "missing".into() };
    let map = ebpf.take_map(IF_COUNTERS).ok_or_else(|| missing(IF_COUNTERS))?;
    let counters = PerCpuHashMap::try_from(map)
        .map_err(|e| LoadError::Kernel { what: IF_COUNTERS.into(), detail: e.to_string() })?;
    let map = ebpf.take_map(IF_OVERFLOW).ok_or_else(|| missing(IF_OVERFLOW))?;
    let overflow = PerCpuArray::try_from(map)
        .map_err(|e| LoadError::Kernel { what: IF_OVERFLOW.into(), detail: e.to_string() })?;
    Ok((counters, overflow))
}

fn take_ring(ebpf: &mut Ebpf, name: &str) -> Result<RingBuf<MapData>, LoadError> {
    let map = ebpf.take_map(name).ok_or_else(|| LoadError::Kernel { what: name.into(), detail: "missing".into() })?;
    RingBuf::try_from(map).map_err(|e| LoadError::Kernel { what: name.into(), detail: e.to_string() })
}

/// Every (ring, CPU)'s counters, as stream entries (`held_from_seq` left 0: the
/// shipper core fills it).
fn read_counters(map: &PerCpuArray<MapData, CounterBytes>) -> Result<Vec<(StreamId, RingCounters)>, LoadError> {
    let mut out = Vec::new();
    for ring in 0..RING_COUNT {
        let values = map
            .get(&u32::from(ring), 0)
            .map_err(|e| LoadError::Kernel { what: "reading rw_counters".into(), detail: e.to_string() })?;
        let class = if ring == RING_P0 { Class::P0 } else { Class::P2 };
        for (cpu, v) in values.iter().enumerate() {
            let Ok(c) = RingCounters::read_from_bytes(v) else { continue };
            let Ok(cpu) = u16::try_from(cpu) else { break };
            out.push((StreamId::new(class, ring, cpu), c));
        }
    }
    Ok(out)
}

/// The per-interface counters: (interface, CPU) values summed per interface, in ifindex
/// order, and the overflow's as [`IFINDEX_OVERFLOW`] when it counted anything.
fn read_interfaces(
    map: &PerCpuHashMap<MapData, u32, IfBytes>,
    overflow: &PerCpuArray<MapData, IfBytes>,
) -> Result<Vec<InterfaceEntry>, LoadError> {
    let sum = |values: &[IfBytes]| {
        values
            .iter()
            .filter_map(|v| IfCounters::read_from_bytes(v).ok())
            .fold((0u64, 0u64), |(p, b), c| (p.saturating_add(c.packets.get()), b.saturating_add(c.bytes.get())))
    };
    let entry = |ifindex: u32, (packets, bytes): (u64, u64)| InterfaceEntry {
        ifindex: U32::new(ifindex),
        _reserved0: U32::new(0),
        packets: U64::new(packets),
        bytes: U64::new(bytes),
    };
    let mut out = Vec::new();
    for item in map.iter() {
        let (ifindex, values) =
            item.map_err(|e| LoadError::Kernel { what: "reading rw_if_counters".into(), detail: e.to_string() })?;
        out.push(entry(ifindex, sum(&values)));
    }
    out.sort_by_key(|e| e.ifindex.get());
    let values = overflow
        .get(&0, 0)
        .map_err(|e| LoadError::Kernel { what: "reading rw_if_overflow".into(), detail: e.to_string() })?;
    let beyond = sum(&values);
    if beyond.0 > 0 {
        out.insert(0, entry(IFINDEX_OVERFLOW, beyond));
    }
    Ok(out)
}

fn stream_entry(id: StreamId, c: &RingCounters, fill_ppm: u32) -> StreamEntry {
    let mut e = StreamEntry::new_zeroed();
    e.stream_id = U32::new(id.0);
    e.fill_max_ppm = U32::new(fill_ppm);
    e.attempted_seq = c.seq;
    e.drops = c.drops;
    e.sampled_out = c.sampled_out;
    e
}

fn boot_id() -> [u8; 16] {
    let mut out = [0u8; 16];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let hex: Vec<u8> = s.trim().bytes().filter(u8::is_ascii_hexdigit).collect();
        for (i, pair) in hex.chunks(2).take(16).enumerate() {
            let text = std::str::from_utf8(pair).unwrap_or("0");
            out[i] = u8::from_str_radix(text, 16).unwrap_or(0);
        }
    }
    out
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    // SAFETY: clock_gettime writes into the zeroed timespec.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::clock_gettime(clock, &raw mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

/// Host `CLOCK_MONOTONIC`, what the programs stamp frames with (`bpf_ktime_get_ns`).
#[must_use]
pub fn mono_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// The shipper's view of the kernel side: rings, counters, control; implements [`Source`].
pub struct RingSource {
    cfg: BpfConfig,
    /// Keeps the programs loaded (and their pins' owners alive).
    _ebpf: Ebpf,
    rings: [RingBuf<MapData>; 2],
    counter_map: PerCpuArray<MapData, CounterBytes>,
    if_counters: PerCpuHashMap<MapData, u32, IfBytes>,
    if_overflow: PerCpuArray<MapData, IfBytes>,
    control: Array<MapData, [u8; size_of::<SamplingControl>()]>,
    progress: aya::maps::HashMap<MapData, ProgressKeyBytes, ProgressBytes>,
    progress_stats: Array<MapData, [u8; size_of::<ProgressStats>()]>,
    /// PROGRESS entries created, as of the last poll (a change sends counters at once).
    progress_inserted_seen: u64,
    /// Gaps between drain passes (µs, 1 µs .. 60 s, 3 significant digits).
    drain_gaps: hdrhistogram::Histogram<u64>,
    last_drain: Option<Instant>,
    /// Fill, drain-gap and drop-burst histograms (`/metrics`), and per ring the
    /// streams' last seqs the bursts are found from.
    metrics: RingMetrics,
    bursts: [BurstTracker; 2],
    epoch: EpochStart,
    sessions: u64,
    reopened: bool,
    /// Pins of this other layout were found and removed: this session started a new epoch.
    replaced_layout: Option<u32>,
    started: bool,
    takeover: Vec<SessionStreamEntry>,
    counters: SourceCounters,
    stats: RingStats,
    /// Bytes found so far by the pass in progress, per ring (a pass ends at an empty ring).
    pass_bytes: [u64; 2],
    next_drain: Instant,
    next_counters: Instant,
    errors: u64,
}

impl std::fmt::Debug for RingSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingSource").field("pin_dir", &self.cfg.pin_dir).field("epoch", &self.epoch.epoch).finish()
    }
}

impl RingSource {
    /// Loads (or reopens) the rings under `cfg.pin_dir`, pins programs, attaches XDP.
    ///
    /// # Errors
    /// See [`LoadError`]: each variant names the fix.
    pub fn open(cfg: BpfConfig) -> Result<Self, LoadError> {
        let Loaded { mut ebpf, reopened, ring_bytes, replaced_layout } = load(&cfg)?;
        let kernel =
            |what: &str, e: &dyn std::error::Error| LoadError::Kernel { what: what.into(), detail: e.to_string() };
        // Programs: this session's replace the last one's pins.
        for name in [BULK_PROG, P0_TEST_PROG, EXIT_PROG, NCCL_PROBES[0].0, NCCL_PROBES[1].0, NCCL_PROBES[2].0] {
            let path = cfg.pin_dir.join(name);
            let _ = std::fs::remove_file(&path);
            if let Some(p) = ebpf.program_mut(name) {
                p.pin(&path).map_err(|e| kernel(&format!("pinning {name}"), &e))?;
            }
        }
        attach_xdp(&mut ebpf, &cfg)?;
        if let Some(shim) = &cfg.nccl_shim {
            attach_nccl(&mut ebpf, &cfg.pin_dir, shim)?;
        }
        let mut meta_map: Array<MapData, [u8; size_of::<EpochMeta>()]> = take_array(&mut ebpf, META)?;
        let mut meta = meta_map
            .get(&0, 0)
            .ok()
            .and_then(|b| EpochMeta::read_from_bytes(&b).ok())
            .unwrap_or_else(EpochMeta::new_zeroed);
        let fresh = meta.epoch.get() == 0;
        if fresh {
            let realtime = clock_ns(libc::CLOCK_REALTIME);
            meta.epoch = U64::new((realtime / 1_000).max(1));
            meta.start_realtime_ns = U64::new(realtime);
            meta.start_mono_ns = U64::new(mono_ns());
            meta.boot_id = boot_id();
        }
        meta.sessions = U64::new(meta.sessions.get() + 1);
        let mut raw = [0u8; size_of::<EpochMeta>()];
        raw.copy_from_slice(meta.as_bytes());
        meta_map.set(0, raw, 0).map_err(|e| kernel("writing rw_meta", &e))?;
        let counter_map = take_counters(&mut ebpf)?;
        let control = take_array(&mut ebpf, CONTROL)?;
        let rings = [take_ring(&mut ebpf, P0_RING)?, take_ring(&mut ebpf, BULK_RING)?];
        let progress_map = ebpf.take_map(PROGRESS).ok_or_else(|| kernel(PROGRESS, &std::fmt::Error))?;
        let progress: aya::maps::HashMap<MapData, ProgressKeyBytes, ProgressBytes> =
            aya::maps::HashMap::try_from(progress_map).map_err(|e| kernel(PROGRESS, &e))?;
        let progress_stats = take_array(&mut ebpf, PROGRESS_STATS)?;
        let (if_counters, if_overflow) = take_interface_maps(&mut ebpf)?;
        // The takeover point: every stream's attempted_seq now. Seqs below it that this
        // session does not find in the ring were read by the last one and never shipped.
        let takeover = if fresh {
            Vec::new()
        } else {
            read_counters(&counter_map)?
                .into_iter()
                .map(|(id, c)| {
                    let mut e = SessionStreamEntry::new_zeroed();
                    e.stream_id = U32::new(id.0);
                    e.attempted_seq = c.seq;
                    e
                })
                .collect()
        };
        tracing::info!(
            pin_dir = %cfg.pin_dir.display(),
            epoch = meta.epoch.get(),
            session = meta.sessions.get(),
            reopened = reopened && !fresh,
            p0_ring_bytes = ring_bytes[0],
            bulk_ring_bytes = ring_bytes[1],
            built_with = if cfg.object.is_some() { "(bpf_object)" } else { BUILT_WITH },
            "eBPF rings ready"
        );
        let now = Instant::now();
        Ok(Self {
            epoch: EpochStart {
                epoch: meta.epoch.get(),
                boot_id: meta.boot_id,
                mono_ns: meta.start_mono_ns.get(),
                start_realtime_ns: meta.start_realtime_ns.get(),
            },
            sessions: meta.sessions.get(),
            reopened: reopened && !fresh,
            replaced_layout,
            started: false,
            takeover,
            counters: SourceCounters { epoch: meta.epoch.get(), ..SourceCounters::default() },
            stats: RingStats { ring_bytes, ..RingStats::default() },
            pass_bytes: [0; 2],
            next_drain: now,
            next_counters: now,
            errors: 0,
            cfg,
            _ebpf: ebpf,
            rings,
            counter_map,
            if_counters,
            if_overflow,
            control,
            progress,
            progress_stats,
            progress_inserted_seen: 0,
            drain_gaps: hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 3)
                .map_err(|e| kernel("the drain-gap histogram", &e))?,
            last_drain: None,
            metrics: RingMetrics::new(ring_bytes),
            bursts: Default::default(),
        })
    }

    /// The layout of pins found and removed instead of read (another build's): this
    /// session started a new epoch.
    #[must_use]
    pub fn replaced_layout(&self) -> Option<u32> {
        self.replaced_layout
    }

    /// Whether this session took over rings a previous shipper left pinned.
    #[must_use]
    pub fn reopened(&self) -> bool {
        self.reopened
    }

    /// The epoch of the counters.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch.epoch
    }

    /// Drain and fill figures.
    #[must_use]
    pub fn stats(&self) -> RingStats {
        self.stats
    }

    /// The PROGRESS entries, most recently updated first, at most
    /// [`MAX_PROGRESS_PER_HEARTBEAT`]; updates the PROGRESS figures in [`RingStats`].
    /// The per-interface counters (none, counted as an error, when the maps cannot be
    /// read: the aggregator then forgets the node's interfaces until they can).
    fn read_interfaces_now(&mut self) -> Vec<InterfaceEntry> {
        read_interfaces(&self.if_counters, &self.if_overflow).unwrap_or_else(|e| {
            self.errors += 1;
            tracing::warn!(error = %e, "reading the per-interface counters failed");
            Vec::new()
        })
    }

    fn read_progress(&mut self, stats: Option<ProgressStats>) -> Vec<ProgressEntry> {
        let mut entries: Vec<ProgressEntry> = self
            .progress
            .iter()
            .filter_map(Result::ok)
            .filter_map(|(_, v)| ProgressEntry::read_from_bytes(&v).ok())
            .collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.last_update_ns.get()));
        let present = entries.len() as u64;
        self.stats.progress_truncated = present.saturating_sub(MAX_PROGRESS_PER_HEARTBEAT as u64);
        entries.truncate(MAX_PROGRESS_PER_HEARTBEAT);
        if let Some(st) = stats {
            self.stats.progress_evicted = st.inserted.get().saturating_sub(present);
            self.stats.progress_exits = st.exits.get();
        }
        self.stats.progress_entries = present;
        entries
    }

    /// Drains `ring` until it is empty, `limit` records were read or one ring's worth of
    /// bytes was; true when empty.
    fn drain(&mut self, ring: usize, limit: usize, out: &mut dyn FnMut(SourceEvent<'_>)) -> (usize, bool) {
        let mut n = 0;
        // At most one ring's worth of bytes per pass: every record in the ring when the
        // pass began is then read (records are consumed in order and the ring holds at
        // most its size), while a producer faster than this thread cannot hold it here
        // forever — a pass "to empty" against such a producer never ended, so the
        // counters (heartbeats, sampling decisions) that wait for it never came.
        let budget_bytes = u64::from(self.stats.ring_bytes.get(ring).copied().unwrap_or(0)).max(1);
        let mut bytes = 0u64;
        let Some(rb) = self.rings.get_mut(ring) else { return (0, true) };
        while n < limit && bytes < budget_bytes {
            let Some(item) = rb.next() else {
                // End of a pass: what it found is the fill at this drain.
                let size = u64::from(self.stats.ring_bytes[ring].max(1));
                let ppm = u32::try_from((self.pass_bytes[ring] * 1_000_000 / size).min(1_000_000)).unwrap_or(0);
                self.stats.fill_max_ppm[ring] = self.stats.fill_max_ppm[ring].max(ppm);
                self.stats.fill_max_ppm_ever[ring] = self.stats.fill_max_ppm_ever[ring].max(ppm);
                self.metrics.on_drained(ring, self.pass_bytes[ring]);
                self.pass_bytes[ring] = 0;
                self.stats.drains += u64::from(ring == 1);
                return (n, true);
            };
            let len = item.len();
            let record = (len as u64 + 8).next_multiple_of(8);
            bytes += record;
            self.pass_bytes[ring] += record;
            self.stats.records[ring] += 1;
            self.stats.bytes[ring] += len as u64;
            if let Some(r) = self.metrics.read_bytes.get_mut(ring) {
                *r += record;
            }
            if let Ok((h, _)) = proto_flat::FrameHeader::ref_from_prefix(&item) {
                let id = h.stream();
                let key = usize::from(id.cpu()) * 4 + usize::from(id.class_code() & 3);
                if let Some((frames, ns)) =
                    self.bursts.get_mut(ring).and_then(|t| t.on_frame(key, h.seq.get(), h.ts_ns.get()))
                {
                    self.metrics.on_burst(ring, frames, ns);
                    self.stats.drop_bursts[ring] += 1;
                    self.stats.drop_burst_frames[ring] += frames;
                }
                out(SourceEvent::Frame(&item));
            } else {
                self.stats.malformed += 1;
            }
            n += 1;
        }
        (n, false)
    }
}

/// Pins an attachment's link at `pin`, so it outlives this process (`what` for errors).
fn pin_link<L>(link: L, what: &str, pin: &Path) -> Result<(), LoadError>
where
    L: TryInto<aya::programs::links::FdLink, Error = aya::programs::links::LinkError>,
{
    let fd = link
        .try_into()
        .map_err(|e| LoadError::Kernel { what: format!("{what}: its link cannot be pinned"), detail: e.to_string() })?;
    fd.pin(pin).map(|_| ()).map_err(|e| LoadError::Kernel { what: format!("pinning {what}"), detail: e.to_string() })
}

fn attach_xdp(ebpf: &mut Ebpf, cfg: &BpfConfig) -> Result<(), LoadError> {
    for ifname in &cfg.xdp_interfaces {
        let pin = cfg.pin_dir.join(format!("link_xdp_{ifname}"));
        if pin.exists() {
            // Still attached from an earlier session (the program it runs writes the same
            // pinned maps): keep it, so no packet goes unseen across the restart.
            continue;
        }
        let prog: &mut Xdp = ebpf
            .program_mut(BULK_PROG)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| LoadError::Kernel { what: BULK_PROG.into(), detail: "missing".into() })?;
        let id = prog
            .attach(ifname, aya::programs::XdpMode::Default)
            .or_else(|_| prog.attach(ifname, aya::programs::XdpMode::Skb))
            .map_err(|e| LoadError::Kernel { what: format!("attaching {BULK_PROG} to {ifname}"), detail: chain(&e) })?;
        let link = prog
            .take_link(id)
            .map_err(|e| LoadError::Kernel { what: format!("the XDP link on {ifname}"), detail: chain(&e) })?;
        pin_link(link, &format!("the XDP link on {ifname}"), &pin)?;
    }
    Ok(())
}

/// uprobes on the shim's probe functions, and the exit hook; links pinned (kept by a
/// restarted shipper: the probes never go away while processes run).
///
/// A uprobe belongs to the file's inode, not its path: every process that maps that file
/// is probed, whatever path it opened (a bind mount into a pod's mount namespace, a hard
/// link). The links are pinned per inode, so a shim replaced at the same path (an
/// upgrade: a new inode) gets links of its own when the shipper starts again, and the
/// links on the old file stay for the processes that still map it.
fn attach_nccl(ebpf: &mut Ebpf, pin_dir: &Path, shim: &Path) -> Result<(), LoadError> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(shim).map_err(|e| LoadError::Kernel {
        what: format!("the NCCL profiler shim {}", shim.display()),
        detail: if e.kind() == std::io::ErrorKind::NotFound {
            "no such file (build it: make -C node-shipper/nccl-shim)".into()
        } else {
            e.to_string()
        },
    })?;
    let inode = format!("{:x}_{:x}", meta.dev(), meta.ino());
    for (prog_name, symbol) in NCCL_PROBES {
        let pin = pin_dir.join(format!("link_uprobe_{symbol}_{inode}"));
        if pin.exists() {
            continue;
        }
        let prog: &mut aya::programs::UProbe = ebpf
            .program_mut(prog_name)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| LoadError::Kernel { what: prog_name.into(), detail: "missing".into() })?;
        let id = match prog.attach(symbol, shim, aya::programs::uprobe::UProbeScope::AllProcesses) {
            Ok(id) => id,
            Err(e) if NCCL_OPTIONAL_PROBES.contains(&symbol) => {
                tracing::warn!(shim = %shim.display(), symbol, error = %chain(&e), "the shim has no such probe (built before it?): not probed");
                continue;
            }
            Err(e) => {
                return Err(LoadError::Kernel {
                    what: format!("uprobe on {symbol} in {}", shim.display()),
                    detail: chain(&e),
                });
            }
        };
        let link = prog
            .take_link(id)
            .map_err(|e| LoadError::Kernel { what: format!("the uprobe link on {symbol}"), detail: chain(&e) })?;
        pin_link(link, &format!("the uprobe on {symbol}"), &pin)?;
    }
    tracing::info!(shim = %shim.display(), inode = %inode, "uprobes on the NCCL profiler shim");
    let pin = pin_dir.join("link_tp_sched_process_exit");
    if !pin.exists() {
        let prog: &mut aya::programs::TracePoint = ebpf
            .program_mut(EXIT_PROG)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| LoadError::Kernel { what: EXIT_PROG.into(), detail: "missing".into() })?;
        let id = prog.attach("sched", "sched_process_exit").map_err(|e| LoadError::Kernel {
            what: "the sched_process_exit hook (is tracefs mounted at /sys/kernel/tracing?)".into(),
            detail: chain(&e),
        })?;
        let link = prog
            .take_link(id)
            .map_err(|e| LoadError::Kernel { what: "the exit hook's link".into(), detail: chain(&e) })?;
        pin_link(link, "the exit hook", &pin)?;
    }
    Ok(())
}

impl Source for RingSource {
    fn pids_are_local(&self) -> bool {
        true
    }

    fn stamps_frames_now(&self) -> bool {
        true
    }

    fn ring_metrics(&self) -> Option<RingMetrics> {
        Some(self.metrics.clone())
    }

    fn poll(&mut self, budget: usize, out: &mut dyn FnMut(SourceEvent<'_>)) -> SourceState {
        if !self.started {
            self.started = true;
            out(SourceEvent::Epoch(self.epoch));
            if self.reopened {
                let takeover = std::mem::take(&mut self.takeover);
                out(SourceEvent::SessionStart(&takeover));
            }
        }
        let now = Instant::now();
        if now < self.next_drain && now < self.next_counters {
            return SourceState::Running;
        }
        // A new PROGRESS entry (a communicator's init) goes out at once: the aggregator
        // needs it (rank → GPU) before it judges that communicator's first ops.
        let progress_stats = self.progress_stats.get(&0, 0).ok().and_then(|b| ProgressStats::read_from_bytes(&b).ok());
        let inserted = progress_stats.map_or(0, |st| st.inserted.get());
        let counters_due = now >= self.next_counters || inserted != self.progress_inserted_seen;
        self.progress_inserted_seen = inserted;
        if let Some(prev) = self.last_drain {
            let gap = u64::try_from(now.duration_since(prev).as_micros()).unwrap_or(u64::MAX);
            self.drain_gaps.saturating_record(gap.max(1));
            self.metrics.on_drain_gap(gap.saturating_mul(1_000));
            self.stats.drain_gap_p999_us = self.drain_gaps.value_at_quantile(0.999);
            self.stats.drain_gap_max_us = self.drain_gaps.max();
        }
        self.last_drain = Some(now);
        // Counters first, then drain what the rings held then (a ring's worth of bytes
        // at most, see `drain`): every seq they count is then yielded (or was dropped in
        // the kernel) before they are.
        let snapshot = if counters_due {
            match read_counters(&self.counter_map) {
                // The interfaces right after the streams, so both stand for one moment.
                Ok(c) => Some((c, mono_ns(), self.read_interfaces_now())),
                Err(e) => {
                    self.errors += 1;
                    tracing::warn!(error = %e, "reading the kernel counters failed");
                    None
                }
            }
        } else {
            None
        };
        // P0 first, always to empty: it is small and it is what verdicts wait on.
        let _ = self.drain(usize::from(RING_P0), usize::MAX, out);
        let limit = if snapshot.is_some() { usize::MAX } else { budget };
        let (_, empty) = self.drain(usize::from(RING_BULK), limit, out);
        if snapshot.is_some() {
            // A last P0 pass: records committed while bulk drained.
            let _ = self.drain(usize::from(RING_P0), usize::MAX, out);
        }
        if empty {
            self.next_drain = now + Duration::from_micros(self.cfg.drain_interval_us);
        }
        if let Some((streams, mono, interfaces)) = snapshot {
            let progress = self.read_progress(progress_stats);
            let fill = self.stats.fill_max_ppm;
            self.counters = SourceCounters {
                epoch: self.epoch.epoch,
                mono_ns: mono,
                streams: streams
                    .iter()
                    .map(|(id, c)| stream_entry(*id, c, fill[usize::from(id.ring()).min(1)]))
                    .collect(),
                progress,
                // Filled by the reader (it looks the processes up).
                owners: Vec::new(),
                interfaces,
            };
            self.stats.fill_max_ppm = [0; 2];
            self.next_counters = now + Duration::from_millis(self.cfg.counters_interval_ms);
            out(SourceEvent::Counters(&self.counters));
        }
        SourceState::Running
    }

    fn counters(&self) -> &SourceCounters {
        &self.counters
    }

    fn node_mono_ns(&self) -> u64 {
        mono_ns()
    }

    fn describe(&self) -> String {
        format!(
            "eBPF rings pinned at {} (epoch {}, session {})",
            self.cfg.pin_dir.display(),
            self.epoch.epoch,
            self.sessions
        )
    }

    fn shipper_stream_index(&self) -> u16 {
        // One P1 stream per session of the epoch: a restarted shipper's heartbeats must not
        // look like duplicates of the last session's.
        u16::try_from(self.sessions.saturating_sub(1) % u64::from(u16::MAX)).unwrap_or(0)
    }

    fn ring_stats(&self) -> Option<RingStats> {
        Some(self.stats)
    }

    fn set_sampling_level(&mut self, level: u8) -> bool {
        let ctl = SamplingControl {
            bulk_level: U32::new(u32::from(level.min(proto_flat::kernel::MAX_SAMPLING_LEVEL))),
            _reserved0: U32::ZERO,
        };
        let mut raw = [0u8; size_of::<SamplingControl>()];
        raw.copy_from_slice(ctl.as_bytes());
        self.control.set(0, raw, 0).is_ok()
    }
}

/// The kernel side driven from user space, for tests and benchmarks: the same object
/// loaded against the same pins, its XDP programs run with `BPF_PROG_TEST_RUN` (on the
/// calling thread's CPU), and the counters read back.
pub struct Producer {
    ebpf: Ebpf,
    counter_map: PerCpuArray<MapData, CounterBytes>,
    if_counters: PerCpuHashMap<MapData, u32, IfBytes>,
    if_overflow: PerCpuArray<MapData, IfBytes>,
    control: Array<MapData, [u8; size_of::<SamplingControl>()]>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer").finish_non_exhaustive()
    }
}

impl Producer {
    /// Loads the object against the pins in `cfg.pin_dir` (creating them if absent).
    ///
    /// # Errors
    /// As [`RingSource::open`].
    pub fn open(cfg: &BpfConfig) -> Result<Self, LoadError> {
        let Loaded { mut ebpf, .. } = load(cfg)?;
        let counter_map = take_counters(&mut ebpf)?;
        let control = take_array(&mut ebpf, CONTROL)?;
        let (if_counters, if_overflow) = take_interface_maps(&mut ebpf)?;
        Ok(Self { ebpf, counter_map, if_counters, if_overflow, control })
    }

    fn run(&self, prog: &str, packet: &[u8], repeat: u32) -> Result<Duration, LoadError> {
        let p: &Xdp = self
            .ebpf
            .program(prog)
            .and_then(|p| p.try_into().ok())
            .ok_or_else(|| LoadError::Kernel { what: prog.into(), detail: "missing".into() })?;
        let opts = TestRunOptions { data_in: Some(packet), repeat, ..TestRunOptions::default() };
        let r = p
            .test_run(opts)
            .map_err(|e| LoadError::Kernel { what: format!("test run of {prog}"), detail: chain(&e) })?;
        Ok(r.duration)
    }

    /// `repeat` bulk events (a 1,500-byte packet each) on this CPU; the kernel's average
    /// time per event.
    ///
    /// # Errors
    /// The test run failed.
    pub fn bulk(&self, repeat: u32) -> Result<Duration, LoadError> {
        static PACKET: [u8; 1500] = [0x5a; 1500];
        self.run(BULK_PROG, &PACKET, repeat)
    }

    /// `repeat` collective frames on this CPU from `template` (the kernel sets the header
    /// and adds the seq to `comm_op_seq` and `local_op_seq`).
    ///
    /// # Errors
    /// The test run failed.
    pub fn p0(&self, template: &proto_flat::frames::CollectiveFrame, repeat: u32) -> Result<Duration, LoadError> {
        self.run(P0_TEST_PROG, template.as_bytes(), repeat)
    }

    /// The bulk sampling level in force (the shipper writes it; tests wait on it).
    ///
    /// # Errors
    /// The map could not be read.
    pub fn sampling_level(&self) -> Result<u32, LoadError> {
        let raw =
            self.control.get(&0, 0).map_err(|e| LoadError::Kernel { what: CONTROL.into(), detail: e.to_string() })?;
        Ok(SamplingControl::read_from_bytes(&raw).map_or(0, |c| c.bulk_level.get()))
    }

    /// Every (ring, CPU)'s counters now.
    ///
    /// # Errors
    /// The map could not be read.
    pub fn counters(&self) -> Result<Vec<(StreamId, RingCounters)>, LoadError> {
        read_counters(&self.counter_map)
    }

    /// Every interface's packets and bytes now (the overflow's as ifindex 0).
    ///
    /// # Errors
    /// A map could not be read.
    pub fn interfaces(&self) -> Result<Vec<InterfaceEntry>, LoadError> {
        read_interfaces(&self.if_counters, &self.if_overflow)
    }
}

/// A pin directory of its own under `/sys/fs/bpf` (`ringwatch-<tag>-<pid>`), emptied and
/// removed on drop: tests and benchmarks, whose kernel state must not outlive them.
#[derive(Debug)]
pub struct ScratchPins(pub PathBuf);

impl ScratchPins {
    /// A fresh directory for `tag` (anything left from an earlier run of this pid removed).
    #[must_use]
    pub fn new(tag: &str) -> Self {
        let p = PathBuf::from(format!("/sys/fs/bpf/ringwatch-{tag}-{}", std::process::id()));
        let _ = remove_pins(&p);
        Self(p)
    }
}

impl Drop for ScratchPins {
    fn drop(&mut self) {
        let _ = remove_pins(&self.0);
    }
}

/// Removes a pin directory and everything pinned in it (the kernel frees what nothing
/// else holds). Tests and `node-shipper` operators use it to end an epoch on purpose.
///
/// # Errors
/// The directory could not be read or a pin not removed.
pub fn remove_pins(dir: &Path) -> std::io::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)? {
        std::fs::remove_file(e?.path())?;
    }
    std::fs::remove_dir(dir)
}
