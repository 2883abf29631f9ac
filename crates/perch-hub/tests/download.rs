//! Search, snapshot listing and downloads against the fake hub on 127.0.0.1.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use perch_hub::fake_hub::{FakeHub, FakeRepo};
use perch_hub::{Downloaded, HubClient, HubError, ModelSource, RemoteSnapshot, SearchQuery};

const REPO: &str = "mlx-community/Tiny-4bit";

/// A model-shaped repository: small JSON files, a 1 MiB LFS weights file, and files mlx-lm
/// does not download.
fn tiny_repo() -> FakeRepo {
    let weights: Vec<u8> = (0..1024 * 1024u32).map(|i| (i * 31 % 251) as u8).collect();
    FakeRepo::new(
        REPO,
        vec![
            ("config.json", br#"{"model_type": "llama"}"#.to_vec()),
            ("model.safetensors", weights),
            ("tokenizer.json", b"{\"model\": {}}".to_vec()),
            ("tokenizer_config.json", b"{}".to_vec()),
            ("README.md", b"# Tiny".to_vec()),
            ("images/logo.png", vec![0x89; 100]),
        ],
    )
}

fn file_content(repo: &FakeRepo, path: &str) -> Vec<u8> {
    let file = repo.files.iter().find(|f| f.path == path).unwrap();
    file.content.as_ref().clone()
}

fn client(hub: &FakeHub, cache: &Path) -> HubClient {
    HubClient::new(hub.url(), None, cache.to_path_buf())
}

fn repo_dir(cache: &Path) -> PathBuf {
    cache.join("models--mlx-community--Tiny-4bit")
}

/// The tiny repository on a fake hub, an empty cache, a client of the hub and the snapshot.
struct Fixture {
    repo: FakeRepo,
    hub: FakeHub,
    cache: tempfile::TempDir,
    client: HubClient,
    snapshot: RemoteSnapshot,
}

fn fixture() -> Fixture {
    let repo = tiny_repo();
    let hub = FakeHub::start(vec![repo.clone()]);
    let cache = tempfile::tempdir().unwrap();
    let client = client(&hub, cache.path());
    let snapshot = client.snapshot(REPO, "main").unwrap();
    Fixture {
        repo,
        hub,
        cache,
        client,
        snapshot,
    }
}

/// Downloads `snapshot`, neither cancelled nor watched.
fn download(client: &HubClient, snapshot: &RemoteSnapshot) -> Result<Downloaded, HubError> {
    client.download(snapshot, &AtomicBool::new(false), &mut |_| {})
}

/// The download holds the weights byte for byte.
fn assert_weights(repo: &FakeRepo, done: &Downloaded) {
    let weights = fs::read(done.snapshot_dir.join("model.safetensors")).unwrap();
    assert!(
        weights == file_content(repo, "model.safetensors"),
        "the weights differ"
    );
}

/// Search results' configs, fetched together before anything is downloaded: each model's own
/// text, or its own error (no config, one over the size limit), in the order asked.
#[test]
fn configs_of_search_results_come_with_their_own_errors() {
    let config = br#"{"model_type": "llama", "hidden_size": 64}"#.to_vec();
    let huge = vec![b' '; perch_hub::MAX_CONFIG_TEXT_BYTES as usize + 1];
    let repos = vec![
        FakeRepo::new("org/a", vec![("config.json", config.clone())]),
        FakeRepo::new("org/no-config", vec![("model.safetensors", vec![0; 8])]),
        FakeRepo::new("org/huge", vec![("config.json", huge)]),
    ];
    let hub = FakeHub::start(repos);
    let cache = tempfile::tempdir().unwrap();
    let client = client(&hub, cache.path());
    assert_eq!(
        client.config_text("org/a", "main").unwrap().as_bytes(),
        &config[..]
    );
    let ids: Vec<String> = ["org/a", "org/no-config", "org/huge", "../etc"]
        .map(String::from)
        .to_vec();
    let results = client.config_texts(&ids);
    assert_eq!(results.len(), 4);
    assert_eq!(results[0].as_ref().unwrap().as_bytes(), &config[..]);
    assert!(
        matches!(&results[1], Err(HubError::Status { status: 404, .. })),
        "{:?}",
        results[1]
    );
    assert!(
        matches!(&results[2], Err(HubError::BadResponse { .. })),
        "{:?}",
        results[2]
    );
    assert!(
        matches!(&results[3], Err(HubError::InvalidRepoId(_))),
        "{:?}",
        results[3]
    );
}

#[test]
fn search_finds_models_by_author_and_text_with_their_size() {
    let mut qwen = FakeRepo::new("mlx-community/Qwen3-0.6B-4bit", vec![]);
    qwen.downloads = 500;
    qwen.safetensors_parameters = BTreeMap::from([("BF16".into(), 100), ("U32".into(), 1000)]);
    let mut llama = FakeRepo::new("mlx-community/Llama-3.2-1B-Instruct-4bit", vec![]);
    llama.downloads = 900;
    let mut other = FakeRepo::new("someone/Qwen3-0.6B", vec![]);
    other.downloads = 10_000;
    let hub = FakeHub::start(vec![qwen, llama, other]);
    let cache = tempfile::tempdir().unwrap();
    let client = client(&hub, cache.path());

    let found = client
        .search(&SearchQuery {
            text: "QWEN".into(),
            ..SearchQuery::default()
        })
        .unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].id, "mlx-community/Qwen3-0.6B-4bit");
    assert_eq!(found[0].weights_bytes, Some(100 * 2 + 1000 * 4));
    assert_eq!(found[0].downloads, 500);

    let all = client.search(&SearchQuery::default()).unwrap();
    let ids: Vec<&str> = all.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "mlx-community/Llama-3.2-1B-Instruct-4bit",
            "mlx-community/Qwen3-0.6B-4bit"
        ],
        "mlx-community only, most downloaded first"
    );
    assert_eq!(all[0].weights_bytes, None, "no safetensors metadata");
    let asked = &hub.requests()[0].uri;
    assert!(
        asked.contains("author=mlx-community") && asked.contains("expand%5B%5D=safetensors"),
        "{asked}"
    );
}

