//! `fusionllm cert`: a private CA and certificates for the broker and every node, and the CA's
//! revocation list. The CA's key and its records live in their own directory (`--ca-dir`,
//! default `<out>-ca`), apart from `--out`, whose files are what is copied to the machines.

use anyhow::{bail, Context, Result};
use clap::Args;
use fusion_transport::time::OffsetDateTime;
use fusion_transport::{Certificates, CA_VALIDITY_DAYS, DEFAULT_VALIDITY_DAYS};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The CA's name in its certificate (a loaded CA must sign with the same name).
const CA_NAME: &str = "fusionllm deployment CA";

#[derive(Args)]
pub struct CertArgs {
    /// Directory to write `ca.pem`, `<name>.pem` / `<name>.key` and `crl.pem` into: what is
    /// copied to the machines (each node needs `ca.pem` and its own pair only).
    #[arg(long)]
    out: PathBuf,
    /// The CA's own directory: its key, the certificates it issued and those it revoked
    /// (default: `<out>-ca`). Keep it off the nodes. An existing CA there issues the new
    /// certificates.
    #[arg(long)]
    ca_dir: Option<PathBuf>,
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
    /// Days the new certificates are valid (at most the CA's own year).
    #[arg(long, default_value_t = DEFAULT_VALIDITY_DAYS,
          value_parser = clap::value_parser!(u32).range(1..=CA_VALIDITY_DAYS as i64))]
    days: u32,
    /// Revoke every certificate issued to these names instead of issuing any, and write the
    /// CA's revocation list to `<out>/crl.pem` (give it to the broker with `--crl`).
    #[arg(long, value_delimiter = ',')]
    revoke: Vec<String>,
    /// Overwrite existing certificate and key files.
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

fn append(path: &Path, line: &str) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    writeln!(f, "{line}").with_context(|| format!("writing {}", path.display()))
}

fn ca_dir(a: &CertArgs) -> Result<PathBuf> {
    if let Some(d) = &a.ca_dir {
        return Ok(d.clone());
    }
    match a.out.file_name() {
        Some(n) => Ok(a.out.with_file_name(format!("{}-ca", n.to_string_lossy()))),
        None => bail!("give the CA's directory with --ca-dir"),
    }
}

/// The CA of `dir`, made there when it has none. A CA key an older version wrote beside the
/// node keys in `out` is moved to `dir` first.
fn open_ca(dir: &Path, out: &Path) -> Result<Certificates> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let (key, pem) = (dir.join("ca.key"), dir.join("ca.pem"));
    let old = out.join("ca.key");
    if !key.exists() && old.exists() {
        std::fs::copy(out.join("ca.pem"), &pem)
            .with_context(|| format!("copying the CA certificate to {}", pem.display()))?;
        let text =
            std::fs::read_to_string(&old).with_context(|| format!("reading {}", old.display()))?;
        write(&key, &text, true, false)?;
        std::fs::remove_file(&old).with_context(|| format!("removing {}", old.display()))?;
        eprintln!(
            "moved the CA key from {} to {}: it does not belong with the nodes' files. It lay \
             beside them, so it may have been copied to nodes, and the certificates it issued \
             before cannot be revoked by name: better make a new CA (a new --out and its -ca \
             directory) and new certificates",
            old.display(),
            key.display()
        );
    }
    if key.exists() != pem.exists() {
        bail!(
            "{} holds only half a CA (ca.key and ca.pem go together): restore the other or remove it",
            dir.display()
        );
    }
    if key.exists() {
        let read = |p: &Path| {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
        };
        return Ok(Certificates::load(CA_NAME, &read(&pem)?, &read(&key)?)?);
    }
    let ca = Certificates::new_ca(CA_NAME)?;
    write(&key, &ca.ca_key_pem(), true, false)?;
    if let Err(e) = write(&pem, &ca.ca_pem, false, false) {
        let _ = std::fs::remove_file(&key);
        return Err(e);
    }
    Ok(ca)
}

