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
/// An entry of a record group: one header block holding the headers of
/// several records whose payloads follow it (see the module docs of `ssd`).
pub const FORMAT_GROUP: u16 = 3;
/// Most records one group holds (a 4 KiB header block of 256-byte
/// entries); a 512-byte block holds 2.
pub const MAX_GROUP_ENTRIES: usize = 16;
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
/// Version 3 (group entries) only; reserved (zero) in versions 1 and 2.
const OFF_PAYLOAD_OFFSET: usize = OFF_RESERVED; // 204
const OFF_GROUP_BYTES: usize = OFF_PAYLOAD_OFFSET + 8; // 212
const OFF_GROUP_INDEX: usize = OFF_GROUP_BYTES + 8; // 220
const OFF_GROUP_COUNT: usize = OFF_GROUP_INDEX + 2; // 222
const OFF_GROUP_RESERVED: usize = OFF_GROUP_COUNT + 2; // 224
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

/// Where a record of a group sits in it (format [`FORMAT_GROUP`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPos {
    /// This record's entry in the group's header block (0-based).
    pub index: u16,
    /// Entries in the header block: 2..=[`MAX_GROUP_ENTRIES`], at most
    /// `block / 256`.
    pub count: u16,
    /// Bytes of the whole group: the header block and every payload,
    /// each padded to whole blocks.
    pub bytes: u64,
    /// Offset of this record's payload in the segment (a multiple of the
    /// block, after the header block, inside the group).
    pub payload_offset: u64,
}

/// Entries a header block of `block` bytes can hold.
pub const fn group_capacity(block: u64) -> usize {
    let n = (block / HEADER_LEN as u64) as usize;
    if n < MAX_GROUP_ENTRIES {
        n
    } else {
        MAX_GROUP_ENTRIES
    }
}

