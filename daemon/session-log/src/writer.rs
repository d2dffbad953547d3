//! Group commit: the one task that writes a session's `events.jsonl`.
//!
//! Appenders send their events with a oneshot for the acknowledgement. The writer takes
//! everything queued (up to `max_batch` events), assigns seqs in queue order, checks each
//! group against the session invariants, writes the batch with one `pwrite`, makes it
//! durable with one `fdatasync`, reads it back to check it projects to the same history,
//! publishes it to readers, and only then acknowledges every appender of the batch. So an
//! acknowledged event is on disk, readers never see an event that is not, and concurrent
//! appenders share the cost of one sync.
//!
//! A failed write or sync is rolled back by truncating the file to its previous length, so
//! the log never keeps a half line; if even the truncation fails the writer stops and the
//! log refuses further appends (re-opening repairs the torn tail).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tether_protocol::events::{Event, EventBody};
use tokio::sync::{mpsc, oneshot, watch};

use super::derive::project;
use super::index::{Index, Undo};
use super::store::{self, LockedFile};
use super::{LogConfig, LogError, LogState};

const MODULE: &str = "session";

/// A request to the writer.
#[derive(Debug)]
pub(crate) enum Command {
    /// Append these events (contiguous seqs, one durability point).
    Append {
        bodies: Vec<EventBody>,
        ack: oneshot::Sender<Result<Vec<Event>, LogError>>,
    },
    /// Write what is queued before this, then stop.
    Close { ack: oneshot::Sender<()> },
}

/// Counters of the writer, shared with the log handle.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub batches: AtomicU64,
    pub fdatasyncs: AtomicU64,
    pub durable_events: AtomicU64,
    /// Test hook: make the next write fail after writing half its bytes.
    #[cfg(test)]
    pub fail_next_write: std::sync::atomic::AtomicBool,
}

type Ack = oneshot::Sender<Result<Vec<Event>, LogError>>;

/// The writer task's state.
#[derive(Debug)]
pub(crate) struct Writer {
    pub file: Arc<LockedFile>,
    pub path: PathBuf,
    /// Length of the file: everything before it is durable and published.
    pub len: u64,
    pub index: Index,
    pub state: watch::Sender<LogState>,
    pub stats: Arc<Stats>,
    pub cfg: LogConfig,
}

/// Where [`Writer::stage`] puts a group: the bytes of its lines, each line's length, and
/// the count of lines in the file plus those staged.
struct Staging<'a> {
    buf: &'a mut Vec<u8>,
    line_lens: &'a mut Vec<u64>,
    lines: &'a mut u64,
}

/// A batch that failed as a whole.
enum BatchError {
    /// The batch was rolled back; the writer can go on.
    Failed(LogError),
    /// The rollback itself failed: the file may hold a partial batch; stop writing.
    Fatal(LogError),
}

// === impl Writer ===

