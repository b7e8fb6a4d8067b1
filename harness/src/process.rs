//! The local-process launcher: etcd as a child of the test process.

use std::process::Stdio;
use std::time::Duration;

use anyhow::Context as _;
use tokio::process::{Child, Command};

use crate::plan::MemberPlan;

/// One etcd child process; restartable on the same data dir and ports.
pub(crate) struct ProcessNode {
    child: Option<Child>,
}

impl ProcessNode {
    pub(crate) async fn spawn(plan: &MemberPlan) -> anyhow::Result<ProcessNode> {
        let mut node = ProcessNode { child: None };
        node.start(plan).await?;
        Ok(node)
    }

    pub(crate) async fn start(&mut self, plan: &MemberPlan) -> anyhow::Result<()> {
        std::fs::create_dir_all(&plan.data_dir)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(plan.data_dir.with_extension("log"))?;
        let client = format!("{}://127.0.0.1:{}", plan.client_scheme(), plan.client_port);
        let peer = format!("http://127.0.0.1:{}", plan.peer_port);
        let mut cmd = Command::new(plan.version.binary());
        cmd.arg(format!("--name={}", plan.name))
            .arg(format!("--data-dir={}", plan.data_dir.display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster={}", plan.initial_cluster))
            .arg(format!("--initial-cluster-token={}", plan.cluster_token))
            .arg("--initial-cluster-state=new")
            .args(plan.tls.as_deref().map(|dir| plan.tls_args(dir)).unwrap_or_default())
            .args(&plan.extra_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        die_with_parent(&mut cmd);
        let child = cmd.spawn().with_context(|| format!("spawning {}", plan.version.binary().display()))?;
        self.child = Some(child);
        Ok(())
    }

    pub(crate) async fn stop(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id() {
                // A paused member must be thawed or it never sees SIGTERM.
                send(pid, libc::SIGCONT);
                send(pid, libc::SIGTERM);
            }
            if tokio::time::timeout(Duration::from_secs(10), child.wait()).await.is_err() {
                child.kill().await?;
            }
        }
        Ok(())
    }

    pub(crate) async fn kill(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().await?;
        }
        Ok(())
    }

    pub(crate) fn signal(&mut self, sig: libc::c_int) -> anyhow::Result<()> {
        let pid = self.child.as_ref().and_then(Child::id).context("member is not running")?;
        send(pid, sig);
        Ok(())
    }

    /// SIGSTOP, then waits until every thread of the member has stopped: `kill` returns before
    /// the signal is delivered, and a Get sent right after it was once answered.
    pub(crate) async fn freeze(&mut self) -> anyhow::Result<()> {
        let pid = self.child.as_ref().and_then(Child::id).context("member is not running")?;
        send(pid, libc::SIGSTOP);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !all_threads_stopped(pid) {
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "member {pid} did not stop within 5 s");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }
}

/// Whether every thread of `pid` is stopped (state `T`), by `/proc/PID/task/*/stat`; true where
/// there is no `/proc` to ask.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return true };
    tasks.flatten().all(|task| {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // "tid (comm) S ...": the state follows the last ')', as comm may hold anything.
        let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
        matches!(state, None | Some('T' | 't'))
    })
}

impl Drop for ProcessNode {
    fn drop(&mut self) {
        if let Some(pid) = self.child.as_ref().and_then(Child::id) {
            // Thaw first so kill_on_drop's SIGKILL is not left pending on a stopped process.
            send(pid, libc::SIGCONT);
        }
    }
}

/// Sends signal `sig` to process `pid` (a stale pid is ignored).
#[allow(unsafe_code)]
pub fn send(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions; a stale pid at worst fails with ESRCH.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Makes the child receive SIGKILL when the test process dies, even by SIGKILL, so no etcd
/// outlives a test run; and puts it in a process group of its own, so a Ctrl-C at the terminal
/// reaches the harness (which stops it in order) and not the member directly.
#[allow(unsafe_code)]
fn die_with_parent(cmd: &mut Command) {
    cmd.process_group(0);
    // SAFETY: the closure runs between fork and exec and only calls prctl(2), which is
    // async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}
