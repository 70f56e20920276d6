//! The executor's logic on the fake driver: coalescing, event bookkeeping,
//! bounds, validation, error mapping, fencing, the fallback decision.

use std::time::Duration;

use super::driver::{CopyApi, Run};
use super::exec::Executor;
use super::fake::{Call, Fake, FakeDriver};
use super::runs::{Resolved, coalesce, devices};
use super::{CudaConfig, TokenState, Unavailable};
use crate::{Completion, CompletionToken, CopyError, Direction, ExternalMemory, PageCopy};

use Direction::{DeviceToHost, HostToDevice};

/// Memory reached only through its raw pointer, so nothing the test holds
/// aliases what the fake's copies write.
struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    fn new(len: usize) -> Self {
        let ptr = Box::into_raw(vec![0u8; len].into_boxed_slice()).cast::<u8>();
        Self { ptr, len }
    }
    fn addr(&self) -> u64 {
        self.ptr as u64
    }
    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds; no copy runs while the test touches it (the
        // fake moves bytes only inside `step`/`run_all`/`synchronize`).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) }
    }
    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.len);
        let mut out = vec![0; len];
        // SAFETY: as for `write`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), len) }
        out
    }
    /// As the fake's "device memory": an allocation on `device`.
    fn declare(&self, fake: &Fake, device: i32) -> u64 {
        // SAFETY: a view for the fake to record base and length only.
        let slice = unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) };
        fake.allocation(device, slice)
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: from `Box::into_raw` of a slice of `len` bytes.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

const PAGE: u64 = 256;

fn config() -> CudaConfig {
    CudaConfig {
        max_in_flight_batches: 4,
        max_runs_per_call: 3,
        unregister_wait_ms: 200,
        ..CudaConfig::default()
    }
}

/// An executor over the fake, with a registered pool. Field order matters:
/// the executor drops (and synchronises) before the buffers are freed.
struct Rig {
    exec: Executor<FakeDriver>,
    fake: Fake,
    pool: Buf,
    device: Vec<Buf>,
}

fn rig_with(devices: i32, batch_api: bool, cfg: CudaConfig) -> Rig {
    let fake = Fake::new(devices, batch_api);
    let mut exec = Executor::open(fake.driver(), cfg).expect("fake opens");
    let pool = Buf::new(64 * PAGE as usize);
    exec.register_host_pool(pool.addr(), pool.len as u64)
        .unwrap();
    Rig {
        exec,
        fake,
        pool,
        device: Vec::new(),
    }
}

fn rig() -> Rig {
    rig_with(2, false, config())
}

impl Rig {
    /// Lends a "device" buffer of `pages` pages on `device` as a region.
    fn region(&mut self, device: i32, pages: u64) -> u32 {
        let buf = Buf::new((pages * PAGE) as usize);
        let ptr = buf.declare(&self.fake, device);
        self.device.push(buf);
        self.exec
            .attach(ExternalMemory::Cuda {
                device,
                ptr,
                len: pages * PAGE,
            })
            .unwrap()
    }

    fn poll(&mut self) -> Vec<Completion> {
        let mut out = Vec::new();
        self.exec.poll(&mut out);
        out
    }

    fn enqueues(&self) -> Vec<(i32, Vec<Run>, CopyApi)> {
        self.fake
            .calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Enqueue {
                    device, runs, api, ..
                } => Some((device, runs, api)),
                _ => None,
            })
            .collect()
    }
}

