//! Fork: a new session seeded with a prefix of this one.
//!
//! The prefix must end outside an open turn (as in dsh, an inside boundary is refused, not
//! clipped: a half turn would hand the child dangling calls). The default boundary is the
//! last event outside the open turn, or the last event when no turn is open. The child's
//! header names its parent and seed length, the output journals of the commands the prefix
//! mentions are copied (up to the byte counts the prefix recorded), and the child's first
//! own event is `session/end-seed`.

use std::path::Path;

use tether_protocol::events::{Event, EventBody};
use tether_protocol::process::StreamKind;

use super::LogError;
use super::index::OpenTurn;
use super::journal::stream_path;
use super::store::{self, io};

/// The inclusive last seq of the prefix to copy (`None`: an empty prefix).
pub(crate) fn boundary(
    events: &[Event],
    open_turn: Option<OpenTurn>,
    at_seq: Option<u64>,
) -> Result<Option<u64>, LogError> {
    let Some(at) = at_seq else {
        return Ok(match open_turn {
            Some(open) => open.start_seq.checked_sub(1),
            None => (events.len() as u64).checked_sub(1),
        });
    };
    if at >= events.len() as u64 {
        return Err(LogError::InvalidRequest {
            reason: format!(
                "fork boundary {at} is beyond the end of the log ({} events)",
                events.len()
            ),
        });
    }
    let mut open = None;
    for e in &events[..=at as usize] {
        match &e.body {
            EventBody::TurnStart { turn, .. } => open = Some((*turn, e.seq)),
            EventBody::TurnEnd { .. } => open = None,
            _ => {}
        }
    }
    match open {
        None => Ok(Some(at)),
        Some((turn, start)) => Err(LogError::Conflict {
            reason: format!("fork boundary {at} is inside turn {turn}, open since seq {start}"),
        }),
    }
}

/// Copy the journals of the commands `prefix` mentions from `from` (a session directory)
/// to `to`, each stream cut at the length the prefix recorded for it (its
/// `process/exited`), or at its current length for a command still running at the boundary.
pub(crate) fn copy_journals(prefix: &[Event], from: &Path, to: &Path) -> Result<(), LogError> {
    let mut commands: Vec<(&str, Option<(u64, u64)>)> = Vec::new();
    for e in prefix {
        match &e.body {
            EventBody::ProcessStarted { command_id, .. }
                if !commands.iter().any(|(c, _)| c == command_id) =>
            {
                commands.push((command_id, None));
            }
            EventBody::ProcessExited {
                command_id,
                stdout_bytes,
                stderr_bytes,
                ..
            } => match commands.iter_mut().find(|(c, _)| c == command_id) {
                Some((_, lens)) => *lens = Some((*stdout_bytes, *stderr_bytes)),
                None => commands.push((command_id, Some((*stdout_bytes, *stderr_bytes)))),
            },
            _ => {}
        }
    }
    let (src_dir, dst_dir) = (from.join(store::OUTPUT_DIR), to.join(store::OUTPUT_DIR));
    for (command_id, lens) in commands {
        if store::validate_id("command id", command_id).is_err() {
            continue;
        }
        for stream in [StreamKind::Stdout, StreamKind::Stderr, StreamKind::Pty] {
            let src = stream_path(&src_dir, command_id, stream);
            if !src.is_file() {
                continue;
            }
            store::create_dir_durable(&dst_dir)?;
            let dst = stream_path(&dst_dir, command_id, stream);
            let copied = std::fs::copy(&src, &dst).map_err(io("copy", &src))?;
            let limit = lens.map(|(out, err)| {
                if stream == StreamKind::Stderr {
                    err
                } else {
                    out
                }
            });
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(&dst)
                .map_err(io("open", &dst))?;
            if let Some(limit) = limit
                && limit < copied
            {
                file.set_len(limit).map_err(io("truncate", &dst))?;
            }
            file.sync_all().map_err(io("fsync", &dst))?;
        }
    }
    if dst_dir.is_dir() {
        store::sync_dir(&dst_dir)?;
    }
    Ok(())
}
