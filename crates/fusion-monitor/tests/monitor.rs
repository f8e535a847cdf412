//! The monitor without a cluster: a scripted sequence of broker events folded into the view,
//! the metrics parsed by Prometheus text parsers (the `prometheus-parse` crate and, where the
//! Prometheus package is installed, `promtool check metrics`), and the HTTP server on loopback
//! (token, page, event stream, metrics).

use fusion_compress::Codec;
use fusion_monitor::{serve, Monitor, RunInfo};
use fusion_proto::Capabilities;
use fusion_runtime::{
    BrokerEvent, LinkCodec, LinkStep, MeasuredLink, NodeStep, StagePlacement, StepDetail,
};
use fusion_train::{EvalRecord, StepRecord};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const NODES: [&str; 2] = ["node-a", "node-b"];

fn info() -> RunInfo {
    RunInfo {
        model: "gpt2-tiny".into(),
        data: "synthetic".into(),
        steps: 10,
        unit: "tok/s".into(),
        sites: NODES
            .iter()
            .zip(["lab", "home"])
            .map(|(n, s)| (n.to_string(), s.to_string()))
            .collect(),
    }
}

fn placement() -> Vec<StagePlacement> {
    NODES
        .iter()
        .enumerate()
        .map(|(stage, node)| StagePlacement {
            stage,
            replica: 0,
            node: node.to_string(),
            site: String::new(),
            backend: "candle-cpu-f32".into(),
            device: "cpu".into(),
            operators: 10,
            params: 1000,
            recompute_segments: 0,
            measured_gflops: 50.0,
            measured_memory_gbs: 10.0,
            calibration: 1.0,
            op_overhead_us: 0.0,
            reachable: true,
            paths: Vec::new(),
        })
        .collect()
}

fn step(s: u64, loss: f32) -> StepRecord {
    StepRecord {
        step: s,
        loss,
        lr: 1e-3,
        grad_norm: 0.5,
        elapsed_s: s as f64 * 0.5,
        throughput: 1000.0,
    }
}

fn detail(s: u64, snapshot_step: u64) -> StepDetail {
    StepDetail {
        step: s,
        wall_s: 0.5,
        nodes: NODES
            .iter()
            .enumerate()
            .map(|(i, n)| NodeStep {
                node: n.to_string(),
                stage: i,
                replica: 0,
                compute_s: 0.3,
                wait_s: 0.1 * i as f64,
                peak_memory_bytes: 100 << 20,
                heartbeat_age_s: 0.2,
            })
            .collect(),
        links: vec![LinkStep {
            from: "node-a".into(),
            to: "node-b".into(),
            bytes: 1_000_000,
        }],
        snapshot_step,
    }
}

/// Two nodes join, are placed, train three steps with an evaluation, node-b is lost, the run
/// rolls back to step 2 and trains step 3 again.
fn script(m: &Monitor) {
    let caps = Capabilities {
        backend: "candle-cpu-f32".into(),
        device: "cpu".into(),
        measured_gflops: 50.0,
        ..Default::default()
    };
    for n in NODES {
        m.observe(&BrokerEvent::Joined {
            node: n,
            capabilities: &caps,
        });
    }
    let measured = [MeasuredLink {
        from: "node-a".into(),
        to: "node-b".into(),
        bandwidth_mbps: 50.0,
        latency_ms: 40.0,
        samples: 1,
        last_bandwidth_mbps: 50.0,
        last_latency_ms: 40.0,
        path: fusion_runtime::path::LinkPath::Direct,
    }];
    m.observe(&BrokerEvent::Links {
        round: 1,
        changed: &measured,
    });
    m.observe(&BrokerEvent::Placement(&placement()));
    m.observe(&BrokerEvent::Plan(&[
        "stage 0: node-a".into(),
        "bottleneck: node-b".into(),
    ]));
    let codec = |c| {
        [LinkCodec {
            from: "node-a".into(),
            to: "node-b".into(),
            direction: "activations".into(),
            codec: c,
            dense_bytes: 4096,
        }]
    };
    m.observe(&BrokerEvent::Compression(&codec(Codec::None)));
    for s in 1..=3 {
        let eval = EvalRecord {
            step: s,
            loss: 5.0,
            accuracy: 0.25,
        };
        m.observe(&BrokerEvent::Step(
            &step(s, 6.0 - s as f32),
            (s == 2).then_some(&eval),
        ));
        m.observe(&BrokerEvent::StepDetail(&detail(s, 2)));
    }
    m.observe(&BrokerEvent::Compression(&codec(Codec::TopK {
        density: 0.1,
    })));
    m.observe(&BrokerEvent::NodeLost {
        node: "node-b",
        reason: "its control stream closed",
    });
    m.observe(&BrokerEvent::Recovered { step: 2, lost: 1 });
    m.observe(&BrokerEvent::Placement(&placement()));
    m.observe(&BrokerEvent::Step(&step(3, 3.5), None));
    m.observe(&BrokerEvent::StepDetail(&detail(3, 2)));
}

