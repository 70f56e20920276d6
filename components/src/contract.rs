//! The compiled recovery contract: which pages of which groups must be present
//! for an engine to resume at a token boundary.
//!
//! Implements the spec's "Compiled hybrid recovery". Adapters declare groups
//! with a [`Rule`] and the [`ComponentKind`]s they hold;
//! [`RecoveryContract::compile`] normalizes that once into page demand, and
//! everything else derives from [`RecoveryContract::required_ranges`]:
//!
//! - a **prefix** group needs the whole queried tail `[start, end)`;
//! - a **window** group needs the last `ceil(past_tokens / page)` pages ending at
//!   `end`, capped by the tail;
//! - a **checkpoint** group needs only the page ending exactly at `end`.
//!
//! [`RecoveryContract::restorable_boundaries`] checks evidence (the page ends a
//! rank actually holds) against that same demand, so ranges and legality
//! cannot disagree. All positions are absolute token offsets; ranges are
//! half-open and page-aligned.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::key::{KeyHasher, KeySet, StateKey};
use crate::namespace::Namespace;

/// What one cache group stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ComponentKind {
    AttentionKv,
    MlaKv,
    SlidingWindowKv,
    RecurrentCheckpoint,
    ConvolutionState,
    /// DeepSeek sparse-attention indexer state. Declared so it can be refused.
    Dsa,
    /// Speculative-decoding draft model state. Declared so it can be refused.
    Draft,
    /// Any other auxiliary state. Declared so it can be refused.
    Auxiliary,
}

impl ComponentKind {
    /// The rule this component can be recovered under, or `None` when the
    /// contract has no capability definition for it.
    pub fn rule_kind(self) -> Option<RuleKind> {
        match self {
            ComponentKind::AttentionKv | ComponentKind::MlaKv => Some(RuleKind::Prefix),
            ComponentKind::SlidingWindowKv => Some(RuleKind::Window),
            ComponentKind::RecurrentCheckpoint | ComponentKind::ConvolutionState => {
                Some(RuleKind::Checkpoint)
            }
            ComponentKind::Dsa | ComponentKind::Draft | ComponentKind::Auxiliary => None,
        }
    }
}

impl fmt::Display for ComponentKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = serde_json::to_value(self).expect("unit variant serializes");
        f.write_str(s.as_str().unwrap_or("?"))
    }
}

/// A group's recovery rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "RuleRepr", into = "RuleRepr")]
pub enum Rule {
    Prefix,
    Window { past_tokens: u64 },
    Checkpoint,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RuleKind {
    Prefix,
    Window,
    Checkpoint,
}

impl fmt::Display for RuleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RuleKind::Prefix => "prefix",
            RuleKind::Window => "window",
            RuleKind::Checkpoint => "checkpoint",
        })
    }
}

impl Rule {
    pub fn kind(&self) -> RuleKind {
        match self {
            Rule::Prefix => RuleKind::Prefix,
            Rule::Window { .. } => RuleKind::Window,
            Rule::Checkpoint => RuleKind::Checkpoint,
        }
    }
}

/// JSON form: `"prefix"`, `{"window": 100}`, `"checkpoint"`.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum RuleRepr {
    Prefix,
    Window(u64),
    Checkpoint,
}

impl From<RuleRepr> for Rule {
    fn from(r: RuleRepr) -> Self {
        match r {
            RuleRepr::Prefix => Rule::Prefix,
            RuleRepr::Window(past_tokens) => Rule::Window { past_tokens },
            RuleRepr::Checkpoint => Rule::Checkpoint,
        }
    }
}

impl From<Rule> for RuleRepr {
    fn from(r: Rule) -> Self {
        match r {
            Rule::Prefix => RuleRepr::Prefix,
            Rule::Window { past_tokens } => RuleRepr::Window(past_tokens),
            Rule::Checkpoint => RuleRepr::Checkpoint,
        }
    }
}

/// A declared group, before compilation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSpec {
    pub id: u32,
    pub rule: Rule,
    pub components: Vec<ComponentKind>,
}

impl GroupSpec {
    /// Full attention KV: a prefix.
    pub fn attention(id: u32) -> Self {
        GroupSpec {
            id,
            rule: Rule::Prefix,
            components: vec![ComponentKind::AttentionKv],
        }
    }

