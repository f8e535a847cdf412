//! Device classes: published speed and memory of the kinds of machines a testbed may contain
//! (`testbeds/device-classes.toml`), so the planner and simulator can reason about GPUs this
//! machine does not have. Measured figures from a node's profiling replace them at run time.

use crate::{Testbed, TestbedError};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// The built-in catalog.
pub const DEVICE_CLASSES: &str = include_str!("../../../testbeds/device-classes.toml");

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceClass {
    pub name: String,
    /// "cpu" or "gpu".
    pub kind: String,
    pub fp32_tflops: f64,
    pub fp16_tflops: f64,
    pub memory_gib: f64,
    pub memory_bandwidth_gbs: f64,
}

impl DeviceClass {
    /// Memory in bytes.
    pub fn memory_bytes(&self) -> f64 {
        self.memory_gib * (1u64 << 30) as f64
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceCatalog {
    #[serde(rename = "class")]
    pub classes: Vec<DeviceClass>,
}

impl DeviceCatalog {
    /// The catalog shipped with fusionllm.
    pub fn builtin() -> Result<Self, TestbedError> {
        Self::from_toml(DEVICE_CLASSES)
    }

    pub fn from_toml(text: &str) -> Result<Self, TestbedError> {
        let c: DeviceCatalog =
            toml::from_str(text).map_err(|e| TestbedError::Parse(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), TestbedError> {
        let bad = |message: String| TestbedError::Invalid {
            testbed: "device classes".into(),
            message,
        };
        let mut seen = HashSet::new();
        for c in &self.classes {
            if !seen.insert(c.name.as_str()) {
                return Err(bad(format!("duplicate class '{}'", c.name)));
            }
            if c.kind != "cpu" && c.kind != "gpu" {
                return Err(bad(format!("class '{}': kind must be cpu or gpu", c.name)));
            }
            let figures = [
                c.fp32_tflops,
                c.fp16_tflops,
                c.memory_gib,
                c.memory_bandwidth_gbs,
            ];
            if !figures.iter().all(|v| v.is_finite() && *v > 0.0) {
                return Err(bad(format!(
                    "class '{}': every figure must be positive",
                    c.name
                )));
            }
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&DeviceClass> {
        self.classes.iter().find(|c| c.name == name)
    }

    /// Checks that every device of `tb` names a class of this catalog.
    pub fn check(&self, tb: &Testbed) -> Result<(), TestbedError> {
        for d in &tb.devices {
            if self.get(&d.class).is_none() {
                let known: Vec<&str> = self.classes.iter().map(|c| c.name.as_str()).collect();
                return Err(TestbedError::Invalid {
                    testbed: tb.name.clone(),
                    message: format!(
                        "device '{}' has unknown class '{}' (known: {})",
                        d.name,
                        d.class,
                        known.join(", ")
                    ),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_catalog_has_the_gpu_generations_and_checks_testbeds() {
        let c = DeviceCatalog::builtin().expect("catalog");
        for name in [
            "cpu", "rtx3080", "rtx3090", "rtx4090", "v100", "a100", "h100",
        ] {
            assert!(c.get(name).is_some(), "{name}");
        }
        let a100 = c.get("a100").expect("a100");
        assert_eq!(a100.memory_bytes(), 80.0 * 1073741824.0);
        assert!(c.get("h100").expect("h100").fp16_tflops > a100.fp16_tflops);
        let tb = Testbed::from_toml(include_str!("../../../testbeds/default.toml")).expect("tb");
        c.check(&tb).expect("default testbed devices are cpus");
        let mut odd = tb.clone();
        odd.devices[0].class = "tpu9".into();
        let err = c.check(&odd).expect_err("unknown class");
        assert!(err.to_string().contains("unknown class 'tpu9'"), "{err}");
    }

    #[test]
    fn bad_catalogs_say_why() {
        let dup = format!("{DEVICE_CLASSES}\n[[class]]\nname = \"a100\"\nkind = \"gpu\"\nfp32_tflops = 1\nfp16_tflops = 1\nmemory_gib = 1\nmemory_bandwidth_gbs = 1\n");
        assert!(DeviceCatalog::from_toml(&dup)
            .unwrap_err()
            .to_string()
            .contains("duplicate class 'a100'"));
        let neg = DEVICE_CLASSES.replace("fp32_tflops = 19.5", "fp32_tflops = -19.5");
        assert!(DeviceCatalog::from_toml(&neg)
            .unwrap_err()
            .to_string()
            .contains("positive"));
    }
}
