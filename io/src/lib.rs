//! Byte movers for OrbitKV: the DRAM host pool now; the SSD store, remote
//! tier and IPC in later issues (see ARCHITECTURE.md).
//!
//! - [`dram`]: one offset-addressed host region with slab-allocated,
//!   fixed-size slots per page-size class.
//! - [`lru`]: least-recently-used order of evictable (unleased) pages.

pub mod checksum;
pub mod dram;
pub mod lru;
pub mod tier;
