//! [`RemoteConfig`]: where the Redis deployment is and every bound of the
//! tier, by name. The password is never part of it (the config is
//! serialized into traces and logs): it comes from `ORBITKV_REMOTE_PASSWORD`
//! or from `password_file` when the tier opens.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::record::RecordMac;

/// Environment variable holding the Redis password (takes precedence over
/// `password_file`).
pub const PASSWORD_ENV: &str = "ORBITKV_REMOTE_PASSWORD";

/// Single node or cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RemoteMode {
    /// More than one seed means a cluster; with one, the node is asked
    /// (`INFO cluster`) when the first connection is made.
    #[default]
    Auto,
    Single,
    Cluster,
}

/// Which pages the tier writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WritePolicy {
    /// Every page published into DRAM is written at once, so other hosts
    /// can use it while this one still holds it.
    #[default]
    WriteThrough,
    /// Pages are written when DRAM evicts them (and no earlier tier such as
    /// the SSD took them first).
    WriteBack,
    /// Both.
    Both,
    /// The tier only reads what others wrote.
    ReadOnly,
}

impl WritePolicy {
    pub fn on_publish(self) -> bool {
        matches!(self, WritePolicy::WriteThrough | WritePolicy::Both)
    }

    pub fn on_evict(self) -> bool {
        matches!(self, WritePolicy::WriteBack | WritePolicy::Both)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteConfig {
    /// Seed URLs, `redis://HOST:PORT` (no password in the URL).
    pub urls: Vec<String>,
    pub mode: RemoteMode,
    /// Prefix of every Redis key the tier writes, so deployments can share
    /// a cluster. Default `okv1:`.
    pub key_prefix: String,
    /// ACL user name (the password never goes here).
    pub username: Option<String>,
    /// File whose contents (trailing newline removed) are the password;
    /// `ORBITKV_REMOTE_PASSWORD` wins when set.
    pub password_file: Option<PathBuf>,
    /// File holding the deployment's secret (at least 32 bytes; a trailing
    /// newline is not part of it), shared by every manager of the
    /// deployment and distinct from the Redis password: records are
    /// authenticated with keys derived from it, so a writer of the store
    /// without it cannot forge one. Required unless `unauthenticated`.
    pub mac_key_file: Option<PathBuf>,
    /// Runs without a secret: records carry MACs under public keys, which
    /// anyone who can write the store can recompute. Whoever can write the
    /// Redis is then trusted as fully as this manager (docs/remote.md).
    pub unauthenticated: bool,
    pub write_policy: WritePolicy,
    /// Expiry set on every record and directory stream. Default 1 h.
    pub ttl_ms: u64,
    /// Largest page written or read. Default 16 MiB.
    pub max_page_bytes: u64,
    /// Reads accepted and not yet reported, plus reads abandoned at their
    /// deadline whose worker has not returned; `QueueFull` beyond.
    /// Default 64.
    pub max_inflight_reads: usize,
    /// Writes accepted and not yet finished; refused `queue_full` beyond.
    /// Default 256.
    pub max_queued_writes: usize,
    /// Bytes of those writes (each holds its record). Default 256 MiB.
    pub max_queued_write_bytes: u64,
    /// Threads that read (one connection each). Default 4.
    pub read_workers: usize,
    /// Threads that write (one connection each). Default 2.
    pub write_workers: usize,
    /// Writes one writer sends as one pipeline when several are queued
    /// (one round trip for all of them). Default 16; 1 writes one at a time.
    pub write_batch_pages: usize,
    /// Record bytes one pipeline carries at most (a batch is cut before the
    /// write that would pass it; a single larger record still goes alone).
    /// Default 2 MiB: a writer MACs (and packs) a whole batch before it
    /// sends any of it, so large records go one or two at a time and the
    /// writers take turns at the socket (2 MiB pages: about 1.2x the
    /// throughput of 8 MiB batches); 16 pages of 64 KiB still go as one.
    pub write_batch_bytes: u64,
    /// A read not complete this long after submission is reported as a
    /// timeout; also the socket timeout of read connections. Default 500 ms.
    pub read_timeout_ms: u64,
    /// Socket timeout of write connections. Default 2 s.
    pub write_timeout_ms: u64,
    /// Connection establishment timeout. Default 500 ms.
    pub connect_timeout_ms: u64,
    /// Cluster redirections/retries per command. Default 2.
    pub cluster_retries: u32,
    /// How often the directory is read for new entries. Default 100 ms.
    pub refresh_interval_ms: u64,
    /// Entries asked for per directory read. Default 1024.
    pub refresh_batch: usize,
    /// Entries taken in one refresh round, all namespaces. Default 65536.
    pub max_refresh_entries: usize,
    /// Every this many rounds, directory streams we read from are checked
    /// for existence, so a flushed or expired directory drops its metadata.
    /// Default 20.
    pub validate_every_rounds: u64,
    /// Pages the metadata cache holds (oldest forgotten first).
    /// Default 1 Mi.
    pub metadata_max_entries: usize,
    /// Namespaces whose directories are followed (oldest dropped first).
    /// Default 256.
    pub max_namespaces: usize,
    /// Directory streams per namespace. Default 16.
    pub directory_shards: u32,
    /// Entries one directory stream keeps (approximate trim). Default 64 Ki.
    pub directory_max_entries: u64,
    /// Consecutive connection/timeout failures that open the breaker: while
    /// open, lookups see nothing and reads and writes are refused at once.
    /// Default 5.
    pub breaker_failures: u32,
    /// Time the breaker stays open before a health check may close it.
    /// Default 1 s.
    pub breaker_cooldown_ms: u64,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        RemoteConfig {
            urls: Vec::new(),
            mode: RemoteMode::Auto,
            key_prefix: "okv1:".into(),
            username: None,
            password_file: None,
            mac_key_file: None,
            unauthenticated: false,
            write_policy: WritePolicy::WriteThrough,
            ttl_ms: 3_600_000,
            max_page_bytes: 16 << 20,
            max_inflight_reads: 64,
            max_queued_writes: 256,
            max_queued_write_bytes: 256 << 20,
            read_workers: 4,
            write_workers: 2,
            write_batch_pages: 16,
            write_batch_bytes: 2 << 20,
            read_timeout_ms: 500,
            write_timeout_ms: 2_000,
            connect_timeout_ms: 500,
            cluster_retries: 2,
            refresh_interval_ms: 100,
            refresh_batch: 1024,
            max_refresh_entries: 65536,
            validate_every_rounds: 20,
            metadata_max_entries: 1 << 20,
            max_namespaces: 256,
            directory_shards: 16,
            directory_max_entries: 64 << 10,
            breaker_failures: 5,
            breaker_cooldown_ms: 1_000,
        }
    }
}

/// Why the remote tier cannot start.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("invalid remote config: {0}")]
    InvalidConfig(String),
    #[error("remote password file {path}: {source}")]
    PasswordFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("remote MAC key file {path}: {source}")]
    MacKeyFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("starting the remote tier's threads: {0}")]
    Spawn(#[source] std::io::Error),
}

