//! What a hostile or misconfigured hub cannot make Perch do: send the token to another server
//! (through a page link or a redirect), list forever, or write outside the cache through a
//! revision or commit name. Against the fake hub on 127.0.0.1; "another host" is a second fake on
//! another port, which ureq's own `SameHost` redirect rule would still give the token.

use std::fs;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use perch_hub::fake_hub::{FakeHub, FakeRepo, RecordedAnswer};
use perch_hub::{Downloaded, HubClient, HubError, RemoteSnapshot, MAX_LISTING_PAGES};

const REPO: &str = "mlx-community/Tiny-4bit";
const TOKEN: &str = "secret";
const JSON: &str = "application/json";

/// Small JSON files and a 300 kB LFS weights file (redirected to the CDN, as on the Hub).
fn tiny_repo() -> FakeRepo {
    let weights: Vec<u8> = (0..300_000u32).map(|i| (i * 31 % 251) as u8).collect();
    FakeRepo::new(
        REPO,
        vec![
            ("config.json", br#"{"model_type": "llama"}"#.to_vec()),
            ("model.safetensors", weights),
            ("tokenizer.json", b"{\"model\": {}}".to_vec()),
            ("tokenizer_config.json", b"{}".to_vec()),
        ],
    )
}

/// A fake serving the tiny repository that answers only with the token.
fn hub_requiring_the_token(repo: &FakeRepo) -> FakeHub {
    let hub = FakeHub::start(vec![repo.clone()]);
    hub.configure(|b| b.required_token = Some(TOKEN.into()));
    hub
}

fn client_with_token(hub: &FakeHub, cache: &Path) -> HubClient {
    HubClient::new(hub.url(), Some(TOKEN.into()), cache.to_path_buf())
}

fn download(client: &HubClient, snapshot: &RemoteSnapshot) -> Result<Downloaded, HubError> {
    client.download(snapshot, &AtomicBool::new(false), &mut |_| {})
}

const BEARER: Option<&str> = Some("Bearer secret");

#[test]
fn a_next_page_on_another_host_is_refused_and_never_gets_the_token() {
    let repo = tiny_repo();
    let hub = hub_requiring_the_token(&repo);
    let elsewhere = FakeHub::start(vec![repo.clone()]);
    hub.configure(|b| b.next_page_url = Some(elsewhere.url().to_owned()));
    let cache = tempfile::tempdir().unwrap();

    let err = client_with_token(&hub, cache.path())
        .snapshot(REPO, "main")
        .unwrap_err();
    assert!(matches!(err, HubError::BadResponse { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.contains(elsewhere.url()) && message.contains("only follows pages there"),
        "{message}"
    );
    // The other server was never asked, so it never saw the token.
    assert_eq!(elsewhere.requests(), vec![]);
    // The endpoint was asked with it: the revision and the first page of the tree.
    let asked = hub.requests();
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(
        asked.iter().all(|r| r.authorization.as_deref() == BEARER),
        "{asked:?}"
    );
}

#[test]
fn a_relative_next_page_on_the_endpoint_is_followed() {
    let tree = format!("/api/models/{REPO}/tree/{}", "a".repeat(40));
    let page = |cursor: Option<&str>, link: Option<String>, path: &str| RecordedAnswer {
        path: tree.clone(),
        query_contains: cursor.map(str::to_owned),
        content_type: JSON.into(),
        link,
        body: format!(
            r#"[{{"type": "file", "path": "{path}", "size": 2, "oid": "{}"}}]"#,
            "b".repeat(40)
        )
        .into_bytes(),
    };
    let hub = FakeHub::start(vec![]);
    hub.configure(|b| {
        b.recorded = vec![
            page(Some("cursor=2"), None, "second.json"),
            page(
                None,
                Some(format!("<{tree}?recursive=true&cursor=2>; rel=\"next\"")),
                "first.json",
            ),
        ]
    });
    let cache = tempfile::tempdir().unwrap();
    let client = HubClient::new(hub.url(), None, cache.path().to_path_buf());
    let files = client.tree(REPO, &"a".repeat(40)).unwrap();
    let paths: Vec<&str> = files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["first.json", "second.json"]);
}

#[test]
fn a_redirect_to_another_host_loses_the_token_that_the_endpoint_gets() {
    let repo = tiny_repo();
    let hub = hub_requiring_the_token(&repo);
    let cdn = FakeHub::start(vec![repo.clone()]);
    hub.configure(|b| b.lfs_redirect_url = Some(cdn.url().to_owned()));
    let cache = tempfile::tempdir().unwrap();
    let client = client_with_token(&hub, cache.path());
    let snapshot = client.snapshot(REPO, "main").unwrap();
    let done = download(&client, &snapshot).unwrap();

    let weights = fs::read(done.snapshot_dir.join("model.safetensors")).unwrap();
    assert!(weights == *repo.files[1].content, "the weights differ");
    // The endpoint got the token on every request, the weights' resolve included...
    let resolve = hub.file_requests("model.safetensors");
    assert_eq!(resolve.len(), 1, "{resolve:?}");
    assert!(
        hub.requests()
            .iter()
            .all(|r| r.authorization.as_deref() == BEARER),
        "{:?}",
        hub.requests()
    );
    // ...and the server it redirected to (same host, other port) never did.
    let on_cdn = cdn.requests();
    assert_eq!(on_cdn.len(), 1, "{on_cdn:?}");
    assert!(on_cdn[0].uri.starts_with("/cdn/"), "{on_cdn:?}");
    assert_eq!(
        on_cdn[0].authorization, None,
        "the token leaked: {on_cdn:?}"
    );
    assert_eq!(
        (
            cdn.bodies_served("model.safetensors"),
            hub.bodies_served("model.safetensors")
        ),
        (1, 0)
    );

    // A redirect on the endpoint's own origin keeps it (the Hub's same-host redirects need it).
    hub.configure(|b| b.lfs_redirect_url = None);
    let other_cache = tempfile::tempdir().unwrap();
    let client = client_with_token(&hub, other_cache.path());
    download(&client, &snapshot).unwrap();
    let same_origin: Vec<_> = hub
        .file_requests("model.safetensors")
        .into_iter()
        .filter(|r| r.uri.starts_with("/cdn/"))
        .collect();
    assert_eq!(same_origin.len(), 1, "{same_origin:?}");
    assert_eq!(same_origin[0].authorization.as_deref(), BEARER);
}

/// A fake whose tree of `REPO` at `commit` always links to a next page: itself.
fn endlessly_paging_hub(commit: &str) -> FakeHub {
    let tree = format!("/api/models/{REPO}/tree/{commit}");
    let hub = FakeHub::start(vec![]);
    hub.configure(|b| {
        b.recorded = vec![RecordedAnswer {
            path: tree.clone(),
            content_type: JSON.into(),
            link: Some(format!(
                "<{{endpoint}}{tree}?recursive=true&cursor=again>; rel=\"next\""
            )),
            body: b"[]".to_vec(),
            ..RecordedAnswer::default()
        }]
    });
    hub
}

#[test]
fn a_hub_that_pages_forever_is_stopped_at_the_page_bound() {
    let commit = "c".repeat(40);
    let hub = endlessly_paging_hub(&commit);
    let cache = tempfile::tempdir().unwrap();
    let client = HubClient::new(hub.url(), None, cache.path().to_path_buf());

    let err = client.tree(REPO, &commit).unwrap_err();
    assert!(matches!(err, HubError::BadResponse { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("past {MAX_LISTING_PAGES} pages")),
        "{err}"
    );
    assert_eq!(hub.requests().len(), MAX_LISTING_PAGES);
}

#[test]
fn a_slow_listing_times_out_as_a_whole() {
    let commit = "c".repeat(40);
    let hub = endlessly_paging_hub(&commit);
    // Each page takes 200 ms, far below the limit; only the listing as a whole exceeds it.
    hub.configure(|b| b.api_delay = Duration::from_millis(200));
    let cache = tempfile::tempdir().unwrap();
    let client = HubClient::new(hub.url(), None, cache.path().to_path_buf())
        .with_listing_timeout(Duration::from_secs(1));

    let started = Instant::now();
    let err = client.tree(REPO, &commit).unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, HubError::TimedOut { .. }), "{err}");
    assert!(
        err.to_string().contains("did not answer within 1s"),
        "{err}"
    );
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(5),
        "{took:?}"
    );
    let pages = hub.requests().len();
    assert!((2..=7).contains(&pages), "{pages} pages");
}

