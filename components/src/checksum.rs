//! The page checksum: XXH3-64 with seed 0 over a page's bytes.
//!
//! One definition for every crate: the publish copy computes it, the
//! manager's copy-in, the tiers and the restore copies verify it, and it is
//! stored with every SSD and remote record. Its digests are XXH3-64's, so
//! they never change with the implementation (the tests below compare them
//! with xxhash-rust's, which wrote the records already on disk).
//!
//! The implementation is twox-hash's, which picks its SIMD kernel when it
//! runs (AVX2 where the CPU has it, else SSE2): a portable build verifies
//! at AVX2 speed on the machines that have it.

use std::hash::Hasher;

/// The page checksum of `bytes`.
#[inline]
pub fn page_checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// A page checksum taken in pieces: `update` with each chunk in order,
/// then `digest` equals [`page_checksum`] of their concatenation.
#[derive(Clone)]
pub struct PageHasher(twox_hash::XxHash3_64);

impl PageHasher {
    pub fn new() -> Self {
        Self(twox_hash::XxHash3_64::with_seed(0))
    }

    /// Starts over, as `new` would.
    pub fn reset(&mut self) {
        *self = Self::new();
    }

    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// The checksum of everything so far; more may follow.
    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

impl Default for PageHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for PageHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PageHasher")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Every length through the short-input paths (0..=240), the first
    /// stripes and blocks, and page sizes: the same digest as xxhash-rust's.
    #[test]
    fn digests_are_xxh3_64() {
        let lens = (0..=1100)
            .chain([
                1023,
                1024,
                1025,
                4095,
                4096,
                16 << 10,
                (64 << 10) + 7,
                2 << 20,
            ])
            .collect::<Vec<_>>();
        for (i, &len) in lens.iter().enumerate() {
            let b = bytes(len, i as u64);
            assert_eq!(
                page_checksum(&b),
                xxhash_rust::xxh3::xxh3_64(&b),
                "len {len}"
            );
        }
        // Known answer: XXH3-64 of the empty input, seed 0.
        assert_eq!(page_checksum(&[]), 0x2D06_8005_38D3_94C2);
    }

    proptest! {
        /// Pieces of any sizes, in order, give the one-shot digest, also
        /// of each prefix along the way; `reset` forgets what came before.
        #[test]
        fn pieces_equal_one_shot(
            len in 0usize..70_000,
            cuts in proptest::collection::vec(0usize..70_000, 0..6),
            seed in any::<u64>(),
        ) {
            let b = bytes(len, seed);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (len + 1)).collect();
            cuts.sort_unstable();
            let mut h = PageHasher::new();
            h.update(b"something before");
            h.reset();
            let mut at = 0;
            for c in cuts.into_iter().chain([len]) {
                h.update(&b[at..c]);
                // A digest along the way (a page copied in pieces reports
                // one after each) changes nothing that follows.
                prop_assert_eq!(h.digest(), xxhash_rust::xxh3::xxh3_64(&b[..c]));
                at = c;
            }
            prop_assert_eq!(h.digest(), xxhash_rust::xxh3::xxh3_64(&b));
            prop_assert_eq!(h.digest(), page_checksum(&b));
        }
    }
}
