//! The pre-execute policies: which tools may run ([`PermissionPolicy`]) and which sandbox
//! paths the file tools may touch ([`PathPolicy`]).

use async_trait::async_trait;

use super::{Guard, Invocation, PreDecision, Wildcard};
use crate::pipeline::config::{PathPolicyConfig, PermissionConfig};
use crate::pipeline::tools::Access;

/// The workspace assumed when the session has no sandbox to ask.
const DEFAULT_WORKSPACE: &str = "/home/user";

// === impl PermissionPolicy ===

/// `[pipeline.permission]`: deny, ask (= deny, there is no approver) or allow by tool name.
#[derive(Debug, Clone)]
pub struct PermissionPolicy {
    deny: Vec<Wildcard>,
    ask: Vec<Wildcard>,
    allow: Vec<Wildcard>,
}

impl PermissionPolicy {
    /// Build from the config section.
    pub fn new(cfg: &PermissionConfig) -> Self {
        Self {
            deny: Wildcard::compile(&cfg.deny_tools),
            ask: Wildcard::compile(&cfg.ask_tools),
            allow: Wildcard::compile(&cfg.allow_tools),
        }
    }

    /// Whether the policy restricts anything (an empty one is not registered).
    pub fn is_empty(&self) -> bool {
        self.deny.is_empty() && self.ask.is_empty() && self.allow.is_empty()
    }

    /// The decision for a tool name.
    pub fn decide(&self, tool: &str) -> PreDecision {
        if let Some(p) = Wildcard::first_match(&self.deny, tool) {
            return PreDecision::Deny {
                reason: format!(
                    "tool \"{tool}\" is denied by the permission policy (pattern \"{}\")",
                    p.as_str()
                ),
            };
        }
        if let Some(p) = Wildcard::first_match(&self.ask, tool) {
            return PreDecision::Ask {
                reason: Some(format!(
                    "tool \"{tool}\" needs an approval (pattern \"{}\") and no approver is configured",
                    p.as_str()
                )),
            };
        }
        if !self.allow.is_empty() && Wildcard::first_match(&self.allow, tool).is_none() {
            return PreDecision::Deny {
                reason: format!("tool \"{tool}\" is not allowed by the permission policy"),
            };
        }
        PreDecision::Allow
    }
}

#[async_trait]
impl Guard for PermissionPolicy {
    fn name(&self) -> &'static str {
        "permission"
    }

    async fn pre_execute(&self, inv: &Invocation) -> PreDecision {
        self.decide(&inv.name)
    }
}

// === impl PathPolicy ===

/// `[pipeline.path_policy]`: deny globs over the paths file tools declare.
#[derive(Debug, Clone)]
pub struct PathPolicy {
    deny_write: Vec<Glob>,
    deny_read: Vec<Glob>,
}

impl PathPolicy {
    /// Build from the config section.
    pub fn new(cfg: &PathPolicyConfig) -> Self {
        Self {
            deny_write: cfg.deny_write.iter().map(|g| Glob::new(g)).collect(),
            deny_read: cfg.deny_read.iter().map(|g| Glob::new(g)).collect(),
        }
    }

    /// Whether the policy denies anything (an empty one is not registered).
    pub fn is_empty(&self) -> bool {
        self.deny_write.is_empty() && self.deny_read.is_empty()
    }

    /// The decision for one access to `path` (relative to `workspace` unless absolute).
    pub fn decide(&self, workspace: &str, path: &str, access: Access) -> PreDecision {
        let abs = normalize(workspace, path);
        let lists: &[&[Glob]] = match access {
            Access::Read => &[&self.deny_read],
            Access::Write => &[&self.deny_read, &self.deny_write],
        };
        for list in lists {
            if let Some(g) = list.iter().find(|g| g.matches(&abs)) {
                return PreDecision::Deny {
                    reason: format!(
                        "path \"{abs}\" is protected by the path policy (pattern \"{}\")",
                        g.source
                    ),
                };
            }
        }
        PreDecision::Allow
    }
}

#[async_trait]
impl Guard for PathPolicy {
    fn name(&self) -> &'static str {
        "path-policy"
    }

    async fn pre_execute(&self, inv: &Invocation) -> PreDecision {
        let Some(tool) = &inv.tool else {
            return PreDecision::Allow;
        };
        let paths = tool.paths(&inv.arguments);
        if paths.is_empty() {
            return PreDecision::Allow;
        }
        let workspace = inv
            .session
            .sandbox()
            .map(|s| s.info().workspace)
            .unwrap_or_else(|_| DEFAULT_WORKSPACE.to_owned());
        for p in paths {
            let d = self.decide(&workspace, &p.path, p.access);
            if d != PreDecision::Allow {
                return d;
            }
        }
        PreDecision::Allow
    }
}

/// `path` made absolute against `workspace`, with `.`, `..` and repeated slashes removed
/// (lexically: `..` above the root stays at the root).
pub fn normalize(workspace: &str, path: &str) -> String {
    let joined = if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("{workspace}/{path}")
    };
    let mut parts: Vec<&str> = Vec::new();
    for seg in joined.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            s => parts.push(s),
        }
    }
    format!("/{}", parts.join("/"))
}

