//! [`StateKey`]: the one key type of every tier, the wire and the traces.
//!
//! Byte layout of [`StateKey::encode`] (integers little-endian):
//!
//! ```text
//! key   := key_version:u8 (=1) ‖ namespace[32] ‖ hash
//! hash  := hash_version:u8 (=1) ‖ group:u32 ‖ len:u16 ‖ native[len]
//! ```
//!
//! `native` is the engine's own chained prefix hash for the page (vLLM's block
//! hash bytes, SGLang's page hash), 1..=[`MAX_NATIVE_HASH_BYTES`] bytes. The
//! group is always present, group 0 included, so a window page and a prefix
//! page with the same native hash never collide. Engines stay in separate
//! domains because the engine is part of the namespace's identity.

use std::fmt;
use std::hash::{Hash, Hasher};

use serde::{Deserialize, Serialize};

use crate::encoding::{Digest32, Frame, put_str, put_u32, put_u64};
use crate::namespace::Namespace;

pub const KEY_VERSION: u8 = 1;
pub const HASH_VERSION: u8 = 1;
pub const MAX_NATIVE_HASH_BYTES: usize = 64;
const HEADER_BYTES: usize = 1 + 32 + 1 + 4 + 2;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("native hash is empty")]
    EmptyHash,
    #[error("native hash is {0} bytes; at most {MAX_NATIVE_HASH_BYTES} are allowed")]
    HashTooLong(usize),
    #[error("state key is {0} bytes; too short")]
    Truncated(usize),
    #[error("unsupported state key version {0}")]
    KeyVersion(u8),
    #[error("unsupported hash version {0}")]
    HashVersion(u8),
    #[error("state key declares {declared} hash bytes but carries {actual}")]
    LengthMismatch { declared: usize, actual: usize },
    #[error("state key has an empty namespace")]
    EmptyNamespace,
}

/// An engine-native chained prefix hash, stored inline so keys are `Copy`.
///
/// Bytes past `len` are always zero (`new` is the only constructor), so the
/// derived order agrees with the used-bytes equality below.
#[derive(Clone, Copy, PartialOrd, Ord)]
pub struct NativeHash {
    len: u8,
    bytes: [u8; MAX_NATIVE_HASH_BYTES],
}

impl NativeHash {
    #[inline]
    pub fn new(bytes: &[u8]) -> Result<Self, KeyError> {
        let mut out = [0u8; MAX_NATIVE_HASH_BYTES];
        // The lengths engines send (SHA-256 digests, 64-bit ids) copy as
        // fixed-size moves; a length-generic copy is a `memcpy` call, paid
        // per page of every query on both sides of the wire.
        match bytes.len() {
            0 => return Err(KeyError::EmptyHash),
            32 => out[..32].copy_from_slice(bytes),
            8 => out[..8].copy_from_slice(bytes),
            n if n > MAX_NATIVE_HASH_BYTES => return Err(KeyError::HashTooLong(n)),
            n => out[..n].copy_from_slice(bytes),
        }
        Ok(NativeHash {
            len: bytes.len() as u8,
            bytes: out,
        })
    }

    /// An integer hash (vLLM's builtin hash, SGLang's int ids) as 8 LE bytes.
    pub fn from_u64(v: u64) -> Self {
        Self::new(&v.to_le_bytes()).expect("8 bytes fit")
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

// Equality and hashing look at the used bytes only: engine hashes are 8-32
// bytes, and the inline buffer holds 64. Equality compares fixed-size
// words (the first 32 bytes, or all 64), which means the same (bytes past
// `len` are zero in both) and compiles to a few vector compares instead of
// a `memcmp` call.
impl PartialEq for NativeHash {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        if self.len != other.len {
            return false;
        }
        // Hashes of at most 32 bytes (every engine's) differ, if at all,
        // in their first 32: half the compare.
        if self.len <= 32
            && let (Some(a), Some(b)) = (
                self.bytes.first_chunk::<32>(),
                other.bytes.first_chunk::<32>(),
            )
        {
            return crate::encoding::eq_words(a, b);
        }
        crate::encoding::eq_words(&self.bytes, &other.bytes)
    }
}

impl Eq for NativeHash {}

impl Hash for NativeHash {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // No length prefix: equal bytes imply equal length, and a collision
        // between lengths is only a collision.
        state.write(self.as_bytes());
    }
}

/// Serialized as lowercase hex.
impl Serialize for NativeHash {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(self.as_bytes()))
    }
}

