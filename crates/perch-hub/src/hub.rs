//! The Hugging Face Hub's HTTP API: model search and the file list of one revision.
//!
//! Routes (as the Hub and `huggingface_hub` use them):
//! - `GET /api/models?search=…&author=…&sort=downloads&direction=-1&limit=N&expand[]=…`
//! - `GET /api/models/{repo}/revision/{rev}` → `{id, sha}` (the commit a branch or tag names)
//! - `GET /api/models/{repo}/tree/{sha}?recursive=true` → `[{type, path, size, oid, lfs?}]`,
//!   paged with `Link: <…>; rel="next"`
//! - `GET /{repo}/resolve/{sha}/{path}` → the file (see `download.rs`)

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::HubError;

/// The public Hub; `$HF_ENDPOINT` overrides it (as for `huggingface_hub` and mlx-lm).
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The organisation that publishes MLX conversions; the picker searches it by default.
pub const MLX_COMMUNITY: &str = "mlx-community";

/// Files a model needs, as mlx-lm's `DEFAULT_ALLOW_PATTERNS` (`mlx_lm/utils.py`) selects them:
/// `*` matches any characters, `/` included (Python's `fnmatch`).
pub const MODEL_FILE_PATTERNS: &[&str] = &[
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
];

/// A client of one Hub endpoint that downloads into one cache directory.
#[derive(Clone, Debug)]
pub struct HubClient {
    endpoint: String,
    token: Option<String>,
    cache_dir: PathBuf,
    agent: ureq::Agent,
}

/// What to search for.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct SearchQuery {
    /// Words to find in the repository id; empty lists the most downloaded.
    pub text: String,
    /// Only repositories of this user or organisation (e.g. [`MLX_COMMUNITY`]).
    pub author: Option<String>,
    /// At most this many results (the Hub caps it at 1000).
    pub limit: usize,
}

impl Default for SearchQuery {
    fn default() -> Self {
        SearchQuery {
            text: String::new(),
            author: Some(MLX_COMMUNITY.to_owned()),
            limit: 30,
        }
    }
}

/// One search result.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HubModel {
    /// Repository id, `org/name`.
    pub id: String,
    pub downloads: u64,
    pub likes: u64,
    /// ISO 8601, as the Hub gives it.
    pub last_modified: Option<String>,
    pub tags: Vec<String>,
    /// Bytes of the weights in its safetensors files (element counts per dtype, as the Hub reads
    /// them from the headers, times the dtype's size); `None` when the Hub has no safetensors
    /// metadata for it. Quantized weights count as their packed `U32` words, so this is the
    /// download size, not parameters × 2.
    pub weights_bytes: Option<u64>,
}

/// One revision of a repository: the commit and the model files in it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RemoteSnapshot {
    pub repo_id: String,
    /// The revision asked for (`main`, a tag or a commit).
    pub revision: String,
    /// The commit it names (40 hex digits).
    pub commit: String,
    /// The files [`MODEL_FILE_PATTERNS`] select, in path order.
    pub files: Vec<RemoteFile>,
}

impl RemoteSnapshot {
    /// Bytes of all its files.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }
}

/// A file of a repository at one commit ([`HubClient::tree`], [`RemoteSnapshot::files`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RemoteFile {
    /// Path inside the repository, `/`-separated, checked to stay inside it.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// The blob's name in the cache and what it must hash to: the SHA-256 of the content for
    /// files stored with Git LFS, else Git's blob id (SHA-1 of `blob {size}\0` + content).
    pub etag: String,
    /// Whether `etag` is a SHA-256 (LFS) rather than a Git blob id.
    pub lfs: bool,
}

