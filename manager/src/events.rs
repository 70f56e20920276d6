//! The host's KV event stream (`[events]`, docs/events.md): what this
//! manager's DRAM tier gains and loses, for KV-aware routers, in vLLM's
//! own `KVEventBatch` shape so a router already reading vLLM's ZMQ
//! publisher reads this one the same way.
//!
//! - **PUB** at `publish`: multipart `[topic, seq, payload]`, one topic per
//!   namespace (its 64 hex digits), `seq` an 8-byte big-endian counter of
//!   that topic's batches from [`first_seq`] (the manager's start time, so
//!   a restart shows as a jump), `payload` a msgpack `KVEventBatch`
//!   (`[ts, [event, ...]]`; events are maps tagged by `type`).
//! - **ROUTER** at `replay` (optional): a request `[start_seq]` (vLLM's
//!   form, through a REQ socket) or `[topic, start_seq]` is answered with
//!   every buffered batch of (that topic) from `start_seq` on, as
//!   `[topic, seq, payload]`, then `["", -1, ""]`.
//!
//! Honest by construction: `BlockStored` is sent for a page once its bytes
//! and checksum landed and a query can find it (`PageChange::Stored`), and
//! `BlockRemoved` when it left the index, in the order the runtime made the
//! changes. A topic's first batch in a manager's life is
//! `AllBlocksCleared` (what a previous manager advertised is gone), and so
//! is a batch after changes were lost (the runtime's journal overflowed or
//! the publisher thread fell behind): subscribers forget rather than trust
//! what they can no longer follow. Only DRAM is advertised for now; pages
//! on SSD or the remote tier are not (a router undercounts them, it never
//! counts a page that is not here).
//!
//! The event loop only drains the journal and hands compact batches to a
//! bounded channel; encoding, sending and replay run on the publisher
//! thread. A full channel drops the batch (counted) and marks the topics
//! for an `AllBlocksCleared`.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::Duration;

use orbitkv_components::StateKey;
use orbitkv_components::contract::Rule;
use orbitkv_components::{Namespace, NativeHash};
use orbitkv_world::{PageChange, Runtime, TierChange};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use tracing::{info, warn};

use crate::ServeError;

/// The `[events]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsConfig {
    /// ZMQ PUB address to bind, e.g. `tcp://127.0.0.1:5557` (or `ipc://PATH`).
    pub publish: String,
    /// ZMQ ROUTER address to bind for replays of missed batches.
    #[serde(default)]
    pub replay: Option<String>,
    /// Batches kept for replay (all topics together).
    #[serde(default = "default_buffer_batches")]
    pub buffer_batches: usize,
    /// Events in one batch at most; a tick's changes of one namespace are
    /// split into batches of this size.
    #[serde(default = "default_max_events_per_batch")]
    pub max_events_per_batch: usize,
    /// Page changes the runtime keeps between two drains (one tick's worth
    /// is far less); past it they are lost and subscribers told to forget.
    #[serde(default = "default_max_pending_changes")]
    pub max_pending_changes: usize,
    /// Batches waiting for the publisher thread; past it they are dropped.
    #[serde(default = "default_max_queued_batches")]
    pub max_queued_batches: usize,
    /// ZMQ send high-water mark of the PUB socket (messages per subscriber).
    #[serde(default = "default_hwm")]
    pub hwm: i32,
    /// Lets a `tcp://` address be a non-loopback one: every host that
    /// reaches it learns which prefixes this host holds (as with
    /// `[serve] metrics_public`).
    #[serde(default)]
    pub public: bool,
}

fn default_buffer_batches() -> usize {
    10_000
}
fn default_max_events_per_batch() -> usize {
    1024
}
fn default_max_pending_changes() -> usize {
    1 << 20
}
fn default_max_queued_batches() -> usize {
    10_000
}
fn default_hwm() -> i32 {
    100_000
}