impl RemoteConfig {
    /// The defaults with these seed URLs.
    pub fn new<S: Into<String>>(urls: impl IntoIterator<Item = S>) -> RemoteConfig {
        RemoteConfig {
            urls: urls.into_iter().map(Into::into).collect(),
            ..RemoteConfig::default()
        }
    }

    /// Parses `--remote`: one URL, or a comma-separated list of seeds.
    pub fn parse_urls(spec: &str) -> Vec<String> {
        spec.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    }

    pub fn read_timeout(&self) -> Duration {
        Duration::from_millis(self.read_timeout_ms)
    }

    pub fn write_timeout(&self) -> Duration {
        Duration::from_millis(self.write_timeout_ms)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// Checks every bound and URL; `RemoteTier::open` calls it.
    pub fn validate(&self) -> Result<(), RemoteError> {
        let bad = |why: String| Err(RemoteError::InvalidConfig(why));
        if self.urls.is_empty() {
            return bad("no seed URL (--remote redis://HOST:PORT)".into());
        }
        for url in &self.urls {
            check_url(url).map_err(RemoteError::InvalidConfig)?;
        }
        if self.mode == RemoteMode::Single && self.urls.len() > 1 {
            return bad("mode single takes exactly one URL".into());
        }
        match (&self.mac_key_file, self.unauthenticated) {
            (None, false) => {
                return bad(
                    "no mac_key_file: records from the store cannot be authenticated. \
                     Give every manager of the deployment the same secret file \
                     (`[remote] mac_key_file`, at least 32 bytes, not the Redis password), \
                     or set `unauthenticated = true` to trust whoever can write the store"
                        .into(),
                );
            }
            (Some(_), true) => {
                return bad("mac_key_file and unauthenticated = true contradict each other".into());
            }
            _ => {}
        }
        if self.key_prefix.is_empty() || self.key_prefix.len() > 64 {
            return bad("key_prefix must be 1 to 64 bytes".into());
        }
        if self.key_prefix.contains(['{', '}']) {
            // A hash tag in the prefix would put every key in one slot.
            return bad("key_prefix must not contain '{' or '}'".into());
        }
        for (name, v) in [
            ("ttl_ms", self.ttl_ms),
            ("max_page_bytes", self.max_page_bytes),
            ("max_queued_write_bytes", self.max_queued_write_bytes),
            ("write_batch_bytes", self.write_batch_bytes),
            ("read_timeout_ms", self.read_timeout_ms),
            ("write_timeout_ms", self.write_timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("refresh_interval_ms", self.refresh_interval_ms),
            ("validate_every_rounds", self.validate_every_rounds),
            ("directory_max_entries", self.directory_max_entries),
            ("breaker_cooldown_ms", self.breaker_cooldown_ms),
            ("directory_shards", u64::from(self.directory_shards)),
            ("breaker_failures", u64::from(self.breaker_failures)),
        ] {
            if v == 0 {
                return bad(format!("{name} is 0"));
            }
        }
        for (name, v) in [
            ("max_inflight_reads", self.max_inflight_reads),
            ("max_queued_writes", self.max_queued_writes),
            ("read_workers", self.read_workers),
            ("write_workers", self.write_workers),
            ("write_batch_pages", self.write_batch_pages),
            ("refresh_batch", self.refresh_batch),
            ("max_refresh_entries", self.max_refresh_entries),
            ("metadata_max_entries", self.metadata_max_entries),
            ("max_namespaces", self.max_namespaces),
        ] {
            if v == 0 {
                return bad(format!("{name} is 0"));
            }
        }
        if self.read_workers > 256 || self.write_workers > 256 {
            return bad("read_workers and write_workers are at most 256".into());
        }
        if self.write_batch_pages > 1024 {
            return bad("write_batch_pages is at most 1024".into());
        }
        if self.write_batch_bytes > 1 << 30 {
            return bad("write_batch_bytes is at most 1 GiB".into());
        }
        if self.directory_shards > 1024 {
            return bad("directory_shards is at most 1024".into());
        }
        if self.max_page_bytes > 512 << 20 {
            // Redis' default proto-max-bulk-len.
            return bad("max_page_bytes exceeds 512 MiB, the largest Redis value".into());
        }
        Ok(())
    }

    /// The record keys: derived from `mac_key_file`'s secret, refused when
    /// it is short or is the Redis `password`; public keys when
    /// `unauthenticated`. The secret is never logged.
    pub fn record_mac(&self, password: Option<&str>) -> Result<RecordMac, RemoteError> {
        let Some(path) = &self.mac_key_file else {
            return if self.unauthenticated {
                Ok(RecordMac::unauthenticated())
            } else {
                Err(RemoteError::InvalidConfig("no mac_key_file".into()))
            };
        };
        let bytes = std::fs::read(path).map_err(|source| RemoteError::MacKeyFile {
            path: path.clone(),
            source,
        })?;
        let secret = bytes
            .strip_suffix(b"\n")
            .map_or(&bytes[..], |s| s.strip_suffix(b"\r").unwrap_or(s));
        let refuse = |why: String| {
            RemoteError::InvalidConfig(format!("mac_key_file {}: {why}", path.display()))
        };
        if password.is_some_and(|p| p.as_bytes() == secret) {
            return Err(refuse(
                "the MAC secret is the Redis password; whoever may write the store must not \
                 hold it"
                    .into(),
            ));
        }
        RecordMac::from_secret(secret).map_err(refuse)
    }

    /// The password: `ORBITKV_REMOTE_PASSWORD`, else `password_file`, else
    /// none. Never logged.
    pub fn password(&self) -> Result<Option<String>, RemoteError> {
        if let Ok(p) = std::env::var(PASSWORD_ENV)
            && !p.is_empty()
        {
            return Ok(Some(p));
        }
        match &self.password_file {
            None => Ok(None),
            Some(path) => {
                let text =
                    std::fs::read_to_string(path).map_err(|source| RemoteError::PasswordFile {
                        path: path.clone(),
                        source,
                    })?;
                let p = text.trim_end_matches(['\n', '\r']).to_owned();
                if p.is_empty() {
                    return Err(RemoteError::InvalidConfig(format!(
                        "password file {} is empty",
                        path.display()
                    )));
                }
                Ok(Some(p))
            }
        }
    }
}

/// `redis://HOST:PORT[/DB]` without credentials. TLS (`rediss://`) and Unix
/// sockets are not supported: this build has no TLS, and a Unix socket
/// cannot be shared across hosts.
fn check_url(url: &str) -> Result<(), String> {
    let Some(rest) = url.strip_prefix("redis://") else {
        return Err(format!(
            "{url:?}: only redis://HOST:PORT URLs are supported (no TLS, no unix sockets)"
        ));
    };
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.contains('@') {
        // Do not echo the URL: it holds a secret.
        return Err(format!(
            "a remote URL holds credentials; put the password in {PASSWORD_ENV} or remote.password_file"
        ));
    }
    let (host, port) = authority
        .rsplit_once(':')
        .ok_or_else(|| format!("{url:?}: no port (redis://HOST:PORT)"))?;
    if host.is_empty() {
        return Err(format!("{url:?}: no host"));
    }
    port.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("{url:?}: bad port"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_without_echoing_secrets() {
        assert!(check_url("redis://127.0.0.1:6379").is_ok());
        assert!(check_url("redis://cache.internal:7000/0").is_ok());
        assert!(check_url("rediss://h:1").is_err());
        assert!(check_url("redis://h").is_err());
        assert!(check_url("redis://:0").is_err());
        assert!(check_url("redis://h:0").is_err());
        let e = check_url("redis://:hunter2@h:1").unwrap_err();
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[test]
    fn parse_and_validate() {
        let urls = RemoteConfig::parse_urls("redis://a:1, redis://b:2,,");
        assert_eq!(urls, ["redis://a:1", "redis://b:2"]);
        // No secret and no explicit trust: refused.
        let e = RemoteConfig::new(urls.clone()).validate().unwrap_err();
        assert!(e.to_string().contains("mac_key_file"), "{e}");
        let mut c = RemoteConfig::new(urls.clone());
        c.unauthenticated = true;
        assert!(c.validate().is_ok());
        c.mac_key_file = Some("/k".into());
        assert!(c.validate().is_err(), "both is a contradiction");
        c.unauthenticated = false;
        assert!(c.validate().is_ok());
        assert!(RemoteConfig::default().validate().is_err());
        let mut c = RemoteConfig::new(urls);
        c.mode = RemoteMode::Single;
        assert!(c.validate().is_err());
        let mut c = RemoteConfig::new(["redis://a:1"]);
        c.unauthenticated = true;
        c.read_workers = 0;
        assert!(c.validate().is_err());
        for (pages, bytes, what) in [
            (0, 1 << 20, "write_batch_pages is 0"),
            (1025, 1 << 20, "write_batch_pages is at most 1024"),
            (16, 0, "write_batch_bytes is 0"),
            (16, (1 << 30) + 1, "write_batch_bytes is at most 1 GiB"),
        ] {
            let mut c = RemoteConfig::new(["redis://a:1"]);
            c.unauthenticated = true;
            c.write_batch_pages = pages;
            c.write_batch_bytes = bytes;
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
        let mut c = RemoteConfig::new(["redis://a:1"]);
        c.key_prefix = "{x}".into();
        assert!(c.validate().is_err());
    }

    #[test]
    fn the_mac_secret_is_long_and_not_the_password() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("mac");
        let mut c = RemoteConfig::new(["redis://a:1"]);
        c.mac_key_file = Some(p.clone());
        assert!(matches!(
            c.record_mac(None),
            Err(RemoteError::MacKeyFile { .. })
        ));
        std::fs::write(&p, "short\n").unwrap();
        assert!(c.record_mac(None).is_err());
        let secret = "0123456789abcdef0123456789abcdef";
        std::fs::write(&p, format!("{secret}\n")).unwrap();
        let mac = c.record_mac(None).unwrap();
        assert!(mac.is_keyed());
        // The trailing newline is not part of the secret.
        std::fs::write(&p, secret).unwrap();
        let again = c.record_mac(None).unwrap();
        assert_eq!(mac.payload_mac(b"x"), again.payload_mac(b"x"));
        let e = c.record_mac(Some(secret)).unwrap_err();
        assert!(e.to_string().contains("Redis password"), "{e}");
        assert!(
            !e.to_string().contains(secret),
            "the secret is never echoed"
        );
        c.mac_key_file = None;
        c.unauthenticated = true;
        assert!(!c.record_mac(None).unwrap().is_keyed());
    }

    #[test]
    fn password_from_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pw");
        std::fs::write(&p, "s3cret\n").unwrap();
        let mut c = RemoteConfig::new(["redis://a:1"]);
        c.password_file = Some(p.clone());
        // The env var (if a developer has it set) wins; only check the file
        // when it is unset.
        if std::env::var(PASSWORD_ENV).is_err() {
            assert_eq!(c.password().unwrap().as_deref(), Some("s3cret"));
            std::fs::write(&p, "\n").unwrap();
            assert!(c.password().is_err());
            c.password_file = Some(dir.path().join("missing"));
            assert!(matches!(
                c.password(),
                Err(RemoteError::PasswordFile { .. })
            ));
        }
    }
}
