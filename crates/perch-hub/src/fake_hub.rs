//! A fake Hugging Face Hub on 127.0.0.1 for tests: the routes [`crate::HubClient`] and
//! `huggingface_hub` use (search, revision, paged tree, resolve with ranges and an LFS redirect),
//! serving repositories from memory, with knobs for the failures a download must survive and for
//! a hostile hub's tricks (page links and redirects to another server, slow answers), and
//! answers recorded from the real Hub served byte for byte ([`RecordedAnswer`]). It records every
//! request ([`FakeHub::requests`], with its `Authorization`) and counts the file bodies it sends
//! ([`FakeHub::bodies_served`]).
//!
//! ```no_run
//! use perch_hub::fake_hub::{FakeHub, FakeRepo};
//! let hub = FakeHub::start(vec![FakeRepo::new("org/model", vec![("config.json", b"{}".to_vec())])]);
//! let client = perch_hub::HubClient::new(hub.url(), None, "/tmp/cache".into());
//! ```

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use sha1::Sha1;
use sha2::{Digest, Sha256};

/// A repository the fake serves.
#[derive(Clone, Debug)]
pub struct FakeRepo {
    pub id: String,
    /// 40 hex digits.
    pub commit: String,
    pub files: Vec<FakeFile>,
    pub downloads: u64,
    pub likes: u64,
    /// Element counts per safetensors dtype, as the Hub's `expand[]=safetensors` reports them.
    pub safetensors_parameters: BTreeMap<String, u64>,
}

#[derive(Clone, Debug)]
pub struct FakeFile {
    pub path: String,
    pub content: Arc<Vec<u8>>,
    /// Stored with Git LFS: listed with a SHA-256 and served through a redirect.
    pub lfs: bool,
    /// See [`FakeFile::etag`]; hashed once, not per request.
    etag: String,
}

impl FakeRepo {
    /// A repository of `files` (path, content); `*.safetensors` are LFS files, as on the Hub.
    /// The commit is derived from the contents.
    pub fn new(id: &str, files: Vec<(&str, Vec<u8>)>) -> Self {
        let mut commit = Sha1::new();
        let files: Vec<FakeFile> = files
            .into_iter()
            .map(|(path, content)| {
                commit.update(path.as_bytes());
                commit.update(&content);
                let lfs = path.ends_with(".safetensors");
                FakeFile {
                    path: path.to_owned(),
                    etag: blob_hash(&content, lfs),
                    lfs,
                    content: Arc::new(content),
                }
            })
            .collect();
        FakeRepo {
            id: id.to_owned(),
            commit: hex(&commit.finalize()),
            files,
            downloads: 0,
            likes: 0,
            safetensors_parameters: BTreeMap::new(),
        }
    }

    /// A repository of the files directly in `dir` (e.g. a model in mlx-community layout), with
    /// the safetensors metadata the Hub would derive from their headers.
    pub fn from_dir(id: &str, dir: &Path) -> std::io::Result<Self> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.is_file() {
                let name = path
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                files.push((name, std::fs::read(&path)?));
            }
        }
        files.sort();
        let mut repo = FakeRepo::new(
            id,
            files.iter().map(|(p, c)| (p.as_str(), c.clone())).collect(),
        );
        for (name, content) in &files {
            if name.ends_with(".safetensors") {
                for (dtype, count) in safetensors_parameters(content) {
                    *repo.safetensors_parameters.entry(dtype).or_default() += count;
                }
            }
        }
        Ok(repo)
    }
}

impl FakeFile {
    /// The hash the Hub lists: SHA-256 for LFS files, else Git's blob id.
    pub fn etag(&self) -> &str {
        &self.etag
    }
}

/// SHA-256 of `content` (`lfs`), else Git's blob id: SHA-1 of `blob {len}\0` + content.
fn blob_hash(content: &[u8], lfs: bool) -> String {
    if lfs {
        hex(&Sha256::digest(content))
    } else {
        let mut sha1 = Sha1::new();
        sha1.update(format!("blob {}\0", content.len()).as_bytes());
        sha1.update(content);
        hex(&sha1.finalize())
    }
}

