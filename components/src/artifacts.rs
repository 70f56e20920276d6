//! Content fingerprint of a local model directory.
//!
//! Which files count (matched on the path relative to the directory; hidden
//! files and folders such as `.git/` and `.cache/` are skipped):
//!
//! | class | files |
//! | --- | --- |
//! | weights | `*.safetensors`, `*.bin`, `*.pt`, `*.pth`, `*.gguf` |
//! | configs and indexes | `*.json` (config, generation config, weight indexes, tokenizer and processor configs) |
//! | tokenizer | `tokenizer*`, `vocab*`, `merges.txt`, `*.model`, `*.tiktoken` |
//! | processor / templates | `*.jinja` (chat templates; processor configs are JSON) |
//! | model code | `*.py` |
//!
//! The digest covers relative paths and contents only: never absolute paths,
//! never timestamps, so a relocated copy keeps its identity and an equal-sized
//! replacement with the same mtime does not. Content is read again on every
//! call; nothing is cached across calls.
//!
//! Byte layout (little-endian, see [`crate::encoding`]):
//!
//! ```text
//! chunk_digest  = SHA-256(chunk bytes)                    chunks of CHUNK_BYTES
//! file_digest   = SHA-256(frame("orbitkv/artifact-file", 1,
//!                   1: size:u64, 2: chunk_bytes:u64, 3: chunk_digest*))
//! dir_digest    = SHA-256(frame("orbitkv/model-artifacts", 1,
//!                   1: count:u64,
//!                   2: (path_len:u64 ‖ path utf8 '/'-separated ‖ file_digest)*  sorted by path))
//! ```
//!
//! Chunks are hashed in parallel (rayon), so one large safetensors file uses
//! every core; each chunk streams through a small buffer.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::encoding::{Digest32, Frame, put_str, put_u64};
use crate::identity::IdentityError;
use sha2::{Digest as _, Sha256};

/// Files are split into independently hashed chunks of this size.
pub const CHUNK_BYTES: u64 = 64 << 20;
const READ_BUF_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactClass {
    Weights,
    Config,
    Tokenizer,
    Template,
    Code,
}