fn page(host_page: u64, region: u32, device_page: u64) -> PageCopy {
    PageCopy {
        host_offset: host_page * PAGE,
        region,
        device_offset: device_page * PAGE,
        len: PAGE,
        expect_checksum: None,
        sum: crate::SumOf::Destination,
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn ok(token: CompletionToken) -> Completion {
    Completion {
        token,
        result: Ok(()),
        checksums: Vec::new(),
    }
}

fn resolved(device: i32, host: u64, dev: u64, len: u64) -> Resolved {
    Resolved {
        device,
        run: Run {
            host,
            device: dev,
            len,
        },
    }
}

#[test]
fn adjacent_pages_merge_into_one_run_only_when_both_sides_are_contiguous() {
    let mut out = Vec::new();
    coalesce(
        [
            resolved(0, 0, 1000, 10),
            resolved(0, 10, 1010, 10), // contiguous both sides: merges
            resolved(0, 20, 1030, 10), // device gap: new run
            resolved(0, 40, 1040, 10), // host gap: new run
            resolved(0, 50, 1050, 0),  // empty: dropped
            resolved(1, 50, 1050, 10), // other device: new run
            resolved(1, 60, 1060, 10), // merges
            resolved(0, 70, 1070, 10), // back to device 0: new run
        ],
        &mut out,
    );
    assert_eq!(
        out,
        vec![
            resolved(0, 0, 1000, 20),
            resolved(0, 20, 1030, 10),
            resolved(0, 40, 1040, 10),
            resolved(1, 50, 1050, 20),
            resolved(0, 70, 1070, 10),
        ]
    );
    let mut devs = Vec::new();
    devices(&out, &mut devs);
    assert_eq!(devs, vec![0, 1]);
}

proptest::proptest! {
    /// Coalescing keeps the exact byte mapping, in order, and leaves no two
    /// neighbouring runs that could have merged.
    #[test]
    fn coalescing_preserves_every_byte_in_order(
        copies in proptest::collection::vec((0u64..2, 0u64..16, 0u64..16, 0u64..3), 0..40)
    ) {
        let input: Vec<Resolved> = copies
            .iter()
            .map(|&(dev, h, d, n)| resolved(dev as i32, h * PAGE, (1 << 20) + d * PAGE, n * PAGE))
            .collect();
        let mut out = Vec::new();
        coalesce(input.iter().copied(), &mut out);
        let units = |rs: &[Resolved]| -> Vec<(i32, u64, u64)> {
            rs.iter()
                .flat_map(|r| {
                    (0..r.run.len / PAGE)
                        .map(move |i| (r.device, r.run.host + i * PAGE, r.run.device + i * PAGE))
                })
                .collect()
        };
        proptest::prop_assert_eq!(units(&input), units(&out));
        for pair in out.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            proptest::prop_assert!(a.run.len > 0);
            proptest::prop_assert!(
                !(a.device == b.device
                    && a.run.host + a.run.len == b.run.host
                    && a.run.device + a.run.len == b.run.device),
                "mergeable neighbours {:?} {:?}", a, b
            );
        }
    }
}

#[test]
fn coalescing_never_merges_past_the_address_space() {
    let mut out = Vec::new();
    coalesce(
        [resolved(0, u64::MAX - 9, 0, 10), resolved(0, 0, 10, 10)],
        &mut out,
    );
    assert_eq!(out.len(), 2);
}

#[test]
fn round_trip_exact_bytes_only_after_events_complete() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let src = pattern(7, 4 * PAGE as usize);
    rig.pool.write(0, &src);
    // Pool pages 0..4 to device pages 4..8, contiguous: one run.
    let restore: Vec<PageCopy> = (0..4).map(|i| page(i, r, 4 + i)).collect();
    let t = rig.exec.submit(HostToDevice, &restore).unwrap();
    assert_eq!(rig.exec.in_flight(), 1);
    assert_eq!(rig.poll(), vec![]);
    assert_eq!(rig.exec.query(t), TokenState::Pending);
    assert_eq!(
        rig.device[0].read(4 * PAGE as usize, src.len()),
        vec![0; src.len()],
        "nothing lands before the stream runs"
    );
    rig.fake.run_all();
    assert_eq!(rig.exec.query(t), TokenState::Done(Ok(())));
    assert_eq!(rig.poll(), vec![ok(t)]);
    assert_eq!(rig.exec.query(t), TokenState::Unknown);
    assert_eq!(rig.exec.in_flight(), 0);
    assert_eq!(rig.device[0].read(4 * PAGE as usize, src.len()), src);

    // Back to other pool pages, scattered: device 4,5 → pool 20,21 (one
    // run), device 6 → pool 30, device 7 → pool 10.
    let publish = [
        page(20, r, 4),
        page(21, r, 5),
        page(30, r, 6),
        page(10, r, 7),
    ];
    let t = rig.exec.submit(DeviceToHost, &publish).unwrap();
    rig.fake.run_all();
    assert_eq!(rig.poll(), vec![ok(t)]);
    let p = PAGE as usize;
    assert_eq!(rig.pool.read(20 * p, 2 * p), src[..2 * p]);
    assert_eq!(rig.pool.read(30 * p, p), src[2 * p..3 * p]);
    assert_eq!(rig.pool.read(10 * p, p), src[3 * p..]);

    let runs: Vec<usize> = rig.enqueues().iter().map(|(_, r, _)| r.len()).collect();
    assert_eq!(runs, vec![1, 3]);
    let stats = rig.exec.stats();
    assert_eq!((stats.batches, stats.copies, stats.runs), (2, 8, 4));
    assert_eq!(stats.bytes_to_device, 4 * PAGE);
    assert_eq!(stats.bytes_to_host, 4 * PAGE);
}

#[test]
fn events_complete_in_stream_order_and_are_reused() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let created = rig.fake.count(|c| matches!(c, Call::CreateEvent(_)));
    assert_eq!(created, 4, "one event per possible in-flight batch");
    for round in 0..5u8 {
        let t1 = rig.exec.submit(HostToDevice, &[page(0, r, 0)]).unwrap();
        let t2 = rig.exec.submit(HostToDevice, &[page(1, r, 1)]).unwrap();
        // The first batch's copy and event only: t1 done, t2 not.
        assert_eq!(rig.fake.step(0, HostToDevice, 2), 2);
        assert_eq!(rig.poll(), vec![ok(t1)], "round {round}");
        assert_eq!(rig.exec.query(t2), TokenState::Pending);
        rig.fake.run_all();
        assert_eq!(rig.poll(), vec![ok(t2)]);
    }
    assert_eq!(
        rig.fake.count(|c| matches!(c, Call::CreateEvent(_))),
        created,
        "the copy path never creates events"
    );
}

#[test]
fn restores_do_not_wait_behind_publishes() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let publish = rig.exec.submit(DeviceToHost, &[page(8, r, 0)]).unwrap();
    let restore = rig.exec.submit(HostToDevice, &[page(0, r, 1)]).unwrap();
    rig.fake.step(0, HostToDevice, usize::MAX);
    assert_eq!(rig.poll(), vec![ok(restore)]);
    assert_eq!(rig.exec.query(publish), TokenState::Pending);
    rig.fake.step(0, DeviceToHost, usize::MAX);
    assert_eq!(rig.poll(), vec![ok(publish)]);
}

#[test]
fn in_flight_batches_are_bounded_until_polled() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let tokens: Vec<_> = (0..4)
        .map(|i| rig.exec.submit(HostToDevice, &[page(i, r, i)]).unwrap())
        .collect();
    assert_eq!(
        rig.exec.submit(HostToDevice, &[page(5, r, 5)]),
        Err(CopyError::QueueFull(4, 4))
    );
    rig.fake.run_all();
    // Finished but unreported batches still count.
    assert_eq!(
        rig.exec.submit(HostToDevice, &[page(5, r, 5)]),
        Err(CopyError::QueueFull(4, 4))
    );
    let done: Vec<_> = rig.poll().into_iter().map(|c| c.token).collect();
    assert_eq!(done, tokens);
    assert!(rig.exec.submit(HostToDevice, &[page(5, r, 5)]).is_ok());
}

