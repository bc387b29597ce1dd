//! What an executor is before it starts: its settings and tools, checked
//! by the builder. The runner starts it (and builds its `Core`); replicas
//! start adopted identities from it, under another executor id.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use toolrunner_protocol::tooldef::ToolDefinition;

use crate::api::authorizer::Authorizer;
use crate::api::handler::Tools;
use crate::error::Result;
#[cfg(feature = "postgres")]
use crate::error::{Error, Kind};
use crate::gate::Gate;
#[cfg(feature = "postgres")]
use crate::gate::{self, Reach};
use crate::health::HealthState;
use crate::net::client::Client;
use crate::store::approvals::ApprovalBook;
use crate::store::{SqliteStore, Store};

use super::fenced::FencedStore;
use super::lease::{Lease, Sole};
use super::life::Life;
use super::{Calls, Config, Core, CrashPlan, Link, RunningExecutor};

/// An executor's settings and tools, checked and not yet started.
pub(crate) struct Template {
    pub(crate) cfg: Config,
    pub(crate) client: Client,
    pub(crate) store_url: String,
    pub(crate) tools: Tools,
    /// The limited tools' slots, one set for the process: shared by the
    /// identities it adopts.
    pub(crate) flow: Arc<super::flow::Flow>,
    pub(crate) authorizer: Arc<dyn Authorizer>,
    pub(crate) definitions: Vec<ToolDefinition>,
    pub(crate) crash_plan: Option<CrashPlan>,
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) takeover_grace: Option<Duration>,
    /// A test's faults of this process.
    pub(crate) gate: Option<Arc<Gate>>,
    /// The health its running executor keeps up to date.
    pub(crate) health: Arc<HealthState>,
}

impl Template {
    /// Opens the store, connects, resumes what the store and the platform
    /// still hold, and starts claiming.
    ///
    /// # Errors
    /// The store cannot be opened, or the platform refuses the connect.
    pub(crate) async fn start(self) -> Result<RunningExecutor> {
        if crate::store::is_postgres(&self.store_url) {
            return self.start_replica().await;
        }
        // One process per store file: taken before the store is touched.
        let lock = SqliteStore::lock(&self.store_url)?;
        let store = SqliteStore::open(&self.store_url).await?;
        let approvals: Arc<dyn ApprovalBook> = Arc::new(store.approvals());
        self.start_locked(Arc::new(store), lock, Arc::new(Sole), Some(approvals))
            .await
    }

    /// Like [`start`](Self::start) with a store of your own. No lock is
    /// taken: never let two executor processes drive one store (for a
    /// [`SqliteStore`], hold [`SqliteStore::lock`] for as long as the
    /// executor runs).
    ///
    /// # Errors
    /// The platform refuses the connect.
    #[cfg(feature = "testing")]
    pub(crate) async fn start_with_store(self, store: Arc<dyn Store>) -> Result<RunningExecutor> {
        self.start_locked(store, None, Arc::new(Sole), None).await
    }

    /// Starts on a PostgreSQL store as this executor's identity: its lease
    /// is taken (with a new fencing token) before anything is sent.
    #[cfg(feature = "postgres")]
    async fn start_replica(self) -> Result<RunningExecutor> {
        gate::before(self.gate.as_deref(), Reach::Store)
            .await
            .map_err(|e| Error::new(Kind::Store, e))?;
        let store = crate::store::PgStore::open_identity(
            &self.store_url,
            &self.cfg.executor_id,
            &self.cfg.binding_id,
            &self.cfg.instance_id,
            self.cfg.lease_ttl,
            self.longest_commit_window(),
        )
        .await?;
        // The tools' limits count every replica of the database.
        self.flow.share(Arc::new(store.shared_flow().await?));
        let template = self
            .takeover_grace
            .is_some()
            .then(|| Box::new(self.template()) as Box<dyn super::replicas::Adopter>);
        let replica = super::replicas::Replica::new(
            store.clone(),
            self.takeover_grace,
            template,
            self.gate.clone(),
        );
        let approvals: Arc<dyn ApprovalBook> = Arc::new(store.approvals());
        self.start_locked(Arc::new(store), None, Arc::new(replica), Some(approvals))
            .await
    }

    #[cfg(not(feature = "postgres"))]
    async fn start_replica(self) -> Result<RunningExecutor> {
        let store = crate::store::open(&self.store_url).await?;
        self.start_locked(store, None, Arc::new(Sole), None).await
    }

    /// The longest commit window of this executor's tools: how long after
    /// a commit point (or a handler's start) any of its handlers may still
    /// make its effect.
    #[cfg(feature = "postgres")]
    pub(crate) fn longest_commit_window(&self) -> Duration {
        self.tools
            .values()
            .map(|t| t.commit_window())
            .max()
            .unwrap_or(crate::api::handler::DEFAULT_COMMIT_WINDOW)
    }

    /// This executor's settings and tools, to start adopted identities
    /// from.
    #[cfg(feature = "postgres")]
    fn template(&self) -> Template {
        Template {
            cfg: self.cfg.clone(),
            client: self.client.fresh(),
            store_url: self.store_url.clone(),
            tools: self.tools.clone(),
            flow: self.flow.clone(),
            authorizer: self.authorizer.clone(),
            definitions: self.definitions.clone(),
            crash_plan: None,
            takeover_grace: None,
            gate: self.gate.clone(),
            // An adopted identity's own (it is not the process's).
            health: Arc::default(),
        }
    }

