//! Computation identity: which model computation produced a cache.
//!
//! Implements the spec's "Name the computation". The inputs, all required
//! unless marked optional:
//!
//! 1. engine name and release (`vllm`, `0.33.0`): engines hash differently,
//!    so equal model names never share an identity across engines;
//! 2. model artifacts, from exactly one source, in this precedence:
//!    `ORBITKV_MODEL_FINGERPRINT` (operator digest, 64 lowercase hex, skips
//!    artifact reads), a hub reference pinned to a full 40-hex commit, or the
//!    content of a local directory ([`crate::artifacts`]);
//! 3. configuration: the model's `config.json` plus the adapter's overrides.
//!    It always participates, even when an operator digest is given;
//! 4. computation settings (canonical map from the adapter);
//! 5. cache representation (canonical map from the adapter);
//! 6. optional `ORBITKV_CACHE_SCOPE`, which separates tenants; it never
//!    replaces the model fingerprint.
//!
//! Active LoRA/adapters are rejected. An input that cannot be established is
//! an error ([`IdentityError`]); there are no silent defaults.
//!
//! Byte layout of the identity (SHA-256 of one [`Frame`]):
//!
//! ```text
//! frame("orbitkv/computation-identity", 1,
//!   1: engine name (utf8)
//!   2: engine release (utf8)
//!   3: artifacts: 0x01 ‖ dir_digest[32]          (directory content)
//!               | 0x02 ‖ commit (40 lowercase hex ascii)
//!               | 0x03 ‖ operator digest[32]
//!   4: configuration: canonical value of config.json ‖ canonical map of overrides
//!   5: settings: canonical map
//!   6: representation: canonical map
//!   7: cache scope: 0x00 | 0x01 ‖ len:u64 ‖ utf8)
//! ```
//!
//! Canonical values and maps are defined in [`crate::value`].

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::artifacts::{DirectoryFingerprint, fingerprint_dir};
use crate::encoding::{Digest32, Frame, put_str};
use crate::namespace::parse_hex32;
use crate::value::{CanonicalMap, CanonicalValue, encode_map, find_null_in_map};

pub const ENV_MODEL_FINGERPRINT: &str = "ORBITKV_MODEL_FINGERPRINT";
pub const ENV_CACHE_SCOPE: &str = "ORBITKV_CACHE_SCOPE";
const MAX_SCOPE_BYTES: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("artifact path {0:?} is not valid UTF-8")]
    NonUtf8Path(PathBuf),
    #[error("{0} changed while it was being hashed")]
    FileChanged(PathBuf),
    #[error(
        "model directory {0} holds no weight files (*.safetensors, *.bin, *.pt, *.pth, *.gguf); \
         set ORBITKV_MODEL_FINGERPRINT or pass a hub revision if the weights live elsewhere"
    )]
    NoWeights(PathBuf),
    #[error(
        "model directory {0} has no config.json; the configuration always participates in the identity"
    )]
    NoConfig(PathBuf),
    #[error("{path} is not a JSON object: {reason}")]
    BadConfig { path: PathBuf, reason: String },
    #[error(
        "hub revision {0:?} is not a full 40-hex commit SHA (branch names, tags and short SHAs are rejected)"
    )]
    BadHubRevision(String),
    #[error("ORBITKV_MODEL_FINGERPRINT must be exactly 64 lowercase hex digits, got {0:?}")]
    BadFingerprint(String),
    #[error(
        "active adapters are not supported ({0}): LoRA and adapters change the computation per request, \
         so cached state cannot be keyed safely"
    )]
    AdaptersActive(String),
    #[error("identity input `{field}` could not be established: {reason}")]
    Unestablished { field: &'static str, reason: String },
}

/// Where the model artifacts' identity comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArtifactIdentity {
    /// Content digest of a local directory.
    Content(Digest32),
    /// A hub repository pinned to a full commit (40 lowercase hex).
    HubRevision(String),
    /// An operator-asserted deployment digest (`ORBITKV_MODEL_FINGERPRINT`).
    Operator(Digest32),
}

impl ArtifactIdentity {
    fn encode(&self) -> Vec<u8> {
        match self {
            ArtifactIdentity::Content(d) => [&[0x01][..], d].concat(),
            ArtifactIdentity::HubRevision(r) => [&[0x02][..], r.as_bytes()].concat(),
            ArtifactIdentity::Operator(d) => [&[0x03][..], d].concat(),
        }
    }

    pub fn source_name(&self) -> &'static str {
        match self {
            ArtifactIdentity::Content(_) => "directory",
            ArtifactIdentity::HubRevision(_) => "hub_revision",
            ArtifactIdentity::Operator(_) => "operator_fingerprint",
        }
    }

    pub fn value(&self) -> String {
        match self {
            ArtifactIdentity::Content(d) | ArtifactIdentity::Operator(d) => hex::encode(d),
            ArtifactIdentity::HubRevision(r) => r.clone(),
        }
    }
}

