//! Processes in one group over MLX's ring backend on 127.0.0.1, each started as `mlx.launch -n 2
//! --backend ring` starts a rank (`MLX_RANK`, and `MLX_HOSTFILE` listing each rank's address):
//! collectives give every rank the same sums, gathers and rank 0's bytes; a rank that dies makes
//! the survivor's next collective an error within seconds, and a rank whose peer never starts
//! gets an error at its deadline — never a hang.
//!
//! Tensor parallelism: two ranks, each holding half of every tiny model's heads and MLP features
//! (`Model::shard`), compute mlx_lm's logits and greedy ids on the tiny models of
//! `tests/oracle/tiny_models.py`; an architecture Perch does not shard yet is refused with a
//! sentence on every rank. Ranks holding different copies of a model are refused, by every
//! rank and before any weight is read.
//!
//! Each rank is this test binary run again on the ignored `rank` test, which does what
//! `PERCH_TEST_RANK_TASK` says and prints one JSON line of results.

mod common;

use std::io::Read;
use std::net::TcpListener;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mlx_rs::Array;
use perch_engine::distributed::{self, Backend, Division, PipelineParallel, TensorParallel};
use perch_engine::{
    generate, models, EngineConfig, EngineEvent, EngineHandle, EngineRequest, GenerateRequest,
    Prompt, PromptLookup, RequestStream, Tokenizer,
};

const TASK_ENV: &str = "PERCH_TEST_RANK_TASK";
/// The tensor-parallel task's models: a folder of `tiny_models.py` cases (or, with
/// `PEAKS_ENV` set, one model's folder).
const MODELS_ENV: &str = "PERCH_TEST_TP_MODELS";
/// Set: the task measures loading's peak memory ([`load_peaks`]).
const PEAKS_ENV: &str = "PERCH_TEST_LOAD_PEAKS";
/// The temporary folder of the process that started a rank, whose MLX JIT folder the rank's
/// compiled libraries go back to ([`JitFolder`]).
const SHARED_TMP_ENV: &str = "PERCH_TEST_SHARED_TMP";

/// MLX's CPU backend compiles fused operations with g++ straight into
/// `$TMPDIR/mlx/<version>/cpu/lib….so` and loads a library as soon as its file exists
/// (`mlx/backend/cpu/compiled.cpp`): two ranks in lockstep compiling one operation at once can
/// load the other's half-written file ("file too short"; every run with that folder emptied
/// failed so, 2026-12-04). So each rank started here has a `$TMPDIR` of its own, holding links
/// to the libraries of the shared folder that nothing is still writing ([`JitFolder::for_rank`]),
/// and gives back what it compiled when it ends ([`JitFolder::give_back`]), by renames: the
/// shared folder only ever gets whole files from ranks.
struct JitFolder;

impl JitFolder {
    /// A library unchanged this long is whole (g++ writes it within its run).
    const SETTLED: Duration = Duration::from_secs(2);

    /// The MLX JIT folders (`mlx/<version>/cpu`) under `tmp`.
    fn folders(tmp: &Path) -> Vec<PathBuf> {
        let Ok(versions) = std::fs::read_dir(tmp.join("mlx")) else {
            return Vec::new();
        };
        versions
            .flatten()
            .map(|v| v.path().join("cpu"))
            .filter(|cpu| cpu.is_dir())
            .collect()
    }

    /// The libraries in `folder`, by file name.
    fn libraries(folder: &Path) -> Vec<(std::ffi::OsString, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(folder) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "so"))
            .map(|e| (e.file_name(), e.path()))
            .collect()
    }

    /// A fresh `$TMPDIR` in `parent` for a rank, holding links to the settled libraries of this
    /// process's MLX JIT folders.
    fn for_rank(parent: &Path) -> PathBuf {
        static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = parent.join(format!("rank-tmp-{n}"));
        let shared = std::env::temp_dir();
        for folder in Self::folders(&shared) {
            let own = tmp.join(folder.strip_prefix(&shared).unwrap());
            std::fs::create_dir_all(&own).unwrap();
            for (name, path) in Self::libraries(&folder) {
                let settled = std::fs::metadata(&path)
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t.elapsed().is_ok_and(|age| age >= Self::SETTLED));
                if settled && std::fs::hard_link(&path, own.join(&name)).is_err() {
                    // Another file system: a rank compiles what it lacks.
                    continue;
                }
            }
        }
        std::fs::create_dir_all(&tmp).unwrap();
        tmp
    }

    /// In a rank: the libraries it compiled into its own `$TMPDIR`, moved into the starting
    /// process's folder under names of their own and renamed into place (a name taken already
    /// is left as it is).
    fn give_back() {
        let Some(shared) = std::env::var_os(SHARED_TMP_ENV).map(PathBuf::from) else {
            return;
        };
        let own = std::env::temp_dir();
        for folder in Self::folders(&own) {
            let theirs = shared.join(folder.strip_prefix(&own).unwrap());
            if std::fs::create_dir_all(&theirs).is_err() {
                continue;
            }
            for (name, path) in Self::libraries(&folder) {
                let target = theirs.join(&name);
                if target.exists() {
                    continue;
                }
                let staged = theirs.join(format!(
                    ".{}.{}",
                    name.to_string_lossy(),
                    std::process::id()
                ));
                if std::fs::copy(&path, &staged).is_ok() {
                    let _ = std::fs::rename(&staged, &target);
                }
            }
        }
    }
}

/// Gives a rank's compiled libraries back when `rank` returns ([`JitFolder::give_back`]).
struct GiveBack;

impl Drop for GiveBack {
    fn drop(&mut self) {
        JitFolder::give_back();
    }
}

/// A rank: runs only as a child of the tests below (ignored, so it is not a test of its own).
#[test]
#[ignore = "a rank started by the distributed tests"]
fn rank() {
    let Ok(task) = std::env::var(TASK_ENV) else {
        return;
    };
    run_rank(task);
    // A rank that joined its group ends at once, as `perch` does (`distributed::exit_now`).
    if distributed::joined() {
        distributed::exit_now(0);
    }
}

