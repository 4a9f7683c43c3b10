//! The shipper's memory budget from its cgroup's limit (pure: the limit is an argument;
//! reading it is `ringwatch_transport::memcg`).
//!
//! What the shipper holds that grows with load is the spool and the reader's queue. Both
//! caps are derived from the limit: `available = limit − ring memory − transport − pools −
//! headroom`, where the transport is QUIC's connection send window (quinn holds a copy
//! of every batch written until it is acked), the pools are the recycled batch buffers
//! (the core's and the reader's, each at its byte cap) and the headroom is the process
//! itself (code, runtime, TLS, allocator slack); the reader queue gets
//! an eighth of it (at most its configured cap), the spool the rest (at most
//! `spool_bytes`: configuration can only lower the cap). The P0/P1 reserves plus two
//! batches are the floor: a cgroup that cannot hold them is a configuration error, with
//! the numbers.

/// What the budget is derived from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetInput {
    /// The cgroup's memory limit (`None`: no limit).
    pub limit_bytes: Option<u64>,
    /// BPF ring memory, charged to the cgroup that created the rings.
    pub ring_bytes: u64,
    /// QUIC's connection send window: batch copies quinn holds until acked.
    pub transport_bytes: u64,
    /// Both buffer pools at their byte caps.
    pub pool_bytes: u64,
    /// The process itself: code, runtime, TLS, allocator slack.
    pub headroom_bytes: u64,
    /// `spool_bytes` from the configuration: the ceiling.
    pub spool_ceiling: u64,
    /// The reader queue's configured cap: its ceiling.
    pub queue_ceiling: u64,
    /// Both reserves plus two of the largest batch: what the spool must hold.
    pub spool_floor: u64,
}

/// The caps in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Budget {
    pub limit_bytes: Option<u64>,
    /// What the limit leaves for the spool and the reader queue.
    pub available_bytes: Option<u64>,
    pub spool_cap_bytes: u64,
    pub reader_queue_cap_bytes: u64,
}

/// The cgroup cannot hold the floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the memory limit ({limit} bytes) less ring memory ({rings}), QUIC's send window ({transport}), the buffer pools \
     ({pools}) and headroom ({headroom}) leaves {available} bytes; the spool needs at least {floor} (both reserves \
     plus two batches) and the reader queue {queue_floor}: raise the cgroup's limit or lower p0_reserve_bytes / \
     p1_reserve_bytes / memory_headroom_bytes / the ring sizes"
)]
pub struct TooSmall {
    pub limit: u64,
    pub rings: u64,
    pub transport: u64,
    pub pools: u64,
    pub headroom: u64,
    pub available: u64,
    pub floor: u64,
    pub queue_floor: u64,
}

/// The reader queue's least cap (a few of the largest batches in flight to the core).
pub const QUEUE_FLOOR: u64 = 2 << 20;

/// Derives the caps.
///
/// # Errors
/// The limit leaves less than the spool's floor plus [`QUEUE_FLOOR`].
pub fn derive(i: BudgetInput) -> Result<Budget, TooSmall> {
    let Some(limit) = i.limit_bytes else {
        return Ok(Budget {
            limit_bytes: None,
            available_bytes: None,
            spool_cap_bytes: i.spool_ceiling,
            reader_queue_cap_bytes: i.queue_ceiling,
        });
    };
    let available = limit
        .saturating_sub(i.ring_bytes)
        .saturating_sub(i.transport_bytes)
        .saturating_sub(i.pool_bytes)
        .saturating_sub(i.headroom_bytes);
    let queue = (available / 8).clamp(QUEUE_FLOOR.min(i.queue_ceiling), i.queue_ceiling.max(1));
    let spool = available.saturating_sub(queue).min(i.spool_ceiling);
    if spool < i.spool_floor {
        return Err(TooSmall {
            limit,
            rings: i.ring_bytes,
            transport: i.transport_bytes,
            pools: i.pool_bytes,
            headroom: i.headroom_bytes,
            available,
            floor: i.spool_floor,
            queue_floor: QUEUE_FLOOR.min(i.queue_ceiling),
        });
    }
    Ok(Budget {
        limit_bytes: Some(limit),
        available_bytes: Some(available),
        spool_cap_bytes: spool,
        reader_queue_cap_bytes: queue,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn input(limit: Option<u64>) -> BudgetInput {
        BudgetInput {
            limit_bytes: limit,
            ring_bytes: 0,
            transport_bytes: 0,
            pool_bytes: 0,
            headroom_bytes: 24 * MIB,
            spool_ceiling: 256 * MIB,
            queue_ceiling: 64 * MIB,
            spool_floor: 4 * MIB + 512 * 1024,
        }
    }

    #[test]
    fn without_a_limit_the_configured_caps_stand() {
        let b = derive(input(None)).unwrap();
        assert_eq!((b.spool_cap_bytes, b.reader_queue_cap_bytes, b.available_bytes), (256 * MIB, 64 * MIB, None));
    }

    #[test]
    fn a_limit_shares_what_is_left_after_rings_and_headroom() {
        // 64 MiB − 24 headroom = 40: queue 5, spool 35.
        let b = derive(input(Some(64 * MIB))).unwrap();
        assert_eq!(
            (b.available_bytes, b.reader_queue_cap_bytes, b.spool_cap_bytes),
            (Some(40 * MIB), 5 * MIB, 35 * MIB)
        );
        // So do QUIC's send window and the buffer pools.
        let b =
            derive(BudgetInput { transport_bytes: 10 * MIB, pool_bytes: 6 * MIB, ..input(Some(64 * MIB)) }).unwrap();
        assert_eq!(
            (b.available_bytes, b.reader_queue_cap_bytes, b.spool_cap_bytes),
            (Some(24 * MIB), 3 * MIB, 21 * MIB)
        );
        // Rings come off first.
        let b = derive(BudgetInput { ring_bytes: 16 * MIB, ..input(Some(64 * MIB)) }).unwrap();
        assert_eq!((b.reader_queue_cap_bytes, b.spool_cap_bytes), (3 * MIB, 21 * MIB));
        // A large limit: the configuration's caps are ceilings.
        let b = derive(input(Some(64 << 30))).unwrap();
        assert_eq!((b.reader_queue_cap_bytes, b.spool_cap_bytes), (64 * MIB, 256 * MIB));
        // Small: the queue keeps its floor.
        let b = derive(input(Some(32 * MIB))).unwrap();
        assert_eq!((b.reader_queue_cap_bytes, b.spool_cap_bytes), (QUEUE_FLOOR, 6 * MIB));
    }

    #[test]
    fn a_limit_below_the_floor_is_refused_with_the_numbers() {
        let e = derive(input(Some(28 * MIB))).unwrap_err();
        assert_eq!((e.available, e.floor, e.limit), (4 * MIB, 4 * MIB + 512 * 1024, 28 * MIB));
        let text = e.to_string();
        for n in ["29360128", "4194304", "4718592", "25165824"] {
            assert!(text.contains(n), "{n} in {text}");
        }
        // The transport and the pools are named.
        let e = derive(BudgetInput { transport_bytes: 10 * MIB, pool_bytes: 8 * MIB, ..input(Some(44 * MIB)) })
            .unwrap_err();
        assert_eq!(e.available, 2 * MIB);
        for n in ["QUIC's send window (10485760)", "buffer pools (8388608)"] {
            assert!(e.to_string().contains(n), "{n} in {e}");
        }
        // A limit below the rings and headroom together does not wrap.
        assert_eq!(derive(BudgetInput { ring_bytes: 1 << 40, ..input(Some(64 * MIB)) }).unwrap_err().available, 0);
    }
}
