//! Operator verbs beside `inspect`, over the manager's socket and under its
//! access rules (same uid both ways): `orbitkv health` for container
//! probes and `orbitkv lookup` (where a prompt's pages are, nothing leased).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use orbitkv_components::NativeHash;
use orbitkv_components::admin::LookupRequest;
use orbitkv_components::namespace::Namespace;
use orbitkv_ipc::{Client, ClientOptions};

/// `orbitkv health` exit codes (docs/serve.md, "Health"): 0 ready (or,
/// with `--live`, answering); 1 answering but not ready; 3 not answering
/// (no socket, no manager, no answer in time, or an untrusted one). Bad
/// flags exit 2, as everywhere.
pub const NOT_READY: u8 = 1;
pub const NOT_LIVE: u8 = 3;

#[derive(clap::Args, Debug)]
pub struct HealthArgs {
    /// The manager's socket.
    #[arg(long, env = "ORBITKV_SOCKET")]
    socket: Option<PathBuf>,
    /// Liveness only: the socket answers (exit 0, else 3).
    #[arg(long)]
    live: bool,
    /// How long the manager has to answer.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// Print the checks as JSON.
    #[arg(long)]
    json: bool,
}

fn connect(socket: Option<PathBuf>, name: &str) -> Result<Client> {
    let socket = socket.unwrap_or_else(orbitkv_manager::settings::default_socket);
    let options = ClientOptions {
        hot_path: false,
        ..ClientOptions::default()
    };
    Client::connect_with(&socket, name, options)
        .with_context(|| format!("connecting to {}", socket.display()))
}

/// Liveness (the manager answers an `Inspect` on its socket) and readiness
/// (no tier down, no operation holding an overdue transfer, room in the
/// runtime's inbox).
pub fn health(args: HealthArgs) -> ExitCode {
    let timeout = Duration::from_millis(args.timeout_ms.max(1));
    let snapshot = connect(args.socket, "orbitkv health").and_then(|mut c| Ok(c.inspect(timeout)?));
    let s = match snapshot {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("{e:#}").replace('\n', " ");
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"live": false, "ready": false, "error": msg})
                );
            } else {
                println!("not live: {msg}");
            }
            return ExitCode::from(NOT_LIVE);
        }
    };
    let h = &s.health;
    let mut problems = Vec::new();
    if !h.tiers_down.is_empty() {
        problems.push(format!("tiers down: {}", h.tiers_down.join(", ")));
    }
    if h.overdue_operations > 0 {
        problems.push(format!(
            "pool wedged: {} operations hold overdue transfers",
            h.overdue_operations
        ));
    }
    if h.inbox_room == 0 {
        problems.push("the runtime's inbox is full".into());
    }
    let ready = problems.is_empty();
    if args.json {
        let v = serde_json::json!({
            "live": true,
            "ready": ready,
            "incarnation": format!("{:016x}", s.incarnation),
            "uptime_s": s.uptime_s,
            "health": h,
            "problems": problems,
        });
        println!("{v}");
    } else if ready || args.live {
        println!(
            "live{}: manager {:016x}, up {:.0} s{}",
            if ready { " and ready" } else { "" },
            s.incarnation,
            s.uptime_s,
            if ready {
                String::new()
            } else {
                format!(" ({})", problems.join("; "))
            }
        );
    } else {
        println!("live, not ready: {}", problems.join("; "));
    }
    if ready || args.live {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(NOT_READY)
    }
}

#[derive(clap::Args, Debug)]
pub struct LookupArgs {
    /// The manager's socket.
    #[arg(long, env = "ORBITKV_SOCKET")]
    socket: Option<PathBuf>,
    /// A registered instance: every rank's namespace.
    #[arg(
        long,
        conflicts_with = "namespace",
        required_unless_present = "namespace"
    )]
    instance: Option<String>,
    /// One namespace (64 hex digits).
    #[arg(long)]
    namespace: Option<String>,
    /// The cache group the hashes belong to.
    #[arg(long, default_value_t = 0)]
    group: u32,
    /// The prompt's chained page hashes, in order, as hex.
    #[arg(required = true)]
    hashes: Vec<String>,
    /// The prompt's length in tokens: a load stops before its last token.
    #[arg(long)]
    prompt_len: Option<u64>,
    /// Print the reply as JSON.
    #[arg(long)]
    json: bool,
}

