//! The provider (control plane) and the sandbox handle.
//!
//! `create` posts to `/v2/sandboxes` with an idempotency key (so it may be retried),
//! falling back to the v1 `/sandboxes` of older backends, where a retry first looks for
//! the sandbox a lost answer may have created (by a marker in its metadata). `connect`
//! uses the connect endpoint (which also resumes a paused sandbox and extends its
//! lifetime), falling back to v1 and then to the sandbox's details on backends without
//! it. `destroy` is a kill where a 404 means already gone; `renew` sets the timeout.
//! What a backend supports is probed on first contact and remembered, so an operation it
//! lacks fails with `UNSUPPORTED` at once instead of being tried again. A sandbox's file
//! system and processes are `tether-envd-client`'s, over its envd.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use reqwest::Method;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use tether_protocol::ErrorCode;
use tether_protocol::e2b::{
    ConnectSandboxRequest, ENVD_PORT, ListedSandbox, NewSandboxRequest, PauseSandboxRequest,
    SandboxDetail, SandboxNetwork, SandboxNetworkUpdate, SandboxResponse, TimeoutRequest,
};
use tether_protocol::network::Egress;
use tether_provider::{
    CallCtx, Capabilities, Enforcement, Fs, PauseKind, PortRoute, PortStream, Process, Provider,
    ProviderError, Result, Sandbox, SandboxInfo, SandboxSpec,
};
use tokio_util::task::TaskTracker;

use tether_envd_client::error::{Op, from_status, malformed};
use tether_envd_client::{
    EnvdClientConfig, EnvdEndpoint, EnvdFs, EnvdProcess, EnvdSandboxClient, EnvdVersion, Http,
    decode, parse_time_ms, retry, retry_unanswered,
};

use crate::client::{ApiClient, build_client};
use crate::config::{DEBUG_SANDBOX_ID, E2bConfig};
use tether_provider::Clock;
use tether_provider::clock::TimeoutReason;

/// The provider kind.
pub const KIND: &str = "e2b";

/// Metadata key of the marker that lets a retried create find the sandbox an earlier,
/// lost attempt made.
pub const CREATE_MARKER: &str = "tether.create";

/// How long a failed create keeps looking for the sandbox it may still have made, to kill it.
const CREATE_CLEANUP_WINDOW: Duration = Duration::from_secs(60);

/// How many times a create that returned after more than one attempt looks for the
/// sandboxes its other attempts made (2 s apart).
const DUPLICATE_LOOKS: usize = 3;

/// The envd version assumed in debug mode (no control plane reports one), as the SDKs do.
const DEBUG_ENVD_VERSION: EnvdVersion = EnvdVersion(99, 99, 99);

const UNKNOWN: u8 = 0;
const YES: u8 = 1;
const NO: u8 = 2;

/// What the backend supports, learned on first contact.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    create_v2: AtomicU8,
    list_v2: AtomicU8,
    connect_v2: AtomicU8,
    pause: AtomicU8,
}

impl Probe {
    fn get(slot: &AtomicU8) -> u8 {
        slot.load(Ordering::Acquire)
    }

