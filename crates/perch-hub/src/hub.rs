//! The Hugging Face Hub's HTTP API: model search and the file list of one revision.
//!
//! Routes (as the Hub and `huggingface_hub` use them):
//! - `GET /api/models?search=…&author=…&sort=downloads&direction=-1&limit=N&expand[]=…`
//! - `GET /api/models/{repo}/revision/{rev}` → `{id, sha}` (the commit a branch or tag names)
//! - `GET /api/models/{repo}/tree/{sha}?recursive=true` → `[{type, path, size, oid, lfs?}]`,
//!   paged with `Link: <…>; rel="next"`
//! - `GET /{repo}/resolve/{sha}/{path}` → the file (see `download.rs`)
//!
//! What the Hub answers is not trusted: the token goes only to the endpoint's origin (redirects
//! are followed here, not by ureq, whose `SameHost` keeps the token for another port of the same
//! host), page links must stay on that origin, listings are bounded in pages and time, and every
//! name that becomes a path in the cache (revision, commit, file path, blob hash) is checked first.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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

/// Most pages one listing follows ([`HubClient::tree`]); a hub that links on past them is an
/// error, not an endless loop.
pub const MAX_LISTING_PAGES: usize = 1000;

/// How long one call of [`HubClient::search`], [`HubClient::commit`], [`HubClient::tree`] or
/// [`HubClient::snapshot`] may take, all its requests, redirects and pages together
/// ([`HubClient::with_listing_timeout`] changes it).
pub const LISTING_TIMEOUT: Duration = Duration::from_secs(120);

/// Redirects followed per request (as ureq's default).
const MAX_REDIRECTS: usize = 10;

/// Largest `config.json` [`HubClient::config_text`] reads: published ones are a few KiB
/// (multimodal ones with their vision config, tens of KiB).
pub const MAX_CONFIG_TEXT_BYTES: u64 = 1 << 20;

/// How long [`HubClient::config_texts`] waits for all its configs, in all.
pub const CONFIG_TEXTS_TIMEOUT: Duration = Duration::from_secs(10);

/// How many configs [`HubClient::config_texts`] asks for at once.
const CONFIG_TEXTS_AT_ONCE: usize = 8;

/// Longest revision accepted, in bytes (a file name's limit on common file systems).
const MAX_REVISION_BYTES: usize = 255;

/// A client of one Hub endpoint that downloads into one cache directory.
///
/// What it guarantees, whatever the Hub (or a server posing as it) answers:
/// - the token is sent only to URLs with the endpoint's scheme, host and port; a redirect
///   elsewhere (the Hub's CDN, another port) is followed without it;
/// - a listing follows `Link: <…>; rel="next"` pages only on that origin
///   ([`HubError::BadResponse`] for a page elsewhere), at most [`MAX_LISTING_PAGES`] of them,
///   within [`LISTING_TIMEOUT`] in all ([`HubError::TimedOut`]);
/// - revisions, commits, file paths and blob hashes are checked before they name anything in the
///   cache, so nothing is written outside [`Self::cache_dir`].
#[derive(Clone, Debug)]
pub struct HubClient {
    endpoint: String,
    /// The endpoint's origin, the only one the token goes to; `None` for an endpoint that is no
    /// absolute http(s) URL (nothing gets the token then).
    origin: Option<Origin>,
    token: Option<String>,
    cache_dir: PathBuf,
    listing_timeout: Duration,
    /// Set: every request and page still to come ends with [`HubError::Cancelled`].
    cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
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
    /// `model_type` of its `config.json`, as the Hub reports it (`expand[]=config`); `None`
    /// when the Hub has none, or one that is no architecture name (over 64 bytes, or characters
    /// other than ASCII letters, digits, `_`, `-` and `.`).
    pub model_type: Option<String>,
}

