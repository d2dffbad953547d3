//! Processes of a microVM sandbox: envd's, spoken to the guest agent.

use std::sync::Arc;

use async_trait::async_trait;
use tether_protocol::process::{ProcessInfo, ProcessSpec};
use tether_provider::{CallCtx, Process, ProcessHandle, ProviderError, Result};

use crate::sandbox::VmCore;

/// The processes of one VM.
#[derive(Debug)]
pub struct VmProcess {
    #[allow(dead_code)]
    core: Arc<VmCore>,
}

impl VmProcess {
    pub(crate) fn new(core: Arc<VmCore>) -> Self {
        Self { core }
    }
}

#[async_trait]
impl Process for VmProcess {
    async fn spawn(&self, _ctx: &CallCtx, _spec: ProcessSpec) -> Result<Arc<dyn ProcessHandle>> {
        Err(ProviderError::Unsupported { op: "spawn" })
    }
    async fn list(&self, _ctx: &CallCtx) -> Result<Vec<ProcessInfo>> {
        Err(ProviderError::Unsupported { op: "list" })
    }
}