#[test]
fn invalid_batches_are_typed_errors_and_queue_nothing() {
    let mut rig = rig();
    let r = rig.region(0, 4);
    let host_len = rig.pool.len as u64;
    let cases = [
        (vec![], CopyError::EmptyBatch),
        (vec![page(0, 9, 0)], CopyError::UnknownRegion(9)),
        (
            vec![page(0, r, 0), page(0, r, 4)],
            CopyError::OutOfBounds {
                what: "device region",
                offset: 4 * PAGE,
                len: PAGE,
                size: 4 * PAGE,
            },
        ),
        (
            vec![PageCopy {
                host_offset: host_len - 1,
                region: r,
                device_offset: 0,
                len: 2,
                expect_checksum: None,
                sum: crate::SumOf::Destination,
            }],
            CopyError::OutOfBounds {
                what: "host pool",
                offset: host_len - 1,
                len: 2,
                size: host_len,
            },
        ),
        (
            vec![PageCopy {
                host_offset: 0,
                region: r,
                device_offset: u64::MAX,
                len: 2,
                expect_checksum: None,
                sum: crate::SumOf::Destination,
            }],
            CopyError::OutOfBounds {
                what: "device region",
                offset: u64::MAX,
                len: 2,
                size: 4 * PAGE,
            },
        ),
    ];
    for (copies, want) in cases {
        assert_eq!(rig.exec.submit(HostToDevice, &copies), Err(want));
    }
    assert!(rig.enqueues().is_empty());
    assert_eq!(rig.exec.in_flight(), 0);

    let fake = Fake::new(1, false);
    let mut no_pool = Executor::open(fake.driver(), config()).unwrap();
    assert_eq!(
        no_pool.submit(HostToDevice, &[page(0, 0, 0)]),
        Err(CopyError::NoHostPool)
    );
}

#[test]
fn restores_verify_their_source_checksums_before_anything_is_queued() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let src = pattern(4, 4 * PAGE as usize);
    rig.pool.write(0, &src);
    let sum = |i: usize| crate::page_checksum(&src[i * PAGE as usize..(i + 1) * PAGE as usize]);
    let mut copies: Vec<PageCopy> = (0..4)
        .map(|i| PageCopy {
            expect_checksum: Some(sum(i as usize)),
            ..page(i, r, i)
        })
        .collect();
    let t = rig.exec.submit(HostToDevice, &copies).unwrap();
    rig.fake.run_all();
    assert_eq!(rig.poll(), vec![ok(t)]);
    // The pool page changed in memory after its checksum was taken.
    rig.pool.write(2 * PAGE as usize + 7, &[0x5a]);
    copies[2].device_offset = 6 * PAGE;
    let before = rig.enqueues().len();
    assert_eq!(
        rig.exec.submit(HostToDevice, &copies),
        Err(CopyError::Checksum {
            host_offset: 2 * PAGE
        })
    );
    assert_eq!(
        rig.enqueues().len(),
        before,
        "nothing of the batch was queued"
    );
    assert_eq!(rig.exec.in_flight(), 0);
}

#[test]
fn large_restores_verify_in_parallel_and_name_the_first_bad_page() {
    const BIG: u64 = 64 << 10;
    let fake = Fake::new(1, false);
    let mut exec = Executor::open(fake.driver(), config()).unwrap();
    let pool = Buf::new((128 * BIG) as usize);
    let data = pattern(8, pool.len);
    pool.write(0, &data);
    exec.register_host_pool(pool.addr(), pool.len as u64)
        .unwrap();
    let device = Buf::new((128 * BIG) as usize);
    let ptr = device.declare(&fake, 0);
    let region = exec
        .attach(ExternalMemory::Cuda {
            device: 0,
            ptr,
            len: 128 * BIG,
        })
        .unwrap();
    let copies: Vec<PageCopy> = (0..128u64)
        .map(|i| {
            let at = (i * BIG) as usize;
            PageCopy {
                host_offset: i * BIG,
                region,
                device_offset: (127 - i) * BIG,
                len: BIG,
                expect_checksum: Some(crate::page_checksum(&data[at..at + BIG as usize])),
                sum: crate::SumOf::Destination,
            }
        })
        .collect();
    pool.write((77 * BIG) as usize, &[0]);
    pool.write((90 * BIG) as usize, &[0]);
    assert_eq!(
        exec.submit(HostToDevice, &copies),
        Err(CopyError::Checksum {
            host_offset: 77 * BIG
        })
    );
    pool.write((77 * BIG) as usize, &data[(77 * BIG) as usize..][..1]);
    pool.write((90 * BIG) as usize, &data[(90 * BIG) as usize..][..1]);
    let t = exec.submit(HostToDevice, &copies).unwrap();
    fake.run_all();
    let mut out = Vec::new();
    exec.poll(&mut out);
    assert_eq!(out, vec![ok(t)]);
    assert_eq!(device.read(0, BIG as usize), data[(127 * BIG) as usize..]);
    drop(exec);
}

#[test]
fn regions_must_lie_inside_one_device_allocation_on_the_stated_device() {
    let mut rig = rig();
    let buf = Buf::new(4 * PAGE as usize);
    let base = buf.declare(&rig.fake, 1);
    let host = Buf::new(PAGE as usize);
    let rejected = |rig: &mut Rig, memory| {
        matches!(rig.exec.attach(memory), Err(CopyError::RegionRejected(..)))
    };
    let cuda = |device, ptr, len| ExternalMemory::Cuda { device, ptr, len };
    assert!(rejected(&mut rig, cuda(0, base, PAGE)), "wrong device");
    assert!(
        rejected(&mut rig, cuda(1, base + PAGE, 4 * PAGE)),
        "runs past the allocation"
    );
    assert!(
        rejected(&mut rig, cuda(1, host.addr(), PAGE)),
        "not device memory"
    );
    assert!(rejected(&mut rig, cuda(2, base, PAGE)), "no such device");
    assert!(rejected(&mut rig, cuda(-1, base, PAGE)), "negative ordinal");
    assert!(rejected(&mut rig, cuda(1, base, 0)), "empty");
    assert!(rejected(&mut rig, cuda(1, 0, PAGE)), "null");
    assert!(rejected(&mut rig, cuda(1, u64::MAX - 1, PAGE)), "wraps");
    let foreign = Buf::new(PAGE as usize);
    let foreign_ptr = foreign.declare(&rig.fake, 1);
    rig.fake
        .state()
        .allocations
        .last_mut()
        .unwrap()
        .primary_context = false;
    assert!(
        rejected(&mut rig, cuda(1, foreign_ptr, PAGE)),
        "another context's memory"
    );
    assert!(rejected(
        &mut rig,
        ExternalMemory::Host {
            base: host.ptr,
            len: PAGE
        }
    ));
    // A sub-range of the allocation is fine, and opens device 1.
    let id = rig.exec.attach(cuda(1, base + PAGE, 3 * PAGE)).unwrap();
    assert!(rig.fake.calls().contains(&Call::Open(1)));
    let t = rig.exec.submit(HostToDevice, &[page(0, id, 2)]).unwrap();
    rig.fake.run_all();
    assert_eq!(rig.poll(), vec![ok(t)]);
    drop(rig);
    drop(buf);
}

