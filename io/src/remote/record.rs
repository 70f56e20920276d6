//! The remote record: one Redis value per page, `header ‖ payload`, and the
//! same header as the page's directory entry. Encoding, decoding and the
//! read-side verification are pure functions here; the layout is in the
//! [module docs](super).
//!
//! Every record is authenticated with the deployment's secret
//! ([`RecordMac`]): the header carries a keyed BLAKE3 of the payload and
//! ends with a keyed BLAKE3 of itself. Whoever can write the Redis but
//! lacks the secret cannot make a record (or a directory entry) that
//! verifies, however they recompute the unkeyed checksums.

use orbitkv_components::StateKey;
use orbitkv_components::key::MAX_NATIVE_HASH_BYTES;

use crate::checksum::page_checksum;

/// First eight bytes of every remote record header.
pub const MAGIC: [u8; 8] = *b"OKVREM\x00\x01";
/// Version of the record layout written by this code (2: keyed MACs; a
/// version-1 record, unauthenticated, is never read).
pub const FORMAT_VERSION: u16 = 2;
/// Header bytes before the key.
pub const FIXED_LEN: usize = 120;
/// Bytes of a MAC (keyed BLAKE3, full length).
pub const MAC_LEN: usize = 32;
/// Bytes of the header MAC after the key.
const SUM_LEN: usize = MAC_LEN;
/// Longest [`StateKey::encode`] output.
pub const MAX_KEY_BYTES: usize = 40 + MAX_NATIVE_HASH_BYTES;
/// Longest header: fixed part, longest key, checksum.
pub const MAX_HEADER_LEN: usize = FIXED_LEN + MAX_KEY_BYTES + SUM_LEN;

const OFF_VERSION: usize = 8;
const OFF_HEADER_LEN: usize = 10;
const OFF_KEY_LEN: usize = 12;
const OFF_FLAGS: usize = 14;
const OFF_PAYLOAD_LEN: usize = 16;
const OFF_PAYLOAD_SUM: usize = 24;
const OFF_WRITER: usize = 32;
const OFF_WRITTEN_MS: usize = 40;
const OFF_TTL_MS: usize = 48;
const OFF_DIGEST: usize = 56;
const OFF_PAYLOAD_MAC: usize = 88;

/// Fewest bytes of secret in `mac_key_file`: 256 bits.
pub const MIN_SECRET_BYTES: usize = 32;

/// The deployment's record keys, derived from its secret (`[remote]
/// mac_key_file`, shared by every manager of the deployment and distinct
/// from the Redis password): one for headers, one for payloads.
#[derive(Clone)]
pub struct RecordMac {
    header: [u8; 32],
    payload: [u8; 32],
    keyed: bool,
}

impl RecordMac {
    /// Keys derived from `secret` (at least [`MIN_SECRET_BYTES`]).
    pub fn from_secret(secret: &[u8]) -> Result<RecordMac, String> {
        if secret.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "the MAC secret holds {} bytes; at least {MIN_SECRET_BYTES} are needed",
                secret.len()
            ));
        }
        Ok(RecordMac::derive(secret, true))
    }

    /// Public keys, for a store the operator trusts fully (`[remote]
    /// unauthenticated = true`): anyone can compute these MACs, so they
    /// catch accidents, not forgeries.
    pub fn unauthenticated() -> RecordMac {
        RecordMac::derive(b"", false)
    }

    fn derive(secret: &[u8], keyed: bool) -> RecordMac {
        RecordMac {
            header: blake3::derive_key("orbitkv 2026 remote record header mac v2", secret),
            payload: blake3::derive_key("orbitkv 2026 remote record payload mac v2", secret),
            keyed,
        }
    }

    /// Whether the keys come from a secret (false: public keys).
    pub fn is_keyed(&self) -> bool {
        self.keyed
    }

    /// The payload's MAC, carried in the header.
    pub fn payload_mac(&self, payload: &[u8]) -> [u8; MAC_LEN] {
        blake3::keyed_hash(&self.payload, payload).into()
    }

    /// A hasher that gives [`RecordMac::payload_mac`] of what it is fed,
    /// for a payload MACed piece by piece as it is copied.
    pub fn payload_hasher(&self) -> blake3::Hasher {
        blake3::Hasher::new_keyed(&self.payload)
    }

    fn header_mac(&self, header_body: &[u8]) -> blake3::Hash {
        blake3::keyed_hash(&self.header, header_body)
    }
}