fn run_rank(task: String) {
    let _give_back = GiveBack;
    let deadline = Duration::from_secs(if task == "alone" { 3 } else { 30 });
    let group = match distributed::init(Backend::Ring, deadline) {
        Ok(group) => group,
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            return;
        }
    };
    if let "engine_staged"
    | "engine_draft_apart"
    | "engine_draft_fails"
    | "engine_follower_draft_fails" = task.as_str()
    {
        // A model in two pipeline stages of unlike layers, rank 0 with the model as its draft
        // and rank 1 with none, or rank 0 or rank 1 with a draft it cannot load: refused by
        // both ranks, each after loading.
        let models = PathBuf::from(std::env::var(MODELS_ENV).unwrap());
        let dir = std::fs::read_dir(&models)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let (division, draft_model) = match task.as_str() {
            "engine_staged" => (Division::Pipeline(PipelineParallel::new(group)), None),
            "engine_draft_fails" => (
                Division::Tensor(TensorParallel::new(group)),
                Some(dir.join("no-such-draft")),
            ),
            "engine_follower_draft_fails" => (Division::Tensor(TensorParallel::new(group)), None),
            _ => (
                Division::Tensor(TensorParallel::new(group)),
                Some(dir.clone()),
            ),
        };
        let rank = division.rank();
        let refused = match rank {
            0 => {
                let config = EngineConfig {
                    draft_model,
                    ..EngineConfig::default()
                };
                EngineHandle::spawn_with(config, "refused".into(), move |_| {
                    Ok((
                        models::load_divided(&dir, &division)?,
                        Tokenizer::load(&dir)?,
                    ))
                })
                .err()
            }
            _ => {
                let model = models::load_divided(&dir, &division).unwrap();
                let tokenizer = Tokenizer::load(&dir).unwrap();
                let draft = match task.as_str() {
                    "engine_follower_draft_fails" => Err(perch_engine::EngineError::Distributed(
                        "this rank's draft could not be loaded".into(),
                    )),
                    _ => Ok(None),
                };
                perch_engine::engine::follow(model.as_ref(), draft, &tokenizer).err()
            }
        };
        let error = refused.map(|e| e.to_string());
        println!("{}", serde_json::json!({ "rank": rank, "error": error }));
        return;
    }
    // Scenarios over TP or (`_pipeline_`) two stages, each given the models' path.
    let scenario: Option<fn(Division, &Path) -> serde_json::Value> = match task.as_str() {
        "engine_images" | "engine_pipeline_images" => Some(with_images),
        "engine_prompt_cache" | "engine_pipeline_prompt_cache" => Some(prompt_caches),
        _ => None,
    };
    if let Some(scenario) = scenario {
        let models = PathBuf::from(std::env::var(MODELS_ENV).unwrap());
        let division = match task.contains("_pipeline_") {
            false => Division::Tensor(TensorParallel::new(group)),
            true => Division::Pipeline(PipelineParallel::new(group)),
        };
        println!("{}", scenario(division, &models));
        return;
    }
    if task == "engine_short_rank" {
        let models = PathBuf::from(std::env::var(MODELS_ENV).unwrap());
        let division = Division::Tensor(TensorParallel::new(group));
        println!("{}", short_of_memory(division, &models));
        return;
    }
    if let Some(variant) = task.strip_prefix("engine") {
        let models = PathBuf::from(std::env::var(MODELS_ENV).unwrap());
        let division = match variant.starts_with("_pipeline") {
            true => Division::Pipeline(PipelineParallel::new(group)),
            false => Division::Tensor(TensorParallel::new(group)),
        };
        let run = match variant {
            "_dies" => Run::Dies,
            "_stalls" => Run::Stalls,
            "_speculative" | "_pipeline_speculative" => Run::Speculative,
            _ => Run::Plain,
        };
        println!("{}", in_the_batch(division, &models, run));
        return;
    }
    let (split, dies, stalls) = match (task.strip_suffix("_dies"), task.strip_suffix("_stalls")) {
        (Some(split), _) => (split, true, false),
        (_, Some(split)) => (split, false, true),
        _ => (task.as_str(), false, false),
    };
    if let "tensor_parallel" | "pipeline_parallel" = split {
        let split = match split {
            "tensor_parallel" => Division::Tensor(TensorParallel::new(group)),
            _ => Division::Pipeline(PipelineParallel::new(group)),
        };
        let models = PathBuf::from(std::env::var(MODELS_ENV).unwrap());
        let result = match (dies || stalls, std::env::var(PEAKS_ENV)) {
            (true, _) => dies_mid_request(split, &models, stalls),
            (false, Ok(_)) => load_peaks(split, &models),
            (false, Err(_)) => divided(split, &models),
        };
        println!("{result}");
        return;
    }
    if task == "load_parts" {
        // Its part of the model in MODELS_ENV, divided by heads: the bytes this process read
        // through read calls (MLX reading whole tensors; the kernel's count, /proc/self/io's
        // `rchar`), and those part reads copied from the mapped files.
        let rchar = || -> u64 {
            let io = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io");
            io.lines()
                .find_map(|l| l.strip_prefix("rchar: "))
                .and_then(|n| n.trim().parse().ok())
                .expect("rchar in /proc/self/io")
        };
        let division = Division::Tensor(TensorParallel::new(group));
        let dir = PathBuf::from(std::env::var(MODELS_ENV).unwrap());
        let parts = perch_engine::nn::part_reads::part_bytes_read;
        let (io, copied) = (rchar(), parts());
        models::load_divided(&dir, &division).unwrap();
        let (io, copied) = (rchar() - io, parts() - copied);
        println!(
            "{}",
            serde_json::json!({ "rank": division.rank(), "read": io, "parts": copied })
        );
        return;
    }
    if task == "load_stalls" {
        // Rank 1 never gets to load: alive, its sockets open, answering nothing.
        let division = Division::Tensor(TensorParallel::new(group));
        if division.rank() == 1 {
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        let dir = first_model(&PathBuf::from(std::env::var(MODELS_ENV).unwrap()));
        let loaded = models::load_divided(&dir, &division).map(|_| ());
        println!(
            "{}",
            serde_json::json!({ "loaded": loaded.map_err(|e| e.to_string()) })
        );
        return;
    }
    if task == "load" {
        // Its stage of its own copy of the model (MODELS_ENV), and MLX's peak meanwhile.
        use perch_engine::device::{memory_stats, reset_peak_memory};
        let split = Division::Pipeline(PipelineParallel::new(group));
        let dir = PathBuf::from(std::env::var(MODELS_ENV).unwrap());
        reset_peak_memory();
        let loaded = models::load_divided(&dir, &split);
        let peak = memory_stats().peak_bytes;
        let result = match loaded {
            Ok(_) => serde_json::json!({ "rank": split.rank(), "peak": peak }),
            Err(e) => {
                serde_json::json!({ "rank": split.rank(), "peak": peak, "error": e.to_string() })
            }
        };
        println!("{result}");
        return;
    }
    let rank = group.rank();
    // Rank r contributes [r + 1, 10 (r + 1), 100 (r + 1)].
    let r = (rank + 1) as f32;
    let x = Array::from_slice(&[r, 10.0 * r, 100.0 * r], &[3]);
    let sum = group.all_sum(&x).unwrap();
    let gathered = group.all_gather(&x).unwrap();
    mlx_rs::transforms::eval([&sum, &gathered]).unwrap();
    let message = b"rank 0 schedules; the others follow".as_slice();
    let received = group
        .broadcast_bytes((rank == 0).then_some(message))
        .unwrap();
    // Each rank's memory, and rank 0 not judging its own (CUDA): every rank gets the least.
    use perch_engine::memory::{Available, MemoryBound};
    let mine = [
        Available {
            bytes: 5 << 30,
            bound: MemoryBound::System,
        },
        Available {
            bytes: 3 << 30,
            bound: MemoryBound::Cgroup,
        },
    ][rank];
    let least = perch_engine::testing::least_available(&group, Some(mine), (1, 1)).unwrap();
    let least_judged =
        perch_engine::testing::least_available(&group, (rank == 1).then_some(mine), (1, 1))
            .unwrap();
    // As pipeline stages: rank 0 holds 2 cache layers, rank 1 4, so rank 1's 3 GiB hold what
    // 1.5 GiB would on rank 0.
    let least_staged =
        perch_engine::testing::least_available(&group, Some(mine), (2 + 2 * rank, 2)).unwrap();
    let mut result = serde_json::json!({
        "least": least,
        "least_judged": least_judged,
        "least_staged": least_staged,
        "rank": rank,
        "size": group.size(),
        "sum": sum.as_slice::<f32>(),
        "gathered": gathered.as_slice::<f32>(),
        "received": String::from_utf8_lossy(&received),
    });
    if task == "die" {
        if rank == 1 {
            // Gone without a word, as a killed host would be.
            std::process::exit(0);
        }
        let start = Instant::now();
        let next = group.all_sum(&x).and_then(|s| Ok(s.eval()?));
        result["after_death"] = match next {
            Ok(()) => serde_json::json!({ "ok": true }),
            Err(e) => {
                serde_json::json!({ "error": e.to_string(), "s": start.elapsed().as_secs_f32() })
            }
        };
    }
    println!("{result}");
}

#[derive(serde::Deserialize)]
struct Expected {
    prompt_ids: Vec<u32>,
    logits: Vec<f32>,
    greedy_ids: Vec<u32>,
}

fn largest(values: &mut dyn Iterator<Item = f32>) -> f32 {
    values.fold(0.0f32, f32::max)
}

/// `model` divided as `division` says, once loaded whole.
fn divide(division: &Division, model: &mut dyn models::Model) -> perch_engine::Result<()> {
    match division {
        Division::Tensor(tp) => model.shard(tp),
        Division::Pipeline(pp) => model.pipeline(pp),
    }
}

/// This rank's part of every model in `models` (one folder a case), loaded alone
/// (`models::load_divided`): the largest difference of its prompt's logits from mlx_lm's (and the
/// largest logit), the same with projections fused at load and the model divided once loaded
/// whole (`Model::shard`, `Model::pipeline`), and greedy ids through `generate`; or why the
/// model cannot be divided so.
fn divided(split: Division, models: &Path) -> serde_json::Value {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(models)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    cases.sort();
    let mut results = serde_json::Map::new();
    for dir in cases {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let expected: Expected =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        let model = match models::load_divided(&dir, &split) {
            Ok(model) => model,
            Err(e) => {
                // The same refusal once loaded whole.
                let mut whole = models::load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
                let after = divide(&split, whole.as_mut()).expect_err("divided once loaded");
                results.insert(
                    name,
                    serde_json::json!({ "error": e.to_string(), "error_after_load": after.to_string() }),
                );
                continue;
            }
        };
        let difference = |model: &dyn models::Model| -> f32 {
            let ours = common::prompt_logits(model, &expected.prompt_ids);
            assert_eq!(ours.len(), expected.logits.len(), "{name}: logits");
            largest(
                &mut ours
                    .iter()
                    .zip(&expected.logits)
                    .map(|(a, b)| (a - b).abs()),
            )
        };
        let scale = largest(&mut expected.logits.iter().map(|v| v.abs()));
        let tokenizer = Tokenizer::load(&dir).unwrap();
        let mut request = GenerateRequest::new(expected.prompt_ids.clone());
        request.max_tokens = expected.greedy_ids.len();
        request.ignore_eos = true;
        let greedy = common::generate_alone(model.as_ref(), &tokenizer, &request)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // Projections fused at load (as on GPUs), each fused layer divided part by part.
        std::env::set_var("PERCH_FUSED_PROJECTIONS", "1");
        let fused = models::load(&dir);
        // And as on CUDA, quantized layers copied dense, loaded both ways: divided once whole,
        // and read part by part (`part_reads`: fused and copied once divided), the same model.
        std::env::set_var("PERCH_WEIGHTS", "dense");
        let dense_whole =
            models::load(&dir).and_then(|mut m| divide(&split, m.as_mut()).map(|()| m));
        let dense_parts = models::load_divided(&dir, &split);
        std::env::remove_var("PERCH_WEIGHTS");
        std::env::remove_var("PERCH_FUSED_PROJECTIONS");
        let mut fused = fused.unwrap_or_else(|e| panic!("{name}: {e}"));
        divide(&split, fused.as_mut()).unwrap_or_else(|e| panic!("{name}, fused: {e}"));
        let logits = |model: perch_engine::Result<Box<dyn models::Model>>| {
            common::prompt_logits(
                model
                    .unwrap_or_else(|e| panic!("{name}, dense: {e}"))
                    .as_ref(),
                &expected.prompt_ids,
            )
        };
        let case = serde_json::json!({
                "difference": difference(model.as_ref()),
                "fused_difference": difference(fused.as_ref()),
                "dense_parts_equal": logits(dense_whole) == logits(dense_parts),
                "scale": scale,
                "greedy_ids": greedy.token_ids,
                "expected_ids": expected.greedy_ids,
        });
        results.insert(name, case);
    }
    serde_json::json!({ "rank": split.rank(), "cases": results })
}

/// MLX's peak memory while loading the model in `dir`: this rank's part alone
/// (`models::load_divided`), then the whole model.
fn load_peaks(split: Division, dir: &Path) -> serde_json::Value {
    use perch_engine::device::{memory_stats, reset_peak_memory};
    reset_peak_memory();
    let part = models::load_divided(dir, &split).unwrap();
    let divided = memory_stats().peak_bytes;
    drop(part);
    reset_peak_memory();
    let whole = models::load(dir).unwrap();
    let whole_peak = memory_stats().peak_bytes;
    drop(whole);
    serde_json::json!({ "rank": split.rank(), "divided": divided, "whole": whole_peak })
}

