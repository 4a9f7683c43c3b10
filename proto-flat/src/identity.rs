//! A node's wire identity.
//!
//! A node's name is the DNS SAN of its client certificate; its `node_id` (in every batch
//! envelope) is the first 8 bytes of SHA-256(name), read big-endian. The shipper stamps
//! it, the aggregator recomputes it from the certificate and refuses a batch whose
//! `node_id` disagrees (`nack node_mismatch`).

use sha2::{Digest, Sha256};

/// `node_id` of the node named `name`.
#[must_use]
pub fn node_id_of(name: &str) -> u64 {
    let digest = Sha256::digest(name.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(digest.get(..8).unwrap_or(&[0; 8]));
    u64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_eight_bytes_of_sha256_big_endian() {
        // `printf node-00 | sha256sum` = 390d87d849b58183 95fa…
        assert_eq!(node_id_of("node-00"), 0x390d_87d8_49b5_8183);
        assert_ne!(node_id_of("node-00"), node_id_of("node-01"));
    }
}
