//! A minimal HTTP/1.1 reverse proxy in front of the development platform,
//! whose rule decides each request's fate: passed through, answered late,
//! refused `503` as by a platform that is down, or refused `401` as by a
//! platform that no longer accepts the token. No WebSocket: executors
//! behind it run with the stream off. Shared by `examples/bench.rs` (an
//! outage of receipts), `tests/crash.rs` (a slow answer) and the
//! PostgreSQL suite's replicas (a token revoked for one identity).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use toolrunner::platform::Platform;

/// What the proxy does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Passed through as it came.
    Forward,
    /// Passed through; its answer held back this long after the platform
    /// has done the work (as after a slow network).
    ForwardThenWait(Duration),
    /// Not passed on: answered `503` (the platform is down).
    Refuse,
    /// Not passed on: answered `401` (the token is no longer accepted).
    Unauthorized,
}

/// A request as the rule sees it: method, path, body.
pub(crate) type Rule = dyn Fn(&str, &str, &[u8]) -> Verdict + Send + Sync;

/// Starts the proxy in front of `upstream`; returns its base URL.
///
/// # Panics
/// If it cannot listen on loopback or build its client.
pub(crate) async fn start(
    upstream: &str,
    rule: impl Fn(&str, &str, &[u8]) -> Verdict + Send + Sync + 'static,
) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("proxy binds");
    let addr = listener.local_addr().expect("proxy address");
    let http = Platform::new(upstream, "").expect("platform client");
    let rule: Arc<Rule> = Arc::new(rule);
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let _ = sock.set_nodelay(true);
            tokio::spawn(connection(sock, http.clone(), rule.clone()));
        }
    });
    format!("http://{addr}")
}

async fn connection(sock: tokio::net::TcpStream, http: Platform, rule: Arc<Rule>) {
    let mut conn = tokio::io::BufReader::new(sock);
    loop {
        let mut line = String::new();
        if conn.read_line(&mut line).await.unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (Some(method), Some(path)) = (parts.next(), parts.next()) else {
            return;
        };
        let (method, path) = (method.to_owned(), path.to_owned());
        let mut headers = Vec::new();
        let mut length = 0usize;
        loop {
            let mut h = String::new();
            if conn.read_line(&mut h).await.unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                let (k, v) = (k.trim(), v.trim());
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.parse().unwrap_or(0);
                } else if !["host", "connection"]
                    .iter()
                    .any(|x| k.eq_ignore_ascii_case(x))
                {
                    headers.push((k.to_owned(), v.to_owned()));
                }
            }
        }
        let mut body = vec![0; length];
        if conn.read_exact(&mut body).await.is_err() {
            return;
        }
        let verdict = rule(&method, &path, &body);
        let (status, answer_headers, bytes) = if verdict == Verdict::Refuse {
            let refusal = br#"{"error":{"type":"api_error","code":"unavailable","message":"the platform is down (proxy outage)"}}"#;
            let headers = vec![("content-type".to_owned(), "application/json".to_owned())];
            (
                reqwest::StatusCode::SERVICE_UNAVAILABLE,
                headers,
                refusal.to_vec(),
            )
        } else if verdict == Verdict::Unauthorized {
            let refusal = br#"{"error":{"type":"authentication_error","code":"invalid_token","message":"the token is not accepted (revoked at the proxy)"}}"#;
            let headers = vec![("content-type".to_owned(), "application/json".to_owned())];
            (reqwest::StatusCode::UNAUTHORIZED, headers, refusal.to_vec())
        } else {
            let Some(method) = toolrunner::platform::Method::parse(method.as_str()) else {
                return;
            };
            // Forwarded as it came: its own token and headers, through the
            // typed client's raw requests.
            let mut req = http.request_to(method, &path).token(None).body(body);
            for (k, v) in &headers {
                req = req.header(k.as_str(), v.as_str());
            }
            let Ok(resp) = req.send().await else {
                return;
            };
            let status = reqwest::StatusCode::from_u16(resp.status)
                .unwrap_or(reqwest::StatusCode::BAD_GATEWAY);
            (status, resp.headers.clone(), resp.body)
        };
        if let Verdict::ForwardThenWait(delay) = verdict {
            tokio::time::sleep(delay).await;
        }
        let mut head = format!(
            "HTTP/1.1 {} {}\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        );
        for (k, v) in &answer_headers {
            if ["content-length", "connection", "transfer-encoding"].contains(&k.as_str()) {
                continue;
            }
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("content-length: {}\r\n\r\n", bytes.len()));
        // One write: a head and a body written apart would wait for the
        // peer's delayed acknowledgement (Nagle), 40 ms an answer.
        let mut answer = head.into_bytes();
        answer.extend_from_slice(&bytes);
        if conn.get_mut().write_all(&answer).await.is_err() {
            return;
        }
    }
}
