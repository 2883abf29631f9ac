//! Perch's Hub client against answers recorded from the real Hub (`tests/fixtures/hub-api/`,
//! sources in its SOURCES.md), served byte for byte by the fake hub: the parser is checked
//! against the Hub's real shapes, not only against the fake's own answers.

use perch_hub::fake_hub::{FakeHub, RecordedAnswer};
use perch_hub::{HubClient, RemoteFile, SearchQuery};

const JSON: &str = "application/json; charset=utf-8";

fn recording(name: &str) -> Vec<u8> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hub-api")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn hub_serving(answers: Vec<RecordedAnswer>) -> (FakeHub, HubClient, tempfile::TempDir) {
    let hub = FakeHub::start(Vec::new());
    hub.configure(|b| b.recorded = answers);
    let cache = tempfile::tempdir().unwrap();
    let client = HubClient::new(hub.url(), None, cache.path().to_path_buf());
    (hub, client, cache)
}

#[test]
fn a_real_search_answer_gives_ids_downloads_and_weight_bytes() {
    let (hub, client, _cache) = hub_serving(vec![RecordedAnswer {
        path: "/api/models".into(),
        content_type: JSON.into(),
        body: recording("search.json"),
        ..RecordedAnswer::default()
    }]);
    let found = client
        .search(&SearchQuery {
            text: String::new(),
            author: Some("deepseek-ai".into()),
            limit: 8,
        })
        .unwrap();
    let summary: Vec<(&str, u64, Option<u64>)> = found
        .iter()
        .map(|m| (m.id.as_str(), m.downloads, m.weights_bytes))
        .collect();
    // Bytes per element: BF16 2, I64 8, F32 4, F8_E4M3 1, I8 1.
    assert_eq!(
        summary,
        vec![
            (
                "deepseek-ai/DeepSeek-V4-Flash-0731",
                4_575_518,
                Some(
                    1_483_567_488 * 2
                        + 2_327_040 * 8
                        + 37_741_630 * 4
                        + 6_304_038_912
                        + 296_352_743_424
                )
            ),
            (
                "deepseek-ai/DeepSeek-V4-Pro-0813",
                127_009,
                Some(2_954_820_352 * 2 + 23_952_621_568 + 1_623_497_637_888)
            ),
        ]
    );
    // The answer has no likes, tags or dates: absent fields are defaults, not errors.
    assert!(found
        .iter()
        .all(|m| m.likes == 0 && m.tags.is_empty() && m.last_modified.is_none()));
    assert!(hub.requests()[0].uri.contains("author=deepseek-ai"));
}

#[test]
fn real_model_objects_give_their_architecture() {
    // The search endpoint answers an array of model objects; these are recorded ones (model
    // info answers, with the `config` subset the Hub indexes: see SOURCES.md).
    let mut body = b"[".to_vec();
    for (i, name) in [
        "model-info-zephyr-7b-beta.json",
        "model-info-stable-diffusion-v1-4.json",
        "model-info.json",
    ]
    .iter()
    .enumerate()
    {
        if i > 0 {
            body.push(b',');
        }
        body.extend(recording(name));
    }
    body.push(b']');
    let (hub, client, _cache) = hub_serving(vec![RecordedAnswer {
        path: "/api/models".into(),
        content_type: JSON.into(),
        body,
        ..RecordedAnswer::default()
    }]);
    let found = client.search(&SearchQuery::default()).unwrap();
    let types: Vec<(&str, Option<&str>)> = found
        .iter()
        .map(|m| (m.id.as_str(), m.model_type.as_deref()))
        .collect();
    assert_eq!(
        types,
        vec![
            ("HuggingFaceH4/zephyr-7b-beta", Some("mistral")),
            // A diffusers pipeline: no model type.
            ("CompVis/stable-diffusion-v1-4", None),
            ("google-bert/bert-base-uncased", Some("bert")),
        ]
    );
    assert!(hub.requests()[0].uri.contains("expand%5B%5D=config"));
}

