//! Models already on this machine: Perch's models directory and the Hugging Face cache.

use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::HubError;

/// Where a local model was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelSource {
    /// Perch's models directory.
    Perch,
    /// The Hugging Face cache.
    HuggingFace,
}

/// A model directory with a `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LocalModel {
    /// The directory's name in Perch's models directory, or the repository id (`org/name`) in the
    /// Hugging Face cache.
    pub name: String,
    /// The directory to load (for the cache: the snapshot `refs/main` names).
    pub path: PathBuf,
    pub source: ModelSource,
    /// Bytes of its files (following the cache's links to blobs).
    pub size_bytes: u64,
    /// `model_type` from `config.json`, when it is readable.
    pub model_type: Option<String>,
    /// Bits of its `quantization` entry, when quantized.
    pub quantization_bits: Option<u32>,
    /// Its `config.json`, when readable (read once here, for callers that judge more of it).
    #[serde(skip)]
    pub config: Option<serde_json::Value>,
}

/// Every model in `perch_dir` and in the Hugging Face cache `hf_cache` (either may be missing),
/// Perch's first, each group sorted by name. Directories without a `config.json` are skipped.
pub fn local_models(perch_dir: &Path, hf_cache: Option<&Path>) -> Vec<LocalModel> {
    let mut found: Vec<LocalModel> = subdirectories(perch_dir)
        .into_iter()
        .filter_map(|dir| {
            let name = dir.file_name()?.to_string_lossy().into_owned();
            describe(name, dir, ModelSource::Perch)
        })
        .collect();
    found.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(cache) = hf_cache {
        let mut cached: Vec<LocalModel> = subdirectories(cache)
            .into_iter()
            .filter_map(|dir| {
                let id = repo_id_of_folder(&dir.file_name()?.to_string_lossy())?;
                let snapshot = cached_snapshot(cache, &id)?;
                describe(id, snapshot, ModelSource::HuggingFace)
            })
            .collect();
        cached.sort_by(|a, b| a.name.cmp(&b.name));
        found.extend(cached);
    }
    found
}

/// Deletes the model in `path`, one that [`local_models`] lists for `perch_dir` and `hf_cache`:
/// its directory in Perch's models directory, or its whole repository in the Hugging Face cache
/// (`models--org--name`: every revision and blob, as `huggingface-cli delete-cache` removes a
/// repository). Returns the bytes freed (regular files only: the cache's snapshot links to its
/// blobs are not counted twice). A model directory that is a link to one elsewhere loses the link
/// only (0 bytes freed). Nothing else is touched: a path that is not such a model is refused
/// ([`HubError::NotLocalModel`]) before anything is read.
pub fn delete_local_model(
    perch_dir: &Path,
    hf_cache: Option<&Path>,
    path: &Path,
) -> Result<u64, HubError> {
    let model = local_models(perch_dir, hf_cache)
        .into_iter()
        .find(|m| m.path == path)
        .ok_or_else(|| HubError::NotLocalModel(path.to_path_buf()))?;
    let dir = match (model.source, hf_cache) {
        (ModelSource::Perch, _) => model.path,
        (ModelSource::HuggingFace, Some(cache)) => repo_folder(cache, &model.name),
        (ModelSource::HuggingFace, None) => return Err(HubError::NotLocalModel(path.into())),
    };
    // A link to a model elsewhere: the link goes, what it points to stays (nothing freed).
    let linked = fs::symlink_metadata(&dir).is_ok_and(|m| m.file_type().is_symlink());
    let freed = if linked { 0 } else { regular_file_bytes(&dir) };
    let removed = if linked {
        fs::remove_file(&dir)
    } else {
        fs::remove_dir_all(&dir)
    };
    removed.map_err(|source| HubError::Io { path: dir, source })?;
    Ok(freed)
}

/// A download that stopped before its end (cancelled, interrupted, the app quit): a repository
/// of the Hugging Face cache holding partial blobs (`blobs/{etag}.incomplete`), which
/// [`crate::HubClient::download`] resumes where they end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PartialDownload {
    /// `org/name`.
    pub repo_id: String,
    /// Bytes its partial blobs hold.
    pub bytes_present: u64,
    /// Whether some revision of it is complete already (a later download stopped).
    pub has_snapshot: bool,
}

