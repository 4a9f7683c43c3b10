//! Layered configuration, shared by both binaries: flags, environment and a TOML file,
//! each field parsed once into its type, with every problem reported at once.
//!
//! Precedence, highest first: command-line flag, environment variable (`<PREFIX><FIELD>`,
//! upper case), TOML file (`--config`), built-in default. Each layer is read as text per
//! field and parsed once, here, so a bad value in any layer is reported with the layer it
//! came from; unknown TOML keys and unknown prefixed variables are errors (a typo must not
//! silently fall back to a default).
//!
//! A binary describes its fields with a [`Schema`] (a table of [`Field`]s and how the
//! parsed [`Values`] become its configuration type). Pure: callers hand in the file's
//! text and the environment; nothing here reads either.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;

/// Where a value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Layer {
    /// Not a value's layer: a problem found when the files a value names were checked.
    Check,
    Default,
    File,
    Env,
    Flag,
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Check => "file check",
            Self::Default => "default",
            Self::File => "config file",
            Self::Env => "environment",
            Self::Flag => "command line",
        })
    }
}

/// A field's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Text that must not be empty.
    Text,
    /// Text that may be empty (an optional value).
    OptText,
    /// `ip:port`.
    Addr,
    /// `ip:port` or `dns-name:port` (a name is resolved where it is used, not here), or
    /// a comma-separated list of them (shards: at most 64, no repeats).
    HostPort,
    /// A whole number in `min..=max`.
    Int { min: u64, max: u64 },
}

/// A field: name (TOML key; flag `--name-with-dashes`; env upper case), kind, default
/// (none: required), help.
pub type Field = (&'static str, Kind, Option<&'static str>, &'static str);

/// One binary's configuration.
pub trait Schema {
    /// The validated configuration.
    type Output;
    /// Environment variable prefix, e.g. `RINGWATCH_SHIPPER_`.
    const ENV_PREFIX: &'static str;
    /// Every field, in documentation order.
    const FIELDS: &'static [Field];
    /// Fields shared with the other binary (e.g. [`crate::psi::CONFIG_FIELDS`]), after
    /// [`Self::FIELDS`].
    const SHARED_FIELDS: &'static [Field] = &[];

    /// Turns parsed values into the configuration, adding the problems only the whole
    /// can see (contradictions) to `values` (see [`Values::problem`]).
    fn build(values: &mut Values) -> Option<Self::Output>;

    /// The problems of the files a valid configuration names (they are read here, unlike
    /// everything else in this module).
    fn check_files(_config: &Self::Output) -> Vec<ConfigError> {
        Vec::new()
    }
}

/// [`load`] for a binary's `main`: the problems printed to stderr after `bin: `, and the
/// exit code for them (2, a configuration error) as the error.
///
/// # Errors
/// The configuration has problems (already printed).
pub fn load_or_exit<S: Schema>(
    bin: &str,
    config_file: Option<&str>,
    flag: impl Fn(&str) -> Option<String>,
) -> Result<S::Output, std::process::ExitCode> {
    load::<S>(config_file, flag).map_err(|e| {
        eprint!("{bin}: {e}");
        std::process::ExitCode::from(2)
    })
}

/// A process's configuration: the TOML file at `config_file` (if given), the
/// environment, and the command line (`flag` gives a field's value, by field name); then
/// validated, and the files it names checked.
///
/// # Errors
/// Every problem found (an unreadable `--config` file is one), each with its field and
/// layer; the caller prints them and exits 2.
pub fn load<S: Schema>(
    config_file: Option<&str>,
    flag: impl Fn(&str) -> Option<String>,
) -> Result<S::Output, ConfigErrors> {
    let mut inputs = Inputs::<S>::default();
    if let Some(path) = config_file {
        match std::fs::read_to_string(path) {
            Ok(text) => inputs.file(&text),
            Err(e) => {
                return Err(ConfigErrors(vec![ConfigError {
                    field: "config".into(),
                    layer: Layer::Flag,
                    message: format!("cannot read {path}: {e}"),
                }]));
            }
        }
    }
    let env: Vec<(String, String)> = std::env::vars().collect();
    inputs.env(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    for &(name, ..) in all_fields::<S>() {
        if let Some(v) = flag(name) {
            inputs.flag(name, &v);
        }
    }
    let out = inputs.validate()?;
    let problems = S::check_files(&out);
    if problems.is_empty() { Ok(out) } else { Err(ConfigErrors(problems)) }
}

/// One problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub layer: Layer,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.field, self.layer, self.message)
    }
}

