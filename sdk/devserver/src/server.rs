//! Starting and stopping the development platform.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{Mutex, broadcast, watch};
use tokio::task::JoinSet;

use crate::engine::Limits;
use crate::http::auth::{Grants, parse_token_spec};
use crate::http::faults::{FaultState, Faults};
use crate::http::faults::{ReceivedConnect, ReceivedReceipt};
use crate::http::shared::{Engine, Shared};
use crate::store::Store;

/// Why the platform could not start, or could not do what a test asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is wrong (a token spec, a fault rate, a zero TTL).
    #[error("invalid setting: {0}")]
    Config(String),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The database could not be opened, migrated or read.
    #[error("cannot open the platform database: {0}")]
    Store(String),
    /// [`DevServer::forget_run`] failed: the run is unknown, or the change
    /// could not be stored.
    #[error("cannot forget the run: {0}")]
    Forget(String),
}

/// Builds a [`DevServer`]. Every setting has the default of
/// `toolrunner devserver`. Its `Debug` does not show the tokens.
#[must_use]
#[derive(Clone)]
pub struct DevServerBuilder {
    listen: SocketAddr,
    db: Option<PathBuf>,
    tokens: Vec<String>,
    lease_ttl_ms: u64,
    heartbeat_interval_ms: u64,
    run_ttl_ms: u64,
    faults: Faults,
    stream: bool,
    record_receipts: bool,
    record_connects: bool,
}

toolrunner_protocol::debug_without_payloads!(DevServerBuilder { listen, db, lease_ttl_ms, heartbeat_interval_ms, run_ttl_ms, faults, stream, record_receipts, record_connects } hiding { tokens });

impl Default for DevServerBuilder {
    fn default() -> Self {
        DevServerBuilder {
            listen: SocketAddr::from(([127, 0, 0, 1], 8700)),
            db: None,
            tokens: Vec::new(),
            lease_ttl_ms: 15_000,
            heartbeat_interval_ms: 5_000,
            run_ttl_ms: 0,
            faults: Faults::default(),
            stream: true,
            record_receipts: false,
            record_connects: false,
        }
    }
}

/// The tokens used when none is given.
pub const DEFAULT_TOKENS: [&str; 2] = [
    "dev-admin=*",
    "dev-executor=executors:connect,tools:execute",
];

impl DevServerBuilder {
    /// Address to listen on (port 0 picks a free port). Default `127.0.0.1:8700`.
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = addr;
        self
    }

    /// Keeps all state in this SQLite file across restarts (default: memory).
    pub fn db_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.db = Some(path.into());
        self
    }

    /// Adds a token with comma-separated scopes, `*` for all. Giving any
    /// token replaces the defaults [`DEFAULT_TOKENS`].
    pub fn token(mut self, token: &str, scopes: &str) -> Self {
        self.tokens.push(format!("{token}={scopes}"));
        self
    }

    /// Adds a token as `TOKEN=SCOPES`, the form of the `--token` flag.
    pub fn token_spec(mut self, spec: &str) -> Self {
        self.tokens.push(spec.to_owned());
        self
    }

    /// Executor lease time to live. Default 15 000.
    pub fn lease_ttl_ms(mut self, ms: u64) -> Self {
        self.lease_ttl_ms = ms;
        self
    }

    /// Advised heartbeat interval. Default 5 000.
    pub fn heartbeat_interval_ms(mut self, ms: u64) -> Self {
        self.heartbeat_interval_ms = ms;
        self
    }

    /// A run with no call change for this long expires; 0 (default) never.
    pub fn run_ttl_ms(mut self, ms: u64) -> Self {
        self.run_ttl_ms = ms;
        self
    }

    /// Fault injection on executor endpoints. Default none.
    pub fn faults(mut self, faults: Faults) -> Self {
        self.faults = faults;
        self
    }

    /// Serves no WebSocket stream (the path answers `404`), to test
    /// executors that must work by polling alone. Default: served.
    pub fn without_stream(mut self) -> Self {
        self.stream = false;
        self
    }

    /// Keeps every receipt request body that reaches the platform, also
    /// those then refused or answered with an injected fault, for
    /// [`DevServer::received_receipts`] (tests that check an executor
    /// never sends one receipt id with two bodies). Default off.
    pub fn record_receipts(mut self) -> Self {
        self.record_receipts = true;
        self
    }

    /// Keeps every connect request that reaches the platform (its
    /// executor and instance ids), also those then refused or answered
    /// with an injected fault, for [`DevServer::received_connects`] (tests
    /// that check a fenced process never connects). Default off.
    pub fn record_connects(mut self) -> Self {
        self.record_connects = true;
        self
    }

    /// Opens the database, binds the address and starts serving.
    ///
    /// # Errors
    /// A bad token spec or fault setting, a zero lease or heartbeat, an
    /// address that cannot be bound, or a database that cannot be opened.
    pub async fn start(self) -> Result<DevServer, Error> {
        let tokens = self.parse_tokens()?;
        self.faults.check().map_err(Error::Config)?;
        if self.lease_ttl_ms == 0 || self.heartbeat_interval_ms == 0 {
            return Err(Error::Config(
                "lease_ttl_ms and heartbeat_interval_ms must be above 0".into(),
            ));
        }
        let mut store = Store::open(self.db.as_deref())
            .await
            .map_err(|e| Error::Store(e.to_string()))?;
        let state = store
            .load()
            .await
            .map_err(|e| Error::Store(e.to_string()))?;
        let listener = TcpListener::bind(self.listen)
            .await
            .map_err(|source| Error::Bind {
                addr: self.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| Error::Bind {
            addr: self.listen,
            source,
        })?;
        let (shutdown, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            engine: Arc::new(Mutex::new(Engine { state, store })),
            limits: Limits {
                lease_ttl_ms: self.lease_ttl_ms,
                heartbeat_interval_ms: self.heartbeat_interval_ms,
                run_ttl_ms: self.run_ttl_ms,
            },
            tokens: Arc::new(tokens),
            faults: StdMutex::new(FaultState::new(self.faults)),
            notices: broadcast::channel(4096).0,
            shutdown,
            clock_offset_ms: std::sync::atomic::AtomicI64::new(0),
            receipt_log: self.record_receipts.then(|| StdMutex::new(Vec::new())),
            connect_log: self.record_connects.then(|| StdMutex::new(Vec::new())),
        });
        let mut tasks = JoinSet::new();
        tasks.spawn(crate::http::serve::accept_loop(
            listener,
            shared.clone(),
            self.stream,
        ));
        tasks.spawn(sweeper(shared.clone()));
        tracing::info!(%addr, "development platform started");
        Ok(DevServer {
            addr,
            shared,
            tasks,
        })
    }

    fn parse_tokens(&self) -> Result<HashMap<String, Grants>, Error> {
        let specs: Vec<String> = if self.tokens.is_empty() {
            DEFAULT_TOKENS.iter().map(|s| (*s).to_owned()).collect()
        } else {
            self.tokens.clone()
        };
        specs
            .iter()
            .map(|s| parse_token_spec(s).map_err(Error::Config))
            .collect()
    }
}

