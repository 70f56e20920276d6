//! A manager connection as a `world::driver::Port`, so the tests and
//! examples that drive a real `orbitkv serve` use the one engine-side
//! driver (`orbitkv_world::driver::Driver`) instead of their own copies.
//! Included by `tests/support/mod.rs` and, by path, by the examples.

use std::time::Duration;

use orbitkv_components::api::{Command, CommandId, Event};
use orbitkv_ipc::{Client, ClientError, Delivered};
use orbitkv_world::driver::{Driver, Port};

/// How long one driver step waits for an event to arrive.
pub const STEP: Duration = Duration::from_millis(10);

/// A borrowed connection: commands go out on it, its events come back.
pub struct ClientPort<'a> {
    pub client: &'a mut Client,
    /// What the driver was handed, flags included: the events it leaves
    /// go back to the client with the runtime's `terminal` flag.
    taken: Vec<Delivered>,
}

impl Port for ClientPort<'_> {
    type Error = ClientError;

    fn submit(&mut self, command: Command) -> Result<CommandId, ClientError> {
        self.client.submit(command)
    }

    /// Without `advance`, what already arrived; with it, waits up to
    /// [`STEP`] for the next event first (the manager's clock is its own).
    fn step(&mut self, advance: bool, events: &mut Vec<Event>) -> Result<(), ClientError> {
        if advance && let Some(d) = self.client.wait_delivered(STEP, |_| true)? {
            events.push(d.event.clone());
            self.taken.push(d);
        }
        for d in self.client.poll_delivered()? {
            events.push(d.event.clone());
            self.taken.push(d);
        }
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
    let mut d = Driver::new(ClientPort {
        client,
        taken: Vec::new(),
    });
    d.max_steps = (timeout.as_millis() / STEP.as_millis()).max(1) as usize;
    let r = f(&mut d);
    let mut taken = std::mem::take(&mut d.port.taken);
    let left = std::mem::take(&mut d.pending)
        .into_iter()
        .map(|event| match taken.iter().position(|t| t.event == event) {
            Some(i) => taken.remove(i),
            None => Delivered {
                event,
                terminal: false,
            },
        })
        .collect();
    d.port.client.requeue(left);
    r
}
