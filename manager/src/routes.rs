//! Which connection an event belongs to, rebuilt from the event stream.
//! Interim: it goes once the runtime addresses its events itself.
//!
//! A command's synchronous replies come in the tick that ingests it. The
//! runtime ingests at most `max_commands_per_tick` a tick, so a command's
//! route is kept until the runtime has taken it from its inbox (ids are
//! sequential: everything below `next_id - inbox_len` was taken).

use std::collections::{BTreeMap, HashMap};

use orbitkv_components::api::{CommandId, Event};

use crate::connection::ConnId;

#[derive(Default)]
pub struct Routes {
    commands: BTreeMap<CommandId, ConnId>,
    operations: HashMap<u64, ConnId>,
    device_pages: HashMap<u64, ConnId>,
    sessions: HashMap<u64, ConnId>,
    /// Publishes reply later (after their copies).
    publishes: HashMap<CommandId, ConnId>,
}

impl Routes {
    pub fn submitted(&mut self, cid: CommandId, conn: ConnId, publish: bool) {
        self.commands.insert(cid, conn);
        if publish {
            self.publishes.insert(cid, conn);
        }
    }

    pub fn owner(&self, e: &Event) -> Option<ConnId> {
        use Event::*;
        match e {
            Rejected { command, .. }
            | InstanceRegistered { command, .. }
            | SessionOpened { command, .. }
            | RegionRegistered { command, .. }
            | DevicePageAllocated { command, .. }
            | QueryResult { command, .. } => self.commands.get(command).copied(),
            PublishDone { command, .. } => self
                .publishes
                .get(command)
                .or(self.commands.get(command))
                .copied(),
            SessionClosed { session } => self.sessions.get(&session.id).copied(),
            DevicePageFreed { device_page, .. } => self.device_pages.get(device_page).copied(),
            Loading { operation }
            | Ready { operation, .. }
            | Miss { operation, .. }
            | RestoreDone { operation, .. }
            | Released { operation }
            | TransferOverdue { operation, .. } => self.operations.get(operation).copied(),
        }
    }

    /// Learns new handles from an event and forgets finished ones.
    pub fn learn(&mut self, e: &Event, owner: ConnId) {
        use Event::*;
        match e {
            SessionOpened { session, .. } => {
                self.sessions.insert(session.id, owner);
            }
            SessionClosed { session } => {
                self.sessions.remove(&session.id);
            }
            DevicePageAllocated { device_page, .. } => {
                self.device_pages.insert(*device_page, owner);
            }
            DevicePageFreed { device_page, .. } => {
                self.device_pages.remove(device_page);
            }
            QueryResult {
                operation,
                miss: None,
                ..
            } => {
                self.operations.insert(*operation, owner);
            }
            Miss { operation, .. } | RestoreDone { operation, .. } | Released { operation } => {
                self.operations.remove(operation);
            }
            PublishDone { command, .. } | Rejected { command, .. } => {
                self.publishes.remove(command);
            }
            _ => {}
        }
    }

    /// After a tick: commands below `ingested_below` were taken from the
    /// inbox, and their synchronous replies have come.
    pub fn ingested(&mut self, ingested_below: CommandId) {
        self.commands = self.commands.split_off(&ingested_below);
    }

    /// Drops every route to a closed connection.
    pub fn forget(&mut self, conn: ConnId) {
        self.commands.retain(|_, c| *c != conn);
        self.operations.retain(|_, c| *c != conn);
        self.device_pages.retain(|_, c| *c != conn);
        self.sessions.retain(|_, c| *c != conn);
        self.publishes.retain(|_, c| *c != conn);
    }
}
