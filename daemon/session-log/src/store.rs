//! The on-disk layout of session logs: paths, ids, publishing a new log atomically, taking
//! the single-writer lock, and parsing `events.jsonl` (telling a torn tail from corruption).
//!
//! Everything here is blocking file I/O; callers run it on the blocking pool.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde_json::error::Category;
use tether_protocol::SESSION_LOG_VERSION;
use tether_protocol::events::{Event, SessionHeader};

use super::LogError;

/// The events file of a session directory.
pub const EVENTS_FILE: &str = "events.jsonl";
/// The directory of command output journals inside a session directory.
pub const OUTPUT_DIR: &str = "output";
/// The directory of session directories inside the state directory.
pub const SESSIONS_DIR: &str = "sessions";
const TMP_FILE: &str = ".events.jsonl.tmp";
const MAX_ID_LEN: usize = 128;

/// The events file locked for writing; the lock is released when it is dropped.
pub(crate) type LockedFile = Flock<File>;

/// `<state_dir>/sessions`.
pub fn sessions_dir(state_dir: &Path) -> PathBuf {
    state_dir.join(SESSIONS_DIR)
}

/// `<state_dir>/sessions/<id>`, after checking that `id` is a safe file name.
pub fn session_dir(state_dir: &Path, id: &str) -> Result<PathBuf, LogError> {
    validate_id("session id", id)?;
    Ok(sessions_dir(state_dir).join(id))
}

/// A session or command id must be usable as one path component: 1 to 128 characters of
/// `[A-Za-z0-9._-]`, not starting with a dot.
pub fn validate_id(what: &str, id: &str) -> Result<(), LogError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && !id.starts_with('.')
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(LogError::InvalidRequest {
            reason: format!(
                "{what} {id:?} must be 1 to {MAX_ID_LEN} characters of [A-Za-z0-9._-], not starting with a dot"
            ),
        })
    }
}

pub(crate) fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> LogError {
    let path = path.to_owned();
    move |source| LogError::Io { op, path, source }
}

/// Make a directory entry durable: fsync the directory that holds it.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), LogError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync directory", dir))
}

/// Create `dir` (and its parents) and make its entry durable.
pub(crate) fn create_dir_durable(dir: &Path) -> Result<(), LogError> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).map_err(io("create directory", dir))?;
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    Ok(())
}

/// Take the exclusive writer lock of an events file, or report the other writer.
pub(crate) fn lock(file: File, path: &Path) -> Result<LockedFile, LogError> {
    Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| match errno {
        nix::errno::Errno::EWOULDBLOCK => LogError::Conflict {
            reason: format!(
                "session log {} is already open by another writer",
                path.display()
            ),
        },
        other => LogError::Io {
            op: "lock",
            path: path.to_owned(),
            source: other.into(),
        },
    })
}