impl std::fmt::Debug for RecordMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys.
        f.debug_struct("RecordMac")
            .field("keyed", &self.keyed)
            .finish_non_exhaustive()
    }
}

/// One record header: what a page is, who wrote it and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub key: StateKey,
    /// [`StateFormat::digest`](orbitkv_components::StateFormat::digest) of
    /// the bytes' format.
    pub format_digest: [u8; 32],
    /// Payload bytes, > 0.
    pub payload_len: u64,
    /// [`page_checksum`] of the payload (the checksum the page carries in
    /// the runtime).
    pub payload_checksum: u64,
    /// [`RecordMac::payload_mac`] of the payload.
    pub payload_mac: [u8; MAC_LEN],
    /// The writing manager's incarnation (inspection only).
    pub writer: u64,
    /// Writer's wall clock at write, Unix milliseconds.
    pub written_unix_ms: u64,
    /// The expiry the writer set on the value, in milliseconds.
    pub ttl_ms: u64,
}

/// Why bytes are not a valid record (or not the one asked for).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("value holds {0} bytes, shorter than a record header")]
    Short(usize),
    #[error("bad magic")]
    Magic,
    #[error("unsupported record version {0}")]
    Version(u16),
    #[error("header field out of range: {0}")]
    Field(&'static str),
    #[error("header MAC mismatch (forged, or another deployment's secret)")]
    HeaderMac,
    #[error("header key does not decode: {0}")]
    Key(String),
    #[error("record is for another key")]
    OtherKey,
    #[error("record holds a {actual}-byte page, {expected} were expected")]
    Length { expected: u64, actual: u64 },
    #[error("value is {actual} bytes, the header says {expected} (truncated or padded)")]
    Truncated { expected: u64, actual: u64 },
    #[error("record checksum {actual:#018x} is not the looked-up {expected:#018x} (rewritten)")]
    Rewritten { expected: u64, actual: u64 },
    #[error("payload checksum {actual:#018x} != header {expected:#018x}")]
    PayloadChecksum { expected: u64, actual: u64 },
    #[error("payload MAC mismatch (forged, or another deployment's secret)")]
    PayloadMac,
    #[error(
        "value holds {actual} bytes, more than the {limit} a record of the promised length takes"
    )]
    TooLong { limit: u64, actual: u64 },
}

fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl RecordHeader {
    /// Bytes of this header once encoded.
    pub fn encoded_len(&self) -> usize {
        FIXED_LEN + self.key.encoded_len() + SUM_LEN
    }

    /// Appends the encoded header, its MAC last, to `out`.
    pub fn encode_into(&self, mac: &RecordMac, out: &mut Vec<u8>) {
        let key = self.key.encode();
        debug_assert!(key.len() <= MAX_KEY_BYTES, "StateKey::encode is bounded");
        let start = out.len();
        let header_len = (FIXED_LEN + key.len() + SUM_LEN) as u16;
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&header_len.to_le_bytes());
        out.extend_from_slice(&(key.len() as u16).to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.payload_len.to_le_bytes());
        out.extend_from_slice(&self.payload_checksum.to_le_bytes());
        out.extend_from_slice(&self.writer.to_le_bytes());
        out.extend_from_slice(&self.written_unix_ms.to_le_bytes());
        out.extend_from_slice(&self.ttl_ms.to_le_bytes());
        out.extend_from_slice(&self.format_digest);
        out.extend_from_slice(&self.payload_mac);
        debug_assert_eq!(out.len() - start, FIXED_LEN);
        out.extend_from_slice(&key);
        let sum = mac.header_mac(&out[start..]);
        out.extend_from_slice(sum.as_bytes());
        debug_assert_eq!(out.len() - start, header_len as usize);
    }

    /// The encoded header alone (a directory entry).
    pub fn encode(&self, mac: &RecordMac) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        self.encode_into(mac, &mut v);
        v
    }

    /// Parses and verifies the header at the start of `bytes`: magic,
    /// version, lengths, flags, header MAC, key encoding. Returns the
    /// header and its length; the rest of `bytes` is not looked at.
    pub fn decode(bytes: &[u8], mac: &RecordMac) -> Result<(RecordHeader, usize), RecordError> {
        if bytes.len() < FIXED_LEN + SUM_LEN {
            return Err(RecordError::Short(bytes.len()));
        }
        if bytes[..8] != MAGIC {
            return Err(RecordError::Magic);
        }
        let version = get_u16(bytes, OFF_VERSION);
        if version != FORMAT_VERSION {
            return Err(RecordError::Version(version));
        }
        let key_len = get_u16(bytes, OFF_KEY_LEN) as usize;
        if key_len > MAX_KEY_BYTES {
            return Err(RecordError::Field("key_len"));
        }
        let header_len = get_u16(bytes, OFF_HEADER_LEN) as usize;
        if header_len != FIXED_LEN + key_len + SUM_LEN {
            return Err(RecordError::Field("header_len"));
        }
        if bytes.len() < header_len {
            return Err(RecordError::Short(bytes.len()));
        }
        let body = header_len - SUM_LEN;
        let mut carried = [0u8; MAC_LEN];
        carried.copy_from_slice(&bytes[body..header_len]);
        // blake3::Hash compares in constant time.
        if mac.header_mac(&bytes[..body]) != blake3::Hash::from(carried) {
            return Err(RecordError::HeaderMac);
        }
        if get_u16(bytes, OFF_FLAGS) != 0 {
            return Err(RecordError::Field("flags"));
        }
        let payload_len = get_u64(bytes, OFF_PAYLOAD_LEN);
        if payload_len == 0 || payload_len > (1 << 40) {
            return Err(RecordError::Field("payload_len"));
        }
        let key = StateKey::decode(&bytes[FIXED_LEN..FIXED_LEN + key_len])
            .map_err(|e| RecordError::Key(e.to_string()))?;
        let mut format_digest = [0u8; 32];
        format_digest.copy_from_slice(&bytes[OFF_DIGEST..OFF_DIGEST + 32]);
        let mut payload_mac = [0u8; MAC_LEN];
        payload_mac.copy_from_slice(&bytes[OFF_PAYLOAD_MAC..OFF_PAYLOAD_MAC + MAC_LEN]);
        Ok((
            RecordHeader {
                key,
                format_digest,
                payload_len,
                payload_checksum: get_u64(bytes, OFF_PAYLOAD_SUM),
                payload_mac,
                writer: get_u64(bytes, OFF_WRITER),
                written_unix_ms: get_u64(bytes, OFF_WRITTEN_MS),
                ttl_ms: get_u64(bytes, OFF_TTL_MS),
            },
            header_len,
        ))
    }
}

/// A complete record value: the header for `payload`, then `payload`.
pub fn encode_record(header: &RecordHeader, mac: &RecordMac, payload: &[u8]) -> Vec<u8> {
    debug_assert_eq!(header.payload_len, payload.len() as u64);
    debug_assert_eq!(header.payload_checksum, page_checksum(payload));
    let mut v = Vec::with_capacity(header.encoded_len() + payload.len());
    header.encode_into(mac, &mut v);
    v.extend_from_slice(payload);
    v
}

/// What a read expects of the record it fetched: the key it asked for, the
/// length the runtime reserved, and the checksum the metadata promised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    pub key: StateKey,
    pub len: u64,
    pub checksum: u64,
}

/// The most bytes a record of `payload_len` bytes can take: what a read
/// fetches at most, so a value planted under a promised key is never read
/// whole.
pub fn max_record_len(payload_len: u64) -> u64 {
    payload_len.saturating_add(MAX_HEADER_LEN as u64)
}

