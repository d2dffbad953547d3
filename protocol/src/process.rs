//! Process (command) wire types, shared by every provider and the APIs.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What to run: an argv vector (never interpreted by a shell) or a shell command line
/// (run as `bash -lc <cmd>` where bash exists, else `sh -c`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Program and arguments.
    Argv(Vec<String>),
    /// A shell command line.
    Shell(String),
}

/// What the command's standard input is.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case", deny_unknown_fields)]
pub enum StdinMode {
    /// `/dev/null`.
    #[default]
    Ignore,
    /// A pipe the caller writes to (`write_stdin`, `close_stdin`).
    Pipe,
    /// Fixed bytes, then end of file.
    Data {
        /// The bytes, base64 on the wire.
        #[serde(with = "crate::b64")]
        data: Vec<u8>,
    },
}

/// Size of a pseudo-terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    /// Rows.
    pub rows: u16,
    /// Columns.
    pub cols: u16,
}

/// The full specification of a command. The seam applies no hidden defaults: what is
/// not set here is the documented default of the field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessSpec {
    /// What to run.
    pub command: Command,
    /// Working directory, a sandbox path (relative paths resolve against the workspace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Environment changes over the sandbox's base environment: `Some(v)` sets, `None`
    /// removes the variable.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, Option<String>>,
    /// Standard input.
    #[serde(default)]
    pub stdin: StdinMode,
    /// Capture cap of stdout: the first this-many bytes are delivered; the rest is drained
    /// (the command never blocks on a full pipe) and dropped, and `Exited` reports the true
    /// totals. `None`: the provider's default cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_max_bytes: Option<u64>,
    /// Same for stderr.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_max_bytes: Option<u64>,
    /// Run under a pseudo-terminal of this size (stdout and stderr are then one stream).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// Milliseconds between SIGTERM and SIGKILL when terminating.
    #[serde(default = "default_grace_ms")]
    pub grace_ms: u64,
    /// A client-chosen id (tag) to find the command again after a broken stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_id: Option<String>,
    /// User to run as, where the provider supports it (E2B: `user` or `root`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// Default grace period between SIGTERM and SIGKILL.
pub const DEFAULT_GRACE_MS: u64 = 3_000;

fn default_grace_ms() -> u64 {
    DEFAULT_GRACE_MS
}

impl ProcessSpec {
    /// A spec for a shell command line with every other field at its default.
    pub fn shell(cmd: impl Into<String>) -> Self {
        Self::new(Command::Shell(cmd.into()))
    }

    /// A spec for an argv vector with every other field at its default.
    pub fn argv<I, S>(argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self::new(Command::Argv(argv.into_iter().map(Into::into).collect()))
    }

    fn new(command: Command) -> Self {
        Self {
            command,
            cwd: None,
            env: BTreeMap::new(),
            stdin: StdinMode::Ignore,
            stdout_max_bytes: None,
            stderr_max_bytes: None,
            pty: None,
            grace_ms: DEFAULT_GRACE_MS,
            command_id: None,
            user: None,
        }
    }
}

/// Which output stream a chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamKind {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
    /// The pseudo-terminal (stdout and stderr merged).
    Pty,
}

/// How a command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// The exit code, if it exited normally.
    pub code: Option<i32>,
    /// The signal number that ended it, if any.
    pub signal: Option<i32>,
}

impl ExitStatus {
    /// `true` for a normal exit with code 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// One event of a command's output stream. Offsets are whole-stream byte coordinates
/// per [`StreamKind`], so a broken stream can be resumed exactly.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ProcessEvent {
    /// The command started.
    Started {
        /// The command id (client-chosen or generated).
        command_id: String,
        /// The process (group leader) id inside the sandbox.
        pid: u32,
    },
    /// Bytes of output.
    Output {
        /// Which stream.
        stream: StreamKind,
        /// Offset of the first byte of `data` in the whole stream.
        offset: u64,
        /// The bytes, base64 on the wire.
        #[serde(with = "crate::b64")]
        data: Vec<u8>,
    },
    /// The command ended. Always the last event.
    Exited {
        /// How it ended.
        status: ExitStatus,
        /// Bytes the command wrote to stdout (or the pty), including any beyond the capture cap.
        stdout_bytes: u64,
        /// Bytes the command wrote to stderr, including any beyond the capture cap.
        stderr_bytes: u64,
    },
}

/// A summary of one running or finished command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// The command id.
    pub command_id: String,
    /// The pid inside the sandbox.
    pub pid: u32,
    /// What it runs.
    pub command: Command,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Whether it runs under a pty.
    pub pty: bool,
    /// How it ended, if it has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ExitStatus>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_defaults_and_round_trip() {
        let spec: ProcessSpec = serde_json::from_str(r#"{"command":{"shell":"echo hi"}}"#).unwrap();
        assert_eq!(spec, ProcessSpec::shell("echo hi"));
        let mut s = ProcessSpec::argv(["ls", "-l"]);
        s.env.insert("A".into(), Some("1".into()));
        s.env.insert("B".into(), None);
        s.stdin = StdinMode::Data {
            data: b"in".to_vec(),
        };
        let j = serde_json::to_string(&s).unwrap();
        assert!(
            j.contains(r#""stdin":{"mode":"data","data":"aW4="}"#),
            "{j}"
        );
        assert_eq!(serde_json::from_str::<ProcessSpec>(&j).unwrap(), s);
        assert!(
            serde_json::from_str::<ProcessSpec>(r#"{"command":{"shell":"x"},"bogus":1}"#).is_err()
        );
    }

    #[test]
    fn output_event_carries_base64() {
        let e = ProcessEvent::Output {
            stream: StreamKind::Stdout,
            offset: 5,
            data: b"hi".to_vec(),
        };
        let j = serde_json::to_string(&e).unwrap();
        assert_eq!(
            j,
            r#"{"type":"output","stream":"stdout","offset":5,"data":"aGk="}"#
        );
        assert_eq!(serde_json::from_str::<ProcessEvent>(&j).unwrap(), e);
    }
}