impl HubClient {
    /// A client of `$HF_ENDPOINT` (else [`DEFAULT_ENDPOINT`]) with the token `huggingface_hub`
    /// would use (`$HF_TOKEN`, else the file `$HF_TOKEN_PATH`, else `huggingface-cli login`'s
    /// `$HF_HOME/token`), downloading into `cache_dir`.
    pub fn from_env(cache_dir: PathBuf) -> Self {
        let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| DEFAULT_ENDPOINT.to_owned());
        HubClient::new(&endpoint, token_from_env(), cache_dir)
    }

    /// A client of `endpoint` (e.g. `https://huggingface.co`), sending `token` as a bearer token
    /// to it (never to the CDN it redirects downloads to).
    pub fn new(endpoint: &str, token: Option<String>, cache_dir: PathBuf) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_connect(Some(Duration::from_secs(15)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent(concat!("perch/", env!("CARGO_PKG_VERSION")))
            .http_status_as_error(false)
            // The Hub redirects LFS files to a CDN with signed URLs: the token stays home.
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::SameHost)
            .build()
            .into();
        HubClient {
            endpoint: endpoint.trim_end_matches('/').to_owned(),
            token,
            cache_dir,
            agent,
        }
    }

    /// The cache directory downloads go into (`hub/` of the Hugging Face cache).
    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Models matching `query`, most downloaded first.
    ///
    /// Errors: [`HubError::Network`], [`HubError::Status`], [`HubError::BadResponse`].
    pub fn search(&self, query: &SearchQuery) -> Result<Vec<HubModel>, HubError> {
        let mut url = format!(
            "{}/api/models?search={}&sort=downloads&direction=-1&limit={}",
            self.endpoint,
            percent_encode(query.text.trim()),
            query.limit.clamp(1, 1000)
        );
        if let Some(author) = &query.author {
            url.push_str(&format!("&author={}", percent_encode(author)));
        }
        for field in ["downloads", "likes", "lastModified", "tags", "safetensors"] {
            url.push_str(&format!("&expand%5B%5D={field}"));
        }
        let (found, _) = self.get_json::<Vec<SearchHit>>(&url)?;
        Ok(found.into_iter().map(SearchHit::into_model).collect())
    }

    /// The commit `revision` names in `repo_id` and its model files.
    ///
    /// Errors: those of [`Self::commit`] and [`Self::tree`].
    pub fn snapshot(&self, repo_id: &str, revision: &str) -> Result<RemoteSnapshot, HubError> {
        let commit = self.commit(repo_id, revision)?;
        let mut files: Vec<RemoteFile> = self
            .tree(repo_id, &commit)?
            .into_iter()
            .filter(|f| {
                MODEL_FILE_PATTERNS
                    .iter()
                    .any(|p| wildcard_match(p, &f.path))
            })
            .collect();
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(RemoteSnapshot {
            repo_id: repo_id.to_owned(),
            revision: revision.to_owned(),
            commit,
            files,
        })
    }

    /// The commit (40 hex digits) that `revision` (a branch, tag or commit) names in `repo_id`:
    /// the `sha` of `GET /api/models/{repo}/revision/{revision}`.
    ///
    /// Errors: [`HubError::InvalidRepoId`]; [`HubError::Status`] (404: no such repository or
    /// revision; 401/403: private or gated); [`HubError::BadResponse`] for a malformed answer;
    /// [`HubError::Network`].
    pub fn commit(&self, repo_id: &str, revision: &str) -> Result<String, HubError> {
        check_repo_id(repo_id)?;
        let url = format!(
            "{}/api/models/{repo_id}/revision/{}",
            self.endpoint,
            percent_encode(revision)
        );
        let (info, _) = self.get_json::<RevisionInfo>(&url)?;
        if !is_commit_hash(&info.sha) {
            return Err(HubError::BadResponse {
                url,
                reason: format!("{:?} is not a commit hash", info.sha),
            });
        }
        Ok(info.sha)
    }

    /// Every file of `repo_id` at `commit`, in the Hub's order: `GET
    /// /api/models/{repo}/tree/{commit}?recursive=true`, following its `Link: <…>; rel="next"`
    /// pages. Directories are left out.
    ///
    /// Errors: [`HubError::InvalidRepoId`]; [`HubError::BadResponse`] for a malformed answer, a
    /// path that would leave the repository or a blob hash of the wrong form;
    /// [`HubError::Status`]; [`HubError::Network`].
    pub fn tree(&self, repo_id: &str, commit: &str) -> Result<Vec<RemoteFile>, HubError> {
        check_repo_id(repo_id)?;
        let mut files = Vec::new();
        let mut next = Some(format!(
            "{}/api/models/{repo_id}/tree/{}?recursive=true",
            self.endpoint,
            percent_encode(commit)
        ));
        while let Some(url) = next {
            let (entries, link) = self.get_json::<Vec<TreeEntry>>(&url)?;
            for entry in entries.into_iter().filter(|e| e.kind == "file") {
                check_path(&entry.path).map_err(|reason| HubError::BadResponse {
                    url: url.clone(),
                    reason,
                })?;
                let (etag, lfs, size) = match entry.lfs {
                    Some(lfs) => (lfs.oid, true, lfs.size),
                    None => (entry.oid, false, entry.size),
                };
                let well_formed = if lfs {
                    is_hex(&etag, 64)
                } else {
                    is_commit_hash(&etag)
                };
                if !well_formed {
                    return Err(HubError::BadResponse {
                        url,
                        reason: format!("{}: {etag:?} is not a blob hash", entry.path),
                    });
                }
                files.push(RemoteFile {
                    path: entry.path,
                    size,
                    etag,
                    lfs,
                });
            }
            next = link;
        }
        Ok(files)
    }

    /// `GET url` with the token when `url` is on the endpoint; 4xx/5xx are errors.
    pub(crate) fn get(
        &self,
        url: &str,
        range_from: Option<u64>,
    ) -> Result<ureq::http::Response<ureq::Body>, HubError> {
        let mut request = self.agent.get(url);
        if let Some(token) = &self.token {
            request = request.header("Authorization", &format!("Bearer {token}"));
        }
        if let Some(from) = range_from {
            request = request.header("Range", &format!("bytes={from}-"));
        }
        let response = request.call().map_err(|source| HubError::Network {
            url: url.to_owned(),
            source: Box::new(source),
        })?;
        let status = response.status().as_u16();
        if status >= 400 && !(status == 416 && range_from.is_some()) {
            return Err(HubError::Status {
                url: url.to_owned(),
                status,
            });
        }
        Ok(response)
    }

    /// `GET url` as JSON, with the `rel="next"` link of a paged answer.
    fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
    ) -> Result<(T, Option<String>), HubError> {
        let mut response = self.get(url, None)?;
        let next = response
            .headers()
            .get("link")
            .and_then(|v| v.to_str().ok())
            .and_then(next_link);
        let value = response
            .body_mut()
            .read_json::<T>()
            .map_err(|e| HubError::BadResponse {
                url: url.to_owned(),
                reason: e.to_string(),
            })?;
        Ok((value, next))
    }
}

