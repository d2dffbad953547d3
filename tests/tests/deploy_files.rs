//! The files under `deploy/` are checked against the code they deploy: every YAML parses,
//! the dashboards query only series the daemon exports (derived from its instrument list),
//! the Prometheus scrape configs pass `promtool check config` and reach the endpoint the
//! configs open with the token they set, each deployment feeds Prometheus one metrics path
//! (never the scrape and the OTLP push both), the manifests are complete and probe
//! `/v1/health`, the systemd unit validates its config before starting, and every example
//! config parses with the daemon's own config type.
//!
//! `tests/tests/prometheus.rs` runs the same dashboard queries against a real Prometheus.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_norway::Value as Yaml;
use tether_daemon::config::Config;
use tether_daemon::telemetry::{self, INSTRUMENTS, names};
use tether_tests::promql::{self, files_under, label_names, label_values_query, metric_names};
use tether_tests::workspace_root;

fn deploy() -> PathBuf {
    workspace_root().join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Every document of a YAML file (manifests may hold several).
fn yaml_docs(path: &Path) -> Vec<Yaml> {
    let text = read(path);
    let mut docs = Vec::new();
    for de in serde_norway::Deserializer::from_str(&text) {
        let v = <Yaml as serde::Deserialize>::deserialize(de)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if !v.is_null() {
            docs.push(v);
        }
    }
    docs
}

fn yaml(path: &Path) -> Yaml {
    let mut docs = yaml_docs(path);
    assert_eq!(
        docs.len(),
        1,
        "{}: expected one YAML document",
        path.display()
    );
    docs.remove(0)
}

fn s<'a>(v: &'a Yaml, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("`{key}` is not a string in {v:?}"))
}

/// The Prometheus series each instrument produces, with the labels allowed on it.
fn exported_series() -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for spec in INSTRUMENTS {
        let mut labels: BTreeSet<String> = spec.prometheus_labels().into_iter().collect();
        // The collector adds these to every series.
        labels.extend(["job".to_owned(), "instance".to_owned()]);
        for series in spec.prometheus_series() {
            let mut l = labels.clone();
            if series.ends_with("_bucket") {
                l.insert("le".to_owned());
            }
            out.insert(series, l);
        }
    }
    out
}

#[test]
fn every_yaml_file_parses() {
    let files = files_under(&deploy(), &["yaml", "yml"]);
    assert!(
        files.len() >= 12,
        "expected the compose, grafana and k8s YAML files, found {files:?}"
    );
    for f in &files {
        assert!(!yaml_docs(f).is_empty(), "{} is empty", f.display());
    }
}

// === the dashboards ===

/// Check one PromQL expression: it names at least one exported series, and only labels
/// those series carry. Returns the series it names.
fn check_expr(
    expr: &str,
    series: &BTreeMap<String, BTreeSet<String>>,
) -> Result<Vec<String>, String> {
    let names = metric_names(expr);
    if names.is_empty() {
        return Err(format!("query references no tether metric: {expr}"));
    }
    let mut allowed = BTreeSet::new();
    for n in &names {
        let labels = series.get(n).ok_or_else(|| {
            format!(
                "`{n}` is not a series the daemon exports (known: {:?})",
                series.keys()
            )
        })?;
        allowed.extend(labels.iter().cloned());
    }
    for l in label_names(expr) {
        if !allowed.contains(&l) {
            return Err(format!("label `{l}` does not exist on {names:?}: {expr}"));
        }
    }
    Ok(names)
}