#[test]
fn batch_api_is_used_when_the_driver_has_it_and_preferred() {
    for (driver_has, prefer, want) in [
        (true, true, CopyApi::Batch),
        (true, false, CopyApi::PerRun),
        (false, true, CopyApi::PerRun),
    ] {
        let cfg = CudaConfig {
            prefer_batch_api: prefer,
            ..config()
        };
        let mut rig = rig_with(1, driver_has, cfg);
        let r = rig.region(0, 8);
        let t = rig
            .exec
            .submit(HostToDevice, &[page(0, r, 0), page(5, r, 1)])
            .unwrap();
        assert_eq!(rig.exec.copy_api(), want);
        assert_eq!(rig.enqueues()[0].2, want);
        rig.fake.run_all();
        assert_eq!(rig.poll(), vec![ok(t)]);
        let calls = if want == CopyApi::Batch { 1 } else { 2 };
        assert_eq!(rig.exec.stats().driver_calls, calls);
    }
}

#[test]
fn a_batch_spanning_two_devices_completes_when_both_streams_did() {
    let mut rig = rig();
    let r0 = rig.region(0, 4);
    let r1 = rig.region(1, 4);
    let src = pattern(3, 2 * PAGE as usize);
    rig.pool.write(0, &src);
    let t = rig
        .exec
        .submit(HostToDevice, &[page(0, r0, 0), page(1, r1, 3)])
        .unwrap();
    rig.fake.run_device(0);
    assert_eq!(rig.exec.query(t), TokenState::Pending);
    rig.fake.run_device(1);
    assert_eq!(rig.poll(), vec![ok(t)]);
    assert_eq!(rig.device[0].read(0, PAGE as usize), src[..PAGE as usize]);
    assert_eq!(
        rig.device[1].read(3 * PAGE as usize, PAGE as usize),
        src[PAGE as usize..]
    );
}

#[test]
fn a_failed_enqueue_fails_its_batch_after_the_queued_part_drained() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    // CUDA_ERROR_INVALID_VALUE (1): not sticky.
    rig.fake.state().fail_enqueue = Some((1, 1));
    let t = rig
        .exec
        .submit(HostToDevice, &[page(0, r, 0), page(4, r, 4)])
        .unwrap();
    assert_eq!(
        rig.exec.query(t),
        TokenState::Pending,
        "one run is still queued"
    );
    rig.fake.run_all();
    let done = rig.poll();
    assert_eq!(done.len(), 1);
    assert!(matches!(&done[0].result, Err(CopyError::Failed(m)) if m.contains("FAKE_1")));
    assert_eq!(rig.exec.stats().failed_batches, 1);
    // The device is fine: the next batch works.
    let t = rig.exec.submit(HostToDevice, &[page(0, r, 0)]).unwrap();
    rig.fake.run_all();
    assert_eq!(rig.poll(), vec![ok(t)]);
}

#[test]
fn a_failed_event_record_waits_for_the_stream_then_fails_the_batch() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    rig.fake.state().fail_record = Some(1);
    let t = rig.exec.submit(HostToDevice, &[page(0, r, 0)]).unwrap();
    assert!(rig.fake.calls().contains(&Call::Synchronize(0)));
    assert_eq!(
        rig.fake.queued(0),
        0,
        "the stream was drained before reporting"
    );
    let done = rig.poll();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].token, t);
    assert!(done[0].result.is_err());
    assert_eq!(rig.exec.in_flight(), 0);
}

#[test]
fn a_fatal_error_loses_the_device_and_fails_everything_pending_on_it() {
    let mut rig = rig();
    let r0 = rig.region(0, 8);
    let r1 = rig.region(1, 8);
    let a = rig.exec.submit(HostToDevice, &[page(0, r0, 0)]).unwrap();
    let b = rig.exec.submit(HostToDevice, &[page(1, r0, 1)]).unwrap();
    let c = rig.exec.submit(HostToDevice, &[page(2, r1, 2)]).unwrap();
    // CUDA_ERROR_ILLEGAL_ADDRESS (700) from the first event query: sticky.
    rig.fake.state().fail_query = Some(700);
    rig.fake.run_device(1);
    let done = rig.poll();
    let failed: Vec<_> = done
        .iter()
        .filter(|d| d.result.is_err())
        .map(|d| d.token)
        .collect();
    assert_eq!(failed, vec![a, b]);
    assert!(done.contains(&ok(c)), "device 1 is unaffected: {done:?}");
    assert!(matches!(
        rig.exec.submit(HostToDevice, &[page(0, r0, 0)]),
        Err(CopyError::Failed(m)) if m.contains("lost")
    ));
    assert_eq!(rig.exec.stats().devices_lost, 1);
    // Unregistering a lost device's region does not wait.
    assert_eq!(rig.exec.unregister(r0), Ok(()));
    let t = rig.exec.submit(HostToDevice, &[page(3, r1, 3)]).unwrap();
    rig.fake.run_all();
    assert_eq!(rig.poll(), vec![ok(t)]);
}

#[test]
fn a_device_lost_while_queueing_a_two_device_batch_still_queues_the_other_part() {
    let mut rig = rig();
    let r0 = rig.region(0, 4);
    let r1 = rig.region(1, 4);
    rig.fake.state().fail_enqueue = Some((0, 700));
    let t = rig
        .exec
        .submit(HostToDevice, &[page(0, r0, 0), page(1, r1, 1)])
        .unwrap();
    assert_eq!(rig.enqueues().len(), 2, "device 1's part is queued too");
    assert_eq!(
        rig.exec.query(t),
        TokenState::Pending,
        "device 1 still copies"
    );
    rig.fake.run_device(1);
    let done = rig.poll();
    assert_eq!(done.len(), 1);
    assert!(done[0].result.is_err());
    assert_eq!(rig.exec.in_flight(), 0);
}

