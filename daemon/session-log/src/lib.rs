//! tether's crash-safe session log: one directory per session under
//! `<state_dir>/sessions/<id>/`. A crate of its own so that it can be read, tested and
//! benchmarked without the daemon; it holds no HTTP, provider or session-manager code.
//!
//! `events.jsonl` holds the header line (`{"type":"session","version":2,"params":{..}}`) and then one
//! event per line (`{"seq","time","type","data"}`, seq contiguous from 0). `output/` holds
//! the command output journals ([`OutputJournal`]), raw bytes referenced by offset.
//!
//! A [`SessionLog`] is the one live writer of a session (an exclusive `flock` on the events
//! file enforces it across processes). Appends are group-committed by a writer task (see
//! `writer.rs`): an append returns only once its events are durable, and readers (the
//! in-memory copy, [`SessionLog::follow`]) only ever see durable events. The model history
//! is derived from the log ([`SessionLog::derive_messages`]); nothing model-visible exists
//! outside it. Opening a log after a crash repairs it ([`SessionLog::open`]): a torn last
//! line is truncated, unanswered calls get `TOOL_NOT_STARTED` / `TOOL_OUTCOME_UNKNOWN`
//! results, and an open turn is closed as interrupted; corruption anywhere else is refused.
//! The session module's runtime invariants (`crate::invariants`) run on open and on every
//! batch.

mod derive;
mod fork;
mod index;
pub mod invariants;
mod journal;
mod repair;
mod store;
mod window;
mod writer;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use tether_protocol::events::{Event, EventBody, Message, SessionHeader, SessionParams};
use tether_protocol::{ErrorCode, SESSION_LOG_VERSION};
use tether_provider::Origin;
use tokio::sync::{Mutex, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

pub use derive::{derive, project};
pub use journal::OutputJournal;
pub use repair::{
    NOT_STARTED_MESSAGE, OUTCOME_UNKNOWN_MESSAGE, not_started_result, outcome_unknown_result,
};
pub use store::{
    ClosedSummary, EVENTS_FILE, OUTPUT_DIR, SESSIONS_DIR, session_dir, sessions_dir, validate_id,
};

use crate::invariants::{Invariants, Violation};
use index::Index;
use store::{Layout, LockedFile};
use window::{LogState, READ_STEP};
use writer::{Command, Stats, Writer};

const MODULE: &str = "session";

/// Default of [`LogConfig::max_batch`].
pub const DEFAULT_MAX_BATCH: usize = 1024;

/// Default of [`LogConfig::held_bytes`]: 1 MiB.
pub const DEFAULT_HELD_BYTES: u64 = 1 << 20;

/// How a session log writes.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// `fdatasync` every batch before acknowledging it. Default: true. Off only for
    /// measurements and throwaway sessions: an acknowledged event may then be lost.
    pub fsync: bool,
    /// The most events one batch (one write, one sync) takes. Default: 1024.
    pub max_batch: usize,
    /// The runtime invariants to run (the `session` module's checks).
    pub invariants: Invariants,
    /// The most bytes of event lines a live log holds in memory (its newest events, and
    /// always the last one); older events are read back from the file when asked for.
    /// Default: [`DEFAULT_HELD_BYTES`].
    pub held_bytes: u64,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            fsync: true,
            max_batch: DEFAULT_MAX_BATCH,
            invariants: Invariants::default(),
            held_bytes: DEFAULT_HELD_BYTES,
        }
    }
}

