//! The dashboards against real data: a real Prometheus (Debian's `prometheus`, from a
//! temporary directory on a loopback port) scrapes an in-process tetherd's `/metrics`
//! with the shipped compose scrape job and token. Tool calls of every outcome are driven,
//! on two providers: `local`, and `e2b` (a second tetherd, as a child process, serving its
//! E2B front; envd traffic through the fault proxy): ok, errors (`FS_NOT_FOUND`,
//! `INVALID_REQUEST`), a timeout of each clock the daemon counts (`total`, `output_idle`,
//! `tool`) on both, a stalled file read (`TRANSPORT_IDLE_TIMEOUT`) and a backend that never
//! answers (`CONNECT_TIMEOUT` on `sandbox.create`). Then every PromQL query of every shipped
//! dashboard (parsed from `deploy/**/*.json`, not listed here) and every template
//! variable runs through Prometheus' HTTP API. A query passes when:
//!
//! - it returns at least one series, one of them with a finite value;
//! - every series carries the labels its legend and its `by (...)` name;
//! - every metric it names has series in Prometheus, and every label it names (grouping
//!   or matcher) is on them (a matcher on a missing label would match "All" silently);
//! - with each variable set to a real value instead of "All", it still returns series.
//!
//! Each query is also mutated (a series spelled as the OTel name without its unit or type
//! suffix; a label shortened) and the mutation must fail the same check: that is how the
//! test fails when a dashboard names a series or label tetherd does not export.
//!
//! The test prints each panel, its queries and the series they returned.
//!
//! One test per binary: the global meter provider can be installed once per process.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use serde_norway::Value as Yaml;
use tether_daemon::config::Config;
use tether_daemon::config::ProviderConfig;
use tether_daemon::telemetry::{self, INSTRUMENTS, PrometheusConfig, TelemetryConfig};
use tether_provider_e2b::{E2bConfig, RetryConfig};
use tether_tests::fault_proxy::FaultProxy;
use tether_tests::promql::{self, Dashboard, Variable};
use tether_tests::{TestDaemon, free_port, wait_until, workspace_bin, workspace_root};

/// Debian's Prometheus (else `prometheus` on the `PATH`); `TETHER_PROMETHEUS_BIN`
/// overrides.
const PROMETHEUS_BIN: &str = "/usr/bin/prometheus";
/// Scrape (and rule evaluation) interval of the test's Prometheus.
const SCRAPE_INTERVAL: &str = "1s";
/// What Grafana's `$__rate_interval` and `$__interval` stand for here: wide enough to
/// hold both rounds of calls, narrow enough that they are what the rates see.
const RATE_WINDOW: &str = "1m";

/// Limits of the daemon under test: each clock fires in its own call.
const TOTAL_MS: u64 = 400;
const OUTPUT_IDLE_MS: u64 = 1_500;
const BASH_TOOL_BUDGET_MS: u64 = 3_000;
/// The E2B provider's transport-idle limit (its keepalives come every second).
const TRANSPORT_IDLE_MS: u64 = 2_500;
/// The file the stalled read reads, and where the stall starts.
const BIG_FILE_BYTES: u64 = 3 << 20;
const STALL_AFTER_BYTES: u64 = 512 << 10;
/// The provider whose backend never answers.
const UNREACHABLE: &str = "e2b-unreachable";

fn deploy() -> PathBuf {
    workspace_root().join("deploy")
}

// === a real Prometheus ===

#[derive(Debug, Deserialize)]
struct ApiResponse<T> {
    status: String,
    data: Option<T>,
    #[serde(default, rename = "errorType")]
    error_type: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Debug, Deserialize)]
struct QueryData {
    #[serde(rename = "resultType")]
    result_type: String,
    result: serde_json::Value,
}

/// One series of an instant vector.
#[derive(Debug, Clone, Deserialize)]
struct Sample {
    metric: BTreeMap<String, String>,
    value: (f64, String),
}

impl Sample {
    fn number(&self) -> f64 {
        self.value.1.parse().unwrap_or(f64::NAN)
    }

    /// The labels worth printing (the scope labels are the same on every series).
    fn show(&self) -> String {
        let labels: Vec<String> = self
            .metric
            .iter()
            .filter(|(k, _)| !k.starts_with("otel_scope_"))
            .map(|(k, v)| format!("{k}=\"{v}\""))
            .collect();
        format!("{{{}}} {}", labels.join(", "), self.value.1)
    }
}

