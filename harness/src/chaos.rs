//! `harness chaos --seed N --duration D [--faults LIST]`: a random schedule of faults over live
//! churn, written as a scenario file (SPEC §8) and run by the scenario runner.
//!
//! The schedule is a pure function of the seed, the duration and the fault list, so a seed
//! reproduces the run; on failure the schedule is also written to `chaos-SEED.toml`, which
//! `harness scenario` replays without the chaos generator. Every run ends with every fault
//! healed, the churn finished, `expect equal` and `verify` exit 0, and the continuous G3
//! checker has watched all of it.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use mirror_core::HumanDuration;

use crate::load::SplitMix64;
use crate::scenario::step::{self as kinds, Step};
use crate::scenario::{parse_until, MemberRef, RevisionRef, Scenario, SideName, Signal};

/// A fault the schedule may pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// kill -9 the agent, then start it again.
    AgentKill,
    /// SIGSTOP the agent, hold, SIGCONT.
    AgentStop,
    /// SIGTERM the agent, then start it again.
    AgentRestart,
    /// Kill a random member of a random side, hold, start it.
    MemberKill,
    /// Pause a random member, hold, resume it.
    MemberPause,
    /// Kill the leader of a random side, hold, start it.
    LeaderKill,
    /// Blackhole agent <-> a side, hold, heal.
    Partition,
    /// Delay agent <-> a side, hold, heal.
    Delay,
    /// Compact the source at its current revision.
    Compaction,
    /// Defragment a side.
    Defrag,
    /// A second agent with a higher epoch takes over; the old one is stopped.
    FenceBump,
    /// A 500-key range delete and a 128-op Txn.
    BigRevision,
    /// Puts of 200 KiB values.
    BigValues,
}

impl Fault {
    /// Every fault, in the order `--faults` names them.
    pub const ALL: [(Fault, &'static str); 13] = [
        (Fault::AgentKill, "agent_kill"),
        (Fault::AgentStop, "agent_stop"),
        (Fault::AgentRestart, "agent_restart"),
        (Fault::MemberKill, "member_kill"),
        (Fault::MemberPause, "member_pause"),
        (Fault::LeaderKill, "leader_kill"),
        (Fault::Partition, "partition"),
        (Fault::Delay, "delay"),
        (Fault::Compaction, "compaction"),
        (Fault::Defrag, "defrag"),
        (Fault::FenceBump, "fence_bump"),
        (Fault::BigRevision, "big_revision"),
        (Fault::BigValues, "big_values"),
    ];

    /// Parses a `--faults` name.
    pub fn parse(name: &str) -> anyhow::Result<Fault> {
        Fault::ALL.iter().find(|(_, n)| *n == name.trim()).map(|(f, _)| *f).ok_or_else(|| {
            let names: Vec<&str> = Fault::ALL.iter().map(|(_, n)| *n).collect();
            anyhow::anyhow!("unknown fault {name:?} (one of {})", names.join(", "))
        })
    }
}

/// Churn rate of a chaos run, writes/s.
const CHURN_RATE: u32 = 200;

/// A schedule being written.
struct Schedule {
    rng: SplitMix64,
    text: String,
    /// Seconds of schedule written so far.
    seconds: f64,
    agent: u32,
    big: u32,
}

impl Schedule {
    fn below(&mut self, n: u64) -> u64 {
        self.rng.next() % n.max(1)
    }

    fn step(&mut self, step: &dyn Step) {
        self.step_with(step, "");
    }

    fn step_with(&mut self, step: &dyn Step, extra: &str) {
        let body = toml::to_string(step).expect("a step serializes");
        let _ = write!(self.text, "[[step]]\n{extra}{body}");
    }

    fn sleep(&mut self, millis: u64) {
        self.seconds += millis as f64 / 1e3;
        self.step(&kinds::Sleep { for_: HumanDuration(Duration::from_millis(millis)) });
    }

    fn hold(&mut self) {
        let ms = 1_000 + self.below(3_000);
        self.sleep(ms);
    }

    fn side(&mut self) -> SideName {
        if self.below(2) == 0 {
            SideName::Source
        } else {
            SideName::Target
        }
    }

    fn id(&self) -> String {
        ((b'a' + self.agent as u8) as char).to_string()
    }

