//! A single-member etcd server on loopback, started from Debian's `etcd` binary, for tests and
//! benchmarks that need a real coordination service. Killed and its data removed when dropped.

use crate::error::{CoordError, Result};
use crate::etcd::Etcd;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd.
pub struct LocalEtcd {
    child: Option<Child>,
    pub endpoint: String,
    _data: tempfile::TempDir,
}

/// The etcd binary: `$ETCD`, else `etcd` on the PATH, else Debian's `/usr/bin/etcd`.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ETCD") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

fn free_port() -> Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| CoordError::Unreachable {
            endpoint: "127.0.0.1".into(),
            why: format!("no free port: {e}"),
        })
}

impl LocalEtcd {
    /// For tests that need etcd: a started one, or None (with a note on stderr) where no etcd
    /// is installed — an error instead under `CI=true`, where a missing tool must fail a test,
    /// never skip it.
    pub async fn start_if_installed() -> Result<Option<LocalEtcd>> {
        if etcd_binary().is_some() {
            return LocalEtcd::start().await.map(Some);
        }
        if std::env::var("CI").as_deref() == Ok("true") {
            return Err(CoordError::Endpoint {
                endpoint: "etcd".into(),
                why: "required under CI=true: apt-get install etcd-server".into(),
            });
        }
        eprintln!("skipping: no etcd binary (apt-get install etcd-server)");
        Ok(None)
    }

    /// Starts etcd on two free loopback ports and waits (at most 30 s) until it answers; tried
    /// three times, since a port found free may be taken before etcd binds it.
    pub async fn start() -> Result<LocalEtcd> {
        let mut tries = 0;
        loop {
            tries += 1;
            match LocalEtcd::start_once().await {
                Err(CoordError::Unreachable { .. }) if tries < 3 => continue,
                other => return other,
            }
        }
    }

    async fn start_once() -> Result<LocalEtcd> {
        let binary = etcd_binary().ok_or_else(|| CoordError::Endpoint {
            endpoint: "etcd".into(),
            why: "no etcd binary (install Debian's etcd-server package, or set ETCD)".into(),
        })?;
        let data = tempfile::tempdir().map_err(|e| CoordError::Endpoint {
            endpoint: "etcd".into(),
            why: format!("a data directory: {e}"),
        })?;
        let (client, peer) = (free_port()?, free_port()?);
        let endpoint = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = Command::new(&binary)
            .arg("--data-dir")
            .arg(data.path().join("member"))
            .args(["--listen-client-urls", &endpoint])
            .args(["--advertise-client-urls", &endpoint])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("default={peer_url}")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| CoordError::Endpoint {
                endpoint: binary.display().to_string(),
                why: format!("starting it: {e}"),
            })?;
        let mut server = LocalEtcd {
            child: Some(child),
            endpoint,
            _data: data,
        };
        server.wait_ready().await?;
        Ok(server)
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let etcd = Etcd::new(&self.endpoint)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match etcd.revision().await {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                return Err(CoordError::Unreachable {
                    endpoint: self.endpoint.clone(),
                    why: format!("etcd exited at start ({status})"),
                });
            }
        }
    }

    /// Kills the server (SIGKILL), as a lost coordination service.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for LocalEtcd {
    fn drop(&mut self) {
        self.kill();
    }
}
