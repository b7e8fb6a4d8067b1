//! `mirror-agent`: the etcd-mirror daemon and its command line (SPEC §4).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use mirror_core::{Config, ConfigError};

/// Exit code of a config error, so scripts can tell "fix the file" from "the engine failed".
const EXIT_CONFIG: u8 = 2;

#[derive(Parser)]
#[command(name = "mirror-agent", version, about = "One-way, fenced, resumable mirror of an etcd key range")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a config file and print the effective config with secrets redacted.
    CheckConfig {
        /// The TOML config file.
        file: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::CheckConfig { file } => check_config(&file),
    }
}

fn check_config(file: &std::path::Path) -> ExitCode {
    match Config::load(file) {
        Ok(config) => {
            print!("{}", config.to_redacted_toml());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mirror-agent: {}: {e}", file.display());
            if let ConfigError::Read { .. } = e {
                eprintln!("mirror-agent: (the file could not be read)");
            }
            ExitCode::from(EXIT_CONFIG)
        }
    }
}