/// Every repository of the Hugging Face cache `hf_cache` with partial blobs, sorted by id.
pub fn partial_downloads(hf_cache: &Path) -> Vec<PartialDownload> {
    let mut found: Vec<PartialDownload> = subdirectories(hf_cache)
        .into_iter()
        .filter_map(|dir| {
            let repo_id = repo_id_of_folder(&dir.file_name()?.to_string_lossy())?;
            let partial = partial_blobs(&dir);
            if partial.is_empty() {
                return None;
            }
            Some(PartialDownload {
                has_snapshot: cached_snapshot(hf_cache, &repo_id).is_some(),
                bytes_present: partial.iter().map(|(_, len)| len).sum(),
                repo_id,
            })
        })
        .collect();
    found.sort_by(|a, b| a.repo_id.cmp(&b.repo_id));
    found
}

/// Deletes the partial blobs of `repo_id` in the Hugging Face cache `hf_cache` (a stopped
/// download given up) and returns the bytes freed; complete blobs and snapshots stay. A
/// repository with none is refused ([`HubError::NotLocalModel`]) before anything is touched.
pub fn discard_partial_download(hf_cache: &Path, repo_id: &str) -> Result<u64, HubError> {
    let none = || HubError::NotLocalModel(hf_cache.join(repo_id));
    // An id that is no repository's names no folder (nothing outside the cache is reached).
    crate::hub::check_repo_id(repo_id).map_err(|_| none())?;
    let partial = partial_blobs(&repo_folder(hf_cache, repo_id));
    if partial.is_empty() {
        return Err(none());
    }
    let mut freed = 0;
    for (path, len) in partial {
        fs::remove_file(&path).map_err(|source| HubError::Io { path, source })?;
        freed += len;
    }
    Ok(freed)
}

/// The partial blobs of a cache repository `dir`, with their lengths (regular files only).
fn partial_blobs(dir: &Path) -> Vec<(PathBuf, u64)> {
    let Ok(entries) = fs::read_dir(dir.join("blobs")) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".incomplete"))
        .filter_map(|e| {
            let meta = fs::symlink_metadata(e.path()).ok()?;
            meta.is_file().then(|| (e.path(), meta.len()))
        })
        .collect()
}

