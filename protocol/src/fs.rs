//! File-operation wire types, shared by every provider and the APIs.

use serde::{Deserialize, Serialize};

/// An opaque file version token. Clients must not parse it; equal tokens mean equal
/// content as far as the provider can tell (size, mtime and inode, or a content hash).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Version(pub String);

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What kind of file system object a path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (reported without following it).
    Symlink,
    /// Anything else (device, socket, fifo).
    Other,
}

/// Metadata of one path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    /// The sandbox path, absolute (e.g. `/home/user/a.txt`).
    pub path: String,
    /// The base name.
    pub name: String,
    /// The kind of object.
    pub kind: FileKind,
    /// Size in bytes.
    pub size: u64,
    /// Permission bits (`0o644`).
    pub mode: u32,
    /// Last modification time, milliseconds since the Unix epoch.
    pub modified_ms: i64,
    /// The version token (files only; directories carry one too, but it is advisory).
    pub version: Version,
    /// Where a symlink points, if this is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
}

/// A guard on a write: the write takes effect only if the guard holds at publication.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum WriteGuard {
    /// Create or overwrite unconditionally.
    #[default]
    None,
    /// Fail with `FS_ALREADY_EXISTS` if the path exists.
    CreateIfAbsent,
    /// Fail with `FS_VERSION_MISMATCH` unless the file's current version is this one.
    ReplaceIfVersion {
        /// The expected current version.
        version: Version,
    },
}

/// The outcome of a write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteOutcome {
    /// The sandbox path written.
    pub path: String,
    /// The new version of the file.
    pub version: Version,
    /// Bytes written.
    pub size: u64,
    /// `true` if the file did not exist before.
    pub created: bool,
}

/// A byte range of a read: `offset` and an optional `length` (to the end when absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ByteRange {
    /// First byte.
    pub offset: u64,
    /// Number of bytes; `None` reads to the end of the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
}

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    /// The entry's metadata (its `path` is absolute).
    #[serde(flatten)]
    pub stat: FileStat,
    /// Depth below the listed directory, starting at 1.
    pub depth: u32,
}

/// What happened to a watched path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FsEventKind {
    /// Created.
    Create,
    /// Written.
    Write,
    /// Removed.
    Remove,
    /// Renamed (moved away or in).
    Rename,
    /// Permissions changed.
    Chmod,
}

/// One file-system watch event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsEvent {
    /// What happened.
    pub kind: FsEventKind,
    /// The path relative to the watched directory.
    pub name: String,
}
