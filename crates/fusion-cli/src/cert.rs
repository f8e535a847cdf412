//! `fusionllm cert`: a private CA and certificates for the broker and every node.

use anyhow::{bail, Context, Result};
use clap::Args;
use fusion_transport::Certificates;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Args)]
pub struct CertArgs {
    /// Directory to write `ca.pem`, `ca.key` and `<name>.pem` / `<name>.key` into.
    #[arg(long)]
    out: PathBuf,
    /// Names to issue certificates for, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "broker,node0,node1,node2,node3"
    )]
    names: Vec<String>,
    /// Host names or IP addresses the broker's certificate is also valid for (nodes' certificates
    /// carry their own name only).
    #[arg(long, value_delimiter = ',')]
    address: Vec<String>,
    /// Overwrite existing files.
    #[arg(long)]
    force: bool,
}

fn write(path: &Path, contents: &str, secret: bool, force: bool) -> Result<()> {
    if path.exists() && !force {
        bail!("{} exists (use --force to overwrite)", path.display());
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let _ = secret;
    let mut f = opts
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    // The mode above applies only to a new file: an overwritten key is made private too.
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("making {} private", path.display()))?;
    }
    f.write_all(contents.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

pub fn run(a: CertArgs) -> Result<()> {
    for n in &a.names {
        if n != "broker" {
            if let Err(why) = fusion_runtime::canonical_node_id(n) {
                bail!("invalid certificate name: {why}");
            }
        }
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let ca = Certificates::new_ca("fusionllm deployment CA")?;
    write(&a.out.join("ca.pem"), &ca.ca_pem, false, a.force)?;
    write(&a.out.join("ca.key"), &ca.ca_key_pem(), true, a.force)?;
    for name in &a.names {
        let addresses: &[String] = if name == "broker" { &a.address } else { &[] };
        let id = ca.issue(name, addresses)?;
        write(
            &a.out.join(format!("{name}.pem")),
            &id.cert_pem,
            false,
            a.force,
        )?;
        write(
            &a.out.join(format!("{name}.key")),
            &id.key_pem,
            true,
            a.force,
        )?;
    }
    println!(
        "wrote a CA and {} certificates to {}",
        a.names.len(),
        a.out.display()
    );
    Ok(())
}