    /// Sliding-window KV keeping `past_tokens` tokens.
    pub fn sliding_window(id: u32, past_tokens: u64) -> Self {
        GroupSpec {
            id,
            rule: Rule::Window { past_tokens },
            components: vec![ComponentKind::SlidingWindowKv],
        }
    }

    /// A recurrent checkpoint with its convolution state.
    pub fn recurrent(id: u32) -> Self {
        GroupSpec {
            id,
            rule: Rule::Checkpoint,
            components: vec![
                ComponentKind::RecurrentCheckpoint,
                ComponentKind::ConvolutionState,
            ],
        }
    }
}

/// A declared contract (the contract JSON of `orbitkv contract`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContractSpec {
    pub namespace: Namespace,
    pub page_tokens: u64,
    pub groups: Vec<GroupSpec>,
}

/// Evidence from one rank: for each registered group, the absolute token ends
/// of the pages it holds within `(start, end]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateBundle {
    pub namespace: Namespace,
    pub start: u64,
    pub end: u64,
    pub groups: Vec<GroupEvidence>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupEvidence {
    pub group: u32,
    pub page_ends: Vec<u64>,
}

/// One group's demand: absolute, half-open, page-aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RequiredRange {
    pub group: u32,
    pub start: u64,
    pub end: u64,
}

impl RequiredRange {
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    #[error("contract namespace is empty")]
    EmptyNamespace,
    #[error("page_tokens is 0")]
    ZeroPageTokens,
    #[error("contract declares no groups")]
    NoGroups,
    #[error("group {0} declares no components")]
    EmptyGroup(u32),
    #[error("group {0} is declared twice")]
    DuplicateGroup(u32),
    #[error("group {group} lists component {kind} twice")]
    DuplicateComponent { group: u32, kind: ComponentKind },
    #[error("contract has no group 0; group 0 leads (the prefix group, when there is one)")]
    MissingGroupZero,
    #[error("a group uses the prefix rule, so group 0 must be a prefix group, not {0}")]
    GroupZeroNotPrefix(RuleKind),
    #[error("group {0}: a window must keep at least one past token")]
    ZeroWindow(u32),
    #[error("group {group}: window of {past_tokens} past tokens overflows token positions")]
    WindowOverflow { group: u32, past_tokens: u64 },
    #[error("group {group}: unsupported component {kind}")]
    UnsupportedComponent { group: u32, kind: ComponentKind },
    #[error("group {group}: component {kind} cannot be recovered by the {rule} rule")]
    RuleMismatch {
        group: u32,
        kind: ComponentKind,
        rule: RuleKind,
    },
    #[error("namespace mismatch: contract is {expected}, input is {got}")]
    NamespaceMismatch { expected: Namespace, got: Namespace },
    #[error("{what} {value} is not aligned to {page_tokens}-token pages")]
    Misaligned {
        what: &'static str,
        value: u64,
        page_tokens: u64,
    },
    #[error("span start {start} is after end {end}")]
    InvertedSpan { start: u64, end: u64 },
    #[error("bundle names group {0}, which the contract does not register")]
    UnknownGroup(u32),
    #[error("bundle omits registered group {0}")]
    MissingGroup(u32),
    #[error("bundle lists group {0} twice")]
    DuplicateBundleGroup(u32),
    #[error("group {group}: page end {next} does not follow {prev} (ends must strictly increase)")]
    PageEndsNotIncreasing { group: u32, prev: u64, next: u64 },
    #[error("group {group}: page end {page_end} is not page-aligned")]
    PageEndMisaligned { group: u32, page_end: u64 },
    #[error("group {group}: page end {page_end} is outside ({start}, {end}]")]
    PageEndOutOfSpan {
        group: u32,
        page_end: u64,
        start: u64,
        end: u64,
    },
    #[error("ranks disagree on the queried span: [{0}, {1}) vs [{2}, {3})")]
    RankSpanMismatch(u64, u64, u64, u64),
    #[error("a vLLM sliding window of {0} tokens keeps no past token (needs at least 2)")]
    WindowTooSmall(u64),
}

