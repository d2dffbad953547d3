//! Runtime invariants: a safety net of named, module-owned checks.
//!
//! Each module of the daemon (`session`, `pipeline`, `lease`, ...) owns a few cheap checks of
//! properties its code is meant to guarantee by construction (a session log's seqs are
//! contiguous, a tool call has at most one result, ...). They run in production, enabled by
//! default, because a violated invariant found early costs an error, while one found late
//! costs a corrupted session. A violation is never silent: it is logged at `error` level with
//! the owning module and check name, counted, and returned to the caller as a [`Violation`]
//! (which the session log turns into `LogError::Invariant`, code `INVARIANT`).
//!
//! The set of checks is a static registry ([`CHECKS`]) so that configuration naming a module
//! that does not exist fails at load rather than silently disabling nothing.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

/// The modules that may own checks. A module may have no check registered yet.
pub const MODULES: &[&str] = &["session", "pipeline", "lease"];

/// One registered check: its owner, its name and what it asserts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    /// The owning module (one of [`MODULES`]).
    pub module: &'static str,
    /// The check's name, unique within its module.
    pub name: &'static str,
    /// What the check asserts, for operators reading a violation.
    pub asserts: &'static str,
}

/// Every registered check, by module.
pub const CHECKS: &[Check] = &[
    Check {
        module: "session",
        name: "seq_contiguous",
        asserts: "event seqs start at 0 and are contiguous, in file order",
    },
    Check {
        module: "session",
        name: "call_id_unique",
        asserts: "a call id is announced and logged as a tool/call at most once",
    },
    Check {
        module: "session",
        name: "tool_call_single_result",
        asserts: "a tool call has at most one tool/result",
    },
    Check {
        module: "session",
        name: "tool_result_cites_call",
        asserts: "every tool/result answers a logged tool/call or an announced call id",
    },
    Check {
        module: "session",
        name: "turn_enclosure",
        asserts: "turns do not nest, and a turn/end closes the open turn",
    },
    Check {
        module: "session",
        name: "derived_history_matches_disk",
        asserts: "the derived model history equals the projection of the log read back from disk",
    },
    Check {
        module: "lease",
        name: "sandbox_owned_once",
        asserts: "a sandbox belongs to exactly one live session",
    },
];

/// The `[invariants]` section of the daemon's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InvariantsConfig {
    /// Run the checks at all. Default: true.
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    /// Restrict the checks to these modules (names from [`MODULES`]). Default: every module.
    #[serde(default)]
    pub modules: Option<Vec<String>>,
}

fn default_enabled() -> bool {
    true
}

impl Default for InvariantsConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            modules: None,
        }
    }
}

/// A configuration that names an unknown module.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invariants: unknown module {module:?} (known: {known})")]
pub struct InvariantsConfigError {
    /// The unknown name.
    pub module: String,
    /// The known names, comma-separated.
    pub known: String,
}

/// A violated invariant, attributed to its module and check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invariant {module}/{check} violated: {message}")]
pub struct Violation {
    /// The owning module.
    pub module: &'static str,
    /// The check's name.
    pub check: &'static str,
    /// What was found.
    pub message: String,
}

/// The runtime-invariant switchboard: which modules' checks run, and how many failed.
///
/// Cheap to clone (shared state); one instance is built from the configuration at start-up
/// and handed to every module.
#[derive(Debug, Clone)]
pub struct Invariants {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    enabled: bool,
    /// `None`: every module.
    modules: Option<BTreeSet<String>>,
    violations: AtomicU64,
}

// === impl Invariants ===

impl InvariantsConfig {
    /// Refuse a module name that owns no checks and never will (a typo would otherwise
    /// silently disable a module's checks). Run at configuration load.
    pub fn validate(&self) -> Result<(), InvariantsConfigError> {
        for m in self.modules.iter().flatten() {
            if !MODULES.contains(&m.as_str()) {
                return Err(InvariantsConfigError {
                    module: m.clone(),
                    known: MODULES.join(", "),
                });
            }
        }
        Ok(())
    }
}

impl Invariants {
    /// Build from configuration; an unknown module name is refused.
    pub fn new(cfg: &InvariantsConfig) -> Result<Self, InvariantsConfigError> {
        cfg.validate()?;
        Ok(Self::from_parts(
            cfg.enabled,
            cfg.modules.as_ref().map(|l| l.iter().cloned().collect()),
        ))
    }

