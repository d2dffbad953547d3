//! Helpers shared by provider implementations and their callers.

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use tether_protocol::ErrorCode;

use crate::ctx::CallCtx;
use crate::error::{ProviderError, Result};
use crate::seam::ByteStream;

/// A byte stream of one buffer.
pub fn once_bytes(data: impl Into<Bytes>) -> ByteStream {
    let data = data.into();
    futures_util::stream::once(async move { Ok(data) }).boxed()
}

/// Collect a byte stream, refusing more than `max` bytes with `FS_TOO_LARGE`.
pub async fn collect(ctx: &CallCtx, path: &str, mut stream: ByteStream, max: u64) -> Result<Bytes> {
    let mut buf = BytesMut::new();
    loop {
        let next = ctx.run(async { Ok(stream.next().await) }).await?;
        match next {
            None => return Ok(buf.freeze()),
            Some(chunk) => {
                let chunk = chunk?;
                if buf.len() as u64 + chunk.len() as u64 > max {
                    return Err(ProviderError::fs(
                        ErrorCode::FsTooLarge,
                        path,
                        format!("file is larger than the {max}-byte limit"),
                    ));
                }
                buf.extend_from_slice(&chunk);
            }
        }
    }
}

/// The names of the entries of directory `dir` that `keep` accepts (none when `dir`
/// does not exist): a provider's own snapshots, for `Provider::list_snapshots`.
pub async fn entry_names(
    dir: &std::path::Path,
    keep: impl Fn(&str) -> bool,
) -> std::io::Result<Vec<String>> {
    let mut rd = match tokio::fs::read_dir(dir).await {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut names = Vec::new();
    while let Some(e) = rd.next_entry().await? {
        if let Some(name) = e.file_name().to_str()
            && keep(name)
        {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

/// Equality of secrets (tokens, keys) whose time depends only on the lengths, not on
/// where the bytes differ (`subtle`'s constant-time comparison).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq as _;
    a.ct_eq(b).into()
}