/// Why a load's keys do not cover its compiled range exactly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("range of group {group} [{start}, {end}) needs {expected} keys, {got} were given")]
    RangeKeyCount {
        group: u32,
        start: u64,
        end: u64,
        expected: u64,
        got: usize,
    },
    #[error("key {0:?} does not belong to this range's namespace and group")]
    ForeignKey(StateKey),
    #[error("key {0:?} appears twice")]
    DuplicateKey(StateKey),
    #[error("key {0:?} is both transferred and retained")]
    Overlap(StateKey),
    #[error("key {0:?} of the range is neither transferred nor retained")]
    Missing(StateKey),
    #[error("key {0:?} is not part of the range")]
    Unexpected(StateKey),
}

/// How many pages a group needs, normalized at compile time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Demand {
    WholeTail,
    TrailingPages(u64),
    FinalPage,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledGroup {
    pub id: u32,
    pub rule: Rule,
    pub components: Vec<ComponentKind>,
    demand: Demand,
}

/// A compiled, validated contract. Groups are sorted by id; group 0 is the
/// prefix group whenever any group uses the prefix rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryContract {
    namespace: Namespace,
    page_tokens: u64,
    groups: Vec<CompiledGroup>,
}

impl RecoveryContract {
    pub fn compile(spec: &ContractSpec) -> Result<Self, ContractError> {
        if spec.namespace.is_empty() {
            return Err(ContractError::EmptyNamespace);
        }
        let page = spec.page_tokens;
        if page == 0 {
            return Err(ContractError::ZeroPageTokens);
        }
        if spec.groups.is_empty() {
            return Err(ContractError::NoGroups);
        }
        let mut by_id = BTreeMap::new();
        for g in &spec.groups {
            if by_id.insert(g.id, g).is_some() {
                return Err(ContractError::DuplicateGroup(g.id));
            }
        }
        let mut groups = Vec::with_capacity(by_id.len());
        for (&id, g) in &by_id {
            if g.components.is_empty() {
                return Err(ContractError::EmptyGroup(id));
            }
            let mut components = g.components.clone();
            components.sort();
            if let Some(w) = components.windows(2).find(|w| w[0] == w[1]) {
                return Err(ContractError::DuplicateComponent {
                    group: id,
                    kind: w[0],
                });
            }
            for &kind in &components {
                match kind.rule_kind() {
                    None => return Err(ContractError::UnsupportedComponent { group: id, kind }),
                    Some(rk) if rk != g.rule.kind() => {
                        return Err(ContractError::RuleMismatch {
                            group: id,
                            kind,
                            rule: g.rule.kind(),
                        });
                    }
                    Some(_) => {}
                }
            }
            let demand = match g.rule {
                Rule::Prefix => Demand::WholeTail,
                Rule::Checkpoint => Demand::FinalPage,
                Rule::Window { past_tokens: 0 } => return Err(ContractError::ZeroWindow(id)),
                Rule::Window { past_tokens } => {
                    let pages = past_tokens.div_ceil(page);
                    if pages.checked_mul(page).is_none() {
                        return Err(ContractError::WindowOverflow {
                            group: id,
                            past_tokens,
                        });
                    }
                    Demand::TrailingPages(pages)
                }
            };
            groups.push(CompiledGroup {
                id,
                rule: g.rule,
                components,
                demand,
            });
        }
        // Group 0 leads: discovery stops every later group at group 0's last
        // page, which is sound for every rule (each needs the page ending at
        // the boundary). A model with full-attention state keeps it in group
        // 0; one without (every attention layer sliding, or recurrent state
        // only) has a window or checkpoint group 0.
        match groups.first() {
            Some(g) if g.id != 0 => return Err(ContractError::MissingGroupZero),
            None => return Err(ContractError::MissingGroupZero),
            Some(g) if g.rule != Rule::Prefix && groups.iter().any(|o| o.rule == Rule::Prefix) => {
                return Err(ContractError::GroupZeroNotPrefix(g.rule.kind()));
            }
            Some(_) => {}
        }
        Ok(RecoveryContract {
            namespace: spec.namespace,
            page_tokens: page,
            groups,
        })
    }

    pub fn namespace(&self) -> Namespace {
        self.namespace
    }

    pub fn page_tokens(&self) -> u64 {
        self.page_tokens
    }

    pub fn groups(&self) -> &[CompiledGroup] {
        &self.groups
    }

    pub fn group(&self, id: u32) -> Option<&CompiledGroup> {
        self.groups
            .binary_search_by_key(&id, |g| g.id)
            .ok()
            .map(|i| &self.groups[i])
    }