/// An error of the session log.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// A file operation failed.
    #[error("session log: {op} {} failed", path.display())]
    Io {
        /// The operation.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// No log at that place.
    #[error("no session log at {}", path.display())]
    NotFound {
        /// The events file looked for.
        path: PathBuf,
    },
    /// The log is corrupt before its last line (a torn last line is repaired, not this).
    #[error("session log {} is corrupt at line {line}: {reason}", path.display())]
    Corrupt {
        /// The events file.
        path: PathBuf,
        /// The 1-based line number (the header is line 1).
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// The request conflicts with the log's state (a fork boundary inside an open turn, a
    /// session that already exists, a second writer).
    #[error("{reason}")]
    Conflict {
        /// What conflicts.
        reason: String,
    },
    /// The request is malformed (a bad id, a boundary beyond the end, a journal gap).
    #[error("{reason}")]
    InvalidRequest {
        /// What is wrong.
        reason: String,
    },
    /// The log was closed; it takes no more appends.
    #[error("the session log is closed")]
    Closed,
    /// The log was closed because the daemon is shutting down; the session lives on after
    /// the next start, so the call may be retried then.
    #[error("the daemon is shutting down")]
    ShuttingDown,
    /// A runtime invariant of the session module was violated; nothing was written.
    #[error("{violation}")]
    Invariant {
        /// The violated check.
        violation: Violation,
    },
}

// === impl LogError ===

impl LogError {
    /// The stable code.
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Io { source, .. } if is_no_space(source) => ErrorCode::StorageFull,
            Self::Io { .. } => ErrorCode::Internal,
            Self::NotFound { .. } => ErrorCode::SessionNotFound,
            Self::Corrupt { .. } => ErrorCode::Internal,
            Self::Conflict { .. } => ErrorCode::Conflict,
            Self::InvalidRequest { .. } => ErrorCode::InvalidRequest,
            Self::Closed => ErrorCode::SessionNotFound,
            Self::ShuttingDown => ErrorCode::ShuttingDown,
            Self::Invariant { .. } => ErrorCode::Invariant,
        }
    }

    /// Who is at the origin of the error.
    pub fn origin(&self) -> Origin {
        match self {
            Self::Io { .. }
            | Self::Corrupt { .. }
            | Self::Closed
            | Self::ShuttingDown
            | Self::Invariant { .. } => Origin::Daemon,
            Self::NotFound { .. } | Self::Conflict { .. } | Self::InvalidRequest { .. } => {
                Origin::Client
            }
        }
    }

    /// Whether the same request may succeed later. A log error never does by itself.
    pub fn retryable(&self) -> bool {
        matches!(self, Self::ShuttingDown)
    }

    /// A copy for each appender of a batch that failed as a whole (`io::Error` is not
    /// `Clone`; its kind and text are kept).
    pub(crate) fn replicate(&self) -> Self {
        match self {
            Self::Io { op, path, source } => Self::Io {
                op,
                path: path.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            Self::NotFound { path } => Self::NotFound { path: path.clone() },
            Self::Corrupt { path, line, reason } => Self::Corrupt {
                path: path.clone(),
                line: *line,
                reason: reason.clone(),
            },
            Self::Conflict { reason } => Self::Conflict {
                reason: reason.clone(),
            },
            Self::InvalidRequest { reason } => Self::InvalidRequest {
                reason: reason.clone(),
            },
            Self::Closed => Self::Closed,
            Self::ShuttingDown => Self::ShuttingDown,
            Self::Invariant { violation } => Self::Invariant {
                violation: violation.clone(),
            },
        }
    }
}

/// ENOSPC or EDQUOT: the state directory's file system is full.
fn is_no_space(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    )
}

impl From<Violation> for LogError {
    fn from(violation: Violation) -> Self {
        Self::Invariant { violation }
    }
}

/// What [`SessionLog::open`] repaired.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Bytes of a torn last line that were truncated.
    pub truncated_bytes: u64,
    /// Call ids answered with `TOOL_NOT_STARTED` (announced, never dispatched).
    pub not_started: Vec<String>,
    /// Call ids answered with `TOOL_OUTCOME_UNKNOWN` (dispatched, no result logged).
    pub outcome_unknown: Vec<String>,
    /// Whether an open turn was closed with `turn/end {kind: interrupted}`.
    pub turn_closed: bool,
}

impl RepairReport {
    /// Whether anything was repaired.
    pub fn changed(&self) -> bool {
        self.truncated_bytes > 0
            || !self.not_started.is_empty()
            || !self.outcome_unknown.is_empty()
            || self.turn_closed
    }
}