/// Classifies a file by its name; `None` means it does not affect the
/// computation (README, licence, images, ...).
pub fn classify(file_name: &str) -> Option<ArtifactClass> {
    let ext = file_name.rsplit_once('.').map(|(_, e)| e).unwrap_or("");
    match ext {
        "safetensors" | "bin" | "pt" | "pth" | "gguf" => Some(ArtifactClass::Weights),
        "json" => Some(ArtifactClass::Config),
        "model" | "tiktoken" => Some(ArtifactClass::Tokenizer),
        "jinja" => Some(ArtifactClass::Template),
        "py" => Some(ArtifactClass::Code),
        _ if file_name.starts_with("tokenizer")
            || file_name.starts_with("vocab")
            || file_name == "merges.txt" =>
        {
            Some(ArtifactClass::Tokenizer)
        }
        _ => None,
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ArtifactFile {
    /// Relative, `/`-separated.
    pub path: String,
    pub class: ArtifactClass,
    pub bytes: u64,
    #[serde(serialize_with = "crate::encoding::serialize_hex")]
    pub digest: Digest32,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DirectoryFingerprint {
    #[serde(serialize_with = "crate::encoding::serialize_hex")]
    pub digest: Digest32,
    pub files: Vec<ArtifactFile>,
    pub bytes_hashed: u64,
}

struct Pending {
    path: String,
    abs: PathBuf,
    class: ArtifactClass,
    bytes: u64,
}

/// Lists the artifact files under `dir`, sorted by relative path.
fn list(dir: &Path) -> Result<Vec<Pending>, IdentityError> {
    let io = |source: std::io::Error| IdentityError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(dir).map_err(io)?;
    if !meta.is_dir() {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::NotADirectory,
            "not a directory",
        )));
    }
    let mut out = Vec::new();
    let walker = walkdir::WalkDir::new(dir)
        .follow_links(true)
        .sort_by_file_name()
        .into_iter()
        .filter_entry(|e| e.depth() == 0 || !e.file_name().to_string_lossy().starts_with('.'));
    for entry in walker {
        let entry = entry.map_err(|e| IdentityError::Io {
            path: e.path().unwrap_or(dir).to_path_buf(),
            source: e.into(),
        })?;
        if !entry.file_type().is_file() {
            continue;
        }
        let rel = entry
            .path()
            .strip_prefix(dir)
            .expect("walkdir yields children of its root");
        let Some(rel_str) = rel.to_str() else {
            return Err(IdentityError::NonUtf8Path(entry.path().to_path_buf()));
        };
        let name = entry.file_name().to_str().unwrap_or_default();
        let Some(class) = classify(name) else {
            continue;
        };
        let bytes = entry
            .metadata()
            .map_err(|e| IdentityError::Io {
                path: entry.path().to_path_buf(),
                source: e.into(),
            })?
            .len();
        out.push(Pending {
            path: rel_str.replace(std::path::MAIN_SEPARATOR, "/"),
            abs: entry.path().to_path_buf(),
            class,
            bytes,
        });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

fn hash_chunk(file: &File, path: &Path, offset: u64, len: u64) -> Result<Digest32, IdentityError> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; READ_BUF_BYTES.min(len as usize).max(1)];
    let mut done = 0u64;
    while done < len {
        let want = ((len - done) as usize).min(buf.len());
        let n = file
            .read_at(&mut buf[..want], offset + done)
            .map_err(|source| IdentityError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        if n == 0 {
            return Err(IdentityError::FileChanged(path.to_path_buf()));
        }
        hasher.update(&buf[..n]);
        done += n as u64;
    }
    Ok(hasher.finalize().into())
}

/// Fingerprints a model directory by content. `progress` is called with the
/// number of bytes just hashed, from worker threads.
pub fn fingerprint_dir(
    dir: &Path,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<DirectoryFingerprint, IdentityError> {
    let files = list(dir)?;
    if !files.iter().any(|f| f.class == ArtifactClass::Weights) {
        return Err(IdentityError::NoWeights(dir.to_path_buf()));
    }
    let handles = files
        .iter()
        .map(|f| {
            File::open(&f.abs).map_err(|source| IdentityError::Io {
                path: f.abs.clone(),
                source,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // One task per (file, chunk): a single huge weight file still spreads
    // across every core.
    let tasks: Vec<(usize, u64)> = files
        .iter()
        .enumerate()
        .flat_map(|(i, f)| (0..f.bytes.div_ceil(CHUNK_BYTES).max(1)).map(move |c| (i, c)))
        .collect();
    let chunk_digests = tasks
        .par_iter()
        .map(|&(i, c)| {
            let f = &files[i];
            let offset = c * CHUNK_BYTES;
            let len = (f.bytes - offset.min(f.bytes)).min(CHUNK_BYTES);
            let d = hash_chunk(&handles[i], &f.abs, offset, len)?;
            progress(len);
            Ok(d)
        })
        .collect::<Result<Vec<Digest32>, IdentityError>>()?;

    let mut out_files = Vec::with_capacity(files.len());
    let mut dir_body = Vec::new();
    put_u64(&mut dir_body, files.len() as u64);
    let mut listing = Vec::new();
    let mut next = 0;
    for (i, f) in files.iter().enumerate() {
        // A file that grew or shrank while we read it has no single content.
        let now = handles[i]
            .metadata()
            .map_err(|source| IdentityError::Io {
                path: f.abs.clone(),
                source,
            })?
            .len();
        if now != f.bytes {
            return Err(IdentityError::FileChanged(f.abs.clone()));
        }
        let n = f.bytes.div_ceil(CHUNK_BYTES).max(1) as usize;
        let mut size = Vec::new();
        put_u64(&mut size, f.bytes);
        let mut frame = Frame::new("orbitkv/artifact-file", 1);
        frame
            .field(1, &size)
            .field(2, &CHUNK_BYTES.to_le_bytes())
            .field(3, &chunk_digests[next..next + n].concat());
        next += n;
        let digest = frame.sha256();
        put_str(&mut listing, &f.path);
        listing.extend_from_slice(&digest);
        out_files.push(ArtifactFile {
            path: f.path.clone(),
            class: f.class,
            bytes: f.bytes,
            digest,
        });
    }
    let mut frame = Frame::new("orbitkv/model-artifacts", 1);
    frame.field(1, &dir_body).field(2, &listing);
    Ok(DirectoryFingerprint {
        digest: frame.sha256(),
        bytes_hashed: files.iter().map(|f| f.bytes).sum(),
        files: out_files,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        for (name, class) in [
            (
                "model-00001-of-00002.safetensors",
                Some(ArtifactClass::Weights),
            ),
            ("pytorch_model.bin", Some(ArtifactClass::Weights)),
            ("consolidated.pth", Some(ArtifactClass::Weights)),
            ("model.gguf", Some(ArtifactClass::Weights)),
            ("model.safetensors.index.json", Some(ArtifactClass::Config)),
            ("config.json", Some(ArtifactClass::Config)),
            ("tokenizer.json", Some(ArtifactClass::Config)),
            ("tokenizer.model", Some(ArtifactClass::Tokenizer)),
            ("merges.txt", Some(ArtifactClass::Tokenizer)),
            ("vocab.txt", Some(ArtifactClass::Tokenizer)),
            ("cl100k.tiktoken", Some(ArtifactClass::Tokenizer)),
            ("chat_template.jinja", Some(ArtifactClass::Template)),
            ("modeling_foo.py", Some(ArtifactClass::Code)),
            ("README.md", None),
            ("LICENSE", None),
            (".gitattributes", None),
            ("notes.txt", None),
        ] {
            assert_eq!(classify(name), class, "{name}");
        }
    }
}