#[test]
fn a_fatal_enqueue_error_loses_the_device() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let queued = rig.exec.submit(HostToDevice, &[page(0, r, 0)]).unwrap();
    rig.fake.state().fail_enqueue = Some((0, 719));
    let t = rig.exec.submit(HostToDevice, &[page(1, r, 1)]).unwrap();
    let done = rig.poll();
    let tokens: Vec<_> = done.iter().map(|d| d.token).collect();
    assert_eq!(tokens, vec![queued, t]);
    assert!(done.iter().all(|d| d.result.is_err()));
}

#[test]
fn unregister_fences_new_copies_and_returns_once_in_flight_ones_landed() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let src = pattern(9, PAGE as usize);
    rig.pool.write(0, &src);
    let t = rig.exec.submit(HostToDevice, &[page(0, r, 2)]).unwrap();
    // The "GPU" finishes the copy a little later, on another thread.
    let fake = rig.fake.clone();
    let gpu = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        fake.run_all();
    });
    assert_eq!(rig.exec.unregister(r), Ok(()));
    gpu.join().unwrap();
    // When unregister returned, the copy had landed and nothing is queued.
    assert_eq!(rig.fake.queued(0), 0);
    assert_eq!(rig.device[0].read(2 * PAGE as usize, PAGE as usize), src);
    assert_eq!(
        rig.poll(),
        vec![ok(t)],
        "the in-flight batch completes normally"
    );
    assert_eq!(
        rig.exec.submit(HostToDevice, &[page(0, r, 0)]),
        Err(CopyError::UnknownRegion(r))
    );
    assert_eq!(rig.exec.unregister(r), Err(CopyError::UnknownRegion(r)));
}

#[test]
fn unregister_reports_copies_still_in_flight_and_keeps_the_fence() {
    let mut rig = rig_with(
        1,
        false,
        CudaConfig {
            unregister_wait_ms: 5,
            ..config()
        },
    );
    let r = rig.region(0, 8);
    let other = rig.region(0, 8);
    let t = rig.exec.submit(HostToDevice, &[page(0, r, 0)]).unwrap();
    assert!(matches!(rig.exec.unregister(r), Err(CopyError::Failed(m)) if m.contains("fenced")));
    assert_eq!(
        rig.exec.submit(HostToDevice, &[page(0, r, 0)]),
        Err(CopyError::UnknownRegion(r)),
        "fenced regions take no new copies"
    );
    assert!(rig.exec.submit(HostToDevice, &[page(1, other, 0)]).is_ok());
    rig.fake.run_all();
    assert_eq!(rig.exec.unregister(r), Ok(()));
    assert!(rig.poll().contains(&ok(t)));
}

#[test]
fn stream_wait_hands_the_batch_event_to_the_callers_stream() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let t = rig.exec.submit(HostToDevice, &[page(0, r, 0)]).unwrap();
    assert_eq!(rig.exec.stream_wait(t, 0xabc), Ok(()));
    let waits: Vec<_> = rig
        .fake
        .calls()
        .into_iter()
        .filter(|c| matches!(c, Call::StreamWait { .. }))
        .collect();
    let recorded = rig.fake.calls().into_iter().find_map(|c| match c {
        Call::Record(0, HostToDevice, e) => Some(e),
        _ => None,
    });
    assert_eq!(
        waits,
        vec![Call::StreamWait {
            device: 0,
            event: recorded.unwrap(),
            stream: 0xabc
        }]
    );
    // A failed batch refuses: the caller must not compute on its pages.
    rig.fake.state().fail_enqueue = Some((0, 1));
    let bad = rig.exec.submit(HostToDevice, &[page(1, r, 1)]).unwrap();
    assert!(rig.exec.stream_wait(bad, 0xabc).is_err());
    rig.fake.run_all();
    rig.poll();
    assert!(rig.exec.stream_wait(t, 0xabc).is_err(), "already reported");
}

#[test]
fn the_pool_is_pinned_portable_and_unpinned_after_the_streams_drain() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let src = pattern(5, PAGE as usize);
    rig.pool.write(0, &src);
    rig.exec.submit(HostToDevice, &[page(0, r, 1)]).unwrap();
    let Rig {
        exec,
        fake,
        pool,
        device,
    } = rig;
    // Dropped with a copy still queued: the drop waits for it.
    drop(exec);
    assert_eq!(fake.queued(0), 0);
    assert_eq!(device[0].read(PAGE as usize, PAGE as usize), src);
    let calls = fake.calls();
    let at = |call: &Call| calls.iter().position(|c| c == call).unwrap();
    let (sync, unpin, close) = (
        at(&Call::Synchronize(0)),
        at(&Call::Unpin(pool.addr())),
        at(&Call::Close(0)),
    );
    assert!(sync < unpin && unpin < close, "{calls:?}");
    assert!(calls.contains(&Call::Pin {
        device: 0,
        base: pool.addr(),
        len: pool.len as u64,
        read_only: false
    }));
}

#[test]
fn memory_pinned_by_someone_else_is_left_pinned() {
    let fake = Fake::new(1, false);
    fake.state().already_pinned = true;
    let pool = Buf::new(PAGE as usize);
    let mut exec = Executor::open(fake.driver(), config()).unwrap();
    exec.register_host_pool(pool.addr(), PAGE).unwrap();
    drop(exec);
    assert_eq!(fake.count(|c| matches!(c, Call::Unpin(_))), 0);
}

#[test]
fn a_read_only_pool_refuses_device_to_host_copies() {
    let mut rig = rig_with(
        1,
        false,
        CudaConfig {
            host_read_only: true,
            ..config()
        },
    );
    let r = rig.region(0, 8);
    assert!(rig.fake.calls().iter().any(|c| matches!(
        c,
        Call::Pin {
            read_only: true,
            ..
        }
    )));
    assert!(matches!(
        rig.exec.submit(DeviceToHost, &[page(0, r, 0)]),
        Err(CopyError::Failed(m)) if m.contains("read-only")
    ));
    assert!(rig.exec.submit(HostToDevice, &[page(0, r, 0)]).is_ok());
}