/// One record header, as written in front of every payload (or, for a
/// record of a group, as one entry of the group's header block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// Segment the record was written into (also in the file name).
    pub segment_id: u64,
    /// Byte offset of this header's block inside its segment file (for a
    /// record of a group, the group's header block).
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
    /// Layout version the header was read in ([`FORMAT_VERSION`],
    /// [`FORMAT_V1`] or [`FORMAT_GROUP`]). `encode` writes
    /// [`FORMAT_VERSION`], or [`FORMAT_GROUP`] for a header with `group`.
    pub version: u16,
    /// The record's place in its group; `None` for a record with a header
    /// block of its own.
    pub group: Option<GroupPos>,
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
        if self.group.is_some() {
            return Err(HeaderError::Field("group"));
        }
        if !valid_block(self.block) {
            return Err(HeaderError::Field("block"));
        }
        if buf.len() < self.block as usize {
            return Err(HeaderError::Short(buf.len(), self.block));
        }
        let b = &mut buf[..self.block as usize];
        b.fill(0);
        self.encode_entry(b)
    }

    /// Writes a group's header block into the first `block` bytes of
    /// `buf`: entry `i` at `i * 256`, the rest zero. Every header must be
    /// a group entry of the same group, in order.
    pub fn encode_group(entries: &[RecordHeader], buf: &mut [u8]) -> Result<(), HeaderError> {
        let Some(first) = entries.first() else {
            return Err(HeaderError::Field("group count"));
        };
        let block = first.block;
        if !valid_block(block) {
            return Err(HeaderError::Field("block"));
        }
        if buf.len() < block as usize {
            return Err(HeaderError::Short(buf.len(), block));
        }
        if entries.len() < 2 || entries.len() > group_capacity(block) {
            return Err(HeaderError::Field("group count"));
        }
        let b = &mut buf[..block as usize];
        b.fill(0);
        for (i, h) in entries.iter().enumerate() {
            let ok = h.block == block
                && h.record_offset == first.record_offset
                && h.group.is_some_and(|g| {
                    usize::from(g.index) == i && usize::from(g.count) == entries.len()
                });
            if !ok {
                return Err(HeaderError::Field("group entry"));
            }
            let at = i * HEADER_LEN as usize;
            h.encode_entry(&mut b[at..at + HEADER_LEN as usize])?;
        }
        Ok(())
    }

    /// Writes this header's 256 bytes into `b` (zeroed by the caller).
    fn encode_entry(&self, b: &mut [u8]) -> Result<(), HeaderError> {
        if !valid_block(self.block) {
            return Err(HeaderError::Field("block"));
        }
        let key = self.key.encode();
        if key.len() > MAX_KEY_BYTES {
            return Err(HeaderError::Field("key too long"));
        }
        b[OFF_MAGIC..OFF_MAGIC + 8].copy_from_slice(&MAGIC);
        let version = if self.group.is_some() {
            FORMAT_GROUP
        } else {
            FORMAT_VERSION
        };
        put_u16(b, OFF_VERSION, version);
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
        if let Some(g) = self.group {
            put_u64(b, OFF_PAYLOAD_OFFSET, g.payload_offset);
            put_u64(b, OFF_GROUP_BYTES, g.bytes);
            put_u16(b, OFF_GROUP_INDEX, g.index);
            put_u16(b, OFF_GROUP_COUNT, g.count);
        }
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
        if buf[OFF_MAGIC..OFF_MAGIC + 8] != MAGIC
            && buf[..MIN_BLOCK as usize].iter().all(|&x| x == 0)
        {
            return Err(HeaderError::Empty);
        }
        Self::decode_entry(&buf[..HEADER_LEN as usize])
    }

    /// Entry `index` of a group's header block `block` (all of its bytes):
    /// decoded and verified as [`RecordHeader::decode`] does, and a group
    /// entry at that index.
    pub fn decode_group_entry(block: &[u8], index: usize) -> Result<RecordHeader, HeaderError> {
        let at = index * HEADER_LEN as usize;
        let Some(b) = block.get(at..at + HEADER_LEN as usize) else {
            return Err(HeaderError::Short(
                block.len(),
                (at + HEADER_LEN as usize) as u64,
            ));
        };
        let h = Self::decode_entry(b)?;
        match h.group {
            Some(g)
                if usize::from(g.index) == index
                    && at + HEADER_LEN as usize <= h.block as usize =>
            {
                Ok(h)
            }
            _ => Err(HeaderError::Field("group index")),
        }
    }

    /// Decodes one 256-byte header (`b.len() >= HEADER_LEN`).
    fn decode_entry(b: &[u8]) -> Result<RecordHeader, HeaderError> {
        let b = &b[..HEADER_LEN as usize];
        if b[OFF_MAGIC..OFF_MAGIC + 8] != MAGIC {
            return Err(HeaderError::Magic);
        }
        let version = get_u16(b, OFF_VERSION);
        if version != FORMAT_VERSION && version != FORMAT_V1 && version != FORMAT_GROUP {
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
        let reserved = if version == FORMAT_GROUP {
            OFF_GROUP_RESERVED
        } else {
            OFF_RESERVED
        };
        if b[reserved..OFF_HEADER_SUM].iter().any(|&x| x != 0) {
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
        let group = if version == FORMAT_GROUP {
            Some(decode_group_fields(b, record_offset, block, payload_len)?)
        } else {
            None
        };
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
            group,
        })
    }

    /// Bytes this record occupies on disk: its header block and padded
    /// payload; for a record of a group, its padded payload only.
    pub fn record_bytes(&self) -> u64 {
        match self.group {
            None => record_bytes(self.payload_len, self.block),
            Some(_) => round_up(self.payload_len, self.block),
        }
    }

    /// Offset of the payload in the segment.
    pub fn payload_offset(&self) -> u64 {
        match self.group {
            None => self.record_offset + self.block,
            Some(g) => g.payload_offset,
        }
    }

    /// Bytes from `record_offset` to the end of what this header's block
    /// describes: the record, or its whole group.
    pub fn extent_bytes(&self) -> u64 {
        match self.group {
            None => record_bytes(self.payload_len, self.block),
            Some(g) => g.bytes,
        }
    }
}

