//! Output journals: the raw bytes of a command's streams, one append-only file per stream
//! (`output/<command-id>.stdout`, `.stderr`, `.pty`), where a byte's offset in the stream is
//! its offset in the file.
//!
//! Offsets make a broken output stream resumable without loss or duplication: a writer that
//! re-attaches to a command re-sends from an offset it already had, and the journal keeps
//! only the bytes it did not have (an overlap is deduplicated, a gap is refused). Readers
//! see only bytes whose append completed, and a following reader waits for more until the
//! command is marked finished.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use tether_protocol::process::StreamKind;
use tokio::sync::{Mutex, watch};

use super::LogError;
use super::store::{self, io};

/// Bytes per chunk of a read stream.
const READ_CHUNK: u64 = 64 * 1024;

const STREAMS: [StreamKind; 3] = [StreamKind::Stdout, StreamKind::Stderr, StreamKind::Pty];

fn slot(stream: StreamKind) -> usize {
    match stream {
        StreamKind::Stdout => 0,
        StreamKind::Stderr => 1,
        StreamKind::Pty => 2,
    }
}

fn extension(stream: StreamKind) -> &'static str {
    match stream {
        StreamKind::Stdout => "stdout",
        StreamKind::Stderr => "stderr",
        StreamKind::Pty => "pty",
    }
}

/// The file of `stream` of `command_id` in the output directory `dir`.
pub(crate) fn stream_path(dir: &Path, command_id: &str, stream: StreamKind) -> PathBuf {
    dir.join(format!("{command_id}.{}", extension(stream)))
}

#[derive(Debug, Default, Clone)]
struct JournalState {
    /// Published length of each stream.
    lens: [u64; 3],
    finished: bool,
}

/// The output journal of one command. See the module documentation.
#[derive(Debug)]
pub struct OutputJournal {
    /// `<session>/output`.
    dir: PathBuf,
    command_id: String,
    /// Open write handles, one per stream; the lock also orders appends.
    files: Mutex<[Option<Arc<File>>; 3]>,
    state: watch::Sender<JournalState>,
}

// === impl OutputJournal ===

impl OutputJournal {
    /// The journal of `command_id` in the output directory `dir`, with the lengths of any
    /// streams already on disk (a re-opened session).
    pub(crate) async fn open(dir: PathBuf, command_id: String) -> Result<Arc<Self>, LogError> {
        let (dir, command_id, lens) = tokio::task::spawn_blocking(move || {
            let mut lens = [0u64; 3];
            for stream in STREAMS {
                let path = stream_path(&dir, &command_id, stream);
                match std::fs::metadata(&path) {
                    Ok(m) => lens[slot(stream)] = m.len(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io("stat", &path)(e)),
                }
            }
            Ok((dir, command_id, lens))
        })
        .await
        .map_err(join_error)??;
        let state = watch::Sender::new(JournalState {
            lens,
            finished: false,
        });
        Ok(Arc::new(Self {
            dir,
            command_id,
            files: Mutex::new([None, None, None]),
            state,
        }))
    }

    /// The command id.
    pub fn command_id(&self) -> &str {
        &self.command_id
    }

    /// The file that holds `stream`.
    pub fn path(&self, stream: StreamKind) -> PathBuf {
        stream_path(&self.dir, &self.command_id, stream)
    }

    /// Append bytes at `offset` of `stream`. Idempotent on overlap: bytes below the current
    /// length are skipped (a resumed stream re-sending them is deduplicated); a gap
    /// (`offset > len`) is refused with `InvalidRequest`, as are new bytes after
    /// [`OutputJournal::finish`] (`Conflict`).
    pub async fn append(
        &self,
        stream: StreamKind,
        offset: u64,
        data: &[u8],
    ) -> Result<(), LogError> {
        let mut files = self.files.lock().await;
        let i = slot(stream);
        let (len, finished) = {
            let s = self.state.borrow();
            (s.lens[i], s.finished)
        };
        if offset > len {
            return Err(LogError::InvalidRequest {
                reason: format!(
                    "{} of command {} continues at offset {offset}, but the journal holds {len} bytes",
                    extension(stream),
                    self.command_id
                ),
            });
        }
        let skip = len - offset;
        if skip >= data.len() as u64 {
            return Ok(());
        }
        if finished {
            return Err(LogError::Conflict {
                reason: format!(
                    "command {} is finished; its journal takes no new bytes",
                    self.command_id
                ),
            });
        }
        let fresh = data[skip as usize..].to_vec();
        let file = match &files[i] {
            Some(f) => f.clone(),
            None => {
                let dir = self.dir.clone();
                let path = self.path(stream);
                let f = tokio::task::spawn_blocking(move || create_stream_file(&dir, &path))
                    .await
                    .map_err(join_error)??;
                files[i] = Some(f.clone());
                f
            }
        };
        let path = self.path(stream);
        let added = fresh.len() as u64;
        let written = tokio::task::spawn_blocking(move || {
            file.write_all_at(&fresh, len).map_err(|e| {
                // Keep the file equal to the published length; a later append rewrites it anyway.
                let _ = file.set_len(len);
                io("write", &path)(e)
            })
        })
        .await
        .map_err(join_error)?;
        written?;
        self.state.send_modify(|s| s.lens[i] = len + added);
        Ok(())
    }

