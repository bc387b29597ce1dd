//! The server loop: a hyper accept loop (so that an injected fault can
//! close a connection without answering) serving the platform's router.
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tower::ServiceExt;

use super::faults::DropConnection;
use super::shared::Shared;

/// The connection failed on purpose: fault injection dropped the answer.
#[derive(Debug, thiserror::Error)]
#[error("response dropped by fault injection")]
struct Dropped;

pub(crate) async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stream: bool) {
    let router = super::router(shared.clone(), stream);
    let mut stop = shared.shutdown.subscribe();
    let mut conns = JoinSet::new();
    loop {
        let (stream, _) = tokio::select! {
            _ = stop.changed() => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let router = router.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let router = router.clone();
            async move {
                let response = router.oneshot(req.map(axum::body::Body::new)).await;
                let response: axum::response::Response = match response {
                    Ok(r) => r,
                    Err(e) => match e {},
                };
                if response.extensions().get::<DropConnection>().is_some() {
                    return Err(Dropped);
                }
                Ok::<_, Dropped>(response)
            }
        });
        let mut stop = shared.shutdown.subscribe();
        conns.spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                _ = &mut conn => {}
                _ = stop.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
        while conns.try_join_next().is_some() {}
    }
    while conns.join_next().await.is_some() {}
}

/// Never constructed; keeps `Infallible` in scope for the match above.
#[allow(dead_code)]
fn _infallible(x: Infallible) -> ! {
    match x {}
}