#[test]
fn a_snapshot_lists_the_model_files_across_pages() {
    let repo = tiny_repo();
    let hub = FakeHub::start(vec![repo.clone()]);
    let cache = tempfile::tempdir().unwrap();
    let snapshot = client(&hub, cache.path()).snapshot(REPO, "main").unwrap();

    assert_eq!(snapshot.commit, repo.commit);
    let paths: Vec<&str> = snapshot.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ],
        "README and images are not model files"
    );
    let weights = &snapshot.files[1];
    assert!(weights.lfs);
    assert_eq!(weights.size, 1024 * 1024);
    assert_eq!(weights.etag, repo.files[1].etag());
    let tree_pages = hub
        .requests()
        .iter()
        .filter(|r| r.uri.contains("/tree/"))
        .count();
    assert_eq!(tree_pages, 3, "6 entries, 2 per page");
}

#[test]
fn a_download_lays_out_the_cache_as_huggingface_hub_does() {
    let Fixture {
        repo,
        hub,
        cache,
        client,
        snapshot,
    } = fixture();
    let mut reports = Vec::new();
    let done = client
        .download(&snapshot, &AtomicBool::new(false), &mut |p| {
            reports.push(p.clone())
        })
        .unwrap();

    let dir = repo_dir(cache.path());
    assert_eq!(done.snapshot_dir, dir.join("snapshots").join(&repo.commit));
    assert_eq!(done.bytes_fetched, snapshot.total_bytes());
    assert_eq!(
        fs::read_to_string(dir.join("refs/main")).unwrap(),
        repo.commit
    );
    for file in &snapshot.files {
        let pointer = done.snapshot_dir.join(&file.path);
        assert_eq!(
            fs::read_link(&pointer).unwrap(),
            Path::new("../../blobs").join(&file.etag),
            "relative link, as huggingface_hub writes"
        );
        assert_eq!(fs::read(&pointer).unwrap(), file_content(&repo, &file.path));
    }
    assert!(!done.snapshot_dir.join("README.md").exists());
    let last = reports.last().unwrap();
    assert_eq!(
        (last.bytes_done, last.files_done),
        (snapshot.total_bytes(), 4)
    );
    assert!(reports
        .windows(2)
        .all(|w| w[0].bytes_done <= w[1].bytes_done));

    // hf-hub's cache reader and Perch's local list find it.
    let config = hf_hub::Cache::new(cache.path().to_path_buf())
        .model(REPO.into())
        .get("config.json");
    assert_eq!(config, Some(done.snapshot_dir.join("config.json")));
    let local = perch_hub::local_models(&cache.path().join("none"), Some(cache.path()));
    assert_eq!(local.len(), 1);
    assert_eq!(
        (local[0].name.as_str(), local[0].source),
        (REPO, ModelSource::HuggingFace)
    );

    // A second download fetches nothing.
    let before = hub.requests().len();
    let again = download(&client, &snapshot).unwrap();
    assert_eq!(
        (again.bytes_fetched, again.bytes_reused),
        (0, snapshot.total_bytes())
    );
    assert!(hub.requests()[before..]
        .iter()
        .all(|r| r.uri.starts_with("/api/")));
}

