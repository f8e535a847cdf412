//! The dashboard's HTTP server: the page, the view as JSON, its patches as server-sent events,
//! and `/metrics`. Read-only (GET only); a token is required when one is set, which [`serve`]
//! insists on for any address beyond loopback.

use crate::{Monitor, MonitorError};
use axum::extract::{Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use subtle::ConstantTimeEq;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::{Stream, StreamExt};

/// A running dashboard; dropping it stops the server.
pub struct Dashboard {
    pub addr: SocketAddr,
    /// What to open in a browser (with the token, when there is one).
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        // Viewers hold their event streams open: stop at once rather than wait for them.
        self.task.abort();
    }
}

#[derive(Clone)]
struct App {
    monitor: Arc<Monitor>,
    token: Option<Arc<str>>,
}

/// Serves `monitor` on `addr` (port 0: any free port) on the current tokio runtime.
pub async fn serve(
    monitor: Arc<Monitor>,
    addr: SocketAddr,
    token: Option<String>,
) -> Result<Dashboard, MonitorError> {
    if !addr.ip().is_loopback() && token.is_none() {
        return Err(MonitorError::TokenRequired {
            addr: addr.to_string(),
        });
    }
    if let Some(t) = &token {
        check_token(t)?;
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MonitorError::Listen {
            addr: addr.to_string(),
            source,
        })?;
    let bound = listener
        .local_addr()
        .map_err(|source| MonitorError::Listen {
            addr: addr.to_string(),
            source,
        })?;
    let host = match bound.ip() {
        ip if ip.is_unspecified() => "localhost".to_string(),
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        ip => ip.to_string(),
    };
    let url = match &token {
        Some(t) => format!("http://{host}:{}/?token={t}", bound.port()),
        None => format!("http://{host}:{}/", bound.port()),
    };
    let app = App {
        monitor,
        token: token.map(Into::into),
    };
    let router = Router::new()
        .route("/", get(index))
        .route("/api/state", get(state))
        .route("/api/events", get(events))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(app.clone(), authorise))
        .with_state(app);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::warn!("dashboard server stopped: {e}");
        }
    });
    Ok(Dashboard {
        addr: bound,
        url,
        task,
    })
}

/// A token must be long enough to guess at no better than chance, and fit a URL as it is.
fn check_token(t: &str) -> Result<(), MonitorError> {
    let url_safe = |c: char| c.is_ascii_alphanumeric() || "-._~".contains(c);
    if t.len() < MIN_TOKEN || !t.chars().all(url_safe) {
        return Err(MonitorError::WeakToken { min: MIN_TOKEN });
    }
    Ok(())
}

/// The shortest token the dashboard accepts.
pub const MIN_TOKEN: usize = 16;

/// Lets a request through when no token is set, or it carries the token (`?token=` or
/// `Authorization: Bearer`).
async fn authorise(
    State(app): State<App>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    request: Request,
    next: Next,
) -> Response {
    let Some(want) = &app.token else {
        return next.run(request).await;
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim());
    let given = query.get("token").map(String::as_str).or(bearer);
    match given {
        Some(g) if bool::from(g.as_bytes().ct_eq(want.as_bytes())) => next.run(request).await,
        _ => (
            StatusCode::UNAUTHORIZED,
            "a token is required: open the URL the launcher printed (?token=...)\n",
        )
            .into_response(),
    }
}

async fn index(State(app): State<App>) -> Html<String> {
    Html(crate::page(&app.monitor.title(), None))
}

async fn state(State(app): State<App>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        app.monitor.view_json(),
    )
        .into_response()
}

async fn metrics(State(app): State<App>) -> Response {
    (
        [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
        app.monitor.metrics_text(),
    )
        .into_response()
}

/// The whole view first, then every patch; a viewer that fell behind gets the whole view again.
async fn events(State(app): State<App>) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let (first, rx) = app.monitor.subscribe();
    let monitor = app.monitor.clone();
    let head = tokio_stream::once(Ok(Event::default()
        .event("snapshot")
        .retry(Duration::from_secs(5))
        .data(first)));
    let rest = BroadcastStream::new(rx).map(move |patch| {
        Ok(match patch {
            Ok(p) => Event::default().event("patch").data(&*p),
            Err(BroadcastStreamRecvError::Lagged(_)) => {
                Event::default().event("snapshot").data(monitor.view_json())
            }
        })
    });
    Sse::new(head.chain(rest)).keep_alive(KeepAlive::default())
}
