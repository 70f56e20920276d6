//! The `/metrics` endpoint: hyper on a single-threaded tokio runtime in its
//! own thread. Every connection is a task, so idle or slow connections cost
//! a little memory and never delay a scrape; each must send its request
//! headers within the timeout, and is closed after the timeout either way.
//! At most `max_connections` are served at once; more wait in the listen
//! backlog.
//!
//! Where: a TCP address, which must be a loopback one unless `[serve]
//! metrics_public = true` (any local user can read a loopback port), or
//! `unix:PATH`, a Unix socket of mode 0600 whose peers must be this uid
//! (or root): the one way to keep the counters from other local users.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tracing::{info, warn};

use crate::ServeError;

/// A bound metrics listener, before the runtime takes it.
enum Bound {
    Tcp(std::net::TcpListener),
    Unix(std::os::unix::net::UnixListener),
}

/// Binds `addr` (`HOST:PORT`, loopback unless `public`; or `unix:PATH`).
fn bind(addr: &str, public: bool) -> Result<Bound, ServeError> {
    let refuse = |reason: String| ServeError::Metrics {
        addr: addr.to_owned(),
        reason,
    };
    if let Some(path) = addr.strip_prefix("unix:") {
        let l =
            crate::listener::bind(std::path::Path::new(path)).map_err(|e| refuse(e.to_string()))?;
        return Ok(Bound::Unix(l));
    }
    let l = std::net::TcpListener::bind(addr).map_err(|e| refuse(e.to_string()))?;
    let local = l.local_addr().map_err(|e| refuse(e.to_string()))?;
    if !public && !local.ip().is_loopback() {
        return Err(refuse(format!(
            "{} is not a loopback address: every host that reaches it could read the \
             counters; set [serve] metrics_public = true to mean it, or use unix:PATH",
            local.ip()
        )));
    }
    l.set_nonblocking(true).map_err(|e| refuse(e.to_string()))?;
    Ok(Bound::Tcp(l))
}

/// Binds `addr` now (so a bad address fails the start) and serves on a
/// side thread until the process exits. Returns where it listens.
pub fn serve(
    addr: &str,
    public: bool,
    registry: Arc<Registry>,
    max_connections: usize,
    timeout: Duration,
) -> Result<String, ServeError> {
    let bad = |e: std::io::Error| ServeError::Metrics {
        addr: addr.to_owned(),
        reason: e.to_string(),
    };
    let bound = bind(addr, public)?;
    let local = match &bound {
        Bound::Tcp(l) => l.local_addr().map_err(bad)?.to_string(),
        Bound::Unix(_) => addr.to_owned(),
    };
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(bad)?;
    std::thread::Builder::new()
        .name("orbitkv-metrics".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match Listener::from_bound(bound) {
                    Ok(l) => l,
                    Err(e) => {
                        warn!(error = %e, "metrics endpoint failed");
                        return;
                    }
                };
                let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
                loop {
                    let Ok(permit) = slots.clone().acquire_owned().await else {
                        return;
                    };
                    let registry = registry.clone();
                    match &listener {
                        Listener::Tcp(l) => {
                            let Ok((stream, _)) = l.accept().await else {
                                continue;
                            };
                            let io = TokioIo::new(stream);
                            tokio::spawn(connection(io, registry, timeout, permit));
                        }
                        Listener::Unix(l) => {
                            let Ok((stream, _)) = l.accept().await else {
                                continue;
                            };
                            // Mode 0600 keeps others out; the peer check
                            // holds even if the mode is changed.
                            let peer = stream.peer_cred().map(|c| c.uid());
                            if !matches!(peer, Ok(p) if p == uid || p == 0) {
                                warn!(?peer, "refusing a metrics connection of another uid");
                                continue;
                            }
                            let io = TokioIo::new(stream);
                            tokio::spawn(connection(io, registry, timeout, permit));
                        }
                    }
                }
            });
        })
        .map_err(bad)?;
    info!(%local, "metrics at /metrics");
    Ok(local)
}

/// Serves one connection, at most `timeout` past its last request's
/// start however slowly it reads; its slot is given back at the end.
async fn connection<I>(
    io: I,
    registry: Arc<Registry>,
    timeout: Duration,
    permit: tokio::sync::OwnedSemaphorePermit,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = service_fn(move |req| answer(req, registry.clone()));
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(timeout)
        .keep_alive(true)
        .serve_connection(io, service);
    let _ = tokio::time::timeout(timeout, conn).await;
    drop(permit);
}

enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

impl Listener {
    fn from_bound(b: Bound) -> std::io::Result<Listener> {
        Ok(match b {
            Bound::Tcp(l) => Listener::Tcp(tokio::net::TcpListener::from_std(l)?),
            Bound::Unix(l) => Listener::Unix(tokio::net::UnixListener::from_std(l)?),
        })
    }
}

async fn answer(
    req: Request<Incoming>,
    registry: Arc<Registry>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, body) = if req.uri().path() == "/metrics" {
        let mut text = String::new();
        match prometheus_client::encoding::text::encode(&mut text, &registry) {
            Ok(()) => (StatusCode::OK, text),
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
        }
    } else {
        (
            StatusCode::NOT_FOUND,
            "not found; try /metrics\n".to_owned(),
        )
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
    );
    Ok(resp)
}
