//! Testbeds: where devices are and how fast the links between them are. A testbed is a TOML file
//! (`testbeds/*.toml`) naming sites (with the bandwidth and latency inside each), devices placed
//! at sites, and the links between sites. Emulation paces traffic to these figures; the scheduler
//! and simulator plan with them.

mod classes;

pub use classes::{DeviceCatalog, DeviceClass, DEVICE_CLASSES};

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TestbedError {
    #[error("{path}: {message}")]
    Read { path: String, message: String },
    #[error("testbed is not valid TOML: {0}")]
    Parse(String),
    #[error("testbed '{testbed}': {message}")]
    Invalid { testbed: String, message: String },
}

/// Bandwidth, one-way latency and packet loss of a link.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    pub bandwidth_mbps: f64,
    pub latency_ms: f64,
    /// Probability that a frame is lost (faithful emulation only; paced links are lossless).
    #[serde(default)]
    pub loss: f64,
}

impl LinkSpec {
    pub fn bytes_per_sec(&self) -> f64 {
        self.bandwidth_mbps * 1e6 / 8.0
    }
    pub fn latency(&self) -> Duration {
        Duration::from_secs_f64(self.latency_ms / 1e3)
    }
    /// Time to deliver `bytes`: serialisation at the link rate plus one-way latency.
    pub fn transfer_time(&self, bytes: usize) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec() + self.latency_ms / 1e3)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Site {
    pub name: String,
    /// The network inside the site (between its devices).
    pub internal: LinkSpec,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    pub name: String,
    pub site: String,
    /// Device class ("cpu", "rtx3090", "a100", ...), for planning with published speeds.
    #[serde(default = "cpu")]
    pub class: String,
    /// Emulation on a local cluster: the node standing for this device computes this many
    /// times slower than the machine it runs on (its training steps are stretched and its
    /// reported speed divided), so one machine can emulate devices of different speed.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub slowdown: f64,
    /// What stands between the device and the internet (a home router's NAT, a firewall): its
    /// node accepts no connections from its peers. Emulated on a local cluster: `--faithful`
    /// builds the router (nftables), the default paced mode refuses connections to the node.
    #[serde(default, skip_serializing_if = "Nat::is_none")]
    pub nat: Nat,
}

/// How a device is reachable from outside its home.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Nat {
    /// A public address that accepts connections.
    #[default]
    None,
    /// A public address behind a firewall that drops inbound connections.
    Firewall,
    /// A home router's NAT that keeps a connection's source port (endpoint-independent
    /// mapping) and lets in only replies from the address and port a connection went to (Linux
    /// masquerading, most home routers).
    PortRestricted,
    /// A NAT that maps every connection to a new random port (carrier-grade NAT, some
    /// corporate firewalls): a peer cannot predict the port.
    Symmetric,
}

impl Nat {
    pub fn is_none(&self) -> bool {
        *self == Nat::None
    }

    /// Whether the device's node accepts connections from its peers.
    pub fn accepts_connections(&self) -> bool {
        self.is_none()
    }

    pub const ALL: [Nat; 4] = [
        Nat::None,
        Nat::Firewall,
        Nat::PortRestricted,
        Nat::Symmetric,
    ];

    /// The name a testbed file uses.
    pub fn name(&self) -> &'static str {
        match self {
            Nat::None => "none",
            Nat::Firewall => "firewall",
            Nat::PortRestricted => "port-restricted",
            Nat::Symmetric => "symmetric",
        }
    }

    pub fn parse(s: &str) -> Result<Nat, String> {
        Nat::ALL.into_iter().find(|n| n.name() == s).ok_or_else(|| {
            format!("'{s}' is not a NAT kind (none, firewall, port-restricted, symmetric)")
        })
    }
}

fn cpu() -> String {
    "cpu".into()
}

fn one() -> f64 {
    1.0
}

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SiteLink {
    pub between: [String; 2],
    #[serde(flatten)]
    pub spec: LinkSpec,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Testbed {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(rename = "site")]
    pub sites: Vec<Site>,
    #[serde(rename = "device")]
    pub devices: Vec<Device>,
    #[serde(rename = "link", default)]
    pub links: Vec<SiteLink>,
}

impl Testbed {
    pub fn from_toml(text: &str) -> Result<Self, TestbedError> {
        let t: Testbed = toml::from_str(text).map_err(|e| TestbedError::Parse(e.to_string()))?;
        t.validate()?;
        Ok(t)
    }