/// Validates a hub revision: a full 40-hex commit. Upper-case hex is folded.
pub fn parse_hub_revision(rev: &str) -> Result<String, IdentityError> {
    if rev.len() == 40 && rev.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(rev.to_ascii_lowercase())
    } else {
        Err(IdentityError::BadHubRevision(rev.to_owned()))
    }
}

/// Validates an operator fingerprint: exactly 64 lowercase hex digits.
pub fn parse_operator_fingerprint(value: &str) -> Result<Digest32, IdentityError> {
    parse_hex32(value).ok_or_else(|| IdentityError::BadFingerprint(value.to_owned()))
}

/// Every input of an identity, already established. [`IdentityParts::digest`]
/// is pure: no files, no environment.
#[derive(Debug, Clone, PartialEq)]
pub struct IdentityParts {
    pub engine: String,
    pub engine_release: String,
    pub artifacts: ArtifactIdentity,
    /// Parsed `config.json` (an object).
    pub configuration: CanonicalValue,
    pub config_overrides: CanonicalMap,
    pub settings: CanonicalMap,
    pub representation: CanonicalMap,
    pub cache_scope: Option<String>,
}

fn unestablished(field: &'static str, reason: impl Into<String>) -> IdentityError {
    IdentityError::Unestablished {
        field,
        reason: reason.into(),
    }
}

fn check_map(field: &'static str, map: &CanonicalMap, required: bool) -> Result<(), IdentityError> {
    if required && map.is_empty() {
        return Err(unestablished(field, "the adapter supplied an empty map"));
    }
    if let Some(path) = find_null_in_map(map) {
        return Err(unestablished(field, format!("`{path}` is null")));
    }
    Ok(())
}

impl IdentityParts {
    /// Checks that every input is established and well-formed.
    pub fn validate(&self) -> Result<(), IdentityError> {
        let engine_ok = !self.engine.is_empty()
            && self
                .engine
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
        if !engine_ok {
            return Err(unestablished(
                "engine",
                format!("{:?} is not a lowercase engine name", self.engine),
            ));
        }
        if self.engine_release.is_empty()
            || !self.engine_release.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(unestablished(
                "engine_release",
                format!("{:?} is not a release string", self.engine_release),
            ));
        }
        if !matches!(self.configuration, CanonicalValue::Object(_)) {
            return Err(unestablished(
                "configuration",
                "config.json is not a JSON object",
            ));
        }
        // `null` inside config.json is a legitimate value (e.g. `rope_scaling`),
        // not a gap, so the configuration is not checked for nulls.
        check_map("config_overrides", &self.config_overrides, false)?;
        check_map("settings", &self.settings, true)?;
        check_map("representation", &self.representation, true)?;
        if let Some(scope) = &self.cache_scope {
            validate_scope(scope)?;
        }
        Ok(())
    }

    /// The canonical encoding (see the module docs).
    pub fn encode(&self) -> Result<Vec<u8>, IdentityError> {
        self.validate()?;
        let mut config = Vec::new();
        self.configuration.encode_into(&mut config);
        config.extend_from_slice(&encode_map(&self.config_overrides));
        let mut scope = Vec::new();
        match &self.cache_scope {
            None => scope.push(0x00),
            Some(s) => {
                scope.push(0x01);
                put_str(&mut scope, s);
            }
        }
        let mut frame = Frame::new("orbitkv/computation-identity", 1);
        frame
            .field(1, self.engine.as_bytes())
            .field(2, self.engine_release.as_bytes())
            .field(3, &self.artifacts.encode())
            .field(4, &config)
            .field(5, &encode_map(&self.settings))
            .field(6, &encode_map(&self.representation))
            .field(7, &scope);
        Ok(frame.into_bytes())
    }

    pub fn digest(&self) -> Result<Digest32, IdentityError> {
        Ok(crate::encoding::sha256(&self.encode()?))
    }
}

fn validate_scope(scope: &str) -> Result<(), IdentityError> {
    if scope.is_empty() || scope.len() > MAX_SCOPE_BYTES || scope.chars().any(char::is_control) {
        return Err(unestablished(
            "cache_scope",
            format!(
                "ORBITKV_CACHE_SCOPE must be 1..={MAX_SCOPE_BYTES} bytes without control characters, got {scope:?}"
            ),
        ));
    }
    Ok(())
}

/// What an adapter knows at startup, before any file is read.
#[derive(Debug, Clone, Default)]
pub struct IdentityInputs {
    pub engine: String,
    pub engine_release: String,
    /// Always required: its `config.json` is the configuration input, and
    /// without a hub revision or operator digest its content is hashed.
    pub model_dir: PathBuf,
    pub hub_revision: Option<String>,
    /// Raw value of `ORBITKV_MODEL_FINGERPRINT`, if set.
    pub operator_fingerprint: Option<String>,
    pub config_overrides: CanonicalMap,
    pub settings: CanonicalMap,
    pub representation: CanonicalMap,
    /// Raw value of `ORBITKV_CACHE_SCOPE`, if set.
    pub cache_scope: Option<String>,
    /// Names of active LoRA/adapters; any entry fails closed.
    pub active_adapters: Vec<String>,
}