impl<'de> Deserialize<'de> for NativeHash {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let bytes = hex::decode(&s).map_err(serde::de::Error::custom)?;
        NativeHash::new(&bytes).map_err(serde::de::Error::custom)
    }
}

impl fmt::Debug for NativeHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NativeHash({})", hex::encode(self.as_bytes()))
    }
}

/// A stored page's identity: the namespace it was computed under, the cache
/// group, and the engine's chained prefix hash.
///
/// Hashing feeds 8 bytes of the namespace digest (already uniformly
/// distributed), the group and the used native bytes, so a lookup hashes
/// 20-44 bytes instead of ~100; equality still compares every field. Maps
/// keyed by it use [`KeyMap`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StateKey {
    pub namespace: Namespace,
    pub group: u32,
    pub native: NativeHash,
}

impl Hash for StateKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        hash_parts(&self.namespace, self.group, &self.native, state);
    }
}

/// What `StateKey` and `KeyRef` hash: they must agree. The namespace's
/// first 8 bytes (a digest's, uniform) and the group in one word; the
/// native hash as 1, 2 or 4 zero-padded words for up to 8, 16 or 32 bytes
/// (bytes past `len` are zero, and equal keys have equal lengths), longer
/// ones as bytes.
fn hash_parts<H: Hasher>(namespace: &Namespace, group: u32, native: &NativeHash, state: &mut H) {
    let ns = &namespace.0;
    let ns = u64::from_le_bytes([ns[0], ns[1], ns[2], ns[3], ns[4], ns[5], ns[6], ns[7]]);
    // Whole words, two at a time (the key hasher mixes 128 bits in one
    // step), not the hasher's slice loop: discovery hashes every page of a
    // query.
    // Every used byte is hashed, so a client cannot collide keys by
    // varying bytes the hash skips.
    let words = match native.len {
        0..=8 => 1,
        9..=16 => 2,
        17..=32 => 4,
        _ => {
            state.write_u64(ns ^ u64::from(group));
            native.hash(state);
            return;
        }
    };
    let mut w = [0u64; 4];
    for (word, bytes) in w.iter_mut().zip(native.bytes.chunks_exact(8)).take(words) {
        let mut b = [0u8; 8];
        b.copy_from_slice(bytes);
        *word = u64::from_le_bytes(b);
    }
    let pair = |lo: u64, hi: u64| u128::from(lo) | (u128::from(hi) << 64);
    state.write_u128(pair(ns ^ u64::from(group), w[0]));
    match words {
        1 => {}
        2 => state.write_u64(w[1]),
        _ => {
            state.write_u128(pair(w[1], w[2]));
            state.write_u64(w[3]);
        }
    }
}

/// A key's parts, borrowed: looks a [`KeyMap`] up without building a
/// [`StateKey`] (discovery looks up every page of a query, and a key is a
/// 104-byte copy). Hashes exactly as the `StateKey` of the same parts.
#[derive(Debug, Clone, Copy)]
pub struct KeyRef<'a> {
    pub namespace: &'a Namespace,
    pub group: u32,
    pub native: &'a NativeHash,
}

impl Hash for KeyRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        hash_parts(self.namespace, self.group, self.native, state);
    }
}

impl hashbrown::Equivalent<StateKey> for KeyRef<'_> {
    fn equivalent(&self, key: &StateKey) -> bool {
        // The native hash differs first when keys differ at all.
        *self.native == key.native && self.group == key.group && *self.namespace == key.namespace
    }
}

/// The hasher of every map keyed by [`StateKey`]: folded multiplies (a
/// 64x64 -> 128-bit product, its halves xored) keyed by two secrets drawn
/// once per process from the OS's randomness, one multiply per 128 bits a
/// key writes (`hash_parts` writes a 32-byte native hash as three). Keys
/// are digests, so this spreads them well; the secrets keep a client that
/// picks its own native hashes from steering them into one bucket. The
/// construction is foldhash's, without its buffering of small writes,
/// which was about 20 of the 37 instructions a key's hash took in
/// discovery (`world/benches/query.rs`, callgrind).
#[derive(Clone, Copy, Debug)]
pub struct KeyHasher {
    seeds: [u64; 2],
}

impl Default for KeyHasher {
    fn default() -> Self {
        static SEEDS: std::sync::OnceLock<[u64; 2]> = std::sync::OnceLock::new();
        let seeds = *SEEDS.get_or_init(|| {
            use std::hash::BuildHasher;
            // SipHash keyed from the OS (std's `RandomState`).
            let os = std::collections::hash_map::RandomState::new();
            // Odd, so no secret multiplies a word by zero.
            [os.hash_one(1u64) | 1, os.hash_one(2u64) | 1]
        });
        KeyHasher { seeds }
    }
}

