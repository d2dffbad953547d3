//! The `[pipeline]` section: the batch scheduler's bound and each guard's own section.
//!
//! Every field has a documented default and unknown fields are refused. Validation runs
//! at load ([`PipelineConfig::validate`], called by the daemon's config loader) and again
//! when a [`super::Pipeline`] is built, so a bad threshold or a zero pool never reaches a
//! running pipeline: it fails loudly with a [`PipelineConfigError`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tether_provider::clock::MAX_TIMER_DELAY_MS;

/// Default bound of the rolling pool of parallel tool calls.
pub const DEFAULT_MAX_PARALLEL_TOOL_CALLS: usize = 4;
/// Default repeat-reminder thresholds (consecutive identical calls).
pub const DEFAULT_REMINDER_THRESHOLDS: [u32; 3] = [3, 5, 8];
/// Default number of characters of canonical arguments quoted in a detailed reminder.
pub const DEFAULT_ARGUMENTS_PREVIEW_CHARS: u32 = 500;
/// Default deny globs of the path policy for write tools.
pub const DEFAULT_DENY_WRITE: &[&str] = &["**/.git/**"];

/// The `[pipeline]` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Largest number of concurrency-safe calls of one batch dispatched at once. Exclusive
    /// calls always run alone. Must be >= 1 (1 runs every batch serially). Default 4.
    #[serde(default = "d_max_parallel")]
    pub max_parallel_tool_calls: i64,
    /// Per-tool budgets of the timeout policy, ms, over the tools' own defaults
    /// (`read_file`, `write_file`, `edit_file`, `list_dir`: 120 000; `bash`: none, its
    /// command's own deadline bounds it). `0` removes a tool's budget. At most 2 147 483 647.
    /// Example: `[pipeline.tool_timeouts] bash = 600000`.
    #[serde(default)]
    pub tool_timeouts: BTreeMap<String, u64>,
    /// The permission policy (pre-execute).
    #[serde(default)]
    pub permission: PermissionConfig,
    /// The path policy (pre-execute).
    #[serde(default)]
    pub path_policy: PathPolicyConfig,
    /// The repeat-tool-reminder guard (post-execute).
    #[serde(default)]
    pub repeat_tool_reminder: RepeatReminderConfig,
}

fn d_max_parallel() -> i64 {
    DEFAULT_MAX_PARALLEL_TOOL_CALLS as i64
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            max_parallel_tool_calls: d_max_parallel(),
            tool_timeouts: BTreeMap::new(),
            permission: PermissionConfig::default(),
            path_policy: PathPolicyConfig::default(),
            repeat_tool_reminder: RepeatReminderConfig::default(),
        }
    }
}

/// `[pipeline.permission]`: which tools may run at all.
///
/// Patterns match tool names; `*` matches any run of characters and every other
/// character is literal. A call matching `deny_tools` is denied; otherwise one matching
/// `ask_tools` needs an approval, and tetherd has no approver, so it is denied too (with
/// a reason saying so); otherwise, when `allow_tools` is not empty, only tools matching it
/// run. Denied calls get a `TOOL_DENIED` result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PermissionConfig {
    /// Tool-name patterns that are always denied. Default: none.
    #[serde(default)]
    pub deny_tools: Vec<String>,
    /// Tool-name patterns that need an approval (denied: there is no approver). Default: none.
    #[serde(default)]
    pub ask_tools: Vec<String>,
    /// When not empty, only tools matching one of these patterns may run. Default: empty
    /// (every tool).
    #[serde(default)]
    pub allow_tools: Vec<String>,
}

/// `[pipeline.path_policy]`: sandbox paths file tools may not touch.
///
/// Globs match the call's path made absolute against the sandbox workspace and normalised
/// lexically (`.` and `..` removed): `**` matches any number of whole path segments
/// (including none), `*` any run of characters within one segment, `?` one character.
/// The policy is lexical: it sees the path the model wrote, not where a symlink leads;
/// the sandbox remains the security boundary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathPolicyConfig {
    /// Globs that write tools (`write_file`, `edit_file`) may not write. Default
    /// `["**/.git/**"]`; `[]` allows every path.
    #[serde(default = "d_deny_write")]
    pub deny_write: Vec<String>,
    /// Globs no file tool may read or write. Default: none.
    #[serde(default)]
    pub deny_read: Vec<String>,
}

fn d_deny_write() -> Vec<String> {
    DEFAULT_DENY_WRITE.iter().map(|s| (*s).to_owned()).collect()
}

impl Default for PathPolicyConfig {
    fn default() -> Self {
        Self {
            deny_write: d_deny_write(),
            deny_read: Vec::new(),
        }
    }
}

/// `[pipeline.repeat_tool_reminder]`: the advisory repeated-call guard.
///
/// Counts consecutive identical calls (same tool, same canonical arguments) per session
/// and, when the run length reaches a threshold, attaches a reminder to the result as an
/// additional context. It never denies or rewrites a call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RepeatReminderConfig {
    /// Run the guard. Default true.
    #[serde(default = "d_true")]
    pub enabled: bool,
    /// Run lengths that trigger a reminder: a gentle one at the smallest, a detailed one at
    /// the others, nothing past the largest. Integers >= 2, no duplicates, not empty.
    /// Default `[3, 5, 8]`.
    #[serde(default = "d_thresholds")]
    pub thresholds: Vec<f64>,
    /// Tool-name patterns to track (`*` wildcard); empty tracks every tool. Default: empty.
    #[serde(default)]
    pub include: Vec<String>,
    /// Tool-name patterns that are transparent (neither counted nor breaking a run).
    /// Default: empty.
    #[serde(default)]
    pub exclude: Vec<String>,
    /// Characters of the canonical arguments quoted in a detailed reminder, an integer of
    /// at least 1. Bounds the reminder only; detection always compares the full arguments.
    /// Default 500.
    #[serde(default = "d_preview")]
    pub arguments_preview_chars: f64,
}