/// A running development platform.
pub struct DevServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    tasks: JoinSet<()>,
}

impl std::fmt::Debug for DevServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl DevServer {
    /// A builder with the defaults of `toolrunner devserver`.
    pub fn builder() -> DevServerBuilder {
        DevServerBuilder::default()
    }

    /// `http://HOST:PORT`, without a trailing slash; paths are under `/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Moves the platform's clock forward by `by`: leases and run TTLs lapse
    /// as if that much time had passed (tests: "the lease expired while the
    /// executor was down" without waiting for it).
    pub fn advance_clock(&self, by: Duration) {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.shared
            .clock_offset_ms
            .fetch_add(ms, std::sync::atomic::Ordering::SeqCst);
    }

    /// Forgets run `run_id`, its calls and their assignments, as a platform
    /// whose own retention deleted them: from then on every path that names
    /// the run answers `404` (tests: "the platform no longer knows the
    /// run", which leaves an executor's call `orphaned`).
    ///
    /// # Errors
    /// The run is unknown, or the change could not be stored.
    pub async fn forget_run(&self, run_id: &str) -> Result<(), Error> {
        self.shared
            .apply(|s, _| s.forget_run(run_id))
            .await
            .map_err(|e| Error::Forget(e.to_string()))
    }

    /// Every receipt request that reached the platform, in arrival order,
    /// when [`DevServerBuilder::record_receipts`] is on (empty otherwise).
    pub fn received_receipts(&self) -> Vec<ReceivedReceipt> {
        self.shared
            .receipt_log
            .as_ref()
            .map(|log| log.lock().map(|l| l.clone()).unwrap_or_default())
            .unwrap_or_default()
    }

    /// Every connect request that reached the platform, in arrival order,
    /// when [`DevServerBuilder::record_connects`] is on (empty otherwise).
    pub fn received_connects(&self) -> Vec<ReceivedConnect> {
        self.shared
            .connect_log
            .as_ref()
            .map(|log| log.lock().map(|l| l.clone()).unwrap_or_default())
            .unwrap_or_default()
    }

    /// Stops accepting, lets open requests finish (up to 5 s), closes streams
    /// and the database.
    pub async fn shutdown(mut self) {
        let _ = self.shared.shutdown.send(true);
        let drained = tokio::time::timeout(Duration::from_secs(5), async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            self.tasks.abort_all();
        }
        self.shared.engine.lock().await.store.close().await;
    }

    /// Runs until `signal` completes, then shuts down.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) {
        signal.await;
        self.shutdown().await;
    }
}

async fn sweeper(shared: Arc<Shared>) {
    let period = (shared.limits.lease_ttl_ms / 4).clamp(10, 250);
    let mut tick = tokio::time::interval(Duration::from_millis(period));
    let mut stop = shared.shutdown.subscribe();
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = tick.tick() => {
                let _ = shared.apply(|_, _| Ok::<_, toolrunner_protocol::ApiError>(())).await;
            }
        }
    }
}
