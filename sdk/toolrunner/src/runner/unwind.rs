//! Product code (handlers, hooks, the authorizer, input types) runs under
//! `catch_unwind`: a panic there is an answer, never a lost task.
use std::future::Future;

use futures_util::FutureExt;

/// Product code panicked: its panic message (or "a panic").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Panicked(pub(crate) String);

impl std::fmt::Display for Panicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Runs `fut`; a panic comes back as `Err` with its message.
pub(crate) async fn catch<F: Future>(fut: F) -> Result<F::Output, Panicked> {
    std::panic::AssertUnwindSafe(fut)
        .catch_unwind()
        .await
        .map_err(|p| message(&*p))
}

/// [`catch`] for a plain function.
pub(crate) fn catch_sync<T>(f: impl FnOnce() -> T) -> Result<T, Panicked> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| message(&*p))
}

fn message(p: &(dyn std::any::Any + Send)) -> Panicked {
    Panicked(
        p.downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".to_owned()),
    )
}