    fn check_namespace(&self, got: Namespace) -> Result<(), ContractError> {
        if got != self.namespace {
            return Err(ContractError::NamespaceMismatch {
                expected: self.namespace,
                got,
            });
        }
        Ok(())
    }

    fn check_span(&self, start: u64, end: u64) -> Result<(), ContractError> {
        for (what, value) in [("start", start), ("end", end)] {
            if value % self.page_tokens != 0 {
                return Err(ContractError::Misaligned {
                    what,
                    value,
                    page_tokens: self.page_tokens,
                });
            }
        }
        if start > end {
            return Err(ContractError::InvertedSpan { start, end });
        }
        Ok(())
    }

    /// The range one group needs to resume at `end` from a valid origin at
    /// `start`. Callers have checked the span.
    fn demand(&self, g: &CompiledGroup, start: u64, end: u64) -> RequiredRange {
        let from = match g.demand {
            _ if start == end => start,
            Demand::WholeTail => start,
            // pages * page_tokens cannot overflow: compile checked it.
            Demand::TrailingPages(pages) => end.saturating_sub(pages * self.page_tokens).max(start),
            Demand::FinalPage => end - self.page_tokens,
        };
        RequiredRange {
            group: g.id,
            start: from,
            end,
        }
    }

    /// Absolute, half-open, page-aligned `(group, start, end)` for every
    /// registered group, in group order. An empty span gives `(g, start,
    /// start)` for every group. Says what is needed, not what is available.
    pub fn required_ranges(
        &self,
        namespace: Namespace,
        start: u64,
        end: u64,
    ) -> Result<Vec<RequiredRange>, ContractError> {
        self.check_namespace(namespace)?;
        self.check_span(start, end)?;
        Ok(self
            .groups
            .iter()
            .map(|g| self.demand(g, start, end))
            .collect())
    }

    /// Every legal boundary `b` in `(start, end]` for one rank's evidence,
    /// ascending. `b` is legal when each group holds every page of its
    /// required range for `[start, b)`.
    pub fn restorable_boundaries(&self, bundle: &StateBundle) -> Result<Vec<u64>, ContractError> {
        self.check_namespace(bundle.namespace)?;
        self.check_span(bundle.start, bundle.end)?;
        // A handful of groups: found by a scan, nothing allocated.
        let evidence = |group: u32| {
            bundle
                .groups
                .iter()
                .find(|ev| ev.group == group)
                .map(|ev| &ev.page_ends[..])
        };
        for (i, ev) in bundle.groups.iter().enumerate() {
            if self.group(ev.group).is_none() {
                return Err(ContractError::UnknownGroup(ev.group));
            }
            if bundle.groups[..i].iter().any(|e| e.group == ev.group) {
                return Err(ContractError::DuplicateBundleGroup(ev.group));
            }
            self.check_page_ends(ev, bundle.start, bundle.end)?;
        }
        if let Some(g) = self.groups.iter().find(|g| evidence(g.id).is_none()) {
            return Err(ContractError::MissingGroup(g.id));
        }
        // Group 0 is a prefix: every legal boundary is one of its page ends.
        // They ascend, and every demand ends at its boundary, so one
        // forward pass over each group's evidence decides every candidate.
        let Some(candidates) = evidence(0) else {
            return Err(ContractError::MissingGroup(0));
        };
        // Groups whose evidence is one run (the usual case: every page
        // found) narrow the candidates to an interval: a demand is covered
        // when it is empty or lies within the run, and as `b` ascends a
        // demand's start never decreases (whole tail: fixed; trailing
        // pages: `max(b - k, start)`; final page: `b - page`) and it is
        // empty either for every `b` or for none. Two binary searches.
        let (mut lo, mut hi) = (0, candidates.len());
        let mut scattered = Vec::new();
        for g in &self.groups {
            // Every declared group has evidence (checked above).
            let ends = evidence(g.id).unwrap_or_default();
            let Some((first, last)) = contiguous(ends, self.page_tokens) else {
                scattered.push((g, ends));
                continue;
            };
            let from = first - self.page_tokens;
            let demand = |b: u64| self.demand(g, bundle.start, b);
            let starts_in = candidates.partition_point(|&b| {
                let r = demand(b);
                r.start != r.end && r.start < from
            });
            let ends_in = candidates.partition_point(|&b| {
                let r = demand(b);
                r.start == r.end || r.end <= last
            });
            lo = lo.max(starts_in);
            hi = hi.min(ends_in);
        }
        let Some(window) = candidates.get(lo..hi) else {
            return Ok(Vec::new());
        };
        if scattered.is_empty() {
            return Ok(window.to_vec());
        }
        let mut legal = vec![true; window.len()];
        for (g, ends) in scattered {
            let mut runs = RunCursor::new(ends, self.page_tokens);
            for (ok, &b) in legal.iter_mut().zip(window) {
                let r = self.demand(g, bundle.start, b);
                *ok = runs.covers(r.start, r.end) && *ok;
            }
        }
        Ok(window
            .iter()
            .zip(&legal)
            .filter(|(_, ok)| **ok)
            .map(|(b, _)| *b)
            .collect())
    }