#[test]
fn a_listing_stops_at_its_cancel_flag() {
    let commit = "c".repeat(40);
    let hub = endlessly_paging_hub(&commit);
    hub.configure(|b| b.api_delay = Duration::from_millis(50));
    let cache = tempfile::tempdir().unwrap();
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let client = HubClient::new(hub.url(), None, cache.path().to_path_buf())
        .with_cancel(std::sync::Arc::clone(&cancel));
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        cancel.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let started = Instant::now();
    let err = client.tree(REPO, &commit).unwrap_err();
    canceller.join().unwrap();
    assert!(matches!(err, HubError::Cancelled), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let pages = hub.requests().len();
    assert!((2..=20).contains(&pages), "{pages} pages before the cancel");
    // A cancelled client asks nothing more.
    assert!(matches!(
        client.tree(REPO, &commit),
        Err(HubError::Cancelled)
    ));
    assert_eq!(hub.requests().len(), pages);
}

/// Every entry under `dir`, recursively, as paths relative to it.
fn entries(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        found.push(path.strip_prefix(dir).unwrap().display().to_string());
        if path.is_dir() && !path.is_symlink() {
            let below = entries(&path);
            found.extend(
                below
                    .into_iter()
                    .map(|e| format!("{}/{e}", path.file_name().unwrap().to_string_lossy())),
            );
        }
    }
    found.sort();
    found
}

