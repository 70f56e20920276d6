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

// Fused copies: every page copy hashes the bytes in the same pass, each
// chunk while it is in cache.
//
// A copy this long or longer streams its writes past the cache
// (non-temporal stores): the destination is a pool slot, a staging slot or
// an engine buffer that nobody reads back within the copy, and an ordinary
// store first reads every destination line it writes. Measured on a 2-core
// VM (2026-12): copying and hashing 1 GiB ran at 4.3-4.8 GB/s per thread
// with cached stores and 5.3-7.4 GB/s streamed, and the 2 MiB save of
// `bridge/bench/lmcache_peer.py` went from 0.56-0.63x LMCache's to
// 0.66-0.74x. Shorter copies keep the cache: a small page is often read
// again soon.

/// Copies at least this long bypass the cache on their way out.
pub const STREAM_MIN: usize = 256 << 10;

/// Chunk of a cached fused copy: copied, then hashed while in cache.
const CHUNK: usize = 64 << 10;

/// Bounce buffer of a streamed copy that hashes what it writes: small
/// enough to stay in L1/L2 between its three touches.
const BOUNCE: usize = 16 << 10;

/// Copies `len` bytes from `src` to `dst` and feeds `h` exactly the bytes
/// written, even if `src` changes meanwhile (a staging area stays writable
/// by its engine): each chunk is copied, then hashed from where it landed
/// (or, streamed, from a bounce buffer that is then written out).
///
/// # Safety
/// `src` and `dst` must be valid for `len` bytes and must not overlap.
pub unsafe fn copy_hashing_written(src: *const u8, dst: *mut u8, len: usize, h: &mut PageHasher) {
    if len >= STREAM_MIN && stream::available() {
        let mut bounce = [0u8; BOUNCE];
        let mut at = 0;
        while at < len {
            let n = BOUNCE.min(len - at);
            // SAFETY: in bounds by the caller's contract; the bounce buffer
            // is ours and holds `n` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(src.add(at), bounce.as_mut_ptr(), n);
                h.update(&bounce[..n]);
                stream::copy(bounce.as_ptr(), dst.add(at), n);
            }
            at += n;
        }
        stream::fence();
        return;
    }
    let mut at = 0;
    while at < len {
        let n = CHUNK.min(len - at);
        // SAFETY: in bounds by the caller's contract; non-overlapping.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n);
            h.update(std::slice::from_raw_parts(dst.add(at), n));
        }
        at += n;
    }
}

/// Copies `len` bytes from `src` to `dst` and feeds `h` the bytes read,
/// each chunk right after it was read (still in cache): one pass over the
/// source. A restore verifies a pool page this way, whose bytes no engine
/// can change.
///
/// # Safety
/// `src` and `dst` must be valid for `len` bytes and must not overlap.
pub unsafe fn copy_hashing_read(src: *const u8, dst: *mut u8, len: usize, h: &mut PageHasher) {
    let streamed = len >= STREAM_MIN && stream::available();
    let mut at = 0;
    while at < len {
        let n = CHUNK.min(len - at);
        // SAFETY: in bounds by the caller's contract; non-overlapping.
        unsafe {
            if streamed {
                stream::copy(src.add(at), dst.add(at), n);
            } else {
                std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n);
            }
            h.update(std::slice::from_raw_parts(src.add(at), n));
        }
        at += n;
    }
    if streamed {
        stream::fence();
    }
}

/// [`copy_hashing_written`] between slices of one length; returns the
/// page checksum of what `dst` now holds.
pub fn copy_checksummed(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_checksummed: lengths differ");
    let mut h = PageHasher::new();
    // SAFETY: both slices hold `len` bytes; a `&mut` cannot alias a `&`.
    unsafe { copy_hashing_written(src.as_ptr(), dst.as_mut_ptr(), dst.len(), &mut h) };
    h.digest()
}

