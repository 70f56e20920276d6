//! The engine side, written once: what an engine (or a test, benchmark,
//! replay or example standing in for one) sends and waits for. A
//! [`Driver`] speaks through a [`Port`]: the embedded runtime
//! ([`Embedded`]), or anything else that takes commands and hands back
//! events (a manager connection).
//!
//! Every wait is bounded (`Driver::max_steps`), and a refusal is a typed
//! `DriverError::Rejected`, never a panic.

use std::collections::VecDeque;

use orbitkv_components::api::{
    Candidates, Command, CommandError, CommandId, Event, Origin, PagePos, PublishPage, Rank,
    RestoreTarget, SessionHandle,
};
use orbitkv_components::contract::GroupSpec;
use orbitkv_components::{Namespace, StorageLayout};

use orbitkv_components::api::AgentRegion;
use orbitkv_gpu::agent::{Chunk, CopyAgent, HostWindow};

use crate::runtime::{Runtime, SubmitError};

/// Where commands go and events come from.
pub trait Port {
    type Error: std::fmt::Debug;
    /// Queues one command; returns the id its reply carries.
    fn submit(&mut self, command: Command) -> std::result::Result<CommandId, Self::Error>;
    /// Lets the runtime work once (a tick; or a wait for a connection's
    /// events) and appends this engine's events. With `advance`, time
    /// moves first (a simulated clock by its step; a wall clock yields):
    /// a driver advances while it waits, not when it only collects the
    /// replies of what it just submitted.
    fn step(
        &mut self,
        advance: bool,
        events: &mut Vec<Event>,
    ) -> std::result::Result<(), Self::Error>;
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError<E: std::fmt::Debug> {
    #[error("port: {0:?}")]
    Port(E),
    #[error("command {command} was refused: {error}")]
    Rejected {
        command: CommandId,
        error: CommandError,
    },
    #[error("no {what} after {steps} steps")]
    Timeout { what: &'static str, steps: usize },
    #[error("{what}: unexpected reply {event:?}")]
    Unexpected {
        what: &'static str,
        event: Box<Event>,
    },
}

pub type Driven<T, E> = std::result::Result<T, DriverError<E>>;

/// A registered device region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub region: u64,
    /// The copy engine's id for it (the simulated arena's, in tests).
    pub engine_region: u32,
    pub page_bytes: u64,
}

/// How a publish ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub command: CommandId,
    pub inserted: u64,
    pub duplicates: u64,
    pub dropped: u64,
}

/// A query's reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryReply {
    pub command: CommandId,
    pub operation: u64,
    pub candidates: Vec<Candidates>,
    pub common: Vec<u64>,
    pub selected: Option<u64>,
    pub miss: Option<orbitkv_components::api::MissReason>,
}

/// A dense model: full attention only.
pub fn dense() -> Vec<GroupSpec> {
    vec![GroupSpec::attention(0)]
}

/// A hybrid model: full attention, a sliding window of 100 past tokens and
/// a recurrent checkpoint.
pub fn hybrid() -> Vec<GroupSpec> {
    vec![
        GroupSpec::attention(0),
        GroupSpec::sliding_window(1, 100),
        GroupSpec::recurrent(2),
    ]
}

/// The register command of a test engine: `ranks` tensor ranks, one layer
/// per group per rank, `page_bytes` per page (`StorageLayout::uniform`).
pub fn register_command(
    instance: &str,
    identity: [u8; 32],
    groups: Vec<GroupSpec>,
    ranks: u32,
    page_tokens: u64,
    page_bytes: u64,
) -> Command {
    let ranks: Vec<Rank> = (0..ranks).map(|tp| Rank { tp, pp: 0 }).collect();
    Command::RegisterInstance {
        instance: instance.into(),
        identity,
        layout: StorageLayout::uniform(&ranks, &groups, page_tokens, page_bytes),
        page_tokens,
        groups,
        ranks,
    }
}

/// A restore target: page `page_end` of (rank, group) into `device_page`.
pub fn target(rank: u32, group: u32, page_end: u64, device_page: u64) -> RestoreTarget {
    RestoreTarget {
        pos: PagePos {
            rank,
            group,
            page_end,
        },
        device_page,
    }
}