/// Counters of a log's writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogStats {
    /// Batches written (each one write and, with `fsync`, one `fdatasync`).
    pub batches: u64,
    /// `fdatasync` calls made for batches.
    pub fdatasyncs: u64,
    /// Events durable in the file (the next seq).
    pub durable_events: u64,
    /// Events held in memory (the newest ones, see [`LogConfig::held_bytes`]).
    pub held_events: u64,
    /// Bytes of the event lines held in memory.
    pub held_bytes: u64,
}

/// The one live writer of a session's log. See the module documentation.
pub struct SessionLog {
    dir: PathBuf,
    header: SessionHeader,
    cfg: LogConfig,
    tx: mpsc::Sender<Command>,
    state: watch::Sender<LogState>,
    stats: Arc<Stats>,
    writer: Mutex<Option<JoinHandle<()>>>,
    journals: Mutex<HashMap<String, Arc<OutputJournal>>>,
    /// Events that need no durability point of their own: written with the next append.
    staged: Mutex<Vec<EventBody>>,
    /// Set when the log was closed for a daemon shutdown (appends then fail with the
    /// retryable `ShuttingDown`, not `Closed`).
    shutting_down: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for SessionLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionLog")
            .field("dir", &self.dir)
            .field("id", &self.header.id)
            .field("next_seq", &self.next_seq())
            .finish()
    }
}

// === impl SessionLog ===

impl SessionLog {
    /// Create the log of a new session in `dir` (created if needed). Refused with
    /// `Conflict` if `dir` already holds a log.
    pub async fn create(
        dir: &Path,
        header: SessionHeader,
        cfg: LogConfig,
    ) -> Result<Arc<Self>, LogError> {
        if header.kind != "session" || header.version != SESSION_LOG_VERSION {
            return Err(LogError::InvalidRequest {
                reason: format!(
                    "a session header has type \"session\" and version {SESSION_LOG_VERSION}"
                ),
            });
        }
        validate_id("session id", &header.id)?;
        let (d, h) = (dir.to_owned(), header.clone());
        let (file, layout) = blocking(move || store::publish_new(&d, &h, &[])).await?;
        Ok(Self::start(
            dir.to_owned(),
            header,
            file,
            layout,
            Index::default(),
            Vec::new(),
            cfg,
        ))
    }

    /// A new session header for `id`, created now.
    pub fn new_header(id: &str, params: SessionParams) -> SessionHeader {
        SessionHeader {
            kind: "session".into(),
            version: SESSION_LOG_VERSION,
            id: id.to_owned(),
            created_ms: now_ms(),
            parent_session: None,
            seed_length: None,
            params,
        }
    }

    /// Open an existing log, repairing a crash: truncate a torn last line (and sync the
    /// truncation); answer every `tool/call` without a `tool/result` with
    /// `TOOL_OUTCOME_UNKNOWN` and every call id announced by the open turn but never
    /// dispatched with `TOOL_NOT_STARTED`; close an open turn with
    /// `turn/end {kind: interrupted}`. Corruption before the last line is refused with
    /// `Corrupt`, a violated invariant with `Invariant`, a log held by another writer with
    /// `Conflict`.
    pub async fn open(dir: &Path, cfg: LogConfig) -> Result<(Arc<Self>, RepairReport), LogError> {
        Self::open_seeing(dir, cfg, |_| {}).await
    }

