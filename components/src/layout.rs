//! Storage layout and sealing: identity + layout + group shapes = namespace.
//!
//! The layout is the set of storage slots a registration declares; the
//! groups say what each group's pages mean (its recovery rule, with the
//! window, and its component kinds). Only what determines the stored bytes
//! and their meaning is sealed; where the bytes sit on the device
//! (`device_addr`) and how many pages the pool holds (`pool_capacity_pages`)
//! are carried for the runtime but never change the namespace. Two
//! registrations whose group 1 is a sliding window in one and a recurrent
//! checkpoint in the other, or whose windows differ, never share a page.
//!
//! Byte layout:
//!
//! ```text
//! namespace = SHA-256(frame("orbitkv/namespace", 2,
//!   1: identity[32]
//!   2: count:u64 ‖ slot*      sorted by (layer, group, tp_rank, pp_rank)
//!   3: count:u64 ‖ group*     sorted by id))
//! slot  := layer:u32 ‖ group:u32 ‖ tp_rank:u32 ‖ pp_rank:u32
//!        ‖ segment_bytes:u64 ‖ padded_page_bytes:u64 ‖ page_tokens:u32
//!        ‖ dtype (len:u64 ‖ utf8) ‖ layout (len:u64 ‖ utf8)
//!        ‖ stride_count:u64 ‖ stride:u64*
//! group := id:u32 ‖ rule:u8 (0 prefix, 1 window, 2 checkpoint)
//!        ‖ past_tokens:u64 (0 unless a window)
//!        ‖ kind_count:u64 ‖ kind:u8*   (sorted, distinct; tags below)
//! kind  := 0 attention_kv, 1 mla_kv, 2 sliding_window_kv,
//!          3 recurrent_checkpoint, 4 convolution_state, 5 dsa, 6 draft,
//!          7 auxiliary
//! ```

use serde::{Deserialize, Serialize};

use crate::api::Rank;
use crate::contract::{ComponentKind, GroupSpec, Rule};
use crate::encoding::{Digest32, Frame, put_str, put_u32, put_u64};
use crate::namespace::Namespace;

/// One registered storage slot: one layer's pages of one group on one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageSlot {
    pub layer: u32,
    pub group: u32,
    pub tp_rank: u32,
    pub pp_rank: u32,
    /// Payload bytes of one page of this slot.
    pub segment_bytes: u64,
    /// Bytes one page occupies after alignment padding.
    pub padded_page_bytes: u64,
    pub page_tokens: u32,
    pub dtype: String,
    /// Dimension order, e.g. `NHD` or `HND`.
    pub layout: String,
    /// Element strides of one page.
    pub strides: Vec<u64>,
    /// Device address of the slot's base; not part of the namespace.
    #[serde(default)]
    pub device_addr: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageLayout {
    pub slots: Vec<StorageSlot>,
    /// Pool capacity in pages; not part of the namespace.
    #[serde(default)]
    pub pool_capacity_pages: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("storage layout has no slots")]
    NoSlots,
    #[error("slot (layer {layer}, group {group}, tp {tp_rank}, pp {pp_rank}) is declared twice")]
    DuplicateSlot {
        layer: u32,
        group: u32,
        tp_rank: u32,
        pp_rank: u32,
    },
    #[error("slot (layer {layer}, group {group}): {reason}")]
    BadSlot {
        layer: u32,
        group: u32,
        reason: &'static str,
    },
    #[error("no groups are declared")]
    NoGroups,
    #[error("group {0} is declared twice")]
    DuplicateGroup(u32),
    #[error("group {0} lists a component kind twice")]
    DuplicateComponent(u32),
    #[error("slot (layer {layer}) names group {group}, which is not declared")]
    UndeclaredGroup { layer: u32, group: u32 },
}

impl StorageSlot {
    fn sort_key(&self) -> (u32, u32, u32, u32) {
        (self.layer, self.group, self.tp_rank, self.pp_rank)
    }

    fn validate(&self) -> Result<(), LayoutError> {
        let bad = |reason| LayoutError::BadSlot {
            layer: self.layer,
            group: self.group,
            reason,
        };
        if self.page_tokens == 0 {
            return Err(bad("page_tokens is 0"));
        }
        if self.segment_bytes == 0 {
            return Err(bad("segment_bytes is 0"));
        }
        if self.padded_page_bytes < self.segment_bytes {
            return Err(bad("padded_page_bytes is smaller than segment_bytes"));
        }
        if self.dtype.is_empty() {
            return Err(bad("dtype is empty"));
        }
        if self.layout.is_empty() {
            return Err(bad("layout is empty"));
        }
        Ok(())
    }

    fn encode_into(&self, out: &mut Vec<u8>) {
        put_u32(out, self.layer);
        put_u32(out, self.group);
        put_u32(out, self.tp_rank);
        put_u32(out, self.pp_rank);
        put_u64(out, self.segment_bytes);
        put_u64(out, self.padded_page_bytes);
        put_u32(out, self.page_tokens);
        put_str(out, &self.dtype);
        put_str(out, &self.layout);
        put_u64(out, self.strides.len() as u64);
        for s in &self.strides {
            put_u64(out, *s);
        }
    }
}

