//! Which ingest shard a shipper talks to (issue 28): rendezvous (highest random weight)
//! hashing of its node name over the shard list. Every shipper picks alone, from its
//! own configuration; adding or removing a shard moves only the nodes that shard gains
//! or loses. The hash is fixed (FNV-1a, then SplitMix64's finalizer), so the choice is
//! the same on every machine and build.

fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The weight of `candidate` for `key`.
#[must_use]
pub fn weight(key: &str, candidate: &str) -> u64 {
    mix64(fnv1a(key.bytes().chain([0xff]).chain(candidate.bytes())))
}

/// The candidate `key` goes to: the one of highest weight (ties: the first). `None`
/// for an empty list.
#[must_use]
pub fn rendezvous<'a, S: AsRef<str>>(key: &str, candidates: &'a [S]) -> Option<&'a S> {
    candidates.iter().enumerate().max_by_key(|(i, c)| (weight(key, c.as_ref()), std::cmp::Reverse(*i))).map(|(_, c)| c)
}

/// Every candidate, in `key`'s rendezvous order (highest weight first; ties: list
/// order): the first is [`rendezvous`]'s pick, the next is where `key` goes when the
/// first is gone, and so on — the same order the first pick has once a shard is removed.
#[must_use]
pub fn rendezvous_order<'a, S: AsRef<str>>(key: &str, candidates: &'a [S]) -> Vec<&'a S> {
    let mut v: Vec<(usize, &S)> = candidates.iter().enumerate().collect();
    v.sort_by_key(|(i, c)| (std::cmp::Reverse(weight(key, c.as_ref())), *i));
    v.into_iter().map(|(_, c)| c).collect()
}

#[cfg(test)]
mod tests {
    use super::{rendezvous, rendezvous_order};

    #[test]
    fn the_order_starts_with_the_pick_and_its_next_is_the_pick_without_the_first() {
        let three = ["a:1", "b:1", "c:1"];
        for n in 0..500 {
            let node = format!("node-{n}");
            let order = rendezvous_order(&node, &three);
            assert_eq!(order.len(), 3);
            assert_eq!(order[0], rendezvous(&node, &three).unwrap());
            let without: Vec<&str> = three.iter().copied().filter(|c| c != order[0]).collect();
            assert_eq!(*order[1], *rendezvous(&node, &without).unwrap(), "{node}");
        }
        assert!(rendezvous_order::<&str>("x", &[]).is_empty());
    }

    #[test]
    fn nodes_spread_and_a_removed_shard_moves_only_its_own() {
        let three = ["a:1", "b:1", "c:1"];
        let two = ["a:1", "b:1"];
        let mut hits = [0; 3];
        for n in 0..3000 {
            let node = format!("node-{n}");
            let before = rendezvous(&node, &three).unwrap();
            hits[three.iter().position(|c| c == before).unwrap()] += 1;
            let after = rendezvous(&node, &two).unwrap();
            if *before != "c:1" {
                assert_eq!(before, after, "{node} stays where it was");
            }
        }
        assert!(hits.iter().all(|&h| h > 800), "roughly even: {hits:?}");
        assert_eq!(rendezvous::<&str>("x", &[]), None);
        assert_eq!(rendezvous("x", &["only"]), Some(&"only"));
    }
}
