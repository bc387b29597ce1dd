//! A TCP proxy on loopback that can be paused: while paused it reads
//! nothing from either side and delivers nothing, so a process whose
//! database and platform connections both go through one stands still to
//! the world as a process stopped with SIGSTOP does (its timers go on;
//! every request it makes waits). Resumed, every byte flows again.
//! Connections are never dropped: a paused peer is slow, not gone.
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A pausable proxy in front of one upstream address.
pub(crate) struct Proxy {
    addr: SocketAddr,
    /// Chunks read from the clients (each request a client sends and then
    /// waits on is one or more: a count of round trips, give or take).
    chunks: Arc<std::sync::atomic::AtomicU64>,
    paused: Arc<watch::Sender<bool>>,
    trigger: Trigger,
    task: tokio::task::JoinHandle<()>,
}

/// A pause armed to fall at a point of the client's traffic: after a
/// chunk holding `after` passes, the next chunk is sent on and the proxy
/// pauses right behind it (a database client paused just after the first
/// statement of a transaction: the server ran it, holding its locks).
#[derive(Clone, Default)]
struct Trigger(Arc<Mutex<Option<Armed>>>);

struct Armed {
    after: Vec<u8>,
    /// Pause right behind the chunk holding `after` itself, not behind
    /// the next one.
    itself: bool,
}

impl Trigger {
    /// Whether the proxy pauses behind this chunk of one connection, which
    /// `seen` says of its last chunk.
    fn fires(&self, chunk: &[u8], seen: &mut bool) -> bool {
        let mut armed = self.0.lock().expect("lock");
        let Some(a) = armed.as_ref() else {
            *seen = false;
            return false;
        };
        if *seen {
            *armed = None;
            return true;
        }
        let holds = chunk
            .windows(a.after.len())
            .any(|w| w == a.after.as_slice());
        if holds && a.itself {
            *armed = None;
            return true;
        }
        *seen = holds;
        false
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// Starts a proxy on `127.0.0.1:0` in front of `upstream`.
    pub(crate) async fn start(upstream: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (paused, watch) = watch::channel(false);
        let paused = Arc::new(paused);
        let trigger = Trigger::default();
        let (pauser, armed) = (paused.clone(), trigger.clone());
        let chunks = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = chunks.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let _ = client.set_nodelay(true);
                let watch = watch.clone();
                let (pauser, armed) = (pauser.clone(), armed.clone());
                let counted = counted.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::spawn(pump(
                        cr,
                        sw,
                        watch.clone(),
                        Some((armed, pauser)),
                        Some(counted),
                    ));
                    tokio::spawn(pump(sr, cw, watch, None, None));
                });
            }
        });
        Ok(Proxy {
            addr,
            chunks,
            paused,
            trigger,
            task,
        })
    }

    /// `url` (`scheme://[user@]host:port/…`) with its host and port
    /// replaced by this proxy's.
    pub(crate) fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL");
        let (user, hostpath) = match rest.split_once('@') {
            Some((u, h)) => (format!("{u}@"), h),
            None => (String::new(), rest),
        };
        let path = hostpath.find('/').map_or("", |i| &hostpath[i..]);
        format!("{scheme}://{user}{}{path}", self.addr)
    }

    /// How many chunks the clients have sent through so far.
    pub(crate) fn client_chunks(&self) -> u64 {
        self.chunks.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Nothing passes from now on, either way.
    pub(crate) fn pause(&self) {
        let _ = self.paused.send(true);
    }

    /// Pauses once a client's chunk holding `after` has passed, right
    /// behind that client's next chunk (see [`Trigger`]).
    pub(crate) fn pause_after_next(&self, after: &[u8]) {
        *self.trigger.0.lock().expect("lock") = Some(Armed {
            after: after.to_vec(),
            itself: false,
        });
    }

    /// Pauses once a client's chunk holding `after` has passed, right
    /// behind it (the server runs that statement; its answer waits).
    pub(crate) fn pause_behind(&self, after: &[u8]) {
        *self.trigger.0.lock().expect("lock") = Some(Armed {
            after: after.to_vec(),
            itself: true,
        });
    }

    /// Whether the proxy is paused.
    pub(crate) fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// Everything passes again.
    pub(crate) fn resume(&self) {
        let _ = self.paused.send(false);
    }
}

/// The address of a `postgres://` or `http://` URL (`localhost` is
/// 127.0.0.1).
pub(crate) fn address_of(url: &str) -> SocketAddr {
    let rest = url.split_once("://").expect("a URL").1;
    let hostport = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let hostport = hostport.split(['/', '?']).next().unwrap_or(hostport);
    let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "5432"));
    let host = if host == "localhost" {
        "127.0.0.1"
    } else {
        host
    };
    format!("{host}:{port}")
        .parse()
        .expect("a loopback address")
}

/// Waits while paused; `false` when the proxy is gone.
async fn wait_running(watch: &mut watch::Receiver<bool>) -> bool {
    while *watch.borrow_and_update() {
        if watch.changed().await.is_err() {
            return false;
        }
    }
    true
}

/// Waits until paused; never when the proxy is gone.
async fn until_paused(mut watch: watch::Receiver<bool>) {
    loop {
        if *watch.borrow_and_update() {
            return;
        }
        if watch.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut watch: watch::Receiver<bool>,
    trigger: Option<(Trigger, Arc<watch::Sender<bool>>)>,
    counted: Option<Arc<std::sync::atomic::AtomicU64>>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut seen = false;
    loop {
        if !wait_running(&mut watch).await {
            return;
        }
        let n = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => n,
            },
            // Paused while waiting: stop reading at once.
            () = until_paused(watch.clone()) => continue,
        };
        if let Some(counted) = &counted {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        // Read just before a pause: held until the resume.
        if !wait_running(&mut watch).await || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
        if let Some((armed, pauser)) = &trigger
            && armed.fires(&buf[..n], &mut seen)
        {
            let _ = pauser.send(true);
        }
    }
}
