//! The trace format (`docs/trace-format.md`): JSONL, a header line, then one
//! engine-side event per line with a simulated timestamp `t` in µs.
//!
//! Lines are either raw runtime commands (`cmd`, with `$name` references to
//! handles bound by earlier lines) or engine-level steps the replay driver
//! expands into commands (`register`, `open`, `publish`, `request`), plus
//! `tick`, `fault` and `tier_put`. Parsing never panics: a bad line is a
//! [`TraceError`] with its line number.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const TRACE_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    /// Format version; must be [`TRACE_VERSION`].
    pub orbitkv_trace: u32,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Runtime configuration (`orbitkv_world::Config`); defaults apply to
    /// omitted fields.
    #[serde(default)]
    pub config: Option<Value>,
    #[serde(default)]
    pub latency: Latency,
    /// `interval`: the simulated manager ticks every `tick_interval_us`,
    /// and `tick` lines add ticks. `explicit` (recorded traces): the runtime
    /// ticks only at `tick` lines, at their `t`, as it did when recorded.
    #[serde(default)]
    pub ticks: Ticks,
    /// Idle tick interval of the simulated manager.
    #[serde(default = "default_tick_interval")]
    pub tick_interval_us: u64,
    /// After the last line, keep ticking up to this long for work to drain.
    #[serde(default = "default_drain")]
    pub drain_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ticks {
    #[default]
    Interval,
    Explicit,
}

fn default_tick_interval() -> u64 {
    10
}

/// Longer than the default `transfer_timeout_us`, so a transfer lost near
/// the end of a trace is still reported overdue.
fn default_drain() -> u64 {
    12_000_000
}

/// Latency models of the simulated backends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Latency {
    /// Fixed cost of a device copy batch.
    pub copy_us: u64,
    /// Device copy rate; 0 is infinitely fast.
    pub copy_bytes_per_us: u64,
    /// Lower tiers, in lookup order.
    pub tiers: Vec<TierLatency>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierLatency {
    pub name: String,
    pub read_us: u64,
    /// Takes pages DRAM evicts (an SSD); a tier without it is read-only to
    /// the runtime (a remote store filled out of band).
    #[serde(default)]
    pub demote: bool,
    /// Remote-store semantics (`docs/trace-format.md`, "Remote tier"):
    /// stale metadata, verified reads with a deadline, down periods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<RemoteModel>,
    /// With `demote`: the tier writes demoted pages straight from their
    /// DRAM slots (the SSD tier with direct I/O) and releases each slot
    /// this many µs later; until then the runtime keeps the slot. Absent:
    /// the tier copies at demotion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_in_place_us: Option<u64>,
}

/// The simulator's model of the remote tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteModel {
    /// Reads slower than this complete as `remote_timeout` at the deadline.
    pub read_timeout_us: u64,
    /// Published pages are written through to the tier.
    #[serde(default)]
    pub write_through: bool,
}

impl Default for Latency {
    fn default() -> Self {
        Latency {
            copy_us: 20,
            copy_bytes_per_us: 20_000,
            tiers: vec![
                TierLatency {
                    name: "ssd".into(),
                    read_us: 100,
                    demote: true,
                    remote: None,
                    write_in_place_us: None,
                },
                TierLatency {
                    name: "remote".into(),
                    read_us: 800,
                    demote: false,
                    remote: None,
                    write_in_place_us: None,
                },
            ],
        }
    }
}

/// The model shapes `register` understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Model {
    /// Full attention only.
    Dense,
    /// Full attention + sliding window.
    Swa,
    /// Full attention + recurrent checkpoint (and its conv state).
    Hybrid,
    /// Full attention + sliding window + recurrent checkpoint.
    HybridSwa,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Register {
    pub instance: String,
    /// Any string: it is hashed into the computation identity. Change it to
    /// model new weights.
    pub identity: String,
    pub model: Model,
    #[serde(default = "one")]
    pub ranks: u32,
    #[serde(default = "default_page_tokens")]
    pub page_tokens: u64,
    #[serde(default = "default_page_bytes")]
    pub page_bytes: u64,
    /// Sliding-window past tokens, for `swa` and `hybrid_swa`.
    #[serde(default = "default_window")]
    pub window: u64,
}