#[test]
fn dashboard_queries_use_only_exported_series() {
    let series = exported_series();
    let dashboards = promql::dashboards(&deploy());
    assert!(!dashboards.is_empty());
    assert!(
        dashboards
            .iter()
            .all(|d| d.path.starts_with(deploy().join("grafana/dashboards"))),
        "dashboards live in grafana/dashboards, which Grafana provisions"
    );
    let datasources = yaml(&deploy().join("grafana/provisioning/datasources/datasources.yaml"));
    let uids: BTreeSet<&str> = datasources["datasources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|d| s(d, "uid"))
        .collect();

    let mut used = BTreeSet::new();
    for d in &dashboards {
        let path = d.path.display();
        assert!(
            !d.uid.is_empty() && !d.title.is_empty(),
            "{path}: uid and title"
        );
        assert!(!d.panels.is_empty(), "{path}: no panels");
        for p in &d.panels {
            let title = &p.title;
            let uid = p.datasource.as_ref().map_or("", |d| d.uid.as_str());
            assert!(
                uids.contains(uid),
                "panel {title:?}: datasource uid {uid:?} is not provisioned"
            );
            assert!(!p.targets.is_empty(), "panel {title:?}: no targets");
            for t in &p.targets {
                let expr = t
                    .expr
                    .as_deref()
                    .unwrap_or_else(|| panic!("panel {title:?}: target without expr"));
                let names =
                    check_expr(expr, &series).unwrap_or_else(|e| panic!("panel {title:?}: {e}"));
                // A legend names labels the query keeps.
                for l in t.legend_labels() {
                    assert!(
                        names.iter().any(|n| series[n].contains(&l)),
                        "panel {title:?}: legend label `{l}` is not on {names:?}"
                    );
                }
                used.extend(names);
            }
        }
        for v in &d.variables {
            let q = v
                .query
                .as_ref()
                .unwrap_or_else(|| panic!("variable {}: no query", v.name));
            let (metric, label) = label_values_query(q.text())
                .unwrap_or_else(|| panic!("variable {}: not label_values(metric, label)", v.name));
            let labels = series
                .get(&metric)
                .unwrap_or_else(|| panic!("variable {}: `{metric}` is not exported", v.name));
            assert!(
                labels.contains(&label),
                "variable {}: `{metric}` has no label `{label}`",
                v.name
            );
            used.insert(metric);
        }
    }
    // Each instrument is on a panel: a metric nobody can see is a dashboard bug.
    for spec in INSTRUMENTS {
        assert!(
            spec.prometheus_series().iter().any(|s| used.contains(s)),
            "no panel shows {} ({:?})",
            spec.name,
            spec.prometheus_series()
        );
    }
}

#[test]
fn the_query_parsers_see_what_they_should() {
    let e = r#"histogram_quantile(0.9, sum by (le, tool_name) (rate(tether_tool_duration_seconds_bucket{provider_kind=~"$p", outcome!="ok"}[5m])))"#;
    assert_eq!(metric_names(e), ["tether_tool_duration_seconds_bucket"]);
    assert_eq!(
        label_names(e),
        ["le", "tool_name", "provider_kind", "outcome"]
    );
    // A misspelt series or label is caught.
    let series = exported_series();
    assert!(check_expr(e, &series).is_ok());
    assert!(check_expr("rate(tether_tool_duration_bucket[5m])", &series).is_err());
    assert!(check_expr("sum by (tool) (tether_sandboxes_live)", &series).is_err());
    assert!(check_expr("up", &series).is_err());
    assert_eq!(
        label_values_query("label_values(tether_tool_duration_seconds_count, tool_name)"),
        Some((
            "tether_tool_duration_seconds_count".to_owned(),
            "tool_name".to_owned()
        ))
    );
    let t = promql::Target {
        expr: None,
        legend_format: Some("p95 {{tool_name}} ({{ provider_kind }})".into()),
    };
    assert_eq!(t.legend_labels(), ["tool_name", "provider_kind"]);
}

// === the collector, Prometheus and compose ===

#[test]
fn collector_routes_traces_to_jaeger_and_metrics_to_the_scraped_exporter() {
    let dir = deploy().join("compose");
    let col = yaml(&dir.join("otel-collector.yaml"));
    let pipelines = col["service"]["pipelines"].as_mapping().unwrap();
    for (name, p) in pipelines {
        for section in ["receivers", "processors", "exporters"] {
            for c in p[section].as_sequence().into_iter().flatten() {
                let c = c.as_str().unwrap();
                assert!(
                    col[section].get(c).is_some(),
                    "pipeline {name:?}: {section} `{c}` is not defined"
                );
            }
        }
    }
    let traces = &col["service"]["pipelines"]["traces"];
    let trace_exporter = traces["exporters"][0].as_str().unwrap();
    assert!(
        s(&col["exporters"][trace_exporter], "endpoint").starts_with("jaeger:"),
        "traces must go to jaeger"
    );
    assert_eq!(traces["receivers"][0].as_str(), Some("otlp"));
    let metrics = &col["service"]["pipelines"]["metrics"];
    assert_eq!(metrics["exporters"][0].as_str(), Some("prometheus"));
    let prom_port = s(&col["exporters"]["prometheus"], "endpoint")
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    // The OTLP receiver listens on the ports tetherd is pointed at.
    assert!(s(&col["receivers"]["otlp"]["protocols"]["http"], "endpoint").ends_with(":4318"));
    assert!(s(&col["receivers"]["otlp"]["protocols"]["grpc"], "endpoint").ends_with(":4317"));

    let prom = yaml(&dir.join("prometheus.yml"));
    let targets: Vec<&str> = prom["scrape_configs"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|j| j["static_configs"].as_sequence().unwrap().iter())
        .flat_map(|c| {
            c["targets"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|t| t.as_str().unwrap())
        })
        .collect();
    assert!(
        targets.contains(&format!("otel-collector:{prom_port}").as_str()),
        "prometheus scrapes {targets:?}"
    );

    let compose = yaml(&dir.join("compose.yaml"));
    let services = compose["services"].as_mapping().unwrap();
    for svc in [
        "tetherd",
        "otel-collector",
        "jaeger",
        "prometheus",
        "grafana",
    ] {
        assert!(
            services.get(svc).is_some(),
            "compose has no `{svc}` service"
        );
    }
    assert!(
        s(&compose["services"]["otel-collector"], "image")
            .starts_with("otel/opentelemetry-collector-contrib:")
    );
    let env = &compose["services"]["tetherd"]["environment"];
    assert_eq!(
        s(env, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        "http://otel-collector:4318"
    );
    // Every bind-mounted file exists.
    for (name, svc) in services {
        for v in svc["volumes"].as_sequence().into_iter().flatten() {
            let v = v.as_str().unwrap();
            if let Some(src) = v.split(':').next().filter(|s| s.starts_with('.')) {
                assert!(
                    dir.join(src).exists(),
                    "service {name:?} mounts missing {src}"
                );
            }
        }
    }
    let build = &compose["services"]["tetherd"]["build"];
    let containerfile = dir.join(s(build, "context")).join(s(build, "dockerfile"));
    assert!(containerfile.is_file(), "{}", containerfile.display());
}

// === Kubernetes ===

#[test]
fn k8s_manifests_are_complete_and_probe_health() {
    let dir = deploy().join("k8s");
    let kustomization = yaml(&dir.join("kustomization.yaml"));
    let resources: BTreeSet<String> = kustomization["resources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect();
    let manifests: BTreeSet<String> = files_under(&dir, &["yaml"])
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .filter(|n| n != "kustomization.yaml")
        .collect();
    assert_eq!(
        resources, manifests,
        "kustomization.yaml must list exactly the manifests"
    );

    let mut by_kind: BTreeMap<String, Vec<Yaml>> = BTreeMap::new();
    for f in &manifests {
        for doc in yaml_docs(&dir.join(f)) {
            assert!(doc["apiVersion"].is_string(), "{f}: apiVersion");
            assert!(doc["metadata"]["name"].is_string(), "{f}: metadata.name");
            by_kind
                .entry(s(&doc, "kind").to_owned())
                .or_default()
                .push(doc);
        }
    }
    for kind in ["Deployment", "Service", "ConfigMap", "Secret"] {
        assert!(by_kind.contains_key(kind), "no {kind} manifest");
    }

    let dep = &by_kind["Deployment"][0];
    let pod = &dep["spec"]["template"];
    let pod_labels = pod["metadata"]["labels"].as_mapping().unwrap();
    for (k, v) in dep["spec"]["selector"]["matchLabels"].as_mapping().unwrap() {
        assert_eq!(
            pod_labels.get(k),
            Some(v),
            "selector label {k:?} not on the pod"
        );
    }
    let containers = pod["spec"]["containers"].as_sequence().unwrap();
    let tetherd = containers
        .iter()
        .find(|c| c["name"] == "tetherd")
        .expect("a tetherd container");
    let port_names: BTreeSet<&str> = tetherd["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| s(p, "name"))
        .collect();
    for probe in ["readinessProbe", "livenessProbe"] {
        let get = &tetherd[probe]["httpGet"];
        assert_eq!(get["path"].as_str(), Some("/v1/health"), "{probe}");
        let port = get["port"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| get["port"].as_u64().unwrap().to_string());
        assert!(
            port_names.contains(port.as_str()) || port == "7420",
            "{probe} port {port}"
        );
    }
    let env: Vec<&str> = tetherd["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| s(e, "name"))
        .collect();
    assert!(env.contains(&"OTEL_EXPORTER_OTLP_ENDPOINT"));

    // The Service reaches the pod.
    let svc = &by_kind["Service"][0];
    for (k, v) in svc["spec"]["selector"].as_mapping().unwrap() {
        assert_eq!(pod_labels.get(k), Some(v), "service selector {k:?}");
    }

    // The ConfigMap's config, rendered with the Secret's keys, is a valid config, and the
    // render step names exactly the Secret's placeholders.
    let cm = by_kind["ConfigMap"]
        .iter()
        .find(|c| c["data"].get("tetherd.toml.template").is_some())
        .expect("the ConfigMap of tetherd.toml");
    let template = s(&cm["data"], "tetherd.toml.template");
    let secret = &by_kind["Secret"][0];
    let mut rendered = template.to_owned();
    for (k, _) in secret["stringData"].as_mapping().unwrap() {
        rendered = rendered.replace(
            &format!("@{}@", k.as_str().unwrap()),
            "a-sixteen-plus-character-secret",
        );
    }
    assert!(
        !rendered.contains('@'),
        "unrendered placeholder in:\n{rendered}"
    );
    let cfg = Config::from_toml_str(&rendered).unwrap_or_else(|e| panic!("k8s config: {e}"));
    cfg.telemetry.validate().unwrap();
    assert_eq!(cfg.server.state_dir, Path::new("/var/lib/tether"));
}

// === systemd, the container, the example configs ===

fn unit_values<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
    unit.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .collect()
}

#[test]
fn systemd_unit_validates_its_config_before_starting() {
    let dir = deploy().join("systemd");
    let unit = read(&dir.join("tetherd.service"));
    let pre = unit_values(&unit, "ExecStartPre");
    let start = unit_values(&unit, "ExecStart");
    assert_eq!(start.len(), 1, "{start:?}");
    let config_of = |cmd: &str, sub: &str| -> String {
        let words: Vec<&str> = cmd.split_whitespace().collect();
        assert!(words[0].ends_with("/tetherd") && words[1] == sub, "{cmd}");
        let i = words
            .iter()
            .position(|w| *w == "--config")
            .unwrap_or_else(|| panic!("no --config in {cmd}"));
        words[i + 1].to_owned()
    };
    let validated: Vec<String> = pre
        .iter()
        .map(|c| config_of(c, "validate-config"))
        .collect();
    let served = config_of(start[0], "serve");
    assert!(
        validated.contains(&served),
        "ExecStartPre must validate {served}, validates {validated:?}"
    );

    // The local provider's sandboxes are made of these namespaces: the unit must allow
    // every one of them.
    let namespaces: Vec<&str> = unit_values(&unit, "RestrictNamespaces")
        .iter()
        .flat_map(|v| v.split_whitespace())
        .collect();
    for ns in ["user", "mnt", "pid", "uts", "ipc", "net", "cgroup"] {
        assert!(
            namespaces.contains(&ns),
            "RestrictNamespaces lacks {ns}: {namespaces:?}"
        );
    }
    // ...and it needs loop devices and a fresh /proc in a sandbox (no over-mounted /proc).
    for (key, forbidden) in [
        ("PrivateDevices", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectProc", "invisible"),
    ] {
        assert!(
            !unit_values(&unit, key).contains(&forbidden),
            "{key}={forbidden}"
        );
    }
    for (key, want) in [
        ("ProtectSystem", "strict"),
        ("PrivateTmp", "yes"),
        ("RestartPreventExitStatus", "64"),
    ] {
        assert_eq!(unit_values(&unit, key), [want], "{key}");
    }
    assert!(
        unit_values(&unit, "ProtectHome")
            .iter()
            .all(|v| *v == "tmpfs" || *v == "yes")
    );
    assert!(unit_values(&unit, "ProtectHome").len() == 1);
    let rw: Vec<&str> = unit_values(&unit, "ReadWritePaths")
        .iter()
        .flat_map(|v| v.split_whitespace())
        .collect();

    // The example config parses with the daemon's own type, and its state dir is writable.
    let cfg = Config::from_toml_str(&read(&dir.join("tetherd.toml")))
        .unwrap_or_else(|e| panic!("tetherd.toml: {e}"));
    cfg.telemetry.validate().unwrap();
    let state = cfg.server.state_dir.to_string_lossy().into_owned();
    assert!(
        rw.contains(&state.as_str()),
        "state_dir {state} not in ReadWritePaths {rw:?}"
    );
    assert!(cfg.telemetry.otlp_endpoint.is_some());
}

#[test]
fn compose_config_parses_with_the_daemon_config_type() {
    let cfg = Config::from_toml_str(&read(&deploy().join("compose/tetherd.toml")))
        .unwrap_or_else(|e| panic!("{e}"));
    cfg.telemetry.validate().unwrap();
}

// === the Prometheus scrape endpoint ===

/// `promtool check config --syntax-only` (Debian's `prometheus` package) on `text`: the
/// real parser, strict about unknown fields. `--syntax-only` because credential files
/// named in a config exist only where it is deployed.
fn promtool_check(name: &str, text: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, text).unwrap();
    let out = std::process::Command::new("promtool")
        .args(["check", "config", "--syntax-only"])
        .arg(&path)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run promtool ({e}): install Debian's `prometheus` package")
        });
    assert!(
        out.status.success(),
        "promtool rejects {name}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The scrape job named `job` of a Prometheus config.
fn scrape_job<'a>(prom: &'a Yaml, job: &str) -> &'a Yaml {
    prom["scrape_configs"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|j| j["job_name"] == job)
        .unwrap_or_else(|| panic!("no scrape job `{job}`"))
}

fn job_targets(job: &Yaml) -> Vec<String> {
    job["static_configs"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|c| c["targets"].as_sequence().unwrap().iter())
        .map(|t| t.as_str().unwrap().to_owned())
        .collect()
}

/// Which path a deployment's metrics take to Prometheus, given the environment it sets:
/// exactly one of the scrape endpoint and the OTLP push, or every series arrives twice.
fn metrics_path(cfg: &Config, env: &[(&str, &str)]) -> &'static str {
    let env: std::collections::HashMap<String, String> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let r = cfg.telemetry.resolve(&env).unwrap();
    match (r.prometheus.is_some(), r.metrics_endpoint.is_some()) {
        (true, false) => "scrape",
        (false, true) => "otlp",
        (true, true) => panic!("metrics both scraped and pushed over OTLP: counted twice"),
        (false, false) => panic!("no metrics reach Prometheus"),
    }
}

#[test]
fn compose_prometheus_scrapes_tetherd_with_the_token_it_sets() {
    let dir = deploy().join("compose");
    let text = read(&dir.join("prometheus.yml"));
    promtool_check("prometheus.yml", &text);
    let prom = yaml(&dir.join("prometheus.yml"));
    let cfg = Config::from_toml_str(&read(&dir.join("tetherd.toml"))).unwrap();
    let scrape = cfg
        .telemetry
        .prometheus
        .clone()
        .expect("[telemetry.prometheus] in compose/tetherd.toml");
    let job = scrape_job(&prom, "tetherd");
    assert_eq!(
        job_targets(job),
        [format!("tetherd:{}", scrape.listen.port())],
        "the job scrapes the port tetherd listens on"
    );
    assert_eq!(
        job["metrics_path"].as_str(),
        Some(telemetry::scrape::METRICS_PATH)
    );
    assert_eq!(s(&job["authorization"], "type"), "Bearer");
    let credentials = s(&job["authorization"], "credentials");
    assert!(
        scrape.auth_tokens.iter().any(|t| t == credentials),
        "the job's token is not one of tetherd's {:?}",
        scrape.auth_tokens
    );

    let compose = yaml(&dir.join("compose.yaml"));
    let tetherd = &compose["services"]["tetherd"];
    let port = scrape.listen.port().to_string();
    assert!(
        tetherd["expose"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|p| p.as_str() == Some(port.as_str())),
        "compose exposes {port} to the network"
    );
    assert!(
        tetherd["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .all(|p| !p.as_str().unwrap().ends_with(&format!(":{port}"))),
        "/metrics is not published on the host"
    );
    let env: Vec<(&str, &str)> = tetherd["environment"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.as_str().unwrap(), v.as_str().unwrap()))
        .collect();
    assert_eq!(metrics_path(&cfg, &env), "scrape");
}

#[test]
fn k8s_scrape_config_reaches_the_metrics_port_with_the_secret_token() {
    let dir = deploy().join("k8s");
    let kustomization = yaml(&dir.join("kustomization.yaml"));
    let namespace = s(&kustomization, "namespace");
    let docs: Vec<Yaml> = files_under(&dir, &["yaml"])
        .iter()
        .filter(|p| !p.ends_with("kustomization.yaml"))
        .flat_map(|p| yaml_docs(p))
        .collect();
    let find = |pred: &dyn Fn(&Yaml) -> bool, what: &str| -> Yaml {
        docs.iter()
            .find(|d| pred(d))
            .cloned()
            .unwrap_or_else(|| panic!("no {what}"))
    };
    let dep = find(&|d| d["kind"] == "Deployment", "Deployment");
    let svc = find(&|d| d["kind"] == "Service", "Service");
    let secret = find(&|d| d["kind"] == "Secret", "Secret");
    let cm = find(
        &|d| d["kind"] == "ConfigMap" && d["data"].get("tetherd.toml.template").is_some(),
        "tetherd.toml ConfigMap",
    );
    let scrape_cm = find(
        &|d| d["kind"] == "ConfigMap" && d["data"].get("scrape-config.yaml").is_some(),
        "scrape-config ConfigMap",
    );

    // The config opens the endpoint with a token from the Secret.
    let template = s(&cm["data"], "tetherd.toml.template");
    let rendered = template.replace("@TETHER_METRICS_TOKEN@", "metrics-token-0123456789");
    let rendered = rendered
        .replace("@TETHER_AUTH_TOKEN@", "auth-token-0123456789")
        .replace("@E2B_FRONT_API_KEY@", "e2b-key-0123456789");
    let cfg = Config::from_toml_str(&rendered).unwrap_or_else(|e| panic!("k8s config: {e}"));
    let scrape = cfg
        .telemetry
        .prometheus
        .clone()
        .expect("[telemetry.prometheus]");
    assert_eq!(scrape.auth_tokens, ["metrics-token-0123456789"]);
    assert!(secret["stringData"].get("TETHER_METRICS_TOKEN").is_some());

    // The init container substitutes every placeholder of the template.
    let pod = &dep["spec"]["template"]["spec"];
    let init = &pod["initContainers"][0];
    let script: String = init["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let mut rest = template;
    while let Some(open) = rest.find('@') {
        let after = &rest[open + 1..];
        let close = after.find('@').expect("placeholders are @NAME@");
        let name = &after[..close];
        assert!(
            script.contains(&format!("s|@{name}@|${{{name}}}|")),
            "the init container does not substitute @{name}@"
        );
        rest = &after[close + 1..];
    }

    // Container port `metrics` is the listen port, and the Service carries it.
    let tetherd = pod["containers"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "tetherd")
        .unwrap();
    let metrics_port = tetherd["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("a container port named metrics");
    assert_eq!(
        metrics_port["containerPort"].as_u64(),
        Some(u64::from(scrape.listen.port()))
    );
    let svc_port = svc["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["targetPort"] == "metrics")
        .expect("a Service port targeting metrics");

    // The scrape job: promtool accepts it, it targets the Service's port and sends a token.
    let fragment = s(&scrape_cm["data"], "scrape-config.yaml");
    promtool_check("scrape-config.yaml", fragment);
    let prom: Yaml = serde_norway::from_str(fragment).unwrap();
    let job = scrape_job(&prom, "tetherd");
    assert_eq!(
        job_targets(job),
        [format!(
            "{}.{namespace}.svc:{}",
            s(&svc["metadata"], "name"),
            svc_port["port"].as_u64().unwrap()
        )]
    );
    assert_eq!(
        job["metrics_path"].as_str(),
        Some(telemetry::scrape::METRICS_PATH)
    );
    assert_eq!(s(&job["authorization"], "type"), "Bearer");
    assert!(
        s(&job["authorization"], "credentials_file").ends_with("/TETHER_METRICS_TOKEN"),
        "the job reads the Secret's key"
    );

    let env: Vec<(&str, &str)> = tetherd["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|e| Some((s(e, "name"), e["value"].as_str()?)))
        .collect();
    assert_eq!(metrics_path(&cfg, &env), "scrape");
}

#[test]
fn systemd_example_offers_the_scrape_endpoint_commented() {
    let text = read(&deploy().join("systemd/tetherd.toml"));
    let cfg = Config::from_toml_str(&text).unwrap();
    assert_eq!(cfg.telemetry.prometheus, None, "off as shipped");
    assert_eq!(metrics_path(&cfg, &[]), "otlp");
    // Uncommented, the block is a valid section (on loopback, with a token).
    let block: String = text
        .lines()
        .skip_while(|l| *l != "# [telemetry.prometheus]")
        .take_while(|l| l.starts_with('#'))
        .map(|l| format!("{}\n", l.trim_start_matches('#').trim_start()))
        .collect();
    assert!(
        !block.is_empty(),
        "no commented [telemetry.prometheus] block"
    );
    let on = Config::from_toml_str(&format!("{text}\n{block}")).unwrap();
    on.telemetry.validate().unwrap();
    let p = on.telemetry.prometheus.expect("the uncommented section");
    assert!(p.listen.ip().is_loopback());
    assert_eq!(p.auth_tokens.len(), 1);
}

#[test]
fn containerfile_builds_both_binaries_from_existing_sources() {
    let text = read(&deploy().join("container/Containerfile"));
    let stages = text
        .lines()
        .filter(|l| l.trim_start().starts_with("FROM "))
        .count();
    assert!(stages >= 2, "expected a multi-stage build");
    assert!(text.contains("cargo build --release --locked"));
    for bin in ["tetherd", "tether", "tether-confine"] {
        assert!(
            text.contains(&format!("target/release/{bin} "))
                || text.contains(&format!("target/release/{bin}\n")),
            "{bin}"
        );
    }
    // Files copied from the build context exist.
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        let words: Vec<&str> = line.split_whitespace().collect();
        for src in &words[1..words.len() - 1] {
            if *src != "." {
                assert!(
                    workspace_root().join(src).exists(),
                    "COPY source {src} is missing"
                );
            }
        }
    }
}

// === the telemetry reference ===

#[test]
fn telemetry_doc_covers_the_whole_vocabulary() {
    let doc = read(&workspace_root().join("docs/telemetry.md"));
    for span in names::ALL_SPANS {
        assert!(
            doc.contains(&format!("`{span}`")),
            "docs/telemetry.md does not document span `{span}`"
        );
    }
    for key in [
        names::SESSION_ID,
        names::SANDBOX_ID,
        names::PROVIDER_KIND,
        names::TOOL_NAME,
        names::TOOL_CALL_ID,
        names::OUTCOME,
        names::ERROR_CODE,
        names::TIMEOUT_CLOCK,
        names::RETRY_COUNT,
        names::BYTES_IN,
        names::BYTES_OUT,
        names::EXIT_CODE,
        names::REMOTE_OP,
    ] {
        assert!(
            doc.contains(&format!("`{key}`")),
            "docs/telemetry.md does not document attribute `{key}`"
        );
    }
    for spec in INSTRUMENTS {
        assert!(
            doc.contains(&format!("`{}`", spec.name)),
            "docs/telemetry.md does not document {}",
            spec.name
        );
        assert!(
            doc.contains(&spec.prometheus_name()),
            "docs/telemetry.md lacks the Prometheus name of {}",
            spec.name
        );
    }
    for var in [
        telemetry::env::OTEL_EXPORTER_OTLP_ENDPOINT,
        telemetry::env::OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
        telemetry::env::OTEL_EXPORTER_OTLP_METRICS_ENDPOINT,
        telemetry::env::OTEL_EXPORTER_OTLP_PROTOCOL,
        telemetry::env::OTEL_EXPORTER_OTLP_TIMEOUT,
        telemetry::env::OTEL_SERVICE_NAME,
        telemetry::env::OTEL_RESOURCE_ATTRIBUTES,
        telemetry::env::OTEL_TRACES_SAMPLER,
        telemetry::env::OTEL_TRACES_SAMPLER_ARG,
        telemetry::env::OTEL_SDK_DISABLED,
        telemetry::env::OTEL_METRIC_EXPORT_INTERVAL,
    ] {
        assert!(
            doc.contains(var),
            "docs/telemetry.md does not document {var}"
        );
    }
}
