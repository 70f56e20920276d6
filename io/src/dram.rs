//! The DRAM tier's host pool: one host memory region carved into fixed-size
//! slots.
//!
//! # Offsets, not pointers
//!
//! The pool is a single contiguous region (today an anonymous
//! [`memmap2::MmapMut`]). Every slot is named by a generation-checked
//! [`SlotKey`] and located by its byte **offset** from the start of the
//! region, never by an address. Callers keep keys and offsets; the few
//! places that need an address (a DMA descriptor, a device copy) add the
//! offset to [`HostPool::base_ptr`] at the moment of use. That lets a later
//! issue back the region with shared memory (memfd, mapped at different
//! addresses in different processes) and register it once for pinned DMA
//! without changing any caller.
//!
//! # Slab layout
//!
//! The region is cut into equal **extents** of
//! [`HostPoolConfig::extent_bytes`] (2 MiB by default); a trailing remainder
//! smaller than one extent is not mapped. A request of `bytes` belongs to
//! the **size class** `bytes` rounded up to [`HostPoolConfig::slot_align`].
//! Each class owns a list of extents and a free list of slot offsets. When a
//! class has no free slot it takes the lowest free extent from the pool's
//! shared free-extent list and carves it into `extent_bytes / class_bytes`
//! slots (memcached-style slab allocation; any tail smaller than one slot is
//! left unused). Freed slots go back to their own class's free list, most
//! recently freed first.
//!
//! **Extents are never returned** to the shared list once a class has taken
//! them, even when all their slots are free: a pool whose mix of page sizes
//! shifts can therefore report [`PoolError::Exhausted`] for one class while
//! another holds free slots. The runtime uses one or a few page sizes, so
//! this keeps allocation O(log classes) with no compaction.
//!
//! A class may not exceed one extent ([`PoolError::TooLarge`]); the runtime
//! sizes `extent_bytes` at least as large as its largest page.
//!
//! All operations are bounded and report bad input as a [`PoolError`] or
//! `None`; none of them panics.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::time::Instant;

use memmap2::MmapMut;
use rayon::prelude::*;
use slotmap::{Key, KeyData, SlotMap};

/// Default extent size: 2 MiB (one huge page on x86-64).
pub const DEFAULT_EXTENT_BYTES: u64 = 2 << 20;
/// Default slot alignment and class granularity: 4 KiB.
pub const DEFAULT_SLOT_ALIGN: u64 = 4096;
/// Stride of [`HostPool::first_touch`]: one byte per 4 KiB OS page.
pub const TOUCH_STRIDE: usize = 4096;
/// Bytes handed to one rayon task by [`HostPool::first_touch`].
const TOUCH_CHUNK: usize = 2 << 20;
/// Most live slots at once; [`SlotMap`] holds fewer than `u32::MAX`.
const MAX_LIVE_SLOTS: usize = u32::MAX as usize - 2;
const GIB: f64 = (1u64 << 30) as f64;

slotmap::new_key_type! {
    /// Generation-checked name of one live slot. A key stays invalid after
    /// its slot is freed, even when the same offset is handed out again.
    pub struct SlotKey;
}

impl SlotKey {
    /// The key as a `u64`, for crates that store it without depending on
    /// slotmap.
    pub fn to_bits(self) -> u64 {
        self.data().as_ffi()
    }

    /// The key from [`SlotKey::to_bits`]. Any other `u64` gives a key that
    /// the pool treats as stale (or that names some unrelated live slot if
    /// the bits happen to match one); it never panics.
    pub fn from_bits(bits: u64) -> SlotKey {
        KeyData::from_ffi(bits).into()
    }
}

/// Size and layout of a [`HostPool`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPoolConfig {
    /// Bytes of host memory; rounded down to a multiple of `extent_bytes`.
    pub capacity_bytes: u64,
    /// Size of one extent, the unit a size class takes from the pool.
    /// Must be a non-zero multiple of `slot_align`. Default 2 MiB.
    pub extent_bytes: u64,
    /// Slot offset alignment and size-class granularity. Must be a power of
    /// two. Default 4096.
    pub slot_align: u64,
    /// Back the region with a shared-memory file (memfd) that client
    /// processes map (`HostPool::export_fd`), instead of private memory.
    pub shared: bool,
}

