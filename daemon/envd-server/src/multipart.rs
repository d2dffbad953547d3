//! A streaming `multipart/form-data` reader for envd's `POST /files`: the decoder of
//! [`tether_protocol::multipart`] on a request body. A part's data is handed on in pieces
//! as it arrives, so an upload is never held whole.

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
pub(super) use tether_protocol::multipart::boundary_of;
use tether_protocol::multipart::{Decoder, PartHeaders, Step};

/// Why a multipart body could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum MultipartError {
    /// The body is not a well-formed multipart body.
    #[error(transparent)]
    Decode(#[from] tether_protocol::multipart::MultipartError),
    /// The transport failed.
    #[error("cannot read the request body: {0}")]
    Body(String),
}

/// A streaming multipart reader.
pub(super) struct Multipart {
    body: BoxStream<'static, Result<Bytes, String>>,
    dec: Decoder,
}

impl Multipart {
    pub(super) fn new(body: BoxStream<'static, Result<Bytes, String>>, boundary: &str) -> Self {
        Self {
            body,
            dec: Decoder::new(boundary),
        }
    }

    /// Hand the decoder the next chunk of the body, or its end.
    async fn fill(&mut self) -> Result<(), MultipartError> {
        match self.body.next().await {
            Some(Ok(chunk)) => self.dec.push(&chunk),
            Some(Err(e)) => return Err(MultipartError::Body(e)),
            None => self.dec.finish(),
        }
        Ok(())
    }

    /// Advance to the next part and return its headers; `None` after the last part. The
    /// rest of the current part, if any, is skipped.
    pub(super) async fn next_part(&mut self) -> Result<Option<PartHeaders>, MultipartError> {
        loop {
            match self.dec.next_part()? {
                Step::Ready(headers) => return Ok(headers),
                // After the body's end the decoder answers or fails: this loop ends.
                Step::NeedInput => self.fill().await?,
            }
        }
    }

    /// The next chunk of the current part's body; `None` at its end.
    pub(super) async fn next_chunk(&mut self) -> Result<Option<Bytes>, MultipartError> {
        loop {
            match self.dec.next_chunk()? {
                Step::Ready(chunk) => return Ok(chunk),
                Step::NeedInput => self.fill().await?,
            }
        }
    }

    /// Read and drop what is left of the body, up to `limit` bytes: `true` when the body
    /// was read to its end within it.
    pub(super) async fn drain(&mut self, limit: usize) -> bool {
        let mut read = self.dec.clear();
        while !self.dec.is_finished() {
            if read > limit {
                return false;
            }
            match self.body.next().await {
                Some(Ok(chunk)) => read += chunk.len(),
                Some(Err(_)) => return false,
                None => self.dec.finish(),
            }
        }
        read <= limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_of(
        chunks: Vec<Result<&'static [u8], &'static str>>,
    ) -> BoxStream<'static, Result<Bytes, String>> {
        futures_util::stream::iter(
            chunks
                .into_iter()
                .map(|c| c.map(Bytes::from_static).map_err(str::to_owned)),
        )
        .boxed()
    }

    #[tokio::test]
    async fn a_body_read_in_chunks_yields_its_parts_then_none() {
        let body = b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nhello\r\n--b--\r\n";
        let mut mp = Multipart::new(body_of(body.chunks(3).map(Ok).collect()), "b");
        let part = mp.next_part().await.unwrap().unwrap();
        assert_eq!(part.filename.as_deref(), Some("a"));
        let mut data = Vec::new();
        while let Some(c) = mp.next_chunk().await.unwrap() {
            data.extend_from_slice(&c);
        }
        assert_eq!(data, b"hello");
        assert_eq!(mp.next_part().await.unwrap(), None);
        assert!(mp.drain(16).await, "the epilogue is read to the end");
    }

    #[tokio::test]
    async fn a_truncated_body_and_a_failed_transport_are_errors() {
        let mut mp = Multipart::new(
            body_of(vec![Ok(
                b"--b\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc",
            )]),
            "b",
        );
        assert!(mp.next_part().await.unwrap().is_some());
        let err = loop {
            match mp.next_chunk().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("a truncated part ends"),
                Err(e) => break e,
            }
        };
        assert_eq!(
            err,
            MultipartError::Decode(tether_protocol::multipart::MultipartError::Truncated)
        );
        let mut mp = Multipart::new(body_of(vec![Ok(b"--b\r\n"), Err("reset")]), "b");
        assert_eq!(
            mp.next_part().await,
            Err(MultipartError::Body("reset".into()))
        );
        let mut mp = Multipart::new(body_of(vec![Ok(b"0123456789"), Ok(b"0123456789")]), "b");
        assert!(!mp.drain(15).await, "a body over the drain limit is left");
    }
}
