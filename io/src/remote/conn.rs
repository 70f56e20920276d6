//! Connections: one per worker thread, to a single node or a cluster, with
//! connect and socket timeouts, and the few commands the tier sends.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConnection, cluster_pipe};
use redis::{Cmd, ConnectionInfo, IntoConnectionInfo, RedisError, RedisResult, Value};

use super::config::{RemoteConfig, RemoteMode};
use super::record::{RecordHeader, RecordMac};
use super::stats::ErrorKind;

const MODE_UNKNOWN: u8 = 0;
const MODE_SINGLE: u8 = 1;
const MODE_CLUSTER: u8 = 2;

/// Builds connections; shared by every thread of the tier.
pub(crate) struct Connector {
    infos: Vec<ConnectionInfo>,
    username: Option<String>,
    password: Option<String>,
    mode: AtomicU8,
    connect_timeout: Duration,
    cluster_retries: u32,
    cluster: Mutex<Option<ClusterClient>>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        f.debug_struct("Connector")
            .field(
                "seeds",
                &self
                    .infos
                    .iter()
                    .map(|i| i.addr().to_string())
                    .collect::<Vec<_>>(),
            )
            .field("mode", &self.mode_name())
            .finish_non_exhaustive()
    }
}

/// One live connection.
pub(crate) enum Conn {
    Single(redis::Connection),
    Cluster(Box<ClusterConnection>),
}

impl Connector {
    pub(crate) fn new(cfg: &RemoteConfig, password: Option<String>) -> Result<Connector, String> {
        let mut infos = Vec::new();
        for url in &cfg.urls {
            let info = url
                .as_str()
                .into_connection_info()
                .map_err(|e| format!("remote URL {url:?}: {e}"))?;
            let mut redis = info.redis_settings().clone();
            if let Some(u) = &cfg.username {
                redis = redis.set_username(u);
            }
            if let Some(p) = &password {
                redis = redis.set_password(p);
            }
            infos.push(info.set_redis_settings(redis));
        }
        let mode = match (cfg.mode, infos.len()) {
            (RemoteMode::Single, _) => MODE_SINGLE,
            (RemoteMode::Cluster, _) => MODE_CLUSTER,
            (RemoteMode::Auto, n) if n > 1 => MODE_CLUSTER,
            (RemoteMode::Auto, _) => MODE_UNKNOWN,
        };
        Ok(Connector {
            infos,
            username: cfg.username.clone(),
            password,
            mode: AtomicU8::new(mode),
            connect_timeout: cfg.connect_timeout(),
            cluster_retries: cfg.cluster_retries,
            cluster: Mutex::new(None),
        })
    }

    pub(crate) fn mode_name(&self) -> &'static str {
        match self.mode.load(Ordering::Relaxed) {
            MODE_SINGLE => "single",
            MODE_CLUSTER => "cluster",
            _ => "unknown",
        }
    }

    /// A new connection whose commands time out after `io_timeout`.
    pub(crate) fn connect(&self, io_timeout: Duration) -> RedisResult<Conn> {
        if self.mode.load(Ordering::Relaxed) == MODE_UNKNOWN {
            let mut c = self.connect_single()?;
            let info: String = redis::cmd("INFO").arg("cluster").query(&mut c)?;
            let cluster = info.lines().any(|l| l.trim() == "cluster_enabled:1");
            let mode = if cluster { MODE_CLUSTER } else { MODE_SINGLE };
            self.mode.store(mode, Ordering::Relaxed);
            if !cluster {
                set_timeouts_single(&c, io_timeout)?;
                return Ok(Conn::Single(c));
            }
        }
        if self.mode.load(Ordering::Relaxed) == MODE_SINGLE {
            let c = self.connect_single()?;
            set_timeouts_single(&c, io_timeout)?;
            return Ok(Conn::Single(c));
        }
        let client = self.cluster_client(io_timeout)?;
        let c = client.get_connection()?;
        c.set_read_timeout(Some(io_timeout))?;
        c.set_write_timeout(Some(io_timeout))?;
        Ok(Conn::Cluster(Box::new(c)))
    }

    fn connect_single(&self) -> RedisResult<redis::Connection> {
        let mut last = None;
        for info in &self.infos {
            match redis::Client::open(info.clone())
                .and_then(|c| c.get_connection_with_timeout(self.connect_timeout))
            {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| RedisError::from((redis::ErrorKind::Client, "no seed URL"))))
    }

    fn cluster_client(&self, io_timeout: Duration) -> RedisResult<ClusterClient> {
        let mut slot = self.cluster.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let mut b = ClusterClientBuilder::new(self.infos.clone())
            .connection_timeout(self.connect_timeout)
            .response_timeout(io_timeout)
            .retries(self.cluster_retries)
            .min_retry_wait(5)
            .max_retry_wait(50);
        if let Some(u) = &self.username {
            b = b.username(u);
        }
        if let Some(p) = &self.password {
            b = b.password(p);
        }
        let client = b.build()?;
        *slot = Some(client.clone());
        Ok(client)
    }
}