/// An environment variable's value: `Ok(None)` when unset, an error when set
/// but not UTF-8 (a value we cannot read is not a value we may ignore).
pub fn read_env(name: &'static str) -> Result<Option<String>, IdentityError> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(unestablished(name, "value is not UTF-8")),
    }
}

impl IdentityInputs {
    /// Fills the two environment inputs from the process environment.
    pub fn with_process_env(mut self) -> Result<Self, IdentityError> {
        self.operator_fingerprint = read_env(ENV_MODEL_FINGERPRINT)?;
        self.cache_scope = read_env(ENV_CACHE_SCOPE)?;
        Ok(self)
    }

    /// Establishes every input. Reads `config.json`, and the directory's
    /// content when it is the artifact source. `progress` receives bytes
    /// hashed.
    pub fn resolve(
        &self,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<ResolvedIdentity, IdentityError> {
        if !self.active_adapters.is_empty() {
            return Err(IdentityError::AdaptersActive(
                self.active_adapters.join(", "),
            ));
        }
        if self.model_dir.join("adapter_config.json").is_file() {
            return Err(IdentityError::AdaptersActive(format!(
                "{} is a PEFT adapter directory (adapter_config.json)",
                self.model_dir.display()
            )));
        }
        let configuration = read_config(&self.model_dir)?;
        let mut fingerprint = None;
        let artifacts = if let Some(raw) = &self.operator_fingerprint {
            ArtifactIdentity::Operator(parse_operator_fingerprint(raw)?)
        } else if let Some(rev) = &self.hub_revision {
            ArtifactIdentity::HubRevision(parse_hub_revision(rev)?)
        } else {
            let fp = fingerprint_dir(&self.model_dir, progress)?;
            let d = fp.digest;
            fingerprint = Some(fp);
            ArtifactIdentity::Content(d)
        };
        let parts = IdentityParts {
            engine: self.engine.clone(),
            engine_release: self.engine_release.clone(),
            artifacts,
            configuration,
            config_overrides: self.config_overrides.clone(),
            settings: self.settings.clone(),
            representation: self.representation.clone(),
            cache_scope: self.cache_scope.clone(),
        };
        let digest = parts.digest()?;
        Ok(ResolvedIdentity {
            digest,
            parts,
            fingerprint,
        })
    }
}

fn read_config(dir: &Path) -> Result<CanonicalValue, IdentityError> {
    let path = dir.join("config.json");
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(if dir.is_dir() {
                IdentityError::NoConfig(dir.to_path_buf())
            } else {
                IdentityError::Io {
                    path: dir.to_path_buf(),
                    source: e,
                }
            });
        }
        Err(source) => return Err(IdentityError::Io { path, source }),
    };
    let value: CanonicalValue =
        serde_json::from_slice(&text).map_err(|e| IdentityError::BadConfig {
            path: path.clone(),
            reason: e.to_string(),
        })?;
    if !matches!(value, CanonicalValue::Object(_)) {
        return Err(IdentityError::BadConfig {
            path,
            reason: "top level is not an object".into(),
        });
    }
    Ok(value)
}

/// A computed identity, with what went into it.
#[derive(Debug, Clone)]
pub struct ResolvedIdentity {
    pub digest: Digest32,
    pub parts: IdentityParts,
    /// Present when the directory content was hashed.
    pub fingerprint: Option<DirectoryFingerprint>,
}

/// One line of the `identity` command's `inputs` list.
#[derive(Debug, Clone, Serialize)]
pub struct InputSummary {
    pub name: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keys: Option<Vec<String>>,
}

impl InputSummary {
    fn new(name: &'static str) -> Self {
        InputSummary {
            name,
            value: None,
            source: None,
            digest: None,
            files: None,
            keys: None,
        }
    }
}

fn map_summary(name: &'static str, map: &CanonicalMap) -> InputSummary {
    InputSummary {
        digest: Some(hex::encode(crate::encoding::sha256(&encode_map(map)))),
        keys: Some(map.keys().cloned().collect()),
        ..InputSummary::new(name)
    }
}

impl ResolvedIdentity {
    /// A readable account of each input, for operators comparing two hosts.
    pub fn summary(&self) -> Vec<InputSummary> {
        let p = &self.parts;
        let mut config = Vec::new();
        p.configuration.encode_into(&mut config);
        vec![
            InputSummary {
                value: Some(p.engine.clone()),
                ..InputSummary::new("engine")
            },
            InputSummary {
                value: Some(p.engine_release.clone()),
                ..InputSummary::new("engine_release")
            },
            InputSummary {
                source: Some(p.artifacts.source_name()),
                value: Some(p.artifacts.value()),
                files: self.fingerprint.as_ref().map(|f| f.files.len()),
                ..InputSummary::new("model_artifacts")
            },
            InputSummary {
                digest: Some(hex::encode(crate::encoding::sha256(&config))),
                ..InputSummary::new("configuration")
            },
            map_summary("config_overrides", &p.config_overrides),
            map_summary("settings", &p.settings),
            map_summary("representation", &p.representation),
            InputSummary {
                value: p.cache_scope.clone(),
                ..InputSummary::new("cache_scope")
            },
        ]
    }
}