fn token_from_env() -> Option<String> {
    let read = |path: PathBuf| {
        let token = std::fs::read_to_string(path).ok()?;
        Some(token.trim().to_owned()).filter(|t| !t.is_empty())
    };
    if let Some(token) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        return Some(token);
    }
    if let Some(path) = std::env::var_os("HF_TOKEN_PATH") {
        return read(PathBuf::from(path));
    }
    let home = std::env::var_os("HF_HOME")
        .map(PathBuf::from)
        .or_else(|| Some(dirs::home_dir()?.join(".cache/huggingface")))?;
    read(home.join("token"))
}

#[derive(Deserialize)]
struct SearchHit {
    id: String,
    #[serde(default)]
    downloads: u64,
    #[serde(default)]
    likes: u64,
    #[serde(rename = "lastModified")]
    last_modified: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    safetensors: Option<SafetensorsInfo>,
}

#[derive(Deserialize)]
struct SafetensorsInfo {
    /// Element count per dtype name (`"BF16"`, `"U32"`, …).
    #[serde(default)]
    parameters: std::collections::BTreeMap<String, u64>,
}

impl SearchHit {
    fn into_model(self) -> HubModel {
        let weights_bytes = self.safetensors.and_then(|s| {
            s.parameters
                .iter()
                .try_fold(0u64, |total, (dtype, &count)| {
                    total.checked_add(count.checked_mul(dtype_bytes(dtype)?)?)
                })
        });
        HubModel {
            id: self.id,
            downloads: self.downloads,
            likes: self.likes,
            last_modified: self.last_modified,
            tags: self.tags,
            weights_bytes,
        }
    }
}

/// Bytes per element of a safetensors dtype name.
fn dtype_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F8_E4M3" | "F8_E5M2" | "I8" | "U8" | "BOOL" => 1,
        _ => return None,
    })
}

#[derive(Deserialize)]
struct RevisionInfo {
    sha: String,
}

#[derive(Deserialize)]
struct TreeEntry {
    #[serde(rename = "type")]
    kind: String,
    path: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    oid: String,
    lfs: Option<LfsInfo>,
}

#[derive(Deserialize)]
struct LfsInfo {
    oid: String,
    size: u64,
}