/// One revision of a repository: the commit and the model files in it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RemoteSnapshot {
    pub repo_id: String,
    /// The revision asked for (`main`, a tag or a commit).
    pub revision: String,
    /// The commit it names (40 hex digits; 64 in a SHA-256 repository).
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
    /// to its origin (scheme, host and port) only: never to the CDN it redirects downloads to,
    /// nor to any other host or port a redirect or a page link names.
    pub fn new(endpoint: &str, token: Option<String>, cache_dir: PathBuf) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_connect(Some(Duration::from_secs(15)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent(concat!("perch/", env!("CARGO_PKG_VERSION")))
            .http_status_as_error(false)
            // `get` follows redirects itself, deciding per hop whether the token goes along.
            .max_redirects(0)
            .redirect_auth_headers(ureq::config::RedirectAuthHeaders::Never)
            .build()
            .into();
        let endpoint = endpoint.trim_end_matches('/').to_owned();
        HubClient {
            origin: Origin::of(&endpoint),
            endpoint,
            token,
            cache_dir,
            listing_timeout: LISTING_TIMEOUT,
            cancel: None,
            agent,
        }
    }

    /// The same client with each listing limited to `limit` in all instead of
    /// [`LISTING_TIMEOUT`].
    pub fn with_listing_timeout(mut self, limit: Duration) -> Self {
        self.listing_timeout = limit;
        self
    }

    /// The same client, stopped by `cancel`: once it is set, the next request, redirect or page
    /// of a listing ends with [`HubError::Cancelled`] (a download also takes its own flag).
    pub fn with_cancel(mut self, cancel: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Self {
        self.cancel = Some(cancel);
        self
    }

    fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
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
    /// Errors: [`HubError::Network`], [`HubError::Status`], [`HubError::BadResponse`],
    /// [`HubError::TimedOut`].
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
        for field in [
            "downloads",
            "likes",
            "lastModified",
            "tags",
            "safetensors",
            "config",
        ] {
            url.push_str(&format!("&expand%5B%5D={field}"));
        }
        let (found, _) = self.get_json::<Vec<SearchHit>>(&url, self.deadline())?;
        Ok(found.into_iter().map(SearchHit::into_model).collect())
    }

    /// The commit `revision` names in `repo_id` and its model files.
    ///
    /// Both requests together end within the listing timeout, or at the client's cancel flag
    /// ([`Self::with_cancel`]), checked before every request and page.
    ///
    /// Errors: those of [`Self::commit`] and [`Self::tree`].
    pub fn snapshot(&self, repo_id: &str, revision: &str) -> Result<RemoteSnapshot, HubError> {
        let deadline = self.deadline();
        let commit = self.commit_by(repo_id, revision, deadline)?;
        let mut files: Vec<RemoteFile> = self
            .tree_by(repo_id, &commit, deadline)?
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

    /// The text of `repo_id`'s `config.json` at `revision` (`GET /{repo}/resolve/{revision}/
    /// config.json`): what sizes a model before any weight is downloaded. At most
    /// [`MAX_CONFIG_TEXT_BYTES`], within the listing timeout.
    ///
    /// Errors: [`HubError::InvalidRepoId`] and [`HubError::InvalidRevision`] before any request;
    /// [`HubError::Status`] (404: no such repository, revision or file); [`HubError::BadResponse`]
    /// for a file over the limit or not UTF-8; [`HubError::Network`]; [`HubError::TimedOut`];
    /// [`HubError::Cancelled`].
    pub fn config_text(&self, repo_id: &str, revision: &str) -> Result<String, HubError> {
        self.config_text_by(repo_id, revision, self.deadline())
    }

    fn config_text_by(
        &self,
        repo_id: &str,
        revision: &str,
        deadline: Instant,
    ) -> Result<String, HubError> {
        check_repo_id(repo_id)?;
        check_revision(revision)?;
        let url = format!(
            "{}/{repo_id}/resolve/{}/config.json",
            self.endpoint,
            percent_encode(revision)
        );
        let mut response = self.get(&url, None, Some(deadline))?;
        response
            .body_mut()
            .with_config()
            .limit(MAX_CONFIG_TEXT_BYTES)
            .read_to_string()
            .map_err(|e| match e {
                ureq::Error::Timeout(ureq::Timeout::Global) => self.timed_out(&url),
                e => HubError::BadResponse {
                    url: url.clone(),
                    reason: e.to_string(),
                },
            })
    }

    /// [`Self::config_text`] at `main` of each of `repo_ids`, [`CONFIG_TEXTS_AT_ONCE`] requests
    /// at a time, all within [`CONFIG_TEXTS_TIMEOUT`]: one result per id, in order (a search
    /// result's config for its fit estimate; one that fails is that model's error alone).
    pub fn config_texts(&self, repo_ids: &[String]) -> Vec<Result<String, HubError>> {
        let deadline = Instant::now() + CONFIG_TEXTS_TIMEOUT.min(self.listing_timeout);
        let mut results = Vec::with_capacity(repo_ids.len());
        for batch in repo_ids.chunks(CONFIG_TEXTS_AT_ONCE) {
            std::thread::scope(|scope| {
                let handles: Vec<_> = batch
                    .iter()
                    .map(|id| scope.spawn(move || self.config_text_by(id, "main", deadline)))
                    .collect();
                for (id, handle) in batch.iter().zip(handles) {
                    results.push(handle.join().unwrap_or_else(|_| {
                        Err(HubError::BadResponse {
                            url: format!("{}/{id}/resolve/main/config.json", self.endpoint),
                            reason: "reading it panicked".into(),
                        })
                    }));
                }
            });
        }
        results
    }

    /// The commit (40 hex digits, or 64 in a SHA-256 repository) that `revision` (a branch, tag
    /// or commit) names in `repo_id`: the `sha` of `GET /api/models/{repo}/revision/{revision}`.
    ///
    /// Errors, before any request: [`HubError::InvalidRepoId`]; [`HubError::InvalidRevision`] for
    /// a revision that could not name a file under the cache's `refs/` (empty, `.` or `..` parts,
    /// control characters, over 255 bytes, …). Then: [`HubError::Status`] (404: no such
    /// repository or revision; 401/403: private or gated); [`HubError::BadResponse`] for a
    /// malformed answer or a `sha` that is no commit hash; [`HubError::Network`];
    /// [`HubError::TimedOut`].
    pub fn commit(&self, repo_id: &str, revision: &str) -> Result<String, HubError> {
        self.commit_by(repo_id, revision, self.deadline())
    }

    fn commit_by(
        &self,
        repo_id: &str,
        revision: &str,
        deadline: Instant,
    ) -> Result<String, HubError> {
        check_repo_id(repo_id)?;
        check_revision(revision)?;
        let url = format!(
            "{}/api/models/{repo_id}/revision/{}",
            self.endpoint,
            percent_encode(revision)
        );
        let (info, _) = self.get_json::<RevisionInfo>(&url, deadline)?;
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
    /// Only pages on the endpoint's origin are followed: a link to another host or port is
    /// refused rather than followed without the token, as a page there could list anything. At
    /// most [`MAX_LISTING_PAGES`] pages are read, all within the listing timeout, each after
    /// checking the client's cancel flag ([`Self::with_cancel`]; [`HubError::Cancelled`]).
    ///
    /// Errors: [`HubError::InvalidRepoId`] and [`HubError::InvalidRevision`] before any request;
    /// [`HubError::BadResponse`] for a malformed answer, a path that would leave the repository,
    /// a blob hash of the wrong form, a next page off the endpoint's origin or more than
    /// [`MAX_LISTING_PAGES`] pages; [`HubError::Status`]; [`HubError::Network`];
    /// [`HubError::TimedOut`].
    pub fn tree(&self, repo_id: &str, commit: &str) -> Result<Vec<RemoteFile>, HubError> {
        self.tree_by(repo_id, commit, self.deadline())
    }

    fn tree_by(
        &self,
        repo_id: &str,
        commit: &str,
        deadline: Instant,
    ) -> Result<Vec<RemoteFile>, HubError> {
        check_repo_id(repo_id)?;
        check_revision(commit)?;
        let mut files = Vec::new();
        let mut next = Some(format!(
            "{}/api/models/{repo_id}/tree/{}?recursive=true",
            self.endpoint,
            percent_encode(commit)
        ));
        let mut pages = 0;
        while let Some(url) = next {
            if pages == MAX_LISTING_PAGES {
                return Err(HubError::BadResponse {
                    url,
                    reason: format!(
                        "the file list goes on past {MAX_LISTING_PAGES} pages; Perch stops there"
                    ),
                });
            }
            pages += 1;
            let (entries, link) = self.get_json::<Vec<TreeEntry>>(&url, deadline)?;
            if self.cancelled() {
                return Err(HubError::Cancelled);
            }
            for entry in entries.into_iter().filter(|e| e.kind == "file") {
                let file = match entry.lfs {
                    Some(lfs) => RemoteFile {
                        path: entry.path,
                        size: lfs.size,
                        etag: lfs.oid,
                        lfs: true,
                    },
                    None => RemoteFile {
                        path: entry.path,
                        size: entry.size,
                        etag: entry.oid,
                        lfs: false,
                    },
                };
                check_file(&file).map_err(|reason| HubError::BadResponse {
                    url: url.clone(),
                    reason,
                })?;
                files.push(file);
            }
            next = match link {
                Some(link) => Some(self.next_page(&url, &link)?),
                None => None,
            };
        }
        Ok(files)
    }

    /// The absolute URL of the `rel="next"` `link` of `page`, when it is on the endpoint's
    /// origin; else [`HubError::BadResponse`].
    fn next_page(&self, page: &str, link: &str) -> Result<String, HubError> {
        resolve_url(page, link)
            .filter(|next| self.is_endpoint(next))
            .ok_or_else(|| HubError::BadResponse {
                url: page.to_owned(),
                reason: format!(
                    "its next page, {link}, is not on {}; Perch only follows pages there",
                    self.endpoint
                ),
            })
    }

    /// Whether `url` has the endpoint's scheme, host and port: the only URLs the token goes to.
    fn is_endpoint(&self, url: &str) -> bool {
        self.origin.is_some() && Origin::of(url) == self.origin
    }

    /// When a listing that starts now must end.
    fn deadline(&self) -> Instant {
        Instant::now() + self.listing_timeout
    }

    /// `GET url`, following up to 10 redirects; 4xx/5xx are errors. The token goes along to
    /// each URL on the endpoint's origin and to no other. With a `deadline`, the whole
    /// exchange (redirects and the body's reading included) ends by then with
    /// [`HubError::TimedOut`]. Errors name `url`, not the hop that failed (a CDN's signed URL
    /// stays out of messages).
    pub(crate) fn get(
        &self,
        url: &str,
        range_from: Option<u64>,
        deadline: Option<Instant>,
    ) -> Result<ureq::http::Response<ureq::Body>, HubError> {
        let mut hop = url.to_owned();
        for _ in 0..=MAX_REDIRECTS {
            if self.cancelled() {
                return Err(HubError::Cancelled);
            }
            let mut request = self.agent.get(&hop);
            if let Some(token) = self.token.as_ref().filter(|_| self.is_endpoint(&hop)) {
                request = request.header("Authorization", &format!("Bearer {token}"));
            }
            if let Some(from) = range_from {
                request = request.header("Range", &format!("bytes={from}-"));
            }
            if let Some(deadline) = deadline {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(self.timed_out(url));
                }
                request = request.config().timeout_global(Some(left)).build();
            }
            let response = request
                .call()
                .map_err(|source| self.request_error(url, source))?;
            let status = response.status().as_u16();
            if matches!(status, 301 | 302 | 303 | 307 | 308) {
                let location = response
                    .headers()
                    .get("location")
                    .and_then(|v| v.to_str().ok());
                let Some(next) = location.and_then(|l| resolve_url(&hop, l)) else {
                    return Err(HubError::BadResponse {
                        url: url.to_owned(),
                        reason: format!("HTTP {status} without a usable Location"),
                    });
                };
                hop = next;
                continue;
            }
            if status >= 400 && !(status == 416 && range_from.is_some()) {
                return Err(HubError::Status {
                    url: url.to_owned(),
                    status,
                });
            }
            return Ok(response);
        }
        Err(HubError::BadResponse {
            url: url.to_owned(),
            reason: format!("more than {MAX_REDIRECTS} redirects"),
        })
    }

    /// `GET url` as JSON by `deadline`, with the `rel="next"` link of a paged answer.
    fn get_json<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
        deadline: Instant,
    ) -> Result<(T, Option<String>), HubError> {
        let mut response = self.get(url, None, Some(deadline))?;
        let next = response
            .headers()
            .get("link")
            .and_then(|v| v.to_str().ok())
            .and_then(next_link);
        let value = response.body_mut().read_json::<T>().map_err(|e| match e {
            ureq::Error::Timeout(ureq::Timeout::Global) => self.timed_out(url),
            e => HubError::BadResponse {
                url: url.to_owned(),
                reason: e.to_string(),
            },
        })?;
        Ok((value, next))
    }

    fn request_error(&self, url: &str, source: ureq::Error) -> HubError {
        match source {
            // Only a listing's deadline sets the global timeout.
            ureq::Error::Timeout(ureq::Timeout::Global) => self.timed_out(url),
            source => HubError::Network {
                url: url.to_owned(),
                source: Box::new(source),
            },
        }
    }

    fn timed_out(&self, url: &str) -> HubError {
        HubError::TimedOut {
            url: url.to_owned(),
            limit: self.listing_timeout,
        }
    }
}