fn set_timeouts_single(c: &redis::Connection, io: Duration) -> RedisResult<()> {
    c.set_read_timeout(Some(io))?;
    c.set_write_timeout(Some(io))
}

/// A writer's buffers for `put_many`, kept between batches.
pub(crate) struct Scratch {
    packed: Vec<u8>,
    /// Capacity kept after a batch; a larger buffer (a record bigger than
    /// the batch bound went alone) is dropped.
    keep: usize,
}

impl Scratch {
    pub(crate) fn new(keep: usize) -> Scratch {
        Scratch {
            packed: Vec::new(),
            keep,
        }
    }

    fn trim(&mut self) {
        if self.packed.capacity() > self.keep {
            self.packed = Vec::new();
        }
    }
}

/// One record of a `put_many`.
pub(crate) struct Put<'a> {
    pub data_key: String,
    /// The record's header; `put_many` sets its payload MAC.
    pub header: RecordHeader,
    pub payload: &'a [u8],
    pub dir: DirPut,
}

/// Where a record's directory entry goes.
pub(crate) struct DirPut {
    pub key: String,
    /// Approximate trim length of the stream.
    pub max_entries: u64,
    /// Renew the stream's expiry with this write.
    pub renew: bool,
}

/// A record as one command argument (the cluster path): header then
/// payload, written straight into the command buffer.
struct RecordArg<'a> {
    header: &'a [u8],
    payload: &'a [u8],
}

impl redis::ToRedisArgs for RecordArg<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        use std::io::Write as _;
        let mut w = out.writer_for_next_arg();
        // Writing into the command's Vec cannot fail.
        let _ = w.write_all(self.header);
        let _ = w.write_all(self.payload);
    }
}

/// The payload is copied into the pipeline and MACed in pieces this big:
/// each piece is hashed while it is still in cache from its copy.
const MAC_PIECE: usize = 64 << 10;

/// Appends one RESP bulk string.
fn bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    bulk_len(out, bytes.len());
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

