//! The runtime's stages, one module each, in the order `orbitkv-world`
//! declares: ingest, discover, validate, read, restore, fence, evict.
//!
//! Each stage is a plain function over queries and resources; its signature
//! says what it reads and writes. Structural changes go through `Commands`.

pub mod copies;
pub mod discover;
pub mod evict;
pub mod fence;
pub mod handoff;
pub mod ingest;
pub mod lifecycle;
mod load;
pub mod publish;
pub mod read;
pub mod resources;
pub mod restore;
pub mod validate;