#[test]
fn a_real_revision_answer_names_its_commit() {
    let (hub, client, _cache) = hub_serving(vec![RecordedAnswer {
        path: "/api/models/google-bert/bert-base-uncased/revision/main".into(),
        content_type: JSON.into(),
        body: recording("model-info.json"),
        ..RecordedAnswer::default()
    }]);
    assert_eq!(
        client
            .commit("google-bert/bert-base-uncased", "main")
            .unwrap(),
        "86b5e0934494bd15c9632b12f734a8a67f723594"
    );
    assert_eq!(hub.requests().len(), 1);
}

#[test]
fn a_real_paged_tree_is_followed_through_its_link_header() {
    const REPO: &str = "FluidInference/parakeet-tdt-0.6b-v3-coreml";
    const COMMIT: &str = "aed02740059203c4a87495924f685de3722ae9ce";
    const CURSOR: &str = "cursor=ZXlKbWFXeGxYMjVoYldVaU9pSk5aV3hGYm1OdlpHVnlMbTFzYlc5a1pXeGpMM2RsYVdkb2RITXZkMlZwWjJoMExtSnBiaUlzSW5SeVpXVmZiMmxrSWpvaU0yVTBPVGMzTUdRNU9HRTJZMlJqTnpjM1pUY3pPREJoWkRWbVpERTNaV0ppWVRNNU5EWTVaaUo5OjEwMA%3D%3D";
    let path = format!("/api/models/{REPO}/tree/{COMMIT}");
    let (hub, client, _cache) = hub_serving(vec![
        RecordedAnswer {
            path: path.clone(),
            query_contains: Some(CURSOR.into()),
            content_type: JSON.into(),
            body: recording("tree-page-2.json"),
            ..RecordedAnswer::default()
        },
        RecordedAnswer {
            path: path.clone(),
            content_type: JSON.into(),
            link: Some(format!(
                "<{{endpoint}}{path}?expand=true&recursive=true&limit=100&{CURSOR}>; rel=\"next\""
            )),
            body: recording("tree-page-1.json"),
            ..RecordedAnswer::default()
        },
    ]);
    let files = client.tree(REPO, COMMIT).unwrap();
    let file = |path: &str, size: u64, etag: &str, lfs: bool| RemoteFile {
        path: path.into(),
        size,
        etag: etag.into(),
        lfs,
    };
    // Directories are skipped; LFS files are named by their content's SHA-256 and sized by
    // `lfs.size`, the others by their Git blob id.
    assert_eq!(
        files,
        vec![
            file(
                ".gitattributes",
                1519,
                "a6344aac8c09253b3b630fb776ae94478aa0275b",
                false
            ),
            file(
                "Melspectrogram_15s.mlmodelc/analytics/coremldata.bin",
                243,
                "69c14cb1c88f889264d81aaf34d927afd46a1fab42b762e2ca506e496f2b0f6b",
                true
            ),
            file(
                "Melspectrogram_15s.mlmodelc/coremldata.bin",
                400,
                "7bf5c6d29eefd6aca3a2775848fc13d169db0d2a399fc42f0d41505403de0c98",
                true
            ),
            file(
                "Melspectrogram_15s.mlmodelc/metadata.json",
                2804,
                &json_oid("Melspectrogram_15s.mlmodelc/metadata.json"),
                false
            ),
            file(
                "Melspectrogram_15s.mlmodelc/model.mil",
                26279,
                &json_oid("Melspectrogram_15s.mlmodelc/model.mil"),
                false
            ),
            file(
                "Melspectrogram_15s.mlmodelc/weights/weight.bin",
                592384,
                "023c2303b7c3a1fafed92fc6ec46c1d43a48c0bbcdf33d6441d383a61747734c",
                true
            ),
        ]
    );
    let uris: Vec<String> = hub.requests().into_iter().map(|r| r.uri).collect();
    assert_eq!(
        uris,
        vec![
            format!("{path}?recursive=true"),
            format!("{path}?expand=true&recursive=true&limit=100&{CURSOR}"),
        ]
    );
}

/// The `oid` the recorded page gives a plain file (read from the recording, so the test checks
/// how it is used, not a copy of it).
fn json_oid(path: &str) -> String {
    let page: Vec<serde_json::Value> =
        serde_json::from_slice(&recording("tree-page-2.json")).unwrap();
    let entry = page.iter().find(|e| e["path"] == path).unwrap();
    assert!(entry.get("lfs").is_none());
    entry["oid"].as_str().unwrap().to_owned()
}
