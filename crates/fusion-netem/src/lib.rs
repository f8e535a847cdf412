//! Faithful emulation of a testbed's links with the kernel's own network stack (needs root).
//!
//! Every device gets a network namespace with its own address. Every pair of devices is joined by
//! a point-to-point path `device A ─veth─ [link namespace] ─veth─ device B`: `tc tbf` on each
//! device's side shapes the sending rate to the link's bandwidth, and a relay process in the link
//! namespace (an AF_PACKET bridge between its two veths) holds each frame for the link's one-way
//! latency and drops frames with the link's loss probability. The kernel here has no `netem`, so
//! the delay lives in user space. Each device also has an unshaped control link to the root
//! namespace, where the broker listens.
//!
//! Namespaces carry a unique prefix; `down` removes every namespace with the prefix and stops its
//! relays, and `up` calls it itself when any step fails.

mod netns;
mod relay;

pub use netns::{down, up, EmulatedDevice, Emulation, NetemError};
pub use relay::{fix_checksums, run_relay};
