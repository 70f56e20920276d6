//! Byte movers for OrbitKV: the DRAM host pool and the SSD store now; the
//! remote tier and IPC in later issues (see ARCHITECTURE.md).
//!
//! - [`dram`]: one offset-addressed host region with slab-allocated,
//!   fixed-size slots per page-size class.
//! - [`lru`]: least-recently-used order of evictable (unleased) pages.
//! - [`ssd`]: the SSD tier, log-structured segment files read and written
//!   with O_DIRECT through io_uring (or a blocking worker pool).

pub mod checksum;
pub mod dram;
pub mod lru;
pub mod ssd;
pub mod tier;
