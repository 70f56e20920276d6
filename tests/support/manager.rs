//! `orbitkv serve` as a subprocess of a test: started on a socket in the
//! test's directory, with its metrics endpoint on a free loopback port, and
//! killed when dropped (a failed test never leaves a manager running).

use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Proc, Stdio};
use std::time::{Duration, Instant};

use orbitkv_ipc::Client;

use super::{T, free_port};

/// The runtime tables every test manager starts from: DRAM in 64 KiB
/// extents without first-touch (fast to start), ticks every 100 µs.
pub const BASE_CONFIG: &str =
    "[serve]\nidle_tick_us = 100\n[dram]\nfirst_touch = false\nextent_bytes = 65536\n";

/// `BASE_CONFIG` with a `[remote]` table naming a MAC secret in `dir`
/// (written once, shared by the managers of `dir` as by a deployment's),
/// then `remote` (more `[remote]` settings, one per line).
pub fn remote_config(dir: &Path, remote: &str) -> String {
    let secret = dir.join("mac.key");
    if !secret.exists() {
        std::fs::write(&secret, "a deployment secret of 32+ bytes, for tests\n").unwrap();
    }
    format!("{BASE_CONFIG}[remote]\nmac_key_file = {secret:?}\n{remote}")
}

pub struct Manager {
    pub child: Child,
    pub socket: PathBuf,
    pub metrics: String,
}

impl Manager {
    /// `orbitkv serve` on `dir/{name}.sock` with `dram` of DRAM, `config`
    /// written to `dir/{name}.toml`, and extra command-line `args`; returns
    /// once it accepts a connection.
    pub fn start(dir: &Path, name: &str, dram: &str, config: &str, args: &[&str]) -> Manager {
        let binary = Path::new(env!("CARGO_BIN_EXE_orbitkv"));
        Manager::start_binary(binary, dir, name, dram, config, args)
    }

    /// [`Manager::start`] with another `orbitkv` binary (a release build
    /// carried to a machine without Rust).
    pub fn start_binary(
        binary: &Path,
        dir: &Path,
        name: &str,
        dram: &str,
        config: &str,
        args: &[&str],
    ) -> Manager {
        let socket = dir.join(format!("{name}.sock"));
        let config_path = dir.join(format!("{name}.toml"));
        std::fs::write(&config_path, config).unwrap();
        // The metrics port is chosen free, then bound by the manager: a
        // test starting another manager at the same moment can take it in
        // between. A manager that exits at once is started again on
        // another port (a few times); one that is up but slow is waited for.
        for attempt in 0.. {
            let metrics = format!("127.0.0.1:{}", free_port());
            let mut child = Proc::new(binary)
                .args(["serve", "--socket", socket.to_str().unwrap()])
                .args(["--dram", dram, "--config", config_path.to_str().unwrap()])
                .args(["--metrics-addr", &metrics])
                .args(args)
                .env("RUST_LOG", "error")
                .env_remove("ORBITKV_HOT_PATH")
                .stdout(Stdio::null())
                .spawn()
                .unwrap();
            let deadline = Instant::now() + T;
            loop {
                if Client::connect(&socket, "probe").is_ok() {
                    return Manager {
                        child,
                        socket,
                        metrics,
                    };
                }
                if let Some(status) = child.try_wait().unwrap() {
                    assert!(
                        attempt < 4,
                        "manager exited at start ({status}), {attempt} times"
                    );
                    break;
                }
                assert!(Instant::now() < deadline, "manager did not come up");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        unreachable!("the loop returns or panics")
    }

    /// The default test manager: `BASE_CONFIG`, 16 MiB of DRAM.
    pub fn start_default(dir: &Path) -> Manager {
        Manager::start(dir, "orbitkv", "16MiB", BASE_CONFIG, &[])
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// SIGTERM, a clean exit, and the socket file removed.
    pub fn stop(mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}");
        assert!(!self.socket.exists(), "socket file removed on shutdown");
    }

    /// The manager's resident set, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
            .unwrap()
    }

    /// Time the manager's threads spent on a CPU, in ns (schedstat: exact,
    /// not sampled at clock ticks).
    pub fn cpu_ns(&self) -> u64 {
        let mut ns = 0;
        for t in std::fs::read_dir(format!("/proc/{}/task", self.pid())).unwrap() {
            let stat =
                std::fs::read_to_string(t.unwrap().path().join("schedstat")).unwrap_or_default();
            ns += stat
                .split(' ')
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
        ns
    }

    /// The `/metrics` page.
    pub fn scrape(&self) -> String {
        let mut s = std::net::TcpStream::connect(&self.metrics).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut body = String::new();
        s.read_to_string(&mut body).unwrap();
        body
    }

    /// `POST path` with `body` on the metrics endpoint: the status code
    /// and the response body.
    pub fn post(&self, path: &str, body: &[u8]) -> (u16, String) {
        let mut s = std::net::TcpStream::connect(&self.metrics).unwrap();
        let head = format!(
            "POST {path} HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        // The server may answer before the body is all sent (too large).
        let _ = s.write_all(body);
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map_or(String::new(), |(_, b)| b.to_owned());
        (status, body)
    }

    /// A sample from `/metrics` by its full series name, labels included as
    /// printed; `None` until the first snapshot.
    pub fn sample(&self, series: &str) -> Option<u64> {
        let body = self.scrape();
        let line = body
            .lines()
            .find(|l| l.starts_with(&format!("{series} ")))?;
        line.rsplit(' ')
            .next()?
            .parse::<f64>()
            .ok()
            .map(|v| v as u64)
    }

    /// `orbitkv_{name}` (labels included as printed).
    pub fn metric(&self, name: &str) -> Option<u64> {
        self.sample(&format!("orbitkv_{name}"))
    }

    /// Waits until the series (refreshed every 100 ms) satisfies `ok`, and
    /// returns the value that did.
    pub fn wait_sample(&self, series: &str, ok: impl Fn(u64) -> bool) -> u64 {
        let deadline = Instant::now() + T;
        loop {
            if let Some(v) = self.sample(series)
                && ok(v)
            {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{series} never got there (now {:?})",
                self.sample(series)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `orbitkv_{name}` satisfies `ok`.
    pub fn wait_metric_until(&self, name: &str, ok: impl Fn(u64) -> bool) -> u64 {
        self.wait_sample(&format!("orbitkv_{name}"), ok)
    }

    /// Waits until `orbitkv_{name}` is `value`.
    pub fn wait_metric(&self, name: &str, value: u64) {
        self.wait_metric_until(name, |v| v == value);
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