    fn set(slot: &AtomicU8, v: u8) {
        slot.store(v, Ordering::Release);
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn secs_ceil(d: Duration) -> i64 {
    let s = d.as_millis().div_ceil(1000);
    i64::try_from(s).unwrap_or(i64::MAX).max(1)
}

// === impl E2bProvider ===

/// A sandbox provider backed by E2B (or an E2B-compatible control plane).
#[derive(Debug, Clone)]
pub struct E2bProvider {
    inner: Arc<ProviderInner>,
}

#[derive(Debug)]
struct ProviderInner {
    cfg: Arc<E2bConfig>,
    /// The envd client's part of `cfg`, shared by every sandbox.
    envd_cfg: Arc<EnvdClientConfig>,
    api: ApiClient,
    http: Http,
    probe: Probe,
    /// Live sandbox handles by id, so that `connect` to a sandbox this provider already
    /// holds shares its command table, and `destroy` stops its streams.
    live: RwLock<HashMap<String, Weak<Shared>>>,
    /// Sandboxes paused without memory here: their resume asks E2B for a boot
    /// (`memory: false`), also where E2B had kept their memory (a pause with memory came
    /// first, and the pause without was answered "already paused").
    reboot: RwLock<HashSet<String>>,
    tasks: TaskTracker,
}

impl E2bProvider {
    /// A provider for `cfg` (already merged with the environment, see
    /// [`E2bConfig::with_env`]) with its own HTTP client.
    pub fn new(cfg: E2bConfig) -> Result<Self> {
        let pool_idle = Duration::from_millis(cfg.envd_config().pool_idle_ms);
        Self::with_client(cfg, build_client(pool_idle)?)
    }

    /// A provider for `cfg` using a shared HTTP client.
    pub fn with_client(cfg: E2bConfig, client: reqwest::Client) -> Result<Self> {
        let endpoints = cfg.validate()?;
        let envd_cfg = Arc::new(cfg.envd_config());
        let http = Http::new(&envd_cfg, client);
        let api = ApiClient::new(&cfg, endpoints, http.clone())?;
        Ok(Self {
            inner: Arc::new(ProviderInner {
                cfg: Arc::new(cfg),
                envd_cfg,
                api,
                http,
                probe: Probe::default(),
                live: RwLock::new(HashMap::new()),
                reboot: RwLock::new(HashSet::new()),
                tasks: TaskTracker::new(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &E2bConfig {
        &self.inner.cfg
    }

    /// Wait (bounded) for the provider's background work (cleanups of failed creates).
    pub async fn drain(&self, limit: Duration) {
        self.inner.tasks.close();
        let _ = tokio::time::timeout(limit, self.inner.tasks.wait()).await;
        self.inner.tasks.reopen();
    }
}

impl ProviderInner {
    fn debug(&self) -> bool {
        self.api.endpoints.debug
    }

    /// A sandbox handle, shared with any live one of the same id.
    fn sandbox(
        &self,
        id: &str,
        token: Option<&str>,
        domain: Option<&str>,
        envd_version: &str,
        info: SandboxInfo,
    ) -> Result<Arc<dyn Sandbox>> {
        if let Some(shared) = self
            .live
            .read()
            .ok()
            .and_then(|m| m.get(id).and_then(Weak::upgrade))
            && !shared.client.is_closed()
        {
            return Ok(Arc::new(E2bSandbox { shared, info }));
        }
        let version = EnvdVersion::parse(envd_version)
            .ok_or_else(|| malformed(format!("envd version {envd_version:?}")))?;
        let base_url = self.api.endpoints.envd_url(id, domain)?;
        let client = self.envd_client(id, base_url, token, version)?;
        let shared = Arc::new(Shared {
            fs: client.fs(),
            process: client.process(),
            client,
            domain: domain.map(str::to_owned),
        });
        if let Ok(mut m) = self.live.write() {
            m.retain(|_, w| w.strong_count() > 0);
            m.insert(id.to_owned(), Arc::downgrade(&shared));
        }
        Ok(Arc::new(E2bSandbox { shared, info }))
    }

    /// The envd client of sandbox `id`: E2B's edge routes its calls by the
    /// `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers.
    fn envd_client(
        &self,
        id: &str,
        base_url: reqwest::Url,
        token: Option<&str>,
        version: EnvdVersion,
    ) -> Result<EnvdSandboxClient> {
        let mut headers = HeaderMap::new();
        let sid = HeaderValue::from_str(id)
            .map_err(|_| malformed("a sandbox id that is not a header value"))?;
        headers.insert(HeaderName::from_static("e2b-sandbox-id"), sid);
        headers.insert(
            HeaderName::from_static("e2b-sandbox-port"),
            HeaderValue::from(ENVD_PORT),
        );
        let endpoint = EnvdEndpoint {
            base_url,
            access_token: token.map(str::to_owned),
            headers,
            version,
        };
        EnvdSandboxClient::with_config(
            KIND,
            id,
            endpoint,
            self.envd_cfg.clone(),
            self.http.client.clone(),
        )
    }

    /// Where `port` of sandbox `id` is served (by the domain of its live handle, else
    /// the configured one).
    fn port_url(&self, id: &str, port: u16) -> Result<reqwest::Url> {
        let domain = self
            .live
            .read()
            .ok()
            .and_then(|m| m.get(id).and_then(Weak::upgrade))
            .and_then(|s| s.domain.clone());
        self.api.endpoints.port_url(id, port, domain.as_deref())
    }

    fn forget(&self, id: &str) {
        let gone = self
            .live
            .write()
            .ok()
            .and_then(|mut m| m.remove(id))
            .and_then(|w| w.upgrade());
        if let Some(shared) = gone {
            shared.client.close();
        }
    }

    fn info_from_listed(&self, s: &ListedSandbox) -> SandboxInfo {
        SandboxInfo {
            id: s.sandbox_id.clone(),
            provider: KIND.into(),
            template: Some(s.alias.clone().unwrap_or_else(|| s.template_id.clone())),
            workspace: self.cfg.workspace.clone(),
            enforcement: Enforcement::Full,
            created_ms: parse_time_ms(&s.started_at).unwrap_or(0),
            expires_ms: parse_time_ms(&s.end_at),
            metadata: s.metadata.clone(),
            network: false,
        }
    }

    fn info_from_detail(&self, d: &SandboxDetail) -> SandboxInfo {
        SandboxInfo {
            id: d.sandbox_id.clone(),
            provider: KIND.into(),
            template: Some(d.alias.clone().unwrap_or_else(|| d.template_id.clone())),
            workspace: self.cfg.workspace.clone(),
            enforcement: Enforcement::Full,
            created_ms: parse_time_ms(&d.started_at).unwrap_or(0),
            expires_ms: parse_time_ms(&d.end_at),
            metadata: d.metadata.clone(),
            network: d.allow_internet_access.unwrap_or(false),
        }
    }

    fn debug_info(&self) -> SandboxInfo {
        SandboxInfo {
            id: DEBUG_SANDBOX_ID.into(),
            provider: KIND.into(),
            template: None,
            workspace: self.cfg.workspace.clone(),
            enforcement: Enforcement::Full,
            created_ms: now_ms(),
            expires_ms: None,
            metadata: BTreeMap::new(),
            network: true,
        }
    }

    // --- create ---

    async fn create_v1(&self, ctx: &CallCtx, body: &NewSandboxRequest) -> Result<SandboxResponse> {
        let (_, _, b) = self
            .api
            .json_call(
                ctx,
                Method::POST,
                "/sandboxes",
                Some(body),
                &[],
                Op::Api("create"),
            )
            .await?;
        decode(&b, "create")
    }

    /// One create attempt: v2 with the idempotency key, else (an older backend) v1.
    /// `v1_sent` is set before a v1 create (which has no key) is sent.
    async fn create_once(
        &self,
        ctx: &CallCtx,
        v2: &NewSandboxRequest,
        v1: &NewSandboxRequest,
        key: &str,
        v1_sent: &AtomicBool,
    ) -> Result<SandboxResponse> {
        if Probe::get(&self.probe.create_v2) != NO {
            let op = Op::Api("create");
            let req = self
                .api
                .request(Method::POST, "/v2/sandboxes")
                .json(v2)
                .header("idempotency-key", key);
            let (status, headers, body) = self.http.call(ctx, req, op).await?;
            match status.as_u16() {
                200 | 201 => {
                    Probe::set(&self.probe.create_v2, YES);
                    return decode(&body, "create");
                }
                404 | 405 | 501 if Probe::get(&self.probe.create_v2) == UNKNOWN => {
                    // A 404 is either a missing route (an older backend) or a missing
                    // template: v1 tells which.
                    v1_sent.store(true, Ordering::Release);
                    let r = self.create_v1(ctx, v1).await;
                    if r.is_ok() {
                        Probe::set(&self.probe.create_v2, NO);
                        tracing::info!(api = %self.api.endpoints.api, "The E2B backend has no v2 create; using v1");
                    }
                    return r;
                }
                _ => return Err(from_status(op, status, &headers, &body)),
            }
        }
        v1_sent.store(true, Ordering::Release);
        self.create_v1(ctx, v1).await
    }

    /// The sandboxes carrying `marker` that the backend lists.
    async fn find_by_marker(&self, ctx: &CallCtx, marker: &str) -> Result<Vec<ListedSandbox>> {
        Ok(self
            .list_all(ctx)
            .await?
            .into_iter()
            .filter(|s| s.metadata.get(CREATE_MARKER).map(String::as_str) == Some(marker))
            .collect())
    }

    /// After a create whose outcome is unknown (`keep` `None`), or one that took more than
    /// one attempt (`keep` the sandbox it returned): kill the sandboxes it may have made
    /// besides `keep` (a backend that does not honour the idempotency key makes one per
    /// attempt), looking until one is found or the window ends; after a create that
    /// returned, the earlier attempts were made before it, so a few looks suffice.
    fn cleanup_lost_create(self: &Arc<Self>, marker: String, keep: Option<String>) {
        let this = self.clone();
        let mut looks = if keep.is_some() {
            DUPLICATE_LOOKS
        } else {
            usize::MAX
        };
        self.tasks.spawn(async move {
            let until = tokio::time::Instant::now() + CREATE_CLEANUP_WINDOW;
            while tokio::time::Instant::now() < until && looks > 0 {
                looks -= 1;
                let ctx = CallCtx::new(format!("create-cleanup-{marker}"))
                    .with_timeout(this.cfg.request_timeout(), Clock::Total);
                if let Ok(found) = this.find_by_marker(&ctx, &marker).await {
                    let extra: Vec<_> = found
                        .into_iter()
                        .filter(|s| Some(&s.sandbox_id) != keep.as_ref())
                        .collect();
                    for s in &extra {
                        tracing::warn!(sandbox.id = %s.sandbox_id, "Killing a sandbox whose create did not complete");
                        let _ = this.kill(&ctx, &s.sandbox_id).await;
                    }
                    if !extra.is_empty() {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
        });
    }

    // --- list, get, kill ---

    async fn list_page(
        &self,
        ctx: &CallCtx,
        next: Option<&str>,
        limit: u32,
    ) -> Result<(Vec<ListedSandbox>, Option<String>)> {
        let op = Op::Api("list");
        if Probe::get(&self.probe.list_v2) != NO {
            let mut url = self.api.endpoints.api_path("/v2/sandboxes");
            {
                let mut q = url.query_pairs_mut();
                q.append_pair("state", "running,paused");
                q.append_pair("limit", &limit.to_string());
                if let Some(n) = next {
                    q.append_pair("nextToken", n);
                }
            }
            let (status, headers, body) = self
                .http
                .call(ctx, self.api.request_url(Method::GET, url), op)
                .await?;
            match status.as_u16() {
                200 => {
                    Probe::set(&self.probe.list_v2, YES);
                    let next = headers
                        .get("x-next-token")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                        .filter(|s| !s.is_empty());
                    return Ok((decode(&body, "list")?, next));
                }
                404 | 405 | 501 if Probe::get(&self.probe.list_v2) == UNKNOWN => {
                    Probe::set(&self.probe.list_v2, NO);
                }
                _ => return Err(from_status(op, status, &headers, &body)),
            }
        }
        let (_, _, body) = self
            .api
            .json_call::<()>(ctx, Method::GET, "/sandboxes", None, &[], op)
            .await?;
        Ok((decode(&body, "list")?, None))
    }

    async fn list_all(&self, ctx: &CallCtx) -> Result<Vec<ListedSandbox>> {
        let mut out = Vec::new();
        let mut next: Option<String> = None;
        // Bounded: a backend that keeps handing out cursors cannot loop us forever.
        for _ in 0..1000 {
            let (page, n) = retry(ctx, self.http.retry, "list", || {
                self.list_page(ctx, next.as_deref(), 100)
            })
            .await?;
            out.extend(page);
            match n {
                Some(n) if Some(&n) != next.as_ref() => next = Some(n),
                _ => break,
            }
        }
        Ok(out)
    }

    /// A lifecycle call whose status its caller judges: the retryable ones (429, 502 to
    /// 504) go through the retry policy, any other comes back with its headers and body.
    async fn judged_call<T: serde::Serialize + Sync>(
        &self,
        ctx: &CallCtx,
        method: Method,
        path: &str,
        body: &T,
        name: &'static str,
        op: Op<'_>,
    ) -> Result<(reqwest::StatusCode, HeaderMap, bytes::Bytes)> {
        retry(ctx, self.http.retry, name, || async {
            let req = self.api.request(method.clone(), path).json(body);
            let (s, h, b) = self.http.call(ctx, req, op).await?;
            if matches!(s.as_u16(), 429 | 502 | 503 | 504) {
                return Err(from_status(op, s, &h, &b));
            }
            Ok((s, h, b))
        })
        .await
    }

    /// What a 404 of a route a backend may lack means: `Ok` when sandbox `id` exists
    /// (the route is missing), else why it is not found.
    async fn route_missing(&self, ctx: &CallCtx, id: &str) -> Result<()> {
        self.detail(ctx, id).await.map(|_| ())
    }

    async fn detail(&self, ctx: &CallCtx, id: &str) -> Result<SandboxDetail> {
        let op = Op::Sandbox { op: "get", id };
        let path = format!("/sandboxes/{id}");
        let (_, _, body) = retry(ctx, self.http.retry, "get", || {
            self.api
                .json_call::<()>(ctx, Method::GET, &path, None, &[], op)
        })
        .await?;
        decode(&body, "get")
    }

    /// Whether the next resume of `id` asks for a boot ([`Self::reboot`]).
    fn reboots(&self, id: &str) -> bool {
        self.reboot
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(id)
    }

    /// Mark (`on`) or clear whether the next resume of `id` asks for a boot.
    fn set_reboot(&self, id: &str, on: bool) {
        let mut set = self.reboot.write().unwrap_or_else(|e| e.into_inner());
        if on {
            set.insert(id.to_owned());
        } else {
            set.remove(id);
        }
    }

    async fn kill(&self, ctx: &CallCtx, id: &str) -> Result<()> {
        self.set_reboot(id, false);
        let op = Op::Sandbox { op: "destroy", id };
        let path = format!("/sandboxes/{id}");
        let r = retry(ctx, self.http.retry, "destroy", || {
            self.api
                .json_call::<()>(ctx, Method::DELETE, &path, None, &[], op)
        })
        .await;
        match r {
            Ok(_) => Ok(()),
            // Already gone is what destroy wants.
            Err(ProviderError::SandboxNotFound { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    // --- connect ---

    /// The connect endpoint's answer; `Ok(None)` when the backend has no such endpoint.
    async fn connect_call(
        &self,
        ctx: &CallCtx,
        id: &str,
        ttl_s: i64,
    ) -> Result<Option<SandboxResponse>> {
        let op = Op::Sandbox { op: "connect", id };
        let reboot = self.reboots(id);
        let body = ConnectSandboxRequest {
            timeout: Some(ttl_s),
            memory: reboot.then_some(false),
        };
        for (v2, path) in [
            (true, format!("/v2/sandboxes/{id}/connect")),
            (false, format!("/sandboxes/{id}/connect")),
        ] {
            if v2 && Probe::get(&self.probe.connect_v2) == NO {
                continue;
            }
            let (status, headers, b) = retry(ctx, self.http.retry, "connect", || {
                self.http
                    .call(ctx, self.api.request(Method::POST, &path).json(&body), op)
            })
            .await?;
            match status.as_u16() {
                200 | 201 => {
                    if v2 {
                        Probe::set(&self.probe.connect_v2, YES);
                    }
                    if reboot {
                        self.set_reboot(id, false);
                    }
                    return decode(&b, "connect").map(Some);
                }
                // 404: no sandbox, or no route; the details tell which.
                404 | 405 | 501 => {
                    if status.as_u16() == 404 {
                        self.detail(ctx, id).await?;
                    }
                    if v2 {
                        Probe::set(&self.probe.connect_v2, NO);
                    }
                }
                _ => return Err(from_status(op, status, &headers, &b)),
            }
        }
        Ok(None)
    }
}

#[async_trait]
impl Provider for E2bProvider {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn capabilities(&self) -> Capabilities {
        let i = &self.inner;
        Capabilities {
            pause: !i.debug() && Probe::get(&i.probe.pause) != NO,
            watch: true,
            pty: true,
            reattach: true,
            renew: !i.debug(),
            // Passed on to the backend, which enforces them.
            egress: true,
            // Passed on as E2B's `memory: false`.
            pause_filesystem: !i.debug() && Probe::get(&i.probe.pause) != NO,
        }
    }

    async fn healthcheck(&self, ctx: &CallCtx) -> Result<()> {
        let i = &self.inner;
        if i.debug() {
            let base = i.api.endpoints.envd_url(DEBUG_SANDBOX_ID, None)?;
            let envd = i.envd_client(DEBUG_SANDBOX_ID, base, None, DEBUG_ENVD_VERSION)?;
            return envd.health(ctx).await;
        }
        // One page of the listing: reachability, credentials and the listing's version.
        retry(ctx, i.http.retry, "healthcheck", || {
            i.list_page(ctx, None, 1)
        })
        .await
        .map(|_| ())
    }

    #[tracing::instrument(name = "sandbox.create", skip_all, fields(provider.kind = "e2b"))]
    async fn create(&self, ctx: &CallCtx, spec: SandboxSpec) -> Result<Arc<dyn Sandbox>> {
        ctx.check()?;
        let i = &self.inner;
        if i.debug() {
            let mut info = i.debug_info();
            info.metadata = spec.metadata.clone();
            return i.sandbox(DEBUG_SANDBOX_ID, None, None, "99.99.99", info);
        }
        let template = spec
            .template
            .clone()
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| i.cfg.template.clone());
        let ttl = spec.ttl.unwrap_or(Duration::from_millis(i.cfg.ttl_ms));
        let ttl_s = secs_ceil(ttl);
        let marker = uuid::Uuid::new_v4().to_string();
        let mut metadata = spec.metadata.clone();
        metadata.insert(CREATE_MARKER.into(), marker.clone());
        let mut network = spec.network || i.cfg.default_network;
        // Denying every address is E2B's `allow_internet_access: false` (`allowOut` still
        // admits): said so, as the backend's own API says it.
        let mut egress = spec.egress.clone();
        let everything = tether_protocol::network::Cidr::everything();
        if everything.iter().all(|c| egress.deny.contains(c)) {
            egress.deny.retain(|c| !everything.contains(c));
            network = false;
        }
        let v2 = NewSandboxRequest {
            template_id: template.clone(),
            timeout: Some(ttl_s),
            metadata: Some(metadata.clone()),
            env_vars: Some(spec.env.clone()),
            auto_pause: Some(i.cfg.auto_pause),
            auto_pause_memory: None,
            auto_resume: None,
            secure: None,
            allow_internet_access: Some(network),
            // The backend enforces the rules (E2B's `allowOut` / `denyOut`).
            network: (!egress.is_empty()).then(|| SandboxNetwork {
                allow_out: Some(egress.allow.iter().map(ToString::to_string).collect()),
                deny_out: Some(egress.deny.iter().map(ToString::to_string).collect()),
                ..SandboxNetwork::default()
            }),
        };
        // v1: `secure` for an access token, and an explicit timeout (its default is 15 s).
        let v1 = NewSandboxRequest {
            secure: Some(true),
            ..v2.clone()
        };
        let v1_sent = AtomicBool::new(false);
        let attempts = AtomicUsize::new(0);
        // Each attempt's answer must start within the connect limit, or the create is sent
        // again: under its idempotency key the backend answers with the sandbox the first
        // attempt is making, so a backend slow to make one is waited for, for as long as
        // the create's own limit allows (the request limit, or the caller's deadline if
        // sooner), and a stalled answer costs one connect limit.
        let caller = ctx;
        let cctx = ctx.with_timeout(i.cfg.request_timeout(), Clock::Total);
        let ctx = &cctx;
        let r = retry_unanswered(ctx, i.http.retry, "create", || async {
            // v1 has no idempotency key: before trying again after a v1 create was sent
            // (a backend known to lack v2, or the fallback of a first create on one not
            // probed yet), look for what a lost answer may have created.
            attempts.fetch_add(1, Ordering::Relaxed);
            if v1_sent.load(Ordering::Acquire)
                && let Some(s) = i.find_by_marker(ctx, &marker).await?.into_iter().next()
            {
                return Ok(Adopted::Listed(s));
            }
            i.create_once(ctx, &v2, &v1, &marker, &v1_sent)
                .await
                .map(Adopted::Created)
        })
        .await;
        // The create's own limit ended (the caller's has not): the backend answered no
        // attempt in time. That is what the caller is told, whichever attempt the limit
        // cut, so the outcome does not depend on where in an attempt it fell.
        let r = r.map_err(|e| {
            let own_limit = e.code() == ErrorCode::DeadlineExceeded
                && e.clock() == Some(Clock::Total)
                && caller.check().is_ok();
            if own_limit {
                ProviderError::Timeout {
                    reason: TimeoutReason {
                        clock: Clock::Connect,
                        timeout_ms: i.http.connect.as_millis() as u64,
                    },
                }
            } else {
                e
            }
        });
        let resp = match r {
            Ok(Adopted::Created(resp)) => {
                if attempts.load(Ordering::Relaxed) > 1 {
                    i.cleanup_lost_create(marker.clone(), Some(resp.sandbox_id.clone()));
                }
                resp
            }
            Ok(Adopted::Listed(s)) => {
                let sb = self.connect(ctx, &s.sandbox_id).await?;
                return Ok(sb);
            }
            Err(e) => {
                // The request may have reached the backend: make sure its sandbox does
                // not outlive this failure.
                if matches!(
                    e.code(),
                    ErrorCode::DeadlineExceeded
                        | ErrorCode::Cancelled
                        | ErrorCode::ShuttingDown
                        | ErrorCode::ProviderUnavailable
                        | ErrorCode::TransportIdleTimeout
                        | ErrorCode::ConnectTimeout
                ) {
                    i.cleanup_lost_create(marker, None);
                }
                return Err(e);
            }
        };
        let version = EnvdVersion::parse(&resp.envd_version);
        if version.is_none_or(|v| v < EnvdVersion(0, 1, 0)) {
            let kctx = CallCtx::new(ctx.request_id.clone())
                .with_timeout(i.cfg.request_timeout(), Clock::Total);
            let _ = i.kill(&kctx, &resp.sandbox_id).await;
            return Err(ProviderError::InvalidRequest {
                message: format!(
                    "template {template} has envd {:?}, too old for this client",
                    resp.envd_version
                ),
            });
        }
        let created = now_ms();
        let info = SandboxInfo {
            id: resp.sandbox_id.clone(),
            provider: KIND.into(),
            template: Some(template),
            workspace: i.cfg.workspace.clone(),
            enforcement: Enforcement::Full,
            created_ms: created,
            expires_ms: Some(created.saturating_add(ttl_s.saturating_mul(1000))),
            metadata,
            network,
        };
        tracing::debug!(sandbox.id = %resp.sandbox_id, envd.version = %resp.envd_version, "Created an E2B sandbox");
        i.sandbox(
            &resp.sandbox_id,
            resp.envd_access_token.as_deref(),
            resp.domain.as_deref(),
            &resp.envd_version,
            info,
        )
    }

    #[tracing::instrument(name = "sandbox.connect", skip_all, fields(provider.kind = "e2b", sandbox.id = %id))]
    async fn connect(&self, ctx: &CallCtx, id: &str) -> Result<Arc<dyn Sandbox>> {
        ctx.check()?;
        let i = &self.inner;
        if i.debug() {
            if id != DEBUG_SANDBOX_ID {
                return Err(ProviderError::SandboxNotFound { id: id.to_owned() });
            }
            return i.sandbox(DEBUG_SANDBOX_ID, None, None, "99.99.99", i.debug_info());
        }
        let ttl_s = secs_ceil(Duration::from_millis(i.cfg.ttl_ms));
        let conn = i.connect_call(ctx, id, ttl_s).await?;
        let detail = i.detail(ctx, id).await?;
        let info = i.info_from_detail(&detail);
        match conn {
            Some(r) => i.sandbox(
                id,
                r.envd_access_token.as_deref(),
                r.domain.as_deref(),
                &r.envd_version,
                info,
            ),
            None => i.sandbox(
                id,
                detail.envd_access_token.as_deref(),
                detail.domain.as_deref(),
                &detail.envd_version,
                info,
            ),
        }
    }

    #[tracing::instrument(name = "sandbox.list", skip_all, fields(provider.kind = "e2b"))]
    async fn list(&self, ctx: &CallCtx) -> Result<Vec<SandboxInfo>> {
        ctx.check()?;
        let i = &self.inner;
        if i.debug() {
            return Ok(Vec::new());
        }
        Ok(i.list_all(ctx)
            .await?
            .iter()
            .map(|s| i.info_from_listed(s))
            .collect())
    }

    #[tracing::instrument(name = "sandbox.destroy", skip_all, fields(provider.kind = "e2b", sandbox.id = %id))]
    async fn destroy(&self, ctx: &CallCtx, id: &str) -> Result<()> {
        ctx.check()?;
        let i = &self.inner;
        if !i.debug() {
            i.kill(ctx, id).await?;
        }
        i.forget(id);
        Ok(())
    }

    #[tracing::instrument(name = "sandbox.renew", skip_all, fields(provider.kind = "e2b", sandbox.id = %id))]
    async fn renew(&self, ctx: &CallCtx, id: &str, ttl: Duration) -> Result<()> {
        ctx.check()?;
        let i = &self.inner;
        if i.debug() {
            return Err(ProviderError::Unsupported { op: "renew" });
        }
        let op = Op::Sandbox { op: "renew", id };
        let path = format!("/sandboxes/{id}/timeout");
        let body = TimeoutRequest {
            timeout: secs_ceil(ttl),
        };
        retry(ctx, i.http.retry, "renew", || {
            i.api
                .json_call(ctx, Method::POST, &path, Some(&body), &[], op)
        })
        .await
        .map(|_| ())
    }

    async fn connect_port(&self, ctx: &CallCtx, id: &str, port: u16) -> Result<PortStream> {
        ctx.check()?;
        let url = self.inner.port_url(id, port)?;
        crate::ports::connect(ctx, &url).await
    }

    fn port_route(&self, id: &str, port: u16) -> Option<PortRoute> {
        let url = self.inner.port_url(id, port).ok()?;
        let host = url.host_str()?;
        let host = match url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_owned(),
        };
        Some(PortRoute {
            host,
            headers: vec![
                ("e2b-sandbox-id".to_owned(), id.to_owned()),
                ("e2b-sandbox-port".to_owned(), port.to_string()),
            ],
        })
    }

    #[tracing::instrument(name = "sandbox.network", skip_all, fields(provider.kind = "e2b", sandbox.id = %id))]
    async fn set_egress(&self, ctx: &CallCtx, id: &str, egress: Egress) -> Result<()> {
        ctx.check()?;
        let i = &self.inner;
        if i.debug() {
            return Err(ProviderError::Unsupported { op: "set_egress" });
        }
        let op = Op::Sandbox { op: "network", id };
        let path = format!("/sandboxes/{id}/network");
        // Replaced whole: the backend enforces E2B's `allowOut` / `denyOut`.
        let body = SandboxNetworkUpdate {
            allow_out: Some(egress.allow.iter().map(ToString::to_string).collect()),
            deny_out: Some(egress.deny.iter().map(ToString::to_string).collect()),
            ..SandboxNetworkUpdate::default()
        };
        let (status, headers, bytes) = i
            .judged_call(ctx, Method::PUT, &path, &body, "network", op)
            .await?;
        match status.as_u16() {
            200..=299 => {
                tracing::debug!(sandbox.id = %id, "Changed an E2B sandbox's egress rules");
                Ok(())
            }
            405 | 501 => Err(ProviderError::Unsupported { op: "set_egress" }),
            404 => {
                i.route_missing(ctx, id).await?;
                Err(ProviderError::Unsupported { op: "set_egress" })
            }
            _ => Err(from_status(op, status, &headers, &bytes)),
        }
    }

    #[tracing::instrument(name = "sandbox.pause", skip_all, fields(provider.kind = "e2b", sandbox.id = %id))]
    async fn pause(&self, ctx: &CallCtx, id: &str, kind: PauseKind) -> Result<()> {
        ctx.check()?;
        let i = &self.inner;
        if i.debug() || Probe::get(&i.probe.pause) == NO {
            return Err(ProviderError::Unsupported { op: "pause" });
        }
        let op = Op::Sandbox { op: "pause", id };
        let path = format!("/sandboxes/{id}/pause");
        let (status, headers, body) = i
            .judged_call(
                ctx,
                Method::POST,
                &path,
                &PauseSandboxRequest {
                    memory: (!kind.is_memory()).then_some(false),
                },
                "pause",
                op,
            )
            .await?;
        let stopped = || {
            if !kind.is_memory() {
                i.set_reboot(id, true);
            }
        };
        match status.as_u16() {
            200..=299 => {
                Probe::set(&i.probe.pause, YES);
                stopped();
                tracing::debug!(sandbox.id = %id, kind = kind.as_str(), "Paused an E2B sandbox");
                Ok(())
            }
            // Already paused.
            409 => {
                stopped();
                Ok(())
            }
            405 | 501 => {
                Probe::set(&i.probe.pause, NO);
                Err(ProviderError::Unsupported { op: "pause" })
            }
            404 => {
                i.route_missing(ctx, id).await?;
                Probe::set(&i.probe.pause, NO);
                Err(ProviderError::Unsupported { op: "pause" })
            }
            _ => Err(from_status(op, status, &headers, &body)),
        }
    }

    async fn resume(&self, ctx: &CallCtx, id: &str) -> Result<Arc<dyn Sandbox>> {
        ctx.check()?;
        let i = &self.inner;
        if i.debug() || Probe::get(&i.probe.pause) == NO {
            return Err(ProviderError::Unsupported { op: "resume" });
        }
        // Connecting to a paused sandbox resumes it.
        self.connect(ctx, id).await
    }
}

enum Adopted {
    Created(SandboxResponse),
    Listed(ListedSandbox),
}

// === impl E2bSandbox ===

#[derive(Debug)]
struct Shared {
    client: EnvdSandboxClient,
    fs: EnvdFs,
    process: EnvdProcess,
    /// The domain its create/connect answer named.
    domain: Option<String>,
}

/// One E2B sandbox.
#[derive(Debug)]
pub struct E2bSandbox {
    shared: Arc<Shared>,
    info: SandboxInfo,
}

impl E2bSandbox {
    /// The envd version the backend reported for this sandbox.
    pub fn envd_version(&self) -> EnvdVersion {
        self.shared.client.version()
    }
}

impl Sandbox for E2bSandbox {
    fn info(&self) -> SandboxInfo {
        self.info.clone()
    }

    fn fs(&self) -> &dyn Fs {
        &self.shared.fs
    }

    fn process(&self) -> &dyn Process {
        &self.shared.process
    }

    fn fs_for(&self, user: &str) -> Result<Option<Arc<dyn Fs>>> {
        Ok(Some(Arc::new(self.shared.fs.for_user(user))))
    }
}
