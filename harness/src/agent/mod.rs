//! Running the real `mirror-agent` binary as a child process, as an operator would.

mod config;
mod metrics;

pub use config::{agent_binary, agent_command, AgentConfig};
pub use metrics::{Observed, Scraped};

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context as _};
use mirror_core::Status;
use tokio::process::{Child, Command};

/// Where `mirror-agent run` runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum AgentBackend {
    /// A child process of the harness (the default).
    #[default]
    Process,
    /// A container of the image `scripts/image.sh` builds ([`AGENT_IMAGE`]), attached to these
    /// Docker networks (the etcd clusters', [`crate::EtcdCluster::docker_network`]), its HTTP
    /// port published on 127.0.0.1. The config's endpoints must be reachable from inside, e.g.
    /// [`crate::EtcdCluster::network_endpoints`].
    Container {
        /// Docker networks to join.
        networks: Vec<String>,
    },
}

/// The agent image `scripts/image.sh` builds.
pub const AGENT_IMAGE: &str = "etcd-mirror/agent:dev";

/// Where the agent container sees its config directory (read-only).
const CONTAINER_CONFIG_DIR: &str = "/etc/etcd-mirror";

/// The agent's HTTP port inside its container (the image's `EXPOSE`).
const CONTAINER_HTTP_PORT: u16 = 8080;

/// The running agent.
enum Running {
    Process(Child),
    /// A created container (it may have exited); removed on drop.
    Container(String),
}

/// A running `mirror-agent run`.
pub struct AgentProcess {
    running: Option<Running>,
    backend: AgentBackend,
    http: SocketAddr,
    dir: tempfile::TempDir,
    config: AgentConfig,
}

impl AgentProcess {
    /// Writes the config and starts the agent as a child process on a free HTTP port.
    pub async fn start(config: &AgentConfig) -> anyhow::Result<AgentProcess> {
        AgentProcess::start_on(config, AgentBackend::Process).await
    }

    /// Writes the config and starts the agent on `backend`.
    pub async fn start_on(config: &AgentConfig, backend: AgentBackend) -> anyhow::Result<AgentProcess> {
        let dir = tempfile::Builder::new().prefix("mirror-agent-").tempdir()?;
        let mut agent = AgentProcess {
            running: None,
            backend,
            http: ([127, 0, 0, 1], 0).into(),
            dir,
            config: config.clone(),
        };
        agent.spawn().await?;
        Ok(agent)
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        match self.backend.clone() {
            AgentBackend::Process => self.spawn_process().await,
            AgentBackend::Container { networks } => self.spawn_container(&networks).await,
        }
    }

