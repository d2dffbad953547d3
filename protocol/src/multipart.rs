//! `multipart/form-data` (RFC 7578) as envd's `POST /files` receives it, read
//! incrementally: feed the decoder body chunks as they come, split anywhere, and take
//! each part's headers and then its data in pieces. Pure: bytes in, values out; no I/O
//! (tetherd's E2B front puts it on a request body).
//!
//! Uploads can be large (the SDKs send whole files), so a part's data is handed on as it
//! arrives: whenever the decoder asks for more input it holds at most a part's header
//! block ([`MAX_HEADER_BYTES`]) or a delimiter's length, never a body. Filenames are kept
//! verbatim, directories included: envd's upload takes a part's filename as the
//! destination path when the request names none, which is why a browser-style parser
//! (that strips directories) would not do.

use bytes::{Buf, Bytes, BytesMut};

/// Longest header block of one part, in bytes: from the end of its delimiter to the empty
/// line that ends it. A longer one is refused, however the body is split.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// Why a multipart body could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MultipartError {
    /// The body does not follow the multipart grammar.
    Malformed(&'static str),
    /// The body ended inside a part.
    Truncated,
}

impl std::fmt::Display for MultipartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Malformed(why) => write!(f, "malformed multipart body: {why}"),
            Self::Truncated => f.write_str("the multipart body ended early"),
        }
    }
}

impl std::error::Error for MultipartError {}

/// The headers of one part that matter here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartHeaders {
    /// `name` of the `Content-Disposition`.
    pub name: Option<String>,
    /// `filename` of the `Content-Disposition`.
    pub filename: Option<String>,
}

/// What a decoder call gives: its answer, or the need for more of the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step<T> {
    /// The answer.
    Ready(T),
    /// Push the next chunk of the body, or [`Decoder::finish`] at its end, and call
    /// again.
    NeedInput,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first delimiter.
    Preamble,
    /// Just after a delimiter: `--` (the end) or CRLF and a part's headers follow.
    AfterDelimiter,
    /// Inside a part's body.
    Body,
    /// After the closing delimiter.
    Done,
}

/// An incremental `multipart/form-data` decoder.
#[derive(Debug)]
pub struct Decoder {
    buf: BytesMut,
    /// `\r\n--<boundary>`.
    delimiter: Vec<u8>,
    state: State,
    /// After a delimiter: how much of the buffer is known to hold no end of the headers
    /// (each search for it starts near there, not from the start again).
    scanned: usize,
    /// No more input will come ([`Decoder::finish`]).
    eof: bool,
}

impl Decoder {
    /// A decoder of a body whose parts are delimited by `boundary` (the content type's,
    /// [`boundary_of`]).
    pub fn new(boundary: &str) -> Self {
        let mut delimiter = b"\r\n--".to_vec();
        delimiter.extend_from_slice(boundary.as_bytes());
        // The first delimiter may open the body without a CRLF before it.
        let mut buf = BytesMut::new();
        buf.extend_from_slice(b"\r\n");
        Self {
            buf,
            delimiter,
            state: State::Preamble,
            scanned: 0,
            eof: false,
        }
    }

    /// Add bytes from the body.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The body has ended: from now on a call that would need more input fails instead.
    pub fn finish(&mut self) {
        self.eof = true;
    }

    /// Whether [`Decoder::finish`] was called.
    pub fn is_finished(&self) -> bool {
        self.eof
    }

    /// Bytes held and not yet handed on. Whenever a call answers [`Step::NeedInput`],
    /// at most [`MAX_HEADER_BYTES`] + 3 or the delimiter's length, whichever is larger.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Drop what is held (to skip the rest of a refused body) and return how many bytes
    /// that was.
    pub fn clear(&mut self) -> usize {
        let n = self.buf.len();
        self.buf.clear();
        n
    }

    fn need_input<T>(&self) -> Result<Step<T>, MultipartError> {
        if self.eof {
            Err(MultipartError::Truncated)
        } else {
            Ok(Step::NeedInput)
        }
    }