fn one() -> u32 {
    1
}
fn default_page_tokens() -> u64 {
    16
}
fn default_page_bytes() -> u64 {
    4096
}
fn default_window() -> u64 {
    32
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Open {
    pub instance: String,
    /// Name the session is bound to, e.g. `$s`.
    #[serde(rename = "as")]
    pub name: String,
    /// Device slots per (rank, group) region, registered on open.
    #[serde(default = "default_slots")]
    pub region_slots: u32,
    /// The session's regions are agent-owned (engine memory the runtime
    /// never maps), copied by a simulated copy agent that behaves as this
    /// model says. Needs `dram.shared` in the header's config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentModel>,
}

fn default_slots() -> u32 {
    256
}

/// How a session's simulated copy agent behaves. Each copy draws once
/// (from `seed`, so a replay is deterministic): the agent vanishes (this
/// copy and every later one are never reported, and the engine closes its
/// session; the trace's one origin stays, so the runtime keeps what those
/// copies may touch held, as for a lost completion), the copy fails, it is
/// reported `late_us` late, or it is done and reported after `copy_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentModel {
    #[serde(default)]
    pub copy_us: u64,
    #[serde(default)]
    pub late_per_mille: u64,
    #[serde(default)]
    pub late_us: u64,
    #[serde(default)]
    pub fail_per_mille: u64,
    #[serde(default)]
    pub vanish_per_mille: u64,
    #[serde(default)]
    pub seed: u64,
}

/// A prompt: segments `"name:pages"`; equal leading segments give equal
/// chained hashes, so prompts share prefixes the way real ones do.
pub type Prompt = Vec<String>;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Publish {
    pub session: String,
    pub request: u64,
    pub prompt: Prompt,
    /// Ranks that publish; default all.
    #[serde(default)]
    pub ranks: Option<Vec<u32>>,
    /// Groups that publish; default all.
    #[serde(default)]
    pub groups: Option<Vec<u32>>,
    /// Publish only pages with index in `[from_page, to_page)`.
    #[serde(default)]
    pub from_page: u64,
    #[serde(default)]
    pub to_page: Option<u64>,
    /// Checkpoint groups publish only pages whose end is a multiple of this
    /// many pages (`(index + 1) % every == 0`): recurrent state is saved at
    /// intervals. Other groups publish every page.
    #[serde(default)]
    pub checkpoint_every: Option<u64>,
}