/// Where each page is (DRAM, then each lower tier's metadata) and how many
/// tokens a prefix group could restore from them. Leases nothing.
pub fn lookup(args: LookupArgs) -> Result<()> {
    let namespace = args
        .namespace
        .as_deref()
        .map(|n| {
            n.parse::<Namespace>()
                .map_err(|e| anyhow::anyhow!("--namespace {n:?}: {e}"))
        })
        .transpose()?;
    let hashes = args
        .hashes
        .iter()
        .map(|h| {
            let bytes = hex::decode(h).with_context(|| format!("hash {h:?} is not hex"))?;
            NativeHash::new(&bytes).map_err(|e| anyhow::anyhow!("hash {h:?}: {e}"))
        })
        .collect::<Result<Vec<_>>>()?;
    let request = LookupRequest {
        instance: args.instance,
        namespace,
        group: args.group,
        hashes,
        prompt_len: args.prompt_len,
    };
    let mut c = connect(args.socket, "orbitkv lookup")?;
    let reply = c.lookup(&request, Duration::from_secs(10))?;
    if let Some(e) = &reply.error {
        bail!("the manager refused the lookup: {e}");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&reply)?);
        return Ok(());
    }
    for n in &reply.namespaces {
        let rank = n
            .rank
            .map_or(String::new(), |(tp, pp)| format!(" (tp {tp}, pp {pp})"));
        let tiers: Vec<String> = n
            .prefix_by_tier
            .iter()
            .map(|(t, p)| format!("{t} {p}"))
            .collect();
        println!(
            "{}{rank}: {} of {} pages from the start{}{}",
            n.namespace.to_hex(),
            n.prefix_pages,
            n.found.len(),
            n.restorable_tokens
                .map_or(String::new(), |t| format!(", {t} tokens")),
            if tiers.is_empty() {
                String::new()
            } else {
                format!(" ({})", tiers.join(", "))
            },
        );
    }
    if let Some(r) = &reply.restorable {
        let tiers: Vec<String> = r.by_tier.iter().map(|(t, n)| format!("{t} {n}")).collect();
        match r.miss {
            Some(reason) => println!("a load would miss: {}", reason.as_str()),
            None => println!(
                "a load would restore {} tokens ({})",
                r.tokens,
                tiers.join(", ")
            ),
        }
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct ClearArgs {
    /// The manager's socket.
    #[arg(long, env = "ORBITKV_SOCKET")]
    socket: Option<PathBuf>,
    /// A registered instance: every rank's namespace.
    #[arg(
        long,
        conflicts_with = "namespace",
        required_unless_present = "namespace"
    )]
    instance: Option<String>,
    /// Namespaces (64 hex digits each; repeat the flag for more).
    #[arg(long)]
    namespace: Vec<String>,
    /// Print the reply as JSON.
    #[arg(long)]
    json: bool,
}

/// Drops every stored page of an instance's namespaces (or of the ones
/// named) from DRAM and each lower tier. Refused while one is leased or
/// being read; a tier that could not clear makes the run exit 1.
pub fn clear(args: ClearArgs) -> Result<()> {
    use orbitkv_components::api::{Command, Event};
    let mut c = connect(args.socket, "orbitkv clear")?;
    let namespaces: Vec<Namespace> = match &args.instance {
        Some(name) => {
            // The instance's namespaces, from a lookup of no pages.
            let request = LookupRequest {
                instance: Some(name.clone()),
                namespace: None,
                group: 0,
                hashes: vec![],
                prompt_len: None,
            };
            let reply = c.lookup(&request, Duration::from_secs(10))?;
            if let Some(e) = reply.error {
                bail!("{e}");
            }
            reply.namespaces.iter().map(|n| n.namespace).collect()
        }
        None => args
            .namespace
            .iter()
            .map(|n| {
                n.parse()
                    .map_err(|e| anyhow::anyhow!("--namespace {n:?}: {e}"))
            })
            .collect::<Result<_>>()?,
    };
    let event = c.call(Command::Clear { namespaces }, Duration::from_secs(30))?;
    let (dram_pages, tiers) = match &event {
        Event::Cleared {
            dram_pages, tiers, ..
        } => (*dram_pages, tiers),
        Event::Rejected { error, .. } => bail!("the manager refused the clear: {error}"),
        other => bail!("unexpected answer {other:?}"),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&event)?);
    } else {
        println!("dram: {dram_pages} pages dropped");
        for t in tiers {
            match (&t.pages, &t.error) {
                (Some(n), _) => println!("{}: {n} pages dropped", t.tier),
                (None, Some(e)) => println!("{}: NOT cleared: {e}", t.tier),
                (None, None) => println!("{}: NOT cleared", t.tier),
            }
        }
    }
    let failed: Vec<&str> = tiers
        .iter()
        .filter(|t| t.pages.is_none())
        .map(|t| t.tier.as_str())
        .collect();
    if !failed.is_empty() {
        return Err(crate::Findings(format!("not cleared in: {}", failed.join(", "))).into());
    }
    Ok(())
}
