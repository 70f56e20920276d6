use orbitkv_components::api::{CommandError, LimitName};
use orbitkv_ipc::ClientError;

/// Why a verb did not complete.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The manager answered and refused the command: nothing was done.
    /// `reason` is the label `orbitkv_refusals_total{reason}` counts (the
    /// error's kind, the malformation's kind, `limit_<name>`).
    #[error("the OrbitKV manager refused {command} ({reason}): {error}")]
    Refused {
        command: &'static str,
        reason: String,
        error: CommandError,
    },
    /// The manager does not answer (down, restarting, too slow), or the
    /// connection can no longer be trusted (a copy passed its deadline, a
    /// reply never came). The connection must be closed: its copy agent
    /// drains before the engine reuses the memory it was given.
    #[error("the OrbitKV manager is unavailable: {0}")]
    Unavailable(String),
    /// A lookup's answer did not come in time. It held nothing, so the
    /// connection stays: a late answer is dropped by the next lookup.
    #[error("no answer to {command} within {timeout:?}")]
    TimedOut {
        command: &'static str,
        timeout: std::time::Duration,
    },
    /// The manager's inbox was full: nothing was queued; try again later.
    #[error("the OrbitKV manager did not queue {command}: its inbox is full")]
    Busy { command: &'static str },
    /// The caller's input cannot be sent (a hash of a bad length, a batch
    /// too large, an unknown region).
    #[error("{0}")]
    Invalid(String),
}

impl EngineError {
    pub fn refused(command: &'static str, error: CommandError) -> EngineError {
        EngineError::Refused {
            command,
            reason: error.reason(),
            error,
        }
    }

    /// A failure of `command` seen by the connection.
    pub fn client(command: &'static str, e: ClientError) -> EngineError {
        match e {
            ClientError::Command(CommandError::Limit {
                name: LimitName::MaxInbox,
                ..
            }) => EngineError::Busy { command },
            // A quota of the connection, uid or process: refused before
            // it was queued.
            ClientError::Command(error) => EngineError::refused(command, error),
            e => EngineError::Unavailable(format!("{command}: {e}")),
        }
    }

    /// Whether the connection must be given up.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, EngineError::Unavailable(_))
    }
}
