//! TLS through rustls with the ring provider (no OpenSSL, no aws-lc),
//! configured for each client: the SDK never installs a process-wide
//! provider behind the application's back.
use std::sync::Arc;

/// The rustls configuration of one HTTP client: ring, the platform's
/// certificate verifier (the operating system's roots), safe protocol
/// versions.
pub(crate) fn client_config() -> Result<rustls::ClientConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls_platform_verifier::Verifier::new(provider.clone())
        .map_err(|e| format!("cannot load the system's certificate roots: {e}"))?;
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("cannot configure TLS: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth())
}

/// Whether `url` names this machine (`localhost`, `127.0.0.0/8`, `::1`).
pub(crate) fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The start of every HTTP client of the SDK (the executor's and
/// [`Platform`](crate::platform::Platform)): TLS of its own, and no proxy
/// between a process and its own machine when `base_url` is on it. Each
/// client adds its timeouts.
pub(crate) fn http_builder(base_url: &str) -> Result<reqwest::ClientBuilder, String> {
    let builder = reqwest::Client::builder().tls_backend_preconfigured(client_config()?);
    let host = base_url
        .split_once("://")
        .map_or("", |(_, rest)| rest.split(['/', ':']).next().unwrap_or(""));
    Ok(if is_loopback(host) {
        builder.no_proxy()
    } else {
        builder
    })
}