impl HostPoolConfig {
    /// `capacity_bytes` with the default extent size and alignment.
    pub fn new(capacity_bytes: u64) -> HostPoolConfig {
        HostPoolConfig {
            capacity_bytes,
            extent_bytes: DEFAULT_EXTENT_BYTES,
            slot_align: DEFAULT_SLOT_ALIGN,
            shared: false,
        }
    }
}

/// Everything that can go wrong in the pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// `slot_align` is zero or not a power of two.
    #[error("slot_align {slot_align} is not a power of two")]
    BadSlotAlign { slot_align: u64 },
    /// `extent_bytes` is zero or not a multiple of `slot_align`.
    #[error("extent_bytes {extent_bytes} is zero or not a multiple of slot_align {slot_align}")]
    BadExtent { extent_bytes: u64, slot_align: u64 },
    /// `capacity_bytes` rounded down to whole extents is zero.
    #[error("capacity_bytes {capacity_bytes} holds no whole extent of {extent_bytes} bytes")]
    CapacityTooSmall {
        capacity_bytes: u64,
        extent_bytes: u64,
    },
    /// The operating system refused the mapping (or it does not fit the
    /// address space).
    #[error("mapping {bytes} bytes of host memory failed: {reason}")]
    Map { bytes: u64, reason: String },
    /// A request for zero bytes.
    #[error("zero-byte slot requested")]
    ZeroSize,
    /// The request's size class is larger than one extent.
    #[error("{bytes} bytes exceed the extent size of {extent_bytes} bytes")]
    TooLarge { bytes: u64, extent_bytes: u64 },
    /// No free slot of this class and no free extent to carve one from.
    #[error("host pool exhausted for class of {class_bytes} bytes")]
    Exhausted { class_bytes: u64 },
    /// The key was freed already or never came from this pool.
    #[error("stale or unknown slot key")]
    StaleSlot,
}

/// What [`HostPool::first_touch`] did and how long it took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstTouchReport {
    /// Bytes of the region touched (the pool's capacity).
    pub bytes: u64,
    /// Wall time of the whole pass.
    pub seconds: f64,
    /// `seconds` per GiB touched.
    pub seconds_per_gib: f64,
    /// Rayon threads available to the pass.
    pub threads: usize,
}

/// Occupancy of one size class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassStats {
    /// Size of every slot in the class.
    pub class_bytes: u64,
    /// Extents the class owns.
    pub extents: u64,
    /// Live slots.
    pub slots_used: u64,
    /// Carved slots on the class's free list.
    pub slots_free: u64,
}

/// Occupancy of the whole pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    /// Mapped bytes (whole extents).
    pub capacity_bytes: u64,
    /// Extents in the region.
    pub extents_total: u64,
    /// Extents no class has taken yet.
    pub extents_free: u64,
    /// Live slots over all classes.
    pub slots_used: u64,
    /// Sum of the class sizes of live slots.
    pub bytes_used: u64,
    /// Per-class figures, sorted by `class_bytes`.
    pub classes: Vec<ClassStats>,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    offset: u64,
    class_bytes: u64,
}

#[derive(Debug, Default)]
struct Class {
    /// Extent indices owned by this class, in the order taken.
    extents: Vec<u64>,
    /// Offsets of carved, unused slots; the last one is handed out next.
    free: Vec<u64>,
    slots_used: u64,
}

/// Host memory region with slab-allocated, offset-addressed slots.
pub struct HostPool {
    map: MmapMut,
    /// The shared-memory file behind `map`, when the pool is shared.
    file: Option<std::fs::File>,
    /// A staging pool ([`HostPool::staging`]): its one client writes it,
    /// so its file is not sealed and its descriptor is read-write.
    client_writable: bool,
    capacity: u64,
    extent_bytes: u64,
    slot_align: u64,
    /// Free extent indices, highest first so `pop` yields the lowest.
    free_extents: Vec<u64>,
    /// Per extent: the class that owns it, or 0 when free.
    extent_owner: Vec<u64>,
    classes: BTreeMap<u64, Class>,
    slots: SlotMap<SlotKey, Slot>,
}

