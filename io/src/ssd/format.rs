//! The record header: encoding, decoding and verification.
//!
//! The byte layout is documented in the [module docs of `ssd`](super).
//! Everything here is pure; the store and the open-time scan both verify
//! through [`RecordHeader::decode`].

use orbitkv_components::StateKey;
use orbitkv_components::key::MAX_NATIVE_HASH_BYTES;

/// Smallest record block: the scan steps this many bytes.
pub const MIN_BLOCK: u64 = 512;
/// Largest record block (and the block of every version-1 record).
pub const MAX_BLOCK: u64 = 4096;
/// The block of version-1 records (one 4 KiB header block, payload padded
/// to 4 KiB).
pub const V1_BLOCK: u64 = 4096;
/// First eight bytes of every record header.
pub const MAGIC: [u8; 8] = *b"OKVSSDR\x01";
/// Version of the record layout written by this code.
pub const FORMAT_VERSION: u16 = 2;
/// The previous layout (4 KiB blocks, no block field), still read.
pub const FORMAT_V1: u16 = 1;
/// Bytes of the header that carry data (the rest of the block is zero).
pub const HEADER_LEN: u16 = 256;
/// Longest [`StateKey::encode`] output: 40 fixed bytes plus the native hash.
pub const MAX_KEY_BYTES: usize = 40 + MAX_NATIVE_HASH_BYTES;

const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_HEADER_LEN: usize = 10;
const OFF_KEY_LEN: usize = 12;
const OFF_FLAGS: usize = 14;
const OFF_SEGMENT: usize = 16;
const OFF_RECORD_OFFSET: usize = 24;
const OFF_SEQUENCE: usize = 32;
const OFF_PAYLOAD_LEN: usize = 40;
const OFF_PAYLOAD_SUM: usize = 48;
const OFF_WRITTEN_US: usize = 56;
const OFF_DIGEST: usize = 64;
const OFF_KEY: usize = 96;
/// Version 2: the record's block size (u32); zero (reserved) in version 1.
const OFF_BLOCK: usize = OFF_KEY + MAX_KEY_BYTES; // 200
const OFF_RESERVED: usize = OFF_BLOCK + 4; // 204
/// Offset of the header checksum; it covers bytes `[0, OFF_HEADER_SUM)`.
pub const OFF_HEADER_SUM: usize = 248;

/// Whether `block` is a record block size this code writes or reads: a
/// power of two in `MIN_BLOCK..=MAX_BLOCK`.
pub const fn valid_block(block: u64) -> bool {
    block.is_power_of_two() && block >= MIN_BLOCK && block <= MAX_BLOCK
}

/// Rounds `n` up to a whole number of `block`s (`block` a power of two).
pub const fn round_up(n: u64, block: u64) -> u64 {
    n.div_ceil(block) * block
}

/// Bytes a record of `payload_len` occupies on disk with blocks of
/// `block` bytes: the header block plus the payload padded to whole blocks.
pub const fn record_bytes(payload_len: u64, block: u64) -> u64 {
    block + round_up(payload_len, block)
}

/// One record header, as written in front of every payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// Segment the record was written into (also in the file name).
    pub segment_id: u64,
    /// Byte offset of this header inside its segment file.
    pub record_offset: u64,
    /// Store-wide write sequence number; the newest record of a key wins.
    pub sequence: u64,
    /// The page's key.
    pub key: StateKey,
    /// [`StateFormat::digest`](orbitkv_components::StateFormat::digest) of
    /// the bytes' format, as given to `submit_write`.
    pub format_digest: [u8; 32],
    /// Payload bytes (without padding).
    pub payload_len: u64,
    /// [`page_checksum`](crate::checksum::page_checksum) of the payload:
    /// computed by `submit_write`, or the one a demoted page carries since
    /// its bytes landed (never recomputed on the write path).
    pub payload_checksum: u64,
    /// The caller's clock at `submit_write`, for inspection only.
    pub written_us: u64,
    /// The record's block: the header block's size, the alignment of the
    /// record and the payload's padding unit ([`valid_block`]; always
    /// [`V1_BLOCK`] for version-1 records). Bound by the header checksum.
    pub block: u64,
    /// Layout version the header was read in ([`FORMAT_VERSION`] or
    /// [`FORMAT_V1`]). `encode` always writes [`FORMAT_VERSION`].
    pub version: u16,
}

/// Why a header block is not a valid record header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("header block is all zero (never written)")]
    Empty,
    #[error("bad magic")]
    Magic,
    #[error("unsupported record format version {0}")]
    Version(u16),
    #[error("header checksum mismatch")]
    Checksum,
    #[error("header field out of range: {0}")]
    Field(&'static str),
    #[error("header key does not decode: {0}")]
    Key(String),
    #[error("header buffer holds {0} bytes, {1} needed")]
    Short(usize, u64),
}

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get_u16(b: &[u8], at: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[at..at + 2]);
    u16::from_le_bytes(a)
}