/// A Prometheus child process with its own config and storage; killed on drop.
struct Prometheus {
    child: Child,
    base: String,
    dir: tempfile::TempDir,
    http: reqwest::Client,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Start Prometheus with `config` (YAML text) and wait until it is ready.
    async fn start(config: &str) -> Self {
        let bin = std::env::var("TETHER_PROMETHEUS_BIN").unwrap_or_else(|_| {
            if std::path::Path::new(PROMETHEUS_BIN).exists() {
                PROMETHEUS_BIN.into()
            } else {
                "prometheus".into()
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
        let port = free_port();
        let child = Command::new(&bin)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run {bin} ({e}): install Debian's `prometheus` package")
            });
        let p = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap(),
        };
        let ready = format!("{}/-/ready", p.base);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = p.http.get(&ready).send().await
                && r.status().is_success()
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Prometheus did not become ready:\n{}",
                p.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        p
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    async fn api<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        params: &[(&str, &str)],
    ) -> Result<T, String> {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .query(params)
            .send()
            .await
            .map_err(|e| format!("{path}: {e}"))?;
        let body: ApiResponse<T> = r.json().await.map_err(|e| format!("{path}: {e}"))?;
        match (body.status.as_str(), body.data) {
            ("success", Some(data)) => Ok(data),
            _ => Err(format!(
                "{}: {}",
                body.error_type.unwrap_or_default(),
                body.error.unwrap_or_default()
            )),
        }
    }

    /// An instant query at the current time; the result must be a vector.
    async fn query(&self, expr: &str) -> Result<Vec<Sample>, String> {
        let data: QueryData = self.api("/api/v1/query", &[("query", expr)]).await?;
        if data.result_type != "vector" {
            return Err(format!("a {} result, not a vector", data.result_type));
        }
        serde_json::from_value(data.result).map_err(|e| e.to_string())
    }

    /// The label sets of the series `selector` matches.
    async fn series(&self, selector: &str) -> Result<Vec<BTreeMap<String, String>>, String> {
        self.api("/api/v1/series", &[("match[]", selector)]).await
    }

    /// Grafana's `label_values(metric, label)`.
    async fn label_values(&self, metric: &str, label: &str) -> Result<Vec<String>, String> {
        self.api(
            &format!("/api/v1/label/{label}/values"),
            &[("match[]", metric)],
        )
        .await
    }

