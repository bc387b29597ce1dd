//! TLS through rustls with the ring provider (no OpenSSL, no aws-lc).

/// Installs ring as the process-wide rustls provider, once. Harmless if the
/// application installed one already.
pub(crate) fn install_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