impl EventsConfig {
    /// Every bound at its default, publishing at `publish`.
    pub fn at(publish: String) -> EventsConfig {
        EventsConfig {
            publish,
            replay: None,
            buffer_batches: default_buffer_batches(),
            max_events_per_batch: default_max_events_per_batch(),
            max_pending_changes: default_max_pending_changes(),
            max_queued_batches: default_max_queued_batches(),
            hwm: default_hwm(),
            public: false,
        }
    }

    pub fn validate(&self) -> Result<(), ServeError> {
        let bad = |what: String| Err(ServeError::Setting(format!("[events] {what}")));
        for (name, v, max) in [
            ("buffer_batches", self.buffer_batches, 1_000_000),
            ("max_events_per_batch", self.max_events_per_batch, 65_536),
            ("max_pending_changes", self.max_pending_changes, 1 << 26),
            ("max_queued_batches", self.max_queued_batches, 1_000_000),
        ] {
            if !(1..=max).contains(&v) {
                return bad(format!("{name} = {v} is outside 1..={max}"));
            }
        }
        if self.hwm < 1 {
            return bad(format!("hwm = {} must be > 0", self.hwm));
        }
        let addrs = std::iter::once(("publish", &self.publish))
            .chain(self.replay.iter().map(|r| ("replay", r)));
        for (name, addr) in addrs {
            if addr.starts_with("ipc://") {
                continue;
            }
            let Some(host) = addr
                .strip_prefix("tcp://")
                .and_then(|hp| hp.rsplit_once(':'))
                .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']'))
            else {
                return bad(format!(
                    "{name} = {addr:?} is not a tcp://HOST:PORT or ipc://PATH address"
                ));
            };
            let loopback = host == "localhost"
                || host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
            if !loopback && !self.public {
                return bad(format!(
                    "{name} = {addr:?} is not a loopback address: every host that reaches it would \
                     learn which prefixes this host holds; set [events] public = true to mean \
                     it, or use ipc://PATH"
                ));
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Why {
    reason: String,
}

/// The stream's counters on `/metrics`.
#[derive(Clone, Default)]
pub struct EventCounters {
    batches: Counter,
    events: Family<Kind, Counter>,
    lost: Family<Why, Counter>,
    replays: Counter,
}

impl EventCounters {
    pub fn register(r: &mut Registry) -> EventCounters {
        let c = EventCounters::default();
        let r = r.sub_registry_with_prefix("kv_events");
        r.register("batches", "KV event batches published", c.batches.clone());
        r.register("events", "KV events published, by type", c.events.clone());
        r.register(
            "lost",
            "Times page changes were lost before publishing, by reason (subscribers are sent AllBlocksCleared)",
            c.lost.clone(),
        );
        r.register("replays", "Replay requests served", c.replays.clone());
        for kind in ["BlockStored", "BlockRemoved", "AllBlocksCleared"] {
            let _ = c.events.get_or_create(&Kind { kind: kind.into() });
        }
        for reason in ["journal_full", "queue_full"] {
            let _ = c.lost.get_or_create(&Why {
                reason: reason.into(),
            });
        }
        c
    }
}

/// One event, before encoding.
#[derive(Debug, Clone, PartialEq)]
enum Ev {
    Stored {
        hash: NativeHash,
        group: u32,
        page_tokens: u64,
        rule: Option<Rule>,
        medium: Medium,
    },
    Removed {
        hash: NativeHash,
        group: u32,
        medium: Medium,
    },
    Cleared,
}

/// Where a page is, as vLLM's events say it: `medium` and `locality`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Medium {
    /// The DRAM tier: `CPU`, `LOCAL`.
    Dram,
    /// A lower tier on this host (the SSD): `STORAGE`, `LOCAL`.
    Storage,
    /// A store shared with other hosts: `STORAGE`, `REMOTE`.
    Remote,
}

impl Medium {
    fn of_tier(name: &str) -> Medium {
        if name == "remote" {
            Medium::Remote
        } else {
            Medium::Storage
        }
    }