/// Element counts per dtype in a safetensors file's header (8-byte little-endian length, then
/// JSON `{name: {dtype, shape, data_offsets}}`), as the Hub reports them; empty if unreadable.
fn safetensors_parameters(content: &[u8]) -> BTreeMap<String, u64> {
    #[derive(Deserialize)]
    struct Tensor {
        dtype: String,
        shape: Vec<u64>,
    }
    let mut counts = BTreeMap::new();
    let Some(len) = content
        .get(..8)
        .and_then(|b| Some(u64::from_le_bytes(b.try_into().ok()?)))
    else {
        return counts;
    };
    let header = content.get(8..8 + len as usize).unwrap_or_default();
    let Ok(tensors) = serde_json::from_slice::<BTreeMap<String, serde_json::Value>>(header) else {
        return counts;
    };
    for (name, tensor) in tensors {
        if name == "__metadata__" {
            continue;
        }
        if let Ok(tensor) = serde_json::from_value::<Tensor>(tensor) {
            *counts.entry(tensor.dtype).or_default() += tensor.shape.iter().product::<u64>();
        }
    }
    counts
}

/// One request the fake received.
#[derive(Clone, Debug, PartialEq)]
pub struct SeenRequest {
    /// Path and query.
    pub uri: String,
    pub range: Option<String>,
    pub authorization: Option<String>,
}

/// Failures and limits to simulate; change them with [`FakeHub::configure`].
#[derive(Clone, Debug, Default)]
pub struct Behaviour {
    /// Cut the connection after about this many body bytes (whole 64 KiB chunks) of the next
    /// `cut_bodies` file responses longer than that.
    pub cut_after: u64,
    pub cut_bodies: usize,
    /// Pause this long before each 64 KiB of a file body (to cancel mid-download).
    pub chunk_delay: Duration,
    /// Serve these paths with one byte changed (a corrupted transfer).
    pub corrupt: Vec<String>,
    /// Answer 401 unless `Authorization: Bearer {token}` is sent.
    pub required_token: Option<String>,
    /// Ignore `Range` and always send whole files (200).
    pub ignore_ranges: bool,
    /// Tree entries per page (0: all on one page).
    pub tree_page_size: usize,
    /// Where the tree's `Link: <…>; rel="next"` points, instead of the fake's own URL (e.g.
    /// another fake, on another port, as a hostile hub could).
    pub next_page_url: Option<String>,
    /// Where LFS files are redirected (`{url}/cdn/…`, served by any fake with the same
    /// repositories), instead of the fake's own `/cdn/…` (the Hub's CDN is another host).
    pub lfs_redirect_url: Option<String>,
    /// Pause this long before answering each `/api/…` request (to time a listing out).
    pub api_delay: Duration,
    /// Answers served instead of the fake's own; the first that matches a request wins.
    pub recorded: Vec<RecordedAnswer>,
}

/// A response of the real Hub, served as recorded: status 200, its body's exact bytes.
#[derive(Clone, Debug, Default)]
pub struct RecordedAnswer {
    /// The request path it answers, without the query.
    pub path: String,
    /// Only for requests whose query contains this (e.g. a page's `cursor=…`).
    pub query_contains: Option<String>,
    /// The `Content-Type` the Hub sent.
    pub content_type: String,
    /// A `Link` header; `{endpoint}` becomes the fake's URL (the Hub's links are absolute).
    pub link: Option<String>,
    pub body: Vec<u8>,
}

impl RecordedAnswer {
    fn answers(&self, uri: &axum::http::Uri) -> bool {
        let query = uri.query().unwrap_or_default();
        uri.path() == self.path
            && self
                .query_contains
                .as_deref()
                .is_none_or(|needle| query.contains(needle))
    }

    fn response(&self, endpoint: &str) -> Response {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", header_value(&self.content_type));
        if let Some(link) = &self.link {
            headers.insert("link", header_value(&link.replace("{endpoint}", endpoint)));
        }
        (StatusCode::OK, headers, self.body.clone()).into_response()
    }
}

struct Shared {
    /// The server's own URL, for absolute links.
    url: String,
    repos: Vec<FakeRepo>,
    behaviour: Behaviour,
    requests: Vec<SeenRequest>,
    /// Bodies sent (200 or 206) per file path.
    bodies_served: BTreeMap<String, usize>,
}

type SharedState = Arc<Mutex<Shared>>;