fn get_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn get_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// XXH3-64 over the checksummed part of a header block.
pub fn header_sum(block: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&block[..OFF_HEADER_SUM])
}

impl RecordHeader {
    /// Writes the header (format [`FORMAT_VERSION`]) into the first
    /// `self.block` bytes of `buf`, zeroing the rest of that block. `buf`
    /// must hold at least `self.block` bytes (the store's buffers always
    /// do).
    pub fn encode_into(&self, buf: &mut [u8]) -> Result<(), HeaderError> {
        if !valid_block(self.block) {
            return Err(HeaderError::Field("block"));
        }
        if buf.len() < self.block as usize {
            return Err(HeaderError::Short(buf.len(), self.block));
        }
        let key = self.key.encode();
        if key.len() > MAX_KEY_BYTES {
            return Err(HeaderError::Field("key too long"));
        }
        let b = &mut buf[..self.block as usize];
        b.fill(0);
        b[OFF_MAGIC..OFF_MAGIC + 8].copy_from_slice(&MAGIC);
        put_u16(b, OFF_VERSION, FORMAT_VERSION);
        put_u16(b, OFF_HEADER_LEN, HEADER_LEN);
        put_u16(b, OFF_KEY_LEN, key.len() as u16);
        put_u16(b, OFF_FLAGS, 0);
        put_u64(b, OFF_SEGMENT, self.segment_id);
        put_u64(b, OFF_RECORD_OFFSET, self.record_offset);
        put_u64(b, OFF_SEQUENCE, self.sequence);
        put_u64(b, OFF_PAYLOAD_LEN, self.payload_len);
        put_u64(b, OFF_PAYLOAD_SUM, self.payload_checksum);
        put_u64(b, OFF_WRITTEN_US, self.written_us);
        b[OFF_DIGEST..OFF_DIGEST + 32].copy_from_slice(&self.format_digest);
        b[OFF_KEY..OFF_KEY + key.len()].copy_from_slice(&key);
        put_u32(b, OFF_BLOCK, self.block as u32);
        let sum = header_sum(b);
        put_u64(b, OFF_HEADER_SUM, sum);
        Ok(())
    }

    /// The header block as a fresh vector of `self.block` bytes.
    pub fn encode(&self) -> Result<Vec<u8>, HeaderError> {
        let mut v = vec![0u8; self.block as usize];
        self.encode_into(&mut v)?;
        Ok(v)
    }

    /// Parses and verifies a header: magic, version, header length, header
    /// checksum, flags, block size, reserved bytes and the key encoding.
    /// `buf` holds at least [`MIN_BLOCK`] bytes from the header's start
    /// (only they are looked at; a block of zeros is [`HeaderError::Empty`]).
    /// It does not know where the block was read from; callers compare
    /// `segment_id` / `record_offset` with the location themselves.
    pub fn decode(buf: &[u8]) -> Result<RecordHeader, HeaderError> {
        if buf.len() < MIN_BLOCK as usize {
            return Err(HeaderError::Short(buf.len(), MIN_BLOCK));
        }
        let b = &buf[..HEADER_LEN as usize];
        if b[OFF_MAGIC..OFF_MAGIC + 8] != MAGIC {
            if buf[..MIN_BLOCK as usize].iter().all(|&x| x == 0) {
                return Err(HeaderError::Empty);
            }
            return Err(HeaderError::Magic);
        }
        let version = get_u16(b, OFF_VERSION);
        if version != FORMAT_VERSION && version != FORMAT_V1 {
            return Err(HeaderError::Version(version));
        }
        if get_u64(b, OFF_HEADER_SUM) != header_sum(b) {
            return Err(HeaderError::Checksum);
        }
        if get_u16(b, OFF_HEADER_LEN) != HEADER_LEN {
            return Err(HeaderError::Field("header_len"));
        }
        if get_u16(b, OFF_FLAGS) != 0 {
            return Err(HeaderError::Field("flags"));
        }
        let block = if version == FORMAT_V1 {
            // Version 1 had no block field: those bytes were reserved.
            if get_u32(b, OFF_BLOCK) != 0 {
                return Err(HeaderError::Field("reserved bytes"));
            }
            V1_BLOCK
        } else {
            let block = u64::from(get_u32(b, OFF_BLOCK));
            if !valid_block(block) {
                return Err(HeaderError::Field("block"));
            }
            block
        };
        if b[OFF_RESERVED..OFF_HEADER_SUM].iter().any(|&x| x != 0) {
            return Err(HeaderError::Field("reserved bytes"));
        }
        let key_len = get_u16(b, OFF_KEY_LEN) as usize;
        if key_len > MAX_KEY_BYTES {
            return Err(HeaderError::Field("key_len"));
        }
        if b[OFF_KEY + key_len..OFF_BLOCK].iter().any(|&x| x != 0) {
            return Err(HeaderError::Field("key padding"));
        }
        let key = StateKey::decode(&b[OFF_KEY..OFF_KEY + key_len])
            .map_err(|e| HeaderError::Key(e.to_string()))?;
        let record_offset = get_u64(b, OFF_RECORD_OFFSET);
        if !record_offset.is_multiple_of(block) {
            return Err(HeaderError::Field("record_offset alignment"));
        }
        let payload_len = get_u64(b, OFF_PAYLOAD_LEN);
        if payload_len == 0 || payload_len > (1 << 48) {
            return Err(HeaderError::Field("payload_len"));
        }
        let mut format_digest = [0u8; 32];
        format_digest.copy_from_slice(&b[OFF_DIGEST..OFF_DIGEST + 32]);
        Ok(RecordHeader {
            segment_id: get_u64(b, OFF_SEGMENT),
            record_offset,
            sequence: get_u64(b, OFF_SEQUENCE),
            key,
            format_digest,
            payload_len,
            payload_checksum: get_u64(b, OFF_PAYLOAD_SUM),
            written_us: get_u64(b, OFF_WRITTEN_US),
            block,
            version,
        })
    }

