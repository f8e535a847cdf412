//! The local launcher's node processes, supervised: a node that crashes while the job runs is
//! started again (a bounded number of times), as a process supervisor would; all of them are
//! killed when the launcher is done.

use anyhow::{Context, Result};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

/// What to do about a node process that exited while the job runs.
#[derive(Debug, PartialEq, Eq)]
pub enum Decision {
    /// It ended cleanly (the broker released it, or it left): leave it be.
    Done,
    /// It crashed: start it again.
    Restart,
    /// It crashed too often: give up on it (the job goes on without it, or fails).
    GiveUp,
}

/// The restart policy: a clean exit is final, a crash is restarted up to `max` times.
pub fn decide(status: ExitStatus, restarts: u32, max: u32) -> Decision {
    if status.success() {
        Decision::Done
    } else if restarts < max {
        Decision::Restart
    } else {
        Decision::GiveUp
    }
}

struct Supervised {
    name: String,
    child: Child,
    log: PathBuf,
    command: Box<dyn Fn() -> Result<Command> + Send>,
    restarts: u32,
    /// Exited and not to be restarted.
    settled: bool,
}

pub struct Supervisor {
    nodes: Vec<Supervised>,
    max_restarts: u32,
}

impl Supervisor {
    pub fn new(max_restarts: u32) -> Self {
        Supervisor {
            nodes: Vec::new(),
            max_restarts,
        }
    }

    /// Starts a node; `command` builds its command line (again on every restart), with its
    /// output appended to `log`.
    pub fn start(
        &mut self,
        name: &str,
        log: PathBuf,
        command: impl Fn() -> Result<Command> + Send + 'static,
    ) -> Result<()> {
        let child = spawn(&command, &log, name)?;
        self.nodes.push(Supervised {
            name: name.into(),
            child,
            log,
            command: Box::new(command),
            restarts: 0,
            settled: false,
        });
        Ok(())
    }

    /// Restarts the nodes that crashed since the last look; returns what it did, to be shown.
    pub fn poll(&mut self) -> Vec<String> {
        let mut said = Vec::new();
        for n in self.nodes.iter_mut().filter(|n| !n.settled) {
            let Ok(Some(status)) = n.child.try_wait() else {
                continue;
            };
            match decide(status, n.restarts, self.max_restarts) {
                Decision::Done => n.settled = true,
                Decision::GiveUp => {
                    n.settled = true;
                    said.push(format!(
                        "node {} exited ({status}) after {} restarts; not restarting it",
                        n.name, n.restarts
                    ));
                }
                Decision::Restart => match spawn(&n.command, &n.log, &n.name) {
                    Ok(child) => {
                        n.child = child;
                        n.restarts += 1;
                        said.push(format!(
                            "node {} exited ({status}); restarted it (restart {} of {})",
                            n.name, n.restarts, self.max_restarts
                        ));
                    }
                    Err(e) => {
                        n.settled = true;
                        said.push(format!(
                            "node {} exited ({status}); restarting it failed: {e:#}",
                            n.name
                        ));
                    }
                },
            }
        }
        said
    }

    /// Watches the nodes until dropped, reporting restarts through `say`.
    pub async fn watch(&mut self, mut say: impl FnMut(String)) {
        loop {
            for line in self.poll() {
                say(line);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits (at most `limit`) for every node to exit, as they do after the broker's stop.
    pub async fn wait_all(&mut self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < deadline {
            if self
                .nodes
                .iter_mut()
                .all(|n| !matches!(n.child.try_wait(), Ok(None)))
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The last lines of every node's log, for a failed run's post-mortem.
    pub fn print_log_tails(&self) {
        for n in &self.nodes {
            let text = std::fs::read_to_string(&n.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(5).collect();
            eprintln!("--- last lines of {}'s log ({}):", n.name, n.log.display());
            tail.iter().rev().for_each(|l| eprintln!("{l}"));
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if matches!(n.child.try_wait(), Ok(None)) {
                let _ = n.child.kill();
                let _ = n.child.wait();
            }
        }
    }
}

fn spawn(command: &dyn Fn() -> Result<Command>, log: &PathBuf, name: &str) -> Result<Child> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("opening {}", log.display()))?;
    command()?
        .stdin(std::process::Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .spawn()
        .with_context(|| format!("starting node {name}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn crashes_are_restarted_a_bounded_number_of_times_and_clean_exits_never() {
        let clean = ExitStatus::from_raw(0);
        let failed = ExitStatus::from_raw(1 << 8);
        let killed = ExitStatus::from_raw(9);
        assert_eq!(decide(clean, 0, 3), Decision::Done);
        assert_eq!(decide(failed, 0, 3), Decision::Restart);
        assert_eq!(decide(killed, 2, 3), Decision::Restart);
        assert_eq!(decide(killed, 3, 3), Decision::GiveUp);
        assert_eq!(decide(failed, 0, 0), Decision::GiveUp);
    }

    #[test]
    fn a_crashed_process_is_started_again_and_a_clean_one_is_left() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Supervisor::new(2);
        s.start("crasher", dir.path().join("c.log"), || {
            let mut c = Command::new("sh");
            c.args(["-c", "echo run; exit 3"]);
            Ok(c)
        })
        .expect("start");
        s.start("clean", dir.path().join("ok.log"), || {
            Ok(Command::new("true"))
        })
        .expect("start");
        let mut said = Vec::new();
        for _ in 0..200 {
            said.extend(s.poll());
            if s.nodes.iter().all(|n| n.settled) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(s.nodes.iter().all(|n| n.settled), "{said:?}");
        assert_eq!(s.nodes[0].restarts, 2, "{said:?}");
        assert_eq!(s.nodes[1].restarts, 0, "{said:?}");
        assert!(
            said.last().is_some_and(|l| l.contains("not restarting")),
            "{said:?}"
        );
        let log = std::fs::read_to_string(dir.path().join("c.log")).expect("log");
        assert_eq!(log.lines().count(), 3, "one line per start: {log}");
    }
}