    pub fn from_file(path: &Path) -> Result<Self, TestbedError> {
        let text = std::fs::read_to_string(path).map_err(|e| TestbedError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_toml(&text).map_err(|e| TestbedError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })
    }

    fn invalid(&self, message: String) -> TestbedError {
        TestbedError::Invalid {
            testbed: self.name.clone(),
            message,
        }
    }

    /// Checks names, references and figures; every pair of sites that hosts devices needs a link.
    pub fn validate(&self) -> Result<(), TestbedError> {
        let check = |what: &str, s: &LinkSpec| -> Result<(), TestbedError> {
            let ok = s.bandwidth_mbps.is_finite()
                && s.bandwidth_mbps > 0.0
                && s.latency_ms.is_finite()
                && s.latency_ms >= 0.0
                && (0.0..1.0).contains(&s.loss);
            if !ok {
                return Err(self.invalid(format!(
                    "{what}: bandwidth must be positive, latency non-negative and loss in [0, 1), got {s:?}"
                )));
            }
            Ok(())
        };
        let mut sites = HashMap::new();
        for s in &self.sites {
            if sites.insert(s.name.as_str(), s).is_some() {
                return Err(self.invalid(format!("duplicate site '{}'", s.name)));
            }
            check(&format!("site '{}'", s.name), &s.internal)?;
        }
        let mut devices = HashMap::new();
        for d in &self.devices {
            if devices.insert(d.name.as_str(), d).is_some() {
                return Err(self.invalid(format!("duplicate device '{}'", d.name)));
            }
            if !(d.slowdown.is_finite() && (1.0..=1000.0).contains(&d.slowdown)) {
                return Err(self.invalid(format!(
                    "device '{}': slowdown must be between 1 and 1000, got {}",
                    d.name, d.slowdown
                )));
            }
            if !sites.contains_key(d.site.as_str()) {
                return Err(self.invalid(format!(
                    "device '{}' is at unknown site '{}'",
                    d.name, d.site
                )));
            }
        }
        if self.devices.is_empty() {
            return Err(self.invalid("no devices".into()));
        }
        for l in &self.links {
            for s in &l.between {
                if !sites.contains_key(s.as_str()) {
                    return Err(self.invalid(format!("link names unknown site '{s}'")));
                }
            }
            if l.between[0] == l.between[1] {
                return Err(self.invalid(format!(
                    "link from site '{}' to itself (use the site's internal figures)",
                    l.between[0]
                )));
            }
            check(
                &format!("link {} - {}", l.between[0], l.between[1]),
                &l.spec,
            )?;
        }
        let used: Vec<&str> = self
            .sites
            .iter()
            .map(|s| s.name.as_str())
            .filter(|s| self.devices.iter().any(|d| d.site == *s))
            .collect();
        for (i, a) in used.iter().enumerate() {
            for b in &used[i + 1..] {
                if self.site_link(a, b).is_none() {
                    return Err(self.invalid(format!("no link between sites '{a}' and '{b}'")));
                }
            }
        }
        Ok(())
    }

    fn site_link(&self, a: &str, b: &str) -> Option<LinkSpec> {
        self.links
            .iter()
            .find(|l| {
                (l.between[0] == a && l.between[1] == b) || (l.between[0] == b && l.between[1] == a)
            })
            .map(|l| l.spec)
    }

    pub fn device(&self, name: &str) -> Option<&Device> {
        self.devices.iter().find(|d| d.name == name)
    }

    /// The link between two devices: their site's internal network, or the link between sites.
    pub fn link(&self, a: &str, b: &str) -> Option<LinkSpec> {
        let (da, db) = (self.device(a)?, self.device(b)?);
        if da.site == db.site {
            self.sites
                .iter()
                .find(|s| s.name == da.site)
                .map(|s| s.internal)
        } else {
            self.site_link(&da.site, &db.site)
        }
    }

    /// The slowest and fastest links between any two devices.
    pub fn bandwidth_range(&self) -> (f64, f64) {
        let mut lo = f64::INFINITY;
        let mut hi: f64 = 0.0;
        for (i, a) in self.devices.iter().enumerate() {
            for b in &self.devices[i + 1..] {
                if let Some(l) = self.link(&a.name, &b.name) {
                    lo = lo.min(l.bandwidth_mbps);
                    hi = hi.max(l.bandwidth_mbps);
                }
            }
        }
        (lo, hi)
    }
}