    /// Advance to the next part and return its headers; `None` after the last part. The
    /// rest of the current part, if any, is skipped.
    pub fn next_part(&mut self) -> Result<Step<Option<PartHeaders>>, MultipartError> {
        loop {
            match self.state {
                State::Done => return Ok(Step::Ready(None)),
                State::Body => loop {
                    match self.next_chunk()? {
                        Step::Ready(Some(_)) => {}
                        Step::Ready(None) => break,
                        Step::NeedInput => return Ok(Step::NeedInput),
                    }
                },
                State::Preamble => match find(&self.buf, &self.delimiter) {
                    Some(i) => {
                        self.buf.advance(i + self.delimiter.len());
                        self.state = State::AfterDelimiter;
                        self.scanned = 0;
                    }
                    None => {
                        // A delimiter may begin in the last bytes: keep those only.
                        let keep = self.delimiter.len();
                        if self.buf.len() > keep {
                            let drop = self.buf.len() - keep;
                            self.buf.advance(drop);
                        }
                        if self.eof {
                            return Err(MultipartError::Malformed("no boundary delimiter found"));
                        }
                        return Ok(Step::NeedInput);
                    }
                },
                State::AfterDelimiter => {
                    if self.buf.len() < 2 {
                        return self.need_input();
                    }
                    if self.buf.starts_with(b"--") {
                        self.state = State::Done;
                        return Ok(Step::Ready(None));
                    }
                    // Headers end at an empty line; the CRLF after the delimiter counts as
                    // the first line break (transport padding before it is allowed). The
                    // limit is on the block, not on what happens to be buffered: else a
                    // body sent in one chunk could have longer headers than in small ones.
                    let from = self.scanned.saturating_sub(3);
                    let Some(end) = find(&self.buf[from..], b"\r\n\r\n").map(|i| from + i) else {
                        // An end still to come would start in the last 3 bytes or later.
                        if self.buf.len() > MAX_HEADER_BYTES + 3 {
                            return Err(MultipartError::Malformed("part headers too long"));
                        }
                        self.scanned = self.buf.len();
                        return self.need_input();
                    };
                    if end > MAX_HEADER_BYTES {
                        return Err(MultipartError::Malformed("part headers too long"));
                    }
                    let block = self.buf.split_to(end + 4);
                    let text = String::from_utf8_lossy(&block);
                    let mut lines = text.split("\r\n");
                    if lines.next().is_some_and(|pad| !pad.trim().is_empty()) {
                        return Err(MultipartError::Malformed("junk after a boundary delimiter"));
                    }
                    let mut headers = PartHeaders::default();
                    for line in lines {
                        let Some((name, value)) = line.split_once(':') else {
                            continue;
                        };
                        if name.trim().eq_ignore_ascii_case("content-disposition") {
                            headers.name = disposition_param(value, "name");
                            headers.filename = disposition_param(value, "filename");
                        }
                    }
                    self.state = State::Body;
                    return Ok(Step::Ready(Some(headers)));
                }
            }
        }
    }

    /// The next piece of the current part's data; `None` at its end (and outside a
    /// part).
    pub fn next_chunk(&mut self) -> Result<Step<Option<Bytes>>, MultipartError> {
        if self.state != State::Body {
            return Ok(Step::Ready(None));
        }
        if let Some(i) = find(&self.buf, &self.delimiter) {
            if i > 0 {
                return Ok(Step::Ready(Some(self.buf.split_to(i).freeze())));
            }
            self.buf.advance(self.delimiter.len());
            self.state = State::AfterDelimiter;
            self.scanned = 0;
            return Ok(Step::Ready(None));
        }
        // Everything but a possible delimiter prefix at the end is part data.
        let safe = self.buf.len().saturating_sub(self.delimiter.len() - 1);
        if safe > 0 {
            return Ok(Step::Ready(Some(self.buf.split_to(safe).freeze())));
        }
        self.need_input()
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A parameter of a `Content-Disposition` value: quoted (backslash escapes) or a token.
fn disposition_param(value: &str, want: &str) -> Option<String> {
    let mut rest = value;
    // Skip the disposition type.
    rest = rest.split_once(';').map_or("", |(_, r)| r);
    while !rest.trim().is_empty() {
        let r = rest.trim_start();
        let (name, after) = r.split_once('=')?;
        let name = name.trim();
        let after = after.trim_start();
        let (val, next) = if let Some(q) = after.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = q.char_indices();
            let mut end = q.len();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            out.push(n);
                        }
                    }
                    '"' => {
                        end = i + 1;
                        break;
                    }
                    c => out.push(c),
                }
            }
            let next = q[end.min(q.len())..].split_once(';').map_or("", |(_, r)| r);
            (out, next)
        } else {
            let (v, next) = after.split_once(';').unwrap_or((after, ""));
            (v.trim().to_owned(), next)
        };
        if name.eq_ignore_ascii_case(want) {
            // Browsers and undici percent-encode `"` and line breaks in filenames.
            return Some(
                val.replace("%22", "\"")
                    .replace("%0A", "\n")
                    .replace("%0D", "\r"),
            );
        }
        rest = next;
    }
    None
}