/// Every problem found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} configuration problem(s):", self.0.len())?;
        for e in &self.0 {
            writeln!(f, "  {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// The raw inputs, one text value per field and layer.
#[derive(Debug, Clone)]
pub struct Inputs<S> {
    values: BTreeMap<&'static str, (Layer, String)>,
    errors: Vec<ConfigError>,
    schema: PhantomData<S>,
}

impl<S> Default for Inputs<S> {
    fn default() -> Self {
        Self { values: BTreeMap::new(), errors: Vec::new(), schema: PhantomData }
    }
}

/// The environment variable of a field.
/// A schema's fields: its own, then the shared ones.
pub fn all_fields<S: Schema>() -> impl Iterator<Item = &'static Field> {
    S::FIELDS.iter().chain(S::SHARED_FIELDS)
}

#[must_use]
pub fn env_name(prefix: &str, field: &str) -> String {
    format!("{prefix}{}", field.to_ascii_uppercase())
}

impl<S: Schema> Inputs<S> {
    fn field(name: &str) -> Option<&'static str> {
        all_fields::<S>().map(|f| f.0).find(|&f| f == name)
    }

    fn set(&mut self, name: &'static str, layer: Layer, value: String) {
        if self.values.get(name).is_none_or(|(l, _)| *l <= layer) {
            self.values.insert(name, (layer, value));
        }
    }

    /// A TOML file's text.
    pub fn file(&mut self, text: &str) {
        let table = match text.parse::<toml::Table>() {
            Ok(t) => t,
            Err(e) => {
                self.errors.push(ConfigError {
                    field: "(file)".into(),
                    layer: Layer::File,
                    message: e.to_string().trim().to_string(),
                });
                return;
            }
        };
        for (key, value) in table {
            let Some(name) = Self::field(&key) else {
                self.errors.push(ConfigError { field: key, layer: Layer::File, message: "unknown key".into() });
                continue;
            };
            let text = match value {
                toml::Value::String(s) => s,
                toml::Value::Integer(i) => i.to_string(),
                other => {
                    self.errors.push(ConfigError {
                        field: key,
                        layer: Layer::File,
                        message: format!("expected a string or an integer, found {}", other.type_str()),
                    });
                    continue;
                }
            };
            self.set(name, Layer::File, text);
        }
    }

    /// The environment (only variables with the schema's prefix are looked at; unknown
    /// ones with that prefix are errors).
    pub fn env<'a>(&mut self, vars: impl IntoIterator<Item = (&'a str, &'a str)>) {
        for (k, v) in vars {
            let Some(rest) = k.strip_prefix(S::ENV_PREFIX) else { continue };
            match Self::field(&rest.to_ascii_lowercase()) {
                Some(name) => self.set(name, Layer::Env, v.to_string()),
                None => self.errors.push(ConfigError {
                    field: k.to_string(),
                    layer: Layer::Env,
                    message: "unknown variable".into(),
                }),
            }
        }
    }

    /// A command-line value for `name` (a field name).
    pub fn flag(&mut self, name: &str, value: &str) {
        match Self::field(name) {
            Some(f) => self.set(f, Layer::Flag, value.to_string()),
            None => self.errors.push(ConfigError {
                field: name.to_string(),
                layer: Layer::Flag,
                message: "unknown option".into(),
            }),
        }
    }

    /// Parses every field, then builds the configuration, reporting every problem.
    ///
    /// # Errors
    /// All problems found, each with its field and layer.
    pub fn validate(&self) -> Result<S::Output, ConfigErrors> {
        let mut v = Values { errors: self.errors.clone(), ..Values::default() };
        for &(name, kind, default, _) in all_fields::<S>() {
            let Some((layer, value)) =
                self.values.get(name).cloned().or_else(|| default.map(|d| (Layer::Default, d.to_string())))
            else {
                // A value that was given but unreadable is already reported.
                if !self.errors.iter().any(|e| e.field == name) {
                    v.errors.push(ConfigError {
                        field: name.into(),
                        layer: Layer::Default,
                        message: "required".into(),
                    });
                }
                continue;
            };
            v.layers.insert(name, layer);
            let bad = |message: String| ConfigError { field: name.into(), layer, message };
            match kind {
                Kind::Text if value.trim().is_empty() => v.errors.push(bad("must not be empty".into())),
                Kind::Text | Kind::OptText => {
                    v.text.insert(name, value);
                }
                Kind::Addr => match value.parse::<SocketAddr>() {
                    Ok(a) => {
                        v.addrs.insert(name, a);
                    }
                    Err(_) => v.errors.push(bad(format!("{value:?} is not ip:port"))),
                },
                Kind::HostPort => match host_ports(&value) {
                    Ok(()) => {
                        v.text.insert(name, value);
                    }
                    Err(why) => v.errors.push(bad(format!("{value:?} is not host:port: {why}"))),
                },
                Kind::Int { min, max } => match value.trim().parse::<u64>() {
                    Ok(x) if (min..=max).contains(&x) => {
                        v.ints.insert(name, x);
                    }
                    Ok(x) => v.errors.push(bad(format!("{x} is outside {min}..={max}"))),
                    Err(_) => v.errors.push(bad(format!("{value:?} is not a whole number"))),
                },
            }
        }
        let out = S::build(&mut v);
        match out {
            Some(o) if v.errors.is_empty() => Ok(o),
            _ if v.errors.is_empty() => Err(ConfigErrors(vec![ConfigError {
                field: "(internal)".into(),
                layer: Layer::Default,
                message: "validated fields missing".into(),
            }])),
            _ => Err(ConfigErrors(v.errors)),
        }
    }
}