/// Non-temporal copies: AVX2 stores that bypass the cache, where the CPU
/// has AVX2 (checked once, at run time: builds are portable).
mod stream {
    #[cfg(target_arch = "x86_64")]
    pub fn available() -> bool {
        std::is_x86_feature_detected!("avx2")
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn available() -> bool {
        false
    }

    /// Orders this thread's streamed stores before whatever it does next
    /// (the completion it reports): they are weakly ordered otherwise.
    #[cfg(target_arch = "x86_64")]
    pub fn fence() {
        // SAFETY: SSE2 is part of x86_64.
        unsafe { std::arch::x86_64::_mm_sfence() }
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub fn fence() {}

    /// Copies `len` bytes with streamed stores (the unaligned head and
    /// the tail with ordinary ones).
    ///
    /// # Safety
    /// `available()` returned true; `src` and `dst` are valid for `len`
    /// bytes and do not overlap.
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: the caller checked AVX2 and the ranges.
        unsafe { copy_avx2(src, dst, len) }
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn copy_avx2(src: *const u8, dst: *mut u8, len: usize) {
        use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256};
        let head = dst.align_offset(32).min(len);
        // SAFETY (every block below): offsets stay below `len`, within the
        // caller's ranges; stores from `head` on are 32-byte aligned.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let mut at = head;
        while at + 128 <= len {
            unsafe {
                let s = src.add(at) as *const __m256i;
                let d = dst.add(at) as *mut __m256i;
                let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
                let (c, e) = (_mm256_loadu_si256(s.add(2)), _mm256_loadu_si256(s.add(3)));
                _mm256_stream_si256(d, a);
                _mm256_stream_si256(d.add(1), b);
                _mm256_stream_si256(d.add(2), c);
                _mm256_stream_si256(d.add(3), e);
            }
            at += 128;
        }
        while at + 32 <= len {
            unsafe {
                let v = _mm256_loadu_si256(src.add(at) as *const __m256i);
                _mm256_stream_si256(dst.add(at) as *mut __m256i, v);
            }
            at += 32;
        }
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at) };
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

    /// Both fused copies, cached and streamed (from `STREAM_MIN` on), at
    /// every alignment of either side and lengths that leave heads and
    /// tails: the destination holds the source exactly, the bytes around
    /// it are untouched, and the digest is the page checksum.
    #[test]
    fn fused_copies_land_exactly_and_digest_it() {
        let lens = [
            0,
            1,
            31,
            4095,
            CHUNK + 17,
            STREAM_MIN - 1,
            STREAM_MIN,
            STREAM_MIN + 129,
            (2 << 20) + 3,
        ];
        for (i, &len) in lens.iter().enumerate() {
            let src = bytes(len + 64, i as u64);
            for (s_off, d_off) in [(0, 0), (3, 0), (0, 5), (7, 33), (32, 32)] {
                let want = &src[s_off..s_off + len];
                for written in [true, false] {
                    let mut dst = vec![0xa5u8; len + 128];
                    let mut h = PageHasher::new();
                    let at = dst[d_off..].as_mut_ptr();
                    // SAFETY: both ranges hold `len` bytes and are disjoint.
                    unsafe {
                        if written {
                            copy_hashing_written(want.as_ptr(), at, len, &mut h);
                        } else {
                            copy_hashing_read(want.as_ptr(), at, len, &mut h);
                        }
                    }
                    let what = format!("written {written}, len {len}, offsets {s_off}/{d_off}");
                    assert_eq!(h.digest(), page_checksum(want), "{what}");
                    assert_eq!(&dst[d_off..d_off + len], want, "{what}");
                    let around = dst[..d_off].iter().chain(&dst[d_off + len..]);
                    assert!(around.into_iter().all(|&b| b == 0xa5), "{what}");
                }
                let mut dst = vec![0u8; len];
                assert_eq!(copy_checksummed(&mut dst, want), page_checksum(want));
                assert_eq!(dst, want);
            }
        }
    }
}