/// The scheme, host and port of an absolute http(s) URL (the `url` crate's tuple origin,
/// default ports filled in): URLs of one origin reach the same server. `None` for anything else.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Origin(url::Origin);

impl Origin {
    fn of(url: &str) -> Option<Origin> {
        let parsed = url::Url::parse(url).ok()?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return None;
        }
        Some(Origin(parsed.origin()))
    }
}

/// `reference` (a `Location` or `Link` target) made absolute against the absolute URL `base`
/// (RFC 3986 resolution, by the `url` crate).
fn resolve_url(base: &str, reference: &str) -> Option<String> {
    let resolved = url::Url::parse(base).ok()?.join(reference).ok()?;
    Some(resolved.into())
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
    /// A subset of the repository's `config.json` (`model_type`, `architectures`, …); read
    /// loosely, so that an odd one costs only its model type, not the search.
    #[serde(default)]
    config: Option<serde_json::Value>,
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
        let model_type = self
            .config
            .as_ref()
            .and_then(|c| c.get("model_type"))
            .and_then(serde_json::Value::as_str)
            .filter(|t| {
                !t.is_empty()
                    && t.len() <= 64
                    && t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
            })
            .map(str::to_owned);
        HubModel {
            id: self.id,
            downloads: self.downloads,
            likes: self.likes,
            last_modified: self.last_modified,
            tags: self.tags,
            weights_bytes,
            model_type,
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

/// A revision (branch, tag or commit) that can name a file under `refs/`, where
/// `huggingface_hub` writes `refs/{revision}` (`refs/pr/1` becomes `refs/refs/pr/1`): at most
/// 255 bytes of `/`-separated parts, none empty, none starting with `.` or `-`, without control
/// characters, spaces or any of `\ : * ? " < > | ~ ^ [`. Git refuses all of these in branch and
/// tag names too (but `" < > |`, which Windows refuses in file names), so `main`, `v1.0`,
/// `refs/pr/1` and commits pass, while `..`, `a/../b` or `/etc` cannot leave `refs/`.
///
/// Errors: [`HubError::InvalidRevision`], naming the revision and what is wrong with it.
pub(crate) fn check_revision(revision: &str) -> Result<(), HubError> {
    let refuse = |reason: String| {
        Err(HubError::InvalidRevision {
            revision: revision.to_owned(),
            reason,
        })
    };
    if revision.is_empty() {
        return refuse("it is empty".into());
    }
    if revision.len() > MAX_REVISION_BYTES {
        return refuse(format!("it is longer than {MAX_REVISION_BYTES} bytes"));
    }
    let forbidden = |c: char| c.is_control() || " \\:*?\"<>|~^[".contains(c);
    if let Some(c) = revision.chars().find(|&c| forbidden(c)) {
        return refuse(format!("it contains {c:?}"));
    }
    for part in revision.split('/') {
        if part.is_empty() {
            return refuse("it has an empty part (a leading, trailing or double `/`)".into());
        }
        if part == "." || part == ".." {
            return refuse(format!(
                "it has a `{part}` part, which would name a path outside the cache's `refs/`"
            ));
        }
        if part.starts_with('.') || part.starts_with('-') {
            return refuse(format!("its part {part:?} starts with `{}`", &part[..1]));
        }
    }
    Ok(())
}

/// A file whose path and blob hash can name files in the cache: [`check_path`], and a SHA-256
/// (LFS) or Git hash (40 or 64 hex digits) as its etag.
pub(crate) fn check_file(file: &RemoteFile) -> Result<(), String> {
    check_path(&file.path)?;
    let well_formed = if file.lfs {
        is_hex(&file.etag, 64)
    } else {
        is_commit_hash(&file.etag)
    };
    if !well_formed {
        return Err(format!("{}: {:?} is not a blob hash", file.path, file.etag));
    }
    Ok(())
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

/// A Git object id: 40 hex digits (SHA-1), or 64 (SHA-256 repositories).
pub(crate) fn is_commit_hash(s: &str) -> bool {
    is_hex(s, 40) || is_hex(s, 64)
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
    fn revisions_are_checked_as_names_under_refs() {
        let commit = "0123456789abcdef0123456789abcdef01234567";
        for good in [
            "main",
            "v1.0",
            "refs/pr/1",
            "release-2024_01",
            commit,
            "a.b/c-d",
        ] {
            assert!(check_revision(good).is_ok(), "{good}");
        }
        let long = "a".repeat(256);
        for bad in [
            "",
            ".",
            "..",
            "../../x",
            "a/../b",
            "a/./b",
            "/etc/passwd",
            "main/",
            "a//b",
            ".hidden",
            "-rf",
            "a\\..\\b",
            "x\0y",
            "tab\there",
            "with space",
            "c:x",
            "a*",
            long.as_str(),
        ] {
            let err = check_revision(bad).unwrap_err();
            assert!(
                matches!(&err, HubError::InvalidRevision { revision, .. } if revision == bad),
                "{bad:?}: {err}"
            );
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
        assert!(check_revision(&"a".repeat(255)).is_ok());
        assert!(is_commit_hash(commit) && is_commit_hash(&"f".repeat(64)));
        assert!(!is_commit_hash("../../x") && !is_commit_hash(&commit[1..]));
    }

    #[test]
    fn origins_compare_scheme_host_and_port() {
        let hub = Origin::of("https://huggingface.co");
        assert!(hub.is_some());
        for same in [
            "https://huggingface.co/api/models?x=1",
            "https://HuggingFace.co:443/a",
        ] {
            assert_eq!(Origin::of(same), hub, "{same}");
        }
        for other in [
            "http://huggingface.co/a",
            "https://huggingface.co:8443/a",
            "https://cdn-lfs.huggingface.co/a",
            "https://huggingface.co.evil.example/a",
            "https://huggingface.co@evil.example/a",
            "/api/models",
        ] {
            assert_ne!(Origin::of(other), hub, "{other}");
        }
        assert_eq!(
            Origin::of("http://127.0.0.1:8000/x"),
            Origin::of("http://127.0.0.1:8000")
        );
        assert_ne!(
            Origin::of("http://127.0.0.1:8000"),
            Origin::of("http://127.0.0.1:8001")
        );
        // An endpoint that is no URL gives no origin: the token goes nowhere.
        let client = HubClient::new("not a url", Some("t".into()), PathBuf::new());
        assert!(!client.is_endpoint("not a url/api/models"));
    }

    #[test]
    fn locations_and_links_resolve_against_the_page() {
        let base = "https://hf.co/api/models/a/b/tree/main?recursive=true";
        for (reference, resolved) in [
            ("https://cdn.example/x?sig=1", "https://cdn.example/x?sig=1"),
            ("//cdn.example/x", "https://cdn.example/x"),
            ("/api/x?cursor=2", "https://hf.co/api/x?cursor=2"),
            (
                "?cursor=2",
                "https://hf.co/api/models/a/b/tree/main?cursor=2",
            ),
            (
                "other?cursor=2",
                "https://hf.co/api/models/a/b/tree/other?cursor=2",
            ),
        ] {
            assert_eq!(
                resolve_url(base, reference).as_deref(),
                Some(resolved),
                "{reference}"
            );
        }
        assert_eq!(resolve_url("/relative/base", "/x"), None);
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

    #[test]
    fn the_model_type_is_read_from_the_config_the_hub_indexes() {
        let model_type = |json: &str| {
            serde_json::from_str::<SearchHit>(json)
                .unwrap()
                .into_model()
                .model_type
        };
        assert_eq!(
            model_type(
                r#"{"id": "a/b", "config": {"architectures": ["Gemma3ForConditionalGeneration"],
                "model_type": "gemma3", "tokenizer_config": {}}}"#
            )
            .as_deref(),
            Some("gemma3")
        );
        // Missing, odd or hostile: no model type, and the search still reads.
        for json in [
            r#"{"id": "a/b"}"#,
            r#"{"id": "a/b", "config": null}"#,
            r#"{"id": "a/b", "config": []}"#,
            r#"{"id": "a/b", "config": {"model_type": 3}}"#,
            r#"{"id": "a/b", "config": {"model_type": ""}}"#,
            r#"{"id": "a/b", "config": {"model_type": "<script>alert(1)</script>"}}"#,
        ] {
            assert_eq!(model_type(json), None, "{json}");
        }
        let long = format!(
            r#"{{"id": "a/b", "config": {{"model_type": "{}"}}}}"#,
            "x".repeat(65)
        );
        assert_eq!(model_type(&long), None);
    }
}
