//! `fusionllm testbed up|down|relay|probe`: faithful link emulation with network namespaces.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use fusion_testbed::Testbed;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Subcommand)]
pub enum TestbedAction {
    /// Create a network namespace per device with shaped, delayed links between them (root).
    Up {
        /// Testbed file (default: the built-in two-site testbed).
        file: Option<PathBuf>,
        /// Emulate only the first N devices.
        #[arg(long)]
        nodes: Option<usize>,
        /// Name prefix of the namespaces (1-6 lowercase letters or digits).
        #[arg(long, default_value = "fl")]
        prefix: String,
    },
    /// Remove the namespaces (and their processes) of a prefix.
    Down {
        #[arg(long, default_value = "fl")]
        prefix: String,
    },
    /// The delay and loss bridge of one link (started by `up` inside the link's namespace).
    #[command(hide = true)]
    Relay(RelayArgs),
    /// Measure one emulated link: `--listen ADDR` in one namespace, `--connect ADDR` in another.
    #[command(hide = true)]
    Probe(ProbeArgs),
}

#[derive(Args)]
pub struct RelayArgs {
    #[arg(long)]
    a: String,
    #[arg(long)]
    b: String,
    #[arg(long)]
    delay_ms: f64,
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
}

#[derive(Args)]
pub struct ProbeArgs {
    #[arg(long)]
    listen: Option<SocketAddr>,
    #[arg(long)]
    connect: Option<SocketAddr>,
    /// Bytes the client sends.
    #[arg(long, default_value_t = 4 << 20)]
    bytes: usize,
}

pub fn relay_command() -> Result<Vec<String>> {
    let exe = std::env::current_exe().context("locating the fusionllm binary")?;
    Ok(vec![
        exe.display().to_string(),
        "testbed".into(),
        "relay".into(),
    ])
}

pub fn load(file: Option<&PathBuf>) -> Result<Testbed> {
    Ok(match file {
        Some(p) => Testbed::from_file(p)?,
        None => Testbed::from_toml(crate::cluster::DEFAULT_TESTBED)?,
    })
}

pub fn run(action: TestbedAction) -> Result<()> {
    match action {
        TestbedAction::Up {
            file,
            nodes,
            prefix,
        } => {
            let tb = load(file.as_ref())?;
            let n = nodes.unwrap_or(tb.devices.len());
            let em = fusion_netem::up(&tb, n, &prefix, &relay_command()?)?;
            println!(
                "testbed '{}' is up ({} namespaces with prefix '{prefix}'):",
                tb.name, n
            );
            for d in &em.devices {
                println!(
                    "  {:<10} netns {:<10} address {:<12} broker via {}",
                    d.name, d.namespace, d.address, d.broker_gateway
                );
            }
            for (a, b, bw, lat) in &em.links {
                println!("  link {a} <-> {b}: {bw} Mbit/s, {lat} ms one way");
            }
            println!("run a node in it: ip netns exec {}-d0 fusionllm node --broker https://<gateway>:PORT --data-listen <address>:0 --advertise <address> ...", prefix);
            println!("remove it: fusionllm testbed down --prefix {prefix}");
            Ok(())
        }
        TestbedAction::Down { prefix } => {
            let n = fusion_netem::down(&prefix)?;
            println!("removed {n} namespaces with prefix '{prefix}'");
            Ok(())
        }
        TestbedAction::Relay(r) => {
            fusion_netem::run_relay(
                &r.a,
                &r.b,
                Duration::from_secs_f64(r.delay_ms.max(0.0) / 1e3),
                r.loss,
            )
            .with_context(|| format!("relay {} <-> {}", r.a, r.b))?;
            Ok(())
        }
        TestbedAction::Probe(p) => probe(p),
    }
}