impl Writer {
    /// Serve commands until closed or until every sender is gone.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        let max_batch = self.cfg.max_batch.max(1);
        let mut closing = None;
        while closing.is_none() {
            let Some(first) = rx.recv().await else { break };
            let mut batch: Vec<(Vec<EventBody>, Ack)> = Vec::new();
            let mut queued = 0usize;
            let mut next = Some(first);
            while let Some(cmd) = next.take() {
                match cmd {
                    Command::Append { bodies, ack } => {
                        queued += bodies.len();
                        batch.push((bodies, ack));
                    }
                    Command::Close { ack } => {
                        closing = Some(ack);
                        break;
                    }
                }
                if queued < max_batch {
                    next = rx.try_recv().ok();
                }
            }
            if !batch.is_empty() && !self.commit(batch).await {
                break;
            }
        }
        // Refuse what is still queued, explicitly, rather than by dropping acks.
        rx.close();
        while let Ok(cmd) = rx.try_recv() {
            match cmd {
                Command::Append { ack, .. } => {
                    let _ = ack.send(Err(LogError::Closed));
                }
                Command::Close { ack } => {
                    let _ = ack.send(());
                }
            }
        }
        self.state.send_modify(|s| s.closed = true);
        if let Some(ack) = closing {
            let _ = ack.send(());
        }
    }

    /// Commit one batch; false when the writer must stop.
    async fn commit(&mut self, batch: Vec<(Vec<EventBody>, Ack)>) -> bool {
        let time = super::now_ms();
        let durable = self.state.borrow().len;
        let mut buf = Vec::new();
        // The length of each staged event's line, in seq order.
        let mut line_lens: Vec<u64> = Vec::new();
        let mut undos: Vec<Undo> = Vec::new();
        let mut staged: Vec<(Vec<Event>, Ack)> = Vec::new();
        let mut next_seq = durable;
        // Lines in the file plus lines staged, counted apart from the seq counter.
        let mut lines = durable;
        for (bodies, ack) in batch {
            let mark = buf.len();
            let lines_mark = lines;
            let lens_mark = line_lens.len();
            let mut undo = self.index.begin();
            let out = Staging {
                buf: &mut buf,
                line_lens: &mut line_lens,
                lines: &mut lines,
            };
            let staging = self.stage(bodies, next_seq, time, out, &mut undo);
            match staging {
                Ok(events) => {
                    next_seq += events.len() as u64;
                    undos.push(undo);
                    staged.push((events, ack));
                }
                Err(e) => {
                    buf.truncate(mark);
                    line_lens.truncate(lens_mark);
                    lines = lines_mark;
                    self.index.rollback(undo);
                    let _ = ack.send(Err(e));
                }
            }
        }
        if staged.is_empty() {
            return true;
        }
        match self.persist(buf, &staged).await {
            Ok(()) => {
                let open_turn = self.index.open_turn();
                self.state.send_modify(|s| {
                    let events = staged.iter().flat_map(|(evs, _)| evs.iter().cloned());
                    for (e, n) in events.zip(&line_lens) {
                        s.push(e, *n);
                    }
                    s.open_turn = open_turn;
                });
                self.stats.durable_events.store(next_seq, Ordering::Release);
                for (events, ack) in staged {
                    let _ = ack.send(Ok(events));
                }
                true
            }
            Err(err) => {
                for undo in undos.into_iter().rev() {
                    self.index.rollback(undo);
                }
                let (err, go_on) = match err {
                    BatchError::Failed(e) => (e, true),
                    BatchError::Fatal(e) => {
                        tracing::error!(path = %self.path.display(), error = %e, "Session log writer stopped: a failed batch could not be rolled back");
                        (e, false)
                    }
                };
                for (_, ack) in staged {
                    let _ = ack.send(Err(err.replicate()));
                }
                go_on
            }
        }
    }

    /// Check and serialise one appender's group at `first_seq`.
    fn stage(
        &mut self,
        bodies: Vec<EventBody>,
        first_seq: u64,
        time: i64,
        out: Staging<'_>,
        undo: &mut Undo,
    ) -> Result<Vec<Event>, LogError> {
        let Staging {
            buf,
            line_lens,
            lines,
        } = out;
        let inv = self.cfg.invariants.clone();
        let mut events = Vec::with_capacity(bodies.len());
        for (i, body) in bodies.into_iter().enumerate() {
            let seq = first_seq + i as u64;
            // The seq must continue the file: equal to the number of lines before it.
            inv.check(MODULE, "seq_contiguous", || {
                if *lines == seq {
                    Ok(())
                } else {
                    Err(format!("seq {seq} assigned after {lines} lines"))
                }
            })?;
            self.index.apply(seq, &body, &inv, undo)?;
            let event = Event { seq, time, body };
            let at = buf.len();
            serde_json::to_writer(&mut *buf, &event).map_err(|e| LogError::InvalidRequest {
                reason: format!("event is not serialisable: {e}"),
            })?;
            buf.push(b'\n');
            line_lens.push((buf.len() - at) as u64);
            *lines += 1;
            events.push(event);
        }
        Ok(events)
    }

    /// Write, sync and verify the batch; roll it back on any failure.
    async fn persist(
        &mut self,
        buf: Vec<u8>,
        staged: &[(Vec<Event>, Ack)],
    ) -> Result<(), BatchError> {
        let file = self.file.clone();
        let path = self.path.clone();
        let at = self.len;
        let fsync = self.cfg.fsync;
        let verify = self.cfg.invariants.is_enabled(MODULE);
        let stats = self.stats.clone();
        let written = buf.len() as u64;
        let outcome = tokio::task::spawn_blocking(move || {
            write_batch(&file, &path, at, &buf, fsync, verify, &stats)
        })
        .await;
        let read_back = match outcome {
            Ok(Ok(read_back)) => read_back,
            Ok(Err(e)) => return Err(self.rollback(at, e).await),
            Err(join) => {
                let e = LogError::Io {
                    op: "write",
                    path: self.path.clone(),
                    source: std::io::Error::other(join),
                };
                return Err(self.rollback(at, e).await);
            }
        };
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        if fsync {
            self.stats.fdatasyncs.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(bytes) = read_back
            && let Err(v) =
                self.cfg
                    .invariants
                    .check(MODULE, "derived_history_matches_disk", || {
                        check_read_back(&bytes, staged)
                    })
        {
            return Err(self.rollback(at, v.into()).await);
        }
        self.len = at + written;
        Ok(())
    }

    /// Truncate the file back to `len` after a failed batch.
    async fn rollback(&mut self, len: u64, cause: LogError) -> BatchError {
        let file = self.file.clone();
        let truncated =
            tokio::task::spawn_blocking(move || file.set_len(len).and_then(|()| file.sync_data()))
                .await;
        match truncated {
            Ok(Ok(())) => {
                self.len = len;
                BatchError::Failed(cause)
            }
            Ok(Err(e)) => BatchError::Fatal(store::io("truncate", &self.path)(e)),
            Err(join) => BatchError::Fatal(LogError::Io {
                op: "truncate",
                path: self.path.clone(),
                source: std::io::Error::other(join),
            }),
        }
    }
}

