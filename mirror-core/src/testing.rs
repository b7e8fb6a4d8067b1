//! Helpers for unit tests of this crate and the crates above it (feature `testing`).

use etcd_client::KvClient;

/// The smallest valid config file: a link between two local clusters, one prefix, every other
/// setting at its default.
pub const MINIMAL_CONFIG: &str = r#"
link_uid = "orders-dr"
[source]
endpoints = ["http://127.0.0.1:2379"]
prefix = "/registry/"
[target]
endpoints = ["http://127.0.0.1:3379"]
prefix = "/registry/"
"#;

/// A KV client that never dials: for tests of paging and batching decisions, not of answers.
pub async fn lazy_kv() -> KvClient {
    let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy();
    etcd_client::Client::from_channel(etcd_client::Channel::Tonic(channel), None)
        .await
        .expect("a lazy channel needs no server")
        .kv_client()
}
