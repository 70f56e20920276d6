//! `orbitkv inspect`: a running manager's live state, for an operator at a
//! terminal (refreshing) or a script (`--json`, one snapshot).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, Result};
use orbitkv_ipc::{Client, ClientOptions, Snapshot, Window};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The manager's socket.
    #[arg(long, env = "ORBITKV_SOCKET")]
    socket: Option<PathBuf>,
    /// Print one snapshot as JSON and exit.
    #[arg(long)]
    json: bool,
    /// Refresh every N seconds until interrupted (text view only); 0 prints
    /// once.
    #[arg(long, default_value_t = 0)]
    watch: u64,
}

pub fn run(args: Args) -> Result<()> {
    let socket = args
        .socket
        .unwrap_or_else(orbitkv_manager::settings::default_socket);
    let options = ClientOptions {
        hot_path: false,
        ..ClientOptions::default()
    };
    let mut c = Client::connect_with(&socket, "orbitkv inspect", options)
        .with_context(|| format!("connecting to {}", socket.display()))?;
    loop {
        let s = c.inspect(Duration::from_secs(10))?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&s)?);
            return Ok(());
        }
        if args.watch > 0 {
            // Clear the screen and go home, as `watch` does.
            print!("\x1b[2J\x1b[H");
        }
        print!("{}", render(&s));
        if args.watch == 0 {
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs(args.watch));
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / f64::from(1u32 << 30))
}

fn window(name: &str, w: &Window) -> String {
    let mut o = format!(
        "{name} ({:.0} s): queries {}  hits {}  hit rate {:.1}%  hit tokens {}/{}  restored {}  published {}  checksum failures {}\n",
        w.seconds,
        w.queries,
        w.hits,
        w.hit_rate * 100.0,
        w.hit_tokens,
        w.queried_tokens,
        gib(w.bytes_restored),
        gib(w.bytes_published),
        w.checksum_failures,
    );
    if !w.misses.is_empty() {
        let m: Vec<String> = w.misses.iter().map(|(k, v)| format!("{k} {v}")).collect();
        o.push_str(&format!("  misses: {}\n", m.join(", ")));
    }
    if !w.refusals.is_empty() {
        let m: Vec<String> = w.refusals.iter().map(|(k, v)| format!("{k} {v}")).collect();
        o.push_str(&format!("  refused: {}\n", m.join(", ")));
    }
    if !w.evictions.is_empty() {
        let m: Vec<String> = w
            .evictions
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        o.push_str(&format!("  evictions: {}\n", m.join(", ")));
    }
    o
}

pub fn render(s: &Snapshot) -> String {
    let mut o = format!(
        "orbitkv manager {:016x}, up {:.0} s\n",
        s.incarnation, s.uptime_s
    );
    o.push_str(&format!(
        "instances {}  sessions {}  operations {}  leases {}  transfers {}  device pages {}\n",
        s.instances, s.sessions, s.operations, s.leases, s.transfers, s.device_pages
    ));
    if !s.operations_by_state.is_empty() {
        let m: Vec<String> = s
            .operations_by_state
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        o.push_str(&format!("  operations by state: {}\n", m.join(", ")));
    }
    o.push_str(&format!(
        "dram: {} pages, {} of {} used, {} reserved for recoveries\n",
        s.pages,
        gib(s.pool_bytes_used),
        gib(s.pool_capacity_bytes),
        gib(s.bytes_reserved)
    ));
    for (name, (used, cap)) in &s.tiers {
        o.push_str(&format!("{name}: {} of {} used\n", gib(*used), gib(*cap)));
    }
    let h = &s.handoffs;
    if h.held > 0 {
        o.push_str(&format!(
            "p/d handoffs: {} standing, {} pages pinned, {} of {} reserved; {} held, {} taken, \
             {} expired (the decode engine recomputed)\n",
            h.standing,
            h.pinned_pages,
            gib(h.reserved_bytes),
            gib(h.budget_bytes),
            h.held,
            h.taken,
            h.expired
        ));
    }
    if let Some(p) = &s.presence {
        let state = match &p.closed_because {
            None => "open".to_owned(),
            Some(why) => format!("closed ({why}: every lookup asks the manager)"),
        };
        o.push_str(&format!(
            "presence filter: {state}, {:.1}% of {} set; {} misses answered by engines; {} rebuilds\n",
            p.fill * 100.0,
            gib(p.bytes),
            p.misses_answered,
            p.rebuilds
        ));
    }
    o.push_str(&window("last minute", &s.last_minute));
    o.push_str(&window("since start", &s.total));
    o.push_str(&format!("connections {}\n", s.connections.len()));
    for c in &s.connections {
        o.push_str(&format!(
            "  #{:<5} {:<24} pid {:<8} sessions {:<3} regions {:<3} outbox {} B{}\n",
            c.id,
            c.client,
            c.pid,
            c.sessions,
            c.regions,
            c.outbox_bytes,
            if c.hot { "  hot" } else { "" }
        ));
    }
    o
}
