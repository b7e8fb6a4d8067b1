//! `/statusz`, `/metrics`, `/healthz`, `/readyz`.

use axum::extract::State;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use mirror_core::Phase;
use tokio_util::sync::CancellationToken;

use std::sync::Arc;

use prometheus_client::registry::Registry;

use mirror_core::StatusHandle;

/// Serves until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    status: StatusHandle,
    registry: Registry,
    shutdown: CancellationToken,
) {
    let registry = Arc::new(registry);
    let app = Router::new()
        .route("/statusz", get(statusz))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    (
                        [
                            (CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8"),
                            (CACHE_CONTROL, "no-store"),
                        ],
                        crate::metrics::encode(&registry),
                    )
                }
            }),
        )
        .with_state(status);
    let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
}

/// The status as JSON, never to be cached: a proxy or browser showing an old snapshot would
/// show a healthy link that is not (or the reverse).
async fn statusz(State(status): State<StatusHandle>) -> impl IntoResponse {
    let mut snapshot = status.read().expect("status lock").clone();
    snapshot.read_memory();
    ([(CACHE_CONTROL, "no-store")], Json(snapshot))
}

/// 200 unless connecting or failed (SPEC §7).
async fn readyz(State(status): State<StatusHandle>) -> impl IntoResponse {
    let phase = status.read().expect("status lock").phase;
    match phase {
        Phase::Connecting | Phase::Failed => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("{}\n", phase.as_str()))
        }
        _ => (StatusCode::OK, format!("{}\n", phase.as_str())),
    }
}