    /// [`SessionLog::open`], showing `see` every event of the file, in order, in the one
    /// pass that reads it (a caller that folds the log into its own state reads it once).
    /// The repair's events, appended after, are not shown.
    pub async fn open_seeing(
        dir: &Path,
        cfg: LogConfig,
        mut see: impl FnMut(&Event) + Send,
    ) -> Result<(Arc<Self>, RepairReport), LogError> {
        let path = dir.join(EVENTS_FILE);
        let d = dir.to_owned();
        let (file, bytes) = blocking(move || store::open_existing(&d)).await?;
        let parsed = store::parse(&bytes, &path).inspect_err(|e| {
            // Never dropped silently: the operator must look at this file.
            tracing::error!(path = %path.display(), error = %e, "Refusing to open a corrupt session log");
        })?;
        let mut report = RepairReport {
            truncated_bytes: bytes.len() as u64 - parsed.valid_len,
            ..Default::default()
        };
        drop(bytes);
        let file = if report.truncated_bytes > 0 {
            tracing::warn!(
                session.id = %parsed.header.id,
                bytes = report.truncated_bytes,
                "Truncating the torn last line of a session log"
            );
            let (len, p) = (parsed.valid_len, path.clone());
            blocking(move || {
                file.set_len(len)
                    .and_then(|()| file.sync_data())
                    .map_err(store::io("truncate", &p))?;
                Ok(file)
            })
            .await?
        } else {
            file
        };
        let mut index = Index::default();
        for e in &parsed.events {
            let mut undo = index.begin();
            index.apply(e.seq, &e.body, &cfg.invariants, &mut undo)?;
            see(e);
        }
        let closers = repair::closers(&index);
        let log = Self::start(
            dir.to_owned(),
            parsed.header,
            file,
            parsed.layout,
            index,
            parsed.events,
            cfg,
        );
        let repaired = async {
            if !closers.bodies.is_empty() {
                tracing::warn!(
                    session.id = %log.header.id,
                    not_started = closers.not_started.len(),
                    outcome_unknown = closers.outcome_unknown.len(),
                    turn_closed = closers.turn_closed,
                    "Repairing an interrupted session log"
                );
                log.append_all(closers.bodies).await?;
            }
            log.verify().await
        };
        if let Err(e) = repaired.await {
            log.close().await;
            return Err(e);
        }
        report.not_started = closers.not_started;
        report.outcome_unknown = closers.outcome_unknown;
        report.turn_closed = closers.turn_closed;
        Ok((log, report))
    }

    fn start(
        dir: PathBuf,
        header: SessionHeader,
        file: LockedFile,
        layout: Layout,
        index: Index,
        events: Vec<Event>,
        cfg: LogConfig,
    ) -> Arc<Self> {
        let stats = Arc::new(Stats::default());
        stats
            .durable_events
            .store(events.len() as u64, Ordering::Release);
        let mut first = LogState::new(layout.header_len, events, &layout.line_lens, cfg.held_bytes);
        first.open_turn = index.open_turn();
        let len = first.bytes;
        let state = watch::Sender::new(first);
        let (tx, rx) = mpsc::channel(cfg.max_batch.clamp(1, 1 << 16));
        let writer = Writer {
            file: Arc::new(file),
            path: dir.join(EVENTS_FILE),
            len,
            index,
            state: state.clone(),
            stats: stats.clone(),
            cfg: cfg.clone(),
        };
        let span = tracing::info_span!("session.writer", session.id = %header.id);
        let handle = tokio::spawn(writer.run(rx).instrument(span));
        Arc::new(Self {
            dir,
            header,
            cfg,
            tx,
            state,
            stats,
            writer: Mutex::new(Some(handle)),
            journals: Mutex::new(HashMap::new()),
            staged: Mutex::new(Vec::new()),
            shutting_down: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Append one event; durable on return.
    pub async fn append(&self, body: EventBody) -> Result<Event, LogError> {
        let mut events = self.append_all(vec![body]).await?;
        events.pop().ok_or(LogError::Closed)
    }

    /// Append several events with contiguous seqs and one durability point. The group is
    /// all-or-nothing: an invariant violation by any of them refuses all of them.
    pub async fn append_all(&self, bodies: Vec<EventBody>) -> Result<Vec<Event>, LogError> {
        if bodies.is_empty() {
            return Ok(Vec::new());
        }
        // Staged events go first, in the same group: one write, one fdatasync.
        let mut all = std::mem::take(&mut *self.staged.lock().await);
        let staged = all.len();
        all.extend(bodies);
        let (ack, acked) = oneshot::channel();
        let closed = || self.closed_error();
        self.tx
            .send(Command::Append { bodies: all, ack })
            .await
            .map_err(|_| closed())?;
        let mut events = acked.await.map_err(|_| closed())?.map_err(|e| match e {
            LogError::Closed => closed(),
            e => e,
        })?;
        Ok(events.split_off(staged.min(events.len())))
    }

    fn closed_error(&self) -> LogError {
        if self.shutting_down.load(Ordering::Acquire) {
            LogError::ShuttingDown
        } else {
            LogError::Closed
        }
    }

    /// [`SessionLog::close`] for a daemon shutdown: later appends fail with the retryable
    /// `ShuttingDown` (the session is live again after the next start).
    pub async fn close_for_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
        self.close().await;
    }

    /// Stage an event that needs no durability point of its own: it is written, in order,
    /// in the same group as the next [`SessionLog::append`] or [`SessionLog::append_all`]
    /// (or by [`SessionLog::close`]). Readers see it only once it is durable.
    ///
    /// For events whose loss in a crash is harmless because a later event they precede is
    /// what makes the state observable (`turn/start` before the first `tool/call`; the last
    /// `tool/result` before `turn/end`): a batch costs two fdatasyncs instead of four.
    pub async fn stage(&self, body: EventBody) {
        self.staged.lock().await.push(body);
    }

    /// The header line.
    pub fn header(&self) -> &SessionHeader {
        &self.header
    }

    /// The session directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The seq the next durable event will have (the number of durable events).
    pub fn next_seq(&self) -> u64 {
        self.state.borrow().len
    }

    /// The time of the last durable event, if any.
    pub fn last_event_time(&self) -> Option<i64> {
        self.state.borrow().last_time()
    }

    /// Durable events with seq > `after` (all when `None`), as they stand now: from memory
    /// where the held window has them, else read back from the file.
    pub async fn events_after(&self, after: Option<u64>) -> Result<Vec<Event>, LogError> {
        self.replay(after)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect()
    }

    /// The durable events with seq > `after` as they stand now, as a stream that ends at
    /// the last one (read in steps, so a long log is never all in memory).
    pub fn replay(&self, after: Option<u64>) -> BoxStream<'static, Result<Event, LogError>> {
        let stop = self.next_seq();
        self.follower(after, Some(stop))
    }

    /// Live follow: the durable events with seq > `after`, then each new one as it becomes
    /// durable; the stream ends when the log is closed, or after a read of the file fails
    /// (that error is its last item).
    pub fn follow(&self, after: Option<u64>) -> BoxStream<'static, Result<Event, LogError>> {
        self.follower(after, None)
    }