/// The `rel="next"` target of an HTTP `Link` header.
fn next_link(header: &str) -> Option<String> {
    header.split(',').find_map(|part| {
        let (target, params) = part.split_once(';')?;
        let is_next = params
            .split(';')
            .any(|p| p.trim().replace(' ', "") == "rel=\"next\"");
        let target = target.trim().strip_prefix('<')?.strip_suffix('>')?;
        is_next.then(|| target.to_owned())
    })
}

/// `org/name`, each part of letters, digits, `-`, `_`, `.` (not starting with `.`).
pub(crate) fn check_repo_id(repo_id: &str) -> Result<(), HubError> {
    let valid_part = |part: &str| {
        !part.is_empty()
            && !part.starts_with('.')
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    match repo_id.split_once('/') {
        Some((org, name)) if valid_part(org) && valid_part(name) => Ok(()),
        _ => Err(HubError::InvalidRepoId(repo_id.to_owned())),
    }
}

/// A relative `/`-separated path without `..`, `.` or empty parts: it cannot leave the snapshot.
fn check_path(path: &str) -> Result<(), String> {
    let bad_part = path
        .split('/')
        .any(|part| part.is_empty() || part == "." || part == ".." || part.contains('\\'));
    if bad_part || path.contains('\0') {
        Err(format!("{path:?} is not a safe relative file path"))
    } else {
        Ok(())
    }
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

pub(crate) fn is_commit_hash(s: &str) -> bool {
    is_hex(s, 40)
}

/// Python `fnmatch` for patterns whose only wildcard is `*` (which also matches `/`).
fn wildcard_match(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let middle: Vec<&str> = parts.collect();
    let Some((last, middle)) = middle.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
pub(crate) fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_follow_fnmatch() {
        assert!(wildcard_match("*.json", "config.json"));
        assert!(wildcard_match("*.json", "sub/dir/x.json"), "* matches /");
        assert!(!wildcard_match("*.json", "config.json.bak"));
        assert!(wildcard_match(
            "model*.safetensors",
            "model-00001-of-00002.safetensors"
        ));
        assert!(wildcard_match("model*.safetensors", "model.safetensors"));
        assert!(!wildcard_match(
            "model*.safetensors",
            "consolidated.safetensors"
        ));
        assert!(wildcard_match("tokenizer.model", "tokenizer.model"));
        assert!(!wildcard_match("tokenizer.model", "x/tokenizer.model"));
        assert!(!wildcard_match("a*b*c", "ac"));
        assert!(wildcard_match("a*b*c", "abxc"));
    }

    #[test]
    fn repo_ids_and_paths_are_checked() {
        assert!(check_repo_id("mlx-community/Qwen3-0.6B-4bit").is_ok());
        for bad in [
            "noslash", "a/b/c", "../x", "a/..", "a/", "/b", "a b/c", "a/.git",
        ] {
            assert!(check_repo_id(bad).is_err(), "{bad}");
        }
        assert!(check_path("model.safetensors").is_ok());
        assert!(check_path("sub/tokenizer.json").is_ok());
        for bad in ["../x", "/etc/passwd", "a//b", "a/./b", "a\\..\\b", "a/"] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn link_headers_give_the_next_page() {
        let header = r#"<https://hf.co/api/models/a/b/tree/x?cursor=abc>; rel="next""#;
        assert_eq!(
            next_link(header).as_deref(),
            Some("https://hf.co/api/models/a/b/tree/x?cursor=abc")
        );
        assert_eq!(next_link(r#"<https://x>; rel="prev""#), None);
    }

    #[test]
    fn weights_bytes_count_each_dtype_at_its_size() {
        let hit: SearchHit = serde_json::from_str(
            r#"{"id": "a/b", "safetensors": {"parameters": {"BF16": 10, "U32": 5}, "total": 15}}"#,
        )
        .unwrap();
        assert_eq!(hit.into_model().weights_bytes, Some(10 * 2 + 5 * 4));
        let unknown: SearchHit =
            serde_json::from_str(r#"{"id": "a/b", "safetensors": {"parameters": {"Q9": 1}}}"#)
                .unwrap();
        assert_eq!(unknown.into_model().weights_bytes, None);
        // A hostile count is an unknown size, not an overflow.
        let huge: SearchHit = serde_json::from_str(
            r#"{"id": "a/b", "safetensors": {"parameters": {"F64": 18446744073709551615}}}"#,
        )
        .unwrap();
        assert_eq!(huge.into_model().weights_bytes, None);
    }
}