    /// Creates the container on the first start, starts it again on later ones (same config
    /// directory, same published port).
    async fn spawn_container(&mut self, networks: &[String]) -> anyhow::Result<()> {
        // The image runs as a non-root user: the config directory must be readable by it.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(self.dir.path(), std::fs::Permissions::from_mode(0o755))?;
        std::fs::write(self.config_path(), self.config.render())?;
        std::fs::set_permissions(self.config_path(), std::fs::Permissions::from_mode(0o644))?;
        if let Some(Running::Container(id)) = &self.running {
            docker(&["start", id]).await?;
            return Ok(());
        }
        let port = crate::ports::free_ports(1)?[0];
        self.http = ([127, 0, 0, 1], port).into();
        let name = format!("em-agent-{}", crate::etcd::unique_id());
        let mut args: Vec<String> = vec![
            "create".into(),
            "--name".into(),
            name.clone(),
            "--label".into(),
            format!("{}=1", crate::container::LABEL),
            "--publish".into(),
            format!("127.0.0.1:{port}:{CONTAINER_HTTP_PORT}"),
            "--volume".into(),
            format!("{}:{CONTAINER_CONFIG_DIR}:ro", self.dir.path().display()),
            "--env".into(),
            format!("MIRROR_LOG={}", std::env::var("MIRROR_LOG").unwrap_or_else(|_| "info".into())),
        ];
        if let Some(first) = networks.first() {
            args.extend(["--network".into(), first.clone()]);
        }
        for (k, v) in &self.config.env {
            args.extend(["--env".into(), format!("{k}={v}")]);
        }
        args.extend([
            AGENT_IMAGE.into(),
            "run".into(),
            "--config".into(),
            format!("{CONTAINER_CONFIG_DIR}/mirror.toml"),
            "--listen".into(),
            format!("0.0.0.0:{CONTAINER_HTTP_PORT}"),
        ]);
        args.extend(self.config.args.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let id = docker(&args).await.with_context(|| {
            format!("creating the agent container from {AGENT_IMAGE} (built by scripts/image.sh)")
        })?;
        self.running = Some(Running::Container(id.clone()));
        for network in networks.iter().skip(1) {
            docker(&["network", "connect", network, &id]).await?;
        }
        docker(&["start", &id]).await?;
        Ok(())
    }

    async fn spawn_process(&mut self) -> anyhow::Result<()> {
        let bin = agent_binary();
        if !bin.exists() {
            bail!("{} is missing: run `cargo build -p mirror-agent` (scripts/test.sh does)", bin.display());
        }
        let port = crate::ports::free_ports(1)?[0];
        self.http = ([127, 0, 0, 1], port).into();
        let config_path = self.config_path();
        std::fs::write(&config_path, self.config.render())?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path())?;
        let child = Command::new(&bin)
            .arg("run")
            .arg("--config")
            .arg(&config_path)
            .arg("--listen")
            .arg(self.http.to_string())
            .args(&self.config.args)
            .env("MIRROR_LOG", std::env::var("MIRROR_LOG").unwrap_or_else(|_| "info".into()))
            .envs(self.config.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            // Its own process group: a Ctrl-C at the terminal reaches the harness (the demo
            // stops its writer and verifies first), not the agent directly.
            .process_group(0)
            .spawn()
            .with_context(|| format!("spawning {}", bin.display()))?;
        self.running = Some(Running::Process(child));
        Ok(())
    }

    /// Replaces the config (takes effect on the next start).
    pub fn set_config(&mut self, config: AgentConfig) {
        self.config = config;
    }

    /// Rewrites the running agent's config file and sends SIGHUP.
    pub fn reload(&mut self, config: AgentConfig) -> anyhow::Result<()> {
        self.config = config;
        std::fs::write(self.config_path(), self.config.render())?;
        self.signal(libc::SIGHUP)
    }

    /// Sends `sig` to the running agent (STOP freezes it, CONT thaws it, HUP reloads).
    pub fn signal(&self, sig: libc::c_int) -> anyhow::Result<()> {
        match &self.running {
            Some(Running::Process(child)) => {
                crate::process::send(child.id().context("agent has exited")?, sig);
                Ok(())
            }
            Some(Running::Container(id)) => {
                let out = std::process::Command::new("docker")
                    .args(["kill", "--signal", &sig.to_string(), id])
                    .output()
                    .context("running docker kill")?;
                if !out.status.success() {
                    bail!("docker kill --signal {sig}: {}", String::from_utf8_lossy(&out.stderr).trim());
                }
                Ok(())
            }
            None => bail!("agent is not running"),
        }
    }

    /// Starts the agent again after it exited (same config unless replaced).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.spawn().await
    }