/// The running fake; it stops when dropped.
pub struct FakeHub {
    url: String,
    shared: SharedState,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

const CHUNK: usize = 64 * 1024;

impl FakeHub {
    /// Serves `repos` on a free port of 127.0.0.1, in a thread of its own.
    ///
    /// Panics if no port can be bound (a test fixture, not product code).
    pub fn start(repos: Vec<FakeRepo>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let url = format!("http://{}", listener.local_addr().expect("local address"));
        let shared = Arc::new(Mutex::new(Shared {
            url: url.clone(),
            repos,
            behaviour: Behaviour {
                tree_page_size: 2,
                ..Behaviour::default()
            },
            requests: Vec::new(),
            bodies_served: BTreeMap::new(),
        }));
        let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
        let state = shared.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let app = Router::new()
                    .route("/api/models", get(search))
                    .route("/api/models/{org}/{name}/revision/{rev}", get(revision))
                    .route("/api/models/{org}/{name}/tree/{rev}", get(tree))
                    .route("/{org}/{name}/resolve/{rev}/{*path}", get(resolve))
                    .route("/cdn/{org}/{name}/{*path}", get(cdn))
                    .layer(axum::middleware::from_fn_with_state(state.clone(), record))
                    .with_state(state);
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stopped.await;
                    })
                    .await;
            });
        });
        FakeHub {
            url,
            shared,
            shutdown: Some(shutdown),
        }
    }

    /// `http://127.0.0.1:{port}`: the endpoint to give a client (or `HF_ENDPOINT`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Changes the failures to simulate from now on.
    pub fn configure(&self, change: impl FnOnce(&mut Behaviour)) {
        change(&mut lock(&self.shared).behaviour);
    }

    /// Every request so far, in order.
    pub fn requests(&self) -> Vec<SeenRequest> {
        lock(&self.shared).requests.clone()
    }

    /// How many times the file at `path` was sent, whole or in part (its 200 and 206 answers,
    /// from resolve or the CDN; redirects and errors do not count).
    pub fn bodies_served(&self, path: &str) -> usize {
        lock(&self.shared)
            .bodies_served
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    /// Requests for the file at `path` (resolve and CDN), in order.
    pub fn file_requests(&self, path: &str) -> Vec<SeenRequest> {
        let suffix = format!("/{path}");
        self.requests()
            .into_iter()
            .filter(|r| {
                let path = r.uri.split('?').next().unwrap_or_default();
                !path.starts_with("/api/") && path.ends_with(&suffix)
            })
            .collect()
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// A poisoned lock only means a handler panicked; the data is still usable for a fake.
fn lock(shared: &SharedState) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

async fn record(
    State(shared): State<SharedState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let seen = {
        let header = |name: &str| {
            let value = request.headers().get(name)?.to_str().ok()?;
            Some(value.to_owned())
        };
        SeenRequest {
            uri: request.uri().to_string(),
            range: header("range"),
            authorization: header("authorization"),
        }
    };
    let (required, recorded, api_delay) = {
        let mut shared = lock(&shared);
        shared.requests.push(seen.clone());
        let recorded = (shared.behaviour.recorded.iter())
            .find(|answer| answer.answers(request.uri()))
            .map(|answer| answer.response(&shared.url));
        let b = &shared.behaviour;
        (b.required_token.clone(), recorded, b.api_delay)
    };
    if seen.uri.starts_with("/api/") && !api_delay.is_zero() {
        tokio::time::sleep(api_delay).await;
    }
    // The CDN's signed URLs need no token; everything else on the Hub may.
    if let Some(token) = required {
        if !seen.uri.starts_with("/cdn/") && seen.authorization != Some(format!("Bearer {token}")) {
            return (StatusCode::UNAUTHORIZED, "Invalid credentials").into_response();
        }
    }
    match recorded {
        Some(response) => response,
        None => next.run(request).await,
    }
}

#[derive(Deserialize)]
struct SearchParams {
    #[serde(default)]
    search: String,
    author: Option<String>,
    limit: Option<usize>,
}

async fn search(State(shared): State<SharedState>, Query(params): Query<SearchParams>) -> Response {
    let shared = lock(&shared);
    let needle = params.search.to_lowercase();
    let mut found: Vec<&FakeRepo> = shared
        .repos
        .iter()
        .filter(|r| r.id.to_lowercase().contains(&needle))
        .filter(|r| {
            params
                .author
                .as_ref()
                .is_none_or(|a| r.id.starts_with(&format!("{a}/")))
        })
        .collect();
    found.sort_by_key(|r| std::cmp::Reverse(r.downloads));
    found.truncate(params.limit.unwrap_or(1000));
    let hits: Vec<_> = found
        .iter()
        .map(|r| {
            let mut hit = json!({
                "_id": r.commit, "id": r.id, "downloads": r.downloads, "likes": r.likes,
                "lastModified": "2026-01-01T00:00:00.000Z", "tags": ["mlx", "safetensors"],
            });
            if !r.safetensors_parameters.is_empty() {
                let total: u64 = r.safetensors_parameters.values().sum();
                hit["safetensors"] =
                    json!({"parameters": r.safetensors_parameters, "total": total});
            }
            // As the Hub does: the config.json fields it indexes.
            let config = r
                .files
                .iter()
                .find(|f| f.path == "config.json")
                .and_then(|f| serde_json::from_slice::<serde_json::Value>(&f.content).ok());
            if let Some(config) = config {
                let mut indexed = json!({});
                for key in ["architectures", "model_type"] {
                    if let Some(value) = config.get(key) {
                        indexed[key] = value.clone();
                    }
                }
                hit["config"] = indexed;
            }
            hit
        })
        .collect();
    Json(hits).into_response()
}

fn find_repo<'a>(shared: &'a Shared, org: &str, name: &str, rev: &str) -> Option<&'a FakeRepo> {
    let id = format!("{org}/{name}");
    shared
        .repos
        .iter()
        .find(|r| r.id == id && (rev == "main" || rev == r.commit))
}

