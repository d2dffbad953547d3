//! The provider registry: named providers built from the config by one factory.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use tether_provider::Provider;

use crate::config::{Config, ProviderConfig};
use crate::error::{DaemonError, Result};

/// Providers by name, plus the default.
#[derive(Debug)]
pub struct ProviderRegistry {
    providers: BTreeMap<String, Arc<dyn Provider>>,
    default: String,
}

impl ProviderRegistry {
    /// Build every configured provider; `local` is always present, and `e2b` when the
    /// process environment names an E2B backend.
    pub fn from_config(cfg: &Config) -> Result<Self> {
        Self::from_config_with_env(cfg, &|name| std::env::var(name).ok())
    }

    /// [`Self::from_config`] with the environment read through `env` (tests pass their own).
    pub fn from_config_with_env(
        cfg: &Config,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        let mut providers: BTreeMap<String, Arc<dyn Provider>> = BTreeMap::new();
        let own = cfg.server.listen;
        for (name, pc) in &cfg.providers {
            if let ProviderConfig::E2b(c) = pc
                && aims_at_self(&c.clone().with_env(env), own)
            {
                return Err(DaemonError::invalid(format!(
                    "provider {name}: its E2B endpoints are this daemon's own listener {own}; a daemon is never its own E2B backend"
                )));
            }
            providers.insert(
                name.clone(),
                build_with_env(pc, &cfg.server.state_dir, name, env)?,
            );
        }
        // === e2b from the environment ===
        // Like the E2B SDKs: an API key or an API URL in the environment names a backend.
        let named = |k: &str| env(k).is_some_and(|v| !v.trim().is_empty());
        if !providers.contains_key("e2b")
            && (named(tether_provider_e2b::config::ENV_API_KEY)
                || named(tether_provider_e2b::config::ENV_API_URL))
        {
            let c = tether_provider_e2b::E2bConfig::default();
            if aims_at_self(&c.clone().with_env(env), own) {
                // The shell that started tetherd has the variables its own banner prints.
                tracing::warn!(
                    listen = %own,
                    "E2B_* variables point at this daemon's own E2B front; no e2b provider is built from them (a daemon is never its own E2B backend)"
                );
            } else {
                let pc = ProviderConfig::E2b(c);
                providers.insert(
                    "e2b".into(),
                    build_with_env(&pc, &cfg.server.state_dir, "e2b", env)?,
                );
            }
        }
        if !providers.contains_key("local") {
            let pc = ProviderConfig::Local(tether_provider_local::LocalConfig::default());
            providers.insert("local".into(), build(&pc, &cfg.server.state_dir, "local")?);
        }
        if !providers.contains_key(&cfg.default_provider) {
            return Err(DaemonError::invalid(format!(
                "default_provider {:?} is not available: configure [providers.{}] (or, for e2b, set E2B_API_KEY or E2B_API_URL)",
                cfg.default_provider, cfg.default_provider
            )));
        }
        Ok(Self {
            providers,
            default: cfg.default_provider.clone(),
        })
    }

    /// A registry over given providers (tests, benches).
    pub fn from_providers(providers: BTreeMap<String, Arc<dyn Provider>>, default: &str) -> Self {
        Self {
            providers,
            default: default.to_owned(),
        }
    }

    /// A provider by name.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Provider>> {
        self.providers.get(name).cloned()
    }

    /// The default provider's name.
    pub fn default_name(&self) -> &str {
        &self.default
    }

    /// Names.
    pub fn names(&self) -> Vec<String> {
        self.providers.keys().cloned().collect()
    }

    /// Every provider.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Arc<dyn Provider>)> {
        self.providers.iter()
    }
}

