//! File operations of a microVM sandbox: envd's, spoken to the guest agent.

use std::sync::Arc;

use async_trait::async_trait;
use tether_protocol::fs::{ByteRange, DirEntry, FileStat, WriteGuard, WriteOutcome};
use tether_provider::{ByteStream, CallCtx, Fs, ProviderError, Result};

use crate::sandbox::VmCore;

/// Whether `Fs::watch` is offered.
pub const WATCH: bool = false;

/// The file system of one VM.
#[derive(Debug)]
pub struct VmFs {
    #[allow(dead_code)]
    core: Arc<VmCore>,
}

impl VmFs {
    pub(crate) fn new(core: Arc<VmCore>) -> Self {
        Self { core }
    }
}

fn unwired() -> ProviderError {
    ProviderError::Unsupported { op: "fs" }
}

#[async_trait]
impl Fs for VmFs {
    async fn stat(&self, _ctx: &CallCtx, _path: &str) -> Result<FileStat> {
        Err(unwired())
    }
    async fn read(&self, _ctx: &CallCtx, _path: &str, _range: ByteRange) -> Result<ByteStream> {
        Err(unwired())
    }
    async fn write(
        &self,
        _ctx: &CallCtx,
        _path: &str,
        _data: ByteStream,
        _guard: WriteGuard,
    ) -> Result<WriteOutcome> {
        Err(unwired())
    }
    async fn list(&self, _ctx: &CallCtx, _path: &str, _depth: u32) -> Result<Vec<DirEntry>> {
        Err(unwired())
    }
    async fn mkdir(&self, _ctx: &CallCtx, _path: &str, _parents: bool) -> Result<FileStat> {
        Err(unwired())
    }
    async fn rename(&self, _ctx: &CallCtx, _from: &str, _to: &str) -> Result<FileStat> {
        Err(unwired())
    }
    async fn remove(&self, _ctx: &CallCtx, _path: &str, _recursive: bool) -> Result<()> {
        Err(unwired())
    }
}
