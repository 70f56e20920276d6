//! A fake [`Driver`] for unit tests: records every call, keeps each
//! device's stream as a queue of operations, and runs them only when the
//! test says so. "Device memory" is host memory the test owns, so copies
//! really move bytes (when their turn comes) and tests check exact bytes.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::driver::{
    Allocation, CopyApi, Driver, DriverError, DriverInfo, EnqueueError, EventId, Ordinal, Pinned,
    Run,
};
use crate::Direction;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    Open(Ordinal),
    Close(Ordinal),
    Pin {
        device: Ordinal,
        base: u64,
        len: u64,
        read_only: bool,
    },
    Unpin(u64),
    CreateEvent(Ordinal),
    DestroyEvent(EventId),
    Enqueue {
        device: Ordinal,
        direction: Direction,
        runs: Vec<Run>,
        api: CopyApi,
    },
    Record(Ordinal, Direction, EventId),
    Synchronize(Ordinal),
    StreamWait {
        device: Ordinal,
        event: EventId,
        stream: u64,
    },
}

enum Op {
    Copy(Direction, Run),
    Record(EventId),
}

#[derive(Default)]
pub(crate) struct State {
    pub info: Option<DriverInfo>,
    pub calls: Vec<Call>,
    pub allocations: Vec<Allocation>,
    pub already_pinned: bool,
    streams: HashMap<(Ordinal, Direction), VecDeque<Op>>,
    /// Recorded and not yet reached by its stream.
    pending_events: Vec<EventId>,
    next_event: u64,
    /// The next enqueue queues this many runs, then fails with this code.
    pub fail_enqueue: Option<(usize, u32)>,
    pub fail_record: Option<u32>,
    pub fail_query: Option<u32>,
    pub fail_synchronize: Option<u32>,
    pub fail_create_event_after: Option<usize>,
}

fn err(call: &'static str, code: u32) -> DriverError {
    DriverError {
        call,
        code,
        name: format!("FAKE_{code}"),
    }
}

/// The test's side: shares the state with the driver the executor owns.
#[derive(Clone, Default)]
pub(crate) struct Fake(pub Arc<Mutex<State>>);

impl Fake {
    pub fn new(devices: i32, batch_api: bool) -> Self {
        let fake = Fake::default();
        fake.state().info = Some(DriverInfo {
            version: if batch_api { 12080 } else { 12040 },
            devices,
            batch_api,
        });
        fake
    }

    pub fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn driver(&self) -> FakeDriver {
        FakeDriver(self.clone())
    }

    /// Declares `buf` as a device allocation on `device`.
    pub fn allocation(&self, device: Ordinal, buf: &mut [u8]) -> u64 {
        let base = buf.as_mut_ptr() as u64;
        self.state().allocations.push(Allocation {
            base,
            len: buf.len() as u64,
            device,
            primary_context: true,
        });
        base
    }

    /// Runs up to `ops` operations of one of `device`'s streams; returns how
    /// many ran.
    pub fn step(&self, device: Ordinal, lane: Direction, ops: usize) -> usize {
        let mut s = self.state();
        let mut ran = 0;
        while ran < ops {
            let Some(op) = s
                .streams
                .get_mut(&(device, lane))
                .and_then(VecDeque::pop_front)
            else {
                break;
            };
            match op {
                Op::Copy(direction, run) => {
                    let (src, dst) = match direction {
                        Direction::HostToDevice => (run.host, run.device),
                        Direction::DeviceToHost => (run.device, run.host),
                    };
                    // SAFETY: the tests keep every pool and "device" buffer
                    // alive while copies on them are queued, and the
                    // executor validated the ranges.
                    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, run.len as usize) };
                }
                Op::Record(ev) => s.pending_events.retain(|&e| e != ev),
            }
            ran += 1;
        }
        ran
    }

    /// Runs everything queued on both of `device`'s streams.
    pub fn run_device(&self, device: Ordinal) {
        self.step(device, Direction::HostToDevice, usize::MAX);
        self.step(device, Direction::DeviceToHost, usize::MAX);
    }

    /// Runs everything queued on every stream.
    pub fn run_all(&self) {
        let lanes: Vec<(Ordinal, Direction)> = self.state().streams.keys().copied().collect();
        for (d, lane) in lanes {
            self.step(d, lane, usize::MAX);
        }
    }

    /// Operations queued on `device`'s streams.
    pub fn queued(&self, device: Ordinal) -> usize {
        let s = self.state();
        s.streams
            .iter()
            .filter(|((d, _), _)| *d == device)
            .map(|(_, q)| q.len())
            .sum()
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    pub fn count(&self, pred: impl Fn(&Call) -> bool) -> usize {
        self.state().calls.iter().filter(|c| pred(c)).count()
    }
}