    fn fault(&mut self, fault: Fault) {
        let id = self.id();
        match fault {
            Fault::AgentKill | Fault::AgentRestart => {
                let signal = if fault == Fault::AgentKill { Signal::Kill } else { Signal::Term };
                self.step(&kinds::StopAgent { id: id.clone(), signal, within: None });
                let ms = self.below(1_500);
                self.sleep(ms);
                self.step(&kinds::StartAgent { id, epoch: None, toml: None, reverse: false });
            }
            Fault::AgentStop => {
                self.step(&kinds::StopAgent { id: id.clone(), signal: Signal::Stop, within: None });
                self.hold();
                self.step(&kinds::StopAgent { id, signal: Signal::Cont, within: None });
            }
            Fault::MemberKill | Fault::LeaderKill | Fault::MemberPause => {
                let side = self.side();
                let member = match fault {
                    Fault::LeaderKill => MemberRef::Named("leader".into()),
                    _ => MemberRef::Index(self.below(3) as usize),
                };
                if fault == Fault::MemberPause {
                    self.step(&kinds::PauseMember { side, member: member.clone() });
                    self.hold();
                    self.step(&kinds::ResumeMember { side, member });
                } else {
                    self.step(&kinds::KillMember { side, member });
                    self.hold();
                    self.step(&kinds::StartMember { side, member: None });
                }
            }
            Fault::Partition | Fault::Delay => {
                let side = self.side();
                if fault == Fault::Partition {
                    self.step(&kinds::Partition { side });
                } else {
                    let ms = 50 + self.below(400);
                    self.step(&kinds::Delay { side, ms });
                }
                self.hold();
                self.step(&kinds::Heal { side });
            }
            Fault::Compaction => self.step(&kinds::Compact {
                side: SideName::Source,
                revision: RevisionRef::Named("current".into()),
                keep: 0,
            }),
            Fault::Defrag => {
                let side = self.side();
                self.step(&kinds::Defrag { side });
            }
            Fault::FenceBump => {
                self.agent += 1;
                let next = self.id();
                self.step(&kinds::StartAgent {
                    id: next.clone(),
                    epoch: Some(u64::from(self.agent) + 1),
                    toml: None,
                    reverse: false,
                });
                self.step(&kinds::Wait {
                    until: parse_until("phase:standby").expect("a state"),
                    timeout: HumanDuration::secs(90),
                    agent: id.clone(),
                });
                self.step(&kinds::StopAgent { id, signal: Signal::Term, within: None });
            }
            Fault::BigRevision => {
                self.big += 1;
                let prefix = format!("big-{}/", self.big);
                self.step(&kinds::Load {
                    side: SideName::Source,
                    keys: 500,
                    value_size: 32,
                    prefix: prefix.clone(),
                    lease: None,
                    lease_every: None,
                    lease_ttl: None,
                    keyspace: None,
                });
                self.step(&kinds::Del {
                    side: SideName::Source,
                    checkpoint: false,
                    key: None,
                    prefix: Some(prefix),
                    target_revisions: None,
                });
                self.step(&kinds::Txn { ops: 128, value_size: 32, prefix: format!("txn-{}/", self.big) });
            }
            Fault::BigValues => {
                for i in 0..3 {
                    self.step(&kinds::Put {
                        side: SideName::Source,
                        key: Some(format!("large-{i}")),
                        checkpoint: false,
                        value: None,
                        value_size: 200 * 1024,
                        outside_prefix: false,
                        lease: None,
                    });
                }
            }
        }
    }
}

/// The schedule for `seed` as scenario file text.
pub fn schedule(seed: u64, duration: Duration, faults: &[Fault]) -> String {
    let mut s = Schedule { rng: SplitMix64(seed), text: String::new(), seconds: 0.0, agent: 0, big: 0 };
    let ops = (duration.as_secs_f64() * f64::from(CHURN_RATE)) as usize;
    let _ = write!(
        s.text,
        "name = \"chaos-{seed}\"\nabout = \"harness chaos --seed {seed} --duration {}s: random faults over churn\"\nseed = {seed}\n\n\
         [source]\nmembers = 3\nprefix = \"/chaos/\"\n[target]\nmembers = 3\n\n\
         [agent]\ntoml = '''\n[sync]\nrequest_timeout = \"2s\"\ndial_timeout = \"1s\"\n'''\n\n",
        duration.as_secs()
    );
    s.step(&kinds::Load {
        side: SideName::Source,
        keys: 2_000,
        value_size: 100,
        prefix: String::new(),
        lease: None,
        lease_every: None,
        lease_ttl: None,
        keyspace: None,
    });
    s.step(&kinds::StartAgent { id: "a".into(), epoch: None, toml: None, reverse: false });
    s.step(&kinds::Wait {
        until: parse_until("condition:InitialSyncComplete=True").expect("a state"),
        timeout: HumanDuration::secs(90),
        agent: "a".into(),
    });
    s.step_with(
        &kinds::Churn {
            ops,
            rate: CHURN_RATE,
            keyspace: 3_000,
            value_size: 100,
            prefix: "churn/".into(),
            leases: true,
        },
        "background = true\n",
    );
    while s.seconds < duration.as_secs_f64() && !faults.is_empty() {
        let fault = faults[s.below(faults.len() as u64) as usize];
        s.fault(fault);
        let ms = 500 + s.below(2_000);
        s.sleep(ms);
    }
    // Heal everything, then judge.
    for side in [SideName::Source, SideName::Target] {
        s.step(&kinds::Heal { side });
        s.step(&kinds::StartMember { side, member: None });
    }
    s.step(&kinds::Wait {
        until: parse_until("background").expect("a state"),
        timeout: HumanDuration::secs(300),
        agent: "a".into(),
    });
    let id = s.id();
    s.step(&kinds::Expect {
        equal: Some(true),
        exact: None,
        phase: Some(mirror_core::Phase::Syncing),
        condition: None,
        forced_resyncs: None,
        g3: Some("held".into()),
        last_error: None,
        agent_exit: None,
        sole_writer_after: None,
        target_has: Vec::new(),
        target_lacks: Vec::new(),
        initial_sync_completed_older_than: None,
        min_scan_restarts: None,
        max_scan_restarts: None,
        max_peak_rss_mib: None,
        max_lag_revisions: None,
        min_watch_restarts: None,
        max_watch_restarts: None,
        during: None,
        checkpoint_role: None,
        target_still_for: None,
        leases_match: None,
        target_leases_gone: Vec::new(),
        target_leases_alive: Vec::new(),
        leases_within: None,
        log_once: Vec::new(),
        agent: id.clone(),
        timeout: HumanDuration::secs(180),
    });
    s.step(&kinds::Verify { id, expect: 0 });
    s.text
}

/// Runs a chaos schedule; on failure writes it to `chaos-SEED.toml` in `dir` and says so.
pub async fn run(
    seed: u64,
    duration: Duration,
    faults: &[Fault],
    dir: PathBuf,
    opts: &crate::scenario::RunOptions,
) -> anyhow::Result<()> {
    println!("chaos seed {seed} (duration {}s)", duration.as_secs());
    let text = schedule(seed, duration, faults);
    let scenario = Scenario::parse(&text)?;
    let outcome = crate::scenario::run(&scenario, opts).await;
    if outcome.is_err() {
        let path = dir.join(format!("chaos-{seed}.toml"));
        std::fs::write(&path, &text)?;
        println!(
            "the schedule is in {}; replay it with: harness scenario {}",
            path.display(),
            path.display()
        );
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seed always gives the same schedule, the schedule parses as a scenario file, every
    /// fault is healed before the end, and the run ends with expect equal and verify.
    #[test]
    fn schedules_are_reproducible_and_end_healed() {
        let all: Vec<Fault> = Fault::ALL.iter().map(|(f, _)| *f).collect();
        let a = schedule(42, Duration::from_secs(60), &all);
        assert_eq!(a, schedule(42, Duration::from_secs(60), &all));
        assert_ne!(a, schedule(43, Duration::from_secs(60), &all));
        let parsed = Scenario::parse(&a).unwrap();
        let kinds: Vec<String> = parsed.steps.iter().map(|s| kinds::kind(s.step.as_ref())).collect();
        assert!(kinds.len() > 10, "{kinds:?}");
        assert_eq!(&kinds[kinds.len() - 2..], ["expect", "verify"]);
        let pauses = kinds.iter().filter(|k| **k == "pause_member").count();
        assert_eq!(pauses, kinds.iter().filter(|k| **k == "resume_member").count());
        let stops = parsed
            .steps
            .iter()
            .filter(|s| toml::to_string(s.step.as_ref()).unwrap().contains("signal = \"STOP\""))
            .count();
        let conts = parsed
            .steps
            .iter()
            .filter(|s| toml::to_string(s.step.as_ref()).unwrap().contains("signal = \"CONT\""))
            .count();
        assert_eq!(stops, conts);
    }

    /// `--faults` names are checked.
    #[test]
    fn fault_names_parse() {
        assert_eq!(Fault::parse("leader_kill").unwrap(), Fault::LeaderKill);
        assert!(Fault::parse("meteor").unwrap_err().to_string().contains("agent_kill"));
    }
}
