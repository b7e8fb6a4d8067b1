//! `mirror-agent run`: the daemon. It serves `/statusz`, `/metrics`, `/healthz` and `/readyz`,
//! drives the engine of the link's mode (compact `engine/`, exact `exact/`), refreshes lag and
//! staleness once a second beside it, reloads the config on SIGHUP and stops within
//! [`STOP_DEADLINE`] of SIGTERM or SIGINT.

use std::process::ExitCode;
use std::sync::{Arc, RwLock};

use mirror_core::{Applies, Config, Status};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::exit::Exit;
use crate::{config_error, engine, exact, freshness, http, metrics, reporter, runtime_with, LogFormat};

/// The longest a stop takes after SIGTERM or SIGINT (issue #44: a Kubernetes rollout or drain
/// waits that long per replica).
const STOP_DEADLINE: std::time::Duration = std::time::Duration::from_millis(1800);

pub(crate) fn run(file: &std::path::Path, listen: Option<String>, format: LogFormat) -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("MIRROR_LOG").unwrap_or_else(|_| "info".into());
    // Colours only on a terminal: log files and journald get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    let mut config = match Config::load(file) {
        Ok(c) => c,
        Err(e) => return config_error(file, &e),
    };
    // What the file says, apart from any --listen override: a reload compares against it.
    let mut file_listen = config.http.listen.clone();
    if let Some(listen) = listen {
        config.http.listen = listen;
        if let Err(e) = config.validate() {
            return config_error(file, &e);
        }
    }
    // Exact mode is a chain of one Txn per revision, each sent when the watch or the answer
    // before it wakes the tail: a wake-up that crosses worker threads (the tail on one, a
    // connection's task on the other) is on that chain each time. On one worker the exact tail
    // kept up with 2 000 revisions/s where two workers fell behind at 1 750 (README, exact
    // figures). `TOKIO_WORKER_THREADS` still rules where set. Signals and the stop backstop
    // keep the main thread.
    let workers = (config.exact() && std::env::var_os("TOKIO_WORKER_THREADS").is_none()).then_some(1);
    runtime_with(workers).block_on(async move {
        let listener = match tokio::net::TcpListener::bind(&config.http.listen).await {
            Ok(l) => l,
            Err(e) => {
                error!("cannot listen on {}: {e}", config.http.listen);
                return ExitCode::from(Exit::Config);
            }
        };
        info!(link = %config.link_uid, epoch = config.epoch, listen = %config.http.listen, "mirror-agent starting");
        warn_insecure(&config, None);
        let status = Arc::new(RwLock::new(Status::default()));
        let shutdown = CancellationToken::new();
        let (registry, metrics) = metrics::registry(status.clone());
        let http = tokio::spawn(http::serve(listener, status.clone(), registry, shutdown.clone()));
        let (reload_tx, reload_rx) = tokio::sync::watch::channel(config.clone());
        tokio::spawn(freshness_watchdog(status.clone(), reload_rx.clone(), shutdown.clone()));
        let engine = if config.exact() {
            let reporter = reporter::Reporter::new(status, freshness::Freshness::of(&config)).with_metrics(metrics);
            reporter.update(|s| {
                s.link_uid = config.link_uid.clone();
                s.epoch = config.epoch as u64;
                s.agent_id = format!("{}/{}", engine::hostname(), std::process::id());
            });
            tokio::spawn(exact::run(config.clone(), reporter, shutdown.clone(), reload_rx))
        } else {
            tokio::spawn(
                engine::Engine::new(config.clone(), status, shutdown.clone())
                    .with_metrics(metrics)
                    .with_reload(reload_rx)
                    .run(),
            )
        };
        let mut current = config;
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
        let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                _ = hup.recv() => reload(file, &mut current, &mut file_listen, &reload_tx),
            }
        }
        info!("stopping");
        shutdown.cancel();
        // The engine bounds its own stop (a grace, then the request in flight is dropped, then
        // a bounded HA resign); this is the backstop that keeps SIGTERM under 2 s whatever
        // hangs (an HTTP client that holds its connection open, say).
        let stopped = async {
            let _ = engine.await;
            let _ = http.await;
        };
        if tokio::time::timeout(STOP_DEADLINE, stopped).await.is_err() {
            warn!("not stopped within {STOP_DEADLINE:?} of the signal; exiting anyway");
        }
        ExitCode::SUCCESS
    })
}