/// The group fields of a version-3 entry, checked against each other: the
/// entry's index inside a count its block can hold, the group a whole
/// number of blocks, the payload block-aligned, after the header block and
/// inside the group (with its padding).
fn decode_group_fields(
    b: &[u8],
    record_offset: u64,
    block: u64,
    payload_len: u64,
) -> Result<GroupPos, HeaderError> {
    let g = GroupPos {
        index: get_u16(b, OFF_GROUP_INDEX),
        count: get_u16(b, OFF_GROUP_COUNT),
        bytes: get_u64(b, OFF_GROUP_BYTES),
        payload_offset: get_u64(b, OFF_PAYLOAD_OFFSET),
    };
    if g.count < 2 || usize::from(g.count) > group_capacity(block) || g.index >= g.count {
        return Err(HeaderError::Field("group count"));
    }
    if !g.bytes.is_multiple_of(block) || !g.payload_offset.is_multiple_of(block) {
        return Err(HeaderError::Field("group alignment"));
    }
    let start = record_offset.checked_add(block);
    let end = record_offset.checked_add(g.bytes);
    let payload_end = g.payload_offset.checked_add(round_up(payload_len, block));
    match (start, end, payload_end) {
        (Some(s), Some(e), Some(p)) if g.payload_offset >= s && p <= e => Ok(g),
        _ => Err(HeaderError::Field("group payload offset")),
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
            group: None,
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
        put_u16(&mut enc, OFF_VERSION, 4);
        assert_eq!(RecordHeader::decode(&enc), Err(HeaderError::Version(4)));
    }

    fn group(block: u64, count: u16) -> Vec<RecordHeader> {
        let mut at = 8192 + block;
        let mut entries = Vec::new();
        let lens: Vec<u64> = (0..count).map(|i| 5000 + 3000 * u64::from(i)).collect();
        let bytes = block + lens.iter().map(|&l| round_up(l, block)).sum::<u64>();
        for (i, &len) in lens.iter().enumerate() {
            let mut h = header(block);
            h.key = StateKey::new(Namespace([3; 32]), 2, &[i as u8; 32]).unwrap();
            h.payload_len = len;
            h.sequence = 42 + i as u64;
            h.version = FORMAT_GROUP;
            h.group = Some(GroupPos {
                index: i as u16,
                count,
                bytes,
                payload_offset: at,
            });
            at += round_up(len, block);
            entries.push(h);
        }
        entries
    }

    /// A group's header block holds one verified entry per record, each
    /// naming its payload; every flipped bit of an entry is caught, and a
    /// group the block cannot hold, or entries of different groups, are
    /// refused at encoding.
    #[test]
    fn group_entries_round_trip_and_are_verified() {
        for block in [512, 4096] {
            let count = group_capacity(block) as u16;
            let entries = group(block, count);
            let mut enc = vec![0xAAu8; block as usize];
            RecordHeader::encode_group(&entries, &mut enc).unwrap();
            for (i, h) in entries.iter().enumerate() {
                let back = RecordHeader::decode_group_entry(&enc, i).unwrap();
                assert_eq!(&back, h);
                assert_eq!(back.version, FORMAT_GROUP);
                assert_eq!(back.payload_offset(), h.group.unwrap().payload_offset);
                assert_eq!(back.record_bytes(), round_up(h.payload_len, block));
                // An entry copied into another entry's place is refused.
                let j = (i + 1) % count as usize;
                let mut moved = enc.clone();
                moved.copy_within(i * 256..(i + 1) * 256, j * 256);
                assert_eq!(
                    RecordHeader::decode_group_entry(&moved, j),
                    Err(HeaderError::Field("group index"))
                );
            }
            // The first entry also decodes where the scan looks (offset 0).
            assert_eq!(RecordHeader::decode(&enc).unwrap(), entries[0]);
            assert_eq!(entries[0].extent_bytes(), entries[0].group.unwrap().bytes);
            for i in 0..HEADER_LEN as usize {
                let mut bad = enc.clone();
                bad[HEADER_LEN as usize + i] ^= 0x04;
                assert!(
                    RecordHeader::decode_group_entry(&bad, 1).is_err(),
                    "byte {i}"
                );
            }
            let mut too_many = entries.clone();
            too_many.push(entries[0]);
            assert_eq!(
                RecordHeader::encode_group(&too_many, &mut enc),
                Err(HeaderError::Field("group count"))
            );
            let mut mixed = entries.clone();
            mixed[1].record_offset += block;
            assert_eq!(
                RecordHeader::encode_group(&mixed, &mut enc),
                Err(HeaderError::Field("group entry"))
            );
            assert_eq!(
                entries[0].encode(),
                Err(HeaderError::Field("group")),
                "a group entry never gets a block of its own"
            );
        }
        assert_eq!(group_capacity(512), 2);
        assert_eq!(group_capacity(4096), MAX_GROUP_ENTRIES);
    }

    /// Group fields the checksum covers but that do not describe a
    /// payload inside its group are refused: a payload before the header
    /// block's end, past the group, unaligned, or an index past the count.
    #[test]
    fn group_fields_are_validated() {
        let entries = group(4096, 3);
        let reencode = |f: &dyn Fn(&mut GroupPos)| {
            let mut e = entries.clone();
            let mut g = e[1].group.unwrap();
            f(&mut g);
            e[1].group = Some(g);
            let mut block = vec![0u8; 4096];
            for (i, h) in e.iter().enumerate() {
                h.encode_entry(&mut block[i * 256..(i + 1) * 256]).unwrap();
            }
            RecordHeader::decode_group_entry(&block, 1)
        };
        assert!(reencode(&|_| {}).is_ok());
        type Edit<'a> = &'a dyn Fn(&mut GroupPos);
        let bad: [(Edit, &str); 6] = [
            (&|g| g.payload_offset = 8192, "group payload offset"),
            (
                &|g| g.payload_offset = 8192 + g.bytes,
                "group payload offset",
            ),
            (&|g| g.payload_offset += 512, "group alignment"),
            (&|g| g.bytes += 100, "group alignment"),
            (&|g| g.count = 1, "group count"),
            (&|g| g.count = 17, "group count"),
        ];
        for (f, why) in bad {
            assert_eq!(reencode(f), Err(HeaderError::Field(why)));
        }
        assert_eq!(
            reencode(&|g| g.index = 2),
            Err(HeaderError::Field("group index"))
        );
    }
}
