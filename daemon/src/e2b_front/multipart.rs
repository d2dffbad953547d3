//! A streaming `multipart/form-data` reader for envd's `POST /files`.
//!
//! Uploads can be large (the SDKs send whole files), so a part's body is handed on in
//! chunks as it arrives and at most one chunk plus one delimiter is buffered. Filenames
//! are kept verbatim, directories included: envd's upload takes a part's filename as the
//! destination path when the request names none, which is why a browser-style parser
//! (that strips directories) would not do.

use bytes::{Buf, Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::stream::BoxStream;

/// Why a multipart body could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum MultipartError {
    /// The body does not follow the multipart grammar.
    #[error("malformed multipart body: {0}")]
    Malformed(&'static str),
    /// The body ended inside a part.
    #[error("the multipart body ended early")]
    Truncated,
    /// The transport failed.
    #[error("cannot read the request body: {0}")]
    Body(String),
}

/// The headers of one part that matter here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct PartHeaders {
    /// `name` of the `Content-Disposition`.
    pub(super) name: Option<String>,
    /// `filename` of the `Content-Disposition`.
    pub(super) filename: Option<String>,
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

/// Longest header block of one part.
const MAX_HEADER_BYTES: usize = 16 * 1024;

/// A streaming multipart reader.
pub(super) struct Multipart {
    body: BoxStream<'static, Result<Bytes, String>>,
    buf: BytesMut,
    /// `\r\n--<boundary>`.
    delimiter: Vec<u8>,
    state: State,
    eof: bool,
}

impl Multipart {
    pub(super) fn new(body: BoxStream<'static, Result<Bytes, String>>, boundary: &str) -> Self {
        let mut delimiter = b"\r\n--".to_vec();
        delimiter.extend_from_slice(boundary.as_bytes());
        // The first delimiter may open the body without a CRLF before it.
        let mut buf = BytesMut::new();
        buf.extend_from_slice(b"\r\n");
        Self {
            body,
            buf,
            delimiter,
            state: State::Preamble,
            eof: false,
        }
    }

    /// Read more of the body; `false` at its end.
    async fn fill(&mut self) -> Result<bool, MultipartError> {
        if self.eof {
            return Ok(false);
        }
        match self.body.next().await {
            Some(Ok(chunk)) => {
                self.buf.extend_from_slice(&chunk);
                Ok(true)
            }
            Some(Err(e)) => Err(MultipartError::Body(e)),
            None => {
                self.eof = true;
                Ok(false)
            }
        }
    }

    /// Advance to the next part and return its headers; `None` after the last part. The
    /// rest of the current part, if any, is skipped.
    pub(super) async fn next_part(&mut self) -> Result<Option<PartHeaders>, MultipartError> {
        loop {
            match self.state {
                State::Done => return Ok(None),
                State::Body => while self.next_chunk().await?.is_some() {},
                State::Preamble => match find(&self.buf, &self.delimiter) {
                    Some(i) => {
                        self.buf.advance(i + self.delimiter.len());
                        self.state = State::AfterDelimiter;
                    }
                    None => {
                        let keep = self.delimiter.len();
                        if self.buf.len() > keep {
                            let drop = self.buf.len() - keep;
                            self.buf.advance(drop);
                        }
                        if !self.fill().await? {
                            return Err(MultipartError::Malformed("no boundary delimiter found"));
                        }
                    }
                },
                State::AfterDelimiter => {
                    while self.buf.len() < 2 {
                        if !self.fill().await? {
                            return Err(MultipartError::Truncated);
                        }
                    }
                    if self.buf.starts_with(b"--") {
                        self.state = State::Done;
                        return Ok(None);
                    }
                    // Headers end at an empty line; the CRLF after the delimiter counts as
                    // the first line break (transport padding before it is allowed).
                    let end = loop {
                        if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                            break i;
                        }
                        if self.buf.len() > MAX_HEADER_BYTES {
                            return Err(MultipartError::Malformed("part headers too long"));
                        }
                        if !self.fill().await? {
                            return Err(MultipartError::Truncated);
                        }
                    };
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
                    return Ok(Some(headers));
                }
            }
        }
    }

    /// Read and drop what is left of the body, up to `limit` bytes: `true` when the body
    /// was read to its end within it.
    pub(super) async fn drain(&mut self, limit: usize) -> bool {
        let mut read = self.buf.len();
        self.buf.clear();
        while !self.eof {
            if read > limit {
                return false;
            }
            match self.body.next().await {
                Some(Ok(chunk)) => read += chunk.len(),
                Some(Err(_)) => return false,
                None => self.eof = true,
            }
        }
        read <= limit
    }

    /// The next chunk of the current part's body; `None` at its end.
    pub(super) async fn next_chunk(&mut self) -> Result<Option<Bytes>, MultipartError> {
        if self.state != State::Body {
            return Ok(None);
        }
        loop {
            if let Some(i) = find(&self.buf, &self.delimiter) {
                if i > 0 {
                    return Ok(Some(self.buf.split_to(i).freeze()));
                }
                self.buf.advance(self.delimiter.len());
                self.state = State::AfterDelimiter;
                return Ok(None);
            }
            // Everything but a possible delimiter prefix at the end is part data.
            let safe = self.buf.len().saturating_sub(self.delimiter.len() - 1);
            if safe > 0 {
                return Ok(Some(self.buf.split_to(safe).freeze()));
            }
            if !self.fill().await? {
                return Err(MultipartError::Truncated);
            }
        }
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
pub(super) fn boundary_of(content_type: &str) -> Option<String> {
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

    fn body_of(chunks: Vec<&'static [u8]>) -> BoxStream<'static, Result<Bytes, String>> {
        futures_util::stream::iter(chunks.into_iter().map(|c| Ok(Bytes::from_static(c)))).boxed()
    }

    async fn collect(mp: &mut Multipart) -> Vec<(PartHeaders, Vec<u8>)> {
        let mut out = Vec::new();
        while let Some(h) = mp.next_part().await.unwrap() {
            let mut data = Vec::new();
            while let Some(c) = mp.next_chunk().await.unwrap() {
                data.extend_from_slice(&c);
            }
            out.push((h, data));
        }
        out
    }

    const BODY: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/dir/a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b \\\"q\\\".bin\"\r\n\r\n\r\n--X\r\n--XyZ--\r\n";

    #[tokio::test]
    async fn parts_keep_full_paths_and_exact_bytes_across_any_chunking() {
        let whole = collect(&mut Multipart::new(body_of(vec![BODY]), "XyZ")).await;
        assert_eq!(whole.len(), 2);
        assert_eq!(whole[0].0.name.as_deref(), Some("file"));
        assert_eq!(whole[0].0.filename.as_deref(), Some("/home/user/dir/a.txt"));
        assert_eq!(whole[0].1, b"hello");
        assert_eq!(whole[1].0.filename.as_deref(), Some("b \"q\".bin"));
        // A part whose data looks like the start of a delimiter.
        assert_eq!(whole[1].1, b"\r\n--X");
        // Byte-by-byte chunking yields the same parts.
        let bytes: Vec<&'static [u8]> = BODY.chunks(1).collect();
        assert_eq!(
            collect(&mut Multipart::new(body_of(bytes), "XyZ")).await,
            whole
        );
        let sevens: Vec<&'static [u8]> = BODY.chunks(7).collect();
        assert_eq!(
            collect(&mut Multipart::new(body_of(sevens), "XyZ")).await,
            whole
        );
    }

    #[tokio::test]
    async fn truncated_and_malformed_bodies_are_errors() {
        let mut mp = Multipart::new(
            body_of(vec![
                b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc",
            ]),
            "XyZ",
        );
        assert!(mp.next_part().await.unwrap().is_some());
        let mut err = None;
        loop {
            match mp.next_chunk().await {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        assert_eq!(err, Some(MultipartError::Truncated));
        let mut none = Multipart::new(body_of(vec![b"no delimiter here"]), "XyZ");
        assert!(matches!(
            none.next_part().await,
            Err(MultipartError::Malformed(_))
        ));
        assert_eq!(
            boundary_of("multipart/form-data; boundary=\"abc\"").as_deref(),
            Some("abc")
        );
        assert_eq!(boundary_of("application/json"), None);
    }
}