#[test]
fn a_lost_connection_is_resumed_with_a_range_request() {
    let Fixture {
        repo,
        hub,
        cache: _cache,
        client,
        snapshot,
    } = fixture();
    hub.configure(|b| {
        b.cut_after = 300_000;
        b.cut_bodies = 1;
    });
    let done = download(&client, &snapshot).unwrap();

    assert_weights(&repo, &done);
    // The first file request was cut; the retry asked only for the rest.
    let cdn: Vec<_> = hub
        .file_requests("model.safetensors")
        .into_iter()
        .filter(|r| r.uri.starts_with("/cdn/"))
        .collect();
    assert_eq!(cdn.len(), 2, "{cdn:?}");
    let from: u64 = cdn[1]
        .range
        .as_deref()
        .unwrap()
        .strip_prefix("bytes=")
        .unwrap()
        .trim_end_matches('-')
        .parse()
        .unwrap();
    assert!(from > 0 && from <= 300_000, "resumed from {from}");
}

#[test]
fn a_cancelled_download_keeps_its_part_and_the_next_one_resumes_it() {
    let Fixture {
        repo,
        hub,
        cache,
        client,
        snapshot,
    } = fixture();
    hub.configure(|b| b.chunk_delay = Duration::from_millis(30));

    let cancel = AtomicBool::new(false);
    let result = client.download(&snapshot, &cancel, &mut |p| {
        if p.file == "model.safetensors" && p.bytes_done > 200_000 {
            cancel.store(true, Ordering::Relaxed);
        }
    });
    assert!(matches!(result, Err(HubError::Cancelled)), "{result:?}");
    let weights = &snapshot.files[1];
    let blobs = repo_dir(cache.path()).join("blobs");
    let partial = fs::metadata(blobs.join(format!("{}.incomplete", weights.etag)))
        .unwrap()
        .len();
    assert!(
        partial > 0 && partial < weights.size,
        "partial file of {partial} bytes"
    );
    assert!(
        !blobs.join(&weights.etag).exists(),
        "no blob until complete"
    );
    assert!(
        !repo_dir(cache.path()).join("refs/main").exists(),
        "not a model yet"
    );

    hub.configure(|b| b.chunk_delay = Duration::ZERO);
    let done = download(&client, &snapshot).unwrap();
    assert_weights(&repo, &done);
    let config = snapshot.files[0].size;
    assert_eq!(
        done.bytes_fetched,
        snapshot.total_bytes() - config - partial,
        "{done:?}"
    );
    // The resolve request and the CDN request it redirects to both ask for the rest only.
    let requests = hub.file_requests("model.safetensors");
    for request in &requests[requests.len() - 2..] {
        assert_eq!(
            request.range,
            Some(format!("bytes={partial}-")),
            "{request:?}"
        );
    }
}

