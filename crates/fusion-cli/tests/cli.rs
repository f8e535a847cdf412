//! The `fusionllm` binary end to end.

use std::process::Command;

fn fusionllm(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_fusionllm"))
        .args(args)
        .output()
        .expect("run fusionllm")
}

#[test]
fn model_summary_json_has_params_and_ops() {
    let out = fusionllm(&["model", "summary", "gpt2-small", "--json", "--seq", "1024"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["params"], 124_439_808);
    let ops = v["ops"].as_array().unwrap();
    assert!(ops.iter().any(|o| o["op"] == "causal_self_attention"));
    assert!(ops
        .iter()
        .all(|o| o["fwd_flops"].as_f64().is_some() && o["activation_bytes"].as_u64().is_some()));
}

#[test]
fn short_training_run_writes_a_report_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    let ckpt = dir.path().join("ckpt");
    let args = |steps: &str| {
        vec![
            "train".to_string(),
            "--steps".into(),
            steps.into(),
            "--batch".into(),
            "4".into(),
            "--seq".into(),
            "16".into(),
            "--eval-batches".into(),
            "1".into(),
            "--checkpoint-dir".into(),
            ckpt.display().to_string(),
            "--report".into(),
            report.display().to_string(),
        ]
    };
    let a: Vec<String> = args("3");
    let out = fusionllm(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(v["steps"].as_array().unwrap().len(), 3);
    assert!(v["throughput"].as_f64().unwrap() > 0.0);
    assert!(v["entropy_floor"].as_f64().unwrap() > 0.0);

    // The resumed half runs in one process with its optimizer state on the compute device (what
    // `auto` picks on a GPU), from the cluster's checkpoint: a checkpoint holds the same state
    // whichever side kept it.
    let mut a = args("5");
    a.push("--nodes".into());
    a.push("1".into());
    a.push("--resume".into());
    a.push(ckpt.display().to_string());
    a.push("--optimizer-on".into());
    a.push("device".into());
    let out = fusionllm(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("at step 3"));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(v["start_step"], 3);
    assert_eq!(v["steps"].as_array().unwrap().len(), 2);
    assert_eq!(v["config"]["optimizer_on"], "device");

    // A new run from the checkpoint's weights: its own model (a --model of the same
    // architecture agrees, another is refused), from step 0.
    let ckpt_s = ckpt.display().to_string();
    let start = |model: &str| {
        fusionllm(&[
            "train",
            "--nodes",
            "1",
            "--steps",
            "2",
            "--batch",
            "4",
            "--seq",
            "16",
            "--eval-batches",
            "1",
            "--init-from",
            &ckpt_s,
            "--model",
            model,
        ])
    };
    let out = start("gpt2-tiny");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("initial weights from"), "{err}");
    let out = start("llama-tiny");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--model llama-tiny is not the model of the weights"),
        "{err}"
    );
}