#[test]
fn the_view_folds_steps_links_codecs_and_a_rollback() {
    let m = Monitor::new(info()).expect("monitor");
    script(&m);
    let v = m.view();
    let steps: Vec<(u64, f32)> = v.steps.iter().map(|s| (s.step, s.loss)).collect();
    assert_eq!(
        steps,
        vec![(1, 5.0), (2, 4.0), (3, 3.5)],
        "step 3 retrained after the rollback"
    );
    assert_eq!(v.evals.len(), 1);
    assert_eq!(v.status, "training");
    assert_eq!(v.snapshot_step, 2);
    let b = &v.nodes["node-b"];
    assert_eq!(
        (b.site.as_str(), b.stage, b.status.as_str()),
        ("home", Some(1), "training")
    );
    assert_eq!(b.peak_memory_bytes, 100 << 20);
    let link = &v.links[0];
    assert_eq!(
        (link.bytes_last_step, link.bytes_total),
        (1_000_000, 4_000_000)
    );
    // 8 Mbit in 0.5 s over 50 Mbit/s.
    assert!((link.utilisation.expect("probed") - 0.32).abs() < 1e-9);
    assert_eq!(link.codecs["activations"], "top-k 10.00%");
    let codecs: Vec<&str> = v.codec_history.iter().map(|c| c.codec.as_str()).collect();
    assert_eq!(codecs, vec!["dense", "top-k 10.00%"]);
    let kinds: Vec<&str> = v.events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        vec!["joined", "joined", "placed", "lost", "recovered", "placed"]
    );
    assert_eq!(v.events[3].node.as_deref(), Some("node-b"));
    assert_eq!(v.events[3].step, 3, "lost at the step the run had reached");
    assert_eq!(v.seq, 18, "one patch per event");
}

fn parse(text: &str) -> prometheus_parse::Scrape {
    let lines = text.lines().map(|l| Ok(l.to_string()));
    prometheus_parse::Scrape::parse(lines).expect("the exposition parses")
}

fn sample<'a>(
    s: &'a prometheus_parse::Scrape,
    name: &str,
    labels: &[(&str, &str)],
) -> &'a prometheus_parse::Value {
    let found = s
        .samples
        .iter()
        .find(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)));
    &found
        .unwrap_or_else(|| panic!("no sample {name} {labels:?} in the scrape"))
        .value
}

fn scalar(v: &prometheus_parse::Value) -> f64 {
    match v {
        prometheus_parse::Value::Counter(x)
        | prometheus_parse::Value::Gauge(x)
        | prometheus_parse::Value::Untyped(x) => *x,
        other => panic!("not a scalar: {other:?}"),
    }
}

