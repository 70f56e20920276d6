//! Helpers shared by the tests that drive a real `orbitkv serve`.
#![allow(dead_code)]

use std::time::Duration;

use orbitkv_components::api::{Command, Event, PublishPage, Rank, SessionHandle};
use orbitkv_components::contract::{ComponentKind, GroupSpec, Rule};
use orbitkv_components::{NativeHash, StorageLayout, StorageSlot};
use orbitkv_ipc::Client;

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
    let e = c.call(register_command(), T).unwrap();
    assert!(matches!(e, Event::InstanceRegistered { .. }), "{e:?}");
}

/// Registers instance "llama": one rank, one prefix group of `BYTES` pages.
pub fn register_command() -> Command {
    let slot = StorageSlot {
        layer: 0,
        group: 0,
        tp_rank: 0,
        pp_rank: 0,
        segment_bytes: BYTES,
        padded_page_bytes: BYTES,
        page_tokens: PAGE as u32,
        dtype: "bf16".into(),
        layout: "NHD".into(),
        strides: vec![1],
        device_addr: 0,
    };
    Command::RegisterInstance {
        instance: "llama".into(),
        identity: [9; 32],
        layout: StorageLayout {
            slots: vec![slot],
            pool_capacity_pages: 0,
        },
        page_tokens: PAGE,
        groups: vec![GroupSpec {
            id: 0,
            rule: Rule::Prefix,
            components: vec![ComponentKind::AttentionKv],
        }],
        ranks: vec![Rank { tp: 0, pp: 0 }],
    }
}

pub fn alloc(c: &mut Client, s: SessionHandle, region: u64, slot: u32) -> u64 {
    match c
        .call(
            Command::DevicePageAlloc {
                session: s,
                region,
                slot,
            },
            T,
        )
        .unwrap()
    {
        Event::DevicePageAllocated { device_page, .. } => device_page,
        e => panic!("{e:?}"),
    }
}

pub fn open(c: &mut Client) -> (SessionHandle, u64) {
    let s = match c
        .call(
            Command::OpenSession {
                instance: "llama".into(),
            },
            T,
        )
        .unwrap()
    {
        Event::SessionOpened { session, .. } => session,
        e => panic!("{e:?}"),
    };
    let region = match c
        .call(
            Command::RegisterDeviceRegion {
                session: s,
                rank: 0,
                group: 0,
                slots: 64,
                agent: None,
            },
            T,
        )
        .unwrap()
    {
        Event::RegionRegistered { region, .. } => region,
        e => panic!("{e:?}"),
    };
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
    let mut pages = Vec::new();
    for i in 0..4u64 {
        let dp = alloc(a, sa, ra, i as u32);
        a.region_mut(ra).unwrap()[(i * BYTES) as usize..((i + 1) * BYTES) as usize]
            .copy_from_slice(&payload(i));
        pages.push(PublishPage {
            rank: 0,
            group: 0,
            hash: hashes[i as usize],
            device_page: dp,
        });
    }
    let e = a
        .call(
            Command::Publish {
                session: sa,
                request: 1,
                pages,
            },
            T,
        )
        .unwrap();
    assert!(matches!(e, Event::PublishDone { inserted: 4, .. }), "{e:?}");
}