/// What the simulated engine does with a ready recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Then {
    #[default]
    Restore,
    /// The engine's one-command hit: a `load` naming a device page for
    /// every page of every rank and group, sent instead of the query.
    Load,
    Release,
    /// Leave it: the preparation deadline retires it.
    Nothing,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub session: String,
    pub request: u64,
    pub prompt: Prompt,
    /// Valid HBM prefix origin in tokens.
    #[serde(default)]
    pub origin: u64,
    /// Prompt length in tokens; default all pages plus one token.
    #[serde(default)]
    pub prompt_len: Option<u64>,
    #[serde(default)]
    pub then: Then,
    /// Cancel this long after submitting, if still unfinished.
    #[serde(default)]
    pub cancel_after_us: Option<u64>,
    #[serde(default)]
    pub speculative: bool,
    /// Bind the operation handle to this name.
    #[serde(default, rename = "as")]
    pub name: Option<String>,
    /// Free (and so allow reuse of) restore destinations this long after
    /// the restore is submitted: a device-page reuse racing the copy.
    #[serde(default)]
    pub free_targets_after_us: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierPut {
    pub tier: String,
    pub instance: String,
    pub prompt: Prompt,
    #[serde(default)]
    pub ranks: Option<Vec<u32>>,
    #[serde(default)]
    pub groups: Option<Vec<u32>>,
    #[serde(default)]
    pub from_page: u64,
    #[serde(default)]
    pub to_page: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fault {
    /// The next `count` reads of a tier fail with an I/O error.
    TierReadError { tier: String, count: usize },
    /// The next `count` reads of a tier never complete.
    TierLoseReads { tier: String, count: usize },
    /// Later reads of a tier take `us` longer.
    TierDelay { tier: String, us: u64 },
    /// Flip a byte of page `page` of `prompt` in a tier (checksum kept).
    CorruptPage {
        tier: String,
        instance: String,
        prompt: Prompt,
        page: u64,
        #[serde(default)]
        rank: u32,
        #[serde(default)]
        group: u32,
    },
    /// A tier loses a page (evicted or lost remotely).
    DropPage {
        tier: String,
        instance: String,
        prompt: Prompt,
        page: u64,
        #[serde(default)]
        rank: u32,
        #[serde(default)]
        group: u32,
    },
    /// Remote tier: down (lookups absent, reads fail) for `us`.
    RemoteDown { tier: String, us: u64 },
    /// Remote tier: every record is gone; metadata still promises them.
    RemoteFlush { tier: String },
    /// Remote tier: a page rewritten with other bytes under a valid
    /// checksum of those bytes (an owner that restarted).
    RemoteRewrite {
        tier: String,
        instance: String,
        prompt: Prompt,
        page: u64,
        #[serde(default)]
        rank: u32,
        #[serde(default)]
        group: u32,
    },
    /// Remote tier: a page's value loses its last byte.
    RemoteTruncate {
        tier: String,
        instance: String,
        prompt: Prompt,
        page: u64,
        #[serde(default)]
        rank: u32,
        #[serde(default)]
        group: u32,
    },
    /// The next `count` device copies fail.
    CopyError { count: usize },
    /// The next `count` device copies never report completion.
    CopyLose { count: usize },
    /// Later device copies take `us` longer.
    CopyDelay { us: u64 },
    /// Later device copies get up to `max_us` of jitter: reordered.
    CopyReorder { max_us: u64, seed: u64 },
    /// The engine process dies: its connection (session) closes.
    SessionCrash { session: String },
    /// The manager restarts: DRAM and sessions are gone, lower tiers stay.
    ManagerRestart,
}

/// One trace line.
#[derive(Debug, Clone, PartialEq)]
pub enum Body {
    Cmd { cmd: Value, bind: Option<String> },
    Tick,
    Fault(Fault),
    TierPut(TierPut),
    Register(Register),
    Open(Open),
    Publish(Publish),
    Request(Request),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// 1-based line number in the file.
    pub number: usize,
    pub t: u64,
    pub body: Body,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct TraceError {
    pub line: usize,
    pub message: String,
}

fn err(line: usize, message: impl Into<String>) -> TraceError {
    TraceError {
        line,
        message: message.into(),
    }
}

pub struct Trace {
    pub header: Header,
    pub lines: Vec<Line>,
}

const KINDS: [&str; 8] = [
    "cmd", "tick", "fault", "tier_put", "register", "open", "publish", "request",
];

/// Parses a whole trace. Every bad line is reported (up to `max_errors`),
/// not just the first.
pub fn parse(text: &str, max_errors: usize) -> Result<Trace, Vec<TraceError>> {
    let mut errors = Vec::new();
    let mut header = None;
    let mut lines = Vec::new();
    let mut last_t = 0;
    for (index, raw) in text.lines().enumerate() {
        let number = index + 1;
        if raw.trim().is_empty() || raw.trim_start().starts_with("//") {
            continue;
        }
        if errors.len() >= max_errors {
            break;
        }
        if header.is_none() {
            match serde_json::from_str::<Header>(raw) {
                Ok(h) if h.orbitkv_trace == TRACE_VERSION => header = Some(h),
                Ok(h) => {
                    errors.push(err(
                        number,
                        format!(
                            "unsupported trace version {} (this build reads {TRACE_VERSION})",
                            h.orbitkv_trace
                        ),
                    ));
                    break;
                }
                Err(e) => {
                    errors.push(err(number, format!("bad header: {e}")));
                    break;
                }
            }
            continue;
        }
        match parse_line(number, raw) {
            Ok(line) if line.t < last_t => errors.push(err(
                number,
                format!("time goes backwards: t={} after t={last_t}", line.t),
            )),
            Ok(line) => {
                last_t = line.t;
                lines.push(line);
            }
            Err(e) => errors.push(e),
        }
    }
    match header {
        None if errors.is_empty() => Err(vec![err(0, "empty trace: no header line")]),
        Some(header) if errors.is_empty() => Ok(Trace { header, lines }),
        _ => Err(errors),
    }
}

fn parse_line(number: usize, raw: &str) -> Result<Line, TraceError> {
    let value: Value =
        serde_json::from_str(raw).map_err(|e| err(number, format!("not JSON: {e}")))?;
    let Value::Object(mut map) = value else {
        return Err(err(number, "a line must be a JSON object"));
    };
    let t = match map.remove("t") {
        Some(Value::Number(n)) => n
            .as_u64()
            .ok_or_else(|| err(number, "`t` must be a non-negative integer (µs)"))?,
        Some(_) => return Err(err(number, "`t` must be a non-negative integer (µs)")),
        None => return Err(err(number, "missing `t`")),
    };
    let bind = match map.remove("bind") {
        None => None,
        Some(Value::String(s)) if s.starts_with('$') => Some(s),
        Some(_) => return Err(err(number, "`bind` must be a string starting with `$`")),
    };
    let kinds: Vec<&str> = KINDS
        .iter()
        .copied()
        .filter(|k| map.contains_key(*k))
        .collect();
    if kinds.len() != 1 || map.len() != 1 {
        let keys: Vec<&String> = map.keys().collect();
        return Err(err(
            number,
            format!("expected `t` and exactly one of {KINDS:?}, got {keys:?}"),
        ));
    }
    let kind = kinds[0];
    if bind.is_some() && kind != "cmd" {
        return Err(err(number, "`bind` belongs on `cmd` lines"));
    }
    let v = map.remove(kind).expect("checked above");
    let de = |e: serde_json::Error| err(number, format!("{kind}: {e}"));
    let body = match kind {
        "cmd" => {
            if !v.is_object() {
                return Err(err(number, "`cmd` must be an object"));
            }
            Body::Cmd { cmd: v, bind }
        }
        "tick" => Body::Tick,
        "fault" => Body::Fault(serde_json::from_value(v).map_err(de)?),
        "tier_put" => Body::TierPut(serde_json::from_value(v).map_err(de)?),
        "register" => Body::Register(serde_json::from_value(v).map_err(de)?),
        "open" => Body::Open(serde_json::from_value(v).map_err(de)?),
        "publish" => Body::Publish(serde_json::from_value(v).map_err(de)?),
        "request" => Body::Request(serde_json::from_value(v).map_err(de)?),
        _ => unreachable!("kinds come from KINDS"),
    };
    if let Body::Register(r) = &body
        && (r.ranks == 0 || r.page_tokens == 0 || r.page_bytes == 0)
    {
        return Err(err(
            number,
            "register: ranks, page_tokens and page_bytes must be positive",
        ));
    }
    Ok(Line { number, t, body })
}

/// Writes one line back in trace form (for recorded and minimized traces).
pub fn to_json(line: &Line) -> Value {
    let mut map = serde_json::Map::new();
    map.insert("t".into(), line.t.into());
    let (k, v) = match &line.body {
        Body::Cmd { cmd, bind } => {
            if let Some(b) = bind {
                map.insert("bind".into(), b.clone().into());
            }
            ("cmd", cmd.clone())
        }
        Body::Tick => ("tick", Value::Object(Default::default())),
        Body::Fault(f) => ("fault", serde_json::to_value(f).expect("plain data")),
        Body::TierPut(p) => ("tier_put", serde_json::to_value(p).expect("plain data")),
        Body::Register(r) => ("register", serde_json::to_value(r).expect("plain data")),
        Body::Open(o) => ("open", serde_json::to_value(o).expect("plain data")),
        Body::Publish(p) => ("publish", serde_json::to_value(p).expect("plain data")),
        Body::Request(r) => ("request", serde_json::to_value(r).expect("plain data")),
    };
    map.insert(k.into(), v);
    Value::Object(map)
}

/// Renders a trace as JSONL.
pub fn render(header: &Header, lines: &[Line]) -> String {
    let mut out = serde_json::to_string(header).expect("plain data");
    out.push('\n');
    for l in lines {
        out.push_str(&serde_json::to_string(&to_json(l)).expect("plain data"));
        out.push('\n');
    }
    out
}

/// Parses `"name:pages"` prompt segments into (name, pages).
pub fn segments(prompt: &Prompt) -> Result<Vec<(String, u64)>, String> {
    prompt
        .iter()
        .map(|seg| {
            let (name, pages) = seg
                .rsplit_once(':')
                .ok_or_else(|| format!("prompt segment {seg:?} is not \"name:pages\""))?;
            let pages: u64 = pages
                .parse()
                .map_err(|_| format!("prompt segment {seg:?}: pages is not a number"))?;
            if name.is_empty() || pages == 0 || pages > 1 << 20 {
                return Err(format!(
                    "prompt segment {seg:?} needs a name and 1..=1048576 pages"
                ));
            }
            Ok((name.to_owned(), pages))
        })
        .collect()
}

/// The engine-native chained hashes of a prompt's pages: page `i` hashes
/// page `i - 1`'s hash with its own content, so equal prefixes give equal
/// hashes and a different earlier page changes every later one.
pub fn chained_hashes(prompt: &Prompt) -> Result<Vec<u64>, String> {
    let mut out = Vec::new();
    let mut prev = 0x6f72_6269_746b_7631u64; // "orbitkv1"
    for (name, pages) in segments(prompt)? {
        for j in 0..pages {
            let mut buf = prev.to_le_bytes().to_vec();
            buf.extend_from_slice(name.as_bytes());
            buf.extend_from_slice(&j.to_le_bytes());
            prev = xxhash_rust::xxh3::xxh3_64(&buf);
            out.push(prev);
        }
    }
    Ok(out)
}