#[test]
fn the_pool_cannot_change_under_copies_in_flight() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    rig.exec.submit(HostToDevice, &[page(0, r, 0)]).unwrap();
    let other = Buf::new(PAGE as usize);
    assert!(rig.exec.register_host_pool(other.addr(), PAGE).is_err());
    assert!(rig.exec.register_host_pool(0, PAGE).is_err());
    rig.fake.run_all();
    rig.poll();
    rig.exec.register_host_pool(other.addr(), PAGE).unwrap();
    assert!(rig.fake.calls().contains(&Call::Unpin(rig.pool.addr())));
    drop(rig);
    drop(other);
}

#[test]
fn opening_needs_a_device_and_the_home_device() {
    let open = |devices, home| {
        let cfg = CudaConfig {
            home_device: home,
            ..config()
        };
        Executor::open(Fake::new(devices, false).driver(), cfg).err()
    };
    assert_eq!(open(0, 0), Some(Unavailable::NoDevice));
    assert_eq!(
        open(1, 1),
        Some(Unavailable::DeviceMissing {
            device: 1,
            count: 1
        })
    );
    assert_eq!(open(2, 1), None);
    let fake = Fake::new(1, false);
    fake.state().fail_create_event_after = Some(2);
    let err = Executor::open(fake.driver(), config()).err();
    assert!(matches!(err, Some(Unavailable::Init(_))));
    // The events made before the failure are destroyed, the device closed.
    assert_eq!(fake.count(|c| matches!(c, Call::DestroyEvent(_))), 2);
    assert!(fake.calls().contains(&Call::Close(0)));
}

#[test]
fn empty_copies_complete_without_touching_a_stream() {
    let mut rig = rig();
    let r = rig.region(0, 8);
    let t = rig
        .exec
        .submit(
            HostToDevice,
            &[PageCopy {
                host_offset: 0,
                region: r,
                device_offset: 0,
                len: 0,
                expect_checksum: None,
                sum: crate::SumOf::Destination,
            }],
        )
        .unwrap();
    assert_eq!(rig.poll(), vec![ok(t)]);
    assert!(rig.enqueues().is_empty());
}

#[test]
fn no_driver_and_no_device_fall_back_to_the_host_engine_with_the_reason() {
    let (engine, why) = super::choose::<super::CudaCopyEngine>(
        Err(Unavailable::NoDriver),
        crate::host::HostCopyConfig::default(),
    );
    assert_eq!(engine.name(), "host");
    assert_eq!(why, Some(Unavailable::NoDriver));
    assert_eq!(
        Unavailable::from_init(Unavailable::Init(super::DriverError {
            call: "cuInit",
            code: 100,
            name: "CUDA_ERROR_NO_DEVICE".into()
        })),
        Unavailable::NoDevice
    );
}

/// The CUDA engine's executor on the fake driver as a [`crate::CopyEngine`]:
/// what `CudaCopyEngine` is over the real driver, so a copy agent can run
/// on it.
struct FakeCuda(Executor<FakeDriver>);

impl crate::CopyEngine for FakeCuda {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn register_device_region(&mut self, bytes: u64) -> Result<crate::RegionId, CopyError> {
        Err(CopyError::RegionRejected(
            bytes,
            "engine-owned memory only".into(),
        ))
    }
    unsafe fn attach_region(
        &mut self,
        memory: ExternalMemory,
    ) -> Result<crate::RegionId, CopyError> {
        self.0.attach(memory)
    }
    fn unregister_device_region(&mut self, region: crate::RegionId) -> Result<(), CopyError> {
        self.0.unregister(region)
    }
    unsafe fn register_host_pool(&mut self, base: *mut u8, len: u64) -> Result<(), CopyError> {
        self.0.register_host_pool(base as u64, len)
    }
    unsafe fn register_host_window(
        &mut self,
        base: *mut u8,
        len: u64,
        spans: &[crate::HostSpan],
    ) -> Result<(), CopyError> {
        self.0.register_host_window(base as u64, len, spans)
    }
    fn submit(
        &mut self,
        direction: Direction,
        copies: &[PageCopy],
        _now_us: u64,
    ) -> Result<CompletionToken, CopyError> {
        self.0.submit(direction, copies)
    }
    fn poll(&mut self, _now_us: u64, out: &mut Vec<Completion>) {
        self.0.poll(out)
    }
    fn in_flight(&self) -> usize {
        self.0.in_flight()
    }
}

mod agent_on_cuda {
    //! A copy agent on the CUDA executor over the fake driver: the host
    //! window pinned span by span, chunked device regions, exact bytes
    //! through fake device memory, completion only once the streams ran.

    use super::*;
    use crate::agent::{AgentError, Chunk, CopyAgent, HostWindow, LayerCount, MemoryKind};
    use crate::host::shared_memory;
    use orbitkv_components::api::{AgentDirection, AgentPageCopy, Command, CopyFailure, Event};

    const P: u64 = 4096;
    const SLOTS: u32 = 4;
    const POOL: u64 = 8 * P;
    const STAGING: u64 = 4 * P;

    /// Fake device memory laid out like a KV cache: per slot, a 1 KiB K run
    /// every 2 KiB in `k` and a 3 KiB V run in `v`.
    struct Device {
        k: Buf,
        v: Buf,
    }

    impl Device {
        fn new(fake: &Fake) -> Self {
            let d = Device {
                k: Buf::new((2048 * SLOTS) as usize),
                v: Buf::new((3072 * SLOTS) as usize),
            };
            d.k.declare(fake, 0);
            d.v.declare(fake, 0);
            d
        }
        fn chunks(&self) -> Vec<Chunk> {
            vec![
                Chunk {
                    kind: MemoryKind::Cuda { device: 0 },
                    ptr: self.k.addr(),
                    stride: 2048,
                    len: 1024,
                },
                Chunk {
                    kind: MemoryKind::Cuda { device: 0 },
                    ptr: self.v.addr(),
                    stride: 3072,
                    len: 3072,
                },
            ]
        }
        fn page(&self, slot: usize) -> Vec<u8> {
            [
                self.k.read(slot * 2048, 1024),
                self.v.read(slot * 3072, 3072),
            ]
            .concat()
        }
    }

