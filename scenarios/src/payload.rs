//! Deterministic page contents: the bytes a key legitimately holds are a
//! pure function of the key, so a replay can check every restored byte.

use orbitkv_components::StateKey;

/// The payload of `key`, `len` bytes long.
pub fn payload(key: &StateKey, len: u64) -> Vec<u8> {
    let mut state = xxhash_rust::xxh3::xxh3_64(&key.encode());
    let mut out = Vec::with_capacity(len as usize);
    while (out.len() as u64) < len {
        // splitmix64: fast, and every 8-byte word differs.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let take = (len as usize - out.len()).min(8);
        out.extend_from_slice(&z.to_le_bytes()[..take]);
    }
    out
}