/// Publish a new log in `dir`: the header and `events` are written to a temporary file,
/// synced, then hard-linked to `events.jsonl` (which fails if a log is already there, so
/// a session is never overwritten), and the directory is synced. A crash leaves either no
/// log or the complete one. Returns the locked events file and where its lines are.
pub(crate) fn publish_new(
    dir: &Path,
    header: &SessionHeader,
    events: &[Event],
) -> Result<(LockedFile, Layout), LogError> {
    let path = dir.join(EVENTS_FILE);
    if path.exists() {
        return Err(exists(dir));
    }
    create_dir_durable(dir)?;
    let tmp = dir.join(TMP_FILE);
    let mut buf = serde_json::to_vec(header).map_err(|e| LogError::InvalidRequest {
        reason: format!("header: {e}"),
    })?;
    buf.push(b'\n');
    let mut layout = Layout {
        header_len: buf.len() as u64,
        line_lens: Vec::with_capacity(events.len()),
    };
    for e in events {
        let at = buf.len();
        serde_json::to_writer(&mut buf, e).map_err(|e| LogError::InvalidRequest {
            reason: format!("event: {e}"),
        })?;
        buf.push(b'\n');
        layout.line_lens.push((buf.len() - at) as u64);
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(io("create", &tmp))?;
    f.write_all(&buf).map_err(io("write", &tmp))?;
    f.sync_all().map_err(io("fsync", &tmp))?;
    drop(f);
    let linked = std::fs::hard_link(&tmp, &path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(exists(dir)),
        Err(e) => return Err(io("link", &path)(e)),
    }
    sync_dir(dir)?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(io("open", &path))?;
    Ok((lock(file, &path)?, layout))
}

/// Where a log's lines are: the header's length and each event line's, in order.
#[derive(Debug, Default)]
pub(crate) struct Layout {
    pub header_len: u64,
    pub line_lens: Vec<u64>,
}

fn exists(dir: &Path) -> LogError {
    LogError::Conflict {
        reason: format!("a session log already exists in {}", dir.display()),
    }
}

/// Open and lock an existing log and read all of it.
pub(crate) fn open_existing(dir: &Path) -> Result<(LockedFile, Vec<u8>), LogError> {
    let path = dir.join(EVENTS_FILE);
    let file = match OpenOptions::new().read(true).write(true).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(LogError::NotFound { path });
        }
        Err(e) => return Err(io("open", &path)(e)),
    };
    let mut file = lock(file, &path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(io("read", &path))?;
    Ok((file, bytes))
}

/// Read a log without locking it (for verification against what the writer holds).
pub(crate) fn read_all(dir: &Path) -> Result<Vec<u8>, LogError> {
    let path = dir.join(EVENTS_FILE);
    std::fs::read(&path).map_err(io("read", &path))
}

/// A parsed log.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub header: SessionHeader,
    pub events: Vec<Event>,
    /// Where the valid lines are.
    pub layout: Layout,
    /// Length of the valid prefix (everything before a torn tail).
    pub valid_len: u64,
}

/// Parse `events.jsonl`. A torn tail (a last line without its newline, or a last line that
/// is not even JSON syntax) ends the valid prefix; anything wrong before it, or a
/// well-formed line that is not a valid event (an unknown type, a seq out of order), is
/// corruption and refused: dropping it would silently rewrite history.
pub(crate) fn parse(bytes: &[u8], path: &Path) -> Result<Parsed, LogError> {
    let corrupt = |line: u64, reason: String| LogError::Corrupt {
        path: path.to_owned(),
        line,
        reason,
    };
    let Some(nl) = bytes.iter().position(|&b| b == b'\n') else {
        return Err(corrupt(1, "no complete header line".into()));
    };
    let header: SessionHeader = serde_json::from_slice(&bytes[..nl])
        .map_err(|e| corrupt(1, format!("invalid header: {e}")))?;
    if header.kind != "session" {
        return Err(corrupt(
            1,
            format!("header type is {:?}, not \"session\"", header.kind),
        ));
    }
    if header.version != SESSION_LOG_VERSION {
        return Err(corrupt(
            1,
            format!(
                "unsupported log version {} (this daemon reads {SESSION_LOG_VERSION})",
                header.version
            ),
        ));
    }
    let mut events = Vec::new();
    let mut layout = Layout {
        header_len: nl as u64 + 1,
        line_lens: Vec::new(),
    };
    let mut pos = nl + 1;
    let mut line_no = 1u64;
    while pos < bytes.len() {
        line_no += 1;
        let rest = &bytes[pos..];
        let Some(len) = rest.iter().position(|&b| b == b'\n') else {
            // No newline: the write of this line never completed.
            break;
        };
        let next = pos + len + 1;
        let is_last = next == bytes.len();
        match serde_json::from_slice::<Event>(&rest[..len]) {
            Ok(event) => {
                if event.seq != events.len() as u64 {
                    return Err(corrupt(
                        line_no,
                        format!("seq {} where {} was expected", event.seq, events.len()),
                    ));
                }
                events.push(event);
                layout.line_lens.push(len as u64 + 1);
            }
            Err(e) if is_last && matches!(e.classify(), Category::Syntax | Category::Eof) => break,
            Err(e) => return Err(corrupt(line_no, e.to_string())),
        }
        pos = next;
    }
    Ok(Parsed {
        header,
        events,
        layout,
        valid_len: pos as u64,
    })
}

