//! Building and removing the emulated network with `ip` and `tc`.

use fusion_testbed::{Nat, Testbed};
use serde::Serialize;
use std::process::{Command, Stdio};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum NetemError {
    #[error("{0}")]
    Config(String),
    #[error("`{command}` failed: {message}")]
    Command { command: String, message: String },
}

type Result<T> = std::result::Result<T, NetemError>;

/// One device's namespace: where its node runs and the addresses it uses.
#[derive(Clone, Debug, Serialize)]
pub struct EmulatedDevice {
    pub name: String,
    pub namespace: String,
    /// The node's address: on the emulated links (peers reach it here), or, behind an emulated
    /// NAT, its private address in its home (nobody outside reaches it there).
    pub address: String,
    /// The address peers see its connections come from: `address`, or its router's.
    pub public_address: String,
    /// What stands between it and the other devices.
    pub nat: Nat,
    /// The root namespace's end of the device's unshaped control link (the broker listens there).
    pub broker_gateway: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct Emulation {
    pub prefix: String,
    pub devices: Vec<EmulatedDevice>,
    /// (device a, device b, bandwidth Mbit/s, one-way latency ms) of every emulated link.
    pub links: Vec<(String, String, f64, f64)>,
}

fn run(program: &str, args: &[String]) -> Result<String> {
    run_with(program, args, None)
}

/// Runs `program` with `input` on its standard input (none: an empty one).
fn run_with(program: &str, args: &[String], input: Option<&str>) -> Result<String> {
    use std::io::Write;
    let failed = |message: String| NetemError::Command {
        command: format!("{program} {}", args.join(" ")),
        message,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            failed(format!(
                "cannot run {program}: {e} (install iproute2, nftables)"
            ))
        })?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| failed(e.to_string()))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| failed(e.to_string()))?;
    if !out.status.success() {
        return Err(failed(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

fn ip(args: &str) -> Result<String> {
    run(
        "ip",
        &args
            .split_whitespace()
            .map(String::from)
            .collect::<Vec<_>>(),
    )
}

fn tc(args: &str) -> Result<String> {
    run(
        "tc",
        &args
            .split_whitespace()
            .map(String::from)
            .collect::<Vec<_>>(),
    )
}

fn device_address(i: usize) -> String {
    format!("10.201.{}.{}", i / 250, i % 250 + 1)
}

/// The private address of device `i` in its home (behind an emulated NAT) and its router's end.
fn home_addresses(i: usize) -> (String, String) {
    (format!("10.203.{i}.2"), format!("10.203.{i}.1"))
}

/// Loads `ruleset` into namespace `ns`'s nftables.
fn nft(ns: &str, ruleset: &str) -> Result<()> {
    let args = ["netns", "exec", ns, "nft", "-f", "-"].map(String::from);
    run_with("ip", &args, Some(ruleset)).map(|_| ())
}

/// A firewall that drops every connection from outside (`inside`: the interface whose
/// connections may start, besides the namespace's own), letting in only what belongs to
/// connections made from inside. Dropped, not refused: a dial times out, as at home.
fn firewall(inside: &str, forward: bool) -> String {
    let chain = |hook: &str| {
        format!(
            "  chain {hook} {{\n    type filter hook {hook} priority 0; policy drop;\n    ct state established,related accept\n    iif \"lo\" accept\n    iifname \"{inside}\" accept\n  }}\n"
        )
    };
    let mut rules = String::from("table inet fusionfw {\n");
    rules.push_str(&chain("input"));
    if forward {
        rules.push_str(&chain("forward"));
    }
    rules.push_str("}\n");
    rules
}

/// A home router's address translation: connections from the home leave with the router's
/// address, keeping their source port (port-restricted cone), or with a random port for every
/// connection (symmetric).
fn translation(home: &str, public: &str, nat: Nat) -> String {
    let random = if nat == Nat::Symmetric {
        " fully-random"
    } else {
        ""
    };
    format!(
        "table ip fusionnat {{\n  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    oifname != \"{home}\" snat to {public}{random}\n  }}\n}}\n"
    )
}

/// Puts device `i`'s namespace `ns` behind what `nat` says; returns the namespace its links
/// attach to (a router's, or its own) and the address its node listens on.
fn enclose(p: &str, i: usize, ns: &str, public: &str, nat: Nat) -> Result<(String, String)> {
    match nat {
        Nat::None => Ok((ns.to_string(), public.to_string())),
        Nat::Firewall => {
            nft(ns, &firewall("ctl", false))?;
            Ok((ns.to_string(), public.to_string()))
        }
        Nat::PortRestricted | Nat::Symmetric => {
            let router = format!("{p}-r{i}");
            let (private, gateway) = home_addresses(i);
            ip(&format!("netns add {router}"))?;
            ip(&format!("-n {router} link set dev lo up"))?;
            ip(&format!("-n {router} addr add {public}/32 dev lo"))?;
            ip(&format!(
                "-n {ns} link add lan type veth peer name home netns {router}"
            ))?;
            ip(&format!("-n {ns} addr add {private}/30 dev lan"))?;
            ip(&format!("-n {ns} link set dev lan up"))?;
            ip(&format!("-n {ns} route add default via {gateway}"))?;
            ip(&format!("-n {router} addr add {gateway}/30 dev home"))?;
            ip(&format!("-n {router} link set dev home up"))?;
            run(
                "ip",
                &[
                    "netns",
                    "exec",
                    &router,
                    "sysctl",
                    "-qw",
                    "net.ipv4.ip_forward=1",
                ]
                .map(String::from),
            )?;
            nft(&router, &translation("home", public, nat))?;
            nft(&router, &firewall("home", true))?;
            Ok((router, private))
        }
    }
}

/// Namespaces whose names start with `prefix-`.
fn namespaces_with(prefix: &str) -> Result<Vec<String>> {
    Ok(ip("netns list")?
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .map(String::from)
        .collect())
}

/// Stops every process in the namespaces of `prefix` (the relays, nodes left behind) and deletes
/// the namespaces, which removes their interfaces and the veth ends in the root namespace.
/// Returns how many namespaces it removed.
pub fn down(prefix: &str) -> Result<usize> {
    check_prefix(prefix)?;
    // Root-namespace ends of the control links (and temporaries of an interrupted `up`): delete
    // them explicitly. A namespace is only destroyed once nothing refers to it any more (a
    // socket lingering in TIME_WAIT is enough to delay that), and until then its veth peer would
    // keep an address a later emulation needs.
    for link in root_links_with(prefix)? {
        let _ = ip(&format!("link del dev {link}"));
    }
    let names = namespaces_with(prefix)?;
    for ns in &names {
        if let Ok(pids) = ip(&format!("netns pids {ns}")) {
            for pid in pids
                .split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok())
            {
                // SAFETY: sending a signal has no memory-safety preconditions.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
    let mut first_err = None;
    for ns in &names {
        if let Err(e) = ip(&format!("netns del {ns}")) {
            first_err.get_or_insert(e);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(names.len()),
    }
}

/// Root-namespace interfaces this module names for `prefix`: `{prefix}c{i}`, `{prefix}C{i}`,
/// `{prefix}{i}x{j}`, `{prefix}{i}y{j}`.
fn root_links_with(prefix: &str) -> Result<Vec<String>> {
    Ok(ip("-br link")?
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(|n| n.split('@').next().unwrap_or(n))
        .filter(|n| {
            n.strip_prefix(prefix).is_some_and(|rest| {
                let control = rest
                    .strip_prefix(['c', 'C'])
                    .is_some_and(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit()));
                let link = rest.split_once(['x', 'y']).is_some_and(|(a, b)| {
                    !a.is_empty()
                        && !b.is_empty()
                        && a.chars().chain(b.chars()).all(|c| c.is_ascii_digit())
                });
                control || link
            })
        })
        .map(String::from)
        .collect())
}

fn check_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty()
        || prefix.len() > 6
        || !prefix
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
    {
        return Err(NetemError::Config(format!(
            "emulation prefix '{prefix}' must be 1 to 6 lowercase letters or digits"
        )));
    }
    Ok(())
}

/// Builds the emulated network for the first `devices` devices of `tb` under `prefix`. `relay`
/// is the command that runs the delay bridge (`fusionllm testbed relay`); it gets
/// `--a IF --b IF --delay-ms D --loss P` appended and runs inside each link's namespace.
/// On any failure everything built so far is removed.
pub fn up(tb: &Testbed, devices: usize, prefix: &str, relay: &[String]) -> Result<Emulation> {
    check_prefix(prefix)?;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(NetemError::Config(
            "faithful emulation needs root (network namespaces and tc); the default paced mode does not".into(),
        ));
    }
    if devices < 2 || devices > tb.devices.len() || devices > 250 {
        return Err(NetemError::Config(format!(
            "testbed '{}' has {} devices; emulating {devices} is not possible (2 to 250)",
            tb.name,
            tb.devices.len()
        )));
    }
    if !namespaces_with(prefix)?.is_empty() {
        return Err(NetemError::Config(format!(
            "namespaces with prefix '{prefix}' exist already (remove them with `fusionllm testbed down --prefix {prefix}`)"
        )));
    }
    if ip("-br addr")?.contains(" 10.202.") {
        return Err(NetemError::Config(
            "another emulated network is up (its control links use 10.202.0.0/16); remove it with `fusionllm testbed down --prefix ...`".into(),
        ));
    }
    match build(tb, devices, prefix, relay) {
        Ok(e) => Ok(e),
        Err(e) => {
            let _ = down(prefix);
            Err(e)
        }
    }
}

fn build(tb: &Testbed, n: usize, p: &str, relay: &[String]) -> Result<Emulation> {
    let mut devices = Vec::new();
    // Where each device's links attach: its own namespace, or its home router's.
    let mut attach = Vec::new();
    for (i, d) in tb.devices.iter().take(n).enumerate() {
        let ns = format!("{p}-d{i}");
        let public = device_address(i);
        ip(&format!("netns add {ns}"))?;
        ip(&format!("-n {ns} link set dev lo up"))?;
        if !matches!(d.nat, Nat::PortRestricted | Nat::Symmetric) {
            ip(&format!("-n {ns} addr add {public}/32 dev lo"))?;
        }
        // The unshaped control link to the root namespace.
        ip(&format!("link add {p}c{i} type veth peer name {p}C{i}"))?;
        ip(&format!("link set dev {p}C{i} netns {ns}"))?;
        ip(&format!("-n {ns} link set dev {p}C{i} name ctl"))?;
        ip(&format!("addr add 10.202.{i}.1/30 dev {p}c{i}"))?;
        ip(&format!("link set dev {p}c{i} up"))?;
        ip(&format!("-n {ns} addr add 10.202.{i}.2/30 dev ctl"))?;
        ip(&format!("-n {ns} link set dev ctl up"))?;
        let (links_ns, address) = enclose(p, i, &ns, &public, d.nat)?;
        attach.push(links_ns);
        devices.push(EmulatedDevice {
            name: d.name.clone(),
            namespace: ns,
            address,
            public_address: public,
            nat: d.nat,
            broker_gateway: format!("10.202.{i}.1"),
        });
    }
    let mut links = Vec::new();
    for i in 0..n {
        for j in i + 1..n {
            let spec = tb.link(&devices[i].name, &devices[j].name).ok_or_else(|| {
                NetemError::Config(format!(
                    "testbed '{}' has no link between {} and {}",
                    tb.name, devices[i].name, devices[j].name
                ))
            })?;
            let lns = format!("{p}-l{i}-{j}");
            ip(&format!("netns add {lns}"))?;
            ip(&format!("-n {lns} link set dev lo up"))?;
            for (me, other, end) in [(i, j, "a"), (j, i, "b")] {
                let ns = &attach[me];
                ip(&format!(
                    "link add {p}{me}x{other} type veth peer name {p}{me}y{other}"
                ))?;
                ip(&format!("link set dev {p}{me}x{other} netns {ns}"))?;
                ip(&format!("link set dev {p}{me}y{other} netns {lns}"))?;
                ip(&format!(
                    "-n {ns} link set dev {p}{me}x{other} name to{other}"
                ))?;
                ip(&format!("-n {lns} link set dev {p}{me}y{other} name {end}"))?;
                // MTU-sized frames only: a packet socket cannot re-send a 64 KB GSO aggregate.
                ip(&format!("-n {ns} link set dev to{other} gso_max_size 1500"))?;
                ip(&format!("-n {ns} link set dev to{other} up"))?;
                ip(&format!("-n {lns} link set dev {end} up"))?;
                ip(&format!(
                    "-n {ns} route add {}/32 dev to{other} src {}",
                    devices[other].public_address, devices[me].public_address
                ))?;
                // Shape the sending side: the token bucket holds about 4 ms of data (at least
                // 10 frames), and queues up to twice the latency plus 50 ms.
                let rate_bytes = spec.bandwidth_mbps * 1e6 / 8.0;
                let burst = (rate_bytes / 250.0).max(15_140.0) as u64;
                let queue_ms = (2.0 * spec.latency_ms + 50.0).ceil() as u64;
                tc(&format!(
                    "-n {ns} qdisc add dev to{other} root tbf rate {}kbit burst {burst} latency {queue_ms}ms",
                    (spec.bandwidth_mbps * 1000.0).round() as u64
                ))?;
            }
            let mut args: Vec<String> = vec!["netns".into(), "exec".into(), lns.clone()];
            args.extend(relay.iter().cloned());
            args.extend(
                [
                    "--a",
                    "a",
                    "--b",
                    "b",
                    "--delay-ms",
                    &spec.latency_ms.to_string(),
                    "--loss",
                    &spec.loss.to_string(),
                ]
                .iter()
                .map(|s| s.to_string()),
            );
            Command::new("ip")
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| NetemError::Command {
                    command: format!("ip {}", args.join(" ")),
                    message: e.to_string(),
                })?;
            links.push((
                devices[i].name.clone(),
                devices[j].name.clone(),
                spec.bandwidth_mbps,
                spec.latency_ms,
            ));
        }
    }
    Ok(Emulation {
        prefix: p.to_string(),
        devices,
        links,
    })
}
