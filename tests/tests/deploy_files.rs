//! The files under `deploy/` are checked against the code they deploy: every YAML parses,
//! the dashboards query only series the daemon exports (derived from its instrument list),
//! the manifests are complete and probe `/v1/health`, the systemd unit validates its config
//! before starting, and every example config parses with the daemon's own config type.

// Helpers outside #[test] fns panic on purpose: a panic is how a test reports failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use serde_norway::Value as Yaml;
use tether_daemon::config::Config;
use tether_daemon::telemetry::{self, INSTRUMENTS, names};
use tether_tests::workspace_root;

fn deploy() -> PathBuf {
    workspace_root().join("deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn files_under(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in
            std::fs::read_dir(&d).unwrap_or_else(|e| panic!("read_dir {}: {e}", d.display()))
        {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| exts.contains(&e))
            {
                out.push(p);
            }
        }
    }
    out.sort();
    out
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

/// `tether_*` identifiers in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(pos) = expr[i..].find("tether_") {
        let start = i + pos;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if boundary {
            out.push(expr[start..end].to_owned());
        }
        i = end;
    }
    out
}

/// Label names used in `by (...)` / `without (...)` clauses and `{label op value}` matchers.
fn label_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for kw in ["by (", "by(", "without (", "without("] {
        let mut rest = expr;
        while let Some(p) = rest.find(kw) {
            let after = &rest[p + kw.len()..];
            let close = after.find(')').unwrap_or(after.len());
            out.extend(
                after[..close]
                    .split(',')
                    .map(|l| l.trim().to_owned())
                    .filter(|l| !l.is_empty()),
            );
            rest = &after[close..];
        }
    }
    let mut rest = expr;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let close = after.find('}').unwrap_or(after.len());
        for matcher in after[..close].split(',') {
            let name: String = matcher
                .trim()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push(name);
            }
        }
        rest = &after[close..];
    }
    out
}

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
    let dashboards = files_under(&deploy().join("grafana/dashboards"), &["json"]);
    assert!(!dashboards.is_empty());
    let datasources = yaml(&deploy().join("grafana/provisioning/datasources/datasources.yaml"));
    let uids: BTreeSet<&str> = datasources["datasources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|d| s(d, "uid"))
        .collect();

    let mut used = BTreeSet::new();
    for path in &dashboards {
        let d: Json =
            serde_json::from_str(&read(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            d["uid"].is_string() && d["title"].is_string(),
            "{}: uid and title",
            path.display()
        );
        let panels = d["panels"]
            .as_array()
            .unwrap_or_else(|| panic!("{}: no panels", path.display()));
        assert!(!panels.is_empty());
        for p in panels {
            let title = p["title"].as_str().unwrap_or("<untitled>");
            let uid = p["datasource"]["uid"].as_str().unwrap_or_default();
            assert!(
                uids.contains(uid),
                "panel {title:?}: datasource uid {uid:?} is not provisioned"
            );
            let targets = p["targets"]
                .as_array()
                .unwrap_or_else(|| panic!("panel {title:?}: no targets"));
            assert!(!targets.is_empty(), "panel {title:?}: no targets");
            for t in targets {
                let expr = t["expr"]
                    .as_str()
                    .unwrap_or_else(|| panic!("panel {title:?}: target without expr"));
                used.extend(
                    check_expr(expr, &series).unwrap_or_else(|e| panic!("panel {title:?}: {e}")),
                );
            }
        }
        for v in d["templating"]["list"].as_array().into_iter().flatten() {
            if let Some(q) = v["query"]["query"].as_str().or(v["query"].as_str()) {
                used.extend(
                    check_expr(q, &series)
                        .unwrap_or_else(|e| panic!("variable {}: {e}", v["name"])),
                );
            }
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
    let cm = &by_kind["ConfigMap"][0];
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

    for (key, want) in [
        ("NoNewPrivileges", "yes"),
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