    fn page_copy(host_page: u64, slot: u64, checksum: Option<u64>) -> AgentPageCopy {
        AgentPageCopy {
            host_offset: host_page * P,
            region: 0,
            region_offset: slot * P,
            len: P,
            checksum,
        }
    }

    fn copy_event(copy: u64, direction: AgentDirection, pages: Vec<AgentPageCopy>) -> Event {
        Event::AgentCopy {
            copy,
            direction,
            pages,
        }
    }

    fn done(out: &[Command]) -> Vec<(u64, Option<CopyFailure>)> {
        out.iter()
            .map(|c| match c {
                Command::CopyDone { copy, failure, .. } => (*copy, failure.clone()),
                other => panic!("not a copy report: {other:?}"),
            })
            .collect()
    }

    /// A copy agent on the fake driver's executor with its window set: a
    /// pool filled with a pattern (`mul`) and an empty staging area, both
    /// shared memory named after `tag`. Returns the agent and both maps.
    fn agent_with_window(
        fake: &Fake,
        tag: &str,
        mul: usize,
    ) -> (CopyAgent, memmap2::MmapMut, memmap2::MmapMut) {
        let exec = Executor::open(fake.driver(), config()).unwrap();
        let (pool_file, mut pool) = shared_memory(&format!("{tag}-pool"), POOL).unwrap();
        for (i, b) in pool.iter_mut().enumerate() {
            *b = (i * mul + i / 4096) as u8;
        }
        let (staging_file, staging) = shared_memory(&format!("{tag}-staging"), STAGING).unwrap();
        let mut agent = CopyAgent::new(Box::new(FakeCuda(exec)));
        agent
            .set_window(HostWindow::map(&pool_file, POOL, &staging_file, STAGING).unwrap())
            .unwrap();
        (agent, pool, staging)
    }

    #[test]
    fn exact_bytes_pool_to_fake_device_to_staging_with_the_window_pinned_per_span() {
        let fake = Fake::new(1, true);
        let (mut agent, pool, staging) = agent_with_window(&fake, "agent-cuda", 13);
        let device = Device::new(&fake);
        assert_eq!(agent.engine(), "cuda");
        // The pool is pinned read-only, the staging area writable.
        let pins: Vec<(u64, bool)> = fake
            .calls()
            .iter()
            .filter_map(|c| match c {
                Call::Pin { len, read_only, .. } => Some((*len, *read_only)),
                _ => None,
            })
            .collect();
        assert_eq!(pins, vec![(POOL, true), (STAGING, false)]);

        // SAFETY: `device` outlives the agent (dropped after it below).
        let (region, page_bytes) = unsafe { agent.attach(SLOTS, &device.chunks()) }.unwrap();
        assert_eq!((region, page_bytes), (0, P));

        // Restore pool pages 5 and 2 into slots 1 and 3.
        let sum =
            |page: u64| crate::page_checksum(&pool[(page * P) as usize..((page + 1) * P) as usize]);
        let want5 = pool[(5 * P) as usize..(6 * P) as usize].to_vec();
        let want2 = pool[(2 * P) as usize..(3 * P) as usize].to_vec();
        let restore = vec![page_copy(5, 1, Some(sum(5))), page_copy(2, 3, Some(sum(2)))];
        assert!(agent.handle(&copy_event(7, AgentDirection::PoolToRegion, restore)));
        let mut out = Vec::new();
        agent.poll(&mut out);
        assert!(out.is_empty(), "reported before the stream ran: {out:?}");
        assert!(agent.busy());
        assert!(
            device.page(1) == vec![0; P as usize],
            "nothing lands before the stream runs"
        );
        fake.run_all();
        agent.poll(&mut out);
        assert_eq!(done(&out), vec![(7, None)]);
        assert!(device.page(1) == want5, "slot 1 holds pool page 5");
        assert!(device.page(3) == want2, "slot 3 holds pool page 2");
        assert!(
            device.page(0) == vec![0; P as usize],
            "untargeted slots untouched"
        );

        // Publish slot 3 into staging page 1.
        out.clear();
        let publish = vec![page_copy(1, 3, None)];
        assert!(agent.handle(&copy_event(8, AgentDirection::RegionToStaging, publish)));
        fake.run_all();
        agent.poll(&mut out);
        assert_eq!(done(&out), vec![(8, None)]);
        assert!(
            staging[P as usize..(2 * P) as usize] == want2[..],
            "the published page is in staging page 1"
        );

        // A pool page that does not match its checksum fails the copy.
        out.clear();
        let bad = vec![page_copy(4, 0, Some(sum(4) ^ 1))];
        assert!(agent.handle(&copy_event(9, AgentDirection::PoolToRegion, bad)));
        fake.run_all();
        agent.poll(&mut out);
        assert_eq!(done(&out), vec![(9, Some(CopyFailure::Checksum(4 * P)))]);

        // Detaching unregisters the region's device ranges: later copies
        // naming it fail, and nothing is written.
        assert!(agent.detach(region));
        out.clear();
        assert!(agent.handle(&copy_event(
            10,
            AgentDirection::PoolToRegion,
            vec![page_copy(0, 2, None)]
        )));
        fake.run_all();
        agent.poll(&mut out);
        assert_eq!(done(&out), vec![(10, Some(CopyFailure::UnknownRegion(0)))]);
        assert!(
            device.page(2) == vec![0; P as usize],
            "a detached region is never written"
        );

        // Dropping the agent waits for the streams, then unpins both spans.
        drop(agent);
        let calls = fake.calls();
        assert_eq!(
            calls.iter().filter(|c| matches!(c, Call::Unpin(_))).count(),
            2,
            "{calls:?}"
        );
        let last_sync = calls
            .iter()
            .rposition(|c| matches!(c, Call::Synchronize(_)))
            .unwrap();
        let first_unpin = calls
            .iter()
            .position(|c| matches!(c, Call::Unpin(_)))
            .unwrap();
        assert!(last_sync < first_unpin, "{calls:?}");
        drop(device);
    }