    fn check_page_ends(
        &self,
        ev: &GroupEvidence,
        start: u64,
        end: u64,
    ) -> Result<(), ContractError> {
        // The common case in passes the compiler vectorizes (a query
        // checks every page end it found); the loop below names the fault.
        let ends = &ev.page_ends;
        let in_span =
            ends.first().is_none_or(|&f| f > start) && ends.last().is_none_or(|&l| l <= end);
        let ascending = ends.windows(2).all(|w| w[0] < w[1]);
        let page = self.page_tokens;
        let all_aligned = if page.is_power_of_two() {
            ends.iter().fold(0, |acc, e| acc | e) & (page - 1) == 0
        } else {
            ends.iter().all(|&e| aligned(e, page))
        };
        if in_span && ascending && all_aligned {
            return Ok(());
        }
        let mut prev: Option<u64> = None;
        for &e in &ev.page_ends {
            if !aligned(e, self.page_tokens) {
                return Err(ContractError::PageEndMisaligned {
                    group: ev.group,
                    page_end: e,
                });
            }
            if e <= start || e > end {
                return Err(ContractError::PageEndOutOfSpan {
                    group: ev.group,
                    page_end: e,
                    start,
                    end,
                });
            }
            if let Some(p) = prev.filter(|&p| p >= e) {
                return Err(ContractError::PageEndsNotIncreasing {
                    group: ev.group,
                    prev: p,
                    next: e,
                });
            }
            prev = Some(e);
        }
        Ok(())
    }

    /// The boundaries legal on every rank. All ranks must describe the same
    /// span of the same request.
    pub fn common_restorable(&self, ranks: &[StateBundle]) -> Result<Vec<u64>, ContractError> {
        let mut sets = Vec::with_capacity(ranks.len());
        for b in ranks {
            let first = &ranks[0];
            if (b.start, b.end) != (first.start, first.end) {
                return Err(ContractError::RankSpanMismatch(
                    first.start,
                    first.end,
                    b.start,
                    b.end,
                ));
            }
            sets.push(self.restorable_boundaries(b)?);
        }
        Ok(common_boundaries(&sets))
    }

    /// Checks that the keys a load transfers plus those the engine attests
    /// it still holds are disjoint and together exactly the range's keys.
    /// `range_keys` are the keys of the range's pages in position order.
    pub fn validate_load(
        &self,
        range: &RequiredRange,
        range_keys: &[StateKey],
        transferred: &[StateKey],
        retained: &[StateKey],
    ) -> Result<(), LoadError> {
        let expected = (range.end - range.start) / self.page_tokens;
        if range_keys.len() as u64 != expected {
            return Err(LoadError::RangeKeyCount {
                group: range.group,
                start: range.start,
                end: range.end,
                expected,
                got: range_keys.len(),
            });
        }
        let mut want = KeySet::with_capacity_and_hasher(range_keys.len(), KeyHasher::default());
        for k in range_keys {
            if k.namespace != self.namespace || k.group != range.group {
                return Err(LoadError::ForeignKey(*k));
            }
            if !want.insert(*k) {
                return Err(LoadError::DuplicateKey(*k));
            }
        }
        // The usual load: the engine takes every page of the range, in
        // order, and holds none. The range's keys are distinct (above), so
        // this is exactly the range: nothing unexpected, twice or missing.
        if retained.is_empty() && transferred == range_keys {
            return Ok(());
        }
        let mut seen = KeySet::with_capacity_and_hasher(range_keys.len(), KeyHasher::default());
        for (k, other) in transferred
            .iter()
            .map(|k| (k, retained))
            .chain(retained.iter().map(|k| (k, transferred)))
        {
            if !want.contains(k) {
                return Err(LoadError::Unexpected(*k));
            }
            if !seen.insert(*k) {
                return Err(if other.contains(k) {
                    LoadError::Overlap(*k)
                } else {
                    LoadError::DuplicateKey(*k)
                });
            }
        }
        match range_keys.iter().find(|k| !seen.contains(*k)) {
            Some(k) => Err(LoadError::Missing(*k)),
            None => Ok(()),
        }
    }
}