impl StorageLayout {
    /// The slots in canonical order, validated.
    pub fn canonical_slots(&self) -> Result<Vec<&StorageSlot>, LayoutError> {
        if self.slots.is_empty() {
            return Err(LayoutError::NoSlots);
        }
        let mut slots: Vec<&StorageSlot> = self.slots.iter().collect();
        slots.sort_by_key(|s| s.sort_key());
        for pair in slots.windows(2) {
            if pair[0].sort_key() == pair[1].sort_key() {
                let s = pair[0];
                return Err(LayoutError::DuplicateSlot {
                    layer: s.layer,
                    group: s.group,
                    tp_rank: s.tp_rank,
                    pp_rank: s.pp_rank,
                });
            }
        }
        for s in &slots {
            s.validate()?;
        }
        Ok(slots)
    }

    /// Canonical bytes of the sealed part of the layout.
    pub fn encode(&self) -> Result<Vec<u8>, LayoutError> {
        let slots = self.canonical_slots()?;
        let mut out = Vec::new();
        put_u64(&mut out, slots.len() as u64);
        for s in slots {
            s.encode_into(&mut out);
        }
        Ok(out)
    }

    /// One slot per rank and group (layer = the group's position), each page
    /// `page_bytes` of bfloat16 in `NHD`: the layout of test engines,
    /// benchmarks and simulated scenarios.
    pub fn uniform(
        ranks: &[Rank],
        groups: &[GroupSpec],
        page_tokens: u64,
        page_bytes: u64,
    ) -> Self {
        let mut slots = Vec::with_capacity(ranks.len() * groups.len());
        for rank in ranks {
            for (layer, g) in groups.iter().enumerate() {
                slots.push(StorageSlot {
                    layer: layer as u32,
                    group: g.id,
                    tp_rank: rank.tp,
                    pp_rank: rank.pp,
                    segment_bytes: page_bytes,
                    padded_page_bytes: page_bytes,
                    page_tokens: page_tokens as u32,
                    dtype: "bfloat16".into(),
                    layout: "NHD".into(),
                    strides: vec![128, 1],
                    device_addr: 0,
                });
            }
        }
        StorageLayout {
            slots,
            pool_capacity_pages: 0,
        }
    }

    /// The layout restricted to one (tp_rank, pp_rank): what one worker holds.
    pub fn for_rank(&self, tp_rank: u32, pp_rank: u32) -> StorageLayout {
        StorageLayout {
            slots: self
                .slots
                .iter()
                .filter(|s| s.tp_rank == tp_rank && s.pp_rank == pp_rank)
                .cloned()
                .collect(),
            pool_capacity_pages: self.pool_capacity_pages,
        }
    }
}

/// The pinned tag of a component kind in the sealed bytes.
fn kind_tag(kind: ComponentKind) -> u8 {
    match kind {
        ComponentKind::AttentionKv => 0,
        ComponentKind::MlaKv => 1,
        ComponentKind::SlidingWindowKv => 2,
        ComponentKind::RecurrentCheckpoint => 3,
        ComponentKind::ConvolutionState => 4,
        ComponentKind::Dsa => 5,
        ComponentKind::Draft => 6,
        ComponentKind::Auxiliary => 7,
    }
}

/// Canonical bytes of the group shapes: sorted by id, kinds sorted. Every
/// slot of `layout` must name a declared group.
pub fn encode_groups(layout: &StorageLayout, groups: &[GroupSpec]) -> Result<Vec<u8>, LayoutError> {
    if groups.is_empty() {
        return Err(LayoutError::NoGroups);
    }
    let mut sorted: Vec<&GroupSpec> = groups.iter().collect();
    sorted.sort_by_key(|g| g.id);
    if let Some(pair) = sorted.windows(2).find(|p| p[0].id == p[1].id) {
        return Err(LayoutError::DuplicateGroup(pair[0].id));
    }
    if let Some(s) = layout
        .slots
        .iter()
        .find(|s| sorted.binary_search_by_key(&s.group, |g| g.id).is_err())
    {
        return Err(LayoutError::UndeclaredGroup {
            layer: s.layer,
            group: s.group,
        });
    }
    let mut out = Vec::new();
    put_u64(&mut out, sorted.len() as u64);
    for g in sorted {
        put_u32(&mut out, g.id);
        let (rule, past_tokens) = match g.rule {
            Rule::Prefix => (0u8, 0),
            Rule::Window { past_tokens } => (1, past_tokens),
            Rule::Checkpoint => (2, 0),
        };
        out.push(rule);
        put_u64(&mut out, past_tokens);
        let mut kinds: Vec<u8> = g.components.iter().map(|k| kind_tag(*k)).collect();
        kinds.sort_unstable();
        if kinds.windows(2).any(|p| p[0] == p[1]) {
            return Err(LayoutError::DuplicateComponent(g.id));
        }
        put_u64(&mut out, kinds.len() as u64);
        out.extend_from_slice(&kinds);
    }
    Ok(out)
}

/// Binds a computation identity to a storage layout and the groups' shapes.
/// The result names the stored representation: two registrations share a
/// namespace exactly when they computed the same thing, store it in the
/// same bytes, and mean the same by each group's pages.
pub fn seal(
    identity: &Digest32,
    layout: &StorageLayout,
    groups: &[GroupSpec],
) -> Result<Namespace, LayoutError> {
    let mut frame = Frame::new("orbitkv/namespace", 2);
    frame
        .field(1, identity)
        .field(2, &layout.encode()?)
        .field(3, &encode_groups(layout, groups)?);
    Ok(Namespace(frame.sha256()))
}
