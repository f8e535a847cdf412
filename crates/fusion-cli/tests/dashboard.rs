//! The dashboard in a real browser: `fusionllm train --dashboard` on the local emulated cluster,
//! the page opened in headless Chromium through chromedriver (WebDriver), the loss curve and the
//! placement checked in the page's DOM, `/metrics` scraped and parsed, one node process killed
//! with SIGKILL and its loss event awaited on the page, and a screenshot saved.
//!
//! Needs Debian's `chromium` and `chromium-driver` (installed by `.ci/run`): under `CI=true` the
//! test fails without them, elsewhere it says so and passes.

use fantoccini::{Client, ClientBuilder};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const NODES: [&str; 4] = ["node0", "node1", "node2", "node3"];
/// Loss points the chart must show before a node is killed.
const POINTS: u64 = 10;
/// The dashboard's token (the page must carry it into its event stream).
const TOKEN: &str = "browser-test-token-0123";
const VICTIM: &str = "node2";

/// The first of `names` found on PATH, or at one of `paths`.
fn tool(names: &[&str], paths: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let on_path = std::env::split_paths(&path)
        .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
        .find(|p| p.is_file());
    on_path.or_else(|| paths.iter().map(PathBuf::from).find(|p| p.is_file()))
}

/// Chromium and chromedriver, or None where they are missing (a failure under CI=true).
fn browser() -> Option<(PathBuf, PathBuf)> {
    let chromium = tool(&["chromium", "chromium-browser"], &[]);
    let driver = tool(&["chromedriver"], &["/usr/lib/chromium/chromedriver"]);
    match (chromium, driver) {
        (Some(c), Some(d)) => Some((c, d)),
        _ => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "the dashboard's browser test needs chromium and chromedriver (Debian's chromium \
                 and chromium-driver) under CI=true"
            );
            eprintln!("chromium or chromedriver not installed: the browser test did not run");
            None
        }
    }
}

