//! tessera's one retry policy. Every retry of a storage request, a plan request or a peer
//! connection is made here, with the same classification and the same backoff, so that a failure
//! costs a known, bounded time.
//!
//! object_store's own HTTP retry is switched off for the stores [`open`](crate::open) builds
//! (`RetryConfig::max_retries = 0`): its default retries 10 times over up to 3 minutes, and under
//! the loader's own retries that turned one S3 outage into minutes of silence. Each request has a
//! connect timeout and a whole-request timeout instead ([`RetryPolicy::client_options`]), and the
//! callers that retry (the read scheduler, the plan client, the TCP connect) do it with
//! [`RetryPolicy::backoff`].
//!
//! The bound: a request that keeps failing fast (connection refused, 503) is given up after
//! `max_attempts` tries and about `first_backoff · (2^(max_attempts-1) − 1)` of waiting (300 ms
//! with the defaults; backon's jitter adds up to as much again); one that stalls is cut after `read_timeout` of silence, or at `request_timeout` per attempt.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use object_store::{ClientConfigKey, ClientOptions, RetryConfig};

/// How often and how patiently tessera retries transient failures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per request before a transient error is given up on (5): enough to ride out a
    /// reset connection or a burst of 503s, few enough that a real outage fails a load within a
    /// second instead of hanging every rank. 0 counts as 1.
    pub max_attempts: u32,
    /// Wait before the first retry (20 ms), doubled for every further retry with jitter, so that
    /// thousands of ranks that failed together do not retry in lockstep.
    pub first_backoff: Duration,
    /// The longest single wait (5 s): waiting longer only delays the job's own failure handling.
    pub max_backoff: Duration,
    /// Connecting to a store (5 s).
    pub connect_timeout: Duration,
    /// Silence within a response (10 s): a server that stops sending mid-body is cut this long
    /// after its last byte, and the request counts as a transient failure.
    pub read_timeout: Duration,
    /// One whole request, body included (60 s): a 16 MiB part at 1 MB/s still fits, a server that
    /// stops sending mid-body does not hold a rank for ever.
    pub request_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            first_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// Exponential backoff with jitter for `backon::Retryable::retry`: at most
    /// `max_attempts - 1` retries.
    pub fn backoff(&self) -> ExponentialBuilder {
        ExponentialBuilder::default()
            .with_min_delay(self.first_backoff)
            .with_max_delay(self.max_backoff)
            .with_factor(2.0)
            .with_jitter()
            .with_max_times(self.max_attempts.max(1) as usize - 1)
    }

    /// The waits before each retry, jittered, as [`Self::backoff`] makes them: for a loop that
    /// retries by hand (a whole file rather than one request).
    pub fn waits(&self) -> impl Iterator<Item = Duration> + Send + use<> {
        self.backoff().build()
    }

    /// The waits before each retry without jitter: what the documentation's bound adds up.
    pub fn total_backoff(&self) -> Duration {
        let mut total = Duration::ZERO;
        let mut wait = self.first_backoff;
        for _ in 1..self.max_attempts.max(1) {
            total += wait.min(self.max_backoff);
            wait = wait.saturating_mul(2);
        }
        total
    }

    /// The timeouts above as object_store client configuration keys: the one list both
    /// [`client_options`](Self::client_options) and the builders configured by key (S3, GCS,
    /// Azure, whose environment may already have set other client keys) apply.
    pub fn client_config(&self) -> [(ClientConfigKey, String); 3] {
        let millis = |d: Duration| format!("{}ms", d.as_millis());
        [
            (
                ClientConfigKey::ConnectTimeout,
                millis(self.connect_timeout),
            ),
            (ClientConfigKey::ReadTimeout, millis(self.read_timeout)),
            (ClientConfigKey::Timeout, millis(self.request_timeout)),
        ]
    }

    /// HTTP client settings of the cloud stores: the timeouts above.
    pub fn client_options(&self) -> ClientOptions {
        self.client_config()
            .into_iter()
            .fold(ClientOptions::new(), |options, (key, value)| {
                options.with_config(key, value)
            })
    }

    /// object_store's own retry: off (see the module documentation).
    pub fn object_store_retry(&self) -> RetryConfig {
        RetryConfig {
            max_retries: 0,
            retry_timeout: self.request_timeout,
            ..RetryConfig::default()
        }
    }
}

/// Whether another attempt may cure `error`. object_store reports network errors, timeouts and 5xx
/// answers as `Generic`; a missing object, a failed precondition, refused credentials or an
/// unsupported request stay what they are on every attempt.
pub fn is_transient(error: &object_store::Error) -> bool {
    matches!(error, object_store::Error::Generic { .. })
}

/// Whether `error` is a request that timed out: a server that stopped sending for the read
/// timeout (mid-body or before its headers), a connect that took the connect timeout, or a
/// request past its whole-request timeout. Such errors are transient, and their own message
/// ("request or response body error") does not say it; callers add it to theirs, since "timed
/// out" is what tells an operator the store stalled rather than refused.
pub fn is_timeout(error: &object_store::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(err) = source {
        if let Some(e) = err.downcast_ref::<reqwest::Error>()
            && e.is_timeout()
        {
            return true;
        }
        if let Some(e) = err.downcast_ref::<std::io::Error>()
            && e.kind() == std::io::ErrorKind::TimedOut
        {
            return true;
        }
        source = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_bound_is_under_a_second() {
        let policy = RetryPolicy::default();
        assert_eq!(
            policy.total_backoff(),
            Duration::from_millis(20 + 40 + 80 + 160)
        );
    }

    #[test]
    fn one_attempt_means_no_retry() {
        let policy = RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        };
        assert_eq!(policy.total_backoff(), Duration::ZERO);
    }

    #[test]
    fn transient_is_generic_only() {
        let generic = object_store::Error::Generic {
            store: "S3",
            source: "503".into(),
        };
        let missing = object_store::Error::NotFound {
            path: "a".into(),
            source: "404".into(),
        };
        assert!(is_transient(&generic));
        assert!(!is_transient(&missing));
        assert!(!is_timeout(&generic));
        let timed_out = object_store::Error::Generic {
            store: "HTTP",
            source: Box::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no data for 10 s",
            )),
        };
        assert!(is_timeout(&timed_out));
    }
}
