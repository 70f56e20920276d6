//! The `/metrics` endpoint, and routers' `POST /lookup` (JSON; answered
//! by the event loop through [`crate::lookups`]): hyper on a single-threaded tokio runtime in its
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

use http_body_util::{BodyExt as _, Full, LengthLimitError, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tracing::{info, warn};

use crate::ServeError;
use crate::lookups::{Door, Turned};
use orbitkv_components::admin::LookupRequest;

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
    door: Door,
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
                    let door = door.clone();
                    match &listener {
                        Listener::Tcp(l) => {
                            let Ok((stream, _)) = l.accept().await else {
                                continue;
                            };
                            let io = TokioIo::new(stream);
                            tokio::spawn(connection(io, registry, door, timeout, permit));
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
                            tokio::spawn(connection(io, registry, door, timeout, permit));
                        }
                    }
                }
            });
        })
        .map_err(bad)?;
    info!(%local, "metrics at /metrics, lookups at POST /lookup");
    Ok(local)
}

/// Serves one connection, at most `timeout` past its last request's
/// start however slowly it reads; its slot is given back at the end.
async fn connection<I>(
    io: I,
    registry: Arc<Registry>,
    door: Door,
    timeout: Duration,
    permit: tokio::sync::OwnedSemaphorePermit,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = service_fn(move |req| answer(req, registry.clone(), door.clone(), timeout));
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
    door: Door,
    timeout: Duration,
) -> Result<Response<Full<Bytes>>, Infallible> {
    const METRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    const JSON: &str = "application/json";
    let (status, body, kind) = match req.uri().path() {
        "/metrics" => {
            let mut text = String::new();
            match prometheus_client::encoding::text::encode(&mut text, &registry) {
                Ok(()) => (StatusCode::OK, text, METRICS),
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n"), METRICS),
            }
        }
        "/lookup" if req.method() == Method::POST => {
            let (status, body) = lookup(req, &door, timeout).await;
            (status, body, JSON)
        }
        "/lookup" => (
            StatusCode::METHOD_NOT_ALLOWED,
            error_json("POST a JSON lookup request (docs/events.md)"),
            JSON,
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "not found; try /metrics, or POST /lookup\n".to_owned(),
            METRICS,
        ),
    };
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(kind),
    );
    Ok(resp)
}

/// `{"error": why}`.
fn error_json(why: &str) -> String {
    serde_json::json!({ "error": why }).to_string()
}

/// A router's lookup: the body (at most `lookup_max_body_bytes`) is a
/// `LookupRequest`; the loop answers it within `timeout`.
async fn lookup(req: Request<Incoming>, door: &Door, timeout: Duration) -> (StatusCode, String) {
    // Bodies are read a few at a time: memory stays bounded whatever
    // number of connections send one.
    let Ok(_reading) = door.reading.clone().try_acquire_owned() else {
        door.count("busy");
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            error_json("too many lookups are being read; try again"),
        );
    };
    let body = match Limited::new(req.into_body(), door.max_body_bytes)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            door.count("too_large");
            let why = format!(
                "the body is over [serve] lookup_max_body_bytes = {}",
                door.max_body_bytes
            );
            return (StatusCode::PAYLOAD_TOO_LARGE, error_json(&why));
        }
        Err(e) => {
            door.count("bad_request");
            return (StatusCode::BAD_REQUEST, error_json(&e.to_string()));
        }
    };
    let request: LookupRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            door.count("bad_request");
            return (StatusCode::BAD_REQUEST, error_json(&e.to_string()));
        }
    };
    let answer = match door.ask(request) {
        Ok(a) => a,
        Err(turned) => {
            let (outcome, status, why) = match turned {
                Turned::Rate => (
                    "rate_limited",
                    StatusCode::TOO_MANY_REQUESTS,
                    "past [serve] lookup_per_second",
                ),
                Turned::Busy => (
                    "busy",
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too many lookups wait for the manager",
                ),
                Turned::Closed => (
                    "busy",
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the manager is shutting down",
                ),
            };
            door.count(outcome);
            return (status, error_json(why));
        }
    };
    match tokio::time::timeout(timeout, answer).await {
        Ok(Ok(reply)) => {
            let status = if reply.error.is_some() {
                StatusCode::BAD_REQUEST
            } else {
                StatusCode::OK
            };
            match serde_json::to_string(&reply) {
                Ok(text) => (status, text),
                Err(e) => (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    error_json(&e.to_string()),
                ),
            }
        }
        Ok(Err(_)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            error_json("the manager is shutting down"),
        ),
        Err(_) => {
            door.count("timeout");
            (
                StatusCode::GATEWAY_TIMEOUT,
                error_json("the manager did not answer within [serve] metrics_timeout_ms"),
            )
        }
    }
}