/// Bytes of the regular files under `dir` (links not followed).
fn regular_file_bytes(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|entry| match entry.file_type() {
            Ok(kind) if kind.is_dir() => regular_file_bytes(&entry.path()),
            Ok(kind) if kind.is_file() => entry.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// The snapshot `refs/main` names for `repo_id` (`org/name`) in the Hugging Face cache
/// `hf_cache`, when it has a `config.json`: what mlx-lm loads for that id offline. Without one
/// (only another branch or tag was downloaded), the snapshot of the first other ref, by name.
/// A ref is written once its download is complete, so a stopped download is never one; a
/// revision downloaded by its commit hash alone writes none (as `huggingface_hub`) and is not
/// listed.
pub fn cached_snapshot(hf_cache: &Path, repo_id: &str) -> Option<PathBuf> {
    let main = hf_hub::Cache::new(hf_cache.to_path_buf())
        .model(repo_id.to_owned())
        .get("config.json")
        .and_then(|config| Some(config.parent()?.to_path_buf()));
    main.or_else(|| {
        let repo = repo_folder(hf_cache, repo_id);
        let mut refs: Vec<PathBuf> = fs::read_dir(repo.join("refs"))
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        refs.sort();
        refs.into_iter().find_map(|r| {
            let commit = fs::read_to_string(r).ok()?;
            let commit = commit.trim();
            let valid = !commit.is_empty() && commit.bytes().all(|b| b.is_ascii_hexdigit());
            let snapshot = repo.join("snapshots").join(commit);
            (valid && snapshot.join("config.json").is_file()).then_some(snapshot)
        })
    })
}

/// What to call the model in `path`: `org/name` for a Hugging Face cache snapshot
/// (`…/models--org--name/snapshots/{commit}`), else the directory's name.
pub fn model_name(path: &Path) -> String {
    let mut parts = path
        .components()
        .rev()
        .map(|c| c.as_os_str().to_string_lossy());
    let (last, parent, repo) = (parts.next(), parts.next(), parts.next());
    if let (Some(_), Some(parent), Some(repo)) = (&last, parent, repo) {
        if let (true, Some(id)) = (parent == "snapshots", repo_id_of_folder(&repo)) {
            return id;
        }
    }
    last.map_or_else(|| path.display().to_string(), |l| l.into_owned())
}

/// The cache folder `models--org--name` of `repo_id` in `hf_cache` (`hf_hub::Repo::folder_name`).
fn repo_folder(hf_cache: &Path, repo_id: &str) -> PathBuf {
    hf_cache.join(format!("models--{}", repo_id.replacen('/', "--", 1)))
}

/// `org/name` for a cache folder `models--org--name` (the inverse of `hf_hub::Repo::folder_name`).
fn repo_id_of_folder(folder: &str) -> Option<String> {
    Some(folder.strip_prefix("models--")?.replacen("--", "/", 1))
}

fn subdirectories(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect()
}

fn describe(name: String, path: PathBuf, source: ModelSource) -> Option<LocalModel> {
    let config_path = path.join("config.json");
    if !config_path.is_file() {
        return None;
    }
    let config: Option<serde_json::Value> = fs::read_to_string(&config_path)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok());
    let model_type = config
        .as_ref()
        .and_then(|c| c.get("model_type")?.as_str().map(str::to_owned));
    let quantization_bits = config.as_ref().and_then(|c| {
        let q = c
            .get("quantization")
            .or_else(|| c.get("quantization_config"))?;
        Some(q.get("bits")?.as_u64()? as u32)
    });
    let size_bytes = fs::read_dir(&path)
        .map(|entries| {
            entries
                .filter_map(|e| fs::metadata(e.ok()?.path()).ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);
    Some(LocalModel {
        name,
        path,
        source,
        size_bytes,
        model_type,
        quantization_bits,
        config,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, text).unwrap();
    }

    #[test]
    fn lists_and_discards_partial_downloads() {
        let root = tempfile::tempdir().unwrap();
        let cache = root.path();
        let repo = cache.join("models--org--paused");
        write(&repo.join("blobs/aaa.incomplete"), "12345");
        write(&repo.join("blobs/bbb.incomplete"), "678");
        write(&repo.join("blobs/ccc"), "complete");
        write(&cache.join("models--org--done/blobs/ddd"), "complete");
        // A link named as a partial blob is not one of its files.
        #[cfg(unix)]
        std::os::unix::fs::symlink(repo.join("blobs/ccc"), repo.join("blobs/eee.incomplete"))
            .unwrap();
        let found = partial_downloads(cache);
        assert_eq!(
            found,
            vec![PartialDownload {
                repo_id: "org/paused".into(),
                bytes_present: 8,
                has_snapshot: false,
            }]
        );
        for nothing_to_discard in ["org/done", "../models--org--paused", "org/../x"] {
            assert!(matches!(
                discard_partial_download(cache, nothing_to_discard),
                Err(HubError::NotLocalModel(_))
            ));
        }
        assert_eq!(discard_partial_download(cache, "org/paused").unwrap(), 8);
        assert!(partial_downloads(cache).is_empty());
        assert!(repo.join("blobs/ccc").is_file(), "complete blobs stay");

        // A branch other than main, downloaded alone, is the repository's snapshot once its ref
        // is written (when its download is complete).
        write(&repo.join("snapshots/abc123/config.json"), "{}");
        assert_eq!(cached_snapshot(cache, "org/paused"), None);
        write(&repo.join("refs/v1"), "abc123");
        assert_eq!(
            cached_snapshot(cache, "org/paused"),
            Some(repo.join("snapshots/abc123"))
        );
    }

    #[test]
    fn lists_perch_models_and_hugging_face_snapshots() {
        let root = tempfile::tempdir().unwrap();
        let perch = root.path().join("models");
        let config = r#"{"model_type": "llama", "quantization": {"bits": 4, "group_size": 64}}"#;
        write(&perch.join("b-model/config.json"), config);
        write(&perch.join("b-model/model.safetensors"), &"x".repeat(1000));
        write(&perch.join("a-model/config.json"), "not json");
        write(&perch.join("no-config/model.safetensors"), "x");

        // The cache's layout: blobs, a snapshot per revision linking to them, refs/main.
        let cache = root.path().join("hub");
        let repo = cache.join("models--mlx-community--Qwen3-0.6B-4bit");
        let qwen_config = r#"{"model_type": "qwen3"}"#;
        write(&repo.join("blobs/aaa"), qwen_config);
        write(&repo.join("blobs/bbb"), &"w".repeat(5000));
        for rev in ["old", "cafe"] {
            let snapshot = repo.join("snapshots").join(rev);
            fs::create_dir_all(&snapshot).unwrap();
            std::os::unix::fs::symlink(repo.join("blobs/aaa"), snapshot.join("config.json"))
                .unwrap();
        }
        std::os::unix::fs::symlink(
            repo.join("blobs/bbb"),
            repo.join("snapshots/cafe/model.safetensors"),
        )
        .unwrap();
        write(&repo.join("refs/main"), "cafe");
        // A dataset and an incomplete download are not models.
        write(&cache.join("datasets--x--y/refs/main"), "1");
        write(&cache.join("models--x--partial/refs/main"), "missing");

        let models = local_models(&perch, Some(&cache));
        let names: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            ["a-model", "b-model", "mlx-community/Qwen3-0.6B-4bit"]
        );
        assert_eq!(models[0].model_type, None, "unreadable config");
        assert_eq!(models[1].model_type.as_deref(), Some("llama"));
        assert_eq!(models[1].quantization_bits, Some(4));
        assert_eq!(models[1].size_bytes, 1000 + config.len() as u64);
        let qwen = &models[2];
        assert_eq!(qwen.source, ModelSource::HuggingFace);
        assert_eq!(qwen.path, repo.join("snapshots/cafe"));
        assert_eq!(qwen.model_type.as_deref(), Some("qwen3"));
        assert_eq!(qwen.size_bytes, 5000 + qwen_config.len() as u64);
    }

    #[test]
    fn names_of_model_directories() {
        let snapshot = Path::new("/c/hub/models--mlx-community--Qwen3-0.6B-4bit/snapshots/ab12");
        assert_eq!(model_name(snapshot), "mlx-community/Qwen3-0.6B-4bit");
        assert_eq!(model_name(Path::new("/data/models/SmolLM2")), "SmolLM2");
        assert_eq!(model_name(Path::new("/")), "/");
    }

    #[test]
    fn missing_directories_list_nothing() {
        let root = tempfile::tempdir().unwrap();
        assert!(
            local_models(&root.path().join("absent"), Some(&root.path().join("nope"))).is_empty()
        );
    }

    #[test]
    fn deletes_a_listed_model_and_nothing_else() {
        let root = tempfile::tempdir().unwrap();
        let perch = root.path().join("models");
        write(&perch.join("mine/config.json"), "{}");
        write(&perch.join("mine/model.safetensors"), &"x".repeat(1000));
        write(&perch.join("keep/config.json"), "{}");
        let cache = root.path().join("hub");
        let repo = cache.join("models--org--Model-4bit");
        write(&repo.join("blobs/aaa"), "{}");
        write(&repo.join("blobs/bbb"), &"w".repeat(5000));
        write(&repo.join("refs/main"), "cafe");
        let snapshot = repo.join("snapshots/cafe");
        fs::create_dir_all(&snapshot).unwrap();
        std::os::unix::fs::symlink(repo.join("blobs/aaa"), snapshot.join("config.json")).unwrap();
        std::os::unix::fs::symlink(repo.join("blobs/bbb"), snapshot.join("model.safetensors"))
            .unwrap();
        let other = cache.join("models--org--Other");
        write(&other.join("blobs/ccc"), "{}");

        // Not a listed model: refused, nothing removed (a parent, a file, a blob, elsewhere).
        for path in [
            perch.clone(),
            perch.join("mine/config.json"),
            repo.join("blobs/bbb"),
            root.path().to_path_buf(),
        ] {
            assert!(matches!(
                delete_local_model(&perch, Some(&cache), &path),
                Err(HubError::NotLocalModel(_))
            ));
        }
        assert!(perch.join("mine/model.safetensors").exists() && repo.exists());

        // The cache's repository: every blob counted once (4 bytes of "{}" + refs + 5,000).
        assert_eq!(
            delete_local_model(&perch, Some(&cache), &snapshot).unwrap(),
            2 + 4 + 5000
        );
        assert!(!repo.exists() && other.exists());
        // Perch's directory.
        assert_eq!(
            delete_local_model(&perch, Some(&cache), &perch.join("mine")).unwrap(),
            2 + 1000
        );
        assert!(!perch.join("mine").exists() && perch.join("keep/config.json").exists());
    }
}