#[test]
fn a_corrupted_transfer_is_caught_and_its_file_deleted() {
    let Fixture {
        repo: _,
        hub,
        cache,
        client,
        snapshot,
    } = fixture();
    hub.configure(|b| b.corrupt = vec!["model.safetensors".into(), "tokenizer.json".into()]);

    let err = download(&client, &snapshot).unwrap_err();
    assert!(
        matches!(&err, HubError::Checksum { path, .. } if path == "model.safetensors"),
        "{err}"
    );
    assert!(err
        .to_string()
        .contains("does not match the Hub's checksum"));
    let blobs = repo_dir(cache.path()).join("blobs");
    let left: Vec<String> = fs::read_dir(&blobs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        left,
        [snapshot.files[0].etag.clone()],
        "only config.json's blob stays"
    );
    assert!(!repo_dir(cache.path()).join("refs/main").exists());

    // A Git (non-LFS) file is checked against its blob id.
    hub.configure(|b| b.corrupt = vec!["tokenizer.json".into()]);
    let err = download(&client, &snapshot).unwrap_err();
    assert!(
        matches!(&err, HubError::Checksum { path, .. } if path == "tokenizer.json"),
        "{err}"
    );

    hub.configure(|b| b.corrupt.clear());
    download(&client, &snapshot).unwrap();
}

#[test]
fn a_server_ignoring_ranges_restarts_the_file() {
    let Fixture {
        repo,
        hub,
        cache,
        client,
        snapshot,
    } = fixture();
    let weights = &snapshot.files[1];
    let blobs = repo_dir(cache.path()).join("blobs");
    fs::create_dir_all(&blobs).unwrap();
    fs::write(
        blobs.join(format!("{}.incomplete", weights.etag)),
        vec![7u8; 5000],
    )
    .unwrap();
    hub.configure(|b| b.ignore_ranges = true);

    let done = download(&client, &snapshot).unwrap();
    assert_weights(&repo, &done);
    assert_eq!(
        done.bytes_fetched,
        snapshot.total_bytes(),
        "the 5000 stale bytes were dropped"
    );
}

#[test]
fn errors_say_what_is_wrong() {
    let hub = FakeHub::start(vec![tiny_repo()]);
    let cache = tempfile::tempdir().unwrap();
    let client = client(&hub, cache.path());

    let err = client
        .snapshot("mlx-community/Missing", "main")
        .unwrap_err();
    assert!(matches!(err, HubError::Status { status: 404, .. }));
    assert!(err.to_string().contains("no such repository"), "{err}");

    let err = client.snapshot("../etc", "main").unwrap_err();
    assert!(matches!(err, HubError::InvalidRepoId(_)), "{err}");
    assert!(
        hub.requests().len() == 1,
        "an invalid id is refused before any request"
    );

    hub.configure(|b| b.required_token = Some("secret".into()));
    let err = client.snapshot(REPO, "main").unwrap_err();
    assert!(err.to_string().contains("gated"), "{err}");
    let with_token = HubClient::new(hub.url(), Some("secret".into()), cache.path().to_path_buf());
    let snapshot = with_token.snapshot(REPO, "main").unwrap();
    download(&with_token, &snapshot).unwrap();

    let unreachable = HubClient::new("http://127.0.0.1:9", None, cache.path().to_path_buf());
    let err = unreachable.search(&SearchQuery::default()).unwrap_err();
    assert!(matches!(err, HubError::Network { .. }), "{err}");
}

