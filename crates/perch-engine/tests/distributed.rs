//! Processes in one group over MLX's ring backend on 127.0.0.1, each started as `mlx.launch -n 2
//! --backend ring` starts a rank (`MLX_RANK`, and `MLX_HOSTFILE` listing each rank's address):
//! collectives give every rank the same sums, gathers and rank 0's bytes; a rank that dies makes
//! the survivor's next collective an error within seconds, and a rank whose peer never starts
//! gets an error at its deadline — never a hang.
//!
//! Each rank is this test binary run again on the ignored `rank` test, which does what
//! `PERCH_TEST_RANK_TASK` says and prints one JSON line of results.

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mlx_rs::Array;
use perch_engine::distributed::{self, Backend};

const TASK_ENV: &str = "PERCH_TEST_RANK_TASK";

/// A rank: runs only as a child of the tests below (ignored, so it is not a test of its own).
#[test]
#[ignore = "a rank started by the distributed tests"]
fn rank() {
    let Ok(task) = std::env::var(TASK_ENV) else {
        return;
    };
    let deadline = Duration::from_secs(if task == "alone" { 3 } else { 30 });
    let group = match distributed::init(Backend::Ring, deadline) {
        Ok(group) => group,
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            return;
        }
    };
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
    let mut result = serde_json::json!({
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
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "rank",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(TASK_ENV, task)
        .env("MLX_RANK", rank.to_string())
        .env("MLX_HOSTFILE", hostfile)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits at most `limit` for `child`, then its JSON line (killed and failed past the limit).
fn result(mut child: Child, limit: Duration) -> serde_json::Value {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("a rank still ran after {limit:?}: a hang");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
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
    // The CPU wheel has ring only; a CUDA build has NCCL.
    let missing = [Backend::Jaccl, Backend::Mpi, Backend::Nccl]
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
    assert!(
        error.contains("could not start its ring backend"),
        "{error}"
    );
}
