//! Recording: every command the runtime accepts, with the clock, and every
//! tick, written as a trace (`docs/trace-format.md`) that `orbitkv replay`
//! runs. Handles are written as `$c<N>` names bound by the command `N` that
//! created them, so a replay maps them onto the handles it gets.
//!
//! A trace has no origins: a replay submits every command as
//! `Origin::EMBEDDED`, which owns every session it opens. `close_origin` is
//! written as `close_session` lines for the sessions that origin had open.

use std::collections::HashMap;
use std::io::Write;

use orbitkv_components::api::{Addressed, Command, CommandId, Event, Origin};
use serde_json::{Value, json};

use crate::config::Config;

pub struct Recorder {
    out: Box<dyn Write + Send>,
    /// Handle bits (device pages, regions, operations) → name.
    names: HashMap<u64, String>,
    /// Session entity bits → name and the origin that opened it.
    sessions: HashMap<u64, (String, Origin)>,
    /// The first write error; recording stops there, the runtime goes on.
    pub error: Option<std::io::Error>,
}

impl Recorder {
    pub fn start(
        mut out: Box<dyn Write + Send>,
        config: &Config,
        tick_interval_us: u64,
    ) -> std::io::Result<Self> {
        let header = json!({
            "orbitkv_trace": 1,
            "name": "recorded",
            "description": "recorded by the OrbitKV runtime",
            "config": config,
            "ticks": "explicit",
            "tick_interval_us": tick_interval_us.max(1),
        });
        writeln!(out, "{header}")?;
        Ok(Recorder {
            out,
            names: HashMap::new(),
            sessions: HashMap::new(),
            error: None,
        })
    }

    fn write(&mut self, line: Value) {
        if self.error.is_none()
            && let Err(e) = writeln!(self.out, "{line}")
        {
            self.error = Some(e);
        }
    }

    /// Rewrites known handles as names, recursively.
    fn rewrite(&self, v: &mut Value) {
        match v {
            Value::Object(map) => {
                for (k, field) in map.iter_mut() {
                    match (k.as_str(), &*field) {
                        ("session", Value::Object(s)) => {
                            if let Some(name) = s
                                .get("id")
                                .and_then(Value::as_u64)
                                .and_then(|id| self.sessions.get(&id))
                            {
                                *field = Value::String(name.0.clone());
                            }
                        }
                        ("region" | "device_page" | "operation", Value::Number(n)) => {
                            if let Some(name) = n.as_u64().and_then(|b| self.names.get(&b)) {
                                *field = Value::String(name.clone());
                            }
                        }
                        _ => self.rewrite(field),
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|i| self.rewrite(i)),
            _ => {}
        }
    }

    pub fn command(&mut self, now_us: u64, id: CommandId, _origin: Origin, command: &Command) {
        // A replay is one process with manager-owned regions: an agent
        // region is recorded as one (the replay's copy engine then does the
        // agent's copies), and the agent's reports are not commands of it.
        if let Command::CopyDone { .. } = command {
            return;
        }
        let mut v = serde_json::to_value(command).expect("commands serialize");
        if let (Command::RegisterDeviceRegion { .. }, Value::Object(map)) = (command, &mut v) {
            map.remove("agent");
        }
        self.rewrite(&mut v);
        let creates = matches!(
            command,
            Command::OpenSession { .. }
                | Command::RegisterDeviceRegion { .. }
                | Command::DevicePageAlloc { .. }
                | Command::Query { .. }
                | Command::Load { .. }
        );
        let mut line = json!({ "t": now_us, "cmd": v });
        if creates {
            line["bind"] = Value::String(format!("$c{id}"));
        }
        self.write(line);
    }

    /// Writes a `close_session` line for every session `origin` has open.
    pub fn close_origin(&mut self, now_us: u64, origin: Origin) {
        let mut names: Vec<&String> = self
            .sessions
            .values()
            .filter(|(_, o)| *o == origin)
            .map(|(name, _)| name)
            .collect();
        names.sort();
        let lines: Vec<Value> = names
            .into_iter()
            .map(|name| {
                json!({ "t": now_us, "cmd": { "command": "close_session", "session": name } })
            })
            .collect();
        for line in lines {
            self.write(line);
        }
    }

    /// `now_us` is the clock when the tick started, before its commands.
    pub fn tick(&mut self, now_us: u64, events: &[Addressed]) {
        self.write(json!({ "t": now_us, "tick": {} }));
        for Addressed { to, event: e, .. } in events {
            match e {
                Event::SessionOpened { command, session } => {
                    self.sessions
                        .insert(session.id, (format!("$c{command}"), *to));
                }
                Event::SessionClosed { session, .. } => {
                    self.sessions.remove(&session.id);
                }
                Event::RegionRegistered {
                    command, region, ..
                } => {
                    self.names.insert(*region, format!("$c{command}"));
                }
                Event::DevicePageAllocated {
                    command,
                    device_page,
                } => {
                    self.names.insert(*device_page, format!("$c{command}"));
                }
                Event::QueryResult {
                    command, operation, ..
                } => {
                    self.names.insert(*operation, format!("$c{command}"));
                }
                _ => {}
            }
        }
    }

    pub fn flush(&mut self) {
        if self.error.is_none()
            && let Err(e) = self.out.flush()
        {
            self.error = Some(e);
        }
    }
}