/// SIGHUP: re-read the file; refuse it whole if a field that defines the link changed, else
/// apply it, naming the fields that wait for a later point ([`Applies`]).
///
/// `http.listen` is restart-only: the listener is bound once. A reload that changes it in the
/// file says so and applies the rest; the running address (or the `--listen` override) stays.
fn reload(
    file: &std::path::Path,
    current: &mut Config,
    file_listen: &mut String,
    tx: &tokio::sync::watch::Sender<Config>,
) {
    let mut new = match Config::load(file) {
        Ok(c) => c,
        Err(e) => {
            error!("reload refused, config unchanged: {e}");
            return;
        }
    };
    let configured_listen = std::mem::replace(&mut new.http.listen, current.http.listen.clone());
    // What each field's change does is mirror_core::Applies (docs/configuration.md's SIGHUP
    // column, held to it by a test). http.listen is left out of the comparison: the running
    // address may be the --listen override, and its own rule follows.
    let changes = mirror_core::sort_changes(current, &new);
    let fields = |when: Applies| changes.get(&when).map(|f| f.join(", "));
    if let Some(refused) = fields(Applies::Refused) {
        error!(
            fields = %refused,
            "reload refused, config unchanged: these fields cannot change while running (they define the link); restart with a new link instead"
        );
        return;
    }
    if let Some(later) = fields(Applies::NextRun) {
        warn!(
            fields = %later,
            "{later}: the running values stay until the next run (a reconnect, forced resync or restart); the rest of the reload applies"
        );
    }
    if let Some(later) = fields(Applies::NextGenesis) {
        warn!(
            fields = %later,
            "{later}: read only when an initial sync is planned (first start or forced resync); the rest of the reload applies"
        );
    }
    if configured_listen != *file_listen {
        warn!(
            field = "http.listen",
            running = %current.http.listen,
            configured = %configured_listen,
            "http.listen applies only at restart: still serving on the running address; the rest of the reload applies"
        );
        *file_listen = configured_listen;
    }
    info!("reloading config");
    warn_insecure(&new, Some(current));
    *current = new.clone();
    tx.send_replace(new);
}

/// Warns once per side that skips verifying its server certificate: at start, and at a reload
/// that turns it on (not at every reconnect).
fn warn_insecure(config: &Config, before: Option<&Config>) {
    let skips = |c: &Config, side: mirror_core::Side| {
        let s = if side == mirror_core::Side::Source { &c.source } else { &c.target };
        s.tls.as_ref().is_some_and(|t| t.insecure_skip_verify)
    };
    for side in [mirror_core::Side::Source, mirror_core::Side::Target] {
        if skips(config, side) && !before.is_some_and(|b| skips(b, side)) {
            warn!(
                %side,
                "{side}.tls.insecure_skip_verify is on: the {side}'s certificate is not verified, so anyone on \
                 the network path can read and change what is mirrored; use ca_file instead"
            );
        }
    }
}

/// Refreshes the lag figures and the staleness rule once a second, independently of the engine,
/// so a wedged engine loop shows as `ReplicationLagExceeded` instead of looking healthy; and
/// logs once each TLS certificate that enters its lead window ([`freshness::CertWarnings`]).
async fn freshness_watchdog(
    status: engine::StatusHandle,
    config: tokio::sync::watch::Receiver<mirror_core::Config>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    let mut certs = freshness::CertWarnings::default();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let rule = freshness::Freshness::of(&config.borrow());
        let now = std::time::SystemTime::now();
        let due = {
            let mut s = status.write().expect("status lock");
            freshness::refresh(&mut s, now, &rule);
            certs.due(&s, now)
        };
        for warning in due {
            warn!("{warning}");
        }
    }
}