    fn follower(
        &self,
        after: Option<u64>,
        stop: Option<u64>,
    ) -> BoxStream<'static, Result<Event, LogError>> {
        let follower = Follower {
            rx: self.state.subscribe(),
            path: self.dir.join(EVENTS_FILE),
            cursor: after.map_or(0, |a| a.saturating_add(1)),
            stop,
            buf: VecDeque::new(),
            failed: false,
        };
        futures_util::stream::unfold(follower, Follower::next).boxed()
    }

    /// The model history derived from the log (`user/message`, `assistant/message`,
    /// `tool/result`).
    pub async fn derive_messages(&self) -> Result<Vec<Message>, LogError> {
        Ok(derive(&self.events_after(None).await?))
    }

    /// The number of the open turn (a `turn/start` without `turn/end`), if any.
    pub fn open_turn(&self) -> Option<u64> {
        self.state.borrow().open_turn.map(|t| t.turn)
    }

    /// The writer's counters.
    pub fn stats(&self) -> LogStats {
        let s = self.state.borrow();
        LogStats {
            batches: self.stats.batches.load(Ordering::Relaxed),
            fdatasyncs: self.stats.fdatasyncs.load(Ordering::Relaxed),
            durable_events: self.stats.durable_events.load(Ordering::Acquire),
            held_events: s.tail.len() as u64,
            held_bytes: s.tail_bytes,
        }
    }

    /// Whether the log is closed.
    pub fn is_closed(&self) -> bool {
        self.state.borrow().closed
    }

    /// Check the `derived_history_matches_disk` invariant: the events held in memory
    /// project to the same history as the same seqs of `events.jsonl` read back from disk,
    /// and the file holds every event published.
    pub async fn verify(&self) -> Result<(), LogError> {
        if !self.cfg.invariants.is_enabled(MODULE) {
            return Ok(());
        }
        // Memory first: the file is always at least as far as what was published.
        let (count, first, messages) = {
            let s = self.state.borrow();
            let first = s.first_held() as usize;
            let held: Vec<Event> = s.tail.iter().map(|(e, _)| e.clone()).collect();
            (s.len as usize, first, derive(&held))
        };
        let dir = self.dir.clone();
        let bytes = blocking(move || store::read_all(&dir)).await?;
        let parsed = store::parse(&bytes, &self.dir.join(EVENTS_FILE))?;
        self.cfg
            .invariants
            .check(MODULE, "derived_history_matches_disk", || {
                if parsed.events.len() < count {
                    return Err(format!(
                        "{count} events in memory, {} on disk",
                        parsed.events.len()
                    ));
                }
                let disk = derive(&parsed.events[first..count]);
                match disk.iter().zip(&messages).position(|(d, m)| d != m) {
                    Some(i) => Err(format!(
                        "message {i} of the history differs from the log on disk"
                    )),
                    None if disk.len() != messages.len() => Err(format!(
                        "{} messages in memory, {} derived from disk",
                        messages.len(),
                        disk.len()
                    )),
                    None => Ok(()),
                }
            })?;
        Ok(())
    }

    /// Fork: copy the prefix up to `at_seq` (inclusive; default: the last event outside an
    /// open turn) into a new session in `new_dir` whose header names this session as parent
    /// and the prefix length as seed length, copy the output journals the prefix refers
    /// to, then append `session/end-seed`. A boundary inside an open turn is refused with
    /// `Conflict`, one beyond the end with `InvalidRequest`, an existing `new_dir` log with
    /// `Conflict` (checked first). For an empty prefix, `boundary_seq` is 0 and the seed
    /// length 0. The child's header carries `params` (the parent's, as they stand now).
    pub async fn fork(
        &self,
        new_dir: &Path,
        new_id: &str,
        at_seq: Option<u64>,
        params: SessionParams,
    ) -> Result<Arc<SessionLog>, LogError> {
        validate_id("session id", new_id)?;
        if new_dir.join(EVENTS_FILE).exists() {
            return Err(LogError::Conflict {
                reason: format!("a session log already exists in {}", new_dir.display()),
            });
        }
        // The open turn and the events up to the same point: one consistent snapshot.
        let (open_turn, stop) = {
            let s = self.state.borrow();
            (s.open_turn, s.len)
        };
        let mut events: Vec<Event> = self
            .follower(None, Some(stop))
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        let boundary = fork::boundary(&events, open_turn, at_seq)?;
        events.truncate(boundary.map_or(0, |b| b as usize + 1));
        let prefix = events;
        let header = SessionHeader {
            kind: "session".into(),
            version: SESSION_LOG_VERSION,
            id: new_id.to_owned(),
            created_ms: now_ms(),
            parent_session: Some(self.header.id.clone()),
            seed_length: Some(prefix.len() as u64),
            params,
        };
        let mut index = Index::default();
        for e in &prefix {
            let mut undo = index.begin();
            index.apply(e.seq, &e.body, &self.cfg.invariants, &mut undo)?;
        }
        let (from, to) = (self.dir.clone(), new_dir.to_owned());
        let (file, layout, prefix, header) = blocking(move || {
            store::create_dir_durable(&to)?;
            fork::copy_journals(&prefix, &from, &to)?;
            let (file, layout) = store::publish_new(&to, &header, &prefix)?;
            Ok((file, layout, prefix, header))
        })
        .await?;
        let child = Self::start(
            new_dir.to_owned(),
            header,
            file,
            layout,
            index,
            prefix,
            self.cfg.clone(),
        );
        let seed_end = EventBody::EndSeed {
            parent_session: self.header.id.clone(),
            boundary_seq: boundary.unwrap_or(0),
        };
        if let Err(e) = child.append(seed_end).await {
            child.close().await;
            return Err(e);
        }
        Ok(child)
    }

    /// The output journal of `command_id` (created on first use; the same journal for
    /// every call with the same id).
    pub async fn journal(&self, command_id: &str) -> Result<Arc<OutputJournal>, LogError> {
        validate_id("command id", command_id)?;
        let mut journals = self.journals.lock().await;
        if let Some(j) = journals.get(command_id) {
            return Ok(j.clone());
        }
        let j = OutputJournal::open(self.dir.join(OUTPUT_DIR), command_id.to_owned()).await?;
        journals.insert(command_id.to_owned(), j.clone());
        Ok(j)
    }

    /// Write what is queued, stop the writer and release the writer lock; later appends
    /// fail with `Closed` and followers end. Idempotent.
    pub async fn close(&self) {
        let staged = std::mem::take(&mut *self.staged.lock().await);
        if !staged.is_empty()
            && let Err(e) = self.append_all(staged).await
        {
            tracing::warn!(session.id = %self.header.id, error = %e, "Staged events could not be written at close");
        }
        let (ack, acked) = oneshot::channel();
        if self.tx.send(Command::Close { ack }).await.is_ok() {
            let _ = acked.await;
        }
        if let Some(handle) = self.writer.lock().await.take()
            && let Err(e) = handle.await
        {
            tracing::error!(session.id = %self.header.id, error = %e, "Session log writer task failed");
        }
    }
}

