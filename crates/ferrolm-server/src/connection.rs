//! Accepting connections: a cap on how many are open at once, deadlines for a request's
//! headers and for idle keep-alive connections, and a shutdown that ends every connection
//! within the grace period whatever its client does.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tower_service::Service;

/// The bounds on connections.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Connections open at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// How long a client may take to send a request's headers.
    pub header_timeout: Duration,
    /// How long a connection may stay open with no request in flight and no bytes moving.
    pub idle_timeout: Duration,
}

/// Serves `app` on `listener` until `stop` resolves; then `on_stop` runs, open connections
/// finish their requests for at most `grace` (plus a second for the answers to go out), and
/// whatever is left is dropped.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    stop: impl Future<Output = ()>,
    grace: Duration,
    on_stop: impl FnOnce(),
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let (stopping_tx, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(stop);
    loop {
        let permit = tokio::select! {
            _ = &mut stop => break,
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = &mut stop => break,
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: not a reason to stop serving.
                    eprintln!("ferrolm: accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        while connections.try_join_next().is_some() {}
        connections.spawn(connection(
            stream,
            app.clone(),
            limits,
            stopping.clone(),
            permit,
        ));
    }
    drop(listener);
    on_stop();
    let _ = stopping_tx.send(true);
    let all_done = async { while connections.join_next().await.is_some() {} };
    let _ = tokio::time::timeout(grace + Duration::from_secs(1), all_done).await;
    connections.shutdown().await;
}

/// One connection: HTTP/1.1 with keep-alive, closed when idle too long or at shutdown.
async fn connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    mut stopping: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Tracked {
        inner: stream,
        activity: activity.clone(),
    });
    let busy = activity.clone();
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let in_flight = InFlight::new(busy.clone());
        let answer = app.clone().call(request.map(Body::new));
        async move {
            let response = answer.await;
            drop(in_flight);
            Ok::<_, Infallible>(response.unwrap_or_else(|never| match never {}))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut tick = tokio::time::interval((limits.idle_timeout / 4).min(Duration::from_secs(1)));
    let mut stop_seen = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = stopping.changed(), if !stop_seen => {
                stop_seen = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = tick.tick() => {
                if activity.idle_for() >= limits.idle_timeout {
                    return; // dropping the connection closes it
                }
            }
        }
    }
}

/// When bytes last moved on a connection, and how many of its requests are being answered.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
    in_flight: AtomicUsize,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        }
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Relaxed);
    }

    /// Zero while a request is in flight; otherwise the time since bytes last moved.
    fn idle_for(&self) -> Duration {
        if self.in_flight.load(Relaxed) > 0 {
            return Duration::ZERO;
        }
        let now = self.start.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_ms.load(Relaxed)))
    }
}

/// Counts one request in flight while it lives.
struct InFlight(Arc<Activity>);

impl InFlight {
    fn new(activity: Arc<Activity>) -> InFlight {
        activity.in_flight.fetch_add(1, Relaxed);
        InFlight(activity)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
        self.0.touch();
    }
}

/// A stream that records when bytes move through it.
struct Tracked {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        result
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(result, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