    #[test]
    fn layered_restores_land_and_count_layer_by_layer_and_one_failed_layer_fails_the_copy() {
        let fake = Fake::new(1, false);
        let (mut agent, pool, _staging) = agent_with_window(&fake, "agent-layers", 29);
        let device = Device::new(&fake);
        // K runs are layer 0, V runs layer 1.
        // SAFETY: `device` outlives the agent.
        let (region, _) =
            unsafe { agent.attach_layered(SLOTS, &device.chunks(), Some(&[0, 1])) }.unwrap();
        let zero = LayerCount::default();
        assert_eq!(agent.layer_counts(region), Some(&[zero, zero][..]));
        let k = |page: u64| pool[(page * P) as usize..(page * P + 1024) as usize].to_vec();
        let v = |page: u64| pool[(page * P + 1024) as usize..((page + 1) * P) as usize].to_vec();

        let restore = vec![page_copy(5, 1, None), page_copy(2, 3, None)];
        assert!(agent.handle(&copy_event(1, AgentDirection::PoolToRegion, restore)));
        let mut out = Vec::new();
        // Layer 0's part is queued first: its two K runs and its event.
        assert_eq!(fake.step(0, HostToDevice, 3), 3);
        agent.poll(&mut out);
        assert!(
            out.is_empty(),
            "the copy is reported once every layer landed: {out:?}"
        );
        let counts = agent.layer_counts(region).unwrap().to_vec();
        assert_eq!(
            counts,
            vec![
                LayerCount {
                    landed: 2,
                    failed: 0
                },
                zero
            ]
        );
        assert!(device.k.read(2048, 1024) == k(5) && device.k.read(3 * 2048, 1024) == k(2));
        assert!(
            device.v.read(3072, 3072) == vec![0; 3072],
            "layer 1 has not landed yet"
        );
        fake.run_all();
        agent.poll(&mut out);
        assert_eq!(done(&out), vec![(1, None)]);
        let counts = agent.layer_counts(region).unwrap().to_vec();
        assert_eq!(
            counts,
            vec![
                LayerCount {
                    landed: 2,
                    failed: 0
                };
                2
            ]
        );
        assert!(device.v.read(3072, 3072) == v(5) && device.v.read(3 * 3072, 3072) == v(2));

        // Layer 0's enqueue fails: layer 1 still lands, the copy fails.
        out.clear();
        fake.state().fail_enqueue = Some((0, 1));
        assert!(agent.handle(&copy_event(
            2,
            AgentDirection::PoolToRegion,
            vec![page_copy(4, 0, None)]
        )));
        fake.run_all();
        agent.poll(&mut out);
        let reported = done(&out);
        assert!(
            matches!(&reported[..], [(2, Some(CopyFailure::Executor(m)))] if m.contains("FAKE_1")),
            "{reported:?}"
        );
        let counts = agent.layer_counts(region).unwrap().to_vec();
        assert_eq!(
            counts,
            vec![
                LayerCount {
                    landed: 2,
                    failed: 1
                },
                LayerCount {
                    landed: 3,
                    failed: 0
                }
            ]
        );

        // Publishes are one batch and count nothing; a pool page that does
        // not match its checksum is refused before any layer is queued.
        out.clear();
        let sum = crate::page_checksum(&pool[(6 * P) as usize..(7 * P) as usize]);
        assert!(agent.handle(&copy_event(
            3,
            AgentDirection::PoolToRegion,
            vec![page_copy(6, 2, Some(sum ^ 1))]
        )));
        assert!(agent.handle(&copy_event(
            4,
            AgentDirection::RegionToStaging,
            vec![page_copy(0, 1, None)]
        )));
        fake.run_all();
        agent.poll(&mut out);
        assert_eq!(
            done(&out),
            vec![(3, Some(CopyFailure::Checksum(6 * P))), (4, None)]
        );
        assert!(
            device.k.read(2 * 2048, 1024) == vec![0; 1024],
            "a refused restore writes nothing"
        );
        assert_eq!(agent.layer_counts(region).unwrap().to_vec(), counts);

        // Bad layer lists are refused.
        // SAFETY: refused before anything is registered.
        let e = unsafe { agent.attach_layered(SLOTS, &device.chunks(), Some(&[0])) }.unwrap_err();
        assert!(matches!(e, AgentError::Layout(m) if m.contains("one layer per chunk")));
        assert_eq!(agent.layer_counts(region + 1), None);
        drop(agent);
        drop(device);
    }

    #[test]
    fn host_memory_and_memory_outside_its_allocation_are_refused_by_a_cuda_agent() {
        let fake = Fake::new(1, false);
        let exec = Executor::open(fake.driver(), config()).unwrap();
        let device = Device::new(&fake);
        let mut agent = CopyAgent::new(Box::new(FakeCuda(exec)));
        let mut host = vec![0u8; (P * SLOTS as u64) as usize];
        let host_chunk = Chunk {
            kind: MemoryKind::Host,
            ptr: host.as_mut_ptr() as u64,
            stride: P,
            len: P,
        };
        // SAFETY: refused before anything is registered.
        let e = unsafe { agent.attach(SLOTS, &[host_chunk]) }.unwrap_err();
        assert!(
            matches!(e, AgentError::Executor(CopyError::RegionRejected(..))),
            "{e:?}"
        );
        // A second chunk that runs past its allocation: refused, and the
        // first chunk, attached before it, is unregistered again.
        let mut chunks = device.chunks();
        chunks[0].stride = 1024;
        // SAFETY: refused; nothing is copied.
        let e = unsafe { agent.attach(SLOTS + 1, &chunks) }.unwrap_err();
        assert!(
            matches!(&e, AgentError::Executor(CopyError::RegionRejected(_, m)) if m.contains("not inside its allocation")),
            "{e:?}"
        );
        // SAFETY: `device` outlives the agent.
        let (region, _) = unsafe { agent.attach(SLOTS, &device.chunks()) }.unwrap();
        assert_eq!(region, 0, "the refused attaches left no region behind");
        drop(agent);
        drop(device);
    }
}
