//! One test per scenario file: `harness/scenarios/NAME.toml` becomes the test
//! `scenarios::NAME` (dashes as underscores), so adding a file adds a test without touching Rust.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|name| name.ends_with(".toml"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    let mut out = String::new();
    for file in files {
        let name: String = file
            .trim_end_matches(".toml")
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' })
            .collect();
        writeln!(
            out,
            "#[tokio::test(flavor = \"multi_thread\", worker_threads = 2)]\nasync fn {name}() {{\n    run_scenario({file:?}).await;\n}}\n"
        )
        .unwrap();
    }
    let path = Path::new(&std::env::var("OUT_DIR").unwrap()).join("scenario_tests.rs");
    std::fs::write(path, out).unwrap();
}
