//! The one exit-code table of every command (docs/operations.md, "Exit codes", is this table
//! with the tests that provoke each code). A command returns an [`Exit`]; only `main` turns it
//! into a process exit code.

use std::process::ExitCode;

/// How a command ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// 0: it did what was asked (valid, equal, promoted, retired, plan written, stopped by a
    /// signal).
    Done,
    /// 1: it ran and says no, having changed nothing it should not: the sides differ, refused
    /// (the source answers, an HA lease lives, the old source is behind), not promoted.
    No,
    /// 2: the config is invalid (every violation named), or `run` cannot bind its HTTP address.
    Config,
    /// 3: it could not start, and nothing happened: no checkpoint, a side unreachable, a file
    /// that cannot be written.
    CannotStart,
    /// 4: `cutover`: promoted, but the source took writes after the drain target.
    PromotedSourceMoved,
    /// 5: `cutover`: promoted, but the source could not be read afterwards to check.
    PromotedUnchecked,
    /// 6: `failover` or `cutover` of an exact link: promoted, but a step after it failed (the
    /// fillers, the compaction past Rs, the lease swap); the same command run again finishes it.
    PromotedIncomplete,
}

impl Exit {
    /// The process exit code.
    pub fn code(self) -> u8 {
        match self {
            Exit::Done => 0,
            Exit::No => 1,
            Exit::Config => 2,
            Exit::CannotStart => 3,
            Exit::PromotedSourceMoved => 4,
            Exit::PromotedUnchecked => 5,
            Exit::PromotedIncomplete => 6,
        }
    }
}

/// A one-shot command's outcome as the process exit code: an error is printed, naming the
/// command, and ends the process as `on_error`.
pub fn reported(command: &str, outcome: anyhow::Result<Exit>, on_error: Exit) -> ExitCode {
    match outcome {
        Ok(exit) => exit.into(),
        Err(e) => {
            eprintln!("mirror-agent {command}: {e:#}");
            on_error.into()
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> ExitCode {
        ExitCode::from(exit.code())
    }
}

#[cfg(test)]
mod tests {
    use super::Exit;

    /// The codes are the documented ones, each used once.
    #[test]
    fn codes_are_the_documented_table() {
        let all = [
            Exit::Done,
            Exit::No,
            Exit::Config,
            Exit::CannotStart,
            Exit::PromotedSourceMoved,
            Exit::PromotedUnchecked,
            Exit::PromotedIncomplete,
        ];
        let codes: Vec<u8> = all.iter().map(|e| e.code()).collect();
        assert_eq!(codes, [0, 1, 2, 3, 4, 5, 6]);
        let table = include_str!("../../docs/operations.md");
        let row = |cmd: &str| table.lines().find(|l| l.starts_with(&format!("| `{cmd}"))).map(str::to_owned);
        for cmd in [
            "check-config",
            "run",
            "status",
            "verify",
            "cutover",
            "failover",
            "retire",
            "failback-plan",
            "snapshot save",
        ] {
            assert!(row(cmd).is_some(), "docs/operations.md's exit-code table has a row for {cmd}");
        }
    }
}