/// Kills and reaps a child (and the processes it started) however the test ends.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        for pid in children(self.0.id()) {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The processes `parent` started (any of its threads).
fn children(parent: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{parent}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        let list = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        out.extend(
            list.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    out
}

/// Starts the local cluster with a dashboard on a free loopback port; returns the process, its
/// stderr lines and the dashboard's URL.
fn start_run(dir: &Path) -> (Reaped, mpsc::Receiver<String>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fusionllm"))
        .args(["train", "--steps", "3000", "--eval-every", "5"])
        .args(["--dashboard", "127.0.0.1:0", "--dashboard-token", TOKEN])
        .arg("--report")
        .arg(dir.join("run.json"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fusionllm train");
    let stderr = child.stderr.take().expect("stderr");
    let run = Reaped(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(line) => {
                if let Some(rest) = line.strip_prefix("dashboard: ") {
                    let url = rest.split_whitespace().next().expect("a URL").to_string();
                    return (run, rx, url);
                }
                seen.push(line);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    panic!(
        "the launcher never printed the dashboard's URL:\n{}",
        seen.join("\n")
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// chromedriver on a free port, once it accepts connections.
fn start_driver(driver: &Path) -> (Reaped, u16) {
    let port = free_port();
    let child = Reaped(
        Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver"),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return (child, port);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("chromedriver never listened on port {port}");
}

async fn open_browser(chromium: &Path, port: u16) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,2400"],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a WebDriver session in headless Chromium")
}

/// Evaluates `script` in the page until `done` holds for its value (bounded).
async fn wait_for(
    c: &Client,
    what: &str,
    script: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut last = serde_json::Value::Null;
    while Instant::now() < deadline {
        last = c.execute(script, vec![]).await.expect("script ran");
        if done(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    panic!("the page never showed {what}; last value: {last}");
}

/// The node process running `name`: a child of the launcher with `--name name`.
fn node_pid(launcher: u32, name: &str) -> u32 {
    let found = children(launcher).into_iter().find(|pid| {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
        args.windows(2)
            .any(|w| w[0] == b"--name" && w[1] == name.as_bytes())
    });
    found.unwrap_or_else(|| panic!("no node process for {name} under pid {launcher}"))
}

/// `http://HOST:PORT` of the dashboard's URL.
fn base_of(url: &str) -> &str {
    let rest = url.strip_prefix("http://").expect("an http URL");
    &url[..7 + rest.find('/').unwrap_or(rest.len())]
}

async fn scrape_metrics(url: &str) {
    let http = reqwest::Client::new();
    let metrics = format!("{}/metrics", base_of(url));
    let denied = http.get(&metrics).send().await.expect("scrape");
    assert_eq!(denied.status().as_u16(), 401, "/metrics without the token");
    let text = http
        .get(&metrics)
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("scrape /metrics")
        .text()
        .await
        .expect("metrics body");
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .expect("/metrics parses as the Prometheus text format");
    let value = |name: &str, node: Option<&str>| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && node.is_none_or(|n| s.labels.get("node") == Some(n)))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) => v,
                _ => f64::NAN,
            })
            .unwrap_or_else(|| panic!("no {name} ({node:?}) in /metrics:\n{text}"))
    };
    assert!(value("fusionllm_steps_total", None) >= POINTS as f64);
    assert!(value("fusionllm_tokens_per_second", None) > 0.0);
    for n in NODES {
        assert_eq!(value("fusionllm_node_up", Some(n)), 1.0, "{n} is up");
        assert!(value("fusionllm_node_compute_seconds_total", Some(n)) > 0.0);
        assert!(value("fusionllm_node_peak_memory_bytes", Some(n)) > 0.0);
    }
}

/// The page's copy of the view, kept by applying patches, equals the broker's at the same
/// patch (the page's JS folds patches as the Rust view does).
async fn same_view_as_the_broker(c: &Client) {
    let script = r#"
        const done = arguments[arguments.length - 1];
        (async () => {
            for (let i = 0; i < 200; i++) {
                const token = new URLSearchParams(location.search).get("token");
                const state = await (await fetch("api/state?token=" + token)).json();
                if (view && view.seq === state.seq) {
                    // Both through the browser's own number formatting.
                    const [a, b] = [JSON.stringify(view), JSON.stringify(state)];
                    done(a === b ? "same" : "differ: " + a + " vs " + b);
                    return;
                }
                await new Promise(r => setTimeout(r, 20));
            }
            done("never at the same patch");
        })();"#;
    let answer = c.execute_async(script, vec![]).await.expect("script ran");
    assert_eq!(answer.as_str(), Some("same"), "{answer}");
}

#[test]
fn the_dashboard_shows_a_live_run_and_a_killed_node_in_headless_chromium() {
    let Some((chromium, driver)) = browser() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let (run, _lines, url) = start_run(dir.path());
    let (_driver, port) = start_driver(&driver);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let shot = rt.block_on(async {
        let c = open_browser(&chromium, port).await;
        c.goto(&url).await.expect("open the dashboard");
        let points = "return Number(document.getElementById('loss-step').dataset.points || 0)";
        wait_for(&c, "the loss curve", points, |v| v.as_u64() >= Some(POINTS)).await;
        let placed = "return Array.from(document.querySelectorAll('#placement [data-node]'))\
                      .map(g => g.dataset.node + ':' + g.dataset.status)";
        wait_for(&c, "every node placed", placed, |v| {
            NODES
                .iter()
                .all(|n| v.to_string().contains(&format!("{n}:training")))
        })
        .await;
        scrape_metrics(&url).await;
        same_view_as_the_broker(&c).await;
        let pid = node_pid(run.0.id(), VICTIM);
        let killed = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
        assert!(killed.expect("kill(1)").success(), "SIGKILL {VICTIM}");
        let lost = "return Array.from(document.querySelectorAll('#events li[data-kind=\"lost\"]'))\
                    .map(li => li.textContent)";
        let v = wait_for(&c, "the node's loss", lost, |v| {
            v.to_string().contains(&format!("{VICTIM} lost"))
        })
        .await;
        eprintln!("the page shows: {v}");
        let shot = c.screenshot().await.expect("screenshot");
        c.close().await.expect("close the browser");
        shot
    });
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    std::fs::write(&out, &shot).expect("save the screenshot");
    assert!(shot.starts_with(b"\x89PNG"), "a PNG screenshot");
    eprintln!("screenshot: {}", out.display());
    drop(run);
}