pub struct Driver<P: Port> {
    pub port: P,
    /// Events that arrived and were not consumed by a wait yet, in order.
    /// A deque: waits take from the front, and taking from a `Vec` moved
    /// every later event (quadratic over a 1024-page publish or restore,
    /// which the throughput benchmark charged to the runtime).
    pub pending: VecDeque<Event>,
    /// Where a step's events land before they join `pending`.
    fresh: Vec<Event>,
    /// The most steps one wait takes before `Timeout`.
    pub max_steps: usize,
}

impl<P: Port> Driver<P> {
    pub fn new(port: P) -> Self {
        Driver {
            port,
            pending: VecDeque::new(),
            fresh: Vec::new(),
            max_steps: 100_000,
        }
    }

    pub fn submit(&mut self, command: Command) -> Driven<CommandId, P::Error> {
        self.port.submit(command).map_err(DriverError::Port)
    }

    /// Runs one tick without moving time; returns its events (also kept
    /// pending).
    pub fn tick(&mut self) -> Driven<&[Event], P::Error> {
        self.step(false)
    }

    /// Moves time one step and ticks; returns the events (also kept
    /// pending).
    pub fn advance(&mut self) -> Driven<&[Event], P::Error> {
        self.step(true)
    }

    fn step(&mut self, advance: bool) -> Driven<&[Event], P::Error> {
        let start = self.pending.len();
        let stepped = self.port.step(advance, &mut self.fresh);
        self.pending.extend(self.fresh.drain(..));
        stepped.map_err(DriverError::Port)?;
        Ok(&self.pending.make_contiguous()[start..])
    }

    /// Removes and returns the first pending event matching `pred`,
    /// advancing until one arrives.
    pub fn wait(
        &mut self,
        what: &'static str,
        pred: impl Fn(&Event) -> bool,
    ) -> Driven<Event, P::Error> {
        for _ in 0..=self.max_steps {
            if let Some(e) = self
                .pending
                .iter()
                .position(&pred)
                .and_then(|i| self.pending.remove(i))
            {
                return Ok(e);
            }
            self.advance()?;
        }
        Err(DriverError::Timeout {
            what,
            steps: self.max_steps,
        })
    }

    /// The reply to command `id`; a refusal is `Rejected`.
    pub fn reply(&mut self, what: &'static str, id: CommandId) -> Driven<Event, P::Error> {
        match self.wait(what, |e| e.command() == Some(id))? {
            Event::Rejected { command, error } => Err(DriverError::Rejected { command, error }),
            event => Ok(event),
        }
    }

    /// Submits, ticks once, and returns the reply.
    pub fn call(&mut self, what: &'static str, command: Command) -> Driven<Event, P::Error> {
        let id = self.submit(command)?;
        self.tick()?;
        self.reply(what, id)
    }

    pub fn register(&mut self, command: Command) -> Driven<Vec<Namespace>, P::Error> {
        match self.call("register", command)? {
            Event::InstanceRegistered { namespaces, .. } => Ok(namespaces),
            event => unexpected("register", event),
        }
    }

    pub fn open(&mut self, instance: &str) -> Driven<SessionHandle, P::Error> {
        let open = Command::OpenSession {
            instance: instance.into(),
        };
        match self.call("open", open)? {
            Event::SessionOpened { session, .. } => Ok(session),
            event => unexpected("open", event),
        }
    }

    pub fn region(
        &mut self,
        session: SessionHandle,
        (rank, group): (u32, u32),
        slots: u32,
    ) -> Driven<Region, P::Error> {
        let command = Command::RegisterDeviceRegion {
            session,
            rank,
            group,
            slots,
            agent: None,
        };
        match self.call("region", command)? {
            Event::RegionRegistered {
                region,
                engine_region,
                page_bytes,
                ..
            } => Ok(Region {
                region,
                engine_region,
                page_bytes,
            }),
            event => unexpected("region", event),
        }
    }

    pub fn alloc(
        &mut self,
        session: SessionHandle,
        region: u64,
        slot: u32,
    ) -> Driven<u64, P::Error> {
        Ok(self.alloc_many(session, region, [slot])?[0])
    }

