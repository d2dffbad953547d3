//! Files of an SSH sandbox: bodies over SFTP, metadata and publication by one small
//! helper script per call, every path confined to the sandbox's workspace.
//!
//! Paths are normalised lexically first (relative ones against the workspace), and a path
//! that leaves the workspace is refused without a round trip. The helper ([`FS`]) then
//! resolves symlinks on the host (`realpath -m`) and refuses a path whose resolution leaves
//! the workspace, so a link made by a command inside the sandbox cannot reach the host's
//! other files. `stat`, `remove` and the source of `rename` do not follow the last
//! component, so links themselves can be inspected and removed.
//!
//! A write streams into a temporary file beside the target (pipelined SFTP writes), then
//! the helper checks the guard and publishes it atomically: `mv` for an unconditional or
//! versioned replace, a hard link for `create_if_absent` (which cannot clobber). Versions
//! are `inode, size, mtime, ctime` with nanoseconds, so any change of the file, ours or a
//! command's, gives a new version.
//!
//! The checks run on the host one step before the operation, so a command racing the
//! provider inside the workspace can still swap a path in between; the workspace is the
//! user's, and the provider does not claim more than that.

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use russh_sftp::protocol::{FileAttributes, OpenFlags};
use std::sync::Arc;
use tether_protocol::ErrorCode;
use tether_protocol::fs::{
    ByteRange, DirEntry, FileKind, FileStat, Version, WriteGuard, WriteOutcome,
};
use tether_provider::{ByteStream, CallCtx, Fs, ProviderError, Result};

use crate::error::{script_error, sftp_error};
use crate::sandbox::SandboxCore;

/// Name prefix of the temporary files of atomic writes (hidden from listings).
pub const TEMP_PREFIX: &str = ".tether-w-";

/// SFTP requests in flight per transfer.
const SFTP_IN_FLIGHT: usize = 32;

/// The file-system helper (`FS OP WORKSPACE args...`). Records are NUL-terminated:
/// `mode-hex TAB size TAB mtime TAB ctime TAB inode TAB path`. Errors: `E CODE message`
/// on stdout, status 3.
pub const FS: &str = r#"op=$1 w=$2
shift 2
fail() { printf 'E %s %s\n' "$1" "$2"; exit 3; }
conf() {
  R=$(realpath -m -- "$1" 2>/dev/null) || fail IO "cannot resolve the path"
  case "$R" in "$w"|"$w"/*) ;; *) fail PD "the path leaves the workspace" ;; esac
}
nofollow() {
  if [ "$1" = "$w" ]; then R=$w; return; fi
  conf "${1%/*}"
  R="$R/${1##*/}"
}
rec() { stat --printf '%f\t%s\t%.9Y\t%.9Z\t%i\t%n\0' -- "$@"; }
there() { [ -e "$1" ] || [ -L "$1" ]; }
case $op in
stat)
  nofollow "$1"; there "$R" || fail NF "no such file or directory"
  rec "$R"
  if [ -L "$R" ]; then t=$(readlink -- "$R"); printf '%s\0' "$t"; fi ;;
list)
  conf "$1"; there "$R" || fail NF "no such file or directory"
  [ -d "$R" ] || fail ND "not a directory"
  cd -- "$R" || fail IO "cannot enter the directory"
  find . -mindepth 1 -maxdepth "$2" ! -name '.tether-w-*' -print0 | xargs -0r stat --printf '%f\t%s\t%.9Y\t%.9Z\t%i\t%n\0' -- ;;