#[test]
fn metrics_parse_and_carry_the_runs_figures() {
    let m = Monitor::new(info()).expect("monitor");
    script(&m);
    let text = m.metrics_text();
    let s = parse(&text);
    let get = |name: &str, labels: &[(&str, &str)]| scalar(sample(&s, name, labels));
    assert_eq!(get("fusionllm_steps_total", &[]), 4.0);
    assert_eq!(get("fusionllm_step", &[]), 3.0);
    assert_eq!(get("fusionllm_train_loss", &[]), 3.5);
    assert_eq!(get("fusionllm_eval_loss", &[]), 5.0);
    assert_eq!(get("fusionllm_tokens_per_second", &[]), 1000.0);
    let ab = [("from", "node-a"), ("to", "node-b")];
    assert_eq!(get("fusionllm_link_sent_bytes_total", &ab), 4e6);
    assert_eq!(
        get("fusionllm_link_bandwidth_bytes_per_second", &ab),
        50e6 / 8.0
    );
    assert_eq!(get("fusionllm_link_latency_seconds", &ab), 0.04);
    let act = [ab[0], ab[1], ("direction", "activations")];
    assert_eq!(get("fusionllm_link_codec_density_ratio", &act), 0.1);
    let b = [("node", "node-b")];
    assert!((get("fusionllm_node_compute_seconds_total", &b) - 1.2).abs() < 1e-9);
    assert!((get("fusionllm_node_wait_seconds_total", &b) - 0.4).abs() < 1e-9);
    assert_eq!(
        get("fusionllm_node_peak_memory_bytes", &b),
        (100 << 20) as f64
    );
    assert_eq!(
        get("fusionllm_node_up", &b),
        1.0,
        "placed again after the loss"
    );
    assert_eq!(get("fusionllm_node_losses_total", &[]), 1.0);
    assert_eq!(get("fusionllm_recoveries_total", &[]), 1.0);
    assert_eq!(get("fusionllm_rolled_back_steps_total", &[]), 1.0);
    assert_eq!(get("fusionllm_snapshot_age_steps", &[]), 1.0);
    match sample(&s, "fusionllm_step_duration_seconds", &[]) {
        prometheus_parse::Value::Histogram(buckets) => {
            let all = buckets.last().expect("buckets");
            assert_eq!(all.count, 4.0, "+Inf bucket counts every step");
        }
        other => panic!("step duration is not a histogram: {other:?}"),
    }
    promtool_check(&text);
}

/// `promtool check metrics` (Debian's prometheus package) lints names, units and types.
fn promtool_check(text: &str) {
    let promtool = ["/usr/bin/promtool", "/usr/local/bin/promtool"]
        .into_iter()
        .find(|p| Path::new(p).exists());
    let Some(promtool) = promtool else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "promtool (Debian's prometheus package) is required under CI=true"
        );
        eprintln!("promtool not installed: checked with prometheus-parse only");
        return;
    };
    let out = std::process::Command::new(promtool)
        .args(["check", "metrics"])
        .output_after_writing(text);
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

trait WriteThenWait {
    fn output_after_writing(&mut self, text: &str) -> std::process::Output;
}