    /// Allocates device pages for `slots` of `region`, submitted together.
    pub fn alloc_many(
        &mut self,
        session: SessionHandle,
        region: u64,
        slots: impl IntoIterator<Item = u32>,
    ) -> Driven<Vec<u64>, P::Error> {
        let mut ids = Vec::new();
        for slot in slots {
            let alloc = Command::DevicePageAlloc {
                session,
                region,
                slot,
            };
            ids.push(self.submit(alloc)?);
        }
        self.tick()?;
        ids.into_iter()
            .map(|id| match self.reply("alloc", id)? {
                Event::DevicePageAllocated { device_page, .. } => Ok(device_page),
                event => unexpected("alloc", event),
            })
            .collect()
    }

    /// Publishes and waits for its `PublishDone`.
    pub fn publish(
        &mut self,
        session: SessionHandle,
        request: u64,
        pages: Vec<PublishPage>,
    ) -> Driven<Published, P::Error> {
        let publish = Command::Publish {
            session,
            request,
            pages,
        };
        match self.call("publish", publish)? {
            Event::PublishDone {
                command,
                inserted,
                duplicates,
                dropped,
                ..
            } => Ok(Published {
                command,
                inserted,
                duplicates,
                dropped,
            }),
            event => unexpected("publish", event),
        }
    }

    /// Sends a query and returns its reply.
    pub fn query(&mut self, query: Command) -> Driven<QueryReply, P::Error> {
        match self.call("query", query)? {
            Event::QueryResult {
                command,
                operation,
                candidates,
                common,
                selected,
                miss,
                ..
            } => Ok(QueryReply {
                command,
                operation,
                candidates,
                common,
                selected,
                miss,
            }),
            event => unexpected("query", event),
        }
    }

    /// Waits for the operation's `Ready` or `Miss`.
    pub fn ready(&mut self, operation: u64) -> Driven<Event, P::Error> {
        self.wait("ready", |e| {
            matches!(e, Event::Ready { operation: o, .. } | Event::Miss { operation: o, .. }
                if *o == operation)
        })
    }

    /// Restores and waits for the operation's `RestoreDone` or `Miss`.
    pub fn restore(
        &mut self,
        session: SessionHandle,
        operation: u64,
        targets: Vec<RestoreTarget>,
        retained: Vec<PagePos>,
    ) -> Driven<Event, P::Error> {
        let restore = Command::Restore {
            session,
            operation,
            targets,
            retained,
        };
        let id = self.submit(restore)?;
        self.tick()?;
        self.wait("restore", |e| match e {
            Event::RestoreDone { operation: o, .. } | Event::Miss { operation: o, .. } => {
                *o == operation
            }
            Event::Rejected { command, .. } => *command == id,
            _ => false,
        })
        .and_then(|e| match e {
            Event::Rejected { command, error } => Err(DriverError::Rejected { command, error }),
            e => Ok(e),
        })
    }
}

fn unexpected<T, E: std::fmt::Debug>(what: &'static str, event: Event) -> Driven<T, E> {
    Err(DriverError::Unexpected {
        what,
        event: Box::new(event),
    })
}

/// The longest a wall-clock step sleeps for the runtime's own copies.
const WAIT_FOR_COPIES: std::time::Duration = std::time::Duration::from_micros(200);

/// The embedded runtime as a port, for one origin. With a simulated clock,
/// each step first moves time by `advance_us` (`AdvanceClock`); with a wall
/// clock it yields the thread.
///
/// With an `agent`, the origin's copy agent runs in-process: each step
/// hands it the origin's `AgentCopy` events (they are the agent's, not the
/// driver's) and submits its `CopyDone` reports, exactly as a bridge agent
/// does over a manager connection.
pub struct Embedded {
    pub rt: Runtime,
    pub origin: Origin,
    /// Simulated time per step; `None` on a wall clock.
    pub advance_us: Option<u64>,
    /// Ticks run through this port.
    pub ticks: u64,
    pub agent: Option<CopyAgent>,
}

impl Embedded {
    pub fn new(rt: Runtime, origin: Origin, advance_us: Option<u64>) -> Self {
        Embedded {
            rt,
            origin,
            advance_us,
            ticks: 0,
            agent: None,
        }
    }

    /// Submits what the agent finished.
    fn report(&mut self) -> std::result::Result<(), SubmitError> {
        let Some(agent) = &mut self.agent else {
            return Ok(());
        };
        let mut done = Vec::new();
        agent.poll(&mut done);
        for command in done {
            self.rt.submit(self.origin, command)?;
        }
        Ok(())
    }
}

