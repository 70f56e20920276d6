use std::time::{Duration, Instant};

/// When a connection may be tried again: at most once per `interval` after
/// a failure, so a manager that is down costs callers one failed connect
/// per interval, not one per call. It keeps the last failure so the calls
/// in between report it (a refusal stays a refusal).
#[derive(Debug)]
pub struct Backoff {
    interval: Duration,
    retry_at: Option<Instant>,
    /// Failures since the last success.
    pub failures: u64,
}

impl Backoff {
    pub fn new(interval: Duration) -> Backoff {
        Backoff {
            interval,
            retry_at: None,
            failures: 0,
        }
    }

    /// Whether an attempt may be made now; if so, the next one waits for
    /// the interval unless [`Backoff::succeeded`] is called.
    pub fn attempt(&mut self, now: Instant) -> bool {
        if self.retry_at.is_some_and(|t| now < t) {
            return false;
        }
        self.retry_at = Some(now + self.interval);
        true
    }

    pub fn failed(&mut self) {
        self.failures += 1;
    }

    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.retry_at = None;
    }

    /// The wait after a failure.
    pub fn interval(&self) -> Duration {
        self.interval
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_attempt_per_interval_after_a_failure_and_none_after_a_success() {
        let mut b = Backoff::new(Duration::from_secs(5));
        let t0 = Instant::now();
        assert!(b.attempt(t0));
        b.failed();
        assert!(!b.attempt(t0 + Duration::from_secs(4)));
        assert!(b.attempt(t0 + Duration::from_secs(5)));
        b.failed();
        assert_eq!(b.failures, 2);
        b.succeeded();
        assert_eq!(b.failures, 0);
        assert!(b.attempt(t0 + Duration::from_secs(5)));
    }
}