    /// Bytes this record occupies on disk.
    pub fn record_bytes(&self) -> u64 {
        record_bytes(self.payload_len, self.block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use orbitkv_components::Namespace;

    fn header(block: u64) -> RecordHeader {
        RecordHeader {
            segment_id: 7,
            record_offset: 8192,
            sequence: 42,
            key: StateKey::new(Namespace([3; 32]), 2, &[9; 64]).unwrap(),
            format_digest: [5; 32],
            payload_len: 5000,
            payload_checksum: 0xdead_beef,
            written_us: 11,
            block,
            version: FORMAT_VERSION,
        }
    }

    #[test]
    fn round_trip_and_every_byte_is_checked() {
        for block in [512, 1024, 2048, 4096] {
            let h = header(block);
            let enc = h.encode().unwrap();
            assert_eq!(enc.len(), block as usize);
            assert_eq!(RecordHeader::decode(&enc).unwrap(), h);
            assert_eq!(h.record_bytes(), block + 5000u64.div_ceil(block) * block);
            // Any single flipped bit in the checksummed range is caught.
            for i in 0..OFF_HEADER_SUM + 8 {
                let mut bad = enc.clone();
                bad[i] ^= 0x10;
                assert!(RecordHeader::decode(&bad).is_err(), "byte {i}");
            }
        }
        assert_eq!(header(512).record_bytes(), 512 + 5120);
        assert_eq!(RecordHeader::decode(&[0u8; 512]), Err(HeaderError::Empty));
        assert_eq!(
            RecordHeader::decode(&[0u8; 100]),
            Err(HeaderError::Short(100, 512))
        );
        for bad in [0, 256, 768, 8192] {
            assert_eq!(header(bad).encode(), Err(HeaderError::Field("block")));
        }
    }

    /// A block size the checksum covers but the code does not accept, and
    /// a record offset off its block, are refused.
    #[test]
    fn block_field_is_validated() {
        let mut enc = header(512).encode().unwrap();
        put_u32(&mut enc, OFF_BLOCK, 768);
        let sum = header_sum(&enc);
        put_u64(&mut enc, OFF_HEADER_SUM, sum);
        assert_eq!(RecordHeader::decode(&enc), Err(HeaderError::Field("block")));
        let mut h = header(4096);
        h.record_offset = 512;
        let enc = h.encode().unwrap();
        assert_eq!(
            RecordHeader::decode(&enc),
            Err(HeaderError::Field("record_offset alignment"))
        );
    }

    /// Version-1 headers (4 KiB blocks, bytes 200..248 reserved) still
    /// decode, with their block; a v1 header carrying a block field is
    /// refused.
    #[test]
    fn version_1_headers_decode_with_4k_blocks() {
        let mut enc = header(4096).encode().unwrap();
        put_u16(&mut enc, OFF_VERSION, FORMAT_V1);
        put_u32(&mut enc, OFF_BLOCK, 0);
        let sum = header_sum(&enc);
        put_u64(&mut enc, OFF_HEADER_SUM, sum);
        let h = RecordHeader::decode(&enc).unwrap();
        assert_eq!((h.block, h.version), (V1_BLOCK, FORMAT_V1));
        assert_eq!(h.record_bytes(), 4096 + 8192);
        put_u32(&mut enc, OFF_BLOCK, 4096);
        let sum = header_sum(&enc);
        put_u64(&mut enc, OFF_HEADER_SUM, sum);
        assert_eq!(
            RecordHeader::decode(&enc),
            Err(HeaderError::Field("reserved bytes"))
        );
        put_u16(&mut enc, OFF_VERSION, 3);
        assert_eq!(RecordHeader::decode(&enc), Err(HeaderError::Version(3)));
    }
}