impl fmt::Debug for HostPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostPool")
            .field("capacity", &self.capacity)
            .field("extent_bytes", &self.extent_bytes)
            .field("slot_align", &self.slot_align)
            .field("extents_free", &self.free_extents.len())
            .field("slots_used", &self.slots.len())
            .finish_non_exhaustive()
    }
}

impl HostPool {
    /// Validates `config` and maps the region. Memory is reserved, not
    /// touched: call [`HostPool::first_touch`] to fault it in.
    pub fn new(config: HostPoolConfig) -> Result<HostPool, PoolError> {
        Self::build(config, false)
    }

    /// A shared pool one client writes into and the manager reads from: a
    /// copy agent's staging area. Its file is not sealed, and
    /// [`export_fd`](Self::export_fd) hands out a read-write descriptor.
    /// Never use it for pages other clients read.
    pub fn staging(mut config: HostPoolConfig) -> Result<HostPool, PoolError> {
        config.shared = true;
        Self::build(config, true)
    }

    fn build(config: HostPoolConfig, client_writable: bool) -> Result<HostPool, PoolError> {
        let HostPoolConfig {
            capacity_bytes,
            extent_bytes,
            slot_align,
            shared,
        } = config;
        if !slot_align.is_power_of_two() {
            return Err(PoolError::BadSlotAlign { slot_align });
        }
        if extent_bytes == 0 || !extent_bytes.is_multiple_of(slot_align) {
            return Err(PoolError::BadExtent {
                extent_bytes,
                slot_align,
            });
        }
        let extents = capacity_bytes / extent_bytes;
        let capacity = extents * extent_bytes;
        if capacity == 0 {
            return Err(PoolError::CapacityTooSmall {
                capacity_bytes,
                extent_bytes,
            });
        }
        let len = usize::try_from(capacity).map_err(|_| PoolError::Map {
            bytes: capacity,
            reason: "larger than the address space".to_owned(),
        })?;
        // The per-extent owner table must be allocatable too.
        let extent_count = usize::try_from(extents).map_err(|_| PoolError::Map {
            bytes: capacity,
            reason: "too many extents for the address space".to_owned(),
        })?;
        let map_err = |e: std::io::Error| PoolError::Map {
            bytes: capacity,
            reason: e.to_string(),
        };
        let (map, file) = if client_writable {
            let (file, map) = staging_memory("orbitkv-staging", capacity).map_err(map_err)?;
            (map, Some(file))
        } else if shared {
            let (file, map) = sealed_pool_memory("orbitkv-host-pool", capacity).map_err(map_err)?;
            (map, Some(file))
        } else {
            (MmapMut::map_anon(len).map_err(map_err)?, None)
        };
        Ok(HostPool {
            map,
            file,
            client_writable,
            capacity,
            extent_bytes,
            slot_align,
            free_extents: (0..extents).rev().collect(),
            extent_owner: vec![0; extent_count],
            classes: BTreeMap::new(),
            slots: SlotMap::with_key(),
        })
    }

    /// A new read-only descriptor for the shared pool's memory file, to
    /// hand to a client process; `None` for a private pool (read-write for
    /// a staging pool). The file is
    /// sealed against writable mappings and resizing
    /// ([`sealed_pool_memory`]), so no descriptor to it, however reopened,
    /// lets a client change a byte.
    pub fn export_fd(&self) -> Option<std::os::fd::OwnedFd> {
        use std::os::fd::AsRawFd;
        let file = self.file.as_ref()?;
        if self.client_writable {
            return file.try_clone().ok().map(std::os::fd::OwnedFd::from);
        }
        // A fresh open file description, read-only (a dup would share the
        // manager's read-write one).
        // Without /proc, a duplicate: the seals protect the pool either way.
        std::fs::OpenOptions::new()
            .read(true)
            .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .or_else(|_| file.try_clone())
            .ok()
            .map(std::os::fd::OwnedFd::from)
    }

