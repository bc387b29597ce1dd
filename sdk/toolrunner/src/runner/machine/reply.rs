//! The platform's reply to one request, as the machine reads it (the
//! driver turns the client's result into one: `runner/answers.rs`).

/// What came back for a request, after the client's own retries.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Reply<T> {
    /// A `2xx` answer.
    Answered(T),
    /// An error envelope: its HTTP status, its code and its message.
    Refused {
        /// The HTTP status.
        status: u16,
        /// The envelope's `code`.
        code: String,
        /// The envelope's `message`, and what the executor adds.
        message: String,
    },
    /// No usable answer after the retries (network, `5xx`, `429`,
    /// timeouts): what was seen last.
    Unreachable(String),
    /// Not sent: right before it went out, the executor's lease was not
    /// live.
    NotSent,
}

impl<T> Reply<T> {
    /// A refusal with `status` and `code`.
    #[cfg(test)]
    pub(crate) fn refused(status: u16, code: &str) -> Reply<T> {
        Reply::Refused {
            status,
            code: code.to_owned(),
            message: format!("{status} {code}"),
        }
    }

    /// A refusal that says the credentials are wrong (`401`, or `403
    /// missing_scope`): not a verdict on the call.
    pub(crate) fn is_configuration(&self) -> bool {
        matches!(self, Reply::Refused { status, code, .. } if *status == 401 || code == "missing_scope")
    }

    /// No verdict came back (unreachable, or not sent).
    pub(crate) fn is_silence(&self) -> bool {
        matches!(self, Reply::Unreachable(_) | Reply::NotSent)
    }

    /// What a silence or a refusal says, for the log and the timeline.
    pub(crate) fn said(&self) -> String {
        match self {
            Reply::Answered(_) => "answered".to_owned(),
            Reply::Refused { message, .. } => message.clone(),
            Reply::Unreachable(m) => format!("platform unreachable: {m}"),
            Reply::NotSent => {
                "not sent, the executor's lease is not live (it could not be renewed)".to_owned()
            }
        }
    }
}
