//! Private benchmark helpers (`bridge/bench/`): baselines measured in Rust.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;

/// Round trips of `message_bytes`-byte messages over a Unix socket pair
/// between two threads (blocking reads and writes), timed in Rust; seconds
/// each. The floor a socket-based protocol pays, without Python.
#[pyfunction]
#[pyo3(signature = (iterations, message_bytes=16))]
pub fn _uds_roundtrip(
    py: Python<'_>,
    iterations: usize,
    message_bytes: usize,
) -> PyResult<Vec<f64>> {
    py.detach(|| -> std::io::Result<Vec<f64>> {
        let (mut a, mut b) = UnixStream::pair()?;
        let echo = std::thread::spawn(move || -> std::io::Result<()> {
            let mut buf = vec![0u8; message_bytes];
            loop {
                match b.read_exact(&mut buf) {
                    Ok(()) => b.write_all(&buf)?,
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
        });
        let msg = vec![7u8; message_bytes];
        let mut back = vec![0u8; message_bytes];
        let mut times = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            let t = Instant::now();
            a.write_all(&msg)?;
            a.read_exact(&mut back)?;
            times.push(t.elapsed().as_secs_f64());
        }
        drop(a);
        echo.join().expect("echo thread")?;
        Ok(times)
    })
    .map_err(|e| PyOSError::new_err(e.to_string()))
}
