//! The command line as scripts use it: exit codes and what is printed.

use std::process::Command;

use mirror_core::testing::MINIMAL_CONFIG;

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_mirror-agent"))
}

fn write(text: &str) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), text).unwrap();
    f
}

/// A valid file with a target user whose password comes from the environment.
fn valid() -> String {
    format!("{MINIMAL_CONFIG}[target.auth]\nusername = \"mirror\"\npassword_env = \"TARGET_PASSWORD\"\n")
}

/// A valid file exits 0 and prints the effective config, defaults included.
#[test]
fn check_config_prints_effective_config() {
    let f = write(&valid());
    let out = agent().arg("check-config").arg(f.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("link_uid = \"orders-dr\""), "{text}");
    assert!(text.contains("max_txn_ops = 128"), "{text}");
    assert!(text.contains("watch_buffer_bytes = \"16MiB\""), "{text}");
}

/// An invalid file exits 2 and names every broken field with its rule.
#[test]
fn check_config_rejects_with_exit_2_and_field_names() {
    let f = write(&valid().replace("link_uid = \"orders-dr\"", "epoch = 0"));
    let out = agent().arg("check-config").arg(f.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("link_uid: is required"), "{err}");
    assert!(err.contains("epoch: must be >= 1"), "{err}");
}

/// An inline password is refused and never echoed.
#[test]
fn check_config_never_echoes_a_password() {
    let f = write(&valid().replace("password_env = \"TARGET_PASSWORD\"", "password = \"hunter2\""));
    let out = agent().arg("check-config").arg(f.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!all.contains("hunter2"), "{all}");
    assert!(all.contains("target.auth.password"), "{all}");
}

/// A missing file is a config error too.
#[test]
fn check_config_missing_file_exits_2() {
    let out = agent().arg("check-config").arg("/nonexistent/mirror.toml").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// The config shipped in the Kubernetes manifest is valid.
#[test]
fn kubernetes_example_config_is_valid() {
    let manifest = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/kubernetes/etcd-mirror.yaml"
    ))
    .unwrap();
    let block: String = manifest
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("mirror.toml: |"))
        .skip(1)
        .take_while(|l| l.starts_with("    ") || l.trim().is_empty())
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    assert!(block.contains("link_uid"), "no config block found");
    let f = write(&block);
    let out = agent().arg("check-config").arg(f.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `status` against nothing listening fails with a message naming the URL.
#[test]
fn status_names_an_unreachable_agent() {
    let out = agent().args(["status", "--url", "http://127.0.0.1:9"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("http://127.0.0.1:9/statusz"), "{err}");
}