/// Greedy generation on the one model in `models`, divided by `split`, during which rank 1 exits
/// without a word after its third token: rank 0's result is its error and how long after the
/// request's start it came (a tiny model's first tokens take milliseconds; rank 0 may meet the
/// loss before its own third token, waiting for rank 1's part of it).
///
/// With `stalls`, rank 1 stops answering instead (it blocks in its token callback): alive, its
/// sockets open.
fn dies_mid_request(split: Division, models: &Path, stalls: bool) -> serde_json::Value {
    let dir = first_model(models);
    let model = models::load_divided(&dir, &split).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    let mut request = GenerateRequest::new(vec![1, 1690, 198, 2683, 359]);
    request.max_tokens = 64;
    request.ignore_eos = true;
    let (mut tokens, start) = (0, Instant::now());
    let outcome = generate(model.as_ref(), &tokenizer, &request, |_| {
        tokens += 1;
        if tokens == 3 && split.rank() == 1 {
            if stalls {
                // Stuck: alive, its sockets open, answering nothing.
                std::fs::write(decoding_marker(&dir), b"").unwrap();
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
            std::process::exit(0);
        }
        ControlFlow::Continue(())
    });
    match outcome {
        Ok(_) => serde_json::json!({ "rank": split.rank(), "tokens": tokens }),
        Err(e) => serde_json::json!({
            "rank": split.rank(),
            "error": e.to_string(),
            "s": start.elapsed().as_secs_f32(),
        }),
    }
}

/// The requests the batch engine runs over two ranks: prompts sharing a prefix (a prefix-cache
/// hit), greedy and seeded sampled, one longer, more than `max_running` at once (some wait for
/// a row), and one without a seed (rank 0 gives it one).
fn batch_requests() -> Vec<EngineRequest> {
    let prompt = |n: usize, salt: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| 1 + (i * 7 + salt * 13) % 90)
            .collect()
    };
    let shared = prompt(40, 1);
    let request = |tokens: Vec<u32>, max_tokens: usize, temperature: f32, seed: Option<u64>| {
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = max_tokens;
        params.ignore_eos = true;
        params.sampling.temperature = temperature;
        params.sampling.seed = seed;
        EngineRequest {
            prompt: Prompt::Tokens(tokens),
            params,
        }
    };
    vec![
        request(shared.clone(), 24, 0.0, None),
        request([&shared[..], &prompt(12, 2)[..]].concat(), 24, 0.0, None),
        request(prompt(30, 3), 24, 0.8, Some(7)),
        request(prompt(90, 4), 40, 0.0, None),
        request(prompt(20, 5), 16, 1.0, None),
        request(prompt(25, 6), 20, 0.6, Some(11)),
    ]
}

/// Each request's stream: its token ids and finish, or its error.
/// The file rank 0 of the dying-rank task writes beside the model's folder `dir` once it decodes.
fn decoding_marker(dir: &Path) -> PathBuf {
    dir.with_extension("decoding")
}

fn collected(streams: Vec<RequestStream>) -> Vec<serde_json::Value> {
    streams
        .into_iter()
        .map(|stream| {
            let mut ids = Vec::new();
            loop {
                match stream.events.recv_timeout(Duration::from_secs(120)) {
                    Ok(EngineEvent::Token { id, .. }) => ids.extend(id),
                    Ok(EngineEvent::Admitted { .. }) => {}
                    Ok(EngineEvent::Finished { error, .. }) => {
                        return serde_json::json!({
                            "ids": ids,
                            "error": error.map(|e| e.message),
                        })
                    }
                    Err(_) => return serde_json::json!({ "ids": ids, "error": "no end: a hang" }),
                }
            }
        })
        .collect()
}

/// What [`in_the_batch`] runs.
#[derive(Clone, Copy, PartialEq)]
enum Run {
    Plain,
    /// Rank 0 idles for twice the group's stall limit, then decodes long requests until a
    /// rank is paused from outside (`a_rank_that_stops_answering_ends_the_group…`).
    Stalls,
    /// Rank 1 dies mid-request.
    Dies,
    /// With a draft model and prompt lookup.
    Speculative,
}

