//! The open-time scan of one segment file: every header and every payload
//! checksum is verified; torn, partial or corrupt records are skipped and
//! counted. It steps [`MIN_BLOCK`] bytes at a time, so it finds records of
//! every block size (version-1 records, at 4 KiB, included), and jumps over
//! holes (`SEEK_DATA`), which hold no record. A file larger than the tier
//! could ever have written, by length or by allocated blocks, is refused
//! before it is walked.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::{FileExt, MetadataExt as _, OpenOptionsExt};
use std::path::Path;

use super::format::{HeaderError, MIN_BLOCK, RecordHeader, round_up};
use crate::checksum::page_checksum;

/// Reads through the file in windows of this many bytes.
const WINDOW: usize = 4 << 20;

/// What one segment holds.
#[derive(Debug, Default)]
pub(crate) struct SegmentScan {
    /// Valid records in file order.
    pub records: Vec<RecordHeader>,
    /// Skipped regions: a record whose payload fails its checksum or runs
    /// past the end of the file, or a stretch (up to the next valid record)
    /// holding non-empty blocks that do not parse as a header of this
    /// segment at that offset.
    pub corrupt: u64,
    /// File length in bytes.
    pub file_len: u64,
    /// Bytes read.
    pub bytes_read: u64,
}

struct Window<'f> {
    file: &'f File,
    file_len: u64,
    start: u64,
    buf: Vec<u8>,
    bytes_read: u64,
}

impl Window<'_> {
    /// `len` bytes at `pos`; the caller checked `pos + len <= file_len`.
    fn read(&mut self, pos: u64, len: usize) -> io::Result<&[u8]> {
        let end = pos + len as u64;
        if pos < self.start || end > self.start + self.buf.len() as u64 {
            let want = (len.max(WINDOW) as u64).min(self.file_len - pos) as usize;
            self.buf.resize(want, 0);
            self.file.read_exact_at(&mut self.buf, pos)?;
            self.bytes_read += want as u64;
            self.start = pos;
        }
        let at = (pos - self.start) as usize;
        Ok(&self.buf[at..at + len])
    }
}

/// Opens a segment file for reading, refusing anything but a regular file
/// without ever blocking: a FIFO or device named like a segment would hang
/// a plain open (or a read) forever, and a symlink points outside the store.
pub(crate) fn open_regular(path: &Path, flags: i32) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(flags | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(file)
}

/// Why a segment file was not scanned.
#[derive(Debug)]
pub(crate) enum ScanRefused {
    Io(io::Error),
    /// Longer, or holding more allocated bytes, than `max_bytes`: not a
    /// segment this tier wrote, and walking it would hold up the start.
    Oversized {
        len: u64,
        allocated: u64,
    },
}

impl From<io::Error> for ScanRefused {
    fn from(e: io::Error) -> Self {
        ScanRefused::Io(e)
    }
}

/// Where the data after `pos` starts, and where that data ends (`SEEK_DATA`
/// and `SEEK_HOLE`); `None` when only a hole is left, or when the
/// filesystem cannot say (then the caller steps as if all were data).
fn data_after(file: &File, pos: u64) -> Option<(u64, u64)> {
    let at = libc::off_t::try_from(pos).ok()?;
    // SAFETY: lseek on a descriptor we own; it moves only the offset, which
    // nothing here reads (reads are positioned).
    let data = unsafe { libc::lseek(file.as_raw_fd(), at, libc::SEEK_DATA) };
    if data < 0 {
        let e = io::Error::last_os_error();
        // ENXIO: no data past `pos`. Anything else: no hole support.
        return (e.raw_os_error() == Some(libc::ENXIO)).then_some((u64::MAX, u64::MAX));
    }
    // SAFETY: as above.
    let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) };
    Some((data as u64, if hole < 0 { u64::MAX } else { hole as u64 }))
}