fn d_true() -> bool {
    true
}
fn d_thresholds() -> Vec<f64> {
    DEFAULT_REMINDER_THRESHOLDS
        .iter()
        .map(|t| f64::from(*t))
        .collect()
}
fn d_preview() -> f64 {
    f64::from(DEFAULT_ARGUMENTS_PREVIEW_CHARS)
}

impl Default for RepeatReminderConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            thresholds: d_thresholds(),
            include: Vec::new(),
            exclude: Vec::new(),
            arguments_preview_chars: d_preview(),
        }
    }
}

/// An invalid `[pipeline]` section.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PipelineConfigError {
    /// `max_parallel_tool_calls` is below 1.
    #[error("pipeline: invalid max_parallel_tool_calls {value} — must be an integer >= 1")]
    MaxParallel {
        /// The value given.
        value: i64,
    },
    /// A tool budget exceeds the largest timer delay.
    #[error(
        "pipeline: tool_timeouts.{tool} = {ms} — must be at most 2147483647 ms (0 = no budget)"
    )]
    ToolTimeout {
        /// The tool.
        tool: String,
        /// The value given.
        ms: u64,
    },
    /// A pattern is empty.
    #[error("pipeline: {field} contains an empty pattern")]
    EmptyPattern {
        /// The config field.
        field: &'static str,
    },
    /// The reminder's thresholds are empty.
    #[error("repeat-tool-reminder: `thresholds` must not be empty")]
    EmptyThresholds,
    /// A reminder threshold is not an integer >= 2.
    #[error(
        "repeat-tool-reminder: invalid threshold {value} — every threshold must be an integer >= 2"
    )]
    InvalidThreshold {
        /// The value given.
        value: f64,
    },
    /// The reminder's thresholds repeat a value.
    #[error("repeat-tool-reminder: `thresholds` must not contain duplicates")]
    DuplicateThresholds,
    /// `arguments_preview_chars` is not an integer >= 1.
    #[error(
        "repeat-tool-reminder: invalid arguments_preview_chars {value} — must be an integer >= 1"
    )]
    InvalidPreviewChars {
        /// The value given.
        value: f64,
    },
}

// === impl PipelineConfig ===

impl PipelineConfig {
    /// Check every rule of the section; the first violation is returned.
    pub fn validate(&self) -> Result<(), PipelineConfigError> {
        self.max_parallel()?;
        for (tool, ms) in &self.tool_timeouts {
            if *ms as f64 > MAX_TIMER_DELAY_MS {
                return Err(PipelineConfigError::ToolTimeout {
                    tool: tool.clone(),
                    ms: *ms,
                });
            }
        }
        let p = &self.permission;
        for (field, list) in [
            ("permission.deny_tools", &p.deny_tools),
            ("permission.ask_tools", &p.ask_tools),
            ("permission.allow_tools", &p.allow_tools),
            ("path_policy.deny_write", &self.path_policy.deny_write),
            ("path_policy.deny_read", &self.path_policy.deny_read),
            (
                "repeat_tool_reminder.include",
                &self.repeat_tool_reminder.include,
            ),
            (
                "repeat_tool_reminder.exclude",
                &self.repeat_tool_reminder.exclude,
            ),
        ] {
            if list.iter().any(|s| s.is_empty()) {
                return Err(PipelineConfigError::EmptyPattern { field });
            }
        }
        self.repeat_tool_reminder.validate().map(|_| ())
    }

    /// The validated pool bound.
    pub(crate) fn max_parallel(&self) -> Result<usize, PipelineConfigError> {
        let v = self.max_parallel_tool_calls;
        usize::try_from(v)
            .ok()
            .filter(|n| *n >= 1)
            .ok_or(PipelineConfigError::MaxParallel { value: v })
    }
}

// === impl RepeatReminderConfig ===

impl RepeatReminderConfig {
    /// Validate (dsh's load-time rules, in dsh's order) and return the thresholds sorted
    /// ascending and the preview cap. The rules apply even when the guard is disabled, so
    /// turning it on later cannot reveal a bad section.
    pub fn validate(&self) -> Result<(Vec<u32>, usize), PipelineConfigError> {
        if self.thresholds.is_empty() {
            return Err(PipelineConfigError::EmptyThresholds);
        }
        let mut sorted = Vec::with_capacity(self.thresholds.len());
        for &value in &self.thresholds {
            if !is_integer(value) || value < 2.0 || value > f64::from(u32::MAX) {
                return Err(PipelineConfigError::InvalidThreshold { value });
            }
            sorted.push(value as u32);
        }
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(PipelineConfigError::DuplicateThresholds);
        }
        let value = self.arguments_preview_chars;
        if !is_integer(value) || value < 1.0 || value > f64::from(u32::MAX) {
            return Err(PipelineConfigError::InvalidPreviewChars { value });
        }
        Ok((sorted, value as usize))
    }
}

fn is_integer(v: f64) -> bool {
    v.is_finite() && v.fract() == 0.0
}