/// The batch engine over the tiny models in `models` (a folder each), divided by `division`:
/// rank 0 serves [`batch_requests`] all at once through an [`EngineHandle`], the other rank
/// follows (`perch_engine::engine::follow`); then rank 0 alone runs them on the whole model.
/// With [`Run::Dies`], rank 1 exits without a word while the batch decodes long requests:
/// rank 0's requests end with an error, and a request after them is refused.
fn in_the_batch(division: Division, models: &Path, run: Run) -> serde_json::Value {
    let (dies, speculative) = (run == Run::Dies, run == Run::Speculative);
    let stalls = run == Run::Stalls;
    let rank = division.rank();
    let mut cases: Vec<PathBuf> = std::fs::read_dir(models)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    cases.sort();
    // Pipeline stages with a small pool, each stage weighing its own bytes scaled to rank 0's.
    // (Not with drafts: a sampled row's draws follow its verify steps, which the pool's room
    // schedules, and a stage's room differs from the whole model's.)
    let staged = matches!(division, Division::Pipeline(_)) && run == Run::Plain;
    let config = |dir: &Path| EngineConfig {
        max_running: 4,
        kv_cache_bytes: match staged {
            true => 512 << 10,
            false => EngineConfig::default().kv_cache_bytes,
        },
        // Compiled steps run faster than uncompiled ones: the dying rank's requests would
        // finish (at the pool's length bound) before it dies.
        compile_decode: !dies && !stalls,
        // The model, whole, drafting for itself; prompt lookup (choosing between verify and
        // plain steps by their times) for the greedy rows it does not draft for.
        draft_model: speculative.then(|| dir.to_path_buf()),
        prompt_lookup: speculative.then(PromptLookup::default),
        ..EngineConfig::default()
    };
    let requests = || {
        let mut requests = batch_requests();
        if speculative {
            for i in [0, 2, 3] {
                requests[i].params.num_draft_tokens = Some(3);
            }
        }
        requests
    };
    let mut results = serde_json::Map::new();
    for dir in cases {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        if rank > 0 {
            let model = models::load_divided(&dir, &division).unwrap();
            let draft = speculative.then(|| models::load(&dir).unwrap());
            let tokenizer = Tokenizer::load(&dir).unwrap();
            if dies {
                // Once rank 0 decodes (its marker), so that its requests hold tokens when the
                // group breaks however long its start took on a busy machine.
                let decoding = decoding_marker(&dir);
                std::thread::spawn(move || {
                    let start = Instant::now();
                    while !decoding.exists() && start.elapsed() < Duration::from_secs(60) {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    std::thread::sleep(Duration::from_millis(300));
                    std::process::exit(0);
                });
            }
            let followed =
                perch_engine::engine::follow(model.as_ref(), Ok(draft.as_deref()), &tokenizer);
            results.insert(
                name,
                serde_json::json!({ "followed": followed.map_err(|e| e.to_string()).err() }),
            );
            continue;
        }
        let (load_dir, part) = (dir.clone(), division.clone());
        let engine = EngineHandle::spawn_with(config(&dir), name.clone(), move |_| {
            Ok((
                models::load_divided(&load_dir, &part)?,
                Tokenizer::load(&load_dir)?,
            ))
        })
        .unwrap();
        if stalls {
            // Idle first: the other rank must not count the group stalled meanwhile.
            let limit: f64 = std::env::var(perch_engine::distributed::STALL_LIMIT_ENV)
                .unwrap()
                .parse()
                .unwrap();
            std::thread::sleep(Duration::from_secs_f64(2.0 * limit));
        }
        if dies || stalls {
            let start = Instant::now();
            let streams: Vec<RequestStream> = (0..3)
                .map(|i| {
                    let mut params = GenerateRequest::new(Vec::new());
                    params.max_tokens = 100_000;
                    params.ignore_eos = true;
                    let prompt = Prompt::Tokens(vec![1, 1690 + i, 198, 2683, 359]);
                    engine.submit(EngineRequest { prompt, params }).unwrap()
                })
                .collect();
            // Rank 1 dies once a few decode steps ran here.
            while engine.stats().unwrap().step_times.decode_steps < 3
                && start.elapsed() < Duration::from_secs(60)
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            std::fs::write(decoding_marker(&dir), b"").unwrap();
            let ended = collected(streams);
            let seconds = start.elapsed().as_secs_f32();
            let after = collected(vec![engine.submit(batch_requests().remove(0)).unwrap()]);
            results.insert(
                name,
                serde_json::json!({ "ended": ended, "s": seconds, "after": after }),
            );
            return serde_json::json!({ "rank": rank, "cases": results });
        }
        let streams = requests()
            .into_iter()
            .map(|request| engine.submit(request).unwrap())
            .collect();
        let divided = collected(streams);
        let times = engine.stats().unwrap().step_times;
        drop(engine);
        let whole = EngineHandle::load(&dir, config(&dir)).unwrap();
        let streams = requests()
            .into_iter()
            .map(|request| whole.submit(request).unwrap())
            .collect();
        let alone = collected(streams);
        results.insert(
            name,
            serde_json::json!({
                "divided": divided,
                "alone": alone,
                "compiled": times.compiled_decode_steps,
                "verify_steps": times.verify_steps,
                "accepted": times.accepted_draft_tokens,
            }),
        );
    }
    serde_json::json!({ "rank": rank, "cases": results })
}

/// The first model of the tiny models in `models`.
fn first_model(models: &Path) -> PathBuf {
    std::fs::read_dir(models)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
}

/// Rank `r > 0`: its part of the model in `dir` follows rank 0's batch to its end; the error,
/// if any.
fn followed(dir: &Path, division: &Division) -> serde_json::Value {
    let model = models::load_divided(dir, division).unwrap();
    let tokenizer = Tokenizer::load(dir).unwrap();
    let followed = perch_engine::engine::follow(model.as_ref(), Ok(None), &tokenizer);
    serde_json::json!({ "rank": division.rank(), "followed": followed.map_err(|e| e.to_string()).err() })
}

/// Chats with images (and one without) through the engine over the tiny Gemma 3 vision-language
/// model in `dir`, divided by `division`: rank 0 serves them, rank 1 follows; then rank 0 alone
/// answers them on the whole model.
fn with_images(division: Division, dir: &Path) -> serde_json::Value {
    use perch_engine::{ChatMessage, ContentPart};
    let rank = division.rank();
    if rank > 0 {
        return followed(dir, &division);
    }
    let image = |seed: u32| {
        use base64::Engine as _;
        let pixels = image::RgbImage::from_fn(32, 32, |x, y| {
            image::Rgb([
                (x * 7 + y * seed) as u8,
                (y * 13 + seed) as u8,
                (x * y) as u8,
            ])
        });
        let mut png = std::io::Cursor::new(Vec::new());
        pixels.write_to(&mut png, image::ImageFormat::Png).unwrap();
        let encoded = base64::engine::general_purpose::STANDARD.encode(png.into_inner());
        ContentPart::Image(format!("data:image/png;base64,{encoded}"))
    };
    let requests = || {
        [
            vec![image(1), ContentPart::Text("What is this?".into())],
            vec![image(5), image(9), ContentPart::Text("And these?".into())],
            vec![ContentPart::Text("No image here.".into())],
        ]
        .into_iter()
        .map(|parts| {
            let mut params = GenerateRequest::new(Vec::new());
            params.max_tokens = 8;
            params.ignore_eos = true;
            EngineRequest {
                prompt: Prompt::Chat(vec![ChatMessage::from_parts("user", parts)]),
                params,
            }
        })
        .collect::<Vec<_>>()
    };
    let (load_dir, part) = (dir.to_path_buf(), division.clone());
    let engine = EngineHandle::spawn_with(EngineConfig::default(), "images".into(), move |_| {
        let model = models::load_divided(&load_dir, &part)?;
        let tokenizer = EngineHandle::tokenizer_for(&load_dir, model.as_ref())?;
        Ok((model, tokenizer))
    })
    .unwrap();
    let streams = requests()
        .into_iter()
        .map(|r| engine.submit(r).unwrap())
        .collect();
    let divided = collected(streams);
    drop(engine);
    let whole = EngineHandle::load(dir, EngineConfig::default()).unwrap();
    let streams = requests()
        .into_iter()
        .map(|r| whole.submit(r).unwrap())
        .collect();
    let alone = collected(streams);
    serde_json::json!({ "rank": rank, "divided": divided, "alone": alone })
}

/// Prompt caches on disk over the first tiny model in `models`, divided by `division`: rank 0's
/// engine saves a prefix (every rank writing its part beside the path), clears its prefix
/// cache, reads the file back into it, and answers requests after it (`Prompt::AfterCache`,
/// greedy and sampled without a seed) and the whole prompt; a part left from an earlier save is
/// refused; then, rank 1's part removed, reading the file and a request after it fail on both
/// ranks alike while a plain request is still served. Last, the whole model on one process
/// answers the whole prompt and refuses rank 0's part.
fn prompt_caches(division: Division, models: &Path) -> serde_json::Value {
    let dir = first_model(models);
    let rank = division.rank();
    if rank > 0 {
        return followed(&dir, &division);
    }
    let prefix: Vec<u32> = (0..40).map(|i| 1 + (i * 11) % 90).collect();
    let rest: Vec<u32> = vec![5, 17, 29, 41];
    let request = |prompt: Prompt, temperature: f32| {
        let mut params = GenerateRequest::new(Vec::new());
        params.max_tokens = 8;
        params.ignore_eos = true;
        params.sampling.temperature = temperature;
        EngineRequest { prompt, params }
    };
    let whole_prompt = || Prompt::Tokens([&prefix[..], &rest[..]].concat());
    let file = models.parent().unwrap().join("prefix.safetensors");
    let after_cache = || Prompt::AfterCache {
        cache_file: file.clone(),
        tokens: rest.clone(),
    };
    let (load_dir, part) = (dir.clone(), division.clone());
    let id = EngineHandle::model_id(&dir);
    let engine = EngineHandle::spawn_with(EngineConfig::default(), id, move |_| {
        let model = models::load_divided(&load_dir, &part)?;
        let tokenizer = EngineHandle::tokenizer_for(&load_dir, model.as_ref())?;
        Ok((model, tokenizer))
    })
    .unwrap();
    let text = |r: perch_engine::Result<usize>| r.map_err(|e| e.to_string());
    let run = |prompts: Vec<(Prompt, f32)>| {
        let streams = prompts
            .into_iter()
            .map(|(p, t)| engine.submit(request(p, t)).unwrap())
            .collect();
        collected(streams)
    };
    let saved = text(engine.save_prompt_cache(Prompt::Tokens(prefix.clone()), &file));
    let part_1 = perch_engine::prompt_cache::rank_path(&file, 1);
    let files = [file.exists(), part_1.exists()];
    // Read back from the files alone, not from the blocks the save left cached.
    engine.clear_cache().unwrap();
    let loaded = text(engine.load_prompt_cache(&file));
    let divided = run(vec![
        (after_cache(), 0.0),
        (whole_prompt(), 0.0),
        (after_cache(), 0.9),
    ]);
    let after_sampled = run(vec![(whole_prompt(), 0.0)]);
    // Rank 1's part of this save beside rank 0's of the next.
    let stale = file.with_file_name("stale.safetensors");
    std::fs::copy(&part_1, &stale).unwrap();
    let other: Vec<u32> = prefix.iter().map(|t| t + 1).collect();
    engine
        .save_prompt_cache(Prompt::Tokens(other), &file)
        .unwrap();
    std::fs::rename(&stale, &part_1).unwrap();
    let loaded_stale = text(engine.load_prompt_cache(&file));
    std::fs::remove_file(&part_1).unwrap();
    let loaded_without_part = text(engine.load_prompt_cache(&file));
    let without_part = run(vec![(after_cache(), 0.0), (whole_prompt(), 0.0)]);
    drop(engine);
    let whole = EngineHandle::load(&dir, EngineConfig::default()).unwrap();
    let alone = collected(vec![whole.submit(request(whole_prompt(), 0.0)).unwrap()]);
    let whole_loads_part = text(whole.load_prompt_cache(&file));
    serde_json::json!({
        "rank": rank,
        "saved": saved,
        "files": files,
        "loaded": loaded,
        "divided": divided,
        "after_sampled": after_sampled,
        "loaded_stale": loaded_stale,
        "loaded_without_part": loaded_without_part,
        "without_part": without_part,
        "alone": alone,
        "whole_loads_part": whole_loads_part,
    })
}

/// The batch engine over the first tiny model in `models`, divided by `division`, with rank 1's
/// memory read as plenty at load (8 GiB available) and then as under its floor: rank 0 (whose
/// own memory is the machine's) serves one request, which rank 1's reading must refuse, then
/// stops its engine.
fn short_of_memory(division: Division, models: &Path) -> serde_json::Value {
    use perch_engine::memory::{Available, MemoryBound};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let rank = division.rank();
    let dir = first_model(models);
    if rank > 0 {
        // Read twice while loading (the budget's gather, then the guard's reading after
        // load), then 40 MB, below the floor of a fifth of 8 GiB.
        fn reading() -> Available {
            static READS: AtomicUsize = AtomicUsize::new(0);
            let bytes = match READS.fetch_add(1, Ordering::Relaxed) {
                0 | 1 => 8 << 30,
                _ => 40 << 20,
            };
            Available {
                bytes,
                bound: MemoryBound::System,
            }
        }
        let model = models::load_divided(&dir, &division).unwrap();
        let tokenizer = Tokenizer::load(&dir).unwrap();
        let followed =
            perch_engine::testing::follow_reading_memory(model.as_ref(), &tokenizer, reading);
        return serde_json::json!({ "rank": rank, "followed": followed.map_err(|e| e.to_string()).err() });
    }
    let engine = EngineHandle::spawn_with(EngineConfig::default(), "short".into(), move |_| {
        Ok((
            models::load_divided(&dir, &division)?,
            Tokenizer::load(&dir)?,
        ))
    })
    .unwrap();
    let served = collected(vec![engine.submit(batch_requests().remove(0)).unwrap()]);
    drop(engine);
    serde_json::json!({ "rank": rank, "served": served })
}

/// The tiny models of `cases` (comma-separated `tiny_models.py` names, a folder each) in
/// `dir/models`, written by the mlx_lm oracle.
fn tiny_models(dir: &Path, cases: &str) -> PathBuf {
    let models = dir.join("models");
    common::run_oracle(
        "tiny_models.py",
        &[
            models.to_str().unwrap(),
            common::model_dir().to_str().unwrap(),
            cases,
        ],
    );
    models
}

/// Two free ports on 127.0.0.1 (bound and released: a port is free again at once).
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

fn spawn_rank(rank: usize, hostfile: &Path, task: &str) -> Child {
    spawn_rank_with(rank, hostfile, task, &[])
}

/// Ranks 0 and 1 of a fresh two-rank group (a hostfile in `dir`) running `task` over the tiny
/// models in `models`.
fn spawn_two_ranks(dir: &Path, models: &Path, task: &str) -> [Child; 2] {
    let hosts = hostfile(dir, 2);
    let env = [(MODELS_ENV, models)];
    [0, 1].map(|r| spawn_rank_with(r, &hosts, task, &env))
}

/// Runs `task` on two ranks over `models` ([`spawn_two_ranks`]), each refusing: each rank's
/// error.
fn refusals(dir: &Path, models: &Path, task: &str) -> [String; 2] {
    spawn_two_ranks(dir, models, task).map(|child| {
        let result = result(child, Duration::from_secs(120));
        result["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{result}"))
            .to_owned()
    })
}

/// Runs `task` on two ranks over `models` ([`spawn_two_ranks`]), each given `seconds`; checks
/// that rank 1 followed rank 0 to its end without an error and returns rank 0's result.
fn led_and_followed(dir: &Path, models: &Path, task: &str, seconds: u64) -> serde_json::Value {
    let [leader, follower] =
        spawn_two_ranks(dir, models, task).map(|c| result(c, Duration::from_secs(seconds)));
    assert_eq!(follower["followed"], serde_json::Value::Null, "{follower}");
    leader
}