#[test]
fn bad_arguments_fail_with_a_clear_message() {
    let out = fusionllm(&["train", "--data", "/nonexistent/corpus.txt"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such file"));
    let out = fusionllm(&["train", "--model", "resnet-tiny", "--steps", "1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("image model"));
    let out = fusionllm(&["train", "--nodes", "1", "--tf32"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--tf32 is for one process on a GPU"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = fusionllm(&["train", "--optimizer-on", "device"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--optimizer-on is for one process"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (args, says) in [
        (
            &[
                "train",
                "--nodes",
                "1",
                "--precision",
                "bf16",
                "--backend",
                "reference",
            ][..],
            "the reference backend computes in f64",
        ),
        (
            &[
                "train",
                "--nodes",
                "1",
                "--backend",
                "candle-cuda",
                "--precision",
                "bf16",
                "--tf32",
            ][..],
            "--tf32 is a mode of f32 matrix products: not with --precision bf16",
        ),
        (
            &["train", "--nodes", "2", "--shard-optimizer"][..],
            "--shard-optimizer shards the optimizer state across a cluster's data-parallel",
        ),
        (
            &[
                "train",
                "--nodes",
                "2",
                "--replicas",
                "2",
                "--shard-optimizer",
                "--snapshots",
                "sharded",
            ][..],
            "not with --snapshots sharded",
        ),
    ] {
        let out = fusionllm(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
    let out = fusionllm(&["model", "summary", "gpt5"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown model preset"));
}

#[test]
fn cert_keeps_the_ca_apart_reuses_it_refuses_to_overwrite_and_revokes() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("certs");
    let ca_dir = dir.path().join("certs-ca");
    let out = out_dir.display().to_string();
    let run = |extra: &[&str]| {
        let mut args = vec!["cert", "--out", out.as_str()];
        args.extend_from_slice(extra);
        fusionllm(&args)
    };
    let first = run(&["--names", "broker,node0"]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    for f in [
        "ca.pem",
        "broker.pem",
        "broker.key",
        "node0.pem",
        "node0.key",
    ] {
        let text = std::fs::read_to_string(out_dir.join(f)).unwrap();
        assert!(text.starts_with("-----BEGIN"), "{f}");
    }
    // The CA's key is not among what is copied to the nodes.
    assert!(!out_dir.join("ca.key").exists());
    assert!(ca_dir.join("ca.key").exists() && ca_dir.join("issued.tsv").exists());
    #[cfg(unix)]
    for key in [out_dir.join("node0.key"), ca_dir.join("ca.key")] {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{} is readable by others", key.display());
    }
    let ca_pem = std::fs::read_to_string(out_dir.join("ca.pem")).unwrap();
    let again = run(&["--names", "broker,node0"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    assert!(run(&["--names", "broker,node0", "--force"])
        .status
        .success());
    // More nodes later: the same CA issues them.
    assert!(run(&["--names", "node1", "--days", "7"]).status.success());
    assert_eq!(
        std::fs::read_to_string(out_dir.join("ca.pem")).unwrap(),
        ca_pem
    );
    // Revoking node0 (both certificates it was issued) writes the list the broker reads.
    let revoke = run(&["--revoke", "node0"]);
    assert!(
        revoke.status.success(),
        "{}",
        String::from_utf8_lossy(&revoke.stderr)
    );
    assert!(String::from_utf8_lossy(&revoke.stdout).contains("revoked 2 certificates"));
    let crl = std::fs::read_to_string(out_dir.join("crl.pem")).unwrap();
    assert!(crl.starts_with("-----BEGIN X509 CRL"), "{crl}");
    let unknown = run(&["--revoke", "node9"]);
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("no certificate to 'node9'"));
    let bad = fusionllm(&["cert", "--out", out.as_str(), "--names", "../evil"]);
    assert!(!bad.status.success());
}

/// A model as a file: a preset's graph and architecture exported, the architecture edited (a
/// third block), both trained; a graph asked to run at another micro-batch is refused with the
/// command that fixes it.
#[test]
fn exported_models_train_from_their_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = fusionllm(&[
        "model",
        "export",
        "gpt2-tiny",
        "--batch",
        "2",
        "--seq",
        "16",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let graph = dir.path().join("graph.json");
    std::fs::write(&graph, &out.stdout).expect("write");
    let out = fusionllm(&["model", "export", "gpt2-tiny", "--architecture"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert!(
        text.contains("family = \"gpt2\"") && text.contains("n_layer = 2"),
        "{text}"
    );
    let arch = dir.path().join("arch.toml");
    std::fs::write(&arch, text.replace("n_layer = 2", "n_layer = 3")).expect("write");
    let summary = fusionllm(&["model", "summary", arch.to_str().expect("path"), "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&summary.stdout).expect("json");
    let blocks = v["ops"]
        .as_array()
        .expect("ops")
        .iter()
        .filter(|o| o["op"] == "causal_self_attention")
        .count();
    assert_eq!(blocks, 3);
    for model in [&graph, &arch] {
        let m = model.to_str().expect("path");
        let out = fusionllm(&[
            "train", "--model", m, "--nodes", "1", "--steps", "3", "--seq", "16",
        ]);
        assert!(
            out.status.success(),
            "{m}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let g = graph.to_str().expect("path");
    let out = fusionllm(&[
        "train", "--model", g, "--nodes", "1", "--steps", "3", "--batch", "4",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("built for micro-batches of 2 x 16 tokens")
            && err.contains("--batch 4 --seq 16"),
        "{err}"
    );
}

/// A user's path through Hugging Face weights: fine-tune the GPT-2 that `transformers` saved
/// (fusion-hf's fixture) on a text file, export the checkpoint, and find in the export exactly
/// the checkpoint's parameters under `transformers`' names.
#[test]
fn fine_tuning_from_hugging_face_weights_and_exporting_the_result() {
    use fusion_train::WeightSource;
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(200),
    )
    .unwrap();
    let gpt2 = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fusion-hf/tests/fixtures/gpt2"
    );
    let ckpt = dir.path().join("ckpt");
    let (text_s, ckpt_s) = (text.to_str().unwrap(), ckpt.to_str().unwrap());
    let train = |tokenizer: &str| {
        fusionllm(&[
            "train",
            "--init-from",
            gpt2,
            "--data",
            text_s,
            "--tokenizer",
            tokenizer,
            "--nodes",
            "1",
            "--steps",
            "4",
            "--batch",
            "2",
            "--seq",
            "16",
            "--eval-every",
            "0",
            "--checkpoint-dir",
            ckpt_s,
        ])
    };
    // GPT-2's BPE has more tokens than this model's 256.
    let out = train("gpt2");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("vocabulary of 256 tokens, fixed by its weights"),
        "{err}"
    );
    let out = train("bytes");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hf = dir.path().join("hf");
    let out = fusionllm(&[
        "export",
        "--checkpoint",
        ckpt_s,
        "--hf",
        hf.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exported = fusion_hf::HfModel::open(&hf).expect("the export opens");
    let original = fusion_hf::HfModel::open(std::path::Path::new(gpt2)).expect("fixture");
    assert_eq!(exported.spec().kind, original.spec().kind);
    let checkpoint = fusion_train::CheckpointWeights::open(&ckpt).expect("checkpoint");
    let graph = exported.spec().graph(1, 1).unwrap();
    checkpoint
        .check(&graph)
        .expect("the checkpoint holds this model");
    let mut changed = 0;
    for p in &graph.params {
        let trained = checkpoint.load(p).unwrap();
        assert_eq!(exported.load_param(p).unwrap(), trained, "{}", p.name);
        changed += usize::from(original.load_param(p).unwrap() != trained);
    }
    assert_eq!(
        changed,
        graph.params.len(),
        "fine-tuning moved every parameter"
    );
}

#[test]
fn a_finished_runs_report_becomes_a_dashboard_page() {
    let dir = tempfile::tempdir().expect("tmp");
    let (report, html) = (dir.path().join("run.json"), dir.path().join("run.html"));
    let (report_s, html_s) = (report.display().to_string(), html.display().to_string());
    let train = [
        "train", "--nodes", "1", "--steps", "3", "--batch", "2", "--seq", "16", "--report",
        &report_s,
    ];
    let out = fusionllm(&train);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = fusionllm(&["report", &report_s, "--html", &html_s]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = std::fs::read_to_string(&html).expect("the page");
    assert!(page.contains("\"step\":3") && page.contains("gpt2-tiny on synthetic"));
    for remote in [
        "<script src",
        "src=\"http",
        "href=\"http",
        "url(http",
        "@import",
    ] {
        assert!(
            !page.contains(remote),
            "the page loads nothing from the network ({remote})"
        );
    }
    // A file that is not a report: an error naming it, no page.
    std::fs::write(&report, "{\"steps\": 3}").expect("write");
    let out = fusionllm(&["report", &report_s, "--html", &html_s]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is not a fusionllm run report"),
        "{err}"
    );
    // One process has no broker to serve a dashboard.
    let out = fusionllm(&["train", "--nodes", "1", "--dashboard", "127.0.0.1:0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--dashboard is served by the broker"),
        "{err}"
    );
}

/// A cluster computing in bf16 or f16 (activations and gradients crossing the links in it)
/// trains as one process of that precision does: the links lose nothing but the residual
/// stream's f32 digits at the cut (one rounding to 16 bits, which the next residual sum widens
/// again), and both sum parameter gradients in f32 (in another order, hence not bit for bit).
/// An f16 cluster's nodes start backward from the broker's one loss scale, which moves as one
/// process's does.
#[test]
fn a_16_bit_cluster_trains_like_one_process_of_its_precision() {
    let dir = tempfile::tempdir().unwrap();
    let run = |precision: &str, nodes: &str| {
        let report = dir.path().join(format!("report-{precision}-{nodes}.json"));
        let out = fusionllm(&[
            "train",
            "--nodes",
            nodes,
            "--precision",
            precision,
            "--micro-batches",
            "4",
            "--steps",
            "4",
            "--batch",
            "4",
            "--seq",
            "16",
            "--eval-batches",
            "1",
            "--report",
            &report.display().to_string(),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{precision} --nodes {nodes}: {err}");
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
        v
    };
    for (precision, codec) in [("bf16", "bf16"), ("f16", "fp16")] {
        let one = run(precision, "1");
        let cluster = run(precision, "2");
        let backend = format!("candle-cpu-{precision}");
        assert_eq!(one["backend"], backend.as_str());
        assert!(
            cluster["backend"].as_str().unwrap().contains(&backend),
            "{}",
            cluster["backend"]
        );
        let codecs = cluster["compression"].as_array().unwrap();
        assert!(!codecs.is_empty());
        for c in codecs {
            assert_eq!(c["codec"]["kind"], codec, "{c}");
        }
        let losses = |v: &serde_json::Value| -> Vec<f64> {
            v["steps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["loss"].as_f64().unwrap())
                .collect()
        };
        let (a, b) = (losses(&one), losses(&cluster));
        assert_eq!(a.len(), 4);
        // The stream's rounding at the cut: up to 2^-8 (bf16) or 2^-11 (f16) of each element, which
        // moved the losses by under 1e-5 (bf16) when measured; ten times that is allowed.
        let rel = if precision == "bf16" { 1e-4 } else { 1e-5 };
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= rel * x.abs(),
                "{precision}: one process {a:?} against the cluster {b:?}"
            );
        }
        assert_eq!(one["loss_scale"], cluster["loss_scale"], "{precision}");
        assert_eq!(
            cluster["loss_scale"].is_null(),
            precision == "bf16",
            "{}",
            cluster["loss_scale"]
        );
    }
}
