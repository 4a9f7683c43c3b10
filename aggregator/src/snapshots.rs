//! Periodic snapshots of the core (and the verdict store), restored at start.
//!
//! File layout (little-endian): `magic "RWAGGv2\0" | aggregator_ns u64 | realtime_ns u64 |
//! aggregator_epoch u64 | core_len u64 | core snapshot (ringwatch_core::snapshot) |
//! verdict store (rkyv VerdictStore)`. Written to `PATH.tmp`, fsynced, and renamed over `PATH`
//! (the directory fsynced after), so a crash mid-write leaves the previous snapshot
//! intact. The core and the verdict store are captured in one cut under the core's lock
//! (pending verdicts drained into the store first): both are serialized there, into
//! buffers the aggregator keeps from one snapshot to the next ([`Buffers`]: nothing is
//! cloned and, once they have grown, nothing allocated), and the file is written after
//! every lock is released ([`crate::snapshot_now`]).
//!
//! Restart semantics (docs/design.md, "Restart semantics"): the new instance's
//! `aggregator_epoch` is the stored one + 1 (sent in every `hello`); aggregator time
//! continues from the snapshot's, plus the wall-clock time that passed, so the restored
//! clocks, deadlines and watermarks stay meaningful; every node has a knowledge gap from
//! the snapshot's time to its first batch after the restart, and collectives overlapping
//! it are `indeterminate(aggregator_gap)`, never `stuck` or `not_joined`.

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
    /// A readable snapshot of another format version (the header says so; the rest is
    /// not read). The caller starts fresh in its place: these are the header's facts.
    #[error("{path}: snapshot format version {found}, this build reads {}", ringwatch_core::snapshot::SNAPSHOT_VERSION)]
    Version { path: String, found: u32, snapshot_ns: u64, now_ns: u64, epoch: u64 },
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

/// One snapshot's serialized parts, kept from one snapshot to the next: each buffer is
/// cleared and refilled, so a steady state allocates nothing per snapshot (a fresh
/// buffer per snapshot, freed after the write, fragmented the heap: the RSS crept up while
/// the live heap stayed flat).
#[derive(Debug, Default)]
pub struct Buffers {
    core: rkyv::util::AlignedVec<16>,
    store: rkyv::util::AlignedVec<16>,
    /// Aggregator time and epoch of the cut in the buffers.
    now_ns: u64,
    epoch: u64,
}

impl Buffers {
    /// Serializes `core` and `store` (one cut: the caller holds what keeps them
    /// consistent) taken at aggregator time `now_ns`.
    ///
    /// # Errors
    /// Serialization errors (`path` names the snapshot in them).
    pub fn capture(
        &mut self,
        path: &Path,
        core: &Core,
        store: &VerdictStore,
        now_ns: u64,
        epoch: u64,
    ) -> Result<(), SnapshotFileError> {
        let p = || path.display().to_string();
        self.core = ringwatch_core::snapshot::archive_into(core, std::mem::take(&mut self.core))
            .map_err(|source| SnapshotFileError::Core { path: p(), source })?;
        let mut buf = std::mem::take(&mut self.store);
        buf.clear();
        self.store = rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(store, buf)
            .map_err(|e| SnapshotFileError::Verdicts { path: p(), msg: e.to_string() })?;
        self.now_ns = now_ns;
        self.epoch = epoch;
        Ok(())
    }

    /// The captured sizes' sum, as the file holds them.
    #[must_use]
    pub fn file_len(&self) -> usize {
        HEAD + 16 + self.core.len() + self.store.len()
    }
}