/// The blocking part of a commit: one positioned write, one `fdatasync`, and the read-back
/// of the bytes just written when verification is on.
fn write_batch(
    file: &File,
    path: &std::path::Path,
    at: u64,
    buf: &[u8],
    fsync: bool,
    verify: bool,
    stats: &Stats,
) -> Result<Option<Vec<u8>>, LogError> {
    #[cfg(test)]
    if stats.fail_next_write.swap(false, Ordering::SeqCst) {
        let half = &buf[..buf.len() / 2];
        file.write_all_at(half, at)
            .map_err(store::io("write", path))?;
        return Err(LogError::Io {
            op: "write",
            path: path.to_owned(),
            source: std::io::Error::other("injected fault"),
        });
    }
    let _ = stats;
    file.write_all_at(buf, at)
        .map_err(store::io("write", path))?;
    if fsync {
        file.sync_data().map_err(store::io("fdatasync", path))?;
    }
    if !verify {
        return Ok(None);
    }
    let mut back = vec![0u8; buf.len()];
    file.read_exact_at(&mut back, at)
        .map_err(store::io("read back", path))?;
    Ok(Some(back))
}

/// The batch read back from disk must parse to the staged events' seqs and project to the
/// same messages.
fn check_read_back(bytes: &[u8], staged: &[(Vec<Event>, Ack)]) -> Result<(), String> {
    let mut lines = bytes.split(|&b| b == b'\n');
    for event in staged.iter().flat_map(|(evs, _)| evs) {
        let line = lines
            .next()
            .ok_or_else(|| format!("seq {} is missing from disk", event.seq))?;
        let back: Event = serde_json::from_slice(line)
            .map_err(|e| format!("seq {} does not parse back: {e}", event.seq))?;
        if back.seq != event.seq {
            return Err(format!("seq {} reads back as seq {}", event.seq, back.seq));
        }
        if project(&back.body) != project(&event.body) {
            return Err(format!("seq {} projects differently from disk", event.seq));
        }
    }
    match (lines.next(), lines.next()) {
        (Some(b""), None) => Ok(()),
        _ => Err("extra bytes after the batch on disk".into()),
    }
}
