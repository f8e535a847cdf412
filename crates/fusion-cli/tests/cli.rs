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

    let mut a = args("5");
    a.push("--resume".into());
    a.push(ckpt.display().to_string());
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
}

#[test]
fn bad_arguments_fail_with_a_clear_message() {
    let out = fusionllm(&["train", "--data", "/nonexistent/corpus.txt"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such file"));
    let out = fusionllm(&["train", "--model", "resnet-tiny", "--steps", "1"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("image model"));
    let out = fusionllm(&["model", "summary", "gpt5"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown model preset"));
}

#[test]
fn cert_writes_a_ca_and_node_certificates_and_refuses_to_overwrite() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().display().to_string();
    let run = |extra: &[&str]| {
        let mut args = vec!["cert", "--out", out.as_str(), "--names", "broker,node0"];
        args.extend_from_slice(extra);
        fusionllm(&args)
    };
    let first = run(&[]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    for f in [
        "ca.pem",
        "ca.key",
        "broker.pem",
        "broker.key",
        "node0.pem",
        "node0.key",
    ] {
        let text = std::fs::read_to_string(dir.path().join(f)).unwrap();
        assert!(text.starts_with("-----BEGIN"), "{f}");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("node0.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o077,
            0,
            "private keys must not be readable by others"
        );
    }
    let again = run(&[]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    assert!(run(&["--force"]).status.success());
    let bad = fusionllm(&["cert", "--out", out.as_str(), "--names", "../evil"]);
    assert!(!bad.status.success());
}