/// Scans segment `id` at `path` (buffered reads; the file is not written),
/// refusing it unread when it is larger than `max_bytes`.
pub(crate) fn scan_segment(
    path: &Path,
    id: u64,
    max_bytes: u64,
) -> Result<SegmentScan, ScanRefused> {
    let file = open_regular(path, 0)?;
    let meta = file.metadata()?;
    let file_len = meta.len();
    let allocated = meta.blocks().saturating_mul(512);
    if file_len > max_bytes || allocated > max_bytes {
        return Err(ScanRefused::Oversized {
            len: file_len,
            allocated,
        });
    }
    let mut w = Window {
        file: &file,
        file_len,
        start: 0,
        buf: Vec::new(),
        bytes_read: 0,
    };
    let mut out = SegmentScan {
        file_len,
        ..SegmentScan::default()
    };
    let mut pos = 0u64;
    let mut in_bad_run = false;
    // Known to be data (not a hole) up to here.
    let mut data_until = 0u64;
    while pos + MIN_BLOCK <= file_len {
        let parsed = RecordHeader::decode(w.read(pos, MIN_BLOCK as usize)?);
        let header = match parsed {
            Err(HeaderError::Empty) => {
                // Zero blocks (padding, preallocated space) do not end a
                // bad run: a damaged record whose header block is larger
                // than the step counts once, whatever its padding.
                pos += MIN_BLOCK;
                if pos >= data_until {
                    // A hole holds no record: go to the next data, at the
                    // step it falls in.
                    match data_after(&file, pos) {
                        Some((data, end)) => {
                            let data = data.min(file_len);
                            pos = pos.max(data - data % MIN_BLOCK);
                            data_until = end;
                        }
                        None => data_until = u64::MAX,
                    }
                }
                continue;
            }
            // A record, or the first entry of a group (every entry of a
            // group names the group's offset; only entry 0 sits there).
            Ok(h)
                if h.segment_id == id
                    && h.record_offset == pos
                    && h.group.is_none_or(|g| g.index == 0) =>
            {
                h
            }
            _ => {
                if !in_bad_run {
                    out.corrupt += 1;
                    in_bad_run = true;
                }
                pos += MIN_BLOCK;
                continue;
            }
        };
        in_bad_run = false;
        if header.group.is_some() {
            match scan_group(&mut w, header, id, &mut out)? {
                Some(end) => {
                    pos = end;
                    continue;
                }
                None => break,
            }
        }
        let rec = header.record_bytes();
        if pos.checked_add(rec).is_none_or(|end| end > file_len) {
            // A header whose payload was cut off: every byte up to the end
            // of the file belongs to this record's extent.
            out.corrupt += 1;
            break;
        }
        let payload = w.read(pos + header.block, header.payload_len as usize)?;
        if page_checksum(payload) == header.payload_checksum {
            out.records.push(header);
        } else {
            out.corrupt += 1;
        }
        // The record's extent was allocated to it alone: skip all of it.
        pos += rec;
    }
    out.bytes_read = w.bytes_read;
    Ok(out)
}

