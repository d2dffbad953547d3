//! Egress rules of a sandbox with network: which networks its processes may connect to.
//! Written in the session's log header (a fork and a restarted daemon have the same) and
//! handed to the provider, which enforces them where the sandbox cannot change them, or
//! refuses the sandbox.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An IPv4 or IPv6 network in CIDR notation: `10.0.0.0/8`, `2001:db8::/32`; a bare
/// address is its `/32` (`/128`). Kept canonical: the host bits are cleared
/// (`10.1.2.3/8` is `10.0.0.0/8`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The network's first address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether it is an IPv4 network.
    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// Every address: `0.0.0.0/0` and `::/0`.
    pub fn everything() -> [Self; 2] {
        [
            Self {
                addr: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                prefix: 0,
            },
            Self {
                addr: IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
                prefix: 0,
            },
        ]
    }
}

/// Why a string is not a [`Cidr`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CidrError(pub String);

impl fmt::Display for CidrError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not an IP address or a network in CIDR notation",
            self.0
        )
    }
}

impl std::error::Error for CidrError {}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || CidrError(s.to_owned());
        let (a, p) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = a.parse().map_err(|_| bad())?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            // Digits only: `+8` and ` 8` are not prefixes.
            Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => {
                p.parse::<u8>().ok().filter(|n| *n <= max).ok_or_else(bad)?
            }
            Some(_) => return Err(bad()),
            None => max,
        };
        let addr = match addr {
            IpAddr::V4(v) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                IpAddr::V4((u32::from(v) & mask).into())
            }
            IpAddr::V6(v) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                IpAddr::V6((u128::from(v) & mask).into())
            }
        };
        Ok(Self { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl Serialize for Cidr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// What a sandbox's processes may connect to: a destination in `allow` is reached, one
/// in `deny` (and not in `allow`) is refused, any other is reached. Empty: no rules.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Egress {
    /// Reached even when `deny` names them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<Cidr>,
    /// Refused.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<Cidr>,
}

impl Egress {
    /// No rule at all.
    pub fn is_empty(&self) -> bool {
        self.allow.is_empty() && self.deny.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn networks_are_parsed_canonical_and_printed_back() {
        for (input, shown) in [
            ("10.0.0.0/8", "10.0.0.0/8"),
            ("10.1.2.3/8", "10.0.0.0/8"),
            ("8.8.8.8", "8.8.8.8/32"),
            ("0.0.0.0/0", "0.0.0.0/0"),
            ("2001:db8::1/32", "2001:db8::/32"),
            ("::1", "::1/128"),
            ("::/0", "::/0"),
        ] {
            let c: Cidr = input.parse().unwrap();
            assert_eq!(c.to_string(), shown, "{input}");
            assert_eq!(shown.parse::<Cidr>().unwrap(), c);
        }
        for bad in [
            "",
            "10.0.0.0/33",
            "::/129",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "example.com",
            "10.0.0/8",
            "10.0.0.0/8/8",
            " 10.0.0.0/8",
        ] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad:?}");
        }
        let e: Egress =
            serde_json::from_str(r#"{"allow":["1.2.3.4"],"deny":["0.0.0.0/0"]}"#).unwrap();
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"allow":["1.2.3.4/32"],"deny":["0.0.0.0/0"]}"#
        );
        assert!(serde_json::from_str::<Egress>(r#"{"deny":["nope"]}"#).is_err());
    }
}
