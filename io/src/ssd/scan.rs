//! The open-time scan of one segment file: every header and every payload
//! checksum is verified; torn, partial or corrupt records are skipped and
//! counted. It steps [`MIN_BLOCK`] bytes at a time, so it finds records of
//! every block size (version-1 records, at 4 KiB, included).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use super::format::{HeaderError, MIN_BLOCK, RecordHeader};
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

/// Scans segment `id` at `path` (buffered reads; the file is not written).
pub(crate) fn scan_segment(path: &Path, id: u64) -> io::Result<SegmentScan> {
    let file = open_regular(path, 0)?;
    let file_len = file.metadata()?.len();
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
    while pos + MIN_BLOCK <= file_len {
        let parsed = RecordHeader::decode(w.read(pos, MIN_BLOCK as usize)?);
        let header = match parsed {
            Err(HeaderError::Empty) => {
                // Zero blocks (padding, preallocated space) do not end a
                // bad run: a damaged record whose header block is larger
                // than the step counts once, whatever its padding.
                pos += MIN_BLOCK;
                continue;
            }
            Ok(h) if h.segment_id == id && h.record_offset == pos => h,
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