    /// Every check disabled (for measurements; never the default).
    pub fn disabled() -> Self {
        Self::from_parts(false, None)
    }

    fn from_parts(enabled: bool, modules: Option<BTreeSet<String>>) -> Self {
        Self {
            inner: Arc::new(Inner {
                enabled,
                modules,
                violations: AtomicU64::new(0),
            }),
        }
    }

    /// Whether the checks of `module` run.
    pub fn is_enabled(&self, module: &str) -> bool {
        self.inner.enabled
            && self
                .inner
                .modules
                .as_ref()
                .is_none_or(|m| m.contains(module))
    }

    /// Run the check `module`/`name` (registered in [`CHECKS`]) if its module is enabled.
    /// `f` returns `Err(what was found)` on a violation, which is logged loudly, counted
    /// and returned attributed to its module and check.
    pub fn check<F>(&self, module: &'static str, name: &'static str, f: F) -> Result<(), Violation>
    where
        F: FnOnce() -> Result<(), String>,
    {
        if !self.is_enabled(module) {
            return Ok(());
        }
        f().map_err(|message| self.violated(module, name, message))
    }

    /// Record a violation found outside [`Invariants::check`] (e.g. by a check that needs
    /// `async` work). Logs and counts it even if the module is disabled: the caller
    /// decided it ran.
    pub fn violated(
        &self,
        module: &'static str,
        check: &'static str,
        message: String,
    ) -> Violation {
        self.inner.violations.fetch_add(1, Ordering::Relaxed);
        tracing::error!(module, check, violation = %message, "Runtime invariant violated");
        Violation {
            module,
            check,
            message,
        }
    }

    /// How many violations were found since start-up.
    pub fn violations(&self) -> u64 {
        self.inner.violations.load(Ordering::Relaxed)
    }
}

impl Default for Invariants {
    /// Every module's checks enabled.
    fn default() -> Self {
        Self::from_parts(true, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_enables_every_module() {
        let cfg: InvariantsConfig = toml::from_str("").unwrap();
        assert_eq!(cfg, InvariantsConfig::default());
        let inv = Invariants::new(&cfg).unwrap();
        for m in MODULES {
            assert!(inv.is_enabled(m));
        }
    }

    #[test]
    fn config_selects_modules_and_refuses_unknown_ones() {
        let cfg: InvariantsConfig = toml::from_str(r#"modules = ["session"]"#).unwrap();
        let inv = Invariants::new(&cfg).unwrap();
        assert!(inv.is_enabled("session"));
        assert!(!inv.is_enabled("lease"));

        let bad: InvariantsConfig = toml::from_str(r#"modules = ["sesion"]"#).unwrap();
        assert_eq!(bad.validate().unwrap_err().module, "sesion");
        assert_eq!(Invariants::new(&bad).unwrap_err().module, "sesion");

        assert!(toml::from_str::<InvariantsConfig>("enabeld = false").is_err());
        let off: InvariantsConfig = toml::from_str("enabled = false").unwrap();
        assert!(!Invariants::new(&off).unwrap().is_enabled("session"));
    }

    #[test]
    fn violation_is_attributed_counted_and_skipped_when_disabled() {
        let inv = Invariants::default();
        assert!(inv.check("session", "seq_contiguous", || Ok(())).is_ok());
        let v = inv
            .check("session", "seq_contiguous", || Err("gap at 3".into()))
            .unwrap_err();
        assert_eq!(
            (v.module, v.check, v.message.as_str()),
            ("session", "seq_contiguous", "gap at 3")
        );
        assert_eq!(inv.violations(), 1);

        let other = Invariants::new(&InvariantsConfig {
            enabled: true,
            modules: Some(vec!["lease".into()]),
        })
        .unwrap();
        let mut ran = false;
        let outcome = other.check("session", "seq_contiguous", || {
            ran = true;
            Err("x".into())
        });
        assert!(outcome.is_ok());
        assert!(!ran, "a disabled module's check must not run");
        assert_eq!(other.violations(), 0);
    }

    #[test]
    fn registry_names_are_unique_and_owned_by_known_modules() {
        let mut seen = BTreeSet::new();
        for c in CHECKS {
            assert!(MODULES.contains(&c.module), "{}", c.module);
            assert!(
                seen.insert((c.module, c.name)),
                "duplicate {}/{}",
                c.module,
                c.name
            );
        }
    }
}