    /// Wait until `expr`'s single value equals `want`.
    async fn wait_for_value(&self, expr: &str, want: f64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let got = self
                .query(expr)
                .await
                .ok()
                .and_then(|v| v.first().map(Sample::number));
            if got == Some(want) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Prometheus never saw {expr} == {want} (last: {got:?}):\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The test's Prometheus config: the shipped compose job `tetherd` (its path, auth and
/// token), pointed at `target` and scraped every [`SCRAPE_INTERVAL`].
fn prometheus_config(target: SocketAddr) -> String {
    let shipped: Yaml = serde_norway::from_str(
        &std::fs::read_to_string(deploy().join("compose/prometheus.yml")).unwrap(),
    )
    .unwrap();
    let mut job = shipped["scrape_configs"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|j| j["job_name"] == "tetherd")
        .expect("compose/prometheus.yml has a `tetherd` job")
        .clone();
    let m = job.as_mapping_mut().unwrap();
    m.insert(
        "static_configs".into(),
        serde_norway::from_str(&format!("[{{targets: [\"{target}\"]}}]")).unwrap(),
    );
    m.insert("scrape_interval".into(), SCRAPE_INTERVAL.into());
    m.insert("scrape_timeout".into(), SCRAPE_INTERVAL.into());
    let config: Yaml = serde_norway::from_str(&format!(
        "global: {{scrape_interval: {SCRAPE_INTERVAL}, scrape_timeout: {SCRAPE_INTERVAL}, evaluation_interval: {SCRAPE_INTERVAL}}}"
    ))
    .unwrap();
    let mut config = config;
    config
        .as_mapping_mut()
        .unwrap()
        .insert("scrape_configs".into(), Yaml::Sequence(vec![job]));
    serde_norway::to_string(&config).unwrap()
}

// === driving the daemon ===

/// One tool call and the error code it must end with (`None`: ok).
struct Call {
    name: &'static str,
    arguments: serde_json::Value,
    want: Option<&'static str>,
    /// Stall the envd connection mid-response first.
    stall: bool,
}

fn call(name: &'static str, arguments: serde_json::Value, want: Option<&'static str>) -> Call {
    Call {
        name,
        arguments,
        want,
        stall: false,
    }
}

/// The calls of one round on any provider.
fn calls() -> Vec<Call> {
    vec![
        call(
            "write_file",
            json!({"path": "notes.txt", "content": "alpha\nbeta\n"}),
            None,
        ),
        call("read_file", json!({"path": "notes.txt"}), None),
        call(
            "edit_file",
            json!({"path": "notes.txt", "old_string": "beta", "new_string": "gamma"}),
            None,
        ),
        call("list_dir", json!({"path": "."}), None),
        call("bash", json!({"command": "echo hello"}), None),
        call(
            "read_file",
            json!({"path": "does/not/exist.txt"}),
            Some("FS_NOT_FOUND"),
        ),
        call("bash", json!({"command": ""}), Some("INVALID_REQUEST")),
        // Clock `total`: the command's own deadline.
        call(
            "bash",
            json!({"command": "echo begun; sleep 30", "timeout_ms": TOTAL_MS}),
            Some("DEADLINE_EXCEEDED"),
        ),
        // Clock `output_idle`: no output for limits.output_idle_ms.
        call(
            "bash",
            json!({"command": "echo begun; sleep 30", "timeout_ms": 20_000}),
            Some("IDLE_TIMEOUT"),
        ),
        // Clock `tool`: the timeout policy's budget, while the command keeps printing.
        call(
            "bash",
            json!({"command": "for i in $(seq 600); do echo tick; sleep 0.1; done", "timeout_ms": 20_000}),
            Some("TOOL_TIMEOUT"),
        ),
    ]
}

/// The calls of one round on the E2B provider: the same, plus a read whose stream stalls.
fn e2b_calls() -> Vec<Call> {
    let mut out = calls();
    out.push(call(
        "bash",
        json!({"command": format!("head -c {BIG_FILE_BYTES} /dev/zero | tr '\\0' a > big.txt")}),
        None,
    ));
    out.push(Call {
        stall: true,
        ..call(
            "read_file",
            json!({"path": "big.txt"}),
            Some("TRANSPORT_IDLE_TIMEOUT"),
        )
    });
    out
}

/// The clocks the calls above expire (on each provider).
const CLOCKS: &[&str] = &["total", "output_idle", "tool"];

async fn new_session(d: &TestDaemon, provider: &str) -> (u16, serde_json::Value) {
    d.post("/v1/sessions", json!({"provider": provider})).await
}

/// One round on `provider`: a session opened and ended (`sandbox.create` and
/// `sandbox.destroy` each round), then `calls` in session `sid`, each in its own request.
async fn drive(
    d: &TestDaemon,
    provider: &str,
    sid: &str,
    round: usize,
    calls: Vec<Call>,
    proxy: Option<&FaultProxy>,
) {
    let (st, body) = new_session(d, provider).await;
    assert_eq!(st, 201, "{body}");
    let brief = body["id"].as_str().unwrap().to_owned();
    let r = d
        .http
        .delete(d.url(&format!("/v1/sessions/{brief}")))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "end session: {}", r.status());
    for (i, c) in calls.into_iter().enumerate() {
        if c.stall {
            proxy
                .expect("a stall needs the proxy")
                .stall_after(STALL_AFTER_BYTES);
        }
        let (st, body) = d
            .post(
                &format!("/v1/sessions/{sid}/tool-calls"),
                json!({"calls": [{"id": format!("r{round}-{i}"), "name": c.name, "arguments": c.arguments}]}),
            )
            .await;
        assert_eq!(st, 200, "{}: {body}", c.name);
        let result = &body["results"][0];
        assert_eq!(
            result["error"]["code"].as_str(),
            c.want,
            "{provider}: {} {}: {result}",
            c.name,
            c.arguments
        );
    }
}

/// A tetherd child process serving its E2B front on the local provider: the backend of
/// the E2B provider under test. Stopped on drop: SIGTERM (it terminates its commands),
/// then SIGKILL if it is still there after its grace period.
struct Backend {
    child: Child,
    base: String,
    _state: tempfile::TempDir,
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while tokio::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Backend {
    async fn start() -> Self {
        let state = tempfile::tempdir().unwrap();
        let port = free_port();
        let child = Command::new(workspace_bin("tetherd"))
            .args([
                "serve",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--state-dir",
            ])
            .arg(state.path())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the backend tetherd");
        let b = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            _state: state,
        };
        let http = reqwest::Client::new();
        wait_until("the backend tetherd", Duration::from_secs(30), || async {
            http.get(format!("{}/v1/health", b.base))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
        b
    }
}

/// The E2B provider of the daemon under test: control plane straight to the backend, envd
/// traffic through `proxy`.
fn e2b_provider(backend: &Backend, proxy: &FaultProxy) -> ProviderConfig {
    ProviderConfig::E2b(E2bConfig {
        api_url: Some(backend.base.clone()),
        sandbox_url: Some(proxy.url()),
        api_key: Some("e2b_prometheus_test".into()),
        inherit_env: false,
        transport_idle_ms: TRANSPORT_IDLE_MS,
        keepalive_interval_s: 1,
        // No retries: a stalled read would otherwise be resumed on a new connection, and
        // the test needs it to end as TRANSPORT_IDLE_TIMEOUT.
        retry: RetryConfig {
            max_times: 0,
            ..RetryConfig::default()
        },
        ..E2bConfig::default()
    })
}

/// An E2B provider whose backend accepts connections and never answers. A create is sent
/// again under its key until its own limit (the request limit), so that limit is short.
fn unreachable_provider(dead: &FaultProxy) -> ProviderConfig {
    ProviderConfig::E2b(E2bConfig {
        api_url: Some(dead.url()),
        sandbox_url: Some(dead.url()),
        api_key: Some("e2b_prometheus_test".into()),
        inherit_env: false,
        connect_timeout_ms: 300,
        request_timeout_ms: 1_000,
        retry: RetryConfig {
            max_times: 1,
            min_delay_ms: 50,
            max_delay_ms: 100,
        },
        ..E2bConfig::default()
    })
}

// === checking one query ===

/// Grafana's values for the variables: one assignment of every variable.
type Assignment = Vec<(String, String)>;

/// Replace Grafana's variables; any `$` left is an unknown variable.
fn substitute(expr: &str, vars: &Assignment) -> Result<String, String> {
    let mut out = expr
        .replace("$__rate_interval", RATE_WINDOW)
        .replace("${__rate_interval}", RATE_WINDOW)
        .replace("$__interval", RATE_WINDOW)
        .replace("${__interval}", RATE_WINDOW);
    let mut vars = vars.clone();
    // Longest first, so that `$tool` does not eat the start of `$tools`.
    vars.sort_by_key(|(name, _)| std::cmp::Reverse(name.len()));
    for (name, value) in &vars {
        out = out
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("${name}"), value);
    }
    match out.find('$') {
        Some(i) => Err(format!("unknown variable at `{}`", &out[i..])),
        None => Ok(out),
    }
}

/// Run `expr` (variables substituted) and check it as the module doc says, but for the
/// per-variable pass. Returns the series.
async fn check_query(
    prom: &Prometheus,
    expr: &str,
    legend_labels: &[String],
) -> Result<Vec<Sample>, String> {
    let result = prom.query(expr).await?;
    if result.is_empty() {
        return Err("no series".into());
    }
    let mut expected: BTreeSet<String> = promql::grouping_labels(expr)
        .into_iter()
        .filter(|l| l != "le")
        .collect();
    expected.extend(legend_labels.iter().cloned());
    for s in &result {
        for l in &expected {
            if s.metric.get(l).is_none_or(String::is_empty) {
                return Err(format!("a series lacks label `{l}`: {}", s.show()));
            }
        }
    }
    if !result.iter().any(|s| s.number().is_finite()) {
        return Err(format!(
            "no finite value: {:?}",
            result.iter().map(Sample::show).collect::<Vec<_>>()
        ));
    }
    let names = promql::metric_names(expr);
    if names.is_empty() {
        return Err("names no tether series".into());
    }
    let mut labels = BTreeSet::new();
    for n in &names {
        let series = prom.series(n).await?;
        if series.is_empty() {
            return Err(format!("`{n}` has no series in Prometheus"));
        }
        labels.extend(series.into_iter().flat_map(BTreeMap::into_keys));
    }
    for l in promql::label_names(expr) {
        if !labels.contains(&l) {
            return Err(format!("label `{l}` is on none of {names:?}"));
        }
    }
    Ok(result)
}

/// The values of a dashboard's variables, as Grafana would offer them.
async fn variable_values(
    prom: &Prometheus,
    vars: &[Variable],
    report: &mut String,
) -> Result<Vec<(Variable, Vec<String>)>, String> {
    let mut out = Vec::new();
    for v in vars {
        let q = v
            .query
            .as_ref()
            .ok_or(format!("variable {}: no query", v.name))?;
        let (metric, label) = promql::label_values_query(q.text()).ok_or(format!(
            "variable {}: not label_values(metric, label)",
            v.name
        ))?;
        let values = prom.label_values(&metric, &label).await?;
        if values.is_empty() {
            return Err(format!("variable {}: {} has no values", v.name, q.text()));
        }
        writeln!(report, "  variable ${} = {}: {values:?}", v.name, q.text()).unwrap();
        out.push((v.clone(), values));
    }
    Ok(out)
}

/// "All" for every variable.
fn all_assignment(values: &[(Variable, Vec<String>)]) -> Assignment {
    values
        .iter()
        .map(|(v, vals)| {
            let value = if v.include_all {
                v.all_value
                    .clone()
                    .unwrap_or_else(|| format!("({})", vals.join("|")))
            } else {
                vals[0].clone()
            };
            (v.name.clone(), value)
        })
        .collect()
}

/// A panel query, as the dashboard has it.
struct Query {
    panel: String,
    expr: String,
    legend: Vec<String>,
}

/// Check one dashboard query: with "All", then with each variable it uses set to a real
/// value (some value must return series). Returns the "All" series.
async fn check_dashboard_query(
    prom: &Prometheus,
    q: &Query,
    values: &[(Variable, Vec<String>)],
) -> Result<(String, Vec<Sample>), String> {
    let all = all_assignment(values);
    let expr = substitute(&q.expr, &all)?;
    let series = check_query(prom, &expr, &q.legend).await?;
    for (v, vals) in values {
        if !q.expr.contains(&format!("${}", v.name)) {
            continue;
        }
        let mut found = false;
        for val in vals {
            let mut one = all.clone();
            for (name, value) in &mut one {
                if *name == v.name {
                    *value = val.clone();
                }
            }
            if check_query(prom, &substitute(&q.expr, &one)?, &q.legend)
                .await
                .is_ok()
            {
                found = true;
                break;
            }
        }
        if !found {
            return Err(format!(
                "no value of ${} ({vals:?}) returns series: is its label on the metric?",
                v.name
            ));
        }
    }
    Ok((expr, series))
}

// === mutations ===

/// Replace whole-word occurrences of `from` in `text`.
fn replace_word(text: &str, from: &str, to: &str) -> String {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find(from) {
        let before = rest[..i].chars().next_back();
        let after = rest[i + from.len()..].chars().next();
        out.push_str(&rest[..i]);
        if before.is_some_and(word) || after.is_some_and(word) {
            out.push_str(from);
        } else {
            out.push_str(to);
        }
        rest = &rest[i + from.len()..];
    }
    out.push_str(rest);
    out
}

/// A wrong spelling of an exported series: the OTel name with underscores but without
/// the unit and type suffixes (`tether_tool_duration_bucket`), or a gauge taken for a
/// counter (`tether_sandboxes_live_total`).
fn wrong_series(series: &str) -> String {
    for spec in INSTRUMENTS {
        let base = spec.prometheus_name();
        if spec.prometheus_series().iter().any(|s| s == series) {
            let naive = series.replacen(&base, &spec.name.replace('.', "_"), 1);
            if naive != series {
                return naive;
            }
            return format!("{series}_total");
        }
    }
    format!("{series}_wrong")
}

/// A wrong spelling of a label: `tool_name` -> `tool`, `outcome` -> `outcome_name`.
fn wrong_label(label: &str) -> String {
    match label.split_once('_') {
        Some((head, _)) => head.to_owned(),
        None => format!("{label}_name"),
    }
}

/// Every mutation of a query that must fail: each series misspelt, each label misspelt
/// (in the expression and the legend alike, as an author would).
fn mutations(q: &Query) -> Vec<(String, Query)> {
    let mut out = Vec::new();
    let names: BTreeSet<String> = promql::metric_names(&q.expr).into_iter().collect();
    for n in &names {
        let wrong = wrong_series(n);
        out.push((
            format!("series {n} -> {wrong}"),
            Query {
                panel: q.panel.clone(),
                expr: replace_word(&q.expr, n, &wrong),
                legend: q.legend.clone(),
            },
        ));
    }
    let labels: BTreeSet<String> = promql::label_names(&q.expr)
        .into_iter()
        .filter(|l| l != "le")
        .collect();
    for l in &labels {
        let wrong = wrong_label(l);
        out.push((
            format!("label {l} -> {wrong}"),
            Query {
                panel: q.panel.clone(),
                expr: replace_word(&q.expr, l, &wrong),
                legend: q
                    .legend
                    .iter()
                    .map(|x| if x == l { wrong.clone() } else { x.clone() })
                    .collect(),
            },
        ));
    }
    out
}

fn queries(d: &Dashboard) -> Vec<Query> {
    d.panels
        .iter()
        .flat_map(|p| {
            p.targets.iter().map(|t| Query {
                panel: p.title.clone(),
                expr: t.expr.clone().unwrap_or_default(),
                legend: t.legend_labels(),
            })
        })
        .collect()
}

// === the test ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_series_from_a_real_prometheus() {
    // tetherd as compose ships it: the scrape endpoint with the compose token, here on
    // an ephemeral loopback port.
    let compose = Config::from_toml_str(
        &std::fs::read_to_string(deploy().join("compose/tetherd.toml")).unwrap(),
    )
    .unwrap();
    let shipped = compose
        .telemetry
        .prometheus
        .clone()
        .expect("compose/tetherd.toml has [telemetry.prometheus]");
    let cfg = TelemetryConfig {
        prometheus: Some(PrometheusConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..shipped
        }),
        ..TelemetryConfig::default()
    };
    let env: HashMap<String, String> = [("RUST_LOG".to_owned(), "warn".to_owned())].into();
    let guard = telemetry::init(&cfg, &env).unwrap();
    assert!(!guard.exports_metrics() && guard.scrape_endpoint().is_some());