    /// This executor's settings and tools under another executor id (an
    /// adopted identity). Its instance id is this process's with a suffix
    /// (`ins_…:1a2b3c4d`), so that the platform's connections of adopted
    /// identities name the process that adopted them.
    #[cfg(feature = "postgres")]
    pub(crate) fn adopted_as(&self, executor_id: &str) -> Template {
        let mut adopted = self.template();
        adopted.cfg.executor_id = executor_id.to_owned();
        adopted.cfg.adopted = true;
        adopted.cfg.instance_id = format!("{}:{:08x}", self.cfg.instance_id, rand::random::<u32>());
        adopted
    }

    /// Starts as an adopted identity on its (fenced) store. (A boxed
    /// future: it breaks the cycle start → lease loop → adoption → start.)
    #[cfg(feature = "postgres")]
    pub(crate) fn start_adopted(
        self,
        store: crate::store::PgStore,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<RunningExecutor>> + Send>> {
        Box::pin(async move {
            let replica =
                super::replicas::Replica::new(store.clone(), None, None, self.gate.clone());
            let approvals: Arc<dyn ApprovalBook> = Arc::new(store.approvals());
            self.start_locked(Arc::new(store), None, Arc::new(replica), Some(approvals))
                .await
        })
    }

    async fn start_locked(
        self,
        store: Arc<dyn Store>,
        lock: Option<crate::store::StoreLock>,
        lease: Arc<dyn Lease>,
        approvals: Option<Arc<dyn ApprovalBook>>,
    ) -> Result<RunningExecutor> {
        super::start(self.core(store, lock, lease, approvals)).await
    }

    /// The `Core` of an executor of these settings and tools, not yet
    /// started.
    pub(crate) fn core(
        self,
        store: Arc<dyn Store>,
        lock: Option<crate::store::StoreLock>,
        lease: Arc<dyn Lease>,
        approvals: Option<Arc<dyn ApprovalBook>>,
    ) -> Arc<Core> {
        let capacity = usize::try_from(self.cfg.capacity).unwrap_or(usize::MAX);
        // Handlers' transactions for this capacity (on PostgreSQL, a pool
        // of their own).
        store.size_handler_transactions(self.cfg.capacity);
        let fence = CancellationToken::new();
        let slots = Arc::new(Semaphore::new(capacity));
        self.health
            .starting(&self.cfg.executor_id, self.cfg.capacity, slots.clone());
        let approvals = super::approval::Waits::new(
            approvals,
            self.authorizer.clone(),
            self.cfg.executor_id.clone(),
        );
        Arc::new(Core {
            cfg: self.cfg,
            client: self.client,
            store: Arc::new(FencedStore {
                inner: store,
                fence: fence.clone(),
                gate: self.gate,
                health: self.health.clone(),
            }),
            tools: self.tools,
            authorizer: self.authorizer,
            link: Link::default(),
            calls: Calls {
                active: StdMutex::new(Default::default()),
                cancelled: StdMutex::new(Default::default()),
                slots,
                flow: self.flow,
                dispatch: Default::default(),
                wake: Notify::new(),
                paused: AtomicBool::new(false),
                reports: Default::default(),
                approvals,
            },
            health: self.health,
            life: Life::new(fence, lock),
            crash_plan: self.crash_plan,
            gauges: Default::default(),
            lease,
        })
    }

    /// A test's executor, not started ([`Template::for_tests`]), on a
    /// store of one process in a temporary directory that lives as long as
    /// the returned guard.
    #[cfg(test)]
    pub(crate) async fn core_for_tests() -> (tempfile::TempDir, Arc<Core>) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = crate::store::SqliteStore::open_path(&dir.path().join("t.db"))
            .await
            .expect("a store");
        let approvals: Arc<dyn ApprovalBook> = Arc::new(store.approvals());
        let core = Template::for_tests().core(
            Arc::new(store),
            None,
            Arc::new(super::lease::Sole),
            Some(approvals),
        );
        (dir, core)
    }

    /// Settings of a test's executor: a platform that is never asked (the
    /// executor is not started), no tool.
    #[cfg(test)]
    pub(crate) fn for_tests() -> Template {
        let backoff = crate::net::client::Backoff {
            initial: std::time::Duration::from_millis(10),
            max: std::time::Duration::from_millis(100),
            attempts: 1,
        };
        Template {
            cfg: Config {
                executor_id: "exe_test".into(),
                binding_id: "bnd_test".into(),
                capacity: 4,
                instance_id: "ins_test".into(),
                timing: super::Timing {
                    poll_interval: Duration::from_millis(100),
                    handler_timeout: Duration::from_secs(5),
                    sqlite_transaction_timeout: Duration::from_secs(1),
                    retry_attempts: 1,
                    reconcile_interval: Duration::from_secs(1),
                    retention: None,
                },
                use_stream: false,
                auto_reconcile: true,
                adopted: false,
                lease_ttl: crate::store::DEFAULT_LEASE_TTL,
            },
            client: Client::new(
                "http://127.0.0.1:9",
                "tok_test",
                Duration::from_secs(1),
                backoff,
            )
            .expect("a client"),
            store_url: String::new(),
            tools: Arc::default(),
            flow: Arc::default(),
            authorizer: Arc::new(crate::api::authorizer::AllowAll),
            definitions: Vec::new(),
            crash_plan: None,
            takeover_grace: None,
            gate: None,
            health: Arc::default(),
        }
    }
}

#[cfg(feature = "postgres")]
impl super::replicas::Adopter for Template {
    fn longest_commit_window(&self) -> Duration {
        Template::longest_commit_window(self)
    }

    fn start_as(
        &self,
        executor_id: &str,
        store: crate::store::PgStore,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<RunningExecutor>> + Send>> {
        self.adopted_as(executor_id).start_adopted(store)
    }
}
