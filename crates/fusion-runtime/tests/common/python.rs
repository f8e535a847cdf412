//! Python compute nodes (`python/`, the `fusionllm-node` package) as child processes of a test:
//! the interpreter of the virtual environment `.ci/run` makes, the node's certificate written to
//! a private directory, and the process reaped (or killed) by the test.

use fusion_transport::NodeIdentity;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The interpreter with `fusionllm_node` installed: `$FUSIONLLM_PYTHON`, else the virtual
/// environment `target/pyenv`, made here (`python3 -m venv`, then `pip install ./python`: numpy,
/// grpcio, protobuf and the stubs generated from `proto/`) when it cannot import the package.
/// None (the test skips) outside CI when that fails; under `CI=true` it fails the test.
pub fn interpreter() -> Option<PathBuf> {
    static READY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match READY.get_or_init(prepare) {
        Ok(p) => Some(p.clone()),
        Err(why) if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("the Python node is required under CI=true: {why}")
        }
        Err(why) => {
            eprintln!("skipped: no Python node ({why})");
            None
        }
    }
}

fn imports_the_node(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import fusionllm_node.node"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or("")
    ))
}

fn prepare() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("FUSIONLLM_PYTHON").map(PathBuf::from) {
        return if imports_the_node(&p) {
            Ok(p)
        } else {
            Err(format!("{} cannot import fusionllm_node", p.display()))
        };
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let venv = root.join("target/pyenv");
    let python = venv.join("bin/python");
    // An editable install (the tests run the sources as they are), made again whenever the
    // package's build files or the protocol it generates its stubs from change.
    let stamp = venv.join("fusionllm-install.stamp");
    let want = install_stamp(&root);
    let current = std::fs::read_to_string(&stamp).ok();
    // No stamp: installed by hand or by .ci/run from this tree; take it as it is.
    if current.as_deref().is_none_or(|c| c == want) && imports_the_node(&python) {
        std::fs::write(&stamp, &want).map_err(|e| format!("writing {}: {e}", stamp.display()))?;
        return Ok(python);
    }
    if !python.exists() {
        run(
            Command::new("python3").arg("-m").arg("venv").arg(&venv),
            "python3 -m venv target/pyenv",
        )?;
    }
    run(
        Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--editable"])
            .arg(root.join("python")),
        "pip install --editable ./python",
    )?;
    if !imports_the_node(&python) {
        return Err("target/pyenv cannot import fusionllm_node after pip install ./python".into());
    }
    std::fs::write(&stamp, want).map_err(|e| format!("writing {}: {e}", stamp.display()))?;
    Ok(python)
}

/// What an install depends on: the package's build files and the protocol files, as text.
fn install_stamp(root: &Path) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in [
        "python/setup.py",
        "python/pyproject.toml",
        "proto/fusionllm.proto",
        "proto/fusionllm_control.proto",
    ] {
        f.hash(&mut h);
        std::fs::read(root.join(f)).unwrap_or_default().hash(&mut h);
    }
    format!("{:016x}", h.finish())
}

/// The repository's `python/` directory.
pub fn package_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python")
}

/// A running Python node; killed when dropped.
pub struct PyNode {
    pub name: String,
    pub child: Arc<Mutex<Option<Child>>>,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

/// Writes `id` as `NAME.pem`, `NAME.key` (mode 0600) and `ca.pem` into a new directory.
pub fn write_identity(name: &str, id: &NodeIdentity) -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join(format!("{name}.pem")), &id.cert_pem).expect("cert");
    let key = dir.path().join(format!("{name}.key"));
    std::fs::write(&key, &id.key_pem).expect("key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::fs::write(dir.path().join("ca.pem"), &id.ca_pem).expect("ca");
    dir
}

impl PyNode {
    /// Starts `python -m fusionllm_node` as `name`, joining `broker` with `token`.
    pub fn start(
        python: &Path,
        name: &str,
        broker: &str,
        token: &str,
        id: &NodeIdentity,
        extra: &[&str],
    ) -> PyNode {
        let dir = write_identity(name, id);
        let log = dir.path().join("node.log");
        let out = std::fs::File::create(&log).expect("log");
        let child = Command::new(python)
            .args(["-m", "fusionllm_node", "--broker", broker, "--name", name])
            .arg("--certs")
            .arg(dir.path())
            .args(["--token", token, "--data-listen", "127.0.0.1:0"])
            .args(["--heartbeat-ms", "200", "--peer-timeout", "60"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("start the Python node");
        PyNode {
            name: name.to_string(),
            child: Arc::new(Mutex::new(Some(child))),
            log,
            _dir: dir,
        }
    }

    /// Waits (bounded) for the process to exit; its status and its log.
    pub fn wait(&self, limit: Duration) -> (Option<std::process::ExitStatus>, String) {
        let until = Instant::now() + limit;
        let status = loop {
            let done = {
                let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
                c.as_mut().and_then(|c| c.try_wait().ok().flatten())
            };
            if done.is_some() || Instant::now() > until {
                break done;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        (
            status,
            std::fs::read_to_string(&self.log).unwrap_or_default(),
        )
    }

    /// Sends the process a signal (`TERM`, `STOP`, ...) with kill(1).
    pub fn signal(&self, sig: &str) {
        if let Some(c) = self
            .child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let status = Command::new("kill")
                .arg(format!("-{sig}"))
                .arg(c.id().to_string())
                .status()
                .expect("kill(1)");
            assert!(status.success(), "kill -{sig} {}", c.id());
        }
    }

    /// SIGKILLs the process (as a crash would) and reaps it.
    pub fn kill(&self) {
        if let Some(mut c) = self.child.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PyNode {
    fn drop(&mut self) {
        self.kill();
    }
}