/// Whether an E2B backend's control plane or envd is `own`, this daemon's listener: the
/// same port on a loopback host, `localhost`, or the listener's own address. A daemon that
/// were its own backend would call itself for every sandbox (and stall its start-up on
/// its own healthcheck). Endpoints that do not resolve are left to the provider to refuse.
fn aims_at_self(c: &tether_provider_e2b::E2bConfig, own: std::net::SocketAddr) -> bool {
    let Ok(ep) = c.validate() else {
        return false;
    };
    let is_own = |u: &reqwest::Url| {
        if u.port_or_known_default() != Some(own.port()) {
            return false;
        }
        let host = u.host_str().unwrap_or("");
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.eq_ignore_ascii_case("localhost") {
            return true;
        }
        host.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback() || ip == own.ip() || own.ip().is_unspecified())
    };
    is_own(&ep.api) || ep.sandbox_url.as_ref().is_some_and(is_own)
}

/// The one factory: a provider from its config section.
pub fn build(cfg: &ProviderConfig, state_dir: &Path, name: &str) -> Result<Arc<dyn Provider>> {
    build_with_env(cfg, state_dir, name, &|k| std::env::var(k).ok())
}

/// [`build`] with the environment read through `env`.
pub fn build_with_env(
    cfg: &ProviderConfig,
    state_dir: &Path,
    name: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Arc<dyn Provider>> {
    match cfg {
        ProviderConfig::Local(c) => {
            let mut c = c.clone();
            if c.root.as_os_str().is_empty() {
                c.root = state_dir.join("sandboxes").join(name);
            }
            let p = tether_provider_local::LocalProvider::new(c)
                .map_err(|e| DaemonError::internal(format!("provider {name}: {e}")))?;
            Ok(Arc::new(p))
        }
        ProviderConfig::E2b(c) => {
            let p = tether_provider_e2b::E2bProvider::new(c.clone().with_env(env))
                .map_err(|e| DaemonError::internal(format!("provider {name}: {e}")))?;
            Ok(Arc::new(p))
        }
        ProviderConfig::Ssh(c) => {
            let p = tether_provider_ssh::SshProvider::new(c.clone())
                .map_err(|e| DaemonError::invalid(format!("provider {name}: {e}")))?;
            Ok(Arc::new(p))
        }
        ProviderConfig::Microvm(c) => {
            let mut c = c.clone();
            if c.root.as_os_str().is_empty() {
                c.root = state_dir.join("sandboxes").join(name);
            }
            if c.base_template.is_none() {
                c.base_template = Some(state_dir.join("sandboxes/local-templates/base"));
            }
            let p = tether_provider_microvm::MicrovmProvider::new(c)
                .map_err(|e| DaemonError::invalid(format!("provider {name}: {e}")))?;
            Ok(Arc::new(p))
        }
    }
}

#[cfg(test)]
mod e2b_env_tests {
    use super::*;

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn e2b_is_registered_from_the_environment_only_when_it_names_a_backend() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.server.state_dir = dir.path().to_owned();
        let none =
            ProviderRegistry::from_config_with_env(&cfg, &env_of(&[("E2B_DOMAIN", "example.org")]))
                .unwrap();
        assert!(none.get("e2b").is_none());
        let with_key =
            ProviderRegistry::from_config_with_env(&cfg, &env_of(&[("E2B_API_KEY", "e2b_x")]))
                .unwrap();
        assert_eq!(with_key.get("e2b").map(|p| p.kind()), Some("e2b"));
        let with_url = ProviderRegistry::from_config_with_env(
            &cfg,
            &env_of(&[("E2B_API_URL", "http://127.0.0.1:9")]),
        )
        .unwrap();
        assert_eq!(with_url.get("e2b").map(|p| p.kind()), Some("e2b"));
        // A configured `e2b` section wins over the environment.
        let toml = "[providers.e2b]\nkind = \"e2b\"\napi_url = \"http://127.0.0.1:1\"\ninherit_env = false\n\n[providers.other]\nkind = \"e2b\"\napi_url = \"http://127.0.0.1:2\"\n";
        let mut cfg2 = Config::from_toml_str(toml).unwrap();
        cfg2.server.state_dir = dir.path().to_owned();
        let r = ProviderRegistry::from_config_with_env(&cfg2, &env_of(&[("E2B_API_KEY", "e2b_x")]))
            .unwrap();
        assert!(r.get("e2b").is_some() && r.get("other").is_some() && r.get("local").is_some());
        // A malformed URL in the environment is refused loudly.
        assert!(
            ProviderRegistry::from_config_with_env(&cfg, &env_of(&[("E2B_API_URL", "not a url")]))
                .is_err()
        );
    }

    #[test]
    fn a_daemon_is_never_its_own_e2b_backend() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::default();
        cfg.server.state_dir = dir.path().to_owned();
        cfg.server.listen = "127.0.0.1:7420".parse().unwrap();
        // The banner's variables, in the shell that started the daemon: no e2b provider.
        for env in [
            &[
                ("E2B_API_URL", "http://127.0.0.1:7420"),
                ("E2B_SANDBOX_URL", "http://127.0.0.1:7420"),
                ("E2B_API_KEY", "e2b_dev"),
            ][..],
            &[("E2B_API_URL", "http://localhost:7420/")][..],
            &[
                ("E2B_API_KEY", "e2b_dev"),
                ("E2B_SANDBOX_URL", "http://127.0.0.1:7420"),
            ][..],
        ] {
            let pairs: Vec<(String, String)> = env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            let lookup = move |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
            let r = ProviderRegistry::from_config_with_env(&cfg, &lookup).unwrap();
            assert!(
                r.get("e2b").is_none(),
                "{env:?} built an e2b provider aimed at itself"
            );
            assert!(r.get("local").is_some());
        }
        // Another port of the same host is another daemon.
        let other = ProviderRegistry::from_config_with_env(
            &cfg,
            &env_of(&[("E2B_API_URL", "http://127.0.0.1:7421")]),
        )
        .unwrap();
        assert!(other.get("e2b").is_some());
        // A configured section aimed at the daemon itself is refused at start.
        let toml = "[providers.mirror]\nkind = \"e2b\"\napi_url = \"http://127.0.0.1:7420\"\ninherit_env = false\n";
        let mut cfg2 = Config::from_toml_str(toml).unwrap();
        cfg2.server.state_dir = dir.path().to_owned();
        cfg2.server.listen = "0.0.0.0:7420".parse().unwrap();
        let e = ProviderRegistry::from_config_with_env(&cfg2, &env_of(&[])).unwrap_err();
        assert_eq!(e.code(), tether_protocol::ErrorCode::InvalidRequest);
    }

    #[test]
    fn e2b_as_default_provider_needs_a_backend() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = Config::from_toml_str("default_provider = \"e2b\"").unwrap();
        cfg.server.state_dir = dir.path().to_owned();
        let e = ProviderRegistry::from_config_with_env(&cfg, &env_of(&[])).unwrap_err();
        assert_eq!(e.code(), tether_protocol::ErrorCode::InvalidRequest);
        let r = ProviderRegistry::from_config_with_env(&cfg, &env_of(&[("E2B_API_KEY", "e2b_x")]))
            .unwrap();
        assert_eq!(r.default_name(), "e2b");
        assert!(Config::from_toml_str("default_provider = \"nope\"").is_err());
    }

    #[test]
    fn a_microvm_section_builds_the_microvm_provider_under_the_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let toml =
            "default_provider = \"vm\"\n\n[providers.vm]\nkind = \"microvm\"\nmemory_mib = 256\n";
        let mut cfg = Config::from_toml_str(toml).unwrap();
        cfg.server.state_dir = dir.path().to_owned();
        let r = ProviderRegistry::from_config_with_env(&cfg, &env_of(&[])).unwrap();
        assert_eq!(r.get("vm").map(|p| p.kind()), Some("microvm"));
        assert!(dir.path().join("sandboxes/vm/vms").is_dir());
        assert!(Config::from_toml_str("[providers.vm]\nkind = \"microvm\"\nmemory = 1\n").is_err());
    }
}