fn bulk_len(out: &mut Vec<u8>, len: usize) {
    out.push(b'$');
    out.extend_from_slice(len.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends `SET <data key> <header ‖ payload> PX <ttl>` to a packed
/// pipeline, copying the payload in once with its MAC computed in the same
/// pass, then the header (which carries that MAC) into the room left before
/// it; sets `put.header`'s payload MAC and returns the encoded header.
///
/// Packed here rather than with a redis-rs `Cmd`: a `Cmd` keeps its own
/// copy of every argument, and packing copies it again, so a megabyte
/// record went through two extra copies and a separate MAC pass. The
/// encoding is plain RESP (an array of bulk strings), as `Cmd` writes it.
fn pack_set(out: &mut Vec<u8>, put: &mut Put<'_>, mac: &RecordMac, ttl_ms: u64) -> Vec<u8> {
    let header_len = put.header.encoded_len();
    let ttl = ttl_ms.to_string();
    out.reserve(put.data_key.len() + header_len + put.payload.len() + 64);
    out.extend_from_slice(b"*5\r\n");
    bulk(out, b"SET");
    bulk(out, put.data_key.as_bytes());
    bulk_len(out, header_len + put.payload.len());
    let at = out.len();
    out.resize(at + header_len, 0);
    let mut hasher = mac.payload_hasher();
    for piece in put.payload.chunks(MAC_PIECE) {
        let start = out.len();
        out.extend_from_slice(piece);
        hasher.update(&out[start..]);
    }
    put.header.payload_mac = *hasher.finalize().as_bytes();
    let header = put.header.encode(mac);
    assert_eq!(header.len(), header_len, "a header encodes to its length");
    out[at..at + header_len].copy_from_slice(&header);
    out.extend_from_slice(b"\r\n");
    bulk(out, b"PX");
    bulk(out, ttl.as_bytes());
    header
}

/// What a bounded read found.
pub(crate) enum Bounded {
    Missing,
    /// The value's length, over the limit; not read.
    TooLong(u64),
    Value(Vec<u8>),
}

/// One directory stream entry: its id and the header bytes it carries.
pub(crate) type DirEntry = (String, Vec<u8>);

impl Conn {
    fn like(&mut self) -> &mut dyn redis::ConnectionLike {
        match self {
            Conn::Single(c) => c,
            Conn::Cluster(c) => c.as_mut(),
        }
    }

    /// Sets the socket read timeout for the next command (a read's time
    /// left before its deadline).
    pub(crate) fn set_read_timeout(&mut self, d: Duration) -> RedisResult<()> {
        let d = d.max(Duration::from_millis(1));
        match self {
            Conn::Single(c) => c.set_read_timeout(Some(d)),
            Conn::Cluster(c) => c.set_read_timeout(Some(d)),
        }
    }

    pub(crate) fn query<T: redis::FromRedisValue>(&mut self, cmd: &Cmd) -> RedisResult<T> {
        cmd.query(self.like())
    }

    /// Sends `cmds` as one pipeline (routed per key in a cluster).
    pub(crate) fn pipeline(&mut self, cmds: Vec<Cmd>) -> RedisResult<Vec<Value>> {
        match self {
            Conn::Single(c) => {
                let mut p = redis::pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query(c)
            }
            Conn::Cluster(c) => {
                let mut p = cluster_pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                p.query(c.as_mut())
            }
        }
    }

    /// The value at `key`, if it is at most `limit` bytes: its length
    /// first, then at most `limit` bytes of it, in one pipeline, so a
    /// longer value is never read whole. A value whose length changed in
    /// between is reported too long or comes back short, and fails its
    /// verification.
    pub(crate) fn get_bounded(&mut self, key: &str, limit: u64) -> RedisResult<Bounded> {
        let mut strlen = redis::cmd("STRLEN");
        strlen.arg(key);
        let mut range = redis::cmd("GETRANGE");
        range.arg(key).arg(0).arg(limit.saturating_sub(1));
        let mut replies = self.pipeline(vec![strlen, range])?.into_iter();
        let bad = |what: &str| {
            redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "bounded read",
                what.to_owned(),
            ))
        };
        let (Some(Value::Int(len)), Some(bytes)) = (replies.next(), replies.next()) else {
            return Err(bad("STRLEN did not answer an integer"));
        };
        let len = u64::try_from(len).map_err(|_| bad("a negative length"))?;
        if len == 0 {
            // No such key (a record is never empty).
            return Ok(Bounded::Missing);
        }
        if len > limit {
            return Ok(Bounded::TooLong(len));
        }
        match bytes {
            Value::BulkString(b) => Ok(Bounded::Value(b)),
            _ => Err(bad("GETRANGE did not answer bytes")),
        }
    }

    /// Stores records (`header ‖ payload`), appends each one's directory
    /// entry (the header) and, where asked, renews the directory's expiry:
    /// one round trip for the whole batch. Values go first, so a directory
    /// entry never names a record that was not written: one ordered
    /// pipeline on a single node; on a cluster the values' and the
    /// directories' slots differ, so every value is stored before any
    /// entry is sent (two round trips). An error fails the whole batch
    /// (some records may be stored: each is complete and verifiable, only
    /// not known to this writer).
    ///
    /// On a single node the commands are packed into `scratch`, whose
    /// buffer is kept between batches (memory already mapped: page faults
    /// and zeroing cost more than the copies at megabyte pages), and each
    /// payload is copied into it once, MACed in that pass (`pack_set`).
    /// On a cluster the MAC is a pass of its own and redis-rs packs.
    /// Either way each put's header gets its payload MAC.
    pub(crate) fn put_many(
        &mut self,
        puts: &mut [Put<'_>],
        mac: &RecordMac,
        ttl_ms: u64,
        scratch: &mut Scratch,
    ) -> RedisResult<()> {
        let dir = |p: &Put<'_>, header: &[u8], out: &mut Vec<Cmd>| {
            let mut xadd = redis::cmd("XADD");
            xadd.arg(&p.dir.key)
                .arg("MAXLEN")
                .arg("~")
                .arg(p.dir.max_entries)
                .arg("*")
                .arg("h")
                .arg(header);
            out.push(xadd);
            if p.dir.renew {
                // Renewed at most every ttl/10 (see `Renewals`): outlive the
                // newest record written in between.
                let mut expire = redis::cmd("PEXPIRE");
                expire.arg(&p.dir.key).arg(ttl_ms + ttl_ms / 10);
                out.push(expire);
            }
        };
        match self {
            Conn::Single(c) => {
                // Each record right before its entry, in order.
                let packed = &mut scratch.packed;
                packed.clear();
                let mut count = 0;
                let mut small = Vec::new();
                for p in puts.iter_mut() {
                    let header = pack_set(packed, p, mac, ttl_ms);
                    small.clear();
                    dir(p, &header, &mut small);
                    for d in &small {
                        d.write_packed_command(packed);
                    }
                    count += 1 + small.len();
                }
                let replies = redis::ConnectionLike::req_packed_commands(c, packed, 0, count);
                scratch.trim();
                for reply in replies? {
                    reply.extract_error()?;
                }
            }
            Conn::Cluster(_) => {
                let mut sets = Vec::with_capacity(puts.len());
                let mut dirs = Vec::with_capacity(puts.len() * 2);
                for p in puts.iter_mut() {
                    p.header.payload_mac = mac.payload_mac(p.payload);
                    let header = p.header.encode(mac);
                    let mut cmd = Cmd::new();
                    cmd.arg("SET")
                        .arg(&p.data_key)
                        .arg(RecordArg {
                            header: &header,
                            payload: p.payload,
                        })
                        .arg("PX")
                        .arg(ttl_ms);
                    sets.push(cmd);
                    dir(p, &header, &mut dirs);
                }
                self.pipeline(sets)?;
                self.pipeline(dirs)?;
            }
        }
        Ok(())
    }

    /// For each directory stream, its entries after `after[i]` (exclusive;
    /// `None` = from the start), at most `count`: one pipeline.
    pub(crate) fn read_directories(
        &mut self,
        dir_keys: &[String],
        after: &[Option<String>],
        count: usize,
    ) -> RedisResult<Vec<Vec<DirEntry>>> {
        debug_assert_eq!(dir_keys.len(), after.len());
        let cmds = dir_keys
            .iter()
            .zip(after)
            .map(|(key, after)| {
                let start = after
                    .as_ref()
                    .map_or_else(|| "-".to_owned(), |id| format!("({id}"));
                let mut c = redis::cmd("XRANGE");
                c.arg(key).arg(start).arg("+").arg("COUNT").arg(count);
                c
            })
            .collect();
        let vals = self.pipeline(cmds)?;
        Ok(vals.into_iter().map(parse_entries).collect())
    }

    /// Which of `keys` exist (one pipelined `EXISTS` per key).
    pub(crate) fn exists(&mut self, keys: &[String]) -> RedisResult<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let cmds = keys
            .iter()
            .map(|k| {
                let mut c = redis::cmd("EXISTS");
                c.arg(k);
                c
            })
            .collect();
        let vals = self.pipeline(cmds)?;
        Ok(vals
            .into_iter()
            .map(|v| matches!(v, Value::Int(n) if n > 0))
            .collect())
    }

    pub(crate) fn ping(&mut self) -> RedisResult<()> {
        let _: String = self.query(&redis::cmd("PING"))?;
        Ok(())
    }
}