/// A path glob: `**` is any number of whole segments (none included), `*` any run of
/// characters within a segment, `?` one character. Matches whole absolute paths; a
/// pattern without a leading `/` or `**` is taken as relative to any directory (`**/`
/// is prepended), so `.env` protects every `.env`.
#[derive(Debug, Clone)]
struct Glob {
    segments: Vec<String>,
    source: String,
}

impl Glob {
    fn new(pattern: &str) -> Self {
        let anchored = pattern.starts_with('/') || pattern.starts_with("**");
        let mut segments: Vec<String> = Vec::new();
        if !anchored {
            segments.push("**".to_owned());
        }
        segments.extend(
            pattern
                .split('/')
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
        );
        Self {
            segments,
            source: pattern.to_owned(),
        }
    }

    fn matches(&self, abs: &str) -> bool {
        let path: Vec<&str> = abs.split('/').filter(|s| !s.is_empty()).collect();
        match_segments(&self.segments, &path)
    }
}

fn match_segments(pat: &[String], path: &[&str]) -> bool {
    match pat.split_first() {
        None => path.is_empty(),
        Some((first, rest)) if first == "**" => {
            (0..=path.len()).any(|skip| match_segments(rest, &path[skip..]))
        }
        Some((first, rest)) => match path.split_first() {
            Some((seg, tail)) => match_segment(first, seg) && match_segments(rest, tail),
            None => false,
        },
    }
}

/// `*` and `?` within one segment.
fn match_segment(pattern: &str, seg: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = seg.chars().collect();
    let (mut ti, mut pi) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn denied(d: PreDecision) -> bool {
        matches!(d, PreDecision::Deny { .. } | PreDecision::Ask { .. })
    }

    #[test]
    fn normalize_resolves_against_the_workspace() {
        assert_eq!(normalize("/home/user", "a/./b/../c"), "/home/user/a/c");
        assert_eq!(normalize("/home/user", "/etc//passwd"), "/etc/passwd");
        assert_eq!(normalize("/home/user", "../../../x"), "/x");
    }

    #[test]
    fn globs_match_segments() {
        let g = Glob::new("**/.git/**");
        assert!(g.matches("/home/user/.git"));
        assert!(g.matches("/home/user/.git/config"));
        assert!(g.matches("/home/user/a/b/.git/refs/heads/main"));
        assert!(!g.matches("/home/user/.gitignore"));
        assert!(!g.matches("/home/user/git/config"));
        let g = Glob::new("/home/user/*.key");
        assert!(g.matches("/home/user/a.key"));
        assert!(!g.matches("/home/user/d/a.key"));
        let g = Glob::new(".env");
        assert!(g.matches("/home/user/.env"));
        assert!(g.matches("/home/user/app/.env"));
        assert!(!g.matches("/home/user/.envrc"));
        assert!(Glob::new("/tmp/?.txt").matches("/tmp/a.txt"));
        assert!(!Glob::new("/tmp/?.txt").matches("/tmp/ab.txt"));
    }

    #[test]
    fn path_policy_denies_writes_under_git_by_default_and_reads_by_config() {
        let p = PathPolicy::new(&PathPolicyConfig::default());
        assert!(denied(p.decide("/home/user", ".git/config", Access::Write)));
        assert!(denied(p.decide(
            "/home/user",
            "src/../.git/HEAD",
            Access::Write
        )));
        assert!(!denied(p.decide("/home/user", ".git/config", Access::Read)));
        assert!(!denied(p.decide(
            "/home/user",
            "src/main.rs",
            Access::Write
        )));
        let cfg = PathPolicyConfig {
            deny_write: vec![],
            deny_read: vec!["/home/user/secrets/**".into()],
        };
        let p = PathPolicy::new(&cfg);
        assert!(denied(p.decide("/home/user", "secrets/k", Access::Read)));
        assert!(
            denied(p.decide("/home/user", "secrets/k", Access::Write)),
            "unreadable means unwritable"
        );
        assert!(!denied(p.decide("/home/user", "public/k", Access::Read)));
    }

    #[test]
    fn permission_policy_deny_wins_then_ask_then_allow_list() {
        let cfg = PermissionConfig {
            deny_tools: vec!["ba*".into()],
            ask_tools: vec!["write_file".into()],
            allow_tools: vec!["*_file".into(), "bash".into()],
        };
        let p = PermissionPolicy::new(&cfg);
        assert!(
            matches!(p.decide("bash"), PreDecision::Deny { .. }),
            "deny wins over allow"
        );
        assert!(matches!(p.decide("write_file"), PreDecision::Ask { .. }));
        assert_eq!(p.decide("read_file"), PreDecision::Allow);
        assert!(
            matches!(p.decide("list_dir"), PreDecision::Deny { .. }),
            "not in the allow list"
        );
        let open = PermissionPolicy::new(&PermissionConfig::default());
        assert!(open.is_empty());
        assert_eq!(open.decide("anything"), PreDecision::Allow);
    }
}