/// The parsed fields (those that parsed), for [`Schema::build`].
#[derive(Debug, Default, Clone)]
pub struct Values {
    errors: Vec<ConfigError>,
    layers: BTreeMap<&'static str, Layer>,
    text: BTreeMap<&'static str, String>,
    ints: BTreeMap<&'static str, u64>,
    addrs: BTreeMap<&'static str, SocketAddr>,
}

impl Values {
    /// A text field (empty optional text included), if it parsed.
    #[must_use]
    pub fn text(&self, name: &str) -> Option<&str> {
        self.text.get(name).map(String::as_str)
    }

    /// An optional text field: `None` when empty or blank.
    #[must_use]
    pub fn opt_text(&self, name: &str) -> Option<&str> {
        self.text(name).map(str::trim).filter(|t| !t.is_empty())
    }

    /// A whole-number field, if it parsed.
    #[must_use]
    pub fn int(&self, name: &str) -> Option<u64> {
        self.ints.get(name).copied()
    }

    /// An address field, if it parsed.
    #[must_use]
    pub fn addr(&self, name: &str) -> Option<SocketAddr> {
        self.addrs.get(name).copied()
    }

    /// Which layer a field's value came from.
    #[must_use]
    pub fn layer(&self, name: &str) -> Layer {
        self.layers.get(name).copied().unwrap_or(Layer::Default)
    }

    /// Whether a field's value was given (by any layer but the default).
    #[must_use]
    pub fn given(&self, name: &str) -> bool {
        self.layer(name) != Layer::Default
    }

    /// Reports a problem with `field` (attributed to the layer its value came from).
    pub fn problem(&mut self, field: &str, message: impl Into<String>) {
        let layer = self.layer(field);
        self.errors.push(ConfigError { field: field.to_owned(), layer, message: message.into() });
    }

    /// Whether problems were found so far.
    #[must_use]
    pub fn has_problems(&self) -> bool {
        !self.errors.is_empty()
    }
}

/// Whether `value` is `ip:port` or `dns-name:port` (RFC 1123 labels, port 1..=65535).
///
/// # Errors
/// What is wrong with it.
pub fn host_port(value: &str) -> Result<(), String> {
    if value.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let (host, port) = value.rsplit_once(':').ok_or("no :port")?;
    match port.parse::<u16>() {
        Ok(0) | Err(_) => return Err(format!("port {port:?} is not 1..=65535")),
        Ok(_) => {}
    }
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() || host.len() > 253 {
        return Err("the host name must be 1..=253 characters".into());
    }
    for label in host.split('.') {
        let ok = (1..=63).contains(&label.len())
            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-');
        if !ok {
            return Err(format!("{label:?} is not a DNS label (an IPv6 address needs [brackets])"));
        }
    }
    Ok(())
}

/// Checks a comma-separated list of [`host_port`]s: 1 to 64, none repeated.
///
/// # Errors
/// Why it is not such a list.
pub fn host_ports(value: &str) -> Result<(), String> {
    let items: Vec<&str> = value.split(',').map(str::trim).collect();
    if items.len() > 64 {
        return Err(format!("{} addresses: 64 at most", items.len()));
    }
    for (i, item) in items.iter().enumerate() {
        host_port(item).map_err(|why| if items.len() > 1 { format!("{item:?}: {why}") } else { why })?;
        if items.get(..i).is_some_and(|before| before.contains(item)) {
            return Err(format!("{item:?} is listed twice"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::host_port;

    #[test]
    fn a_list_of_shards_is_checked_item_by_item() {
        assert!(super::host_ports("a:1,b:2 , 127.0.0.1:3").is_ok());
        assert!(super::host_ports("a:1,a:1").unwrap_err().contains("twice"));
        assert!(super::host_ports("a:1,,b:2").is_err());
        assert!(super::host_ports("a:1,b").unwrap_err().contains("\"b\""));
    }

    #[test]
    fn host_port_takes_addresses_and_dns_names_and_refuses_the_rest() {
        for ok in ["127.0.0.1:4433", "[::1]:4433", "aggregator:4433", "aggregator.ringwatch.svc.cluster.local.:4433"] {
            assert_eq!(host_port(ok), Ok(()), "{ok}");
        }
        for bad in ["aggregator", "aggregator:0", "aggregator:65536", ":4433", "-x.y:1", "a..b:1", "::1:4433", "a_b:1"]
        {
            assert!(host_port(bad).is_err(), "{bad}");
        }
    }
}