/// Verifies a fetched value before any byte of it may reach the pool:
/// header and its MAC, key, length (a truncated or padded value fails),
/// the checksum the metadata promised (a record rewritten since the lookup
/// fails), the payload's MAC and its checksum. Returns where the payload
/// starts.
pub fn verify(value: &[u8], expect: &Expect, mac: &RecordMac) -> Result<usize, RecordError> {
    let (h, header_len) = RecordHeader::decode(value, mac)?;
    if h.key != expect.key {
        return Err(RecordError::OtherKey);
    }
    if h.payload_len != expect.len {
        return Err(RecordError::Length {
            expected: expect.len,
            actual: h.payload_len,
        });
    }
    let total = header_len as u64 + h.payload_len;
    if value.len() as u64 != total {
        return Err(RecordError::Truncated {
            expected: total,
            actual: value.len() as u64,
        });
    }
    if h.payload_checksum != expect.checksum {
        return Err(RecordError::Rewritten {
            expected: expect.checksum,
            actual: h.payload_checksum,
        });
    }
    let payload = &value[header_len..];
    if blake3::Hash::from(mac.payload_mac(payload)) != blake3::Hash::from(h.payload_mac) {
        return Err(RecordError::PayloadMac);
    }
    let sum = page_checksum(payload);
    if sum != h.payload_checksum {
        return Err(RecordError::PayloadChecksum {
            expected: h.payload_checksum,
            actual: sum,
        });
    }
    Ok(header_len)
}

/// Redis key of a page's record: `<prefix>d:<hex StateKey::encode>`. Hex
/// keeps keys printable for `redis-cli`; the full key is inside the value
/// too, and only that copy is trusted.
pub fn data_key(prefix: &str, key: &StateKey) -> String {
    format!("{prefix}d:{}", hex::encode(key.encode()))
}

/// Redis key of one shard of a namespace's directory stream.
pub fn directory_key(
    prefix: &str,
    namespace: &orbitkv_components::Namespace,
    shard: u32,
) -> String {
    format!("{prefix}i:{}:{shard}", namespace.to_hex())
}

