//! What a live log holds in memory: the newest durable events, up to
//! [`LogConfig::held_bytes`](crate::LogConfig::held_bytes) of their lines, and the file
//! offset of every [`OFFSET_STRIDE`]-th event. Older events are read back from
//! `events.jsonl` when asked for ([`read_events`]): the file is append-only and everything
//! before the published length is durable, so a read never races the writer.
//!
//! A session that runs for months therefore costs a bounded window plus eight bytes per
//! `OFFSET_STRIDE` events, and a reader of an old seq starts at most `OFFSET_STRIDE` lines
//! before it.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::Path;

use tether_protocol::events::Event;

use super::LogError;
use super::index::OpenTurn;
use super::store::io;

/// One offset is kept for every this many events.
pub(crate) const OFFSET_STRIDE: u64 = 64;

/// The most events one read from disk returns (a follower reads on in steps of this).
pub(crate) const READ_STEP: usize = 1024;

/// What readers see: durable events only.
#[derive(Debug, Default)]
pub(crate) struct LogState {
    /// The number of durable events: the seq of the next one.
    pub len: u64,
    /// The length of the file's durable prefix, bytes.
    pub bytes: u64,
    /// The newest durable events, seqs `len - tail.len() .. len`, with their line lengths.
    /// At most `held` bytes of lines, and never empty while `len > 0`.
    pub tail: VecDeque<(Event, u64)>,
    /// The bytes of the lines in `tail`.
    pub tail_bytes: u64,
    /// The file offset of event `i * OFFSET_STRIDE` at index `i`.
    pub offsets: Vec<u64>,
    /// The largest `tail_bytes` kept (a window of at least one event).
    pub held: u64,
    pub open_turn: Option<OpenTurn>,
    pub closed: bool,
}

// === impl LogState ===

impl LogState {
    /// The state of a log whose header line is `header_len` bytes, followed by `events`
    /// with the given line lengths.
    pub fn new(header_len: u64, events: Vec<Event>, line_lens: &[u64], held: u64) -> Self {
        let mut s = Self {
            bytes: header_len,
            held,
            ..Self::default()
        };
        for (e, n) in events.into_iter().zip(line_lens) {
            s.push(e, *n);
        }
        s
    }

    /// Publish one durable event whose line, `line_len` bytes, ends the file.
    pub fn push(&mut self, event: Event, line_len: u64) {
        if event.seq.is_multiple_of(OFFSET_STRIDE) {
            self.offsets.push(self.bytes);
        }
        self.len = event.seq.saturating_add(1);
        self.bytes = self.bytes.saturating_add(line_len);
        self.tail.push_back((event, line_len));
        self.tail_bytes = self.tail_bytes.saturating_add(line_len);
        while self.tail_bytes > self.held && self.tail.len() > 1 {
            if let Some((_, n)) = self.tail.pop_front() {
                self.tail_bytes -= n;
            }
        }
    }

    /// The seq of the oldest event held in memory (`len` when none is).
    pub fn first_held(&self) -> u64 {
        self.len - self.tail.len() as u64
    }

    /// The held events with seq in `from..to`.
    pub fn held_range(&self, from: u64, to: u64) -> impl Iterator<Item = &Event> {
        let skip = from.saturating_sub(self.first_held()) as usize;
        self.tail
            .iter()
            .skip(skip)
            .map(|(e, _)| e)
            .take_while(move |e| e.seq < to)
    }

    /// Where a read of events from seq `from` starts in the file: the offset of the
    /// strided event at or before it, and that event's seq.
    pub fn disk_start(&self, from: u64) -> (u64, u64) {
        let i = ((from / OFFSET_STRIDE) as usize).min(self.offsets.len().saturating_sub(1));
        match self.offsets.get(i) {
            Some(off) => (*off, i as u64 * OFFSET_STRIDE),
            None => (self.bytes, self.len),
        }
    }

    /// The time of the last durable event.
    pub fn last_time(&self) -> Option<i64> {
        self.tail.back().map(|(e, _)| e.time)
    }
}

/// Read from `path` the events with seq in `from..to`, at most `max` of them, starting at
/// byte `start` (the line of seq `start_seq`) and reading no further than byte `end` (the
/// durable length when the read was planned). A line that does not parse, or a seq out of
/// order, is corruption: the log on disk is the record, and it is never read around.
pub(crate) fn read_events(
    path: &Path,
    (start, start_seq): (u64, u64),
    end: u64,
    (from, to): (u64, u64),
    max: usize,
) -> Result<Vec<Event>, LogError> {
    let mut file = File::open(path).map_err(io("open", path))?;
    file.seek(SeekFrom::Start(start))
        .map_err(io("seek", path))?;
    let mut reader = BufReader::new(file);
    let mut out = Vec::new();
    let (mut pos, mut want_seq) = (start, start_seq);
    let mut line = Vec::new();
    while pos < end && out.len() < max && want_seq < to {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(io("read", path))? as u64;
        if n == 0 || line.last() != Some(&b'\n') {
            return Err(corrupt(
                path,
                want_seq,
                "the file ends inside its durable part",
            ));
        }
        pos += n;
        let event: Event = serde_json::from_slice(&line[..line.len() - 1])
            .map_err(|e| corrupt(path, want_seq, &e.to_string()))?;
        if event.seq != want_seq {
            return Err(corrupt(
                path,
                want_seq,
                &format!("seq {} where {want_seq} was expected", event.seq),
            ));
        }
        want_seq += 1;
        if event.seq >= from {
            out.push(event);
        }
    }
    Ok(out)
}

fn corrupt(path: &Path, seq: u64, reason: &str) -> LogError {
    LogError::Corrupt {
        path: path.to_owned(),
        // Line 1 is the header; event `seq` is on line `seq + 2`.
        line: seq.saturating_add(2),
        reason: reason.to_owned(),
    }
}