/// What a closed session's log says without reading all of it: its header and its last
/// event, a `session/closed`.
#[derive(Debug, Clone)]
pub struct ClosedSummary {
    /// The header line.
    pub header: SessionHeader,
    /// The number of events (the last seq + 1).
    pub events: u64,
    /// When it was closed, ms since the epoch.
    pub closed_ms: i64,
}

/// Bytes read from the end of a log to find its last line.
const TAIL_PROBE: u64 = 64 * 1024;

/// Read the header and the last line of `dir`'s log: `Some` when the log ends with a
/// complete `session/closed` event (nothing to repair), `None` when it does not (a live
/// session, or a torn tail that opening repairs). An unreadable header is an error.
pub(crate) fn closed_summary_blocking(dir: &Path) -> Result<Option<ClosedSummary>, LogError> {
    use std::io::{BufRead, BufReader, Seek, SeekFrom};
    let path = dir.join(EVENTS_FILE);
    let mut file = File::open(&path).map_err(io("open", &path))?;
    let len = file.metadata().map_err(io("stat", &path))?.len();
    let mut first = Vec::new();
    BufReader::new(&mut file)
        .read_until(b'\n', &mut first)
        .map_err(io("read", &path))?;
    let header: SessionHeader = serde_json::from_slice(&first).map_err(|e| LogError::Corrupt {
        path: path.clone(),
        line: 1,
        reason: format!("invalid header: {e}"),
    })?;
    if header.kind != "session" || header.version != SESSION_LOG_VERSION {
        return Err(LogError::Corrupt {
            path,
            line: 1,
            reason: format!(
                "a session header has type \"session\" and version {SESSION_LOG_VERSION}"
            ),
        });
    }
    let start = len.saturating_sub(TAIL_PROBE).max(first.len() as u64);
    file.seek(SeekFrom::Start(start))
        .map_err(io("seek", &path))?;
    let mut tail = Vec::new();
    file.read_to_end(&mut tail).map_err(io("read", &path))?;
    let Some(body) = tail.strip_suffix(b"\n") else {
        return Ok(None);
    };
    let last = body
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(body, |i| &body[i + 1..]);
    let closed = match serde_json::from_slice::<Event>(last) {
        Ok(e)
            if matches!(
                e.body,
                tether_protocol::events::EventBody::SessionClosed { .. }
            ) =>
        {
            Some(ClosedSummary {
                header,
                events: e.seq + 1,
                closed_ms: e.time,
            })
        }
        _ => None,
    };
    Ok(closed)
}

/// The ids of the sessions stored in `dir` (a sessions directory), sorted.
pub(crate) fn list_sessions_blocking(dir: &Path) -> Result<Vec<String>, LogError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io("list", dir)(e)),
    };
    let mut ids = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io("list", dir))?;
        let Ok(id) = entry.file_name().into_string() else {
            continue;
        };
        if validate_id("session id", &id).is_ok() && entry.path().join(EVENTS_FILE).is_file() {
            ids.push(id);
        }
    }
    ids.sort();
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_must_be_single_safe_path_components() {
        for ok in ["s1", "a.b-c_D", "0123456789abcdef"] {
            validate_id("id", ok).unwrap();
        }
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "a/b",
            "a\\b",
            "a b",
            "é",
            &"x".repeat(129),
        ] {
            let err = validate_id("id", bad).unwrap_err();
            assert_eq!(
                err.code(),
                tether_protocol::ErrorCode::InvalidRequest,
                "{bad:?}"
            );
        }
    }
}