fn spawn_rank_with(rank: usize, hostfile: &Path, task: &str, env: &[(&str, &Path)]) -> Child {
    use std::os::unix::process::CommandExt;
    Command::new(std::env::current_exe().unwrap())
        // A process group of its own: a rank paused with SIGSTOP in the tests' shared group would
        // get the SIGHUP and SIGCONT the kernel sends to an orphaned group with a stopped member
        // whenever another process of that group exits (another test's rank), and end.
        .process_group(0)
        .args([
            "--exact",
            "rank",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TMPDIR", JitFolder::for_rank(hostfile.parent().unwrap()))
        .env(SHARED_TMP_ENV, std::env::temp_dir())
        .env(TASK_ENV, task)
        .env("MLX_RANK", rank.to_string())
        .env("MLX_HOSTFILE", hostfile)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits at most `limit` for `child`: its status and what it printed (killed and failed past
/// the limit, with what it printed until then).
fn ended(child: &mut Child, limit: Duration) -> (std::process::ExitStatus, String, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if start.elapsed() > limit {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    match status {
        Some(status) => (status, out, err),
        None => panic!("a rank still ran after {limit:?}: a hang; it printed:\n{out}\n{err}"),
    }
}

/// Waits at most `limit` for `child` ([`ended`]), then its JSON line.
fn result(mut child: Child, limit: Duration) -> serde_json::Value {
    let (_, out, err) = ended(&mut child, limit);
    // The harness prints `test rank ... ` before the line on the same line.
    let line = out
        .find('{')
        .and_then(|at| out[at..].lines().next())
        .unwrap_or_else(|| panic!("a rank printed no result:\n{out}\n{err}"));
    serde_json::from_str(line).unwrap()
}

fn hostfile(dir: &Path, ranks: usize) -> std::path::PathBuf {
    let hosts: Vec<Vec<String>> = free_ports(ranks)
        .into_iter()
        .map(|port| vec![format!("127.0.0.1:{port}")])
        .collect();
    let path = dir.join("hosts.json");
    std::fs::write(&path, serde_json::to_string(&hosts).unwrap()).unwrap();
    path
}

#[test]
fn two_ranks_sum_gather_and_broadcast() {
    assert!(
        Backend::Ring.is_available(),
        "the MLX Perch links has the ring backend"
    );
    let dir = tempfile::tempdir().unwrap();
    let hosts = hostfile(dir.path(), 2);
    let children: Vec<Child> = (0..2)
        .map(|r| spawn_rank(r, &hosts, "collectives"))
        .collect();
    let results: Vec<_> = children
        .into_iter()
        .map(|c| result(c, Duration::from_secs(60)))
        .collect();
    for (r, result) in results.iter().enumerate() {
        assert_eq!(result["rank"], r, "{result}");
        assert_eq!(result["size"], 2, "{result}");
        assert_eq!(
            result["sum"],
            serde_json::json!([3.0, 30.0, 300.0]),
            "{result}"
        );
        assert_eq!(
            result["gathered"],
            serde_json::json!([1.0, 10.0, 100.0, 2.0, 20.0, 200.0]),
            "{result}"
        );
        assert_eq!(
            result["received"], "rank 0 schedules; the others follow",
            "{result}"
        );
        // Rank 1's own reading; on rank 0, named as rank 1's.
        let bound = match r {
            0 => serde_json::json!({ "Rank": 1 }),
            _ => serde_json::json!("Cgroup"),
        };
        let three_gb = serde_json::json!({ "bytes": 3u64 << 30, "bound": bound });
        assert_eq!(result["least"], three_gb, "{result}");
        assert_eq!(result["least_judged"], three_gb, "{result}");
        let staged = serde_json::json!({ "bytes": 3u64 << 29, "bound": bound });
        assert_eq!(result["least_staged"], staged, "{result}");
    }
}

#[test]
fn a_rank_that_dies_fails_the_next_collective() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = hostfile(dir.path(), 2);
    let survivor = spawn_rank(0, &hosts, "die");
    let mut dying = spawn_rank(1, &hosts, "die");
    let result = result(survivor, Duration::from_secs(60));
    // Rank 1 exits without a result line.
    dying.wait().unwrap();
    let after = &result["after_death"];
    let error = after["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{result}"));
    assert!(error.contains("peer"), "{error}");
    assert!(after["s"].as_f64().unwrap() < 10.0, "{after}");
}

#[test]
fn a_rank_whose_peer_never_starts_gets_an_error_at_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = hostfile(dir.path(), 2);
    let start = Instant::now();
    let result = result(spawn_rank(0, &hosts, "alone"), Duration::from_secs(30));
    let error = result["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{result}"));
    assert!(error.contains("connected within"), "{error}");
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn a_backend_this_mlx_lacks_is_an_error() {
    // The CPU wheel has ring only; a CUDA build has NCCL. MPI first: JACCL's and NCCL's
    // environments are checked before whether MLX has them (and this test sets none).
    let missing = [Backend::Mpi, Backend::Jaccl, Backend::Nccl]
        .into_iter()
        .find(|b| !b.is_available());
    let Some(backend) = missing else {
        panic!("this MLX has every backend: nothing to refuse");
    };
    let error = distributed::init(backend, Duration::from_secs(1)).unwrap_err();
    assert!(error.to_string().contains("has no"), "{error}");
}

#[test]
fn a_rank_with_a_missing_hostfile_gets_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let result = result(
        spawn_rank(0, &dir.path().join("no-such-hosts.json"), "alone"),
        Duration::from_secs(30),
    );
    let error = result["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{result}"));
    // Checked before MLX reads it: the error names the file.
    assert!(error.contains("MLX_HOSTFILE"), "{error}");
    assert!(error.contains("no-such-hosts.json"), "{error}");
}

/// Cases of every family Perch shards: dense float32 (Llama 3 RoPE), stored fused projections
/// (Phi-3), 4-bit with query, key and value biases (Qwen2), per-head query and key norms (Qwen3),
/// NoPE layers (SmolLM3), YaRN with sliding layers (Ministral 3, and 4-bit under Mistral 3's
/// multimodal layout), Gemma 3's sliding and global layers with their scaled embeddings, Gemma 4's
/// layers reading another layer's cache and its per-layer inputs, experts
/// (Qwen3-MoE, a dense first layer; gpt-oss: biases everywhere, attention sinks, sliding layers),
/// Gated DeltaNet layers beside gated attention (Qwen3.5, dense and with experts and a shared
/// expert); and those it refuses, each with its reason.
const SHARDED: [&str; 13] = [
    "gemma3_text",
    "gemma4_text",
    "gpt_oss",
    "llama3-rope",
    "ministral3",
    "mistral3-4bit",
    "phi3",
    "qwen2-4bit",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_moe",
    "smollm3",
];
const REFUSED: [(&str, &str); 3] = [
    ("olmo2", "norms over all heads"),
    // Experts of 32 features at 4 bits in groups of 32: 16 a rank.
    ("qwen3_moe-4bit", "not whole groups of 32"),
    ("gemma4_text-moe-4bit", "MLP beside experts"),
];

#[test]
fn two_ranks_tensor_parallel_compute_mlx_lm_s_logits_and_greedy_ids() {
    two_ranks_divide("tensor_parallel", &SHARDED, &REFUSED, &SHARDED_BY_MLX_LM);
}

/// Cases split into two stages of layers: dense (Llama 3; Qwen2 4-bit; Qwen3; SmolLM3's NoPE
/// layers), quantized with norms over all heads (OLMo 2), stored fused projections (Phi-3),
/// sliding layers (Gemma 3; Ministral 3, and 4-bit under Mistral 3's layout), experts (Qwen3-MoE
/// 4-bit; gpt-oss; Gemma 4's MLP beside experts), hybrids (Qwen3.5 dense and with experts); and
/// Gemma 4 with layers reading another layer's cache, refused.
const STAGED: [&str; 14] = [
    "gemma3_text",
    "gemma4_text-moe-4bit",
    "gpt_oss",
    "llama3-rope",
    "ministral3",
    "mistral3-4bit",
    "olmo2-4bit",
    "phi3",
    "qwen2-4bit",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_moe-4bit",
    "smollm3",
];
const NOT_STAGED: [(&str, &str); 1] = [("gemma4_text", "another layer's keys and values")];

/// The cases mlx_lm 0.32.2 divides too (`shard`; `pipeline`): its sharded model's greedy ids are
/// Perch's, its logits mlx_lm's whole model's.
const SHARDED_BY_MLX_LM: [&str; 8] = [
    "gpt_oss",
    "llama3-rope",
    "ministral3",
    "qwen2-4bit",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_moe",
];
const STAGED_BY_MLX_LM: [&str; 5] = [
    "ministral3",
    "qwen2-4bit",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_moe-4bit",
];

#[test]
fn two_ranks_pipeline_parallel_compute_mlx_lm_s_logits_and_greedy_ids() {
    two_ranks_divide("pipeline_parallel", &STAGED, &NOT_STAGED, &STAGED_BY_MLX_LM);
}

