//! The `/metrics` endpoint: hyper on a single-threaded tokio runtime in its
//! own thread. Every connection is a task, so idle or slow connections cost
//! a little memory and never delay a scrape; each must send its request
//! headers within the timeout, and is closed after the timeout either way.
//! At most `max_connections` are served at once; more wait in the listen
//! backlog.

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

/// Binds `addr` now (so a bad address fails the start) and serves on a
/// side thread until the process exits.
pub fn serve(
    addr: &str,
    registry: Arc<Registry>,
    max_connections: usize,
    timeout: Duration,
) -> Result<std::net::SocketAddr, ServeError> {
    let bad = |e: std::io::Error| ServeError::Metrics {
        addr: addr.to_owned(),
        reason: e.to_string(),
    };
    let std_listener = std::net::TcpListener::bind(addr).map_err(bad)?;
    std_listener.set_nonblocking(true).map_err(bad)?;
    let local = std_listener.local_addr().map_err(bad)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(bad)?;
    std::thread::Builder::new()
        .name("orbitkv-metrics".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(std_listener) {
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
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    let registry = registry.clone();
                    tokio::spawn(async move {
                        let service = service_fn(move |req| answer(req, registry.clone()));
                        let conn = http1::Builder::new()
                            .timer(TokioTimer::new())
                            .header_read_timeout(timeout)
                            .keep_alive(true)
                            .serve_connection(TokioIo::new(stream), service);
                        // A connection lives at most `timeout` past its
                        // last request's start, however slowly it reads.
                        let _ = tokio::time::timeout(timeout, conn).await;
                        drop(permit);
                    });
                }
            });
        })
        .map_err(bad)?;
    info!(%local, "metrics at /metrics");
    Ok(local)
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
