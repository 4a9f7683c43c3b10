//! `aggregator certs init`: a development certificate set (rcgen, ECDSA P-256).
//!
//! Files written into the directory: `ca.pem`/`ca.key` (the dev CA), `aggregator.pem`/
//! `aggregator.key` (server; SANs `aggregator`, `localhost`, 127.0.0.1, ::1) and per node
//! `<name>.pem`/`<name>.key`, a client certificate whose only DNS SAN is the node's name —
//! the name the aggregator reports it under and hashes into its `node_id`. Node names
//! are `node-00`, `node-01`, … (the simulator's names).
//!
//! For production, issue node certificates from your own CA with the node's name as the
//! DNS SAN (deploy/README.md).

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

/// Errors writing a certificate set.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "{dir} is not empty ({files} entries): refusing to replace a certificate set (node certificates signed by the old CA would be left beside a new one); give --force to replace the whole set"
    )]
    NotEmpty { dir: PathBuf, files: usize },
}

/// The paths of a certificate set.
#[derive(Debug, Clone)]
pub struct CertSet {
    pub dir: PathBuf,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

impl CertSet {
    /// The files of a set in `dir` (whether or not they exist yet).
    #[must_use]
    pub fn at(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            ca: dir.join("ca.pem"),
            server_cert: dir.join("aggregator.pem"),
            server_key: dir.join("aggregator.key"),
        }
    }

    /// A node's certificate and key.
    #[must_use]
    pub fn node(&self, name: &str) -> (PathBuf, PathBuf) {
        (self.dir.join(format!("{name}.pem")), self.dir.join(format!("{name}.key")))
    }
}

/// The name of node `i` (as the simulator names it).
#[must_use]
pub fn node_name(i: u32) -> String {
    format!("node-{i:02}")
}

fn write(path: PathBuf, text: &str) -> Result<(), CertError> {
    std::fs::write(&path, text).map_err(|source| CertError::Io { path, source })
}

/// Writes a private key readable by its owner only (0600, from creation on).
fn write_key(path: PathBuf, text: &str) -> Result<(), CertError> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = |source| CertError::Io { path: path.clone(), source };
    let mut f =
        std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&path).map_err(io)?;
    // An existing file keeps its mode through `open`: set it.
    f.set_permissions(std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)
}

/// [`init`], refusing a directory that is not empty unless `force`, which removes the
/// old set's `.pem` and `.key` files first (the whole set is replaced: no node
/// certificate of an old CA stays beside the new one).
///
/// # Errors
/// As [`init`], or [`CertError::NotEmpty`].
pub fn init_checked(dir: &Path, nodes: &[String], force: bool) -> Result<CertSet, CertError> {
    let io = |source| CertError::Io { path: dir.to_path_buf(), source };
    if dir.exists() {
        let entries: Vec<PathBuf> =
            std::fs::read_dir(dir).map_err(io)?.filter_map(Result::ok).map(|e| e.path()).collect();
        if !entries.is_empty() && !force {
            return Err(CertError::NotEmpty { dir: dir.to_path_buf(), files: entries.len() });
        }
        for p in entries.iter().filter(|p| p.extension().is_some_and(|e| e == "pem" || e == "key")) {
            std::fs::remove_file(p).map_err(|source| CertError::Io { path: p.clone(), source })?;
        }
    }
    init(dir, nodes)
}

/// A CA (self-signed) whose certificates are written as `<stem>.pem`/`<stem>.key`.
fn new_ca(dir: &Path, stem: &str, common_name: &str) -> Result<CertifiedIssuer<'static, KeyPair>, CertError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let key = KeyPair::generate()?;
    let key_pem = key.serialize_pem();
    let ca = CertifiedIssuer::self_signed(params, key)?;
    write(dir.join(format!("{stem}.pem")), &ca.pem())?;
    write_key(dir.join(format!("{stem}.key")), &key_pem)?;
    Ok(ca)
}

/// Issues a certificate for `sans` signed by `ca`, written as `<stem>.pem`/`<stem>.key`.
fn issue(
    dir: &Path,
    stem: &str,
    ca: &CertifiedIssuer<'static, KeyPair>,
    sans: &[SanType],
    usage: ExtendedKeyUsagePurpose,
) -> Result<(), CertError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.subject_alt_names = sans.to_vec();
    params.distinguished_name.push(DnType::CommonName, stem);
    params.extended_key_usages = vec![usage];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, ca)?;
    write(dir.join(format!("{stem}.pem")), &cert.pem())?;
    write_key(dir.join(format!("{stem}.key")), &key.serialize_pem())?;
    Ok(())
}

fn dns(name: &str) -> Result<SanType, CertError> {
    Ok(SanType::DnsName(name.try_into()?))
}

/// Writes a dev CA, the server certificate and a client certificate per node name.
///
/// # Errors
/// The directory cannot be written, or a name is not a valid DNS name.
pub fn init(dir: &Path, nodes: &[String]) -> Result<CertSet, CertError> {
    std::fs::create_dir_all(dir).map_err(|source| CertError::Io { path: dir.to_path_buf(), source })?;
    let ca = new_ca(dir, "ca", "ringwatch dev CA")?;
    let server_sans = [
        dns("aggregator")?,
        dns("localhost")?,
        SanType::IpAddress([127, 0, 0, 1].into()),
        SanType::IpAddress(std::net::Ipv6Addr::LOCALHOST.into()),
    ];
    issue(dir, "aggregator", &ca, &server_sans, ExtendedKeyUsagePurpose::ServerAuth)?;
    for name in nodes {
        issue(dir, name, &ca, &[dns(name)?], ExtendedKeyUsagePurpose::ClientAuth)?;
    }
    Ok(CertSet::at(dir))
}

/// A second, unrelated CA with its own client certificates (hostile-peer tests: a
/// certificate from another CA must be refused).
///
/// # Errors
/// As [`init`].
pub fn init_foreign(dir: &Path, nodes: &[String]) -> Result<(), CertError> {
    std::fs::create_dir_all(dir).map_err(|source| CertError::Io { path: dir.to_path_buf(), source })?;
    let ca = new_ca(dir, "ca", "some other CA")?;
    for name in nodes {
        issue(dir, name, &ca, &[dns(name)?], ExtendedKeyUsagePurpose::ClientAuth)?;
    }
    Ok(())
}