#[test]
fn a_hub_listing_paths_outside_the_repository_is_refused() {
    let evil = FakeRepo::new(
        "mlx-community/Evil",
        vec![("../../escape.json", b"{}".to_vec())],
    );
    let hub = FakeHub::start(vec![evil]);
    let cache = tempfile::tempdir().unwrap();
    let err = client(&hub, cache.path())
        .snapshot("mlx-community/Evil", "main")
        .unwrap_err();
    assert!(matches!(err, HubError::BadResponse { .. }), "{err}");
    assert!(
        err.to_string().contains("not a safe relative file path"),
        "{err}"
    );
}

const FULL_DISK_ENV: &str = "PERCH_HUB_FULL_DISK_TEST";

/// Downloads with writes limited by `ulimit -f` (as a full disk would stop them): runs only as
/// the child of `a_write_failure_mid_file_is_an_error_and_keeps_the_cache_sound`.
#[test]
#[ignore = "the child process of a_write_failure_mid_file_is_an_error_and_keeps_the_cache_sound"]
fn download_with_limited_writes() {
    let Ok(setup) = std::env::var(FULL_DISK_ENV) else {
        return;
    };
    let (url, cache) = setup.split_once('\n').unwrap();
    let client = HubClient::new(url, None, PathBuf::from(cache));
    let snapshot = client.snapshot(REPO, "main").unwrap();
    let err = download(&client, &snapshot).unwrap_err();
    let HubError::Io { path, source } = &err else {
        panic!("expected a write error, got {err}");
    };
    assert!(path.to_string_lossy().ends_with(".incomplete"), "{err}");
    println!("write error: {err}: {source}");
}

#[test]
fn a_write_failure_mid_file_is_an_error_and_keeps_the_cache_sound() {
    let Fixture {
        repo,
        hub,
        cache,
        client,
        snapshot,
    } = fixture();
    // Files may grow to 400 blocks of 512 bytes (dash's unit): the small files fit, the 1 MiB
    // weights do not. SIGXFSZ is ignored so that the write fails (EFBIG) instead of killing.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(r#"trap '' XFSZ; ulimit -f 400; exec "$0" "$@""#)
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "download_with_limited_writes",
            "--ignored",
            "--nocapture",
        ])
        .env(
            FULL_DISK_ENV,
            format!("{}\n{}", hub.url(), cache.path().display()),
        )
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("write error: cannot write"), "{stdout}");

    // What was complete stays; the failed file is no blob; no snapshot is announced.
    let dir = repo_dir(cache.path());
    let config = &repo.files[0];
    assert_eq!(
        fs::read(dir.join("blobs").join(config.etag())).unwrap(),
        *config.content
    );
    assert!(!dir.join("blobs").join(repo.files[1].etag()).exists());
    assert!(!dir.join("refs/main").exists());

    // With room again, the download completes.
    let done = download(&client, &snapshot).unwrap();
    assert_weights(&repo, &done);
}

#[test]
fn a_disk_without_room_is_refused_before_writing() {
    let cache = tempfile::tempdir().unwrap();
    let hub = FakeHub::start(vec![tiny_repo()]);
    let client = client(&hub, cache.path());
    let mut snapshot = client.snapshot(REPO, "main").unwrap();
    // As if the Hub listed 1 EiB of weights: no disk has room for that.
    snapshot.files[1].size = 1 << 60;
    let err = download(&client, &snapshot).unwrap_err();
    assert!(matches!(err, HubError::DiskFull { .. }), "{err}");
    assert!(err.to_string().contains("not enough disk space"), "{err}");
    assert!(
        hub.requests().iter().all(|r| r.uri.starts_with("/api/")),
        "nothing was fetched"
    );
}

const CONCURRENT_ENV: &str = "PERCH_HUB_CONCURRENT_TEST";