/// Server: counts what one client sends and answers with the count, printing the address each
/// connection came from. Client: prints the TCP handshake time (one round trip), the throughput
/// from first byte to the server's answer, and its own address (behind an emulated NAT the
/// server sees another).
fn probe(p: ProbeArgs) -> Result<()> {
    if let Some(addr) = p.listen {
        let listener = TcpListener::bind(addr).with_context(|| format!("binding {addr}"))?;
        println!("listening");
        std::io::stdout().flush()?;
        // The client's first connection only resolves the link-layer address (ARP); the
        // second one carries the data.
        for _ in 0..2 {
            let (mut s, from) = listener.accept()?;
            println!("from {from}");
            std::io::stdout().flush()?;
            let mut buf = vec![0u8; 1 << 16];
            let mut total = 0u64;
            loop {
                let n = s.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
            if total > 0 {
                s.write_all(&total.to_be_bytes())?;
                return Ok(());
            }
        }
        bail!("the client sent nothing");
    }
    let Some(addr) = p.connect else {
        bail!("probe needs --listen or --connect");
    };
    drop(TcpStream::connect_timeout(&addr, Duration::from_secs(10))?);
    let t0 = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    let rtt = t0.elapsed();
    s.set_nodelay(true)?;
    let chunk = vec![0u8; 1 << 16];
    let t1 = Instant::now();
    let mut sent = 0;
    while sent < p.bytes {
        let n = chunk.len().min(p.bytes - sent);
        s.write_all(&chunk[..n])?;
        sent += n;
    }
    s.shutdown(std::net::Shutdown::Write)?;
    let mut answer = [0u8; 8];
    s.read_exact(&mut answer)?;
    // The answer arrives one round trip after the last byte left: take that out.
    let elapsed = t1.elapsed().saturating_sub(rtt);
    let received = u64::from_be_bytes(answer);
    println!(
        "rtt_ms {:.3} mbit_s {:.3} bytes {received} local {}",
        rtt.as_secs_f64() * 1e3,
        received as f64 * 8.0 / elapsed.as_secs_f64().max(1e-9) / 1e6,
        s.local_addr()?
    );
    Ok(())
}

#[derive(serde::Serialize)]
struct LinkMeasurement {
    from: String,
    to: String,
    bandwidth_mbps: f64,
    latency_ms: f64,
    rtt_ms: f64,
    achieved_mbps: f64,
}

/// `fusionllm bench --netns`: brings the default testbed up, measures one link inside a site and
/// the one between sites with the probe (a warm-up connection, then a timed connect and a bulk
/// transfer), and removes it again.
pub fn bench(json: Option<&std::path::Path>) -> Result<()> {
    let tb = load(None)?;
    let prefix = format!("b{:04x}", std::process::id() & 0xffff);
    let em = fusion_netem::up(&tb, tb.devices.len(), &prefix, &relay_command()?)?;
    struct Down(String);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = fusion_netem::down(&self.0);
        }
    }
    let _down = Down(prefix);
    let exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    for (a, b, bytes) in [(0usize, 1usize, 400_000_000usize), (1, 2, 50_000_000)] {
        let (da, db) = (&em.devices[a], &em.devices[b]);
        let spec = tb
            .link(&da.name, &db.name)
            .context("the testbed has no link between the measured devices")?;
        let addr = format!("{}:9300", db.address);
        let mut server = std::process::Command::new("ip")
            .args(["netns", "exec", &db.namespace])
            .arg(&exe)
            .args(["testbed", "probe", "--listen", &addr])
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(server.stdout.as_mut().context("probe output")?),
            &mut line,
        )?;
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &da.namespace])
            .arg(&exe)
            .args([
                "testbed",
                "probe",
                "--connect",
                &addr,
                "--bytes",
                &bytes.to_string(),
            ])
            .output()?;
        let _ = server.wait();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let field = |k: &str| -> f64 {
            let words: Vec<&str> = text.split_whitespace().collect();
            words
                .iter()
                .position(|w| *w == k)
                .and_then(|i| words.get(i + 1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(f64::NAN)
        };
        rows.push(LinkMeasurement {
            from: da.name.clone(),
            to: db.name.clone(),
            bandwidth_mbps: spec.bandwidth_mbps,
            latency_ms: spec.latency_ms,
            rtt_ms: field("rtt_ms"),
            achieved_mbps: field("mbit_s"),
        });
    }
    println!(
        "faithful emulation of testbed '{}' (namespaces, tc tbf, AF_PACKET delay bridge)",
        tb.name
    );
    println!(
        "{:<8} {:<8} {:>12} {:>12} {:>10} {:>12} {:>8}",
        "from", "to", "config Mb/s", "config RTT", "RTT ms", "achieved", "ratio"
    );
    for r in &rows {
        println!(
            "{:<8} {:<8} {:>12.1} {:>12.1} {:>10.2} {:>12.1} {:>7.1}%",
            r.from,
            r.to,
            r.bandwidth_mbps,
            2.0 * r.latency_ms,
            r.rtt_ms,
            r.achieved_mbps,
            100.0 * r.achieved_mbps / r.bandwidth_mbps
        );
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)?;
    }
    Ok(())
}