    fn medium(self) -> &'static str {
        match self {
            Medium::Dram => "CPU",
            Medium::Storage | Medium::Remote => "STORAGE",
        }
    }

    fn locality(self) -> &'static str {
        match self {
            Medium::Remote => "REMOTE",
            Medium::Dram | Medium::Storage => "LOCAL",
        }
    }
}

/// A change of what a medium holds: a page stored (true) or removed.
type Change = (Medium, bool, StateKey);

/// One topic's events of one tick.
struct Batch {
    namespace: Namespace,
    ts: f64,
    events: Vec<Ev>,
}

/// The event loop's half: drains the runtime's journal after each tick.
pub struct EventStream {
    tx: SyncSender<Batch>,
    counters: EventCounters,
    max_events: usize,
    changes: Vec<PageChange>,
    tier_changes: Vec<(&'static str, TierChange)>,
    /// What each namespace's pages are (`Runtime::namespaces`), refreshed
    /// when a change names one not here.
    described: HashMap<Namespace, (u64, Vec<(u32, Rule)>)>,
    /// Topics that have had their first batch this incarnation.
    opened: BTreeSet<Namespace>,
    /// Topics to be told to forget before their next batch.
    forget: BTreeSet<Namespace>,
}

impl EventStream {
    /// Binds the sockets now (a bad address stops the start, naming the
    /// setting), starts the publisher thread, and turns on the runtime's
    /// page journal.
    pub fn start(
        cfg: &EventsConfig,
        rt: &mut Runtime,
        counters: EventCounters,
    ) -> Result<EventStream, ServeError> {
        cfg.validate()?;
        let ctx = zmq::Context::new();
        let setting = |name: &str, addr: &str, e: zmq::Error| {
            ServeError::Setting(format!("[events] {name} = {addr:?}: {e}"))
        };
        let publish = ctx
            .socket(zmq::PUB)
            .map_err(|e| setting("publish", &cfg.publish, e))?;
        publish
            .set_sndhwm(cfg.hwm)
            .and_then(|()| publish.set_linger(0))
            .and_then(|()| publish.bind(&cfg.publish))
            .map_err(|e| setting("publish", &cfg.publish, e))?;
        let replay = match &cfg.replay {
            Some(addr) => {
                let s = ctx
                    .socket(zmq::ROUTER)
                    .map_err(|e| setting("replay", addr, e))?;
                // A whole replay plus its end marker fits in the queue.
                let hwm = i32::try_from(2 * (cfg.buffer_batches + 1)).unwrap_or(i32::MAX);
                s.set_sndhwm(hwm)
                    .and_then(|()| s.set_linger(0))
                    .and_then(|()| s.bind(addr))
                    .map_err(|e| setting("replay", addr, e))?;
                Some(s)
            }
            None => None,
        };
        let (tx, rx) = std::sync::mpsc::sync_channel(cfg.max_queued_batches);
        let thread = Publisher {
            publish,
            replay,
            buffer: VecDeque::new(),
            buffer_batches: cfg.buffer_batches,
            seqs: HashMap::new(),
            first_seq: first_seq(),
            counters: counters.clone(),
        };
        std::thread::Builder::new()
            .name("orbitkv-events".into())
            .spawn(move || thread.run(rx, ctx))
            .map_err(|e| ServeError::Io {
                what: "the events thread".into(),
                source: e,
            })?;
        rt.record_page_changes(cfg.max_pending_changes);
        rt.count_event_races();
        info!(publish = %cfg.publish, replay = ?cfg.replay, "KV events");
        Ok(EventStream {
            tx,
            counters,
            max_events: cfg.max_events_per_batch,
            changes: Vec::new(),
            tier_changes: Vec::new(),
            described: HashMap::new(),
            opened: BTreeSet::new(),
            forget: BTreeSet::new(),
        })
    }

