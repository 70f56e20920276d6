use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use orbitkv_components::admin::{LookupReply, LookupRequest, MAX_LOOKUP_HASHES, Restorable};
use orbitkv_components::api::{
    AgentRegion, Candidates, Command, CommandError, CommandId, Event, GroupHashes, LeaseInfo,
    MissReason, PagePos, PublishPage, RestoreTarget, SessionHandle,
};
use orbitkv_components::contract::{RequiredRange, Rule};
use orbitkv_components::key::NativeHash;
use orbitkv_components::namespace::Namespace;
use orbitkv_ipc::{Client, ClientError, Delivered};

use crate::EngineError;

/// The most queries [`Session::lookup_many`] sends in one round; larger
/// batches go in rounds of this many (the manager's hot path keeps a
/// bounded number of requests open per connection).
pub const MAX_BATCH: usize = 64;

/// How a session waits.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Longest wait for any one reply or outcome.
    pub timeout: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            timeout: Duration::from_secs(10),
        }
    }
}

/// One prompt's question: its page hashes (page order, the same in every
/// group of `groups`) past `origin` tokens of a `prompt_len`-token prompt.
#[derive(Debug, Clone)]
pub struct Query {
    pub groups: Vec<u32>,
    pub hashes: Vec<NativeHash>,
    pub origin: u64,
    pub prompt_len: u64,
}

/// What a lookup found. It holds nothing: there is nothing to release.
#[derive(Debug, Clone, PartialEq)]
pub struct Lookup {
    /// The boundary (in tokens) a load would restore to; `None` on a miss.
    pub selected: Option<u64>,
    pub miss: Option<MissReason>,
    pub candidates: Vec<Candidates>,
    /// Boundaries every group could resume at.
    pub common: Vec<u64>,
    /// Answered here from the presence filter, without asking the manager.
    pub local: bool,
}

impl Lookup {
    /// The miss a lookup answered here from the presence filter is: what
    /// the manager answers when group 0's first page is in no tier
    /// (`not_found`, no page of any rank's groups, `groups` in order).
    pub fn not_found(ranks: usize, groups: &[u32]) -> Lookup {
        let mut groups = groups.to_vec();
        groups.sort_unstable();
        Lookup {
            selected: None,
            miss: Some(MissReason::NotFound),
            candidates: (0..ranks as u32)
                .flat_map(|rank| {
                    groups.iter().map(move |&group| Candidates {
                        rank,
                        group,
                        page_ends: Vec::new(),
                    })
                })
                .collect(),
            common: Vec::new(),
            local: true,
        }
    }
}

/// Where a load's pages go: the ranks it loads, the device page of every
/// page it could take, the pages the engine already holds.
#[derive(Debug, Clone, Default)]
pub struct LoadPlan {
    pub ranks: Vec<u32>,
    pub targets: Vec<RestoreTarget>,
    pub retained: Vec<PagePos>,
    /// The P/D handoff this load takes (`Session::hold` on the producer):
    /// its pins return once the load has leased the pages.
    pub handoff: Option<u64>,
}

/// The answer to [`Session::hold`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub handoff: u64,
    /// Pages promised over every rank and group, and those already in DRAM
    /// (pinned now; the rest are pinned as they land).
    pub promised: u64,
    pub pinned: u64,
    /// Bytes reserved from the manager's handoff budget.
    pub bytes: u64,
}

/// A load's outcome.
#[derive(Debug, Clone, PartialEq)]
pub enum Loaded {
    /// Every required page of `boundary` is in the device pages named for
    /// it (the copies landed and were verified).
    Hit {
        boundary: u64,
        ranges: Vec<(u32, RequiredRange)>,
        leases: Vec<LeaseInfo>,
        pages: u64,
        bytes: u64,
        /// Pages read from a lower tier (SSD, remote) rather than DRAM.
        pages_from_tiers: u64,
    },
    /// Nothing usable was loaded; the engine recomputes. Device pages the
    /// load named may have been partly written.
    Miss(MissReason),
}

/// A save's outcome: pages stored now, already stored, dropped (no room
/// within the publish deadline, or their copy failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saved {
    pub inserted: u64,
    pub duplicates: u64,
    pub dropped: u64,
}

/// A device region registered by this session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub region: u64,
    pub engine_region: u32,
    pub page_bytes: u64,
    pub rank: u32,
    pub group: u32,
    pub slots: u32,
}

/// One session with the manager, over one connection (the caller's
/// [`Client`], passed to every verb so the connection can stay shared
/// with its copy agent and memory views).
#[derive(Debug)]
pub struct Session {
    handle: SessionHandle,
    instance: String,
    namespaces: Vec<Namespace>,
    options: SessionOptions,
    next_request: u64,
    regions: HashMap<u64, Region>,
    /// Device pages by (region, slot): allocated on a slot's first use,
    /// kept until the session closes.
    slots: HashMap<(u64, u32), u64>,
    /// Started verbs not yet ended, by ticket (their first command's id).
    jobs: HashMap<Ticket, Job>,
    /// Which job a command's reply or an operation's event belongs to.
    by_command: HashMap<CommandId, Ticket>,
    by_operation: HashMap<u64, Ticket>,
    /// Progress found while waiting for something else.
    progress: VecDeque<Progress>,
    /// Events that belonged to no job (answered after their job ended).
    pub strays: u64,
    /// Lookups sent without waiting ([`Session::start_lookup`]), by ticket.
    lookups: HashMap<u64, PendingLookup>,
    next_lookup: u64,
    /// The instance's tokens per page and storage groups, and whether
    /// group 0 is a prefix (then a lookup whose first page the presence
    /// filter says is absent is a certain miss).
    page_tokens: u64,
    group_ids: Vec<u32>,
    prefix_first: bool,
    /// Lookups answered from the presence filter, without a round trip.
    pub answered_here: u64,
}