    /// Faults the whole region in by writing one byte per 4 KiB OS page,
    /// in parallel on the rayon pool, and reports the wall time.
    ///
    /// Meant for startup, before any slot is allocated: it then writes
    /// zeros (the region's content already). If slots are live it rewrites
    /// each touched byte with its current value instead, so slot contents
    /// are never disturbed.
    pub fn first_touch(&mut self) -> FirstTouchReport {
        let preserve = !self.slots.is_empty();
        let start = Instant::now();
        self.map[..].par_chunks_mut(TOUCH_CHUNK).for_each(|chunk| {
            for page in chunk.chunks_mut(TOUCH_STRIDE) {
                if let Some(byte) = page.first_mut() {
                    if preserve {
                        let p: *mut u8 = byte;
                        // SAFETY: `p` comes from a live `&mut u8`, so it is
                        // valid, aligned and exclusively ours for both
                        // accesses. Volatile keeps the store from being
                        // elided as a no-op.
                        unsafe { p.write_volatile(p.read_volatile()) };
                    } else {
                        *byte = 0;
                    }
                }
            }
        });
        let seconds = start.elapsed().as_secs_f64();
        let gib = self.capacity as f64 / GIB;
        FirstTouchReport {
            bytes: self.capacity,
            seconds,
            seconds_per_gib: seconds / gib,
            threads: rayon::current_num_threads(),
        }
    }

    /// The size class of a `bytes` request, or why there is none.
    fn class_of(&self, bytes: u64) -> Result<u64, PoolError> {
        if bytes == 0 {
            return Err(PoolError::ZeroSize);
        }
        if bytes > self.extent_bytes {
            return Err(PoolError::TooLarge {
                bytes,
                extent_bytes: self.extent_bytes,
            });
        }
        // bytes <= extent_bytes, a multiple of slot_align: no overflow, and
        // the class never exceeds the extent.
        Ok(bytes.next_multiple_of(self.slot_align))
    }

    /// Allocates a slot of at least `bytes` (its class: `bytes` rounded up
    /// to `slot_align`). Slot contents are whatever the last user left.
    pub fn alloc(&mut self, bytes: u64) -> Result<SlotKey, PoolError> {
        let class_bytes = self.class_of(bytes)?;
        if self.slots.len() >= MAX_LIVE_SLOTS {
            return Err(PoolError::Exhausted { class_bytes });
        }
        let has_free_slot = self
            .classes
            .get(&class_bytes)
            .is_some_and(|c| !c.free.is_empty());
        if !has_free_slot && self.free_extents.is_empty() {
            // Checked before `entry` so a failed request leaves no empty
            // class behind in the stats.
            return Err(PoolError::Exhausted { class_bytes });
        }
        let class = self.classes.entry(class_bytes).or_default();
        if class.free.is_empty() {
            let Some(extent) = self.free_extents.pop() else {
                return Err(PoolError::Exhausted { class_bytes });
            };
            if let Some(owner) = usize::try_from(extent)
                .ok()
                .and_then(|i| self.extent_owner.get_mut(i))
            {
                *owner = class_bytes;
            }
            class.extents.push(extent);
            let start = extent * self.extent_bytes;
            let per_extent = self.extent_bytes / class_bytes;
            class
                .free
                .extend((0..per_extent).rev().map(|i| start + i * class_bytes));
        }
        let Some(offset) = class.free.pop() else {
            return Err(PoolError::Exhausted { class_bytes });
        };
        class.slots_used += 1;
        Ok(self.slots.insert(Slot {
            offset,
            class_bytes,
        }))
    }

    /// Returns a slot to its class's free list. The key is stale afterwards.
    pub fn free(&mut self, key: SlotKey) -> Result<(), PoolError> {
        let slot = self.slots.remove(key).ok_or(PoolError::StaleSlot)?;
        if let Some(class) = self.classes.get_mut(&slot.class_bytes) {
            class.slots_used = class.slots_used.saturating_sub(1);
            class.free.push(slot.offset);
        }
        Ok(())
    }