impl std::hash::BuildHasher for KeyHasher {
    type Hasher = KeyHash;

    #[inline]
    fn build_hasher(&self) -> KeyHash {
        KeyHash {
            acc: self.seeds[0],
            seed: self.seeds[1],
        }
    }
}

/// [`KeyHasher`]'s state.
#[derive(Clone, Copy, Debug)]
pub struct KeyHash {
    acc: u64,
    seed: u64,
}

#[inline(always)]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

impl Hasher for KeyHash {
    #[inline]
    fn write_u128(&mut self, x: u128) {
        self.acc = folded_multiply((x as u64) ^ self.acc, ((x >> 64) as u64) ^ self.seed);
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.write_u128(u128::from(x));
    }

    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    #[inline]
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(16);
        for c in &mut chunks {
            let mut w = [0u8; 16];
            w.copy_from_slice(c);
            self.write_u128(u128::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        let mut w = [0u8; 16];
        w[..rest.len()].copy_from_slice(rest);
        // The length goes with the tail, so trailing zero bytes count.
        self.write_u128(u128::from_le_bytes(w) ^ ((bytes.len() as u128) << 120));
    }

    #[inline]
    fn finish(&self) -> u64 {
        folded_multiply(self.acc, self.seed.rotate_left(23))
    }
}

/// A hash map keyed by [`StateKey`] (see [`KeyHasher`]), also looked up
/// by [`KeyRef`].
pub type KeyMap<V> = hashbrown::HashMap<StateKey, V, KeyHasher>;

/// A hash set of [`StateKey`]s (see [`KeyHasher`]).
pub type KeySet = hashbrown::HashSet<StateKey, KeyHasher>;

impl StateKey {
    pub fn new(namespace: Namespace, group: u32, native: &[u8]) -> Result<Self, KeyError> {
        if namespace.is_empty() {
            return Err(KeyError::EmptyNamespace);
        }
        Ok(StateKey {
            namespace,
            group,
            native: NativeHash::new(native)?,
        })
    }

    /// The versioned hash part: `hash_version ‖ group ‖ len ‖ native`.
    pub fn hash_bytes(&self) -> Vec<u8> {
        let native = self.native.as_bytes();
        let mut out = Vec::with_capacity(7 + native.len());
        out.push(HASH_VERSION);
        out.extend_from_slice(&self.group.to_le_bytes());
        out.extend_from_slice(&(native.len() as u16).to_le_bytes());
        out.extend_from_slice(native);
        out
    }

    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + self.native.as_bytes().len()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        out.push(KEY_VERSION);
        out.extend_from_slice(self.namespace.as_bytes());
        out.extend_from_slice(&self.hash_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, KeyError> {
        if bytes.len() < HEADER_BYTES {
            return Err(KeyError::Truncated(bytes.len()));
        }
        if bytes[0] != KEY_VERSION {
            return Err(KeyError::KeyVersion(bytes[0]));
        }
        let namespace = Namespace(bytes[1..33].try_into().expect("32 bytes"));
        if bytes[33] != HASH_VERSION {
            return Err(KeyError::HashVersion(bytes[33]));
        }
        let group = u32::from_le_bytes(bytes[34..38].try_into().expect("4 bytes"));
        let declared = u16::from_le_bytes(bytes[38..40].try_into().expect("2 bytes")) as usize;
        let native = &bytes[HEADER_BYTES..];
        if native.len() != declared {
            return Err(KeyError::LengthMismatch {
                declared,
                actual: native.len(),
            });
        }
        StateKey::new(namespace, group, native)
    }
}

impl fmt::Debug for StateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "StateKey({:?}, g{}, {})",
            self.namespace,
            self.group,
            hex::encode(self.native.as_bytes())
        )
    }
}

/// The full description of a page's bytes. A planning type: it is sealed into
/// the namespace through the layout and digested into SSD record headers, not
/// sent per page.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFormat {
    /// Element type, e.g. `bfloat16`, `fp8_e4m3`.
    pub dtype: String,
    /// Quantization scheme, `none` when unquantized.
    pub quantization: String,
    pub page_tokens: u32,
    /// Dimension order, e.g. `NHD`.
    pub layout: String,
    pub strides: Vec<u64>,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub tp_rank: u32,
    pub tp_size: u32,
    pub pp_rank: u32,
    pub pp_size: u32,
    /// The kernel/implementation that wrote the bytes, e.g. `vllm-flash-attn`.
    pub implementation: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid state format: {0}")]
