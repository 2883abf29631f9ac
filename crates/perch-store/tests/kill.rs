//! `kill -9` in the middle of writing: every answer the writer reported as saved is there
//! after reopening, and the database is not set aside.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use perch_engine::{FinishReason, GenerationStats};
use perch_store::{ConversationSettings, History, Turn};

const CHILD_ENV: &str = "PERCH_STORE_KILL_TEST_DB";

/// The writer: runs only as the child of `answers_reported_saved_survive_kill_9` (ignored, so
/// it is not counted as a test of its own).
#[test]
#[ignore = "the child process of answers_reported_saved_survive_kill_9"]
fn writer_child() {
    let Some(path) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let (mut history, _) = History::open(path.as_ref()).unwrap();
    let id = history
        .create_conversation(&ConversationSettings::default())
        .unwrap()
        .id;
    for i in 0.. {
        let question = Turn::Send {
            content: format!("question {i}"),
            images: Vec::new(),
        };
        history.begin_turn(id, &question).unwrap();
        let answer = format!("answer {i} {}", "y".repeat(i % 500));
        let stats = GenerationStats::default();
        let saved = history
            .save_answer(id, &answer, FinishReason::Stop, &stats, None, None)
            .unwrap();
        println!("saved {id} {} {}", saved.id, answer.len());
    }
}

#[test]
fn answers_reported_saved_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("history.sqlite3");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "writer_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &path)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut saved = Vec::new();
    while saved.len() < 100 {
        let line = lines.next().expect("writer ended early").unwrap();
        if let Some(rest) = line.strip_prefix("saved ") {
            saved.push(rest.to_owned());
        }
    }
    child.kill().unwrap(); // SIGKILL on Unix
    child.wait().unwrap();
    // Lines already written before the kill were reported too.
    saved.extend(
        lines
            .map_while(Result::ok)
            .filter_map(|l| l.strip_prefix("saved ").map(str::to_owned)),
    );

    let (history, set_aside) = History::open(&path).unwrap();
    assert_eq!(set_aside, None);
    let conversations = history.conversations("").unwrap();
    assert_eq!(conversations.len(), 1);
    let messages = history.conversation(conversations[0].id).unwrap().messages;
    for report in &saved {
        let fields: Vec<usize> = report.split(' ').map(|f| f.parse().unwrap()).collect();
        let message = messages
            .iter()
            .find(|m| m.id as usize == fields[1])
            .unwrap_or_else(|| panic!("answer {} reported saved is lost", fields[1]));
        assert_eq!(message.content.len(), fields[2]);
        assert_eq!(message.finish_reason, Some(FinishReason::Stop));
    }
}