fn not_found() -> Response {
    (StatusCode::NOT_FOUND, "Repository not found").into_response()
}

async fn revision(
    State(shared): State<SharedState>,
    UrlPath((org, name, rev)): UrlPath<(String, String, String)>,
) -> Response {
    let shared = lock(&shared);
    let Some(repo) = find_repo(&shared, &org, &name, &rev) else {
        return not_found();
    };
    let siblings: Vec<_> = repo
        .files
        .iter()
        .map(|f| json!({"rfilename": f.path}))
        .collect();
    Json(json!({"id": repo.id, "sha": repo.commit, "siblings": siblings})).into_response()
}

#[derive(Deserialize)]
struct TreeParams {
    cursor: Option<usize>,
}

async fn tree(
    State(shared): State<SharedState>,
    UrlPath((org, name, rev)): UrlPath<(String, String, String)>,
    Query(params): Query<TreeParams>,
) -> Response {
    let shared = lock(&shared);
    let Some(repo) = find_repo(&shared, &org, &name, &rev) else {
        return not_found();
    };
    let entries: Vec<_> = repo
        .files
        .iter()
        .map(|f| {
            let mut entry =
                json!({"type": "file", "path": f.path, "size": f.content.len(), "oid": git_oid(f)});
            if f.lfs {
                entry["lfs"] =
                    json!({"oid": f.etag(), "size": f.content.len(), "pointerSize": 134});
            }
            entry
        })
        .collect();
    let start = params.cursor.unwrap_or(0).min(entries.len());
    let page = match shared.behaviour.tree_page_size {
        0 => entries.len(),
        n => n,
    };
    let end = (start + page).min(entries.len());
    let mut response = Json(entries[start..end].to_vec()).into_response();
    if end < entries.len() {
        let base = (shared.behaviour.next_page_url.as_ref()).unwrap_or(&shared.url);
        let link = format!(
            "<{base}/api/models/{}/tree/{rev}?recursive=true&cursor={end}>; rel=\"next\"",
            repo.id
        );
        response.headers_mut().insert("link", header_value(&link));
    }
    response
}

/// The tree's `oid` of a file: the Git blob id of what Git stores (the pointer file for LFS).
fn git_oid(file: &FakeFile) -> String {
    if !file.lfs {
        return file.etag.clone();
    }
    let pointer = format!(
        "version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize {}\n",
        file.etag,
        file.content.len()
    );
    blob_hash(pointer.as_bytes(), false)
}