    /// Publishes what the last tick changed. Never blocks.
    pub fn drain(&mut self, rt: &mut Runtime, taken: &mut crate::presence::Changes) {
        // A loss in one medium makes subscribers forget the topic's every
        // medium (AllBlocksCleared names none): each lists what it holds
        // again after a loss of its own, so the others must too.
        let (dram_lost, tier_lost) = (taken.dram_lost, taken.tiers_lost);
        self.changes.append(&mut taken.dram);
        self.tier_changes.append(&mut taken.tiers);
        if dram_lost || tier_lost {
            self.counters
                .lost
                .get_or_create(&Why {
                    reason: "journal_full".into(),
                })
                .inc();
            warn!(
                "KV events: page changes were lost (journal full); subscribers are told to forget, \
                 and every stored page is listed again"
            );
            self.forget.extend(self.opened.iter().copied());
            if !dram_lost {
                self.changes.clear();
                rt.list_pages(&mut self.changes);
            }
            if !tier_lost {
                self.tier_changes.clear();
                rt.relist_tiers();
                rt.take_tier_changes(&mut self.tier_changes);
            }
        }
        if self.changes.is_empty() && self.tier_changes.is_empty() && self.forget.is_empty() {
            return;
        }
        let changes: Vec<Change> = self
            .changes
            .drain(..)
            .map(|c| match c {
                PageChange::Stored(k) => (Medium::Dram, true, k),
                PageChange::Removed(k, _) => (Medium::Dram, false, k),
            })
            .chain(self.tier_changes.drain(..).map(|(tier, c)| match c {
                TierChange::Stored(k) => (Medium::of_tier(tier), true, k),
                TierChange::Removed(k) => (Medium::of_tier(tier), false, k),
            }))
            .collect();
        let namespace_of = |c: &Change| c.2.namespace;
        if changes
            .iter()
            .any(|c| !self.described.contains_key(&namespace_of(c)))
        {
            self.described = rt
                .namespaces()
                .into_iter()
                .map(|n| (n.namespace, (n.page_tokens, n.groups)))
                .collect();
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        // Per namespace, in the order of the changes.
        let mut by_ns: Vec<(Namespace, Vec<Ev>)> = Vec::new();
        for ns in std::mem::take(&mut self.forget) {
            by_ns.push((ns, vec![Ev::Cleared]));
        }
        for c in &changes {
            let ns = namespace_of(c);
            let ev = match *c {
                (medium, true, k) => {
                    let (page_tokens, rule) = match self.described.get(&ns) {
                        Some((t, groups)) => (
                            *t,
                            groups.iter().find(|(g, _)| *g == k.group).map(|(_, r)| *r),
                        ),
                        None => (0, None),
                    };
                    Ev::Stored {
                        hash: k.native,
                        group: k.group,
                        page_tokens,
                        rule,
                        medium,
                    }
                }
                (medium, false, k) => Ev::Removed {
                    hash: k.native,
                    group: k.group,
                    medium,
                },
            };
            let at = match by_ns.iter().position(|(n, _)| *n == ns) {
                Some(i) => i,
                None => {
                    let first = if self.opened.insert(ns) {
                        vec![Ev::Cleared]
                    } else {
                        Vec::new()
                    };
                    by_ns.push((ns, first));
                    by_ns.len() - 1
                }
            };
            by_ns[at].1.push(ev);
        }
        for (namespace, events) in by_ns {
            for chunk in events.chunks(self.max_events) {
                let batch = Batch {
                    namespace,
                    ts,
                    events: chunk.to_vec(),
                };
                match self.tx.try_send(batch) {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) => {
                        self.counters
                            .lost
                            .get_or_create(&Why {
                                reason: "queue_full".into(),
                            })
                            .inc();
                        warn!(
                            "KV events: the publisher fell behind; subscribers are told to forget"
                        );
                        self.forget.insert(namespace);
                        break;
                    }
                    Err(TrySendError::Disconnected(_)) => {
                        warn!("KV events: the publisher thread is gone; no more events");
                        return;
                    }
                }
            }
        }
    }
}

/// The publisher thread's state.
struct Publisher {
    publish: zmq::Socket,
    replay: Option<zmq::Socket>,
    /// (topic, seq, payload), oldest first, at most `buffer_batches`.
    buffer: VecDeque<(Namespace, u64, Vec<u8>)>,
    buffer_batches: usize,
    seqs: HashMap<Namespace, u64>,
    /// Every topic's first sequence number in this manager's life.
    first_seq: u64,
    counters: EventCounters,
}

/// The manager's start time in Unix milliseconds, times 2^20: above every
/// number an earlier manager on this host used (it would have had to send
/// 2^20 batches per millisecond of its life to reach it), and below 2^63
/// (the replay's end marker is -1 as a signed number) for the next 270
/// years. A subscriber thus tells a restart from a continuation by the
/// number alone: a new manager's numbers jump ahead.
fn first_seq() -> u64 {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    ms << 20
}

/// How often the thread looks for replay requests while no batch comes.
const REPLAY_POLL: Duration = Duration::from_millis(10);
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

impl Publisher {
    fn run(mut self, rx: Receiver<Batch>, _ctx: zmq::Context) {
        loop {
            self.serve_replays();
            match rx.recv_timeout(REPLAY_POLL) {
                Ok(batch) => self.send(batch),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn send(&mut self, batch: Batch) {
        let seq = self.seqs.entry(batch.namespace).or_insert(self.first_seq);
        let this = *seq;
        *seq += 1;
        let payload = encode_batch(batch.ts, &batch.events);
        let topic = batch.namespace.to_hex();
        // PUB never blocks: past the high-water mark ZMQ drops for that
        // subscriber, which sees the gap in `seq` and asks for a replay.
        if let Err(e) = self.publish.send_multipart(
            [topic.as_bytes(), &this.to_be_bytes()[..], &payload[..]],
            zmq::DONTWAIT,
        ) {
            warn!(error = %e, "KV events: publish failed");
        }
        self.counters.batches.inc();
        for ev in &batch.events {
            let kind = match ev {
                Ev::Stored { .. } => "BlockStored",
                Ev::Removed { .. } => "BlockRemoved",
                Ev::Cleared => "AllBlocksCleared",
            };
            self.counters
                .events
                .get_or_create(&Kind { kind: kind.into() })
                .inc();
        }
        if self.buffer.len() == self.buffer_batches {
            self.buffer.pop_front();
        }
        self.buffer.push_back((batch.namespace, this, payload));
    }

    /// Answers the waiting replay requests; a malformed one is logged and
    /// ignored (never answered with anything it could misread).
    fn serve_replays(&mut self) {
        let Some(sock) = &self.replay else { return };
        while let Ok(frames) = sock.recv_multipart(zmq::DONTWAIT) {
            // [client, "", start] (REQ) or [client, "", topic, start].
            let (client, rest) = match frames.split_first() {
                Some((c, rest)) if rest.first().is_some_and(|d| d.is_empty()) => (c, &rest[1..]),
                _ => {
                    warn!(frames = frames.len(), "KV events: malformed replay request");
                    continue;
                }
            };
            let (topic, start) = match rest {
                [start] => (None, start),
                [topic, start] => (Some(topic.as_slice()), start),
                _ => {
                    warn!(frames = frames.len(), "KV events: malformed replay request");
                    continue;
                }
            };
            let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else {
                warn!("KV events: a replay request's start is not 8 bytes");
                continue;
            };
            self.counters.replays.inc();
            for (ns, seq, payload) in &self.buffer {
                let name = ns.to_hex();
                if *seq < start || topic.is_some_and(|t| t != name.as_bytes()) {
                    continue;
                }
                let parts: [&[u8]; 5] = [client, b"", name.as_bytes(), &seq.to_be_bytes(), payload];
                if sock.send_multipart(parts, zmq::DONTWAIT).is_err() {
                    break;
                }
            }
            let end: [&[u8]; 5] = [client, b"", b"", &END_SEQ, b""];
            let _ = sock.send_multipart(end, zmq::DONTWAIT);
        }
    }
}

/// vLLM 0.33's `KVEventBatch`: `[ts, events]` (array-like; the trailing
/// `data_parallel_rank` left out as its default), each event a map whose
/// first key is its `type` tag.
fn encode_batch(ts: f64, events: &[Ev]) -> Vec<u8> {
    use rmp::encode as e;
    let mut out = Vec::with_capacity(64 + events.len() * 160);
    // Writes to a Vec cannot fail.
    let _ = e::write_array_len(&mut out, 2);
    let _ = e::write_f64(&mut out, ts);
    let _ = e::write_array_len(&mut out, events.len() as u32);
    for ev in events {
        encode_event(&mut out, ev);
    }
    out
}

fn encode_event(out: &mut Vec<u8>, ev: &Ev) {
    use rmp::encode as e;
    let key = |out: &mut Vec<u8>, k: &str| {
        let _ = e::write_str(out, k);
    };
    match ev {
        Ev::Stored {
            hash,
            group,
            page_tokens,
            rule,
            medium,
        } => {
            let (kind, window) = match rule {
                Some(Rule::Prefix) => ("full_attention", None),
                Some(Rule::Window { past_tokens }) => ("sliding_window", Some(*past_tokens)),
                Some(Rule::Checkpoint) => ("mamba", None),
                None => ("unknown", None),
            };
            let _ = e::write_map_len(out, 11 + u32::from(window.is_some()));
            key(out, "type");
            key(out, "BlockStored");
            key(out, "block_hashes");
            let _ = e::write_array_len(out, 1);
            let _ = e::write_bin(out, hash.as_bytes());
            key(out, "parent_block_hash");
            let _ = e::write_nil(out);
            key(out, "token_ids");
            let _ = e::write_array_len(out, 0);
            key(out, "block_size");
            let _ = e::write_uint(out, *page_tokens);
            key(out, "lora_id");
            let _ = e::write_nil(out);
            key(out, "medium");
            key(out, medium.medium());
            key(out, "lora_name");
            let _ = e::write_nil(out);
            key(out, "group_idx");
            let _ = e::write_uint(out, u64::from(*group));
            key(out, "kv_cache_spec_kind");
            key(out, kind);
            if let Some(w) = window {
                key(out, "kv_cache_spec_sliding_window");
                let _ = e::write_uint(out, w);
            }
            key(out, "locality");
            key(out, medium.locality());
        }
        Ev::Removed {
            hash,
            group,
            medium,
        } => {
            let _ = e::write_map_len(out, 5);
            key(out, "type");
            key(out, "BlockRemoved");
            key(out, "block_hashes");
            let _ = e::write_array_len(out, 1);
            let _ = e::write_bin(out, hash.as_bytes());
            key(out, "medium");
            key(out, medium.medium());
            key(out, "group_idx");
            let _ = e::write_uint(out, u64::from(*group));
            key(out, "locality");
            key(out, medium.locality());
        }
        Ev::Cleared => {
            let _ = e::write_map_len(out, 1);
            key(out, "type");
            key(out, "AllBlocksCleared");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(text: &str) -> Result<EventsConfig, String> {
        let c: EventsConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }

    #[test]
    fn addresses_are_loopback_or_ipc_unless_public_and_bounds_are_in_range() {
        assert!(cfg(r#"publish = "tcp://127.0.0.1:5557""#).is_ok());
        assert!(cfg(r#"publish = "tcp://[::1]:5557""#).is_ok());
        assert!(cfg(r#"publish = "tcp://localhost:5557""#).is_ok());
        assert!(cfg(r#"publish = "ipc:///run/orbitkv/events""#).is_ok());
        let e = cfg(r#"publish = "tcp://0.0.0.0:5557""#).unwrap_err();
        assert!(e.contains("publish") && e.contains("public = true"), "{e}");
        assert!(cfg("publish = \"tcp://0.0.0.0:5557\"\npublic = true").is_ok());
        let e = cfg("publish = \"ipc:///x\"\nreplay = \"tcp://*:1\"").unwrap_err();
        assert!(e.contains("replay"), "{e}");
        let e = cfg(r#"publish = "inproc://x""#).unwrap_err();
        assert!(e.contains("publish"), "{e}");
        let e = cfg("publish = \"ipc:///x\"\nmax_events_per_batch = 0").unwrap_err();
        assert!(e.contains("max_events_per_batch"), "{e}");
        let e = cfg("publish = \"ipc:///x\"\nbatches = 1").unwrap_err();
        assert!(e.contains("batches"), "{e}");
    }

    #[test]
    fn a_batch_is_an_array_of_ts_and_tagged_maps() {
        let hash = NativeHash::new(&[7; 32]).unwrap();
        let out = encode_batch(
            1.5,
            &[
                Ev::Cleared,
                Ev::Stored {
                    hash,
                    group: 1,
                    page_tokens: 16,
                    rule: Some(Rule::Window { past_tokens: 127 }),
                    medium: Medium::Dram,
                },
                Ev::Removed {
                    hash,
                    group: 1,
                    medium: Medium::Storage,
                },
            ],
        );
        use rmpv::Value;
        let v = rmpv::decode::read_value(&mut &out[..]).unwrap();
        let Value::Array(batch) = v else {
            panic!("{v:?}")
        };
        assert_eq!(batch[0], Value::F64(1.5));
        let Value::Array(events) = &batch[1] else {
            panic!("{batch:?}")
        };
        let fields = |ev: &Value| -> Vec<(String, Value)> {
            ev.as_map()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.as_str().unwrap().to_owned(), v.clone()))
                .collect()
        };
        let cleared = fields(&events[0]);
        assert_eq!(cleared, [("type".into(), "AllBlocksCleared".into())]);
        let stored = fields(&events[1]);
        assert_eq!(
            stored[0],
            ("type".into(), "BlockStored".into()),
            "the tag first"
        );
        let get =
            |f: &[(String, Value)], k: &str| f.iter().find(|(n, _)| n == k).unwrap().1.clone();
        assert_eq!(
            get(&stored, "block_hashes"),
            Value::Array(vec![Value::Binary(vec![7; 32])])
        );
        assert_eq!(get(&stored, "block_size"), Value::from(16));
        assert_eq!(get(&stored, "group_idx"), Value::from(1));
        assert_eq!(
            get(&stored, "kv_cache_spec_kind"),
            Value::from("sliding_window")
        );
        assert_eq!(
            get(&stored, "kv_cache_spec_sliding_window"),
            Value::from(127)
        );
        assert_eq!(get(&stored, "medium"), Value::from("CPU"));
        // vLLM's required fields are all there, null where unknown.
        for k in ["parent_block_hash", "lora_id", "lora_name"] {
            assert_eq!(get(&stored, k), Value::Nil, "{k}");
        }
        assert_eq!(get(&stored, "token_ids"), Value::Array(vec![]));
        let removed = fields(&events[2]);
        assert_eq!(removed[0], ("type".into(), "BlockRemoved".into()));
        assert_eq!(get(&removed, "group_idx"), Value::from(1));
        assert_eq!(get(&stored, "locality"), Value::from("LOCAL"));
        assert_eq!(get(&removed, "medium"), Value::from("STORAGE"));
        assert_eq!(get(&removed, "locality"), Value::from("LOCAL"));
        assert_eq!(removed.len(), 5);
        assert_eq!(
            (Medium::of_tier("ssd"), Medium::of_tier("remote").locality()),
            (Medium::Storage, "REMOTE")
        );
    }
}
