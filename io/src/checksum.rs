//! The page checksum: computed when a page's bytes are complete, verified
//! after every read from a lower tier.

/// XXH3-64 of a page's payload (`orbitkv_components::checksum`).
pub use orbitkv_components::checksum::{PageHasher, page_checksum};

/// Bytes copied (then hashed while still in cache) per step of
/// [`copy_with_checksum`].
const FUSED_CHUNK: usize = 64 << 10;

/// Copies `src` into `dst` (same length) and returns the page checksum of
/// the bytes written, in one pass: each chunk is hashed from `dst` right
/// after it is copied, so the checksum covers exactly what landed. Equal to
/// `page_checksum(dst)` afterwards. Always through the cache: the remote
/// tier's writer packs the copy right after (a pool's copy-in streams
/// instead: `orbitkv_components::checksum::copy_checksummed`).
pub fn copy_with_checksum(dst: &mut [u8], src: &[u8]) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_with_checksum: lengths differ");
    let mut hasher = PageHasher::new();
    for (d, s) in dst.chunks_mut(FUSED_CHUNK).zip(src.chunks(FUSED_CHUNK)) {
        d.copy_from_slice(s);
        hasher.update(d);
    }
    hasher.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_copy_checksums_what_it_wrote() {
        for len in [
            0usize,
            1,
            4095,
            FUSED_CHUNK,
            FUSED_CHUNK + 17,
            3 * FUSED_CHUNK,
        ] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
            let mut dst = vec![0u8; len];
            let sum = copy_with_checksum(&mut dst, &src);
            assert_eq!(dst, src);
            assert_eq!(sum, page_checksum(&src), "len {len}");
        }
    }
}