    /// The config it runs with.
    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    /// The config file it runs on.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("mirror.toml")
    }

    /// Its log file (stdout and stderr).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("agent.log")
    }

    /// Everything the agent logged so far.
    pub fn log(&self) -> String {
        match &self.running {
            Some(Running::Container(id)) => crate::container::docker_logs(id),
            _ => std::fs::read_to_string(self.log_path()).unwrap_or_default(),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// GET /statusz.
    pub async fn status(&self) -> anyhow::Result<Status> {
        self.status_via(&reqwest::Client::new()).await
    }

    /// GET /statusz through `client`, whose pool keeps the connection for the next read.
    async fn status_via(&self, client: &reqwest::Client) -> anyhow::Result<Status> {
        let resp = client
            .get(format!("{}/statusz", self.url()))
            .timeout(Duration::from_secs(5))
            .send()
            .await?
            .error_for_status()?;
        Ok(resp.json().await?)
    }

    /// GET /metrics.
    pub async fn metrics(&self) -> anyhow::Result<Scraped> {
        Scraped::get(&self.url()).await
    }

    /// GET a path, returning the HTTP status code.
    pub async fn http_code(&self, path: &str) -> anyhow::Result<u16> {
        let resp = reqwest::Client::new()
            .get(format!("{}{path}", self.url()))
            .timeout(Duration::from_secs(5))
            .send()
            .await?;
        Ok(resp.status().as_u16())
    }

    /// Polls /statusz until `pred` holds, or fails with the last status and the agent log.
    pub async fn wait_for(
        &self,
        what: &str,
        within: Duration,
        pred: impl Fn(&Status) -> bool,
    ) -> anyhow::Result<Status> {
        self.wait_for_every(what, within, Duration::from_millis(100), pred).await
    }

    /// [`AgentProcess::wait_for`], reading `/statusz` every `every` (the bench times the agent
    /// by its own conditions, to 10 ms, with no read of the clusters it measures).
    pub async fn wait_for_every(
        &self,
        what: &str,
        within: Duration,
        every: Duration,
        pred: impl Fn(&Status) -> bool,
    ) -> anyhow::Result<Status> {
        let deadline = tokio::time::Instant::now() + within;
        let mut last = None;
        // One client for the whole wait: a new one per read opened a connection per read, at
        // the bench's 100 reads/s a cost the measured agent paid too.
        let client = reqwest::Client::new();
        while tokio::time::Instant::now() < deadline {
            if let Ok(s) = self.status_via(&client).await {
                if pred(&s) {
                    return Ok(s);
                }
                last = Some(s);
            }
            tokio::time::sleep(every).await;
        }
        bail!(
            "agent never reached {what} within {within:?}; last status: {last:#?}\n--- agent log ---\n{}",
            self.log()
        )
    }

    /// SIGTERM and wait; returns the exit code.
    pub async fn terminate(&mut self) -> anyhow::Result<Option<i32>> {
        match self.running.take() {
            None => Ok(None),
            Some(Running::Process(mut child)) => {
                if let Some(pid) = child.id() {
                    crate::process::send(pid, libc::SIGTERM);
                }
                let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
                    .await
                    .context("agent did not stop on SIGTERM")??;
                Ok(status.code())
            }
            Some(Running::Container(id)) => {
                // docker stop: SIGTERM, then SIGKILL after 30 s (which would show as exit 137).
                let stopped = docker(&["stop", "--time", "30", &id]).await;
                let code = docker(&["inspect", "--format", "{{.State.ExitCode}}", &id]).await;
                self.running = Some(Running::Container(id));
                stopped?;
                Ok(Some(code?.parse().context("docker inspect exit code")?))
            }
        }
    }

    /// SIGKILL, no warning.
    pub async fn kill9(&mut self) -> anyhow::Result<()> {
        match &mut self.running {
            Some(Running::Process(child)) => {
                child.kill().await?;
                self.running = None;
            }
            Some(Running::Container(id)) => {
                docker(&["kill", id]).await?;
            }
            None => {}
        }
        Ok(())
    }

    /// The process id while running as a child process (`None` in a container).
    pub fn pid(&self) -> Option<u32> {
        match &self.running {
            Some(Running::Process(child)) => child.id(),
            _ => None,
        }
    }

    /// Peak resident memory of the running agent in bytes (VmHWM), where /proc has it.
    pub fn peak_rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()?)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    /// Peak resident memory since the last call (VmHWM, which the agent's own `peak_rss_bytes`
    /// reports too), then starts a new peak from the current RSS (Linux resets VmHWM when "5"
    /// is written to `/proc/PID/clear_refs`): a bench reads one peak per case.
    pub fn take_peak_rss_bytes(&self) -> Option<u64> {
        let peak = self.peak_rss_bytes()?;
        std::fs::write(format!("/proc/{}/clear_refs", self.pid()?), "5").ok()?;
        Some(peak)
    }

    /// Whether the agent is still running.
    pub fn is_running(&mut self) -> bool {
        match &mut self.running {
            Some(Running::Process(c)) => c.try_wait().ok().flatten().is_none(),
            Some(Running::Container(id)) => std::process::Command::new("docker")
                .args(["inspect", "--format", "{{.State.Running}}", id.as_str()])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "true"),
            None => false,
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if let Some(Running::Container(id)) = &self.running {
            let _ = std::process::Command::new("docker")
                .args(["rm", "--force", id.as_str()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Runs `docker ARGS`; its trimmed stdout, or an error with its stderr.
async fn docker(args: &[&str]) -> anyhow::Result<String> {
    let out =
        Command::new("docker").args(args).stdin(Stdio::null()).output().await.context("running docker")?;
    if !out.status.success() {
        bail!("docker {}: {}", args.first().unwrap_or(&""), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