/// The boundary of a `multipart/form-data` content type.
pub fn boundary_of(content_type: &str) -> Option<String> {
    let mut parts = content_type.split(';');
    let base = parts.next()?.trim();
    if !base.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    parts
        .find_map(|p| {
            let (k, v) = p.split_once('=')?;
            k.trim()
                .eq_ignore_ascii_case("boundary")
                .then(|| v.trim().trim_matches('"').to_owned())
        })
        .filter(|b| !b.is_empty() && b.len() <= 70)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decode a body delivered in `chunks`: each part's headers and data, or the error.
    fn collect<'a>(
        boundary: &str,
        chunks: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<Vec<(PartHeaders, Vec<u8>)>, MultipartError> {
        let mut chunks = chunks.into_iter();
        let mut dec = Decoder::new(boundary);
        let mut feed = |dec: &mut Decoder| match chunks.next() {
            Some(c) => dec.push(c),
            None => dec.finish(),
        };
        let mut out = Vec::new();
        loop {
            let h = match dec.next_part()? {
                Step::Ready(Some(h)) => h,
                Step::Ready(None) => return Ok(out),
                Step::NeedInput => {
                    feed(&mut dec);
                    continue;
                }
            };
            let mut data = Vec::new();
            loop {
                match dec.next_chunk()? {
                    Step::Ready(Some(c)) => data.extend_from_slice(&c),
                    Step::Ready(None) => break,
                    Step::NeedInput => feed(&mut dec),
                }
            }
            out.push((h, data));
        }
    }

    const BODY: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/dir/a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b \\\"q\\\".bin\"\r\n\r\n\r\n--X\r\n--XyZ--\r\n";

    #[test]
    fn parts_keep_full_paths_and_exact_bytes_across_any_chunking() {
        let whole = collect("XyZ", [BODY]).unwrap();
        assert_eq!(whole.len(), 2);
        assert_eq!(whole[0].0.name.as_deref(), Some("file"));
        assert_eq!(whole[0].0.filename.as_deref(), Some("/home/user/dir/a.txt"));
        assert_eq!(whole[0].1, b"hello");
        assert_eq!(whole[1].0.filename.as_deref(), Some("b \"q\".bin"));
        // A part whose data looks like the start of a delimiter.
        assert_eq!(whole[1].1, b"\r\n--X");
        // Byte-by-byte chunking yields the same parts.
        assert_eq!(collect("XyZ", BODY.chunks(1)).unwrap(), whole);
        assert_eq!(collect("XyZ", BODY.chunks(7)).unwrap(), whole);
    }

    #[test]
    fn truncated_and_malformed_bodies_are_errors() {
        let cut: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc";
        assert_eq!(collect("XyZ", [cut]), Err(MultipartError::Truncated));
        assert!(matches!(
            collect("XyZ", [b"no delimiter here".as_slice()]),
            Err(MultipartError::Malformed(_))
        ));
        assert_eq!(
            boundary_of("multipart/form-data; boundary=\"abc\"").as_deref(),
            Some("abc")
        );
        assert_eq!(boundary_of("application/json"), None);
    }

    /// A body whose one part has a header block of `len` bytes.
    fn with_headers(len: usize) -> Vec<u8> {
        let mut body = b"--XyZ\r\nX-Pad: ".to_vec();
        body.resize(5 + len, b'p');
        body.extend_from_slice(b"\r\n\r\ndata\r\n--XyZ--\r\n");
        body
    }

    #[test]
    fn the_header_limit_holds_however_the_body_is_split() {
        // Found by the `multipart` fuzz target: headers over the limit were refused when
        // they came in small chunks and taken when they came in one.
        let at = with_headers(MAX_HEADER_BYTES);
        let over = with_headers(MAX_HEADER_BYTES + 1);
        let refused = Err(MultipartError::Malformed("part headers too long"));
        for size in [1, 100, 4096, usize::MAX] {
            let parts = collect("XyZ", at.chunks(size.min(at.len()))).unwrap();
            assert_eq!(parts.len(), 1);
            assert_eq!(parts[0].1, b"data");
            assert_eq!(collect("XyZ", over.chunks(size.min(over.len()))), refused);
        }
        // No end of the headers yet: more input is asked for while the end could still
        // come within the limit, and the body refused as soon as it cannot.
        let mut dec = Decoder::new("XyZ");
        dec.push(b"--XyZ");
        dec.push(&vec![b'p'; MAX_HEADER_BYTES + 3]);
        assert_eq!(dec.next_part(), Ok(Step::NeedInput));
        assert_eq!(dec.buffered(), MAX_HEADER_BYTES + 3);
        dec.push(b"p");
        assert_eq!(
            dec.next_part(),
            Err(MultipartError::Malformed("part headers too long"))
        );
    }
}