    /// Byte offset of a live slot from the start of the region.
    pub fn offset(&self, key: SlotKey) -> Option<u64> {
        self.slots.get(key).map(|s| s.offset)
    }

    /// Size of a live slot (its class size).
    pub fn slot_len(&self, key: SlotKey) -> Option<u64> {
        self.slots.get(key).map(|s| s.class_bytes)
    }

    /// Region range of the first `len` bytes of a live slot.
    fn range(&self, key: SlotKey, len: u64) -> Option<std::ops::Range<usize>> {
        let slot = self.slots.get(key)?;
        if len > slot.class_bytes {
            return None;
        }
        // offset + class_bytes <= capacity, which fits usize.
        let start = usize::try_from(slot.offset).ok()?;
        let len = usize::try_from(len).ok()?;
        Some(start..start.checked_add(len)?)
    }

    /// The first `len` bytes of a live slot; `None` if the key is stale or
    /// `len` exceeds the slot.
    pub fn bytes(&self, key: SlotKey, len: u64) -> Option<&[u8]> {
        let range = self.range(key, len)?;
        self.map.get(range)
    }

    /// Mutable view of the first `len` bytes of a live slot; `None` if the
    /// key is stale or `len` exceeds the slot.
    pub fn bytes_mut(&mut self, key: SlotKey, len: u64) -> Option<&mut [u8]> {
        let range = self.range(key, len)?;
        self.map.get_mut(range)
    }

    /// Mutable views of several live slots at once (the first `len` bytes
    /// of each, in the order given), so they can be filled in parallel.
    /// `None` if a key is stale, a `len` exceeds its slot, or two entries
    /// name the same slot.
    pub fn slots_mut(&mut self, slots: &[(SlotKey, u64)]) -> Option<Vec<&mut [u8]>> {
        let mut ranges: Vec<(usize, std::ops::Range<usize>)> = slots
            .iter()
            .enumerate()
            .map(|(n, &(key, len))| Some((n, self.range(key, len)?)))
            .collect::<Option<_>>()?;
        ranges.sort_by_key(|(_, r)| r.start);
        // Carve the map front to back; live slots never overlap, and a
        // repeated slot is refused here rather than aliased.
        let mut out: Vec<Option<&mut [u8]>> = (0..slots.len()).map(|_| None).collect();
        let mut rest: &mut [u8] = &mut self.map[..];
        let mut at = 0usize;
        for (n, r) in ranges {
            let skip = r.start.checked_sub(at)?;
            let (_, tail) = std::mem::take(&mut rest).split_at_mut_checked(skip)?;
            let (view, tail) = tail.split_at_mut_checked(r.len())?;
            out[n] = Some(view);
            rest = tail;
            at = r.end;
        }
        out.into_iter().collect()
    }

