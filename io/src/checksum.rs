//! The page checksum: computed when a page's bytes are complete, verified
//! after every read from a lower tier.

/// XXH3-64 of a page's payload.
pub fn page_checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}
