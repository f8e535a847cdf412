//! Random planning instances for measuring schedulers against the exact optimum: chains of
//! operators with skip connections, devices of widely different speed, and links drawn
//! log-uniformly between 8 Mbit/s and 10 Gbit/s, so that some instances are bound by compute,
//! some by links, and most by both.

use crate::network::Network;
use fusion_estimate::{DeviceProfile, OpKind, OpWorkload, ProfileSource, TensorFlow, Workload};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// One random instance.
pub struct Instance {
    pub workload: Workload,
    pub network: Network,
    pub micro_batches: usize,
}

fn log_uniform(rng: &mut ChaCha8Rng, lo: f64, hi: f64) -> f64 {
    (rng.random_range(lo.ln()..hi.ln())).exp()
}

/// Instance number `seed`, with up to `max_devices` devices and `max_ops` operators.
pub fn instance(seed: u64, max_devices: usize, max_ops: usize) -> Instance {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = rng.random_range(8.max(max_ops / 4)..=max_ops.max(8));
    let d = rng.random_range(2..=max_devices.max(2));
    let ops: Vec<OpWorkload> = (0..n)
        .map(|i| {
            let dense = rng.random_bool(0.6);
            let flops = log_uniform(&mut rng, 2e10, 2e12);
            let bytes = log_uniform(&mut rng, 1e7, 1e9);
            let params = rng.random_range(0..20_000_000usize);
            OpWorkload {
                name: format!("op{i}"),
                op: if dense { "dense" } else { "elementwise" }.into(),
                kind: if dense { OpKind::Dense } else { OpKind::Memory },
                fwd_flops: flops,
                bwd_flops: 2.0 * flops,
                fwd_bytes: bytes,
                bwd_bytes: 2.0 * bytes,
                params,
                param_bytes: 4.0 * params as f64,
                grad_bytes: 4.0 * params as f64,
                optimizer_bytes: 8.0 * params as f64,
                activation_bytes: log_uniform(&mut rng, 1e6, 1e8),
            }
        })
        .collect();
    let mut flows = Vec::new();
    for i in 0..n - 1 {
        let mut consumers = vec![i + 1];
        // A skip connection to a later operator (a residual edge), sometimes.
        if rng.random_bool(0.3) && i + 2 < n {
            consumers.push(rng.random_range(i + 2..n.min(i + 7)));
        }
        flows.push(TensorFlow {
            name: format!("t{i}"),
            bytes: log_uniform(&mut rng, 2e5, 2e7),
            producer: i,
            consumers,
        });
    }
    let workload = Workload::from_parts(&format!("random-{seed}"), ops, flows);
    let devices = (0..d)
        .map(|k| {
            let speed = log_uniform(&mut rng, 2e12, 1e14);
            DeviceProfile {
                name: format!("dev{k}"),
                class: "random".into(),
                dense_flops_per_s: speed,
                memory_bytes_per_s: speed / log_uniform(&mut rng, 20.0, 100.0),
                memory_capacity_bytes: 80e9,
                calibration: 1.0,
                op_overhead_s: 0.0,
                source: ProfileSource::Class,
            }
        })
        .collect();
    let mut bandwidth = vec![vec![f64::INFINITY; d]; d];
    let mut latency = vec![vec![0.0; d]; d];
    for a in 0..d {
        for b in a + 1..d {
            let bw = log_uniform(&mut rng, 8e6, 1e10) / 8.0;
            let lat = log_uniform(&mut rng, 1e-4, 0.1);
            (bandwidth[a][b], bandwidth[b][a]) = (bw, bw);
            (latency[a][b], latency[b][a]) = (lat, lat);
        }
    }
    Instance {
        workload,
        network: Network {
            devices,
            bandwidth,
            latency,
        },
        micro_batches: [4, 8, 16][rng.random_range(0..3)],
    }
}
