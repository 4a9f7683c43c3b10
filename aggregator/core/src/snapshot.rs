//! Snapshots of the core's state: `magic "RWSNAP\0\0" | version u32 | reserved u32 |
//! rkyv archive`. The archive is validated (bytecheck) before anything is restored, so a
//! corrupt or hostile file is an error, never undefined behaviour.
//!
//! The state is the whole [`Core`]: ingest (trackers, watermarks, clocks, liveness,
//! pending settlements, undelivered records) and the matcher (ops in flight, PROGRESS,
//! deadlines, durations, health evidence, undelivered events) and batch dedup (which
//! `(node, shipper_session, batch_seq)` are settled).

use crate::pipeline::Core;

/// First bytes of a snapshot.
pub const SNAPSHOT_MAGIC: [u8; 8] = *b"RWSNAP\0\0";
/// Snapshot format version.
pub const SNAPSHOT_VERSION: u32 = 17; // 2: batch dedup; 3: comm seq gaps; 4: ingest knows it was restored; 5: dedup holes + resume, prior_instance; 6: clock freshness floor, frozen decision times; 7: expected_nodes; 8: PROGRESS recency; 9: recovery of every unfinished rank; 10: implausible batch/resume counts, homes dense + sparse; 11: bounded matcher maps (communicator and process retirement, one deadline per op), retired epochs' trackers, degraded_clear in the matcher's config; 12: aggregator_crash (a ninth loss cause), resume floors of a restored core; 13: owners_turned_away; 14: the core's role, unpublished records, the API mirror; 15: the matcher role's bus liveness; 16: stale bus liveness statements ignored; 17: bus liveness timed by the records' production time

/// Why a snapshot could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("not a ringwatch snapshot")]
    BadMagic,
    #[error("unsupported snapshot version {got} (this build reads {SNAPSHOT_VERSION})")]
    UnsupportedVersion { got: u32 },
    #[error("snapshot too short: {got} bytes")]
    TooShort { got: usize },
    #[error("snapshot archive invalid: {0}")]
    Archive(String),
}

/// Serializes the state.
pub fn write(state: &Core) -> Result<Vec<u8>, SnapshotError> {
    let archive = archive_into(state, rkyv::util::AlignedVec::new())?;
    let mut out = Vec::with_capacity(archive.len().saturating_add(16));
    out.extend_from_slice(&header());
    out.extend_from_slice(&archive);
    Ok(out)
}

/// A snapshot's first 16 bytes (magic, version, reserved); [`archive_into`]'s bytes
/// follow them.
#[must_use]
pub fn header() -> [u8; 16] {
    let mut h = [0; 16];
    h[..8].copy_from_slice(&SNAPSHOT_MAGIC);
    h[8..12].copy_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    h
}

/// Serializes the state's archive into `buf` (cleared first, its capacity reused: a
/// caller that keeps the buffer allocates nothing once it has grown to the state's
/// size); `header()` then the returned bytes are what [`write`] returns.
pub fn archive_into(
    state: &Core,
    mut buf: rkyv::util::AlignedVec<16>,
) -> Result<rkyv::util::AlignedVec<16>, SnapshotError> {
    buf.clear();
    rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(state, buf)
        .map_err(|e| SnapshotError::Archive(e.to_string()))
}

/// Restores a state written by [`write`], at aggregator time `now`: the aggregator's
/// knowledge gap for every node runs from `snapshot_ns` to that node's next batch.
pub fn read(bytes: &[u8], snapshot_ns: u64) -> Result<Core, SnapshotError> {
    let head = bytes.get(..16).ok_or(SnapshotError::TooShort { got: bytes.len() })?;
    if head.get(..8) != Some(&SNAPSHOT_MAGIC[..]) {
        return Err(SnapshotError::BadMagic);
    }
    let version = head.get(8..12).and_then(|v| <[u8; 4]>::try_from(v).ok()).map_or(0, u32::from_le_bytes);
    if version != SNAPSHOT_VERSION {
        return Err(SnapshotError::UnsupportedVersion { got: version });
    }
    // rkyv needs the archive aligned; copy it into an aligned buffer.
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len().saturating_sub(16));
    aligned.extend_from_slice(bytes.get(16..).unwrap_or(&[]));
    let mut state =
        rkyv::from_bytes::<Core, rkyv::rancor::Error>(&aligned).map_err(|e| SnapshotError::Archive(e.to_string()))?;
    state.restart_knowledge(snapshot_ns);
    Ok(state)
}