pub(crate) struct FakeDriver(Fake);

impl Driver for FakeDriver {
    fn info(&self) -> DriverInfo {
        self.0.state().info.unwrap_or(DriverInfo {
            version: 0,
            devices: 0,
            batch_api: false,
        })
    }

    fn open_device(&mut self, device: Ordinal) -> Result<(), DriverError> {
        let mut s = self.0.state();
        s.calls.push(Call::Open(device));
        Ok(())
    }

    fn close_device(&mut self, device: Ordinal) {
        self.0.state().calls.push(Call::Close(device));
    }

    fn pin_host(
        &mut self,
        device: Ordinal,
        base: u64,
        len: u64,
        read_only: bool,
    ) -> Result<Pinned, DriverError> {
        let mut s = self.0.state();
        s.calls.push(Call::Pin {
            device,
            base,
            len,
            read_only,
        });
        Ok(if s.already_pinned {
            Pinned::AlreadyPinned
        } else {
            Pinned::ByUs
        })
    }

    fn unpin_host(&mut self, _device: Ordinal, base: u64) -> Result<(), DriverError> {
        self.0.state().calls.push(Call::Unpin(base));
        Ok(())
    }

    fn allocation(
        &mut self,
        _device: Ordinal,
        ptr: u64,
    ) -> Result<Option<Allocation>, DriverError> {
        Ok(self
            .0
            .state()
            .allocations
            .iter()
            .find(|a| ptr >= a.base && ptr < a.base + a.len)
            .copied())
    }

    fn create_event(&mut self, device: Ordinal) -> Result<EventId, DriverError> {
        let mut s = self.0.state();
        let created = s
            .calls
            .iter()
            .filter(|c| matches!(c, Call::CreateEvent(_)))
            .count();
        if s.fail_create_event_after.is_some_and(|n| created >= n) {
            return Err(err("cuEventCreate", 2));
        }
        s.calls.push(Call::CreateEvent(device));
        s.next_event += 1;
        Ok(EventId(s.next_event))
    }

    fn destroy_event(&mut self, _device: Ordinal, event: EventId) {
        self.0.state().calls.push(Call::DestroyEvent(event));
    }

    fn enqueue(
        &mut self,
        device: Ordinal,
        direction: Direction,
        runs: &[Run],
        api: CopyApi,
    ) -> Result<(), EnqueueError> {
        let mut s = self.0.state();
        s.calls.push(Call::Enqueue {
            device,
            direction,
            runs: runs.to_vec(),
            api,
        });
        let (take, fail) = match s.fail_enqueue.take() {
            Some((n, code)) => (n.min(runs.len()), Some(code)),
            None => (runs.len(), None),
        };
        let stream = s.streams.entry((device, direction)).or_default();
        for run in &runs[..take] {
            stream.push_back(Op::Copy(direction, *run));
        }
        match fail {
            Some(code) => Err(EnqueueError {
                enqueued: take,
                error: err("cuMemcpyAsync", code),
            }),
            None => Ok(()),
        }
    }

    fn record(
        &mut self,
        device: Ordinal,
        direction: Direction,
        event: EventId,
    ) -> Result<(), DriverError> {
        let mut s = self.0.state();
        if let Some(code) = s.fail_record.take() {
            return Err(err("cuEventRecord", code));
        }
        s.calls.push(Call::Record(device, direction, event));
        s.pending_events.push(event);
        s.streams
            .entry((device, direction))
            .or_default()
            .push_back(Op::Record(event));
        Ok(())
    }

    fn query(&mut self, _device: Ordinal, event: EventId) -> Result<bool, DriverError> {
        let mut s = self.0.state();
        if let Some(code) = s.fail_query.take() {
            return Err(err("cuEventQuery", code));
        }
        Ok(!s.pending_events.contains(&event))
    }

    fn synchronize(&mut self, device: Ordinal) -> Result<(), DriverError> {
        {
            let mut s = self.0.state();
            s.calls.push(Call::Synchronize(device));
            if let Some(code) = s.fail_synchronize.take() {
                return Err(err("cuStreamSynchronize", code));
            }
        }
        self.0.run_device(device);
        Ok(())
    }

    fn stream_wait(
        &mut self,
        device: Ordinal,
        event: EventId,
        stream: u64,
    ) -> Result<(), DriverError> {
        self.0.state().calls.push(Call::StreamWait {
            device,
            event,
            stream,
        });
        Ok(())
    }
}