/// Two ranks, each running `task` on the tiny models `divided` and `refused`: every rank computes
/// mlx_lm's logits and greedy ids on the first and gives each of the others' reason; and two
/// ranks of mlx_lm's own division of `by_mlx_lm` (`tests/oracle/sharded.py`) get Perch's ids.
fn two_ranks_divide(task: &str, divided: &[&str], refused: &[(&str, &str)], by_mlx_lm: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<&str> = divided
        .iter()
        .copied()
        .chain(refused.iter().map(|(name, _)| *name))
        .collect();
    let models = tiny_models(dir.path(), &cases.join(","));
    let children = spawn_two_ranks(dir.path(), &models, task);
    let results: Vec<_> = children
        .into_iter()
        .map(|c| result(c, Duration::from_secs(300)))
        .collect();
    let mode = task.strip_suffix("_parallel").unwrap();
    let hosts = hostfile(dir.path(), 2);
    let sharded = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/sharded.py");
    let mlx_lm: Vec<_> = (0..2)
        .map(|r| {
            Command::new(common::oracle_python())
                .arg(&sharded)
                .arg(&models)
                .arg(mode)
                .arg(by_mlx_lm.join(","))
                .env("TMPDIR", JitFolder::for_rank(dir.path()))
                .env("MLX_RANK", r.to_string())
                .env("MLX_HOSTFILE", &hosts)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mlx_lm: Vec<_> = mlx_lm
        .into_iter()
        .map(|c| result(c, Duration::from_secs(300)))
        .collect();
    for (r, (result, theirs)) in results.iter().zip(&mlx_lm).enumerate() {
        assert_eq!(result["rank"], r, "{result}");
        assert_eq!(theirs["rank"], r, "{theirs}");
        for name in by_mlx_lm {
            let (ours, theirs) = (&result["cases"][name], &theirs["cases"][name]);
            let scale = ours["scale"].as_f64().unwrap();
            let difference = theirs["difference"].as_f64().unwrap();
            assert!(
                difference <= 1e-4 * scale.max(1.0),
                "rank {r}, {name}: mlx_lm's {mode}-parallel logits differ from its whole \
                 model's by {difference}"
            );
            assert_eq!(
                ours["greedy_ids"], theirs["greedy_ids"],
                "rank {r}, {name}: mlx_lm's {mode}-parallel ids"
            );
        }
        for name in divided {
            let case = &result["cases"][name];
            assert!(case["error"].is_null(), "rank {r}, {name}: {case}");
            let scale = case["scale"].as_f64().unwrap();
            assert!(scale > 0.1, "{name}: degenerate logits");
            for key in ["difference", "fused_difference"] {
                let difference = case[key].as_f64().unwrap();
                // As architecture_parity's one process: float32 rounding of other summation
                // orders.
                assert!(
                    difference <= 1e-4 * scale.max(1.0),
                    "rank {r}, {name}: logits differ from mlx_lm by {difference} ({key}; max \
                     |logit| {scale})"
                );
            }
            assert_eq!(case["greedy_ids"], case["expected_ids"], "rank {r}, {name}");
            if let Some(equal) = case.get("dense_parts_equal") {
                assert_eq!(
                    equal, true,
                    "rank {r}, {name}: read part by part, fused and dense"
                );
            }
        }
        for (name, why) in refused {
            for key in ["error", "error_after_load"] {
                let error = result["cases"][name][key].as_str();
                assert!(
                    error.is_some_and(|e| e.contains(why)),
                    "rank {r}, {name}: {}",
                    result["cases"][name]
                );
            }
        }
    }
}

/// A rank that exits in the middle of a request, tensor- or pipeline-parallel: the other rank's
/// generation ends in an error within seconds, not a hang.
#[test]
fn a_rank_that_dies_mid_request_ends_the_other_s_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), "llama3-rope");
    for task in ["tensor_parallel_dies", "pipeline_parallel_dies"] {
        let [survivor, mut dying] = spawn_two_ranks(dir.path(), &models, task);
        let result = result(survivor, Duration::from_secs(120));
        dying.wait().unwrap();
        let error = result["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{task}: {result}"));
        // A sentence: MLX's, without its source location.
        assert!(
            error.contains("connection to a peer was lost"),
            "{task}: {error}"
        );
        assert!(!error.contains(".cpp"), "{task}: {error}");
        let s = result["s"]
            .as_f64()
            .unwrap_or_else(|| panic!("{task}: {result}"));
        assert!(s < 10.0, "{task}: the error came {s} s after the peer died");
    }
}

/// The batch engine over two ranks (tensor-parallel): rank 0 serves six requests at once through
/// an `EngineHandle` (more than its rows: some wait; prompts sharing a prefix; greedy, seeded and
/// unseeded sampling), the other rank follows its batch; each request's ids equal those of the
/// whole model on one process (but the unseeded one's, which only has to end), on a dense, a
/// mixture-of-experts and a hybrid model, with decode steps compiled; and rank 1 returns once
/// rank 0's engine stops.
#[test]
fn the_batch_engine_runs_over_two_ranks() {
    batch_over_two_ranks("engine", &["llama3-rope", "qwen3_moe", "qwen3_5_moe"], true);
}

/// The same over two pipeline stages (decode steps uncompiled, a KV budget of 512 KiB), on the
/// dense, the mixture-of-experts and the hybrid model, and a Qwen3.5 and a Gemma 3 of 6 layers
/// (linear or sliding-window attention and full attention by turns: rank 0 holds two runs of
/// the pair, rank 1 one, so its own bytes weigh against rank 0's scaled): requests finish and
/// prompts are prefilled while other rows decode. The prefix cache's bound on its bounded parts
/// is not reached here (the scaled bound is `BlockStore`'s unit test).
/// Before each stage evaluated its hand-over in every pass, this deadlocked (rank 0 waiting in
/// the ring's `recv` inside its block copies, rank 1 in the stages' gather).
#[test]
fn the_batch_engine_runs_over_two_pipeline_stages() {
    batch_over_two_ranks(
        "engine_pipeline",
        &[
            "llama3-rope",
            "qwen3_moe",
            "qwen3_5_moe",
            "qwen3_5-6",
            "gemma3_text-6",
        ],
        false,
    );
}

/// Speculative decoding in the batch over two ranks (tensor-parallel, then two pipeline
/// stages), on a dense and a hybrid model: every rank holds the whole model as the draft (proposing for three requests, two
/// greedy and a seeded sampled one) and prompt lookup proposes for another greedy one, its
/// choice between verify and plain steps taken by rank 0's step times on both ranks (each
/// rank's own clock would choose apart, and the batches' digests would then differ). Each
/// request's ids equal one process's, and verify steps ran with proposals accepted.
#[test]
fn speculative_decoding_runs_over_two_ranks() {
    let names = ["llama3-rope", "qwen3_5_moe"];
    for (task, compiled) in [
        ("engine_speculative", true),
        ("engine_pipeline_speculative", false),
    ] {
        let results = batch_over_two_ranks(task, &names, compiled);
        for name in names {
            let case = &results[0]["cases"][name];
            assert!(
                case["verify_steps"].as_u64().unwrap() > 0,
                "{task}, {name}: {case}"
            );
            assert!(
                case["accepted"].as_u64().unwrap() > 0,
                "{task}, {name}: {case}"
            );
        }
    }
}

/// Runs `task` ([`in_the_batch`]) over the tiny models `names` on two ranks and checks rank 0's
/// answers against one process's, and that decode steps were `compiled` or not.
fn batch_over_two_ranks(task: &str, names: &[&str], compiled: bool) -> Vec<serde_json::Value> {
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), &names.join(","));
    let children = spawn_two_ranks(dir.path(), &models, task);
    let results: Vec<_> = children
        .into_iter()
        .map(|c| result(c, Duration::from_secs(300)))
        .collect();
    for &name in names {
        assert_eq!(
            results[1]["cases"][name]["followed"],
            serde_json::Value::Null,
            "{name}: rank 1 {}",
            results[1]
        );
        let case = &results[0]["cases"][name];
        // Tensor parallelism's decode steps compiled with the ranks' sums inside.
        assert_eq!(
            case["compiled"].as_u64().unwrap() > 0,
            compiled,
            "{name}: {case}"
        );
        let (divided, alone) = (
            case["divided"].as_array().unwrap(),
            case["alone"].as_array().unwrap(),
        );
        for (i, (ours, whole)) in divided.iter().zip(alone).enumerate() {
            assert!(ours["error"].is_null(), "{name}, request {i}: {ours}");
            let n = ours["ids"].as_array().unwrap().len();
            assert!(n >= 16, "{name}, request {i}: {n} tokens");
            // The unseeded request draws its own seed in each engine.
            if i != 4 {
                assert_eq!(ours["ids"], whole["ids"], "{name}, request {i}");
            }
        }
    }
    results
}

/// A model divided over two ranks on a machine with memory to spare, where rank 1 reads its
/// memory as under its floor (a stand-in reading): rank 0 admits within rank 1's headroom, so
/// its request is refused with a sentence naming rank 1's memory, where alone it runs (the
/// test above); and rank 1 returns once rank 0's engine stops.
#[test]
fn the_rank_with_the_least_memory_bounds_admissions() {
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), "llama3-rope");
    let led = led_and_followed(dir.path(), &models, "engine_short_rank", 120);
    let served = &led["served"][0];
    let error = served["error"]
        .as_str()
        .unwrap_or_else(|| panic!("rank 0: {led}"));
    assert!(error.contains("of memory for its KV cache"), "{error}");
    assert!(
        error.contains(
            "0 bytes is available on rank 1, the rank dividing the model with the least memory"
        ),
        "{error}"
    );
    assert_eq!(served["ids"], serde_json::json!([]), "{served}");
}

/// Pipeline stages that hold a model's kinds of layers in other proportions (Gemma 3 with 3
/// sliding-window layers to 1 global, over 2 ranks: no whole run of the pattern for each, so
/// split layer by layer, sliding and global against two sliding) are refused by the batch
/// engine on both ranks, with a sentence naming each rank's layers and tensor parallelism
/// (each stage weighs its own bytes against rank 0's scaled by its layers: exact only when
/// every kind scales alike).
#[test]
fn the_batch_engine_refuses_stages_of_unlike_layers() {
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), "gemma3_text");
    let config_path = models.join("gemma3_text/config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["sliding_window_pattern"] = 4.into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    for (r, error) in refusals(dir.path(), &models, "engine_staged")
        .iter()
        .enumerate()
    {
        assert!(
            error.contains(
                "rank 0: 1 sliding-window and 0 linear-attention of 2; rank 1: 2 \
                 sliding-window and 0 linear-attention of 2"
            ),
            "rank {r}: {error}"
        );
        assert!(
            error.contains("divide it with --distributed tensor"),
            "rank {r}: {error}"
        );
    }
}

