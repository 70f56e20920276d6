//! The remote record: one Redis value per page, `header ‖ payload`, and the
//! same header as the page's directory entry. Encoding, decoding and the
//! read-side verification are pure functions here; the layout is in the
//! [module docs](super).

use orbitkv_components::StateKey;
use orbitkv_components::key::MAX_NATIVE_HASH_BYTES;

use crate::checksum::page_checksum;

/// First eight bytes of every remote record header.
pub const MAGIC: [u8; 8] = *b"OKVREM\x00\x01";
/// Version of the record layout written by this code.
pub const FORMAT_VERSION: u16 = 1;
/// Header bytes before the key.
pub const FIXED_LEN: usize = 88;
/// Bytes of the header checksum after the key.
const SUM_LEN: usize = 8;
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

/// One record header: what a page is, who wrote it and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    pub key: StateKey,
    /// [`StateFormat::digest`](orbitkv_components::StateFormat::digest) of
    /// the bytes' format.
    pub format_digest: [u8; 32],
    /// Payload bytes, > 0.
    pub payload_len: u64,
    /// [`page_checksum`] of the payload.
    pub payload_checksum: u64,
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
    #[error("header checksum mismatch")]
    HeaderChecksum,
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

    /// Appends the encoded header to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
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
        debug_assert_eq!(out.len() - start, FIXED_LEN);
        out.extend_from_slice(&key);
        let sum = xxhash_rust::xxh3::xxh3_64(&out[start..]);
        out.extend_from_slice(&sum.to_le_bytes());
        debug_assert_eq!(out.len() - start, header_len as usize);
    }

    /// The encoded header alone (a directory entry).
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut v);
        v
    }

    /// Parses and verifies the header at the start of `bytes`: magic,
    /// version, lengths, flags, header checksum, key encoding. Returns the
    /// header and its length; the rest of `bytes` is not looked at.
    pub fn decode(bytes: &[u8]) -> Result<(RecordHeader, usize), RecordError> {
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
        if get_u64(bytes, body) != xxhash_rust::xxh3::xxh3_64(&bytes[..body]) {
            return Err(RecordError::HeaderChecksum);
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
        Ok((
            RecordHeader {
                key,
                format_digest,
                payload_len,
                payload_checksum: get_u64(bytes, OFF_PAYLOAD_SUM),
                writer: get_u64(bytes, OFF_WRITER),
                written_unix_ms: get_u64(bytes, OFF_WRITTEN_MS),
                ttl_ms: get_u64(bytes, OFF_TTL_MS),
            },
            header_len,
        ))
    }
}

/// A complete record value: the header for `payload`, then `payload`.
pub fn encode_record(header: &RecordHeader, payload: &[u8]) -> Vec<u8> {
    debug_assert_eq!(header.payload_len, payload.len() as u64);
    debug_assert_eq!(header.payload_checksum, page_checksum(payload));
    let mut v = Vec::with_capacity(header.encoded_len() + payload.len());
    header.encode_into(&mut v);
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

/// Verifies a fetched value before any byte of it may reach the pool:
/// header, key, length (a truncated or padded value fails), the checksum
/// the metadata promised (a record rewritten since the lookup fails), and
/// the payload checksum. Returns where the payload starts.
pub fn verify(value: &[u8], expect: &Expect) -> Result<usize, RecordError> {
    let (h, header_len) = RecordHeader::decode(value)?;
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
    let sum = page_checksum(&value[header_len..]);
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

    fn header(k: StateKey, payload: &[u8]) -> RecordHeader {
        RecordHeader {
            key: k,
            format_digest: [9; 32],
            payload_len: payload.len() as u64,
            payload_checksum: page_checksum(payload),
            writer: 42,
            written_unix_ms: 1_700_000_000_000,
            ttl_ms: 60_000,
        }
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
        let v = encode_record(&h, &payload);
        let (back, len) = RecordHeader::decode(&v).unwrap();
        assert_eq!(back, h);
        assert_eq!(len, h.encoded_len());
        assert_eq!(verify(&v, &expect(key(1), &payload)), Ok(len));
        assert_eq!(&v[len..], &payload[..]);
    }

    #[test]
    fn every_mismatch_is_typed() {
        let payload = vec![5u8; 1000];
        let h = header(key(1), &payload);
        let v = encode_record(&h, &payload);
        let e = expect(key(1), &payload);
        assert_eq!(
            verify(&v, &expect(key(2), &payload)),
            Err(RecordError::OtherKey)
        );
        assert!(matches!(
            verify(&v, &Expect { len: 999, ..e }),
            Err(RecordError::Length { .. })
        ));
        assert!(matches!(
            verify(&v[..v.len() - 1], &e),
            Err(RecordError::Truncated { .. })
        ));
        let mut longer = v.clone();
        longer.push(0);
        assert!(matches!(
            verify(&longer, &e),
            Err(RecordError::Truncated { .. })
        ));
        assert!(matches!(
            verify(&v, &Expect { checksum: 1, ..e }),
            Err(RecordError::Rewritten { .. })
        ));
        let mut flipped = v.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(
            verify(&flipped, &e),
            Err(RecordError::PayloadChecksum { .. })
        ));
        let mut bad_header = v.clone();
        bad_header[OFF_WRITER] ^= 1;
        assert_eq!(verify(&bad_header, &e), Err(RecordError::HeaderChecksum));
        assert_eq!(verify(b"hello", &e), Err(RecordError::Short(5)));
        assert_eq!(verify(&[0u8; 200], &e), Err(RecordError::Magic));
        // A value that is another key's valid record never verifies.
        let other = encode_record(&header(key(2), &payload), &payload);
        assert_eq!(verify(&other, &e), Err(RecordError::OtherKey));
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
            prop_assert!(verify(&bytes, &e).is_err());
            let _ = RecordHeader::decode(&bytes);
        }

        /// Any single-byte change of a valid record fails verification.
        #[test]
        fn any_flip_is_caught(at in 0usize..(FIXED_LEN + 49 + SUM_LEN + 64), bit in 0u8..8) {
            let payload: Vec<u8> = (0..64u8).collect();
            let h = header(key(1), &payload);
            let mut v = encode_record(&h, &payload);
            let at = at % v.len();
            v[at] ^= 1 << bit;
            prop_assert!(verify(&v, &expect(key(1), &payload)).is_err());
        }
    }
}