/// The ids of the sessions stored in `sessions_dir` (the directory holding one directory
/// per session, `<state_dir>/sessions`, see [`sessions_dir`]): the subdirectories with an
/// `events.jsonl`, sorted; none when the directory does not exist yet.
pub async fn list_sessions(sessions_dir: &Path) -> Result<Vec<String>, LogError> {
    let dir = sessions_dir.to_owned();
    blocking(move || store::list_sessions_blocking(&dir)).await
}

/// The summary of a closed session's log read from its first and last lines, or `None`
/// when the log does not end with `session/closed` (see [`store::ClosedSummary`]).
pub async fn closed_summary(dir: &Path) -> Result<Option<ClosedSummary>, LogError> {
    let dir = dir.to_owned();
    blocking(move || store::closed_summary_blocking(&dir)).await
}

/// Run blocking file work on the blocking pool.
async fn blocking<T, F>(f: F) -> Result<T, LogError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, LogError> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| LogError::Io {
            op: "blocking task",
            path: PathBuf::new(),
            source: std::io::Error::other(e),
        })?
}

/// Milliseconds since the Unix epoch (0 for a clock before it).
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The state of one [`SessionLog::follow`] or [`SessionLog::replay`] stream.
struct Follower {
    rx: watch::Receiver<LogState>,
    /// `events.jsonl`, read for events older than the held window.
    path: PathBuf,
    /// The next seq to yield.
    cursor: u64,
    /// Where a replay ends (exclusive); `None` follows until the log closes.
    stop: Option<u64>,
    buf: VecDeque<Event>,
    /// A read failed and was yielded: the stream is over.
    failed: bool,
}