pub fn run(a: CertArgs) -> Result<()> {
    let dir = ca_dir(&a)?;
    if !a.revoke.is_empty() {
        return revoke(&a, &dir);
    }
    for n in &a.names {
        if n != fusion_transport::BROKER_NAME {
            if let Err(why) = fusion_runtime::canonical_node_id(n) {
                bail!("invalid certificate name: {why}");
            }
        }
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let ca = open_ca(&dir, &a.out)?;
    let ca_pem = a.out.join("ca.pem");
    let same = std::fs::read_to_string(&ca_pem).is_ok_and(|p| p == ca.ca_pem);
    if !same {
        write(&ca_pem, &ca.ca_pem, false, a.force)?;
    }
    let now = OffsetDateTime::now_utc();
    let until = now + fusion_transport::time::Duration::days(a.days.into());
    for name in &a.names {
        let addresses: &[String] = if name == fusion_transport::BROKER_NAME {
            &a.address
        } else {
            &[]
        };
        let (id, issued) = ca.issue_for(name, addresses, now, until)?;
        let out = |ext: &str| a.out.join(format!("{name}.{ext}"));
        write(&out("pem"), &id.cert_pem, false, a.force)?;
        write(&out("key"), &id.key_pem, true, a.force)?;
        // serial, name, expiry (Unix seconds)
        append(
            &dir.join("issued.tsv"),
            &format!(
                "{}\t{name}\t{}",
                hex(&issued.serial),
                issued.not_after.unix_timestamp()
            ),
        )?;
    }
    println!(
        "wrote {} certificates valid for {} days to {} (the CA's key and records are in {}: keep \
         them off the nodes)",
        a.names.len(),
        a.days,
        a.out.display(),
        dir.display()
    );
    Ok(())
}

/// Revokes every certificate issued to the names in `a.revoke` and writes the CA's new list.
fn revoke(a: &CertArgs, dir: &Path) -> Result<()> {
    if !dir.join("ca.key").exists() {
        bail!(
            "no CA in {} (give its directory with --ca-dir)",
            dir.display()
        );
    }
    let ca = open_ca(dir, &a.out)?;
    let issued = read_table(&dir.join("issued.tsv"))?;
    let revoked_path = dir.join("revoked.tsv");
    let mut revoked = read_table(&revoked_path)?;
    for name in &a.revoke {
        let serials: Vec<&String> = issued
            .iter()
            .filter(|(_, n)| n == name)
            .map(|(s, _)| s)
            .collect();
        if serials.is_empty() {
            bail!("this CA issued no certificate to '{name}'");
        }
        for s in serials {
            if !revoked.iter().any(|(r, _)| r == s) {
                append(&revoked_path, &format!("{s}\t{name}"))?;
                revoked.push((s.clone(), name.clone()));
            }
        }
    }
    let serials = revoked
        .iter()
        .map(|(s, _)| unhex(s))
        .collect::<Result<Vec<_>>>()?;
    let number = revoked.len() as u64 + OffsetDateTime::now_utc().unix_timestamp() as u64;
    let crl = ca.revocation_list(&serials, number)?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let path = a.out.join("crl.pem");
    write(&path, &crl, false, true)?;
    println!(
        "revoked {} certificates in all; wrote {path} (start the broker with --crl {path})",
        serials.len(),
        path = path.display()
    );
    Ok(())
}

/// The (serial, name) rows of one of the CA's tables; none when it does not exist yet.
fn read_table(path: &Path) -> Result<Vec<(String, String)>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let mut f = l.split('\t');
            match (f.next(), f.next()) {
                (Some(s), Some(n)) => Ok((s.to_string(), n.to_string())),
                _ => bail!("{}: malformed line {l:?}", path.display()),
            }
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    if !s.is_ascii() || !s.len().is_multiple_of(2) {
        bail!("serial {s:?} is not hexadecimal");
    }
    (0..s.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&s[i..i + 2], 16)
                .with_context(|| format!("serial {s:?} is not hexadecimal"))
        })
        .collect()
}