/// A group whose first entry, `first`, is valid at its offset: each entry
/// of its header block that verifies, names this group and a payload after
/// the previous entry's, and whose payload matches its checksum, is
/// indexed; every other entry counts as corrupt. Returns where the group
/// ends, or `None` when it runs past the end of the file (cut off: every
/// byte up to the end belongs to it, as for a single record).
fn scan_group(
    w: &mut Window<'_>,
    first: RecordHeader,
    id: u64,
    out: &mut SegmentScan,
) -> io::Result<Option<u64>> {
    let Some(g) = first.group else {
        return Ok(Some(first.record_offset + first.extent_bytes()));
    };
    let pos = first.record_offset;
    let end = match pos.checked_add(g.bytes) {
        Some(end) if end <= w.file_len => end,
        _ => {
            out.corrupt += 1;
            return Ok(None);
        }
    };
    let block = w.read(pos, first.block as usize)?.to_vec();
    let mut next_payload = pos + first.block;
    for i in 0..usize::from(g.count) {
        let entry = if i == 0 {
            Ok(first)
        } else {
            RecordHeader::decode_group_entry(&block, i)
        };
        let h = match entry {
            Ok(h)
                if h.segment_id == id
                    && h.record_offset == pos
                    && h.block == first.block
                    && h.group.is_some_and(|e| {
                        e.count == g.count && e.bytes == g.bytes && e.payload_offset >= next_payload
                    }) =>
            {
                h
            }
            _ => {
                out.corrupt += 1;
                continue;
            }
        };
        let at = h.payload_offset();
        next_payload = at + round_up(h.payload_len, h.block);
        let payload = w.read(at, h.payload_len as usize)?;
        if page_checksum(payload) == h.payload_checksum {
            out.records.push(h);
        } else {
            out.corrupt += 1;
        }
    }
    Ok(Some(end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ssd::format::{FORMAT_GROUP, FORMAT_VERSION, GroupPos};
    use orbitkv_components::{Namespace, StateKey};
    use proptest::prelude::*;
    use std::os::unix::fs::FileExt;

    const B: u64 = 4096;

    fn header(i: u64, offset: u64, len: u64, sum: u64, group: Option<GroupPos>) -> RecordHeader {
        RecordHeader {
            segment_id: 1,
            record_offset: offset,
            sequence: i,
            key: StateKey::new(Namespace([4; 32]), 0, &i.to_le_bytes()).unwrap(),
            format_digest: [1; 32],
            payload_len: len,
            payload_checksum: sum,
            written_us: 0,
            block: B,
            version: if group.is_some() {
                FORMAT_GROUP
            } else {
                FORMAT_VERSION
            },
            group,
        }
    }

    fn payload(i: u64, len: u64) -> Vec<u8> {
        (0..len).map(|j| (j * 31 + i * 7 + 1) as u8).collect()
    }

    /// A segment image: a group of three records (lengths 5000, 4096,
    /// 9000) then a record of its own (3000 bytes). Returns the image and
    /// each record's (key index, payload offset).
    fn image() -> (Vec<u8>, Vec<(u64, u64)>) {
        let lens = [5000u64, 4096, 9000];
        let bytes = B + lens.iter().map(|&l| round_up(l, B)).sum::<u64>();
        let mut img = vec![0u8; (bytes + B + round_up(3000, B)) as usize];
        let mut at = B;
        let mut entries = Vec::new();
        let mut placed = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            let p = payload(i as u64, len);
            img[at as usize..(at + len) as usize].copy_from_slice(&p);
            let g = GroupPos {
                index: i as u16,
                count: 3,
                bytes,
                payload_offset: at,
            };
            entries.push(header(i as u64, 0, len, page_checksum(&p), Some(g)));
            placed.push((i as u64, at));
            at += round_up(len, B);
        }
        RecordHeader::encode_group(&entries, &mut img[..B as usize]).unwrap();
        let p = payload(3, 3000);
        header(3, bytes, 3000, page_checksum(&p), None)
            .encode_into(&mut img[bytes as usize..])
            .unwrap();
        img[(bytes + B) as usize..(bytes + B + 3000) as usize].copy_from_slice(&p);
        placed.push((3, bytes + B));
        (img, placed)
    }

    fn scan(img: &[u8]) -> SegmentScan {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("seg");
        let f = File::create(&path).unwrap();
        f.write_all_at(img, 0).unwrap();
        scan_segment(&path, 1, 1 << 30).unwrap()
    }

    #[test]
    fn an_intact_image_indexes_every_record() {
        let (img, placed) = image();
        let s = scan(&img);
        assert_eq!(s.corrupt, 0);
        let got: Vec<(u64, u64)> = s
            .records
            .iter()
            .map(|h| (h.sequence, h.payload_offset()))
            .collect();
        assert_eq!(got, placed);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Damage anywhere (flipped bytes, a cut): the scan never panics,
        /// and indexes only records as written, at their own offsets, whose
        /// payloads still match their checksums.
        #[test]
        fn damage_never_yields_a_record_that_was_not_written(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..), 0..8),
            cut in proptest::option::of(any::<prop::sample::Index>()),
        ) {
            let (mut img, placed) = image();
            for (at, x) in flips {
                let i = at.index(img.len());
                img[i] ^= x;
            }
            if let Some(c) = cut {
                img.truncate(c.index(img.len()));
            }
            let s = scan(&img);
            for h in &s.records {
                prop_assert!(placed.contains(&(h.sequence, h.payload_offset())), "{h:?}");
                let at = h.payload_offset() as usize;
                let p = &img[at..at + h.payload_len as usize];
                prop_assert_eq!(p, &payload(h.sequence, h.payload_len)[..]);
            }
        }

        /// Arbitrary bytes are never a record, and never a panic.
        #[test]
        fn noise_is_never_a_record(noise in proptest::collection::vec(any::<u8>(), 0..20_000)) {
            let s = scan(&noise);
            prop_assert!(s.records.is_empty());
        }
    }
}
