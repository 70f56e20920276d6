//! A manager connection as a `world::driver::Port`, so the tests and
//! examples that drive a real `orbitkv serve` use the one engine-side
//! driver (`orbitkv_world::driver::Driver`) instead of their own copies.
//! Included by `tests/support/mod.rs` and, by path, by the examples.

use std::time::Duration;

use orbitkv_components::api::{Command, CommandId, Event};
use orbitkv_ipc::{Client, ClientError};
use orbitkv_world::driver::{Driver, Port};

/// How long one driver step waits for an event to arrive.
pub const STEP: Duration = Duration::from_millis(10);

/// A borrowed connection: commands go out on it, its events come back.
pub struct ClientPort<'a> {
    pub client: &'a mut Client,
}

impl Port for ClientPort<'_> {
    type Error = ClientError;

    fn submit(&mut self, command: Command) -> Result<CommandId, ClientError> {
        self.client.submit(command)
    }

    /// Without `advance`, what already arrived; with it, waits up to
    /// [`STEP`] for the next event first (the manager's clock is its own).
    fn step(&mut self, advance: bool, events: &mut Vec<Event>) -> Result<(), ClientError> {
        if advance && let Some(e) = self.client.wait_event(STEP, |_| true)? {
            events.push(e);
        }
        events.extend(self.client.poll_events()?);
        Ok(())
    }
}

/// Runs `f` with a driver over `client` whose waits end after `timeout`;
/// the events it took and did not consume go back to the client, in order,
/// so code that waits on the client directly afterwards still sees them.
pub fn with_driver<R>(
    client: &mut Client,
    timeout: Duration,
    f: impl FnOnce(&mut Driver<ClientPort<'_>>) -> R,
) -> R {
    let mut d = Driver::new(ClientPort { client });
    d.max_steps = (timeout.as_millis() / STEP.as_millis()).max(1) as usize;
    let r = f(&mut d);
    let left = std::mem::take(&mut d.pending).into();
    d.port.client.requeue(left);
    r
}