/// Writes the snapshot captured in `b` to `path`; returns its size.
///
/// # Errors
/// File errors.
pub fn write_captured(path: &Path, b: &Buffers) -> Result<usize, SnapshotFileError> {
    let p = path.display().to_string();
    let core_len = 16 + b.core.len();
    let mut head = Vec::with_capacity(HEAD + 16);
    head.extend_from_slice(&FILE_MAGIC);
    for v in [b.now_ns, realtime_ns(), b.epoch, core_len as u64] {
        head.extend_from_slice(&v.to_le_bytes());
    }
    head.extend_from_slice(&ringwatch_core::snapshot::header());
    let tmp = path.with_extension("tmp");
    let io = |source| SnapshotFileError::Io { path: p.clone(), source };
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(&head).map_err(io)?;
        f.write_all(&b.core).map_err(io)?;
        f.write_all(&b.store).map_err(io)?;
        // Durable before it replaces the previous snapshot.
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    // The rename itself is durable once the directory is synced.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    }
    Ok(b.file_len())
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
    let now_ns = snapshot_ns.saturating_add(realtime_ns().saturating_sub(then_real));
    let core = ringwatch_core::snapshot::read(core_bytes, snapshot_ns).map_err(|source| match source {
        ringwatch_core::snapshot::SnapshotError::UnsupportedVersion { got } => SnapshotFileError::Version {
            path: p.clone(),
            found: got,
            snapshot_ns,
            now_ns,
            epoch: epoch.saturating_add(1),
        },
        source => SnapshotFileError::Core { path: p.clone(), source },
    })?;
    let mut aligned = rkyv::util::AlignedVec::<16>::new();
    aligned.extend_from_slice(bytes.get(core_end..).unwrap_or(&[]));
    let store = rkyv::from_bytes::<VerdictStore, rkyv::rancor::Error>(&aligned)
        .map_err(|e| SnapshotFileError::Verdicts { path: p.clone(), msg: e.to_string() })?;
    Ok(Some(Restored { core, store, snapshot_ns, now_ns, epoch: epoch.saturating_add(1) }))
}

/// Moves a snapshot this build cannot read to `PATH.v<found>` (numbered further if that
/// exists), so the next snapshot does not overwrite it and an operator can still take it
/// to a build that reads it. Returns where it went.
///
/// # Errors
/// The rename failed.
pub fn set_aside(path: &Path, found: u32) -> Result<std::path::PathBuf, SnapshotFileError> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut aside = path.with_file_name(format!("{name}.v{found}"));
    let mut n = 1u32;
    while aside.exists() {
        aside = path.with_file_name(format!("{name}.v{found}.{n}"));
        n = n.saturating_add(1);
    }
    std::fs::rename(path, &aside)
        .map_err(|source| SnapshotFileError::Io { path: path.display().to_string(), source })?;
    Ok(aside)
}

#[cfg(test)]
mod tests {
    use ringwatch_core::records::{Comm, NodeId};
    use ringwatch_core::verdict::{Evidence, MatcherEvent, OpRef, Outcome, Verdict};
    use ringwatch_core::{IngestConfig, MatcherConfig, StoreConfig};

    use super::*;

    fn store_with(ops: u64) -> VerdictStore {
        let mut s = VerdictStore::new(StoreConfig::default());
        let events = (1..=ops).flat_map(|seq| {
            (0..4u32).map(move |rank| {
                MatcherEvent::Verdict(Verdict {
                    op: OpRef::Coll { comm: Comm { hash: 7, disambiguator: 0, instance: 1 }, seq },
                    rank,
                    node: Some(NodeId(u64::from(rank))),
                    gpu_uuid: [0; 16],
                    outcome: if rank == 1 { Outcome::Stuck } else { Outcome::WaitingOn(Some(1)) },
                    tags: Vec::new(),
                    is_final: true,
                    decided_at_ns: seq,
                    evidence: Evidence::default(),
                    revision: 0,
                })
            })
        });
        s.apply(1_000, events);
        s
    }

    /// The buffers kept from one snapshot to the next: each capture replaces the last one
    /// whole (a smaller state after a larger one leaves nothing of the larger behind), and
    /// what is written loads back equal.
    #[test]
    fn reused_buffers_write_each_snapshot_whole() {
        let dir = std::env::temp_dir().join(format!("ringwatch-snapshots-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("agg.snap");
        let core = Core::new(IngestConfig::default(), MatcherConfig::default(), 0);
        let mut b = Buffers::default();
        for (ops, now) in [(500, 5_000_000_000), (3, 6_000_000_000)] {
            let store = store_with(ops);
            b.capture(&path, &core, &store, now, 4).unwrap();
            let len = write_captured(&path, &b).unwrap();
            assert_eq!(len, usize::try_from(std::fs::metadata(&path).unwrap().len()).unwrap());
            let r = load(&path).unwrap().unwrap();
            assert_eq!(r.store, store, "{ops} ops");
            assert_eq!(r.snapshot_ns, now);
            assert_eq!(r.epoch, 5);
            assert_eq!(r.core.stats(), core.stats());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