/// Chats with one and with two images, and one without, through the engine over two ranks
/// (tensor-parallel, then two pipeline stages; the tiny Gemma 3 vision-language model mlx-vlm
/// writes, every rank holding its whole vision tower): rank 0 sends each request's pixel values with it, and each answer's
/// ids equal those of the whole model on one process.
#[test]
fn images_run_over_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = common::model_dir();
    common::run_oracle(
        "tiny_vision.py",
        &[dir.path().to_str().unwrap(), tokenizer.to_str().unwrap()],
    );
    let model = dir.path().join("gemma3");
    for task in ["engine_images", "engine_pipeline_images"] {
        if task == "engine_pipeline_images" {
            // Its 2 layers, a sliding and a global one, as two global ones: stages of one kind
            // (the batch refuses stages of unlike layers).
            let path = model.join("config.json");
            let mut config: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            config["text_config"]["sliding_window_pattern"] = 1.into();
            std::fs::write(&path, config.to_string()).unwrap();
        }
        let led = led_and_followed(dir.path(), &model, task, 300);
        let (divided, alone) = (
            led["divided"].as_array().unwrap(),
            led["alone"].as_array().unwrap(),
        );
        assert_eq!(divided.len(), 3, "{task}: {led}");
        for (i, (ours, whole)) in divided.iter().zip(alone).enumerate() {
            let ids = ours["ids"].as_array().unwrap();
            assert!(ours["error"].is_null(), "{task}, request {i}: {ours}");
            assert_eq!(ids.len(), 8, "{task}, request {i}: {ours}");
            assert_eq!(ours["ids"], whole["ids"], "{task}, request {i}");
        }
    }
}

/// A draft model on rank 0 and none on rank 1: both ranks refuse at load with a sentence naming
/// each rank's, rather than meet other collectives once the batch drafts.
#[test]
fn ranks_with_different_drafts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), "llama3-rope");
    for (r, error) in refusals(dir.path(), &models, "engine_draft_apart")
        .iter()
        .enumerate()
    {
        assert!(
            error.contains("the ranks hold different draft models (rank 0 one, rank 1 none"),
            "rank {r}: {error}"
        );
    }
}

/// A rank failing to load its draft model once its part of the model is loaded (rank 0, then
/// rank 1): it ends with its own error and the other rank with a sentence naming it, rather
/// than waiting in a collective the failed rank never makes.
#[test]
fn a_rank_that_fails_to_prepare_fails_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), "llama3-rope");
    for (task, failed, own) in [
        ("engine_draft_fails", 0, "no-such-draft"),
        (
            "engine_follower_draft_fails",
            1,
            "this rank's draft could not be loaded",
        ),
    ] {
        let errors = refusals(dir.path(), &models, task);
        assert!(errors[failed].contains(own), "{task}: {errors:?}");
        let named = format!("rank {failed} could not prepare its part of the model");
        assert!(errors[1 - failed].contains(&named), "{task}: {errors:?}");
    }
}

/// Prompt caches on disk over two ranks (tensor-parallel, then two pipeline stages): each rank
/// writes and reads its own part, a request after the cache gets the ids of the whole prompt on
/// one process, a missing part fails reading on every rank alike (naming the rank) without
/// stopping the group, and a rank's part is refused by the whole model.
#[test]
fn prompt_caches_on_disk_run_over_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), "llama3-rope");
    for task in ["engine_prompt_cache", "engine_pipeline_prompt_cache"] {
        let led = led_and_followed(dir.path(), &models, task, 300);
        assert_eq!(led["saved"]["Ok"], 40, "{task}: {led}");
        assert_eq!(
            led["files"],
            serde_json::json!([true, true]),
            "{task}: {led}"
        );
        assert_eq!(led["loaded"]["Ok"], 32, "{task}: {led}");
        let alone = &led["alone"][0];
        assert_eq!(alone["ids"].as_array().unwrap().len(), 8, "{task}: {led}");
        let divided = led["divided"].as_array().unwrap();
        for (i, ours) in divided.iter().enumerate() {
            assert!(ours["error"].is_null(), "{task}, request {i}: {led}");
            assert_eq!(ours["ids"].as_array().unwrap().len(), 8, "{task}: {led}");
        }
        for ours in [&divided[0], &divided[1], &led["after_sampled"][0]] {
            assert_eq!(ours["ids"], alone["ids"], "{task}: {led}");
        }
        let refused = led["loaded_stale"]["Err"].as_str().unwrap_or_default();
        assert!(refused.contains("not of one save"), "{task}: {led}");
        let refused = led["loaded_without_part"]["Err"]
            .as_str()
            .unwrap_or_default();
        assert!(
            refused.contains("rank 1 could not read or write its part")
                && refused.contains("prefix.rank1.safetensors"),
            "{task}: {led}"
        );
        let [after_cache, plain] = [0, 1].map(|i| &led["without_part"][i]);
        let error = after_cache["error"].as_str().unwrap_or_default();
        assert!(error.contains("rank 1 could not read"), "{task}: {led}");
        assert_eq!(plain["ids"], alone["ids"], "{task}: {led}");
        let refused = led["whole_loads_part"]["Err"].as_str().unwrap_or_default();
        assert!(
            refused.contains("rank 0 of 2 part of the model's KV"),
            "{task}: {led}"
        );
        std::fs::remove_file(dir.path().join("prefix.safetensors")).unwrap();
    }
}

/// A rank that exits while the batch engine decodes over two ranks: rank 0's requests end with
/// MLX's sentence within seconds, and a request after them is refused (the group stopped),
/// never a hang.
#[test]
fn a_rank_that_dies_under_the_batch_engine_ends_its_requests() {
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), "llama3-rope");
    let [survivor, mut dying] = spawn_two_ranks(dir.path(), &models, "engine_dies");
    let result = result(survivor, Duration::from_secs(120));
    dying.wait().unwrap();
    let case = &result["cases"]["llama3-rope"];
    for ended in case["ended"].as_array().unwrap() {
        let error = ended["error"].as_str().unwrap_or_else(|| panic!("{case}"));
        assert!(error.contains("connection to a peer was lost"), "{error}");
        assert!(!ended["ids"].as_array().unwrap().is_empty(), "{case}");
    }
    assert!(case["s"].as_f64().unwrap() < 20.0, "{case}");
    let after = case["after"][0]["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{case}"));
    assert!(after.contains("stopped working together"), "{after}");
}

/// A rank that stops answering while the batch decodes (paused with SIGSTOP: alive, its
/// sockets open, so MLX's collectives never fail) ends the group within the stall limit
/// (`PERCH_GROUP_STALL_SECS`, 4 s here): the rank still running says why on its standard error
/// and exits with the watchdog's status, never a hang; paused rank 1 ends rank 0, paused rank
/// 0 ends rank 1. Before its requests rank 0 idles for twice the limit, which the other rank
/// must not count as a stall (rank 0's calls while idle).
#[test]
fn a_rank_that_stops_answering_ends_the_group_within_its_stall_limit() {
    use perch_engine::distributed::{STALLED_EXIT_CODE, STALL_LIMIT_ENV};
    // Through libc, not the `kill` program (procps may be missing on a clean machine).
    let signal = |child: &Child, name: &str| {
        let number = match name {
            "-STOP" => libc::SIGSTOP,
            _ => libc::SIGKILL,
        };
        // SAFETY: a plain system call on a child this test started and has not reaped.
        let sent = unsafe { libc::kill(child.id() as libc::pid_t, number) };
        assert_eq!(sent, 0, "kill {name}");
    };
    for paused in [1, 0] {
        let dir = tempfile::tempdir().unwrap();
        let models = tiny_models(dir.path(), "llama3-rope");
        let hosts = hostfile(dir.path(), 2);
        let env = [
            (MODELS_ENV, models.as_path()),
            (STALL_LIMIT_ENV, Path::new("4")),
        ];
        let mut ranks = [0, 1].map(|r| spawn_rank_with(r, &hosts, "engine_stalls", &env));
        let marker = decoding_marker(&models.join("llama3-rope"));
        let start = Instant::now();
        while !marker.exists() {
            for (r, rank) in ranks.iter_mut().enumerate() {
                if let Some(status) = rank.try_wait().unwrap() {
                    panic!("paused {paused}: rank {r} {status} before rank 0 decoded");
                }
            }
            assert!(start.elapsed() < Duration::from_secs(120), "no decoding");
            std::thread::sleep(Duration::from_millis(20));
        }
        signal(&ranks[paused], "-STOP");
        let stopped_at = Instant::now();
        let ending = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ended(&mut ranks[1 - paused], Duration::from_secs(60))
        }));
        let seconds = stopped_at.elapsed().as_secs_f32();
        signal(&ranks[paused], "-KILL");
        ranks[paused].wait().unwrap();
        let (status, _, err) = ending.unwrap_or_else(|e| std::panic::resume_unwind(e));
        assert_eq!(
            status.code(),
            Some(STALLED_EXIT_CODE),
            "paused {paused}: {err}"
        );
        let rank = 1 - paused;
        assert!(
            err.contains(&format!(
                "rank {rank}: the ranks dividing the model made no progress"
            )),
            "paused {paused}: {err}"
        );
        // The limit, its polling and a step in flight, with room for a busy machine.
        assert!(seconds < 30.0, "paused {paused}: {seconds} s");
    }
}

/// A rank that stops answering after its third token of a greedy generation (it blocks in its
/// token callback), either split: rank 0's watchdog ends it within the stall limit (4 s; rank
/// 1's is 60 s, so that rank 1 does not end first) with its sentence and status, after rank 1
/// stopped (its marker), never a hang.
#[test]
fn a_rank_that_stops_answering_mid_request_ends_the_other() {
    use perch_engine::distributed::{STALLED_EXIT_CODE, STALL_LIMIT_ENV};
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), "llama3-rope");
    let marker = decoding_marker(&models.join("llama3-rope"));
    for task in ["tensor_parallel_stalls", "pipeline_parallel_stalls"] {
        let _ = std::fs::remove_file(&marker);
        let hosts = hostfile(dir.path(), 2);
        let [mut rank_0, mut rank_1] = [(0, "4"), (1, "60")].map(|(r, limit)| {
            let env = [
                (MODELS_ENV, models.as_path()),
                (STALL_LIMIT_ENV, Path::new(limit)),
            ];
            spawn_rank_with(r, &hosts, task, &env)
        });
        let ending = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            ended(&mut rank_0, Duration::from_secs(120))
        }));
        let _ = rank_1.kill();
        let (_, out_1, err_1) = ended(&mut rank_1, Duration::from_secs(10));
        let (status, _, err) = ending.unwrap_or_else(|e| std::panic::resume_unwind(e));
        assert_eq!(
            status.code(),
            Some(STALLED_EXIT_CODE),
            "{task}: {err}\nrank 1: {out_1}\n{err_1}"
        );
        assert!(
            err.contains("rank 0: the ranks dividing the model made no progress"),
            "{task}: {err}"
        );
        assert!(
            marker.exists(),
            "{task}: rank 0 ended before rank 1 paused: {err}"
        );
    }
}