/// The directory shard a key's entry goes to: spreads one namespace's
/// directory over `shards` streams (and so over cluster nodes).
pub fn shard_of(key: &StateKey, shards: u32) -> u32 {
    (xxhash_rust::xxh3::xxh3_64(&key.encode()) % u64::from(shards.max(1))) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use orbitkv_components::Namespace;
    use proptest::prelude::*;

    fn key(i: u64) -> StateKey {
        StateKey::new(Namespace([7; 32]), 3, &i.to_le_bytes()).unwrap()
    }

    fn mac() -> RecordMac {
        RecordMac::from_secret(&[0x5a; 32]).unwrap()
    }

    fn header_with(k: StateKey, payload: &[u8], mac: &RecordMac) -> RecordHeader {
        RecordHeader {
            key: k,
            format_digest: [9; 32],
            payload_len: payload.len() as u64,
            payload_checksum: page_checksum(payload),
            payload_mac: mac.payload_mac(payload),
            writer: 42,
            written_unix_ms: 1_700_000_000_000,
            ttl_ms: 60_000,
        }
    }

    fn header(k: StateKey, payload: &[u8]) -> RecordHeader {
        header_with(k, payload, &mac())
    }

    fn expect(k: StateKey, payload: &[u8]) -> Expect {
        Expect {
            key: k,
            len: payload.len() as u64,
            checksum: page_checksum(payload),
        }
    }

    #[test]
    fn round_trip() {
        let payload = vec![5u8; 1000];
        let h = header(key(1), &payload);
        let v = encode_record(&h, &mac(), &payload);
        let (back, len) = RecordHeader::decode(&v, &mac()).unwrap();
        assert_eq!(back, h);
        assert_eq!(len, h.encoded_len());
        assert!(len <= MAX_HEADER_LEN);
        assert!(v.len() as u64 <= max_record_len(1000));
        assert_eq!(verify(&v, &expect(key(1), &payload), &mac()), Ok(len));
        assert_eq!(&v[len..], &payload[..]);
    }

    #[test]
    fn every_mismatch_is_typed() {
        let m = mac();
        let payload = vec![5u8; 1000];
        let h = header(key(1), &payload);
        let v = encode_record(&h, &m, &payload);
        let e = expect(key(1), &payload);
        assert_eq!(
            verify(&v, &expect(key(2), &payload), &m),
            Err(RecordError::OtherKey)
        );
        assert!(matches!(
            verify(&v, &Expect { len: 999, ..e }, &m),
            Err(RecordError::Length { .. })
        ));
        assert!(matches!(
            verify(&v[..v.len() - 1], &e, &m),
            Err(RecordError::Truncated { .. })
        ));
        let mut longer = v.clone();
        longer.push(0);
        assert!(matches!(
            verify(&longer, &e, &m),
            Err(RecordError::Truncated { .. })
        ));
        assert!(matches!(
            verify(&v, &Expect { checksum: 1, ..e }, &m),
            Err(RecordError::Rewritten { .. })
        ));
        let mut flipped = v.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(verify(&flipped, &e, &m), Err(RecordError::PayloadMac));
        let mut bad_header = v.clone();
        bad_header[OFF_WRITER] ^= 1;
        assert_eq!(verify(&bad_header, &e, &m), Err(RecordError::HeaderMac));
        assert_eq!(verify(b"hello", &e, &m), Err(RecordError::Short(5)));
        assert_eq!(verify(&[0u8; 300], &e, &m), Err(RecordError::Magic));
        // A value that is another key's valid record never verifies.
        let other = encode_record(&header(key(2), &payload), &m, &payload);
        assert_eq!(verify(&other, &e, &m), Err(RecordError::OtherKey));
    }

    /// Issue 23: whoever writes the Redis can recompute every unkeyed
    /// checksum, but without the deployment's secret no record verifies.
    #[test]
    fn a_forged_record_never_verifies_without_the_secret() {
        let m = mac();
        let honest = vec![5u8; 1000];
        let evil = vec![6u8; 1000];
        let e = expect(key(1), &evil);
        for forger in [
            RecordMac::unauthenticated(),
            RecordMac::from_secret(&[0x5b; 32]).unwrap(),
        ] {
            // A whole record under the forger's keys, checksums right.
            let forged = encode_record(&header_with(key(1), &evil, &forger), &forger, &evil);
            assert_eq!(verify(&forged, &e, &m), Err(RecordError::HeaderMac));
            assert_eq!(
                RecordHeader::decode(&forged, &m).map(|_| ()),
                Err(RecordError::HeaderMac)
            );
        }
        // An honest header (MAC intact) over other bytes of the same length:
        // the payload MAC catches it even before the checksum would.
        let h = header(key(1), &honest);
        let mut spliced = h.encode(&m);
        spliced.extend_from_slice(&evil);
        let e = expect(key(1), &honest);
        assert_eq!(verify(&spliced, &e, &m), Err(RecordError::PayloadMac));
        // The honest record itself verifies, and only under its secret.
        let good = encode_record(&h, &m, &honest);
        assert!(verify(&good, &e, &m).is_ok());
        assert_eq!(
            verify(&good, &e, &RecordMac::unauthenticated()),
            Err(RecordError::HeaderMac)
        );
        assert!(RecordMac::from_secret(&[1; 31]).is_err());
        assert!(!format!("{m:?}").contains('['), "keys never printed");
    }

    #[test]
    fn keys_are_printable_and_sharded() {
        let k = key(1);
        let dk = data_key("okv1:", &k);
        assert!(dk.starts_with("okv1:d:") && dk.is_ascii());
        assert_eq!(hex::decode(&dk[7..]).unwrap(), k.encode());
        let s = shard_of(&k, 16);
        assert!(s < 16);
        assert_eq!(
            directory_key("okv1:", &k.namespace, s),
            format!("okv1:i:{}:{s}", k.namespace.to_hex())
        );
        assert_eq!(shard_of(&k, 0), 0);
    }

    proptest! {
        /// Arbitrary bytes never verify, and never panic the decoder.
        #[test]
        fn garbage_never_verifies(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let e = Expect { key: key(1), len: 16, checksum: 0 };
            prop_assert!(verify(&bytes, &e, &mac()).is_err());
            let _ = RecordHeader::decode(&bytes, &mac());
        }

        /// Any single-byte change of a valid record fails verification.
        #[test]
        fn any_flip_is_caught(at in 0usize..(FIXED_LEN + 49 + SUM_LEN + 64), bit in 0u8..8) {
            let payload: Vec<u8> = (0..64u8).collect();
            let h = header(key(1), &payload);
            let mut v = encode_record(&h, &mac(), &payload);
            let at = at % v.len();
            v[at] ^= 1 << bit;
            prop_assert!(verify(&v, &expect(key(1), &payload), &mac()).is_err());
        }
    }
}
