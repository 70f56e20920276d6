//! Helpers shared by the tests that drive a real `orbitkv serve`, on the
//! engine-side driver (`orbitkv_world::driver`) through [`ClientPort`].
#![allow(dead_code)]

use std::time::Duration;

use orbitkv_components::NativeHash;
use orbitkv_components::api::{Command, Event, PagePos, PublishPage, RestoreTarget, SessionHandle};
use orbitkv_ipc::Client;
use orbitkv_world::driver;

mod manager;
mod port;
#[allow(unused_imports)]
pub use manager::{BASE_CONFIG, Manager, remote_config};
#[allow(unused_imports)]
pub use port::{ClientPort, with_driver};

pub const PAGE: u64 = 16;
pub const BYTES: u64 = 4096;
pub const T: Duration = Duration::from_secs(10);

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn register(c: &mut Client) {
    register_as(c, "llama", [9; 32]);
}

/// Registers `instance` under `identity`: the layout of `register_command`.
pub fn register_as(c: &mut Client, instance: &str, identity: [u8; 32]) {
    let command = driver::register_command(instance, identity, driver::dense(), 1, PAGE, BYTES);
    with_driver(c, T, |d| d.register(command)).unwrap();
}

/// Registers instance "llama": one rank, one prefix group of `BYTES` pages
/// (`world::driver::register_command`, the test engines' layout).
pub fn register_command() -> Command {
    driver::register_command("llama", [9; 32], driver::dense(), 1, PAGE, BYTES)
}

pub fn alloc(c: &mut Client, s: SessionHandle, region: u64, slot: u32) -> u64 {
    with_driver(c, T, |d| d.alloc(s, region, slot)).unwrap()
}

pub fn open(c: &mut Client) -> (SessionHandle, u64) {
    open_as(c, "llama")
}

/// Opens a session of `instance` and registers a 64-slot region of its
/// rank 0, group 0, whose shared memory comes with the reply.
pub fn open_as(c: &mut Client, instance: &str) -> (SessionHandle, u64) {
    let (s, region) = with_driver(c, T, |d| {
        let s = d.open(instance)?;
        Ok::<_, driver::DriverError<_>>((s, d.region(s, (0, 0), 64)?.region))
    })
    .unwrap();
    assert!(
        c.region_mut(region).is_some(),
        "the region's shared memory came with the reply"
    );
    (s, region)
}

/// Registers, opens a session with a region, writes `payload(i)` into the
/// first four device pages and publishes them under `hashes[0..4]`.
pub fn publish_four(a: &mut Client, hashes: &[NativeHash], payload: impl Fn(u64) -> Vec<u8>) {
    register(a);
    let (sa, ra) = open(a);
    let dps = with_driver(a, T, |d| d.alloc_many(sa, ra, 0..4)).unwrap();
    let mut pages = Vec::new();
    for (i, dp) in dps.into_iter().enumerate() {
        a.region_mut(ra).unwrap()[i * BYTES as usize..(i + 1) * BYTES as usize]
            .copy_from_slice(&payload(i as u64));
        pages.push(PublishPage {
            rank: 0,
            group: 0,
            hash: hashes[i],
            device_page: dp,
        });
    }
    let done = with_driver(a, T, |d| d.publish(sa, 1, pages)).unwrap();
    assert_eq!(done.inserted, 4, "{done:?}");
}

/// Restores the four pages of a ready `operation` (positions `PAGE` to
/// `4 * PAGE`) into device pages allocated at slots
/// `first_slot..first_slot + 4` of `region`; see [`restore_four_into`].
pub fn restore_four(
    c: &mut Client,
    s: SessionHandle,
    region: u64,
    operation: u64,
    first_slot: u32,
    payload: impl Fn(u64) -> Vec<u8>,
) -> Event {
    let device_pages: Vec<u64> = (0..4)
        .map(|i| alloc(c, s, region, first_slot + i))
        .collect();
    restore_four_into(c, s, region, operation, &device_pages, first_slot, payload)
}

/// Restores page `i` of a ready `operation` (position `(i + 1) * PAGE`)
/// into `device_pages[i]`, the device page at slot `first_slot + i` of
/// `region`, waits for this operation's `restore_done`, and checks that
/// each slot then holds exactly `payload(i)`. Returns the event.
pub fn restore_four_into(
    c: &mut Client,
    s: SessionHandle,
    region: u64,
    operation: u64,
    device_pages: &[u64],
    first_slot: u32,
    payload: impl Fn(u64) -> Vec<u8>,
) -> Event {
    assert_eq!(device_pages.len(), 4);
    let targets = (0..4u64)
        .map(|i| RestoreTarget {
            pos: PagePos {
                rank: 0,
                group: 0,
                page_end: (i + 1) * PAGE,
            },
            device_page: device_pages[i as usize],
        })
        .collect();
    c.submit(Command::Restore {
        session: s,
        operation,
        targets,
        retained: vec![],
    })
    .unwrap();
    let done = c
        .wait_event(T, |e| {
            matches!(e, Event::RestoreDone { operation: o, .. } | Event::Miss { operation: o, .. } if *o == operation)
        })
        .unwrap()
        .unwrap();
    assert!(
        matches!(done, Event::RestoreDone { pages: 4, .. }),
        "{done:?}"
    );
    for i in 0..4u64 {
        let at = ((u64::from(first_slot) + i) * BYTES) as usize;
        assert_eq!(
            &c.region_mut(region).unwrap()[at..at + BYTES as usize],
            &payload(i)[..],
            "page {i}"
        );
    }
    done
}