    let backend = Backend::start().await;
    let envd = FaultProxy::start(backend.base.trim_start_matches("http://").parse().unwrap()).await;
    let dead = FaultProxy::start(backend.base.trim_start_matches("http://").parse().unwrap()).await;
    dead.blackhole();
    let d = TestDaemon::start_with(|c| {
        c.default_provider = "local".to_owned();
        c.limits.output_idle_ms = OUTPUT_IDLE_MS;
        c.pipeline
            .tool_timeouts
            .insert("bash".to_owned(), BASH_TOOL_BUDGET_MS);
        c.providers
            .insert("e2b".to_owned(), e2b_provider(&backend, &envd));
        c.providers
            .insert(UNREACHABLE.to_owned(), unreachable_provider(&dead));
    })
    .await;
    let metrics_addr = d
        .daemon
        .as_ref()
        .and_then(|r| r.metrics_addr)
        .expect("the scrape listener is up");
    let url = format!("http://{metrics_addr}{}", telemetry::scrape::METRICS_PATH);
    let r = d.http.get(&url).send().await.unwrap();
    assert_eq!(r.status(), 401, "a scrape without the token is refused");

    let prom = Prometheus::start(&prometheus_config(metrics_addr)).await;
    // The first scrape, with the shipped job's token, succeeded.
    prom.wait_for_value("up{job=\"tetherd\"}", 1.0).await;

