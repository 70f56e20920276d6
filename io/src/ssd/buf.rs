//! Store-owned, 4 KiB-aligned I/O buffers (O_DIRECT needs the address, the
//! length and the file offset aligned to the device's direct-I/O
//! alignment, at most 4 KiB; lengths are whole record blocks, multiples of
//! 512).

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::BTreeMap;
use std::ptr::NonNull;

use super::format::{MAX_BLOCK, MIN_BLOCK};

/// Address alignment of every buffer.
const ALIGN: usize = MAX_BLOCK as usize;
/// Lengths are multiples of this.
const UNIT: usize = MIN_BLOCK as usize;

/// A zero-initialised heap buffer whose address is 4 KiB aligned and whose
/// length is a multiple of 512.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned plain memory.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` rounded up to a multiple of 512; `None` if zero or the
    /// allocator refuses.
    pub(crate) fn new(len: usize) -> Option<AlignedBuf> {
        let len = len.checked_next_multiple_of(UNIT)?;
        if len == 0 {
            return None;
        }
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, len })
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, ALIGN),
            )
        }
    }
}

/// Recycles buffers by exact size, holding at most `max_bytes` idle.
pub(crate) struct BufPool {
    free: BTreeMap<usize, Vec<AlignedBuf>>,
    idle_bytes: usize,
    max_bytes: usize,
}

impl BufPool {
    pub(crate) fn new(max_bytes: usize) -> BufPool {
        BufPool {
            free: BTreeMap::new(),
            idle_bytes: 0,
            max_bytes,
        }
    }

    /// A buffer of `len` rounded up to 512. Recycled buffers hold stale
    /// bytes: callers overwrite (and zero-pad) what they use.
    pub(crate) fn get(&mut self, len: usize) -> Option<AlignedBuf> {
        let len = len.checked_next_multiple_of(UNIT)?;
        if let Some(list) = self.free.get_mut(&len)
            && let Some(buf) = list.pop()
        {
            self.idle_bytes -= buf.len();
            return Some(buf);
        }
        AlignedBuf::new(len)
    }

    pub(crate) fn put(&mut self, buf: AlignedBuf) {
        if self.idle_bytes + buf.len() > self.max_bytes {
            return;
        }
        self.idle_bytes += buf.len();
        self.free.entry(buf.len()).or_default().push(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_recycled() {
        let b = AlignedBuf::new(5000).unwrap();
        assert_eq!(b.len(), 5120);
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        assert!(AlignedBuf::new(0).is_none());
        let mut pool = BufPool::new(16384);
        let p = b.as_ptr();
        pool.put(b);
        let again = pool.get(4700).unwrap();
        assert_eq!(again.as_ptr(), p);
        pool.put(AlignedBuf::new(16384).unwrap());
        pool.put(again); // over max_bytes: dropped
        assert!(pool.get(16384).is_some());
    }
}