/// A rank that never gets to load its part (alive, its sockets open) ends the rank waiting for
/// it where the ranks meet while loading, within the load limit (`PERCH_GROUP_LOAD_SECS`, 3 s
/// here), with the watchdog's sentence and status, never a hang.
#[test]
fn a_rank_that_never_loads_ends_the_group_within_its_load_limit() {
    use perch_engine::distributed::{LOAD_LIMIT_ENV, STALLED_EXIT_CODE};
    let dir = tempfile::tempdir().unwrap();
    let models = tiny_models(dir.path(), "llama3-rope");
    let hosts = hostfile(dir.path(), 2);
    let env = [
        (MODELS_ENV, models.as_path()),
        (LOAD_LIMIT_ENV, Path::new("3")),
    ];
    let [mut rank_0, mut rank_1] = [0, 1].map(|r| spawn_rank_with(r, &hosts, "load_stalls", &env));
    let start = Instant::now();
    let ending = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ended(&mut rank_0, Duration::from_secs(60))
    }));
    let seconds = start.elapsed().as_secs_f32();
    let _ = rank_1.kill();
    let _ = rank_1.wait();
    let (status, out, err) = ending.unwrap_or_else(|e| std::panic::resume_unwind(e));
    assert_eq!(status.code(), Some(STALLED_EXIT_CODE), "{out}\n{err}");
    assert!(
        err.contains("rank 0: the ranks loading the model did not all reach this point"),
        "{err}"
    );
    assert!(err.contains(LOAD_LIMIT_ENV), "{err}");
    assert!((3.0..30.0).contains(&seconds), "{seconds} s");
}

/// A Llama whose layers hold nearly all of its weights (hidden 256, 2 layers, an MLP of 1024, a
/// vocabulary of 256, tied embeddings), random, in float16: its folder in `dir`, and the bytes of
/// its tensors that dividing it by heads over two ranks leaves whole on each (the embeddings and
/// the norms).
fn wide_llama(dir: &Path) -> (PathBuf, u64) {
    let model = dir.join("wide-llama");
    std::fs::create_dir_all(&model).unwrap();
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 1024,
        "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": true,
    });
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let mut tensors: Vec<(String, Vec<i32>)> = vec![
        ("model.embed_tokens.weight".into(), vec![256, 256]),
        ("model.norm.weight".into(), vec![256]),
    ];
    for i in 0..2 {
        let p = format!("model.layers.{i}");
        for (name, shape) in [
            ("self_attn.q_proj", vec![256, 256]),
            ("self_attn.k_proj", vec![256, 256]),
            ("self_attn.v_proj", vec![256, 256]),
            ("self_attn.o_proj", vec![256, 256]),
            ("mlp.gate_proj", vec![1024, 256]),
            ("mlp.up_proj", vec![1024, 256]),
            ("mlp.down_proj", vec![256, 1024]),
            ("input_layernorm", vec![256]),
            ("post_attention_layernorm", vec![256]),
        ] {
            tensors.push((format!("{p}.{name}.weight"), shape));
        }
    }
    let whole: i64 = tensors
        .iter()
        .filter(|(name, _)| !name.contains("_proj"))
        .map(|(_, shape)| shape.iter().map(|&d| d as i64).product::<i64>() * 2)
        .sum();
    let arrays: Vec<(String, Array)> = tensors
        .into_iter()
        .map(|(name, shape)| {
            let values = mlx_rs::random::normal::<f32>(&shape[..], None, 0.02, None).unwrap();
            (name, values.as_dtype(mlx_rs::Dtype::Float16).unwrap())
        })
        .collect();
    Array::save_safetensors(arrays, None, model.join("model.safetensors")).unwrap();
    (model, whole as u64)
}

/// Dividing a model by heads (`models::load_divided`, tensor parallel over two ranks) reads only
/// each rank's part of every divided tensor from the weight file: each rank's part reads copy
/// exactly half of the divided tensors' bytes (`part_reads::part_bytes_read`), and its read
/// calls (MLX reading whole tensors, as the kernel counts them) no more than the tensors it keeps
/// whole, the headers and the config; about 52% of this model's weights in all. Reading every
/// tensor whole and keeping a part, as before, was all of them.
#[test]
fn a_rank_reads_only_its_part_of_each_divided_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let (model, whole) = wide_llama(dir.path());
    let file = std::fs::metadata(model.join("model.safetensors"))
        .unwrap()
        .len();
    let hosts = hostfile(dir.path(), 2);
    let env = [(MODELS_ENV, model.as_path())];
    let children: Vec<Child> = (0..2)
        .map(|r| spawn_rank_with(r, &hosts, "load_parts", &env))
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        let result = result(child, Duration::from_secs(120));
        assert_eq!(result["rank"], r, "{result}");
        let (read, parts) = (
            result["read"].as_u64().unwrap(),
            result["parts"].as_u64().unwrap(),
        );
        // The header aside, the file is its tensors' bytes.
        let header = {
            let bytes = std::fs::read(model.join("model.safetensors")).unwrap();
            8 + u64::from_le_bytes(bytes[..8].try_into().unwrap())
        };
        let divided = file - header - whole;
        assert_eq!(parts, divided / 2, "rank {r}: parts of {divided} bytes");
        // The headers (twice: checked, then read by MLX) and config.json besides.
        assert!(
            (whole..whole + 2 * header + 16 * 1024).contains(&read),
            "rank {r}: read calls took {read} bytes, {whole} kept whole, {divided} divided"
        );
    }
}

/// Loading one stage of two (`models::load_divided`) reads and keeps only that stage's layers:
/// each rank's peak while loading the test model (30 layers; its embeddings and LM head kept by
/// both) is well below loading it whole, so other layers are never read (were every tensor read
/// and then dropped, the peak would be the whole model's).
#[test]
fn a_stage_loads_only_its_layers() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = hostfile(dir.path(), 2);
    let model = common::model_dir();
    let env = [(MODELS_ENV, model.as_path()), (PEAKS_ENV, Path::new("1"))];
    let children: Vec<Child> = (0..2)
        .map(|r| spawn_rank_with(r, &hosts, "pipeline_parallel", &env))
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        let result = result(child, Duration::from_secs(120));
        assert_eq!(result["rank"], r, "{result}");
        let (divided, whole) = (
            result["divided"].as_f64().unwrap(),
            result["whole"].as_f64().unwrap(),
        );
        assert!(
            divided < 0.75 * whole,
            "rank {r}: {divided} bytes at most, against {whole} whole"
        );
    }
}

/// Ranks whose copies of the model differ are refused, before any weight is read and by every
/// rank alike: rank 1's `config.json` with another value, its weight file with another last
/// byte, or its tokenizer's configuration with another end-of-sequence token. A copy of the
/// same files elsewhere (links to them) loads.
#[test]
fn ranks_holding_different_models_are_refused_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::model_dir();
    // A folder of links to the model's files, but for `own`, written as given.
    let variant = |name: &str, own: Option<(&str, Vec<u8>)>| -> PathBuf {
        let folder = dir.path().join(name);
        std::fs::create_dir(&folder).unwrap();
        for entry in std::fs::read_dir(&model).unwrap() {
            let path = entry.unwrap().path();
            let file = path.file_name().unwrap();
            match &own {
                Some((own, bytes)) if file == *own => {
                    std::fs::write(folder.join(file), bytes).unwrap()
                }
                _ => std::os::unix::fs::symlink(&path, folder.join(file)).unwrap(),
            }
        }
        folder
    };
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    config["rms_norm_eps"] = serde_json::json!(1e-4);
    let mut weights = std::fs::read(model.join("model.safetensors")).unwrap();
    *weights.last_mut().unwrap() ^= 1;
    let mut tokenizer: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("tokenizer_config.json")).unwrap())
            .unwrap();
    tokenizer["eos_token"] = serde_json::json!("<|endoftext|>");
    let cases = [
        ("copy", variant("copy", None), None),
        (
            "config",
            variant(
                "config",
                Some(("config.json", serde_json::to_vec(&config).unwrap())),
            ),
            Some("the config.json of rank 1 differs from rank 0's"),
        ),
        (
            "weights",
            variant("weights", Some(("model.safetensors", weights))),
            Some("the weight files of rank 1 differ from rank 0's"),
        ),
        (
            "tokenizer",
            variant(
                "tokenizer",
                Some((
                    "tokenizer_config.json",
                    serde_json::to_vec(&tokenizer).unwrap(),
                )),
            ),
            Some("the tokenizer files of rank 1 differ from rank 0's"),
        ),
    ];
    let model_bytes = std::fs::metadata(model.join("model.safetensors"))
        .unwrap()
        .len() as f64;
    for (name, copy, refusal) in cases {
        let hosts = hostfile(dir.path(), 2);
        let children: Vec<Child> = [model.as_path(), copy.as_path()]
            .into_iter()
            .enumerate()
            .map(|(r, own)| spawn_rank_with(r, &hosts, "load", &[(MODELS_ENV, own)]))
            .collect();
        for (r, child) in children.into_iter().enumerate() {
            let result = result(child, Duration::from_secs(120));
            assert_eq!(result["rank"], r, "{name}: {result}");
            let peak = result["peak"].as_f64().unwrap();
            match refusal {
                None => {
                    assert!(result.get("error").is_none(), "{name}: {result}");
                    assert!(
                        peak > 0.1 * model_bytes,
                        "{name}: rank {r} loaded {peak} bytes"
                    );
                }
                Some(refusal) => {
                    let error = result["error"]
                        .as_str()
                        .unwrap_or_else(|| panic!("{name}: rank {r} loaded: {result}"));
                    assert!(error.contains(refusal), "{name}: rank {r}: {error}");
                    assert!(error.contains("the same model files"), "{name}: {error}");
                    // Refused before loading: no weight was read into MLX.
                    assert!(
                        peak < 0.01 * model_bytes,
                        "{name}: rank {r} held {peak} bytes"
                    );
                }
            }
        }
    }
}
