//! What to do when a query fails: run the failed batch again after a pause, or stop.
//!
//! A failure that is expected to pass ([`crate::error::is_transient`]: a server down or
//! restarting, a connection refused or cut, a timeout) does not end the query. The query
//! starts again from its checkpoint in this process, the way a restarted process would: the
//! batch that failed (its `offsets/N` without `commits/N`) runs again with the same id and
//! range, state is loaded again from version N, the sinks and the source are opened again.
//! That is the path every kill test proves exactly-once, so a retry cannot write a row
//! twice. Between attempts the query waits a pause that doubles from
//! [`RetryPolicy::initial`] up to [`RetryPolicy::max`]; listeners hear of each
//! ([`crate::QueryListener::on_query_retrying`]), so `/readyz` says why it is not ready.
//! A failure of any other kind (bad data under FAILFAST, a schema or setting refused,
//! authentication, a corrupt checkpoint), and the last allowed attempt, stop the query as
//! before. The count of attempts starts again once a batch commits.
//!
//! [`decide`] is the whole decision, a pure function with a table test.

use std::time::Duration;

/// How a query meets failures that are expected to pass (`[query] retry` in a pipeline,
/// `DataStreamWriter::retry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Runs of a failing batch in a row, the first included, before the query stops
    /// (1: no retry).
    pub attempts: u32,
    /// The pause after the first failure; each later pause is twice the one before.
    pub initial: Duration,
    /// The longest pause.
    pub max: Duration,
}

impl Default for RetryPolicy {
    /// 10 runs with pauses of 1, 2, 4, ... up to 60 seconds: a server that is back within
    /// about 4 minutes loses the query nothing.
    fn default() -> Self {
        RetryPolicy {
            attempts: 10,
            initial: Duration::from_secs(1),
            max: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// No retry: the first failure stops the query.
    pub fn none() -> Self {
        RetryPolicy {
            attempts: 1,
            ..RetryPolicy::default()
        }
    }

    /// The pause after failed run `failed` (1 for the first failure).
    pub fn pause(&self, failed: u32) -> Duration {
        let doublings = failed.saturating_sub(1).min(32);
        self.initial
            .saturating_mul(1u32 << doublings.min(31))
            .min(self.max)
    }

    /// The policy's own mistakes, named by `key` (`query.retry`).
    pub fn check(&self, key: &str) -> crate::error::Result<()> {
        if self.attempts == 0 {
            return Err(crate::error::Error::config(
                format!("{key}.attempts"),
                "must be at least 1 (1: the first failure stops the query)",
            ));
        }
        if self.initial.is_zero() {
            return Err(crate::error::Error::config(
                format!("{key}.initial"),
                "must be more than 0: without a pause the runs would hammer a server that is down",
            ));
        }
        if self.initial > self.max {
            return Err(crate::error::Error::config(
                format!("{key}.initial"),
                format!(
                    "{} ms is longer than {key}.max ({} ms)",
                    self.initial.as_millis(),
                    self.max.as_millis()
                ),
            ));
        }
        Ok(())
    }
}

/// What the query does after a run of it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Start again from the checkpoint after this pause; this is failure `failed` in a row.
    Retry { pause: Duration, failed: u32 },
    /// Stop with the error.
    Stop,
    /// The query was asked to stop and the failure may pass: end as stopped (the batch
    /// runs again at the next start), as a stop during a pause does.
    Stopped,
}

/// What to do after a failed run. `transient`: whether the error is one that may pass;
/// `failed_before`: failures in a row before this one (since the last commit);
/// `stopping`: whether the query was asked to stop.
pub fn decide(
    policy: &RetryPolicy,
    transient: bool,
    failed_before: u32,
    stopping: bool,
) -> Decision {
    let failed = failed_before.saturating_add(1);
    if transient && stopping {
        return Decision::Stopped;
    }
    if !transient || failed >= policy.attempts {
        return Decision::Stop;
    }
    Decision::Retry {
        pause: policy.pause(failed),
        failed,
    }
}

#[cfg(test)]
mod tests {
    use super::Decision::*;
    use super::*;

    #[test]
    fn each_failure_gets_the_expected_decision() {
        let p = RetryPolicy {
            attempts: 4,
            initial: Duration::from_millis(500),
            max: Duration::from_secs(3),
        };
        let ms = Duration::from_millis;
        // (transient, failed before, stopping) -> decision
        let cases: &[(bool, u32, bool, Decision)] = &[
            // the first transient failure: the initial pause
            (
                true,
                0,
                false,
                Retry {
                    pause: ms(500),
                    failed: 1,
                },
            ),
            // pauses double...
            (
                true,
                1,
                false,
                Retry {
                    pause: ms(1000),
                    failed: 2,
                },
            ),
            (
                true,
                2,
                false,
                Retry {
                    pause: ms(2000),
                    failed: 3,
                },
            ),
            // ...until the attempts are spent: the 4th run failed, no 5th
            (true, 3, false, Stop),
            (true, 10, false, Stop),
            // a permanent error stops at once
            (false, 0, false, Stop),
            // a query asked to stop does not wait for another attempt: it ends as stopped
            // (the batch runs at the next start), unless the error is one to report
            (true, 0, true, Stopped),
            (true, 3, true, Stopped),
            (false, 0, true, Stop),
        ];
        for &(transient, before, stopping, want) in cases {
            assert_eq!(
                decide(&p, transient, before, stopping),
                want,
                "transient {transient}, {before} failed before, stopping {stopping}"
            );
        }
        // The longest pause caps the doubling.
        let long = RetryPolicy { attempts: 100, ..p };
        assert_eq!(
            decide(&long, true, 6, false),
            Retry {
                pause: ms(3000),
                failed: 7
            }
        );
        assert_eq!(long.pause(u32::MAX), ms(3000));
        // No retry at all.
        assert_eq!(decide(&RetryPolicy::none(), true, 0, false), Stop);
    }

    #[test]
    fn the_default_waits_about_four_minutes_in_all() {
        let d = RetryPolicy::default();
        let total: Duration = (1..d.attempts).map(|f| d.pause(f)).sum();
        assert_eq!(
            total,
            Duration::from_secs(1 + 2 + 4 + 8 + 16 + 32 + 60 + 60 + 60)
        );
        assert!(d.check("query.retry").is_ok());
    }

    #[test]
    fn a_policy_that_cannot_work_is_refused_naming_the_key() {
        let zero = RetryPolicy {
            attempts: 0,
            ..RetryPolicy::default()
        };
        let e = zero.check("query.retry").unwrap_err().to_string();
        assert!(e.contains("query.retry.attempts"), "{e}");
        let upside_down = RetryPolicy {
            initial: Duration::from_secs(5),
            max: Duration::from_secs(1),
            ..RetryPolicy::default()
        };
        let no_pause = RetryPolicy {
            initial: Duration::ZERO,
            ..RetryPolicy::default()
        };
        let e = no_pause.check("query.retry").unwrap_err().to_string();
        assert!(
            e.contains("query.retry.initial") && e.contains("more than 0"),
            "{e}"
        );
        let e = upside_down.check("query.retry").unwrap_err().to_string();
        assert!(
            e.contains("query.retry.initial") && e.contains("5000 ms"),
            "{e}"
        );
    }
}
