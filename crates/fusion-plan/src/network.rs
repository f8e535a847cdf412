//! The devices a plan may use and the links between every pair of them.

use crate::error::PlanError;
use fusion_estimate::DeviceProfile;
use fusion_testbed::{DeviceCatalog, Testbed};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Network {
    pub devices: Vec<DeviceProfile>,
    /// Bytes per second from device `i` to device `j` (infinite on the diagonal).
    pub bandwidth: Vec<Vec<f64>>,
    /// One-way latency in seconds.
    pub latency: Vec<Vec<f64>>,
}

impl Network {
    /// Devices of `tb` at the published speed of their class.
    pub fn from_testbed(tb: &Testbed, catalog: &DeviceCatalog) -> Result<Self, PlanError> {
        catalog.check(tb)?;
        let profiles = tb
            .devices
            .iter()
            .map(|d| {
                catalog
                    .get(&d.class)
                    .map(|c| DeviceProfile::from_class(&d.name, c))
                    .ok_or_else(|| PlanError::Invalid(format!("unknown class '{}'", d.class)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::with_profiles(tb, profiles)
    }

    /// Devices of `tb` with the given profiles (one per device, in the testbed's order), e.g.
    /// measured ones.
    pub fn with_profiles(tb: &Testbed, devices: Vec<DeviceProfile>) -> Result<Self, PlanError> {
        if devices.len() != tb.devices.len() {
            return Err(PlanError::Invalid(format!(
                "{} profiles for {} devices",
                devices.len(),
                tb.devices.len()
            )));
        }
        let n = devices.len();
        let mut bandwidth = vec![vec![f64::INFINITY; n]; n];
        let mut latency = vec![vec![0.0; n]; n];
        for i in 0..n {
            for j in 0..n {
                if i == j {
                    continue;
                }
                let l = tb
                    .link(&tb.devices[i].name, &tb.devices[j].name)
                    .ok_or_else(|| {
                        PlanError::Invalid(format!(
                            "no link between '{}' and '{}'",
                            tb.devices[i].name, tb.devices[j].name
                        ))
                    })?;
                bandwidth[i][j] = l.bytes_per_sec();
                latency[i][j] = l.latency_ms / 1e3;
            }
        }
        let net = Network {
            devices,
            bandwidth,
            latency,
        };
        net.validate()?;
        Ok(net)
    }

    pub fn validate(&self) -> Result<(), PlanError> {
        let n = self.devices.len();
        if n == 0 {
            return Err(PlanError::Invalid("no devices".into()));
        }
        if self.bandwidth.len() != n
            || self.latency.len() != n
            || self
                .bandwidth
                .iter()
                .chain(&self.latency)
                .any(|r| r.len() != n)
        {
            return Err(PlanError::Invalid(format!(
                "link matrices must be {n} x {n}"
            )));
        }
        for d in &self.devices {
            d.validate()
                .map_err(|e| PlanError::Invalid(e.to_string()))?;
        }
        for i in 0..n {
            for j in 0..n {
                if i != j && !(self.bandwidth[i][j] > 0.0 && self.latency[i][j] >= 0.0) {
                    return Err(PlanError::Invalid(format!(
                        "link {i} -> {j} needs positive bandwidth and non-negative latency"
                    )));
                }
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}