impl Port for Embedded {
    type Error = SubmitError;

    fn submit(&mut self, command: Command) -> std::result::Result<CommandId, SubmitError> {
        self.rt.submit(self.origin, command)
    }

    fn step(
        &mut self,
        advance: bool,
        events: &mut Vec<Event>,
    ) -> std::result::Result<(), SubmitError> {
        match self.advance_us {
            Some(us) if advance && us > 0 => {
                self.rt.submit(self.origin, Command::AdvanceClock { us })?;
            }
            // Copies run on other threads: sleep until one lands when they
            // are all there is to wait for, else let them run.
            None if advance && !self.rt.wait_io(WAIT_FOR_COPIES) => std::thread::yield_now(),
            _ => {}
        }
        self.report()?;
        let origin = self.origin;
        self.ticks += 1;
        for a in self.rt.tick() {
            if a.to != origin {
                continue;
            }
            let taken = self
                .agent
                .as_mut()
                .is_some_and(|agent| agent.handle(&a.event));
            if !taken {
                events.push(a.event);
            }
        }
        Ok(())
    }
}

/// Why an agent-owned region could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AgentSetupError<E: std::fmt::Debug> {
    #[error("the port has no copy agent")]
    NoAgent,
    #[error(transparent)]
    Agent(#[from] orbitkv_gpu::agent::AgentError),
    #[error("the runtime exports no {0} (an agent needs `dram.shared`)")]
    NoExport(&'static str),
    #[error(transparent)]
    Driver(DriverError<E>),
}

impl Driver<Embedded> {
    /// Registers engine memory laid out as `chunks` per page over `slots`
    /// slots as an agent-owned region of (rank, group): attached to the
    /// port's agent first, then registered with the runtime (the agent's
    /// host window is mapped once the origin has a staging area).
    ///
    /// # Safety
    /// As [`CopyAgent::attach`]: the memory outlives the region and every
    /// copy against it.
    pub unsafe fn agent_region(
        &mut self,
        session: SessionHandle,
        (rank, group): (u32, u32),
        slots: u32,
        chunks: &[Chunk],
    ) -> std::result::Result<Region, AgentSetupError<SubmitError>> {
        let agent = self.port.agent.as_mut().ok_or(AgentSetupError::NoAgent)?;
        // SAFETY: forwarded from this function's contract.
        let (id, page_bytes) = unsafe { agent.attach(slots, chunks)? };
        let command = Command::RegisterDeviceRegion {
            session,
            rank,
            group,
            slots,
            agent: Some(AgentRegion {
                region: id,
                page_bytes,
            }),
        };
        let region = match self.call("agent region", command) {
            Ok(Event::RegionRegistered {
                region,
                engine_region,
                page_bytes,
                ..
            }) => Region {
                region,
                engine_region,
                page_bytes,
            },
            Ok(event) => Err(AgentSetupError::Driver(DriverError::Unexpected {
                what: "agent region",
                event: Box::new(event),
            }))?,
            Err(e) => {
                if let Some(agent) = &mut self.port.agent {
                    agent.detach(id);
                }
                return Err(AgentSetupError::Driver(e));
            }
        };
        self.map_agent_window()?;
        Ok(region)
    }

    /// Maps the agent's host window (the pool read-only, the origin's
    /// staging area writable) if it has none yet.
    pub fn map_agent_window(&mut self) -> std::result::Result<(), AgentSetupError<SubmitError>> {
        let port = &mut self.port;
        let agent = port.agent.as_mut().ok_or(AgentSetupError::NoAgent)?;
        if agent.has_window() {
            return Ok(());
        }
        let pool = port
            .rt
            .export_pool()
            .ok_or(AgentSetupError::NoExport("pool"))?;
        let staging = port
            .rt
            .export_staging(port.origin)
            .ok_or(AgentSetupError::NoExport("staging area"))?;
        let staging_len = port
            .rt
            .staging_capacity(port.origin)
            .ok_or(AgentSetupError::NoExport("staging area"))?;
        let window = HostWindow::map(pool, port.rt.pool_capacity(), staging, staging_len)?;
        agent.set_window(window)?;
        Ok(())
    }
}