/// A lookup in flight: sent, its id once known; `forgotten` ones are kept
/// only to drop their answers.
#[derive(Debug)]
struct PendingLookup {
    sending: Sending,
    id: Option<CommandId>,
    forgotten: bool,
}

impl PendingLookup {
    /// Its command id, once the manager queued it.
    fn resolve(&mut self, c: &mut dyn Port) -> Result<Option<CommandId>, ClientError> {
        if self.id.is_none() {
            self.id = c.accepted_id(self.sending)?;
        }
        Ok(self.id)
    }
}

/// The most lookups [`Session::start_lookup`] keeps in flight.
pub const MAX_PENDING_LOOKUPS: usize = 4096;

/// A started verb: the id of its first command.
pub type Ticket = CommandId;

/// What [`Session::poll`] reports of started verbs.
#[derive(Debug)]
pub enum Progress {
    /// A load's or lease's pages are leased: a load's copies are under
    /// way; a lease's pages may be read now, until [`Session::release`].
    Ready {
        ticket: Ticket,
        boundary: u64,
        ranges: Vec<(u32, RequiredRange)>,
        leases: Vec<LeaseInfo>,
    },
    /// A load or lease ended.
    Loaded { ticket: Ticket, outcome: Loaded },
    /// A save ended.
    Saved { ticket: Ticket, outcome: Saved },
    /// The manager refused a command of the verb (for a load's plan or a
    /// lease's release, after its pages were leased: nothing is usable).
    Refused { ticket: Ticket, error: EngineError },
}