/// `v % page == 0`, without a division for the usual power-of-two pages
/// (one per page end of every query).
fn aligned(v: u64, page: u64) -> bool {
    if page.is_power_of_two() {
        v & (page - 1) == 0
    } else {
        v.is_multiple_of(page)
    }
}

/// `(first, last)` when checked page ends (aligned, strictly ascending)
/// form one contiguous run of pages.
fn contiguous(ends: &[u64], page: u64) -> Option<(u64, u64)> {
    let (&first, &last) = (ends.first()?, ends.last()?);
    let span = (ends.len() as u64 - 1).checked_mul(page)?;
    (last - first == span).then_some((first, last))
}

/// Walks sorted page ends, keeping the length (in pages) of the
/// contiguous run that ends at the last end it passed.
struct RunCursor<'a> {
    ends: &'a [u64],
    page: u64,
    /// `ends[..at]` are passed.
    at: usize,
    /// Pages in the contiguous run ending at `ends[at - 1]`.
    run: u64,
}

impl<'a> RunCursor<'a> {
    fn new(ends: &'a [u64], page: u64) -> Self {
        RunCursor {
            ends,
            page,
            at: 0,
            run: 0,
        }
    }

    /// Whether every page of `[start, end)` is held. Linear over a pass
    /// whose `end`s ascend; an `end` below the last one starts over.
    fn covers(&mut self, start: u64, end: u64) -> bool {
        if start == end {
            return true;
        }
        let passed = |c: &Self| c.at.checked_sub(1).and_then(|i| c.ends.get(i)).copied();
        if passed(self).is_some_and(|e| e > end) {
            self.at = 0;
            self.run = 0;
        }
        while let Some(&e) = self.ends.get(self.at).filter(|&&e| e <= end) {
            self.run = match passed(self) {
                Some(p) if e - p == self.page => self.run + 1,
                _ => 1,
            };
            self.at += 1;
        }
        // Demands are page-aligned, so this is `run >= (end - start) / page`
        // without a division (and, were they not, the stricter test).
        passed(self) == Some(end) && self.run.saturating_mul(self.page) >= end - start
    }
}

/// The intersection of per-rank boundary sets (never the minimum of maxima:
/// that could pick a checkpoint one rank lacks). No ranks, no boundaries.
pub fn common_boundaries(ranks: &[Vec<u64>]) -> Vec<u64> {
    let Some((first, rest)) = ranks.split_first() else {
        return Vec::new();
    };
    let mut out: Vec<u64> = first.clone();
    out.sort_unstable();
    out.dedup();
    for set in rest {
        let set: std::collections::HashSet<u64> = set.iter().copied().collect();
        out.retain(|b| set.contains(b));
    }
    out
}

/// The largest common legal boundary at or below `limit`.
pub fn select_boundary(common: &[u64], limit: u64) -> Option<u64> {
    common.iter().copied().filter(|&b| b <= limit).max()
}

/// The selection limit for a prompt: both engines must compute the final
/// prompt token themselves to produce logits, so a restore may end at most at
/// `prompt_len - 1`.
pub fn prompt_limit(prompt_len: u64) -> u64 {
    prompt_len.saturating_sub(1)
}

/// vLLM's sliding window of `window_tokens` includes the next query token, so
/// the state to keep is `window_tokens - 1` past tokens, and at least one.
pub fn vllm_window_past_tokens(window_tokens: u64) -> Result<u64, ContractError> {
    if window_tokens < 2 {
        return Err(ContractError::WindowTooSmall(window_tokens));
    }
    Ok(window_tokens - 1)
}