#[test]
fn revisions_that_could_leave_the_cache_are_refused_before_anything_is_asked_or_written() {
    let repo = tiny_repo();
    let hub = FakeHub::start(vec![repo.clone()]);
    let root = tempfile::tempdir().unwrap();
    let cache = root.path().join("cache");
    let client = HubClient::new(hub.url(), None, cache.clone());
    let long = "a".repeat(256);
    let bad = [
        "../../x", "..", ".", "a/../b", "", "/etc/x", "refs//x", "a\\b", "x\0y", "-x", &long,
    ];

    for revision in bad {
        let err = client.snapshot(REPO, revision).unwrap_err();
        assert!(
            matches!(&err, HubError::InvalidRevision { revision: r, .. } if r == revision),
            "{revision:?}: {err}"
        );
        assert!(err.to_string().contains(&format!("{revision:?}")), "{err}");
    }
    assert_eq!(hub.requests(), vec![], "refused before any request");

    // A snapshot made by hand with such a revision is refused by the download, before writing.
    let snapshot = client.snapshot(REPO, "main").unwrap();
    for revision in bad {
        let mut hostile = snapshot.clone();
        hostile.revision = revision.to_owned();
        let err = download(&client, &hostile).unwrap_err();
        assert!(
            matches!(err, HubError::InvalidRevision { .. }),
            "{revision:?}: {err}"
        );
    }
    assert_eq!(
        entries(root.path()),
        Vec::<String>::new(),
        "nothing written"
    );

    // The Hub's own names with slashes are fine: `refs/pr/1` is written as `huggingface_hub`
    // writes it, under `refs/`.
    let pr = "refs/pr/1";
    hub.configure(|b| {
        b.recorded = vec![RecordedAnswer {
            path: format!("/api/models/{REPO}/revision/refs%2Fpr%2F1"),
            content_type: JSON.into(),
            body: format!(r#"{{"id": "{REPO}", "sha": "{}"}}"#, repo.commit).into_bytes(),
            ..RecordedAnswer::default()
        }]
    });
    let snapshot = client.snapshot(REPO, pr).unwrap();
    assert_eq!(snapshot.commit, repo.commit);
    download(&client, &snapshot).unwrap();
    let refs = cache.join("models--mlx-community--Tiny-4bit/refs");
    assert_eq!(
        fs::read_to_string(refs.join("refs/pr/1")).unwrap(),
        repo.commit
    );
    let written = entries(root.path());
    assert!(
        written
            .iter()
            .all(|e| e == "cache" || e.starts_with("cache/")),
        "{written:?}"
    );
    assert!(
        entries(&refs).iter().all(|e| !e.ends_with(".tmp")),
        "no temporary file is left: {:?}",
        entries(&refs)
    );
}

#[test]
fn a_hostile_commit_hash_is_refused_before_anything_is_written() {
    let repo = tiny_repo();
    let hub = FakeHub::start(vec![repo.clone()]);
    let root = tempfile::tempdir().unwrap();
    let cache = root.path().join("cache");
    let client = HubClient::new(hub.url(), None, cache.clone());
    let snapshot = client.snapshot(REPO, "main").unwrap();
    let hostile = "../../../../escaped";

    hub.configure(|b| {
        b.recorded = vec![RecordedAnswer {
            path: format!("/api/models/{REPO}/revision/main"),
            content_type: JSON.into(),
            body: format!(r#"{{"id": "{REPO}", "sha": "{hostile}"}}"#).into_bytes(),
            ..RecordedAnswer::default()
        }]
    });
    let err = client.snapshot(REPO, "main").unwrap_err();
    assert!(matches!(err, HubError::BadResponse { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("{hostile:?} is not a commit hash")),
        "{err}"
    );

    // Nor can a snapshot carrying one, or a hostile blob hash, be downloaded.
    let mut with_commit = snapshot.clone();
    with_commit.commit = hostile.to_owned();
    let err = download(&client, &with_commit).unwrap_err();
    assert!(
        matches!(&err, HubError::InvalidRevision { revision, .. } if revision == hostile),
        "{err}"
    );
    let mut with_etag = snapshot.clone();
    with_etag.files[0].etag = "../../../escaped".into();
    let err = download(&client, &with_etag).unwrap_err();
    assert!(matches!(err, HubError::InvalidFile { .. }), "{err}");
    assert!(err.to_string().contains("is not a blob hash"), "{err}");
    assert_eq!(
        entries(root.path()),
        Vec::<String>::new(),
        "nothing written"
    );
}