impl Progress {
    pub fn ticket(&self) -> Ticket {
        match self {
            Progress::Ready { ticket, .. }
            | Progress::Loaded { ticket, .. }
            | Progress::Saved { ticket, .. }
            | Progress::Refused { ticket, .. } => *ticket,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobKind {
    Load,
    Lease,
    Save,
}

#[derive(Debug)]
struct Job {
    kind: JobKind,
    command: CommandId,
    operation: Option<u64>,
    release: Option<CommandId>,
    ready: Option<Leased>,
}

/// What a ready operation leased.
#[derive(Debug)]
struct Leased {
    boundary: u64,
    ranges: Vec<(u32, RequiredRange)>,
    leases: Vec<LeaseInfo>,
    pages_from_tiers: u64,
}

impl Session {
    /// Registers the instance (`register`, a `RegisterInstance`) and opens
    /// a session of it.
    pub fn open(
        c: &mut dyn Port,
        register: Command,
        options: SessionOptions,
    ) -> Result<Session, EngineError> {
        let Command::RegisterInstance { instance, .. } = &register else {
            return Err(EngineError::Invalid(format!(
                "a session starts with register_instance, not {}",
                register.kind()
            )));
        };
        let instance = instance.clone();
        let (page_tokens, group_ids, prefix_first) = match &register {
            Command::RegisterInstance {
                page_tokens,
                groups,
                ..
            } => (
                *page_tokens,
                groups.iter().map(|g| g.id).collect::<Vec<u32>>(),
                groups.iter().any(|g| g.id == 0 && g.rule == Rule::Prefix),
            ),
            _ => (0, Vec::new(), false),
        };
        let t = options.timeout;
        let namespaces = match call(c, "register_instance", register, t)? {
            Event::InstanceRegistered { namespaces, .. } => namespaces,
            other => return Err(unexpected("register_instance", &other)),
        };
        let handle = match call(
            c,
            "open_session",
            Command::OpenSession {
                instance: instance.clone(),
            },
            t,
        )? {
            Event::SessionOpened { session, .. } => session,
            other => return Err(unexpected("open_session", &other)),
        };
        Ok(Session {
            handle,
            instance,
            namespaces,
            options,
            next_request: 0,
            regions: HashMap::new(),
            slots: HashMap::new(),
            jobs: HashMap::new(),
            by_command: HashMap::new(),
            by_operation: HashMap::new(),
            progress: VecDeque::new(),
            strays: 0,
            lookups: HashMap::new(),
            next_lookup: 0,
            page_tokens,
            group_ids,
            prefix_first,
            answered_here: 0,
        })
    }

    /// Which hash of a lookup from `origin` the presence filter checks
    /// (group 0's first page asked for), or `None` when the filter cannot
    /// answer for this session: the port has none, group 0 is not a
    /// prefix, or `origin` is not page-aligned.
    pub fn filter_index(&self, c: &dyn Port, origin: u64) -> Option<usize> {
        c.presence()?;
        if !self.prefix_first || self.page_tokens == 0 || !origin.is_multiple_of(self.page_tokens) {
            return None;
        }
        usize::try_from(origin / self.page_tokens).ok()
    }

    /// Whether the presence filter proves a lookup of `groups` a miss,
    /// `first` being its hash at [`Session::filter_index`]: the groups are
    /// the instance's, and no tier holds group 0's `first` (a lookup that
    /// finds no page there ends with no candidates; the manager would
    /// answer `not_found`). Counted as answered here when it does.
    pub fn answer_from_filter(
        &mut self,
        c: &mut dyn Port,
        groups: &[u32],
        first: &NativeHash,
    ) -> bool {
        let (Some(presence), Some(namespace)) = (c.presence(), self.namespaces.first()) else {
            return false;
        };
        if !self.prefix_first
            || groups.len() != self.group_ids.len()
            || !self.group_ids.iter().all(|g| groups.contains(g))
            || !presence.absent(namespace, 0, first)
        {
            return false;
        }
        self.answered_here += 1;
        c.note_answered_here(1);
        true
    }

    /// How many of a lookup's `n` pages are worth sending: a page of
    /// group 0 past `origin` that the presence filter proves is in no tier
    /// bounds the answer (group 0 is a prefix: no boundary passes a page it
    /// lacks), so the pages from it on can be left out without changing
    /// the selected boundary or the miss. Probes pages `first + 1`,
    /// `first + 2`, `first + 4`, ... (`first` = `origin`'s page, which
    /// [`Session::answer_from_filter`] checks), at most `log2(n)` hashes,
    /// each read through `hash` (`None`: no such page). `n` when the filter
    /// cannot tell for this session and `groups` (as for
    /// `answer_from_filter`) or no probed page is proven absent.
    pub fn pages_worth_asking<E>(
        &self,
        c: &dyn Port,
        groups: &[u32],
        n: usize,
        origin: u64,
        hash: &mut dyn FnMut(usize) -> Result<Option<NativeHash>, E>,
    ) -> Result<usize, E> {
        let (Some(first), Some(presence), Some(namespace)) = (
            self.filter_index(c, origin),
            c.presence(),
            self.namespaces.first(),
        ) else {
            return Ok(n);
        };
        if groups.len() != self.group_ids.len()
            || !self.group_ids.iter().all(|g| groups.contains(g))
        {
            return Ok(n);
        }
        let mut step = 1usize;
        while let Some(at) = first.checked_add(step).filter(|&at| at < n) {
            match hash(at)? {
                Some(h) if presence.absent(namespace, 0, &h) => return Ok(at),
                Some(_) => {}
                None => return Ok(n),
            }
            step = step.saturating_mul(2);
        }
        Ok(n)
    }

    /// A miss answered here ([`Lookup::not_found`] for this instance).
    pub fn local_miss(&self) -> Lookup {
        Lookup::not_found(self.namespaces.len(), &self.group_ids)
    }

    /// [`Session::answer_from_filter`] for a whole query.
    fn certain_miss(&mut self, c: &mut dyn Port, q: &Query) -> bool {
        match self.filter_index(c, q.origin).and_then(|i| q.hashes.get(i)) {
            Some(first) => self.answer_from_filter(c, &q.groups, first),
            None => false,
        }
    }

    pub fn handle(&self) -> SessionHandle {
        self.handle
    }

    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The namespaces the manager sealed for the instance.
    pub fn namespaces(&self) -> &[Namespace] {
        &self.namespaces
    }

    /// A region this session registered.
    pub fn region(&self, region: u64) -> Option<&Region> {
        self.regions.get(&region)
    }

    pub fn regions(&self) -> impl Iterator<Item = &Region> {
        self.regions.values()
    }

    /// Device pages held in the slot table.
    pub fn device_page_count(&self) -> usize {
        self.slots.len()
    }

    fn request(&mut self) -> u64 {
        self.next_request += 1;
        self.next_request
    }

    /// Registers a device region of `slots` page slots for one rank's
    /// group; `agent` names memory attached to the connection's copy agent.
    pub fn register_region(
        &mut self,
        c: &mut dyn Port,
        rank: u32,
        group: u32,
        slots: u32,
        agent: Option<AgentRegion>,
    ) -> Result<Region, EngineError> {
        let command = Command::RegisterDeviceRegion {
            session: self.handle,
            rank,
            group,
            slots,
            agent,
        };
        match call(c, "register_device_region", command, self.options.timeout)? {
            Event::RegionRegistered {
                region,
                engine_region,
                page_bytes,
                ..
            } => {
                let r = Region {
                    region,
                    engine_region,
                    page_bytes,
                    rank,
                    group,
                    slots,
                };
                self.regions.insert(region, r);
                Ok(r)
            }
            other => Err(unexpected("register_device_region", &other)),
        }
    }

    /// The device pages of `slots` of `region`, in order: from the slot
    /// table, the missing ones allocated in one round trip.
    pub fn device_pages(
        &mut self,
        c: &mut dyn Port,
        region: u64,
        slots: &[u32],
    ) -> Result<Vec<u64>, EngineError> {
        let Some(r) = self.regions.get(&region) else {
            return Err(EngineError::Invalid(format!(
                "region {region:#x} is not one this session registered"
            )));
        };
        if let Some(s) = slots.iter().find(|&&s| s >= r.slots) {
            return Err(EngineError::Invalid(format!(
                "slot {s} is outside region {region:#x} ({} slots)",
                r.slots
            )));
        }
        let mut missing: Vec<u32> = slots
            .iter()
            .copied()
            .filter(|s| !self.slots.contains_key(&(region, *s)))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        for chunk in missing.chunks(MAX_BATCH) {
            let commands = chunk
                .iter()
                .map(|&slot| Command::DevicePageAlloc {
                    session: self.handle,
                    region,
                    slot,
                })
                .collect();
            let ids = submit_many(c, "device_page_alloc", commands)?;
            for (&slot, id) in chunk.iter().zip(ids) {
                match reply(c, "device_page_alloc", id, self.options.timeout)? {
                    Event::DevicePageAllocated { device_page, .. } => {
                        self.slots.insert((region, slot), device_page);
                    }
                    other => return Err(unexpected("device_page_alloc", &other)),
                }
            }
        }
        slots
            .iter()
            .map(|s| {
                self.slots.get(&(region, *s)).copied().ok_or_else(|| {
                    EngineError::Unavailable(format!("slot {s} of region {region:#x} has no page"))
                })
            })
            .collect()
    }

    fn groups(q: &Query) -> Vec<GroupHashes> {
        q.groups
            .iter()
            .map(|&group| GroupHashes {
                group,
                hashes: q.hashes.clone(),
            })
            .collect()
    }

    fn lookup_command(&mut self, q: &Query) -> Command {
        Command::Lookup {
            session: self.handle,
            request: self.request(),
            groups: Self::groups(q),
            origin: q.origin,
            prompt_len: q.prompt_len,
            expect_namespaces: self.namespaces.clone(),
        }
    }

    /// Where the manager would resume `q`: one round trip, nothing held.
    pub fn lookup(&mut self, c: &mut dyn Port, q: &Query) -> Result<Lookup, EngineError> {
        self.lookup_within(c, q, self.options.timeout)
    }

    /// [`Session::lookup`], waiting at most `timeout`: past it the answer
    /// is [`EngineError::TimedOut`] and the connection stays (a lookup
    /// holds nothing; its late answer is dropped by a later lookup).
    pub fn lookup_within(
        &mut self,
        c: &mut dyn Port,
        q: &Query,
        timeout: Duration,
    ) -> Result<Lookup, EngineError> {
        if self.certain_miss(c, q) {
            return Ok(self.local_miss());
        }
        let command = self.lookup_command(q);
        let id = submit(c, "lookup", command)?;
        let deadline = Instant::now() + timeout;
        let started = &self.by_command;
        // While lookups sent without waiting are in flight, an earlier
        // answer may be one of theirs (their ids are learnt lazily): only
        // then are late answers left for later.
        let drop_late = self.lookups.is_empty();
        // Its answer, or a late answer of an earlier lookup (dropped);
        // never an answer of a started verb.
        let ours = |e: &Event| {
            e.command().is_some_and(|c| {
                c == id
                    || (drop_late
                        && c < id
                        && !started.contains_key(&c)
                        && matches!(e, Event::QueryResult { .. } | Event::Rejected { .. }))
            })
        };
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match c
                .wait_event(left, &ours)
                .map_err(|e| EngineError::client("lookup", e))?
            {
                Some(d) if d.event.command() == Some(id) => return lookup_answer(d),
                Some(_) => self.strays += 1,
                None => {
                    return Err(EngineError::TimedOut {
                        command: "lookup",
                        timeout,
                    });
                }
            }
        }
    }

    /// Sends a lookup without waiting for anything (a scheduler that
    /// must not block): [`Session::lookup_result`] collects its answer.
    pub fn start_lookup(&mut self, c: &mut dyn Port, q: &Query) -> Result<u64, EngineError> {
        self.sweep(c)?;
        if self.lookups.len() >= MAX_PENDING_LOOKUPS {
            return Err(EngineError::Invalid(format!(
                "{MAX_PENDING_LOOKUPS} lookups are already in flight"
            )));
        }
        let command = self.lookup_command(q);
        let sending = c
            .send_command(command)
            .map_err(|e| EngineError::client("lookup", e))?;
        self.next_lookup += 1;
        self.lookups.insert(
            self.next_lookup,
            PendingLookup {
                sending,
                id: None,
                forgotten: false,
            },
        );
        Ok(self.next_lookup)
    }

    /// A started lookup's answer if it has arrived (never blocks); it is
    /// then forgotten. `Invalid` for a ticket not in flight.
    pub fn lookup_result(
        &mut self,
        c: &mut dyn Port,
        ticket: u64,
    ) -> Result<Option<Lookup>, EngineError> {
        self.sweep(c)?;
        let Some(p) = self.lookups.get_mut(&ticket).filter(|p| !p.forgotten) else {
            return Err(EngineError::Invalid(format!(
                "no lookup {ticket} in flight"
            )));
        };
        let id = match p.resolve(c) {
            Ok(Some(id)) => id,
            Ok(None) => return Ok(None),
            Err(e) => {
                self.lookups.remove(&ticket);
                return Err(EngineError::client("lookup", e));
            }
        };
        let Some(d) = c
            .wait_event(Duration::ZERO, &|e| e.command() == Some(id))
            .map_err(|e| EngineError::client("lookup", e))?
        else {
            return Ok(None);
        };
        self.lookups.remove(&ticket);
        lookup_answer(d).map(Some)
    }

    /// Gives a started lookup up: its answer is dropped when it comes.
    pub fn forget_lookup(&mut self, ticket: u64) {
        if let Some(p) = self.lookups.get_mut(&ticket) {
            p.forgotten = true;
        }
    }

    /// Drops the answers of forgotten lookups that have arrived.
    fn sweep(&mut self, c: &mut dyn Port) -> Result<(), EngineError> {
        let forgotten: Vec<u64> = self
            .lookups
            .iter()
            .filter(|(_, p)| p.forgotten)
            .map(|(t, _)| *t)
            .collect();
        for t in forgotten {
            let Some(p) = self.lookups.get_mut(&t) else {
                continue;
            };
            let id = match p.resolve(c) {
                Ok(Some(id)) => id,
                Ok(None) => continue,
                // Never queued: nothing will answer it.
                Err(_) => {
                    self.lookups.remove(&t);
                    continue;
                }
            };
            if c.wait_event(Duration::ZERO, &|e| e.command() == Some(id))
                .map_err(|e| EngineError::client("lookup", e))?
                .is_some()
            {
                self.lookups.remove(&t);
                self.strays += 1;
            }
        }
        Ok(())
    }

    /// What a load of each prompt (`(hashes, prompt_len)`: vLLM's block
    /// hashes, one list for every group) would restore on this host now,
    /// and from which tier: the manager's own selection, every rank and
    /// group of this session's instance, nothing leased (a router's
    /// question; `POST /lookup` asks the same). One round trip per
    /// [`MAX_BATCH`] prompts.
    pub fn locate_many(
        &mut self,
        c: &mut dyn Port,
        prompts: &[(&[NativeHash], Option<u64>)],
    ) -> Result<Vec<Restorable>, EngineError> {
        let mut out = Vec::with_capacity(prompts.len());
        for chunk in prompts.chunks(MAX_BATCH) {
            let mut requests = Vec::with_capacity(chunk.len());
            for (hashes, prompt_len) in chunk {
                if hashes.len() > MAX_LOOKUP_HASHES {
                    return Err(EngineError::Invalid(format!(
                        "{} hashes; a lookup names at most {MAX_LOOKUP_HASHES}",
                        hashes.len()
                    )));
                }
                requests.push(LookupRequest {
                    instance: Some(self.instance.clone()),
                    namespace: None,
                    group: 0,
                    hashes: hashes.to_vec(),
                    prompt_len: *prompt_len,
                });
            }
            let replies = c
                .locate(&requests, self.options.timeout)
                .map_err(|e| match e {
                    ClientError::Timeout(timeout) => EngineError::TimedOut {
                        command: "locate",
                        timeout,
                    },
                    e => EngineError::client("locate", e),
                })?;
            for reply in replies {
                match reply {
                    LookupReply {
                        restorable: Some(r),
                        error: None,
                        ..
                    } => out.push(r),
                    LookupReply { error: Some(e), .. } => return Err(EngineError::Invalid(e)),
                    // The instance owns the namespaces it registered.
                    LookupReply { .. } => {
                        return Err(EngineError::Unavailable(
                            "locate: the manager answered without a selection".into(),
                        ));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Many lookups in one round trip per [`MAX_BATCH`] queries: all are
    /// sent before any answer is awaited.
    pub fn lookup_many(
        &mut self,
        c: &mut dyn Port,
        queries: &[Query],
    ) -> Result<Vec<Lookup>, EngineError> {
        self.lookup_many_within(c, queries, self.options.timeout)
    }

    /// [`Session::lookup_many`], every answer within `timeout` of the
    /// call (past it: [`EngineError::TimedOut`]).
    pub fn lookup_many_within(
        &mut self,
        c: &mut dyn Port,
        queries: &[Query],
        timeout: Duration,
    ) -> Result<Vec<Lookup>, EngineError> {
        let deadline = Instant::now() + timeout;
        // Certain misses are answered here; the others are asked.
        let mut out: Vec<Lookup> = Vec::with_capacity(queries.len());
        let mut asked = Vec::new();
        for (i, q) in queries.iter().enumerate() {
            if self.certain_miss(c, q) {
                out.push(self.local_miss());
            } else {
                // Replaced by the manager's answer below (allocates nothing).
                out.push(Lookup::not_found(0, &[]));
                asked.push(i);
            }
        }
        for chunk in asked.chunks(MAX_BATCH) {
            let commands = chunk
                .iter()
                .map(|&i| self.lookup_command(&queries[i]))
                .collect();
            let ids = submit_many(c, "lookup", commands)?;
            for (&i, id) in chunk.iter().zip(ids) {
                let left = deadline.saturating_duration_since(Instant::now());
                out[i] = lookup_result(reply(c, "lookup", id, left)?)?;
            }
        }
        Ok(out)
    }

    /// Loads `q` into the plan's device pages in one command: the manager
    /// selects the boundary, leases and reads its pages, and has them
    /// copied; returns after the last event. A plan that does not cover
    /// the selected ranges is refused (nothing is copied).
    pub fn load(
        &mut self,
        c: &mut dyn Port,
        q: &Query,
        plan: LoadPlan,
    ) -> Result<Loaded, EngineError> {
        let ticket = self.start_load(c, q, plan)?;
        match self.wait(c, ticket, self.options.timeout)? {
            Progress::Loaded { outcome, .. } => Ok(outcome),
            Progress::Refused { error, .. } => Err(error),
            other => Err(EngineError::Unavailable(format!(
                "load: unexpected {other:?}"
            ))),
        }
    }

    /// Waits for the end of started verb `ticket` (its `Loaded`, `Saved` or
    /// `Refused`); the progress of other verbs found meanwhile is kept for
    /// [`Session::poll`], this one's `Ready` dropped.
    fn wait(
        &mut self,
        c: &mut dyn Port,
        ticket: Ticket,
        timeout: Duration,
    ) -> Result<Progress, EngineError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self
                .progress
                .iter()
                .position(|p| p.ticket() == ticket && !matches!(p, Progress::Ready { .. }))
            {
                let done = self.progress.remove(i);
                self.progress.retain(|p| p.ticket() != ticket);
                return done.ok_or_else(|| {
                    EngineError::Unavailable(format!("{ticket}: its outcome went missing"))
                });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // The manager may still be copying into the device pages.
                return Err(EngineError::Unavailable(format!(
                    "{ticket}: no outcome within {timeout:?}"
                )));
            }
            self.pump(c, left)?;
        }
    }

    fn load_command(&mut self, q: &Query, plan: LoadPlan) -> Command {
        Command::Load {
            session: self.handle,
            request: self.request(),
            groups: Self::groups(q),
            origin: q.origin,
            prompt_len: q.prompt_len,
            expect_namespaces: self.namespaces.clone(),
            ranks: plan.ranks,
            targets: plan.targets,
            retained: plan.retained,
            handoff: plan.handoff,
        }
    }

    /// A P/D producer's promise: the pages of `hashes` in `groups`, on
    /// every rank, stay pinned in the manager's DRAM as they land, until a
    /// load naming `handoff` took them or `deadline_ms` passed. One round
    /// trip; a refusal (a bound, a duplicate id) is
    /// [`EngineError::Refused`] and pins nothing.
    pub fn hold(
        &mut self,
        c: &mut dyn Port,
        groups: &[u32],
        hashes: &[NativeHash],
        handoff: u64,
        deadline_ms: u64,
    ) -> Result<Held, EngineError> {
        let command = Command::Hold {
            session: self.handle,
            handoff,
            groups: groups
                .iter()
                .map(|&group| GroupHashes {
                    group,
                    hashes: hashes.to_vec(),
                })
                .collect(),
            deadline_ms,
        };
        match call(c, "hold", command, self.options.timeout)? {
            Event::Held {
                handoff,
                promised,
                pinned,
                bytes,
                ..
            } => Ok(Held {
                handoff,
                promised,
                pinned,
                bytes,
            }),
            other => Err(unexpected("hold", &other)),
        }
    }

    fn start(
        &mut self,
        c: &mut dyn Port,
        kind: JobKind,
        what: &'static str,
        command: Command,
    ) -> Result<Ticket, EngineError> {
        let id = submit(c, what, command)?;
        self.jobs.insert(
            id,
            Job {
                kind,
                command: id,
                operation: None,
                release: None,
                ready: None,
            },
        );
        self.by_command.insert(id, id);
        Ok(id)
    }

    /// Starts a [`Session::load`]; its progress comes from
    /// [`Session::poll`]: `Ready` once its pages are leased and copying,
    /// then `Loaded` (or `Refused`).
    pub fn start_load(
        &mut self,
        c: &mut dyn Port,
        q: &Query,
        plan: LoadPlan,
    ) -> Result<Ticket, EngineError> {
        let command = self.load_command(q, plan);
        self.start(c, JobKind::Load, "load", command)
    }

    /// Starts a lease of `q`'s selected pages for an engine that reads
    /// them from the shared pool itself: `Ready` carries the leases (pool
    /// offsets and checksums: verify what is read); the engine then calls
    /// [`Session::release`], and `Loaded` ends it (a `Miss` if the leases
    /// passed their deadline first: what was read is not to be used).
    pub fn start_lease(&mut self, c: &mut dyn Port, q: &Query) -> Result<Ticket, EngineError> {
        let command = Command::Query {
            session: self.handle,
            request: self.request(),
            groups: Self::groups(q),
            origin: q.origin,
            prompt_len: q.prompt_len,
            expect_namespaces: self.namespaces.clone(),
            prepare: true,
            speculative: false,
        };
        self.start(c, JobKind::Lease, "query", command)
    }

    /// Ends a lease whose pages were read (or abandons one that is still
    /// waiting for them).
    pub fn release(&mut self, c: &mut dyn Port, ticket: Ticket) -> Result<(), EngineError> {
        let Some(job) = self.jobs.get(&ticket) else {
            return Err(EngineError::Invalid(format!("no lease {ticket} in flight")));
        };
        let (JobKind::Lease, Some(operation), None) = (job.kind, job.operation, job.release) else {
            return Err(EngineError::Invalid(format!(
                "{ticket} is not a lease whose operation is known and not yet released"
            )));
        };
        let id = submit(
            c,
            "release",
            Command::Release {
                session: self.handle,
                operation,
            },
        )?;
        if let Some(job) = self.jobs.get_mut(&ticket) {
            job.release = Some(id);
        }
        self.by_command.insert(id, ticket);
        Ok(())
    }

    /// Cancels a started lease or load whose operation is known (its
    /// `Loaded` then comes as a miss, or as what ended it first). Not for
    /// a load whose copies may run: see [`EngineError::Unavailable`].
    /// Returns whether a cancel was sent.
    pub fn cancel(&mut self, c: &mut dyn Port, ticket: Ticket) -> Result<bool, EngineError> {
        let Some(operation) = self.jobs.get(&ticket).and_then(|j| j.operation) else {
            return Ok(false);
        };
        submit(
            c,
            "cancel",
            Command::Cancel {
                session: self.handle,
                operation,
            },
        )?;
        Ok(true)
    }

    /// Starts a [`Session::save`]; `Saved` (or `Refused`) comes from
    /// [`Session::poll`].
    pub fn start_save(
        &mut self,
        c: &mut dyn Port,
        pages: Vec<PublishPage>,
    ) -> Result<Ticket, EngineError> {
        let command = Command::Publish {
            session: self.handle,
            request: self.request(),
            pages,
        };
        self.start(c, JobKind::Save, "publish", command)
    }

    /// Verbs started and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// The progress of started verbs: what is already known, else what
    /// arrives within `timeout` (and whatever arrived with it).
    /// [`EngineError::Unavailable`] when the connection failed or a copy
    /// passed its deadline: every verb in flight is lost with it.
    pub fn poll(
        &mut self,
        c: &mut dyn Port,
        timeout: Duration,
    ) -> Result<Vec<Progress>, EngineError> {
        if self.progress.is_empty() {
            self.pump(c, timeout)?;
        }
        Ok(self.progress.drain(..).collect())
    }

    /// Takes this session's events of started verbs that arrive within
    /// `timeout` (and whatever arrived with the first) into `progress`.
    fn pump(&mut self, c: &mut dyn Port, timeout: Duration) -> Result<(), EngineError> {
        let (cmds, ops) = (&self.by_command, &self.by_operation);
        let ours = |e: &Event| {
            e.command().is_some_and(|c| cmds.contains_key(&c))
                || e.operation().is_some_and(|o| ops.contains_key(&o))
        };
        let mut found = Vec::new();
        let mut wait = timeout;
        while let Some(d) = c
            .wait_event(wait, &ours)
            .map_err(|e| EngineError::client("poll", e))?
        {
            found.push(d);
            wait = Duration::ZERO;
        }
        for d in found {
            self.handle_event(d)?;
        }
        Ok(())
    }

    fn finish(&mut self, ticket: Ticket) -> Option<Job> {
        let job = self.jobs.remove(&ticket)?;
        self.by_command.remove(&job.command);
        if let Some(r) = job.release {
            self.by_command.remove(&r);
        }
        if let Some(op) = job.operation {
            self.by_operation.remove(&op);
        }
        Some(job)
    }

    /// Routes one event of this session's jobs. The runtime's `terminal`
    /// flag says whether the event ends its job (and nothing more will be
    /// addressed to it); the event's kind says with what outcome. A kind
    /// that cannot end a job arriving as its end, or the reverse, is a
    /// protocol fault: the connection is given up, never guessed around.
    fn handle_event(&mut self, d: Delivered) -> Result<(), EngineError> {
        let Delivered { event: e, terminal } = d;
        let by_command = e
            .command()
            .and_then(|id| self.by_command.get(&id).map(|t| (id, *t)));
        let ticket = match by_command {
            Some((_, t)) => t,
            None => match e.operation().and_then(|op| self.by_operation.get(&op)) {
                Some(&t) => t,
                None => {
                    self.strays += 1;
                    return Ok(());
                }
            },
        };
        let Some(kind) = self.jobs.get(&ticket).map(|j| j.kind) else {
            // Routed to a job already gone: its tables are stale.
            if let Some((id, _)) = by_command {
                self.by_command.remove(&id);
            }
            self.strays += 1;
            return Ok(());
        };
        if terminal {
            let job = self.finish(ticket);
            let outcome = match e {
                Event::Rejected { error, command } => {
                    let what = match (kind, job.as_ref().and_then(|j| j.release) == Some(command)) {
                        (JobKind::Load, _) => "load",
                        (JobKind::Lease, true) => "release",
                        (JobKind::Lease, false) => "query",
                        (JobKind::Save, _) => "publish",
                    };
                    Progress::Refused {
                        ticket,
                        error: EngineError::refused(what, error),
                    }
                }
                Event::QueryResult {
                    miss: Some(reason), ..
                }
                | Event::Miss { reason, .. } => Progress::Loaded {
                    ticket,
                    outcome: Loaded::Miss(reason),
                },
                Event::PublishDone {
                    inserted,
                    duplicates,
                    dropped,
                    ..
                } => Progress::Saved {
                    ticket,
                    outcome: Saved {
                        inserted,
                        duplicates,
                        dropped,
                    },
                },
                Event::RestoreDone { pages, bytes, .. } => match job.and_then(|j| j.ready) {
                    Some(l) => Progress::Loaded {
                        ticket,
                        outcome: Loaded::Hit {
                            boundary: l.boundary,
                            ranges: l.ranges,
                            leases: l.leases,
                            pages,
                            bytes,
                            pages_from_tiers: l.pages_from_tiers,
                        },
                    },
                    None => {
                        return Err(EngineError::Unavailable(format!(
                            "load {ticket}: restore_done without ready"
                        )));
                    }
                },
                Event::Released { .. } => {
                    let outcome = match job.and_then(|j| j.ready.map(|r| (r, j.release.is_some())))
                    {
                        Some((l, true)) => Loaded::Hit {
                            boundary: l.boundary,
                            ranges: l.ranges,
                            pages: l.leases.len() as u64,
                            bytes: l.leases.iter().map(|l| l.bytes).sum(),
                            leases: l.leases,
                            pages_from_tiers: l.pages_from_tiers,
                        },
                        // Released before the pages were read (the
                        // caller abandoned it): nothing was loaded.
                        _ => Loaded::Miss(MissReason::Cancelled),
                    };
                    Progress::Loaded { ticket, outcome }
                }
                other => return Err(protocol("ended", &other)),
            };
            self.progress.push_back(outcome);
            return Ok(());
        }
        match e {
            // A hit: the operation goes on under its own id.
            Event::QueryResult {
                operation,
                miss: None,
                ..
            } => {
                if let Some(job) = self.jobs.get_mut(&ticket) {
                    job.operation = Some(operation);
                }
                self.by_operation.insert(operation, ticket);
                // A lease's command is answered; a load's plan can still
                // be refused in reply to its command.
                if let (JobKind::Lease, Some((id, _))) = (kind, by_command) {
                    self.by_command.remove(&id);
                }
            }
            Event::Loading { .. } => {}
            Event::Ready {
                boundary,
                ranges,
                leases,
                pages_from_tiers,
                ..
            } => {
                if let Some(job) = self.jobs.get_mut(&ticket) {
                    job.ready = Some(Leased {
                        boundary,
                        ranges: ranges.clone(),
                        leases: leases.clone(),
                        pages_from_tiers,
                    });
                }
                self.progress.push_back(Progress::Ready {
                    ticket,
                    boundary,
                    ranges,
                    leases,
                });
            }
            // The agent may still be copying into the device pages: the
            // connection is given up (its agent drains first).
            Event::TransferOverdue { kind, .. } => {
                return Err(EngineError::Unavailable(format!(
                    "{ticket}: a {kind} passed its deadline"
                )));
            }
            other => return Err(protocol("did not end", &other)),
        }
        Ok(())
    }

    /// Saves pages from device pages of this session.
    pub fn save(
        &mut self,
        c: &mut dyn Port,
        pages: Vec<PublishPage>,
    ) -> Result<Saved, EngineError> {
        let ticket = self.start_save(c, pages)?;
        match self.wait(c, ticket, self.options.timeout)? {
            Progress::Saved { outcome, .. } => Ok(outcome),
            Progress::Refused { error, .. } => Err(error),
            other => Err(EngineError::Unavailable(format!(
                "publish: unexpected {other:?}"
            ))),
        }
    }

    /// Closes the session: the manager frees its device pages and regions
    /// once nothing in flight uses them.
    pub fn close(self, c: &mut dyn Port) -> Result<(), EngineError> {
        let id = submit(
            c,
            "close_session",
            Command::CloseSession {
                session: self.handle,
            },
        )?;
        let t = self.options.timeout;
        match c
            .wait_event(t, &|e| e.command() == Some(id))
            .map_err(|e| EngineError::client("close_session", e))?
            .map(|d| d.event)
        {
            Some(Event::SessionClosed { .. }) => Ok(()),
            Some(Event::Rejected { error, .. }) => {
                Err(EngineError::refused("close_session", error))
            }
            Some(other) => Err(unexpected("close_session", &other)),
            None => Err(EngineError::Unavailable(format!(
                "close_session: no reply within {t:?}"
            ))),
        }
    }
}

/// What a session talks through: a manager connection ([`Client`]), or an
/// embedded runtime this process ticks (the Python bridge's `Runtime`).
pub trait Port {
    /// Queues a command; its id once accepted.
    fn submit(&mut self, command: Command) -> Result<CommandId, ClientError>;
    /// Queues several in one round trip (see [`Client::submit_many`]).
    fn submit_many(
        &mut self,
        commands: Vec<Command>,
    ) -> Result<Vec<Result<CommandId, CommandError>>, ClientError>;
    /// The first queued or arriving event matching `pred`, within
    /// `timeout`, with the runtime's `terminal` flag; other events stay
    /// queued.
    fn wait_event(
        &mut self,
        timeout: Duration,
        pred: &dyn Fn(&Event) -> bool,
    ) -> Result<Option<Delivered>, ClientError>;
    /// Sends a command without waiting for it to be queued.
    fn send_command(&mut self, command: Command) -> Result<Sending, ClientError>;
    /// A sent command's id once queued; `None` while unanswered.
    fn accepted_id(&mut self, sent: Sending) -> Result<Option<CommandId>, ClientError>;
    /// Where prompts' pages are and what a load would restore (`orbitkv
    /// lookup`, metadata only): one reply per request, in order.
    fn locate(
        &mut self,
        requests: &[LookupRequest],
        timeout: Duration,
    ) -> Result<Vec<LookupReply>, ClientError> {
        let _ = (requests, timeout);
        Err(ClientError::Protocol(
            "this port answers no lookups of where pages are".into(),
        ))
    }
    /// The manager's presence filter (`orbitkv_ipc::presence`), where this
    /// port has one: a lookup whose first page it says is absent misses
    /// without a round trip.
    fn presence(&self) -> Option<&orbitkv_ipc::presence::PresenceView> {
        None
    }
    /// Counts `n` lookups answered from the presence filter.
    fn note_answered_here(&mut self, n: u64) {
        let _ = n;
    }
}

/// A command sent without waiting: queued already (an embedded runtime),
/// or sent to a manager that has not answered yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sending {
    Queued(CommandId),
    Sent(orbitkv_ipc::Sent),
}

impl Port for Client {
    fn submit(&mut self, command: Command) -> Result<CommandId, ClientError> {
        Client::submit(self, command)
    }

    fn presence(&self) -> Option<&orbitkv_ipc::presence::PresenceView> {
        Client::presence(self)
    }

    fn note_answered_here(&mut self, n: u64) {
        Client::note_answered_here(self, n)
    }

    fn submit_many(
        &mut self,
        commands: Vec<Command>,
    ) -> Result<Vec<Result<CommandId, CommandError>>, ClientError> {
        Client::submit_many(self, commands)
    }

    fn wait_event(
        &mut self,
        timeout: Duration,
        pred: &dyn Fn(&Event) -> bool,
    ) -> Result<Option<Delivered>, ClientError> {
        Client::wait_delivered(self, timeout, pred)
    }

    fn send_command(&mut self, command: Command) -> Result<Sending, ClientError> {
        Client::send_command(self, command).map(Sending::Sent)
    }

    fn accepted_id(&mut self, sent: Sending) -> Result<Option<CommandId>, ClientError> {
        match sent {
            Sending::Queued(id) => Ok(Some(id)),
            Sending::Sent(s) => Client::accepted_id(self, s),
        }
    }

    fn locate(
        &mut self,
        requests: &[LookupRequest],
        timeout: Duration,
    ) -> Result<Vec<LookupReply>, ClientError> {
        Client::lookup_many(self, requests, timeout)
    }
}

/// The runtime's `terminal` flag and the event's kind disagree: a kind
/// that cannot end its job `ended` it, or one that must end it `did not
/// end` it.
fn protocol(how: &str, e: &Event) -> EngineError {
    EngineError::Unavailable(format!("protocol: {how} a job: {e:?}"))
}

fn unexpected(command: &'static str, e: &Event) -> EngineError {
    EngineError::Unavailable(format!("{command}: unexpected reply {e:?}"))
}

fn submit(
    c: &mut dyn Port,
    what: &'static str,
    command: Command,
) -> Result<CommandId, EngineError> {
    c.submit(command).map_err(|e| EngineError::client(what, e))
}

fn submit_many(
    c: &mut dyn Port,
    what: &'static str,
    commands: Vec<Command>,
) -> Result<Vec<CommandId>, EngineError> {
    c.submit_many(commands)
        .map_err(|e| EngineError::client(what, e))?
        .into_iter()
        .map(|r| r.map_err(|e| EngineError::client(what, ClientError::Command(e))))
        .collect()
}

/// The reply to command `id`; a `rejected` one is [`EngineError::Refused`].
fn reply(
    c: &mut dyn Port,
    what: &'static str,
    id: CommandId,
    timeout: Duration,
) -> Result<Event, EngineError> {
    match c
        .wait_event(timeout, &|e| e.command() == Some(id))
        .map_err(|e| EngineError::client(what, e))?
    {
        // A set-up command's one reply ends it.
        Some(d) if !d.terminal => Err(protocol("did not end", &d.event)),
        Some(Delivered {
            event: Event::Rejected { error, .. },
            ..
        }) => Err(EngineError::refused(what, error)),
        Some(d) => Ok(d.event),
        None => Err(EngineError::Unavailable(format!(
            "{what}: no reply within {timeout:?}"
        ))),
    }
}

fn call(
    c: &mut dyn Port,
    what: &'static str,
    command: Command,
    timeout: Duration,
) -> Result<Event, EngineError> {
    let id = submit(c, what, command)?;
    reply(c, what, id, timeout)
}

/// A lookup's answer: its one event, which ends it (the runtime marks it
/// terminal); a refusal is [`EngineError::Refused`].
fn lookup_answer(d: Delivered) -> Result<Lookup, EngineError> {
    if !d.terminal {
        return Err(protocol("did not end", &d.event));
    }
    if let Event::Rejected { error, .. } = d.event {
        return Err(EngineError::refused("lookup", error));
    }
    lookup_result(d.event)
}

fn lookup_result(e: Event) -> Result<Lookup, EngineError> {
    match e {
        Event::QueryResult {
            selected,
            miss,
            candidates,
            common,
            ..
        } => Ok(Lookup {
            selected: if miss.is_some() { None } else { selected },
            miss,
            candidates,
            common,
            local: false,
        }),
        other => Err(unexpected("lookup", &other)),
    }
}