impl WriteThenWait for std::process::Command {
    fn output_after_writing(&mut self, text: &str) -> std::process::Output {
        use std::io::Write;
        let mut c = self
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("start promtool");
        c.stdin
            .take()
            .expect("stdin")
            .write_all(text.as_bytes())
            .expect("write the exposition");
        c.wait_with_output().expect("promtool ran")
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

#[test]
fn the_server_wants_its_token_and_streams_the_view_then_patches() {
    let rt = runtime();
    rt.block_on(async {
        let m = Monitor::new(info()).expect("monitor");
        let addr = "127.0.0.1:0".parse().expect("addr");
        let weak = serve(m.clone(), addr, Some("short".into())).await;
        assert!(matches!(
            weak,
            Err(fusion_monitor::MonitorError::WeakToken { .. })
        ));
        let d = serve(m.clone(), addr, Some("s3cret-dashboard-token".into()))
            .await
            .expect("serve");
        assert!(
            d.url.ends_with("/?token=s3cret-dashboard-token"),
            "{}",
            d.url
        );
        let base = format!("http://{}", d.addr);
        let http = reqwest::Client::new();
        let status = |path: &str| {
            let (http, url) = (http.clone(), format!("{base}{path}"));
            async move { http.get(url).send().await.expect("GET").status().as_u16() }
        };
        assert_eq!(status("/").await, 401);
        assert_eq!(status("/metrics?token=wrong").await, 401);
        assert_eq!(status("/?token=s3cret-dashboard-token").await, 200);
        let metrics = http
            .get(format!("{base}/metrics"))
            .header("authorization", "bearer s3cret-dashboard-token")
            .send()
            .await
            .expect("scrape");
        assert_eq!(metrics.status().as_u16(), 200);
        let text = metrics.text().await.expect("body");
        assert!(text.contains("fusionllm_steps_total 0"), "{text}");
        assert_eq!(
            http.post(format!("{base}/api/state?token=s3cret-dashboard-token"))
                .send()
                .await
                .expect("POST")
                .status()
                .as_u16(),
            405,
            "read-only"
        );
        let events = stream_events(&http, &base, &m).await;
        assert!(events[0].starts_with("event: snapshot"), "{events:?}");
        assert!(events[0].contains("\"seq\":0"), "{events:?}");
        assert!(events[1].starts_with("event: patch"), "{events:?}");
        assert!(events[1].contains("\"seq\":1") && events[1].contains("node-a joined"));
    });
}

/// Opens the event stream, lets one node join, and returns the first two events.
async fn stream_events(http: &reqwest::Client, base: &str, m: &Arc<Monitor>) -> Vec<String> {
    let mut resp = http
        .get(format!("{base}/api/events?token=s3cret-dashboard-token"))
        .send()
        .await
        .expect("event stream");
    assert_eq!(resp.status().as_u16(), 200);
    let mut text = String::new();
    let mut joined = false;
    for _ in 0..50 {
        let chunk = tokio::time::timeout(Duration::from_secs(5), resp.chunk())
            .await
            .expect("an event within 5 s")
            .expect("read");
        text.push_str(&String::from_utf8_lossy(&chunk.unwrap_or_default()));
        if !joined && text.contains("event: snapshot") {
            joined = true;
            let caps = Capabilities::default();
            m.observe(&BrokerEvent::Joined {
                node: "node-a",
                capabilities: &caps,
            });
        }
        let events: Vec<String> = text
            .split("\n\n")
            .filter(|e| e.contains("event: "))
            .map(|e| e.trim_start_matches(": \n").to_string())
            .collect();
        if events.len() >= 2 {
            return events;
        }
    }
    panic!("fewer than two events: {text}");
}

#[test]
fn an_address_beyond_loopback_needs_a_token() {
    let rt = runtime();
    rt.block_on(async {
        let m = Monitor::new(info()).expect("monitor");
        let addr = "0.0.0.0:0".parse().expect("addr");
        match serve(m, addr, None).await {
            Err(fusion_monitor::MonitorError::TokenRequired { .. }) => {}
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("served beyond loopback without a token"),
        }
    });
}

#[test]
fn a_report_becomes_a_page_with_its_curves_and_recoveries() {
    let report = serde_json::json!({
        "model": "gpt2-tiny", "data": "synthetic", "throughput_unit": "tok/s",
        "config": {"steps": 3},
        "steps": [
            {"step": 1, "loss": 5.0, "lr": 0.001, "grad_norm": 1.0, "elapsed_s": 0.5, "throughput": 900.0},
            {"step": 2, "loss": 4.0, "lr": 0.001, "grad_norm": 1.0, "elapsed_s": 1.0, "throughput": 950.0}
        ],
        "evals": [{"step": 2, "loss": 4.5, "accuracy": 0.1}],
        "placement": [{"stage": 0, "replica": 0, "node": "node-a", "site": "lab", "backend": "reference-f64",
                       "device": "cpu", "operators": 3, "params": 10, "measured_gflops": 1.0}],
        "links": [{"from": "node-a", "to": "node-b", "bytes": 2000, "tensors": 4}],
        "measured_links": [{"from": "node-a", "to": "node-b", "bandwidth_mbps": 50.0, "latency_ms": 40.0}],
        "compression": [{"from": "node-a", "to": "node-b", "direction": "gradients",
                         "codec": {"kind": "top_k", "density": 0.05}, "dense_bytes": 100}],
        "recoveries": [{"node": "node-b", "reason": "killed", "interrupted_at_step": 2,
                        "resumed_from_step": 1, "steps_lost": 1}]
    });
    let dir = tempfile::tempdir().expect("tmp");
    let (input, output) = (dir.path().join("run.json"), dir.path().join("run.html"));
    std::fs::write(&input, report.to_string()).expect("write");
    fusion_monitor::report_page(&input, &output).expect("page");
    let html = std::fs::read_to_string(&output).expect("read");
    let v = fusion_monitor::view_from_report(&report.to_string()).expect("view");
    assert_eq!(v.steps.len(), 2);
    assert_eq!(v.evals[0].t, 1.0);
    assert_eq!(v.links[0].bytes_last_step, 1000);
    assert_eq!(
        (v.nodes["node-a"].site.as_str(), v.source.as_str()),
        ("lab", "report")
    );
    assert_eq!(v.links[0].codecs["gradients"], "top-k 5.00%");
    let kinds: Vec<&str> = v.events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, vec!["lost", "recovered", "finished"]);
    assert!(html.contains("\"kind\":\"lost\"") && html.contains("gpt2-tiny on synthetic"));
    std::fs::write(&input, "{\"model\": 1}").expect("write");
    match fusion_monitor::report_page(&input, &output) {
        Err(fusion_monitor::MonitorError::BadReport { .. }) => {}
        other => panic!("a malformed report gave {other:?}"),
    }
}