// === impl Follower ===

impl Follower {
    async fn next(mut self) -> Option<(Result<Event, LogError>, Self)> {
        loop {
            if let Some(e) = self.buf.pop_front() {
                return Some((Ok(e), self));
            }
            let stop = self.stop.unwrap_or(u64::MAX);
            if self.failed || self.cursor >= stop {
                return None;
            }
            let (closed, disk) = {
                let s = self.rx.borrow_and_update();
                let to = s.len.min(stop);
                if self.cursor < s.first_held() {
                    let plan = (s.disk_start(self.cursor), s.bytes, s.first_held().min(to));
                    (s.closed, Some(plan))
                } else {
                    self.buf.extend(s.held_range(self.cursor, to).cloned());
                    self.cursor = self.cursor.max(to);
                    (s.closed, None)
                }
            };
            if let Some((start, end, to)) = disk {
                let (path, from) = (self.path.clone(), self.cursor);
                let read =
                    blocking(move || window::read_events(&path, start, end, (from, to), READ_STEP))
                        .await;
                match read {
                    Ok(events) => {
                        self.cursor = events.last().map_or(to, |e| e.seq + 1);
                        self.buf.extend(events);
                    }
                    Err(e) => {
                        self.failed = true;
                        return Some((Err(e), self));
                    }
                }
                continue;
            }
            if !self.buf.is_empty() {
                continue;
            }
            if self.cursor >= stop || closed || self.rx.changed().await.is_err() {
                return None;
            }
        }
    }
}