mkdir)
  conf "$1"; there "$R" && fail EX "already exists"
  if [ "$2" = 1 ]; then
    mkdir -p -- "$R" 2>/dev/null || fail ND "a parent is not a directory"
  else
    p=${R%/*}; [ -e "$p" ] || fail NF "the parent does not exist"
    [ -d "$p" ] || fail ND "the parent is not a directory"
    mkdir -- "$R" 2>/dev/null || fail IO "mkdir failed"
  fi
  rec "$R" ;;
rename)
  nofollow "$1"; a=$R; there "$a" || fail NF "no such file or directory"
  [ "$a" = "$w" ] && fail PD "the workspace itself"
  nofollow "$2"; b=$R; [ -d "${b%/*}" ] || fail NF "the target's directory does not exist"
  e=$(mv -fT -- "$a" "$b" 2>&1) || fail IO "$e"
  rec "$b" ;;
remove)
  nofollow "$1"; there "$R" || fail NF "no such file or directory"
  [ "$R" = "$w" ] && fail PD "the workspace itself"
  if [ -d "$R" ] && [ ! -L "$R" ]; then
    if [ "$2" = 1 ]; then chmod -R u+rwx -- "$R" 2>/dev/null; rm -rf -- "$R" || fail IO "rm failed"
    else rmdir -- "$R" 2>/dev/null || fail NE "the directory is not empty"; fi
  else rm -f -- "$R" || fail IO "rm failed"; fi ;;
rpath)
  conf "$1"; there "$R" || fail NF "no such file or directory"
  [ -d "$R" ] && fail ID "is a directory"
  [ -f "$R" ] || fail NR "not a regular file"
  printf '%s\0' "$R"; rec "$R" ;;
wprep)
  conf "$1"; [ -d "$R" ] && fail ID "is a directory"
  there "$R" && [ ! -f "$R" ] && fail NR "not a regular file"
  case $2 in
  create) there "$R" && fail EX "already exists" ;;
  replace) [ -f "$R" ] || fail VM "the file does not exist" ;;
  esac
  p=${R%/*}
  [ -d "$p" ] || mkdir -p -- "$p" 2>/dev/null || fail ND "a parent is not a directory"
  printf '%s\0' "$R" ;;
publish)
  t=$1; conf "$2"; g=$3 v=$4
  x=0; there "$R" && x=1
  case $g in
  none)
    [ -d "$R" ] && { rm -f -- "$t"; fail ID "is a directory"; }
    mv -fT -- "$t" "$R" 2>/dev/null || { rm -f -- "$t"; fail IO "cannot publish"; } ;;
  create)
    if ! ln -T -- "$t" "$R" 2>/dev/null; then rm -f -- "$t"; there "$R" && fail EX "already exists"; fail IO "cannot publish"; fi
    rm -f -- "$t" ;;
  replace)
    [ "$x" = 1 ] || { rm -f -- "$t"; fail VM "the file does not exist"; }
    c=$(stat -c 'i%is%sm%.9Yc%.9Z' -- "$R")
    [ "$c" = "$v" ] || { rm -f -- "$t"; fail VM "the version does not match"; }
    mv -fT -- "$t" "$R" 2>/dev/null || { rm -f -- "$t"; fail IO "cannot publish"; } ;;
  esac
  printf '%s\0' "$x"; rec "$R" ;;
*) fail IO "unknown operation" ;;
esac"#;

/// Normalise `path` (relative ones against `base`) to an absolute path without `.`/`..`.
pub fn normalize(base: &str, path: &str) -> Result<String> {
    if path.contains('\0') {
        return Err(ProviderError::InvalidRequest {
            message: "a path contains NUL".into(),
        });
    }
    let joined = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("{base}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for c in joined.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// One parsed stat record.
fn parse_record(rec: &str, link: Option<String>) -> Option<FileStat> {
    let mut f = rec.splitn(6, '\t');
    let mode = u32::from_str_radix(f.next()?, 16).ok()?;
    let size: u64 = f.next()?.parse().ok()?;
    let mtime = f.next()?;
    let ctime = f.next()?;
    let ino = f.next()?;
    let path = f.next()?.to_owned();
    let kind = match mode & 0o170000 {
        0o040000 => FileKind::Dir,
        0o100000 => FileKind::File,
        0o120000 => FileKind::Symlink,
        _ => FileKind::Other,
    };
    let secs: f64 = mtime.parse().unwrap_or(0.0);
    let name = path.rsplit('/').next().unwrap_or("").to_owned();
    Some(FileStat {
        version: Version(format!("i{ino}s{size}m{mtime}c{ctime}")),
        name,
        path,
        kind,
        size,
        mode: mode & 0o7777,
        modified_ms: (secs * 1000.0) as i64,
        symlink_target: link,
    })
}

fn records(out: &[u8]) -> Vec<String> {
    out.split(|&b| b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

fn bad_output(what: &str) -> ProviderError {
    ProviderError::Backend {
        message: format!("ssh: unexpected output of the file helper ({what})"),
        source: None,
    }
}

/// The file side of an SSH sandbox.
#[derive(Debug)]
pub struct SshFs {
    pub(crate) core: Arc<SandboxCore>,
}

impl SshFs {
    /// The normalised host path of a sandbox path, refused if it leaves the workspace.
    fn resolve(&self, path: &str) -> Result<String> {
        let ws = &self.core.workspace;
        let p = normalize(ws, path)?;
        if p == *ws || p.starts_with(&format!("{ws}/")) {
            Ok(p)
        } else {
            Err(ProviderError::fs(
                ErrorCode::FsPermissionDenied,
                path,
                "the path leaves the sandbox's workspace",
            ))
        }
    }

    /// Run one helper operation; `Ok(stdout)` or the `FS_*` error it reported.
    async fn helper(&self, ctx: &CallCtx, path: &str, op: &str, args: &[&str]) -> Result<Vec<u8>> {
        let mut all = vec![op, self.core.workspace.as_str()];
        all.extend_from_slice(args);
        let line = self.core.host.line(FS, &all);
        let out = match op {
            "stat" | "list" | "rpath" => self.core.host.exec_idempotent(ctx, &line).await?,
            _ => self.core.host.exec(ctx, &line, None).await?,
        };
        match out.code {
            Some(0) => Ok(out.stdout),
            _ => Err(script_error(path, &out.out()).unwrap_or_else(|| {
                ProviderError::fs(
                    ErrorCode::FsIoError,
                    path,
                    format!("the file helper failed: {}", out.err()),
                )
            })),
        }
    }

    async fn remove_temp(&self, ctx: &CallCtx, tmp: &str) {
        if let Ok((sftp, _lease)) = self.core.host.sftp(ctx).await {
            let _ = sftp.session.remove(tmp).await;
        }
    }

    /// Stream `data` into a new file `tmp` over SFTP; returns the bytes written.
    async fn upload(&self, ctx: &CallCtx, tmp: &str, mut data: ByteStream) -> Result<u64> {
        let (sftp, _lease) = self.core.host.sftp(ctx).await?;
        let chunk_len = sftp.write_chunk;
        let sftp = sftp.session;
        let flags = OpenFlags::WRITE | OpenFlags::CREATE | OpenFlags::EXCLUDE | OpenFlags::TRUNCATE;
        let attrs = FileAttributes {
            permissions: Some(0o644),
            ..FileAttributes::empty()
        };
        let handle = ctx
            .run(async {
                sftp.open(tmp, flags, attrs)
                    .await
                    .map_err(|e| sftp_error(tmp, e))
            })
            .await?
            .handle;
        let result = ctx
            .run(async {
                let mut inflight = FuturesUnordered::new();
                let mut offset = 0u64;
                let mut pending = Vec::with_capacity(chunk_len);
                let mut input_done = false;
                loop {
                    while !input_done && inflight.len() < SFTP_IN_FLIGHT {
                        // Fill one request's worth of bytes.
                        while pending.len() < chunk_len {
                            match data.next().await {
                                Some(Ok(b)) => pending.extend_from_slice(&b),
                                Some(Err(e)) => return Err(e),
                                None => {
                                    input_done = true;
                                    break;
                                }
                            }
                        }
                        while pending.len() >= chunk_len || (input_done && !pending.is_empty()) {
                            let n = pending.len().min(chunk_len);
                            let chunk: Vec<u8> = pending.drain(..n).collect();
                            let at = offset;
                            offset += n as u64;
                            let s = sftp.clone();
                            let h = handle.clone();
                            inflight.push(async move { s.write(h, at, chunk).await });
                        }
                    }
                    match inflight.next().await {
                        Some(Ok(_)) => {}
                        Some(Err(e)) => return Err(sftp_error(tmp, e)),
                        None if input_done => break,
                        None => {}
                    }
                }
                Ok(offset)
            })
            .await;
        let closed = sftp.close(handle).await;
        let n = result?;
        closed.map_err(|e| sftp_error(tmp, e))?;
        Ok(n)
    }
}

#[async_trait]
impl Fs for SshFs {
    async fn stat(&self, ctx: &CallCtx, path: &str) -> Result<FileStat> {
        let p = self.resolve(path)?;
        let out = self.helper(ctx, path, "stat", &[&p]).await?;
        let recs = records(&out);
        let link = recs.get(1).cloned();
        recs.first()
            .and_then(|r| parse_record(r, link))
            .ok_or_else(|| bad_output("stat"))
    }

    async fn read(&self, ctx: &CallCtx, path: &str, range: ByteRange) -> Result<ByteStream> {
        let p = self.resolve(path)?;
        let out = self.helper(ctx, path, "rpath", &[&p]).await?;
        let recs = records(&out);
        let (Some(real), Some(st)) = (
            recs.first().cloned(),
            recs.get(1).and_then(|r| parse_record(r, None)),
        ) else {
            return Err(bad_output("rpath"));
        };
        let end = match range.length {
            Some(l) => st.size.min(range.offset.saturating_add(l)),
            None => st.size,
        };
        let start = range.offset.min(end);
        if start >= end {
            return Ok(futures_util::stream::empty().boxed());
        }
        let (sftp, lease) = self.core.host.sftp(ctx).await?;
        let chunk_len = sftp.read_chunk;
        let sftp = sftp.session;
        let handle = ctx
            .run(async {
                sftp.open(&real, OpenFlags::READ, FileAttributes::empty())
                    .await
                    .map_err(|e| sftp_error(path, e))
            })
            .await?
            .handle;
        let path = path.to_owned();
        // A read that loses its connection reports why it was lost (the transport idle
        // clock, or a broken link), not an SFTP failure.
        let conn = lease.conn.clone();
        let offsets: Vec<(u64, u64)> = (start..end)
            .step_by(chunk_len)
            .map(|o| (o, (end - o).min(chunk_len as u64)))
            .collect();
        let s2 = sftp.clone();
        let h2 = handle.clone();
        let p2 = path.clone();
        let body = futures_util::stream::iter(offsets)
            .map(move |(o, n)| {
                let s = sftp.clone();
                let h = handle.clone();
                let p = path.clone();
                let conn = conn.clone();
                async move {
                    // A server may answer a read with fewer bytes than asked (the SFTP
                    // draft allows it anywhere): ask again for the rest, so that every
                    // chunk is whole. End of file (the file shrank) ends it early; the
                    // reader then sees fewer bytes.
                    let mut got: Vec<u8> = Vec::new();
                    while (got.len() as u64) < n {
                        let want = u32::try_from(n - got.len() as u64).unwrap_or(u32::MAX);
                        match s.read(h.clone(), o + got.len() as u64, want).await {
                            Ok(d) if d.data.is_empty() => break,
                            Ok(d) if got.is_empty() && d.data.len() as u64 == n => {
                                return Ok(Bytes::from(d.data));
                            }
                            Ok(d) => got.extend_from_slice(&d.data),
                            Err(russh_sftp::client::error::Error::Status(st))
                                if st.status_code == russh_sftp::protocol::StatusCode::Eof =>
                            {
                                break;
                            }
                            Err(_) if conn.closed_now() => return Err(conn.lost("a read")),
                            Err(e) => return Err(sftp_error(&p, e)),
                        }
                    }
                    Ok(Bytes::from(got))
                }
            })
            .buffered(SFTP_IN_FLIGHT)
            .filter(|r| std::future::ready(!matches!(r, Ok(b) if b.is_empty())));
        let closing = futures_util::stream::once(async move {
            let _ = s2.close(h2).await;
            drop(lease);
            drop(p2);
            Ok(Bytes::new())
        })
        .filter(|_| std::future::ready(false));
        Ok(body.chain(closing).boxed())
    }

    async fn write(
        &self,
        ctx: &CallCtx,
        path: &str,
        data: ByteStream,
        guard: WriteGuard,
    ) -> Result<WriteOutcome> {
        let p = self.resolve(path)?;
        let g = match &guard {
            WriteGuard::None => "none",
            WriteGuard::CreateIfAbsent => "create",
            WriteGuard::ReplaceIfVersion { .. } => "replace",
        };
        let out = self.helper(ctx, path, "wprep", &[&p, g]).await?;
        let real = records(&out)
            .into_iter()
            .next()
            .ok_or_else(|| bad_output("wprep"))?;
        let dir = real.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
        let tmp = format!("{dir}/{TEMP_PREFIX}{}", uuid::Uuid::new_v4().simple());
        if let Err(e) = self.upload(ctx, &tmp, data).await {
            self.remove_temp(&CallCtx::new("ssh-cleanup"), &tmp).await;
            return Err(e);
        }
        let v = match &guard {
            WriteGuard::ReplaceIfVersion { version } => version.0.clone(),
            _ => String::new(),
        };
        let out = match self
            .helper(ctx, path, "publish", &[&tmp, &real, g, &v])
            .await
        {
            Ok(o) => o,
            Err(e) => {
                self.remove_temp(&CallCtx::new("ssh-cleanup"), &tmp).await;
                return Err(e);
            }
        };
        let recs = records(&out);
        let existed = recs.first().map(String::as_str) == Some("1");
        let st = recs
            .get(1)
            .and_then(|r| parse_record(r, None))
            .ok_or_else(|| bad_output("publish"))?;
        Ok(WriteOutcome {
            path: st.path,
            version: st.version,
            size: st.size,
            created: !existed,
        })
    }

    async fn list(&self, ctx: &CallCtx, path: &str, depth: u32) -> Result<Vec<DirEntry>> {
        let p = self.resolve(path)?;
        let depth = depth.max(1);
        let out = self
            .helper(ctx, path, "list", &[&p, &depth.to_string()])
            .await?;
        // The listing is of the resolved directory; paths are reported under it.
        let base = p.trim_end_matches('/').to_owned();
        let mut entries: Vec<DirEntry> = records(&out)
            .iter()
            .filter_map(|r| parse_record(r, None))
            .map(|mut st| {
                let rel = st.path.trim_start_matches("./").to_owned();
                let d = rel.split('/').count() as u32;
                st.path = if base == "/" {
                    format!("/{rel}")
                } else {
                    format!("{base}/{rel}")
                };
                DirEntry { stat: st, depth: d }
            })
            .collect();
        entries.sort_by(|a, b| a.stat.path.cmp(&b.stat.path));
        Ok(entries)
    }

    async fn mkdir(&self, ctx: &CallCtx, path: &str, parents: bool) -> Result<FileStat> {
        let p = self.resolve(path)?;
        let out = self
            .helper(ctx, path, "mkdir", &[&p, if parents { "1" } else { "0" }])
            .await?;
        records(&out)
            .first()
            .and_then(|r| parse_record(r, None))
            .ok_or_else(|| bad_output("mkdir"))
    }

    async fn rename(&self, ctx: &CallCtx, from: &str, to: &str) -> Result<FileStat> {
        let a = self.resolve(from)?;
        let b = self.resolve(to)?;
        let out = self.helper(ctx, from, "rename", &[&a, &b]).await?;
        records(&out)
            .first()
            .and_then(|r| parse_record(r, None))
            .ok_or_else(|| bad_output("rename"))
    }

    async fn remove(&self, ctx: &CallCtx, path: &str, recursive: bool) -> Result<()> {
        let p = self.resolve(path)?;
        self.helper(
            ctx,
            path,
            "remove",
            &[&p, if recursive { "1" } else { "0" }],
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_collapses_dots_and_resolves_relative_paths() {
        assert_eq!(normalize("/w/s", "a/./b/../c").unwrap(), "/w/s/a/c");
        assert_eq!(normalize("/w/s", "/x/y/").unwrap(), "/x/y");
        assert_eq!(normalize("/w/s", "../../..").unwrap(), "/");
        assert!(normalize("/w", "a\0b").is_err());
    }

    #[test]
    fn records_parse_kind_version_and_path() {
        let st = parse_record(
            "81a4\t11\t1700000000.123456789\t1700000001.5\t42\t/w/a.txt",
            None,
        )
        .unwrap();
        assert_eq!(st.kind, FileKind::File);
        assert_eq!(st.size, 11);
        assert_eq!(st.mode, 0o644);
        assert_eq!(st.name, "a.txt");
        assert_eq!(st.modified_ms, 1_700_000_000_123);
        assert_eq!(st.version.0, "i42s11m1700000000.123456789c1700000001.5");
        let d = parse_record("41ed\t4096\t1\t1\t7\t/w", None).unwrap();
        assert_eq!(d.kind, FileKind::Dir);
        let l = parse_record("a1ff\t3\t1\t1\t8\t/w/l", Some("/etc".into())).unwrap();
        assert_eq!(l.kind, FileKind::Symlink);
        assert_eq!(l.symlink_target.as_deref(), Some("/etc"));
    }
}
