//! `/statusz`, `/metrics`, `/healthz`, `/readyz`.

use axum::extract::State;
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
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        crate::metrics::encode(&registry),
                    )
                }
            }),
        )
        .with_state(status);
    let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await;
}

async fn statusz(State(status): State<StatusHandle>) -> impl IntoResponse {
    let mut snapshot = status.read().expect("status lock").clone();
    snapshot.read_memory();
    Json(snapshot)
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
