//! The network, one leaf: every HTTP client of the SDK (reqwest), its TLS
//! (rustls with ring, the system's roots) and the WebSocket stream's
//! frames (tokio-tungstenite). Nothing else in the SDK names those crates.

pub(crate) mod client;
pub mod platform;
pub(crate) mod tls;