/// Downloads the tiny repository (a number of times) once the start file appears: runs only as
/// a child of `concurrent_processes_share_the_download_and_fetch_each_blob_once`.
#[test]
#[ignore = "a child process of concurrent_processes_share_the_download_and_fetch_each_blob_once"]
fn download_in_a_child_process() {
    let Ok(setup) = std::env::var(CONCURRENT_ENV) else {
        return;
    };
    let mut lines = setup.lines();
    let (url, cache, start, times) = (
        lines.next().unwrap(),
        lines.next().unwrap(),
        Path::new(lines.next().unwrap()),
        lines.next().unwrap().parse::<usize>().unwrap(),
    );
    let client = HubClient::new(url, None, PathBuf::from(cache));
    let snapshot = client.snapshot(REPO, "main").unwrap();
    let waiting = std::time::Instant::now();
    while !start.exists() {
        assert!(waiting.elapsed() < Duration::from_secs(30), "never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut fetched = 0;
    for _ in 0..times {
        fetched += download(&client, &snapshot).unwrap().bytes_fetched;
    }
    println!("fetched {fetched} bytes");
}

/// Runs 3 children that each download the fixture's repository `times` times, all starting
/// together; returns the bytes they fetched, together.
fn download_in_3_processes(hub: &FakeHub, cache: &Path, times: usize) -> u64 {
    let start = tempfile::tempdir().unwrap();
    let start_file = start.path().join("go");
    let before = hub.requests().len();
    let children: Vec<_> = (0..3)
        .map(|_| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "download_in_a_child_process",
                    "--ignored",
                    "--nocapture",
                ])
                .env(
                    CONCURRENT_ENV,
                    format!(
                        "{}\n{}\n{}\n{times}",
                        hub.url(),
                        cache.display(),
                        start_file.display()
                    ),
                )
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Each child lists the snapshot (the revision and 3 pages of the tree), then waits: start
    // them together.
    let listed = std::time::Instant::now();
    while hub.requests().len() < before + 3 * 4 {
        assert!(listed.elapsed() < Duration::from_secs(30), "children stuck");
        std::thread::sleep(Duration::from_millis(5));
    }
    fs::write(&start_file, b"").unwrap();

    let mut fetched = 0;
    for child in children {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bytes = stdout
            .lines()
            .find_map(|l| l.strip_prefix("fetched ")?.strip_suffix(" bytes"))
            .unwrap_or_else(|| panic!("{stdout}"));
        fetched += bytes.parse::<u64>().unwrap();
    }
    fetched
}

#[test]
fn concurrent_processes_share_the_download_and_fetch_each_blob_once() {
    let Fixture {
        repo,
        hub,
        cache,
        client: _,
        snapshot,
    } = fixture();
    // 16 chunks of weights at 20 ms each: the downloads overlap.
    hub.configure(|b| b.chunk_delay = Duration::from_millis(20));
    let fetched = download_in_3_processes(&hub, cache.path(), 1);
    assert_eq!(fetched, snapshot.total_bytes(), "together, each byte once");
    for file in &snapshot.files {
        assert_eq!(
            hub.bodies_served(&file.path),
            1,
            "{} fetched once",
            file.path
        );
    }
    let dir = repo_dir(cache.path());
    let snapshot_dir = dir.join("snapshots").join(&repo.commit);
    for file in &snapshot.files {
        let content = fs::read(snapshot_dir.join(&file.path)).unwrap();
        assert!(content == file_content(&repo, &file.path), "{}", file.path);
    }
    assert_eq!(
        fs::read_to_string(dir.join("refs/main")).unwrap(),
        repo.commit
    );

    // Downloads of a complete model only rewrite `refs/main`: 3 processes doing it 100 times
    // each, at once, all succeed (each writes under a name of its own) and fetch nothing.
    hub.configure(|b| b.chunk_delay = Duration::ZERO);
    assert_eq!(download_in_3_processes(&hub, cache.path(), 100), 0);
    for file in &snapshot.files {
        assert_eq!(
            hub.bodies_served(&file.path),
            1,
            "{} fetched once",
            file.path
        );
    }
    assert_eq!(
        fs::read_to_string(dir.join("refs/main")).unwrap(),
        repo.commit
    );
    for listed in [&snapshot_dir, &dir.join("refs")] {
        let names: Vec<_> = fs::read_dir(listed)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().all(|n| !n.ends_with(".tmp")),
            "temporary files left: {names:?}"
        );
    }
}