pub struct FormatError(pub &'static str);

impl StateFormat {
    pub fn validate(&self) -> Result<(), FormatError> {
        let checks: [(bool, &'static str); 9] = [
            (!self.dtype.is_empty(), "dtype is empty"),
            (
                !self.quantization.is_empty(),
                "quantization is empty (use \"none\")",
            ),
            (self.page_tokens > 0, "page_tokens is 0"),
            (!self.layout.is_empty(), "layout is empty"),
            (
                self.num_kv_heads > 0 && self.head_dim > 0,
                "head shape has a zero",
            ),
            (
                self.tp_size > 0 && self.tp_rank < self.tp_size,
                "tp_rank is not below tp_size",
            ),
            (
                self.pp_size > 0 && self.pp_rank < self.pp_size,
                "pp_rank is not below pp_size",
            ),
            (!self.implementation.is_empty(), "implementation is empty"),
            (!self.strides.is_empty(), "strides are empty"),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, why)) => Err(FormatError(why)),
            None => Ok(()),
        }
    }

    /// SHA-256 of the canonical encoding.
    pub fn digest(&self) -> Result<Digest32, FormatError> {
        self.validate()?;
        let mut body = Vec::new();
        put_str(&mut body, &self.dtype);
        put_str(&mut body, &self.quantization);
        put_u32(&mut body, self.page_tokens);
        put_str(&mut body, &self.layout);
        put_u64(&mut body, self.strides.len() as u64);
        for s in &self.strides {
            put_u64(&mut body, *s);
        }
        for v in [
            self.num_kv_heads,
            self.head_dim,
            self.tp_rank,
            self.tp_size,
            self.pp_rank,
            self.pp_size,
        ] {
            put_u32(&mut body, v);
        }
        put_str(&mut body, &self.implementation);
        let mut frame = Frame::new("orbitkv/state-format", 1);
        frame.field(1, &body);
        Ok(frame.sha256())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    /// Byte slices hash with their length: trailing zeros, and a tail
    /// that fills a whole 16-byte block, still change the hash.
    #[test]
    fn key_hasher_hashes_slices_with_their_length() {
        let h = KeyHasher::default();
        let of = |b: &[u8]| {
            let mut s = h.build_hasher();
            s.write(b);
            s.finish()
        };
        assert_ne!(of(&[]), of(&[0]));
        assert_ne!(of(&[1, 0]), of(&[1]));
        assert_ne!(of(&[7; 16]), of(&[7; 17]));
        assert_ne!(of(&[0; 16]), of(&[0; 32]));
        assert_eq!(of(&[9; 40]), of(&[9; 40]));
    }

    /// Sequential integer hashes (what a careless engine could send) and
    /// keys that differ in one word spread over a table's buckets as
    /// randomly placed keys would: with 65,536 keys in 4,096 buckets
    /// (16 expected each), no bucket gets past 48 (a Poisson tail of
    /// about 1e-11), in the low bits (the bucket index), and each of the
    /// top 7 bits' values (hashbrown's tags) gets 512 +- 128 (5.7 sigma).
    #[test]
    fn key_hasher_spreads_adversarially_regular_keys() {
        let h = KeyHasher::default();
        let ids: fn(u64) -> StateKey =
            |i| StateKey::new(Namespace([0x5a; 32]), 0, &i.to_le_bytes()).unwrap();
        for (name, key) in [
            ("ids", ids),
            ("last word", |i: u64| {
                let mut b = [0u8; 32];
                b[24..].copy_from_slice(&i.to_le_bytes());
                StateKey::new(Namespace([0x5a; 32]), 1, &b).unwrap()
            }),
        ] {
            let mut low = vec![0u32; 4096];
            let mut top = [0u32; 128];
            for i in 0..65_536u64 {
                let x = h.hash_one(key(i));
                low[(x & 4095) as usize] += 1;
                top[(x >> 57) as usize] += 1;
            }
            let max = low.iter().max().unwrap();
            assert!(*max <= 48, "{name}: a bucket got {max} keys");
            // 512 expected per tag.
            let (tmin, tmax) = (top.iter().min().unwrap(), top.iter().max().unwrap());
            assert!(
                *tmin >= 384 && *tmax <= 640,
                "{name}: tag loads {tmin}..={tmax}"
            );
        }
    }
}