async fn resolve(
    State(shared): State<SharedState>,
    UrlPath((org, name, rev, path)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let (repo_commit, file) = match find_file(&shared, &org, &name, &rev, &path) {
        Ok(found) => found,
        Err(response) => return response,
    };
    if file.lfs {
        // As the Hub: LFS files live on a CDN; its signed URL needs no token.
        let base = lock(&shared).behaviour.lfs_redirect_url.clone();
        let mut response = StatusCode::FOUND.into_response();
        let location = format!(
            "{}/cdn/{org}/{name}/{path}?commit={repo_commit}",
            base.unwrap_or_default()
        );
        response
            .headers_mut()
            .insert("location", header_value(&location));
        response
            .headers_mut()
            .insert("x-repo-commit", header_value(&repo_commit));
        response.headers_mut().insert(
            "x-linked-etag",
            header_value(&format!("\"{}\"", file.etag())),
        );
        response.headers_mut().insert(
            "x-linked-size",
            header_value(&file.content.len().to_string()),
        );
        return response;
    }
    serve_file(&shared, &file, &repo_commit, &headers)
}

#[derive(Deserialize)]
struct CdnParams {
    commit: String,
}

async fn cdn(
    State(shared): State<SharedState>,
    UrlPath((org, name, path)): UrlPath<(String, String, String)>,
    Query(params): Query<CdnParams>,
    headers: HeaderMap,
) -> Response {
    match find_file(&shared, &org, &name, &params.commit, &path) {
        Ok((commit, file)) => serve_file(&shared, &file, &commit, &headers),
        Err(response) => response,
    }
}

/// The file at `path` of `org/name` at `rev`, with the repository's commit; else a 404.
#[allow(clippy::result_large_err)] // axum's Response is the handler's error type
fn find_file(
    shared: &SharedState,
    org: &str,
    name: &str,
    rev: &str,
    path: &str,
) -> Result<(String, FakeFile), Response> {
    let shared = lock(shared);
    let repo = find_repo(&shared, org, name, rev).ok_or_else(not_found)?;
    let file = repo.files.iter().find(|f| f.path == path);
    let file = file.ok_or_else(|| (StatusCode::NOT_FOUND, "Entry not found").into_response())?;
    Ok((repo.commit.clone(), file.clone()))
}

/// The file's bytes (a `Range: bytes=a-` or `bytes=a-b` part of them, 206), cut, slowed or
/// corrupted as [`Behaviour`] says.
fn serve_file(
    shared: &SharedState,
    file: &FakeFile,
    commit: &str,
    headers: &HeaderMap,
) -> Response {
    let (delay, corrupt, ignore_ranges) = {
        let b = &lock(shared).behaviour;
        (
            b.chunk_delay,
            b.corrupt.contains(&file.path),
            b.ignore_ranges,
        )
    };
    let mut content = file.content.as_ref().clone();
    if corrupt && !content.is_empty() {
        content[0] ^= 0xff;
    }
    let size = content.len();
    let range = headers
        .get("range")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
        .filter(|_| !ignore_ranges)
        .and_then(|r| {
            let (first, last) = r.split_once('-')?;
            let first: usize = first.parse().ok()?;
            let last: usize = if last.is_empty() {
                size.saturating_sub(1)
            } else {
                last.parse().ok()?
            };
            Some((first, last.min(size.saturating_sub(1))))
        });
    let mut response_headers = HeaderMap::new();
    response_headers.insert("etag", header_value(&format!("\"{}\"", file.etag())));
    response_headers.insert("x-repo-commit", header_value(commit));
    response_headers.insert("accept-ranges", HeaderValue::from_static("bytes"));
    let (status, body) = match range {
        Some((first, _)) if first >= size => {
            response_headers.insert("content-range", header_value(&format!("bytes */{size}")));
            return (StatusCode::RANGE_NOT_SATISFIABLE, response_headers).into_response();
        }
        Some((first, last)) => {
            response_headers.insert(
                "content-range",
                header_value(&format!("bytes {first}-{last}/{size}")),
            );
            (StatusCode::PARTIAL_CONTENT, content[first..=last].to_vec())
        }
        None => (StatusCode::OK, content),
    };
    response_headers.insert("content-length", header_value(&body.len().to_string()));
    // Only a body long enough to be cut counts against `cut_bodies`.
    let cut = {
        let mut shared = lock(shared);
        *shared.bodies_served.entry(file.path.clone()).or_default() += 1;
        let b = &mut shared.behaviour;
        let cut = b.cut_bodies > 0 && body.len() as u64 > b.cut_after;
        if cut {
            b.cut_bodies -= 1;
        }
        cut.then_some(b.cut_after)
    };
    let chunks: Vec<Bytes> = body.chunks(CHUNK).map(Bytes::copy_from_slice).collect();
    // State: the chunks left (none once cut) and the bytes sent.
    let stream = futures_util::stream::unfold(
        (Some(chunks.into_iter()), 0u64),
        move |(chunks, sent)| async move {
            let mut chunks = chunks?;
            let chunk = chunks.next()?;
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let sent = sent + chunk.len() as u64;
            if cut.is_some_and(|limit| sent > limit) {
                // Let hyper flush what was sent, then it closes the connection short of
                // Content-Length: a lost connection.
                tokio::time::sleep(Duration::from_millis(100)).await;
                let cut: Result<Bytes, _> = Err(std::io::Error::other("cut by the fake hub"));
                return Some((cut, (None, sent)));
            }
            Some((Ok(chunk), (Some(chunks), sent)))
        },
    );
    (status, response_headers, Body::from_stream(stream)).into_response()
}

fn header_value(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