    /// Address of offset 0, for DMA registration and device copies. Valid
    /// until the pool is dropped; add a slot's [`offset`](Self::offset) at
    /// the moment of use rather than storing derived pointers.
    pub fn base_ptr(&mut self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Mapped bytes: `capacity_bytes` rounded down to whole extents.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Extent size from the config.
    pub fn extent_bytes(&self) -> u64 {
        self.extent_bytes
    }

    /// Slot alignment from the config.
    pub fn slot_align(&self) -> u64 {
        self.slot_align
    }

    /// Whether [`alloc`](Self::alloc)`(bytes)` would succeed now: a free
    /// slot of that class exists or a free extent does.
    pub fn can_alloc(&self, bytes: u64) -> bool {
        let Ok(class_bytes) = self.class_of(bytes) else {
            return false;
        };
        if self.slots.len() >= MAX_LIVE_SLOTS {
            return false;
        }
        !self.free_extents.is_empty()
            || self
                .classes
                .get(&class_bytes)
                .is_some_and(|c| !c.free.is_empty())
    }

    /// Slots an allocation of `class_bytes` could take now without freeing
    /// anything: carved free slots of that class, and the slots free extents
    /// would give it. Zero for a size no slot can hold, or at the live-slot
    /// bound.
    pub fn free_slots(&self, class_bytes: u64) -> u64 {
        let Ok(class_bytes) = self.class_of(class_bytes) else {
            return 0;
        };
        if self.slots.len() >= MAX_LIVE_SLOTS {
            return 0;
        }
        let carved = self
            .classes
            .get(&class_bytes)
            .map_or(0, |c| c.free.len() as u64);
        let per_extent = self.extent_bytes / class_bytes;
        carved + self.free_extents.len() as u64 * per_extent
    }

    /// Occupancy figures; classes sorted by size.
    pub fn stats(&self) -> PoolStats {
        let classes: Vec<ClassStats> = self
            .classes
            .iter()
            .map(|(&class_bytes, c)| ClassStats {
                class_bytes,
                extents: c.extents.len() as u64,
                slots_used: c.slots_used,
                slots_free: c.free.len() as u64,
            })
            .collect();
        PoolStats {
            capacity_bytes: self.capacity,
            extents_total: self.extent_owner.len() as u64,
            extents_free: self.free_extents.len() as u64,
            slots_used: self.slots.len() as u64,
            bytes_used: classes
                .iter()
                .map(|c| c.class_bytes.saturating_mul(c.slots_used))
                .fold(0, u64::saturating_add),
            classes,
        }
    }

    /// Checks the pool's bookkeeping: extents are either free or owned by
    /// exactly one class; every live or free slot sits on its class's slot
    /// grid inside an extent that class owns; no two live slots overlap and
    /// no free-list slot is live or listed twice; per class, live plus free
    /// slots equal the slots its extents hold. O(slots + extents).
    pub fn check_invariants(&self) -> Result<(), String> {
        let total = self.extent_owner.len() as u64;
        if total * self.extent_bytes != self.capacity {
            return Err(format!(
                "{total} extents of {} bytes != capacity {}",
                self.extent_bytes, self.capacity
            ));
        }
        if self.map.len() as u64 != self.capacity {
            return Err(format!(
                "mapping of {} bytes != capacity {}",
                self.map.len(),
                self.capacity
            ));
        }
        let owner = |extent: u64| -> Option<u64> {
            usize::try_from(extent)
                .ok()
                .and_then(|i| self.extent_owner.get(i))
                .copied()
        };

        // Extent ownership.
        let mut seen_extents = HashSet::new();
        for &e in &self.free_extents {
            if owner(e) != Some(0) {
                return Err(format!(
                    "free extent {e} is out of range or owned by {:?}",
                    owner(e)
                ));
            }
            if !seen_extents.insert(e) {
                return Err(format!("extent {e} listed twice"));
            }
        }
        for (&class_bytes, class) in &self.classes {
            if class_bytes == 0
                || class_bytes > self.extent_bytes
                || !class_bytes.is_multiple_of(self.slot_align)
            {
                return Err(format!("invalid class size {class_bytes}"));
            }
            for &e in &class.extents {
                if owner(e) != Some(class_bytes) {
                    return Err(format!(
                        "extent {e} of class {class_bytes} has owner {:?}",
                        owner(e)
                    ));
                }
                if !seen_extents.insert(e) {
                    return Err(format!("extent {e} listed twice"));
                }
            }
        }
        if seen_extents.len() as u64 != total {
            return Err(format!(
                "{} extents accounted for, {total} exist",
                seen_extents.len()
            ));
        }

        // A slot position is valid for `class_bytes` when it lies on the
        // class's grid inside an extent the class owns.
        let on_grid = |offset: u64, class_bytes: u64| -> Result<(), String> {
            let extent = offset / self.extent_bytes;
            if owner(extent) != Some(class_bytes) {
                return Err(format!(
                    "slot at {offset} (class {class_bytes}) lies in extent {extent} owned by {:?}",
                    owner(extent)
                ));
            }
            let within = offset - extent * self.extent_bytes;
            let per_extent = self.extent_bytes / class_bytes;
            if !within.is_multiple_of(class_bytes) || within / class_bytes >= per_extent {
                return Err(format!(
                    "slot at {offset} is off the grid of class {class_bytes}"
                ));
            }
            Ok(())
        };

        // Live slots.
        let mut live: Vec<(u64, u64)> = Vec::with_capacity(self.slots.len());
        let mut live_per_class: BTreeMap<u64, u64> = BTreeMap::new();
        for (_, slot) in &self.slots {
            if !self.classes.contains_key(&slot.class_bytes) {
                return Err(format!(
                    "live slot at {} has unknown class {}",
                    slot.offset, slot.class_bytes
                ));
            }
            on_grid(slot.offset, slot.class_bytes)?;
            live.push((slot.offset, slot.class_bytes));
            *live_per_class.entry(slot.class_bytes).or_default() += 1;
        }
        live.sort_unstable();
        for pair in live.windows(2) {
            if let [(a, a_len), (b, _)] = pair
                && a + a_len > *b
            {
                return Err(format!("live slots at {a} and {b} overlap"));
            }
        }
        let live_offsets: HashSet<u64> = live.iter().map(|&(o, _)| o).collect();

        // Free lists and counts.
        let mut used_sum = 0u64;
        for (&class_bytes, class) in &self.classes {
            let mut seen = HashSet::with_capacity(class.free.len());
            for &offset in &class.free {
                on_grid(offset, class_bytes)?;
                if live_offsets.contains(&offset) {
                    return Err(format!(
                        "free slot at {offset} (class {class_bytes}) is live"
                    ));
                }
                if !seen.insert(offset) {
                    return Err(format!(
                        "slot at {offset} listed twice on class {class_bytes}'s free list"
                    ));
                }
            }
            let live_here = live_per_class.get(&class_bytes).copied().unwrap_or(0);
            if live_here != class.slots_used {
                return Err(format!(
                    "class {class_bytes}: {live_here} live slots, counter says {}",
                    class.slots_used
                ));
            }
            let carved = class.extents.len() as u64 * (self.extent_bytes / class_bytes);
            if class.slots_used + class.free.len() as u64 != carved {
                return Err(format!(
                    "class {class_bytes}: {} used + {} free != {carved} carved",
                    class.slots_used,
                    class.free.len()
                ));
            }
            used_sum += class.slots_used;
        }
        if used_sum != self.slots.len() as u64 {
            return Err(format!(
                "class counters sum to {used_sum}, {} slots live",
                self.slots.len()
            ));
        }
        Ok(())
    }
}

/// The shared pool's memory: a memfd mapped read-write by this process
/// only. After the mapping it is sealed with `F_SEAL_FUTURE_WRITE` (no new
/// writable mapping or `write(2)`, by anyone, ever), `F_SEAL_SHRINK` and
/// `F_SEAL_GROW` (no client can fault the manager by truncating it), and
/// `F_SEAL_SEAL`. Clients map it read-only and `mprotect` cannot add write
/// access to their mappings.
pub fn sealed_pool_memory(
    name: &str,
    len: u64,
) -> std::io::Result<(std::fs::File, memmap2::MmapMut)> {
    let fd = memfd::MemfdOptions::default()
        .close_on_exec(true)
        .allow_sealing(true)
        .create(name)
        .map_err(std::io::Error::other)?;
    fd.as_file().set_len(len)?;
    // SAFETY: the file is ours; the mapping made here is the only writable
    // one there will ever be (sealed below).
    let map = unsafe { memmap2::MmapMut::map_mut(fd.as_file())? };
    fd.add_seals(&[
        memfd::FileSeal::SealFutureWrite,
        memfd::FileSeal::SealShrink,
        memfd::FileSeal::SealGrow,
        memfd::FileSeal::SealSeal,
    ])
    .map_err(std::io::Error::other)?;
    Ok((fd.into_file(), map))
}

/// A staging area's memory file: its one client maps it writable, so only
/// its size is sealed (`F_SEAL_SHRINK`, `F_SEAL_GROW`, `F_SEAL_SEAL`): the
/// client cannot truncate it under the manager's reads, which would fault
/// the manager.
pub fn staging_memory(name: &str, len: u64) -> std::io::Result<(std::fs::File, memmap2::MmapMut)> {
    let fd = memfd::MemfdOptions::default()
        .close_on_exec(true)
        .allow_sealing(true)
        .create(name)
        .map_err(std::io::Error::other)?;
    fd.as_file().set_len(len)?;
    fd.add_seals(&[
        memfd::FileSeal::SealShrink,
        memfd::FileSeal::SealGrow,
        memfd::FileSeal::SealSeal,
    ])
    .map_err(std::io::Error::other)?;
    let file = fd.into_file();
    // SAFETY: the manager reads only slots whose copy its agent reported;
    // the bytes may still change under it, which the fused copy tolerates
    // (it checksums what it wrote into the pool).
    let map = unsafe { memmap2::MmapMut::map_mut(&file)? };
    Ok((file, map))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> HostPool {
        let mut p = HostPool::new(HostPoolConfig {
            capacity_bytes: 4 * 65536,
            extent_bytes: 65536,
            slot_align: 4096,
            shared: false,
        })
        .unwrap();
        p.alloc(4096).unwrap();
        p.alloc(4096).unwrap();
        p.alloc(8192).unwrap();
        p.check_invariants().unwrap();
        p
    }

    fn live_offset(p: &HostPool, class_bytes: u64) -> u64 {
        p.slots
            .values()
            .find(|s| s.class_bytes == class_bytes)
            .unwrap()
            .offset
    }

    #[test]
    fn checker_catches_live_slot_on_free_list() {
        let mut p = pool();
        let off = live_offset(&p, 4096);
        let class = p.classes.get_mut(&4096).unwrap();
        class.free.pop();
        class.free.push(off);
        assert!(p.check_invariants().unwrap_err().contains("is live"));
    }

    #[test]
    fn checker_catches_overlap() {
        let mut p = pool();
        let off = live_offset(&p, 4096);
        p.slots.insert(Slot {
            offset: off,
            class_bytes: 4096,
        });
        let class = p.classes.get_mut(&4096).unwrap();
        class.slots_used += 1;
        class.free.pop();
        assert!(p.check_invariants().unwrap_err().contains("overlap"));
    }

    #[test]
    fn checker_catches_foreign_extent() {
        let mut p = pool();
        let off = live_offset(&p, 8192);
        p.slots.insert(Slot {
            offset: off,
            class_bytes: 4096,
        });
        assert!(p.check_invariants().unwrap_err().contains("owned by"));
    }

    #[test]
    fn free_slots_counts_carved_slots_and_free_extents() {
        let mut p = pool();
        // Two 4 KiB slots used of one extent (16 carved), one 8 KiB of
        // another (8); the other two extents are free.
        assert_eq!(p.free_slots(4096), 14 + 2 * 16);
        assert_eq!(p.free_slots(4000), 14 + 2 * 16, "rounded to its class");
        assert_eq!(p.free_slots(8192), 7 + 2 * 8);
        assert_eq!(p.free_slots(65536), 2);
        assert_eq!(p.free_slots(65537), 0, "no slot holds it");
        assert_eq!(p.free_slots(0), 0);
        while p.alloc(65536).is_ok() {}
        assert_eq!(p.free_slots(4096), 14, "only carved slots are left");
        let k = p.alloc(4096).unwrap();
        assert_eq!(p.free_slots(4096), 13);
        p.free(k).unwrap();
        assert_eq!(p.free_slots(4096), 14);
    }

    #[test]
    fn checker_catches_bad_counts() {
        let mut p = pool();
        p.classes.get_mut(&8192).unwrap().slots_used += 1;
        assert!(p.check_invariants().unwrap_err().contains("counter"));

        let mut p = pool();
        p.classes.get_mut(&8192).unwrap().free.pop();
        assert!(p.check_invariants().unwrap_err().contains("carved"));

        let mut p = pool();
        let dup = *p.classes[&4096].free.last().unwrap();
        p.classes.get_mut(&4096).unwrap().free.push(dup);
        assert!(p.check_invariants().unwrap_err().contains("twice"));

        let mut p = pool();
        p.free_extents.pop();
        assert!(p.check_invariants().unwrap_err().contains("accounted"));
    }
}