    /// The published length of `stream`.
    pub fn len(&self, stream: StreamKind) -> u64 {
        self.state.borrow().lens[slot(stream)]
    }

    /// Whether no stream holds any byte.
    pub fn is_empty(&self) -> bool {
        self.state.borrow().lens.iter().all(|&l| l == 0)
    }

    /// Make the journal durable (called before an event that references its bytes is
    /// appended to the log).
    pub async fn sync(&self) -> Result<(), LogError> {
        let files = self.files.lock().await;
        let open: Vec<(Arc<File>, PathBuf)> = STREAMS
            .iter()
            .filter_map(|&s| files[slot(s)].clone().map(|f| (f, self.path(s))))
            .collect();
        drop(files);
        if open.is_empty() {
            // Nothing was written (a command without output): no trip to the blocking pool.
            return Ok(());
        }
        tokio::task::spawn_blocking(move || {
            for (file, path) in open {
                file.sync_data().map_err(io("fdatasync", &path))?;
            }
            Ok(())
        })
        .await
        .map_err(join_error)?
    }

    /// Mark the command finished: readers following it end after the last byte, and its
    /// files are closed (a session runs any number of commands; their write handles must
    /// not pile up until it closes).
    pub async fn finish(&self) {
        let mut files = self.files.lock().await;
        self.state.send_modify(|s| s.finished = true);
        *files = [None, None, None];
    }

    /// Whether [`OutputJournal::finish`] was called.
    pub fn is_finished(&self) -> bool {
        self.state.borrow().finished
    }

    /// Read `stream` from `offset` as `(offset, bytes)` chunks. Without `follow` the stream
    /// ends at the current length; with it, it waits for more bytes until the command is
    /// finished. An offset beyond the end is refused unless following an unfinished command.
    pub fn read(
        &self,
        stream: StreamKind,
        offset: u64,
        follow: bool,
    ) -> BoxStream<'static, Result<(u64, Bytes), LogError>> {
        let reader = Reader {
            rx: self.state.subscribe(),
            path: self.path(stream),
            slot: slot(stream),
            pos: offset,
            follow,
            done: false,
        };
        futures_util::stream::unfold(reader, Reader::next).boxed()
    }

    /// The last `max` bytes of `stream`, and whether earlier bytes were left out.
    pub async fn tail(&self, stream: StreamKind, max: u64) -> Result<(Bytes, bool), LogError> {
        let len = self.len(stream);
        let start = len - len.min(max);
        if start == len {
            return Ok((Bytes::new(), start > 0));
        }
        let bytes = read_range(self.path(stream), start, len - start).await?;
        Ok((bytes, start > 0))
    }
}

/// Create (or open, after a restart) a stream file; a new file's entry is made durable.
fn create_stream_file(dir: &Path, path: &Path) -> Result<Arc<File>, LogError> {
    store::create_dir_durable(dir)?;
    let existed = path.exists();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io("create", path))?;
    if !existed {
        store::sync_dir(dir)?;
    }
    Ok(Arc::new(file))
}

async fn read_range(path: PathBuf, at: u64, n: u64) -> Result<Bytes, LogError> {
    tokio::task::spawn_blocking(move || {
        let file = File::open(&path).map_err(io("open", &path))?;
        let mut buf = vec![0u8; n as usize];
        file.read_exact_at(&mut buf, at)
            .map_err(io("read", &path))?;
        Ok(Bytes::from(buf))
    })
    .await
    .map_err(join_error)?
}

fn join_error(e: tokio::task::JoinError) -> LogError {
    LogError::Io {
        op: "blocking task",
        path: PathBuf::new(),
        source: std::io::Error::other(e),
    }
}

/// The state of one [`OutputJournal::read`] stream.
struct Reader {
    rx: watch::Receiver<JournalState>,
    path: PathBuf,
    slot: usize,
    pos: u64,
    follow: bool,
    done: bool,
}

// === impl Reader ===

impl Reader {
    async fn next(mut self) -> Option<(Result<(u64, Bytes), LogError>, Self)> {
        if self.done {
            return None;
        }
        loop {
            let (len, finished) = {
                let s = self.rx.borrow_and_update();
                (s.lens[self.slot], s.finished)
            };
            if self.pos < len {
                let at = self.pos;
                let n = (len - at).min(READ_CHUNK);
                return match read_range(self.path.clone(), at, n).await {
                    Ok(bytes) => {
                        self.pos += n;
                        Some((Ok((at, bytes)), self))
                    }
                    Err(e) => {
                        self.done = true;
                        Some((Err(e), self))
                    }
                };
            }
            let ended = !self.follow || finished;
            if self.pos > len && ended {
                self.done = true;
                let reason = format!(
                    "offset {} is beyond the end of the stream ({len} bytes)",
                    self.pos
                );
                return Some((Err(LogError::InvalidRequest { reason }), self));
            }
            if ended || self.rx.changed().await.is_err() {
                return None;
            }
        }
    }
}