/// XRANGE reply: `[[id, [field, value, ...]], ...]`. Entries that do not
/// have this shape, or lack the `h` field, are skipped (a directory entry is
/// a hint; the record itself is verified when read).
fn parse_entries(v: Value) -> Vec<DirEntry> {
    let Value::Array(items) = v else {
        return Vec::new();
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Value::Array(mut pair) = item else {
            continue;
        };
        if pair.len() != 2 {
            continue;
        }
        let fields = pair.pop();
        let id = pair.pop();
        let id = match id {
            Some(Value::BulkString(b)) => String::from_utf8(b).ok(),
            Some(Value::SimpleString(s)) => Some(s),
            _ => None,
        };
        let Some(id) = id else { continue };
        let Some(Value::Array(fields)) = fields else {
            out.push((id, Vec::new()));
            continue;
        };
        let mut header = Vec::new();
        let mut it = fields.into_iter();
        while let (Some(f), Some(val)) = (it.next(), it.next()) {
            if matches!(&f, Value::BulkString(b) if b == b"h")
                && let Value::BulkString(b) = val
            {
                header = b;
            }
        }
        // Keep the id even when the entry is unusable, so reading moves on.
        out.push((id, header));
    }
    out
}

/// Maps a client error to the kind counted and reported.
pub(crate) fn classify(e: &RedisError) -> ErrorKind {
    if e.is_timeout() {
        ErrorKind::Timeout
    } else if e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            redis::ErrorKind::AuthenticationFailed | redis::ErrorKind::ClusterConnectionNotFound
        )
    {
        ErrorKind::Unavailable
    } else {
        ErrorKind::Server
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_xrange_replies_and_skips_odd_shapes() {
        let v = Value::Array(vec![
            Value::Array(vec![
                Value::BulkString(b"1-0".to_vec()),
                Value::Array(vec![
                    Value::BulkString(b"h".to_vec()),
                    Value::BulkString(vec![1, 2, 3]),
                ]),
            ]),
            Value::Int(5),
            Value::Array(vec![
                Value::BulkString(b"2-0".to_vec()),
                Value::Array(vec![
                    Value::BulkString(b"x".to_vec()),
                    Value::BulkString(vec![9]),
                ]),
            ]),
        ]);
        let e = parse_entries(v);
        assert_eq!(
            e,
            vec![
                ("1-0".to_owned(), vec![1, 2, 3]),
                ("2-0".to_owned(), vec![])
            ]
        );
        assert!(parse_entries(Value::Nil).is_empty());
    }

    /// `pack_set` writes what redis-rs packs for the same SET of the same
    /// record, and the record verifies: its header carries the MAC of the
    /// payload computed piece by piece (payloads around a piece's edge).
    #[test]
    fn a_hand_packed_set_is_the_commands_packing_and_its_record_verifies() {
        use orbitkv_components::{Namespace, StateKey};

        use crate::checksum::page_checksum;
        use crate::remote::record::{Expect, verify};

        let mac = RecordMac::from_secret(&[0x5a; 32]).unwrap();
        // Records are never empty (a header refuses a zero length).
        for len in [
            1,
            MAC_PIECE - 1,
            MAC_PIECE,
            MAC_PIECE + 1,
            3 * MAC_PIECE + 17,
        ] {
            let payload: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let key = StateKey::new(Namespace([7; 32]), 3, &(len as u64).to_le_bytes()).unwrap();
            let header = RecordHeader {
                key,
                format_digest: [9; 32],
                payload_len: len as u64,
                payload_checksum: page_checksum(&payload),
                payload_mac: [0; crate::remote::record::MAC_LEN],
                writer: 42,
                written_unix_ms: 1_700_000_000_000,
                ttl_ms: 60_000,
            };
            let mut put = Put {
                data_key: format!("orbitkv:test:{len}"),
                header,
                payload: &payload,
                dir: DirPut {
                    key: "dir".into(),
                    max_entries: 8,
                    renew: false,
                },
            };
            let mut packed = b"prefix".to_vec();
            let encoded = pack_set(&mut packed, &mut put, &mac, 600_000);
            assert_eq!(put.header.payload_mac, mac.payload_mac(&payload), "{len}");
            assert_eq!(encoded, put.header.encode(&mac));

            let mut record = encoded.clone();
            record.extend_from_slice(&payload);
            let mut want = b"prefix".to_vec();
            redis::cmd("SET")
                .arg(&put.data_key)
                .arg(&record)
                .arg("PX")
                .arg(600_000u64)
                .write_packed_command(&mut want);
            assert_eq!(packed, want, "{len}");

            let expect = Expect {
                key,
                len: len as u64,
                checksum: page_checksum(&payload),
            };
            let checked = verify(&record, &expect, &mac);
            assert!(checked.is_ok(), "{len}: {checked:?}");
        }
    }
}
