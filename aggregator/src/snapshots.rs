//! Periodic snapshots of the core (and the verdict store), restored at start.
//!
//! File layout (little-endian): `magic "RWAGGv2\0" | aggregator_ns u64 | realtime_ns u64 |
//! aggregator_epoch u64 | core_len u64 | core snapshot (ringwatch_core::snapshot) |
//! verdict store (rkyv VerdictStore)`. Written to `PATH.tmp`, fsynced, and renamed over `PATH`
//! (the directory fsynced after), so a crash mid-write leaves the previous snapshot
//! intact. The core and the verdict store are captured in one cut under the core's lock
//! (pending verdicts drained into the store first), cloned, and written after every
//! lock is released ([`crate::snapshot_now`]).
//!
//! Restart semantics (DESIGN): the new instance's `aggregator_epoch` is the stored one + 1
//! (sent in every `hello`); aggregator time continues from the snapshot's, plus the
//! wall-clock time that passed, so the restored clocks, deadlines and watermarks stay
//! meaningful; every node has a knowledge gap from the snapshot's time to its first batch
//! after the restart, and collectives overlapping it are `indeterminate(aggregator_gap)`,
//! never `stuck` or `not_joined`.

use std::path::Path;

use ringwatch_core::{Core, VerdictStore};

/// First bytes of an aggregator snapshot file.
pub const FILE_MAGIC: [u8; 8] = *b"RWAGGv2\0";
const HEAD: usize = 8 + 4 * 8;

/// Why a snapshot could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotFileError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: not an aggregator snapshot (or truncated)")]
    BadFile { path: String },
    #[error("{path}: {source}")]
    Core { path: String, source: ringwatch_core::snapshot::SnapshotError },
    #[error("{path}: verdicts: {msg}")]
    Verdicts { path: String, msg: String },
}

/// What a snapshot file gave back.
#[derive(Debug)]
pub struct Restored {
    pub core: Core,
    pub store: VerdictStore,
    /// The aggregator time the snapshot was taken.
    pub snapshot_ns: u64,
    /// Aggregator time now: the snapshot's plus the wall-clock time since.
    pub now_ns: u64,
    /// The new instance's epoch (stored + 1).
    pub epoch: u64,
}

fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Writes a snapshot of `core` and `store` taken at aggregator time `now_ns`; returns
/// its size.
///
/// # Errors
/// Serialization or file errors.
pub fn save(
    path: &Path,
    core: &Core,
    store: &VerdictStore,
    now_ns: u64,
    epoch: u64,
) -> Result<usize, SnapshotFileError> {
    let p = path.display().to_string();
    let core_bytes =
        ringwatch_core::snapshot::write(core).map_err(|source| SnapshotFileError::Core { path: p.clone(), source })?;
    let verdict_bytes = rkyv::to_bytes::<rkyv::rancor::Error>(store)
        .map_err(|e| SnapshotFileError::Verdicts { path: p.clone(), msg: e.to_string() })?;
    let mut out = Vec::with_capacity(HEAD + core_bytes.len() + verdict_bytes.len());
    out.extend_from_slice(&FILE_MAGIC);
    for v in [now_ns, realtime_ns(), epoch, core_bytes.len() as u64] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&core_bytes);
    out.extend_from_slice(&verdict_bytes);
    let tmp = path.with_extension("tmp");
    let io = |source| SnapshotFileError::Io { path: p.clone(), source };
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&out).map_err(io)?;
        // Durable before it replaces the previous snapshot.
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    // The rename itself is durable once the directory is synced.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    }
    Ok(out.len())
}

/// Reads the snapshot at `path`; `Ok(None)` when there is none (a first start).
///
/// # Errors
/// A file that exists but cannot be read or does not validate: the operator must look
/// (starting empty would silently forget the dedup state and the knowledge gap).
pub fn load(path: &Path) -> Result<Option<Restored>, SnapshotFileError> {
    let p = path.display().to_string();
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(SnapshotFileError::Io { path: p, source }),
    };
    let bad = || SnapshotFileError::BadFile { path: p.clone() };
    if bytes.get(..8) != Some(&FILE_MAGIC[..]) {
        return Err(bad());
    }
    let word =
        |i: usize| bytes.get(8 + i * 8..16 + i * 8).and_then(|w| <[u8; 8]>::try_from(w).ok()).map(u64::from_le_bytes);
    let (Some(snapshot_ns), Some(then_real), Some(epoch), Some(core_len)) = (word(0), word(1), word(2), word(3)) else {
        return Err(bad());
    };
    let core_end = HEAD.checked_add(usize::try_from(core_len).map_err(|_| bad())?).ok_or_else(bad)?;
    let core_bytes = bytes.get(HEAD..core_end).ok_or_else(bad)?;
    let core = ringwatch_core::snapshot::read(core_bytes, snapshot_ns)
        .map_err(|source| SnapshotFileError::Core { path: p.clone(), source })?;
    let mut aligned = rkyv::util::AlignedVec::<16>::new();
    aligned.extend_from_slice(bytes.get(core_end..).unwrap_or(&[]));
    let store = rkyv::from_bytes::<VerdictStore, rkyv::rancor::Error>(&aligned)
        .map_err(|e| SnapshotFileError::Verdicts { path: p.clone(), msg: e.to_string() })?;
    let now_ns = snapshot_ns.saturating_add(realtime_ns().saturating_sub(then_real));
    Ok(Some(Restored { core, store, snapshot_ns, now_ns, epoch: epoch.saturating_add(1) }))
}
