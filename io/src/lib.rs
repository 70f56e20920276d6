//! Byte movers for OrbitKV: the DRAM host pool, the SSD store and the
//! remote tier (see ARCHITECTURE.md; the wire is `orbitkv-ipc`).
//!
//! - [`dram`]: one offset-addressed host region with slab-allocated,
//!   fixed-size slots per page-size class.
//! - [`lru`]: least-recently-used order of evictable (unleased) pages.
//! - [`ssd`]: the SSD tier, log-structured segment files read and written
//!   with O_DIRECT through io_uring (or a blocking worker pool).
//! - [`remote`]: the remote tier, pages in Redis / Redis Cluster shared
//!   across hosts, verified on every read.

pub mod checksum;
pub mod dram;
pub mod lru;
pub mod remote;
pub mod ssd;
pub mod tier;