    // Two rounds of every outcome on both providers, with scrapes between, so that rates
    // see increases.
    let sid = d.new_session().await;
    let (st, body) = new_session(&d, "e2b").await;
    assert_eq!(st, 201, "{body}");
    let e2b_sid = body["id"].as_str().unwrap().to_owned();
    let per_round = calls().len() + e2b_calls().len();
    for round in 1..=2 {
        drive(&d, "local", &sid, round, calls(), None).await;
        drive(&d, "e2b", &e2b_sid, round, e2b_calls(), Some(&envd)).await;
        let (st, body) = new_session(&d, UNREACHABLE).await;
        assert_eq!(
            (st, tether_tests::code(&body)),
            (504, "CONNECT_TIMEOUT"),
            "{body}"
        );
        prom.wait_for_value(
            "sum(tether_tool_duration_seconds_count{job=\"tetherd\"})",
            (round * per_round) as f64,
        )
        .await;
    }
    let outcomes: BTreeSet<String> = prom
        .query("sum by (outcome) (tether_tool_duration_seconds_count)")
        .await
        .unwrap()
        .into_iter()
        .filter_map(|s| s.metric.get("outcome").cloned())
        .collect();
    let wanted: BTreeSet<String> = e2b_calls()
        .iter()
        .map(|c| c.want.unwrap_or("ok").to_owned())
        .collect();
    assert_eq!(outcomes, wanted, "every outcome reached Prometheus");
    let clocks: BTreeMap<(String, String), f64> = prom
        .query("sum by (timeout_clock, provider_kind) (tether_timeouts_total)")
        .await
        .unwrap()
        .into_iter()
        .map(|s| {
            (
                (
                    s.metric["provider_kind"].clone(),
                    s.metric["timeout_clock"].clone(),
                ),
                s.number(),
            )
        })
        .collect();
    for provider in ["local", "e2b"] {
        for c in CLOCKS {
            assert_eq!(
                clocks.get(&(provider.to_owned(), (*c).to_owned())),
                Some(&2.0),
                "clock {c} twice on {provider}: {clocks:?}"
            );
        }
    }
    // The providers' own clocks are counted too: the stalled read's transport idle and
    // the unreachable backend's connect.
    for c in ["transport_idle", "connect"] {
        assert!(
            clocks
                .get(&("e2b".to_owned(), c.to_owned()))
                .is_some_and(|n| *n >= 1.0),
            "clock {c} on e2b: {clocks:?}"
        );
    }
    let e2b_failures: BTreeSet<(String, String)> = prom
        .query("sum by (remote_op, outcome) (tether_remote_op_duration_seconds_count{provider_kind=\"e2b\", outcome!=\"ok\"})")
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.metric["remote_op"].clone(), s.metric["outcome"].clone()))
        .collect();
    for want in [
        ("sandbox.create", "CONNECT_TIMEOUT"),
        ("fs.read", "TRANSPORT_IDLE_TIMEOUT"),
    ] {
        assert!(
            e2b_failures.contains(&(want.0.to_owned(), want.1.to_owned())),
            "{want:?} in {e2b_failures:?}"
        );
    }

    // Every dashboard query, then its mutations.
    let dashboards = promql::dashboards(&deploy());
    assert!(!dashboards.is_empty(), "no dashboard under deploy/");
    let mut report = String::new();
    let mut failures = Vec::new();
    let mut checked = 0;
    let mut caught = 0;
    for dash in &dashboards {
        writeln!(
            report,
            "dashboard {:?} ({})",
            dash.title,
            dash.path.display()
        )
        .unwrap();
        let values = match variable_values(&prom, &dash.variables, &mut report).await {
            Ok(v) => v,
            Err(e) => {
                failures.push(format!("{}: {e}", dash.title));
                continue;
            }
        };
        let mut last_panel = String::new();
        for q in queries(dash) {
            if q.panel != last_panel {
                writeln!(report, "panel {:?}", q.panel).unwrap();
                last_panel.clone_from(&q.panel);
            }
            checked += 1;
            match check_dashboard_query(&prom, &q, &values).await {
                Ok((expr, series)) => {
                    writeln!(report, "  query {expr}").unwrap();
                    for s in &series {
                        writeln!(report, "    {}", s.show()).unwrap();
                    }
                }
                Err(e) => {
                    writeln!(report, "  query {}\n    FAILED: {e}", q.expr).unwrap();
                    failures.push(format!("panel {:?}: {}: {e}", q.panel, q.expr));
                }
            }
            for (what, m) in mutations(&q) {
                match check_dashboard_query(&prom, &m, &values).await {
                    Ok((expr, _)) => failures.push(format!(
                        "panel {:?}: the mutation ({what}) passed the check: {expr}",
                        q.panel
                    )),
                    Err(e) => {
                        caught += 1;
                        writeln!(report, "    mutation {what}: rejected ({e})").unwrap();
                    }
                }
            }
        }
    }
    // The OTel spelling itself is not a Prometheus series name.
    let dotted = check_query(&prom, "sum(rate(tether.tool.duration[1m]))", &[]).await;
    assert!(dotted.is_err(), "{dotted:?}");
    writeln!(
        report,
        "negative: tether.tool.duration -> {}",
        dotted.unwrap_err()
    )
    .unwrap();
    writeln!(
        report,
        "{checked} dashboard queries checked, {caught} mutations rejected"
    )
    .unwrap();
    println!("{report}");

    d.stop().await;
    guard.shutdown().await;
    drop(prom);
    drop(backend);
    assert!(checked > 0 && caught > 0);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
