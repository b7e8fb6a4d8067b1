//! # harness
//!
//! Real etcd servers, faults and scenarios for etcd-mirror's tests and benchmarks.
//!
//! - [`EtcdCluster`]: 1 or 3 members of etcd 3.5.30, 3.5.16, 3.5.1 or 3.4.23, as Docker containers
//!   ([`Backend::Container`], the default when a Docker engine answers) or local processes
//!   ([`Backend::Process`], or `HARNESS_BACKEND=process`). Members can be stopped, killed,
//!   started, restarted with other flags, paused and unpaused.
//! - [`FaultProxy`] / [`Proxies`]: cut and heal the network between the agent and one side.
//! - [`AgentProcess`]: the real `mirror-agent` binary with a generated [`AgentConfig`], its
//!   `/statusz`, SIGTERM and kill -9; as a child process or, [`AgentBackend::Container`], as a
//!   container of the image `scripts/image.sh` builds, on the etcd containers' networks;
//!   [`Scraped`]: its `/metrics`, histograms read as the difference of two scrapes.
//! - [`pki`]: a throwaway CA with server and client certificates; [`ClusterSpec::tls`] makes a
//!   cluster serve them and require client certificates.
//! - [`check_g3`]: target == source at the checkpoint watermark, callable at any moment.
//! - [`promtool`](mod@promtool): the alert rules in deploy/prometheus under `promtool`, with a
//!   unit test made from healthy agents' scrapes.
//! - [`demo`]: the main job on an embedded default, with progress and a live tail view.
//! - [`scenario`]: scenario files (SPEC §8) and their runner, and the waits, counts and checks
//!   scenario tests share; [`chaos`]: random fault schedules written as scenario files;
//!   [`bench`](mod@bench): the figures `harness bench` prints, each next to a baseline from the
//!   same run.
//!
//! ## What it deliberately does not do
//! It never links the agent's engine: scenarios drive the `mirror-agent` *binary*, as an
//! operator would, so what is tested is what ships.

mod agent;
pub mod bench;
pub mod chaos;
mod check;
mod container;
pub mod demo;
mod etcd;
pub mod exact;
pub mod figures;
mod load;
pub mod pki;
mod plan;
pub mod plot;
mod ports;
mod process;
pub mod promtool;
mod proxy;
pub mod scenario;

pub use agent::{
    agent_binary, agent_command, AgentBackend, AgentConfig, AgentProcess, Observed, Scraped, AGENT_IMAGE,
};
pub use check::{check_g3, check_g3_leases, difference_now, read_window, G3Violation, G3};
pub use container::LABEL as CONTAINER_LABEL;
pub use etcd::{
    agent_client, docker_ready, tools_dir, wait_serving, Backend, ClusterSpec, EtcdCluster, EtcdVersion,
    Node, Proxies,
};
pub use load::{load_cycling, load_keys, load_leased_keys, Churn, ChurnReport};
pub use ports::free_ports;
pub use process::send as send_signal;
pub use proxy::FaultProxy;
