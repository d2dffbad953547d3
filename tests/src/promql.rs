//! The shipped Grafana dashboards and the PromQL in them: every dashboard under a
//! directory (any `*.json` with `panels`), each panel's targets and legends, the template
//! variables, and the metric and label names an expression uses.
//!
//! The name scanners are deliberately simple (no PromQL parser): they find `tether_*`
//! identifiers, `by (...)`/`without (...)` lists and `{label op value}` matchers, which is
//! every construct the dashboards use; `tests/tests/deploy_files.rs` pins what they see.

// Test support: a dashboard that does not parse is a failed test, and says which.
#![allow(clippy::expect_used)]

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One dashboard file.
#[derive(Debug, Clone)]
pub struct Dashboard {
    /// Its file.
    pub path: PathBuf,
    /// Its uid.
    pub uid: String,
    /// Its title.
    pub title: String,
    /// Every panel with queries (rows' nested panels included).
    pub panels: Vec<Panel>,
    /// Its template variables.
    pub variables: Vec<Variable>,
}

/// A panel.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Panel {
    /// Its title.
    #[serde(default)]
    pub title: String,
    /// Its type (`timeseries`, `stat`, `row`, ...).
    #[serde(default, rename = "type")]
    pub kind: String,
    /// Its data source.
    #[serde(default)]
    pub datasource: Option<DataSourceRef>,
    /// Its queries.
    #[serde(default)]
    pub targets: Vec<Target>,
    /// A row's panels.
    #[serde(default)]
    pub panels: Vec<Panel>,
}

/// A reference to a provisioned data source.
#[derive(Debug, Clone, Deserialize)]
pub struct DataSourceRef {
    /// The data source's uid.
    #[serde(default)]
    pub uid: String,
}

/// One query of a panel.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Target {
    /// The PromQL expression (Grafana variables not yet substituted).
    #[serde(default)]
    pub expr: Option<String>,
    /// The legend template (`{{label}}` placeholders).
    #[serde(default)]
    pub legend_format: Option<String>,
}

/// A template variable.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Variable {
    /// Its name (`$name` in queries).
    pub name: String,
    /// Its query: `label_values(metric, label)` for a query variable.
    #[serde(default)]
    pub query: Option<VariableQuery>,
    /// Whether "All" is offered.
    #[serde(default)]
    pub include_all: bool,
    /// What "All" stands for (Grafana's default is a regex of every value).
    #[serde(default)]
    pub all_value: Option<String>,
}

/// A variable's query, as older (string) or newer (object) Grafana writes it.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum VariableQuery {
    /// `"label_values(...)"`.
    Text(String),
    /// `{"query": "label_values(...)", "refId": ...}`.
    Object {
        /// The query text.
        query: String,
    },
}

#[derive(Debug, Deserialize)]
struct DashboardFile {
    #[serde(default)]
    uid: String,
    #[serde(default)]
    title: String,
    #[serde(default)]
    panels: Vec<Panel>,
    #[serde(default)]
    templating: Templating,
}

#[derive(Debug, Default, Deserialize)]
struct Templating {
    #[serde(default)]
    list: Vec<Variable>,
}

impl VariableQuery {
    /// The query text.
    pub fn text(&self) -> &str {
        match self {
            Self::Text(t) | Self::Object { query: t } => t,
        }
    }
}

impl Target {
    /// The `{{label}}` names of the legend.
    pub fn legend_labels(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = self.legend_format.as_deref().unwrap_or("");
        while let Some(open) = rest.find("{{") {
            let after = &rest[open + 2..];
            let Some(close) = after.find("}}") else { break };
            let name = after[..close].trim();
            if !name.is_empty() {
                out.push(name.to_owned());
            }
            rest = &after[close + 2..];
        }
        out
    }
}

/// Every Grafana dashboard (a JSON file with `panels`) under `root`, sorted by path.
pub fn dashboards(root: &Path) -> Vec<Dashboard> {
    let mut out = Vec::new();
    for path in files_under(root, &["json"]) {
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let probe: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{}: invalid JSON: {e}", path.display()));
        if probe.get("panels").is_none() {
            continue;
        }
        let d: DashboardFile = serde_json::from_value(probe)
            .unwrap_or_else(|e| panic!("{}: not a dashboard: {e}", path.display()));
        let mut panels = Vec::new();
        let mut stack: Vec<Panel> = d.panels.into_iter().rev().collect();
        while let Some(mut p) = stack.pop() {
            stack.extend(std::mem::take(&mut p.panels).into_iter().rev());
            if p.kind != "row" {
                panels.push(p);
            }
        }
        out.push(Dashboard {
            path,
            uid: d.uid,
            title: d.title,
            panels,
            variables: d.templating.list,
        });
    }
    out
}

/// Files under `dir` (recursively) whose extension is one of `exts`, sorted.
pub fn files_under(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in
            std::fs::read_dir(&d).unwrap_or_else(|e| panic!("read_dir {}: {e}", d.display()))
        {
            let p = entry.expect("directory entry").path();
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

/// `label_values(metric, label)` → `(metric, label)`.
pub fn label_values_query(q: &str) -> Option<(String, String)> {
    let inner = q.trim().strip_prefix("label_values(")?.strip_suffix(')')?;
    let (metric, label) = inner.rsplit_once(',')?;
    Some((metric.trim().to_owned(), label.trim().to_owned()))
}

/// `tether_*` identifiers in a PromQL expression, in order.
pub fn metric_names(expr: &str) -> Vec<String> {
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

/// Label names of `by (...)` / `without (...)` clauses, in order.
pub fn grouping_labels(expr: &str) -> Vec<String> {
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
    out
}

/// Label names of `{label op value}` matchers, in order.
pub fn matcher_labels(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
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

/// Every label name an expression uses: grouping lists, then matchers.
pub fn label_names(expr: &str) -> Vec<String> {
    let mut out = grouping_labels(expr);
    out.extend(matcher_labels(expr));
    out
}
