//! Downloading a [`RemoteSnapshot`] into the Hugging Face cache, laid out as `huggingface_hub`
//! writes it, so mlx-lm and Perch share every model:
//!
//! ```text
//! models--{org}--{name}/blobs/{etag}                       the content, one per distinct file
//! models--{org}--{name}/blobs/{etag}.incomplete            a partial download (resumable)
//! models--{org}--{name}/snapshots/{commit}/{path}          -> ../../blobs/{etag} (relative link)
//! models--{org}--{name}/refs/{revision}                    the commit, e.g. refs/main
//! .locks/models--{org}--{name}/{etag}.lock                 held while one process fetches a blob
//! ```
//!
//! Partial files are resumed with `Range: bytes={len}-` (by Perch or by `huggingface_hub`: the
//! names are the same), every blob is checked against its hash (SHA-256 for LFS files, Git's
//! blob id otherwise) before it gets its final name, and a blob is only ever renamed into place
//! complete, so a cancelled, interrupted or failed download never leaves a damaged model.
//!
//! Processes share the cache: a blob is fetched under its `.lock` (`flock`, as `huggingface_hub`'s
//! `filelock` takes it), so two downloads of one model fetch each blob once, the second waiting
//! and then finding it complete; links and refs are written under a name of their own
//! (`{name}.{pid}.{n}.tmp`) and renamed into place, so concurrent writers do not trip on each
//! other. Every name from the snapshot is checked before it names a path (revision, commit, file
//! path, blob hash): nothing is written outside the cache directory.
//!
//! `hf-hub`'s own download is not used: in 0.4/0.5 it cannot be cancelled (the async one leaves
//! its chunk tasks running), it verifies nothing, and its partial files (`.sync.part` with a
//! trailing counter) are not the ones `huggingface_hub` resumes; 1.0 does not resume at all.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use sha1::Sha1;
use sha2::{Digest, Sha256};

use crate::error::io_error;
use crate::hub::{
    check_file, check_repo_id, check_revision, is_commit_hash, percent_encode, RemoteFile,
    RemoteSnapshot,
};
use crate::{HubClient, HubError};

/// How often transient failures (lost connection, HTTP 5xx) are retried per file, resuming.
const RETRIES: u32 = 3;
/// Read size; also how often cancellation is checked.
const BUFFER_BYTES: usize = 256 * 1024;
/// Progress is reported at most this often (and at every file's end).
const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// Where a download stands.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DownloadProgress {
    pub repo_id: String,
    /// The file being fetched (path in the repository).
    pub file: String,
    /// Bytes present so far, all files together (reused and resumed bytes count).
    pub bytes_done: u64,
    /// Bytes of all files.
    pub bytes_total: u64,
    pub files_done: usize,
    pub files_total: usize,
}

/// A finished download.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Downloaded {
    /// `snapshots/{commit}` in the cache: the directory to load.
    pub snapshot_dir: PathBuf,
    /// Bytes fetched over the network by this call.
    pub bytes_fetched: u64,
    /// Bytes already in the cache (complete blobs and the resumed parts of partial ones).
    pub bytes_reused: u64,
}

impl HubClient {
    /// Downloads every file of `snapshot` that the cache lacks, verifies it, links it into
    /// `snapshots/{commit}` and points `refs/{revision}` at the commit.
    ///
    /// `cancel` is checked between reads: setting it stops the download within one read with
    /// [`HubError::Cancelled`], keeping the partial file for the next call to resume.
    /// `on_progress` is called at the start, at most every 100 ms, and after each file.
    ///
    /// Another process downloading the same files (Perch or `huggingface_hub`) is waited for,
    /// blob by blob, and what it completed is reused rather than fetched again.
    ///
    /// Errors, before anything is written: [`HubError::InvalidRepoId`],
    /// [`HubError::InvalidRevision`] (also for a commit that is no commit hash) and
    /// [`HubError::InvalidFile`] for a snapshot whose names could leave the cache (those from
    /// [`HubClient::snapshot`] are already checked); [`HubError::DiskFull`] when the disk lacks
    /// the missing bytes. Then: [`HubError::Checksum`] (the bad partial file is deleted);
    /// [`HubError::Interrupted`], [`HubError::Network`] or [`HubError::Status`] once retries are
    /// spent (the partial file is kept); [`HubError::Io`].
    pub fn download(
        &self,
        snapshot: &RemoteSnapshot,
        cancel: &AtomicBool,
        on_progress: &mut dyn FnMut(&DownloadProgress),
    ) -> Result<Downloaded, HubError> {
        check_snapshot(snapshot)?;
        let folder = hf_hub::Repo::model(snapshot.repo_id.clone()).folder_name();
        let repo_dir = self.cache_dir().join(&folder);
        let blobs = repo_dir.join("blobs");
        let locks = self.cache_dir().join(".locks").join(&folder);
        let snapshot_dir = repo_dir.join("snapshots").join(&snapshot.commit);
        for dir in [&blobs, &locks, &snapshot_dir] {
            fs::create_dir_all(dir).map_err(io_error(dir))?;
        }

        let present: Vec<u64> = snapshot
            .files
            .iter()
            .map(|file| bytes_present(&blobs, file))
            .collect();
        let missing = snapshot.total_bytes() - present.iter().sum::<u64>();
        check_disk_space(&blobs, missing)?;

        let mut reporter = Reporter {
            progress: DownloadProgress {
                repo_id: snapshot.repo_id.clone(),
                file: String::new(),
                bytes_done: 0,
                bytes_total: snapshot.total_bytes(),
                files_done: 0,
                files_total: snapshot.files.len(),
            },
            last_sent: None,
            sink: on_progress,
        };
        reporter.send();
        let mut bytes_fetched = 0;
        let mut bytes_finished = 0;
        for file in &snapshot.files {
            reporter.progress.file = file.path.clone();
            let blob = blobs.join(&file.etag);
            if !is_complete(&blob, file.size) {
                let _lock = lock(&locks.join(format!("{}.lock", file.etag)), cancel)?;
                // Another process may have finished it while we waited.
                if !is_complete(&blob, file.size) {
                    bytes_fetched +=
                        self.fetch_blob(snapshot, file, &blob, cancel, &mut reporter)?;
                }
            }
            link(&snapshot_dir, file)?;
            bytes_finished += file.size;
            reporter.progress.bytes_done = bytes_finished;
            reporter.progress.files_done += 1;
            reporter.send();
        }
        if snapshot.revision != snapshot.commit {
            write_ref(&repo_dir, &snapshot.revision, &snapshot.commit)?;
        }
        Ok(Downloaded {
            snapshot_dir,
            bytes_fetched,
            bytes_reused: snapshot.total_bytes() - bytes_fetched,
        })
    }

    /// Fetches one blob into `{blob}.incomplete` (resuming it), verifies it and renames it to
    /// `blob`. Returns the bytes fetched over the network.
    fn fetch_blob(
        &self,
        snapshot: &RemoteSnapshot,
        file: &RemoteFile,
        blob: &Path,
        cancel: &AtomicBool,
        reporter: &mut Reporter,
    ) -> Result<u64, HubError> {
        let url = format!(
            "{}/{}/resolve/{}/{}",
            self.endpoint(),
            snapshot.repo_id,
            snapshot.commit,
            encode_path(&file.path)
        );
        let partial_path = partial_path(blob);
        let mut partial = Partial::open(&partial_path, file)?;
        reporter.advance(partial.len);
        let mut attempt = 0;
        loop {
            match self.fetch_rest(&url, file, &mut partial, cancel, reporter) {
                Ok(()) => break,
                Err(err) if err.is_transient() && attempt < RETRIES => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(250 << attempt));
                }
                Err(err) => return Err(err),
            }
        }
        let actual = partial.hasher.finish();
        if actual != file.etag {
            drop(partial);
            let _ = fs::remove_file(&partial_path);
            return Err(HubError::Checksum {
                path: file.path.clone(),
                expected: file.etag.clone(),
                actual,
            });
        }
        partial.file.sync_all().map_err(io_error(&partial_path))?;
        fs::rename(&partial_path, blob).map_err(io_error(blob))?;
        Ok(partial.fetched)
    }

    /// Requests the bytes `partial` lacks and appends them, hashing as it goes.
    fn fetch_rest(
        &self,
        url: &str,
        file: &RemoteFile,
        partial: &mut Partial,
        cancel: &AtomicBool,
        reporter: &mut Reporter,
    ) -> Result<(), HubError> {
        if partial.len == file.size {
            return Ok(());
        }
        let range_from = (partial.len > 0).then_some(partial.len);
        let mut response = self.get(url, range_from, None)?;
        let resumes = response.status().as_u16() == 206
            && content_range_start(response.headers()) == Some(partial.len);
        if !resumes && partial.len > 0 {
            // The server sent the whole file (or refused the range): start over.
            reporter.retreat(partial.len);
            partial.restart(file)?;
            if response.status().as_u16() != 200 {
                response = self.get(url, None, None)?;
            }
        }
        let mut body = response.body_mut().as_reader();
        let mut buffer = vec![0u8; BUFFER_BYTES];
        let interrupted = |partial: &Partial, source| HubError::Interrupted {
            path: file.path.clone(),
            received: partial.len,
            expected: file.size,
            source,
        };
        loop {
            if cancel.load(Ordering::Relaxed) {
                return Err(HubError::Cancelled);
            }
            let n = match body.read(&mut buffer) {
                Ok(0) => break,
                Ok(n) => n,
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(interrupted(partial, Some(err))),
            };
            if partial.len + n as u64 > file.size {
                return Err(HubError::BadResponse {
                    url: url.to_owned(),
                    reason: format!(
                        "{} is longer than the {} bytes listed",
                        file.path, file.size
                    ),
                });
            }
            partial.append(&buffer[..n])?;
            reporter.advance(n as u64);
        }
        if partial.len < file.size {
            return Err(interrupted(partial, None));
        }
        Ok(())
    }
}

/// A `.incomplete` file, open for appending, with the hash of what it holds.
struct Partial {
    path: PathBuf,
    file: File,
    len: u64,
    /// Bytes of `len` that this process appended (the rest was there when it was opened).
    fetched: u64,
    hasher: BlobHasher,
}

impl Partial {
    /// Opens (or creates) `path` and hashes what it already holds; a file longer than `file`
    /// cannot be a prefix of it and is started over.
    fn open(path: &Path, file: &RemoteFile) -> Result<Partial, HubError> {
        let handle = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io_error(path))?;
        let existing = handle.metadata().map_err(io_error(path))?.len();
        let mut partial = Partial {
            path: path.to_owned(),
            len: 0,
            fetched: 0,
            hasher: BlobHasher::new(file),
            file: handle,
        };
        if existing > file.size {
            partial.restart(file)?;
            return Ok(partial);
        }
        // Reading to the end also leaves the file positioned for appending.
        let mut buffer = vec![0u8; BUFFER_BYTES];
        loop {
            let n = partial.file.read(&mut buffer).map_err(io_error(path))?;
            if n == 0 {
                break;
            }
            partial.hasher.update(&buffer[..n]);
            partial.len += n as u64;
        }
        Ok(partial)
    }

    fn restart(&mut self, file: &RemoteFile) -> Result<(), HubError> {
        self.file.set_len(0).map_err(io_error(&self.path))?;
        self.file
            .seek(SeekFrom::Start(0))
            .map_err(io_error(&self.path))?;
        self.len = 0;
        self.fetched = 0;
        self.hasher = BlobHasher::new(file);
        Ok(())
    }

    fn append(&mut self, bytes: &[u8]) -> Result<(), HubError> {
        self.file.write_all(bytes).map_err(io_error(&self.path))?;
        self.hasher.update(bytes);
        self.len += bytes.len() as u64;
        self.fetched += bytes.len() as u64;
        Ok(())
    }
}

/// The hash a [`RemoteFile::etag`] names.
enum BlobHasher {
    Sha256(Sha256),
    /// Git's blob id: SHA-1 of `blob {size}\0` followed by the content.
    GitBlob(Sha1),
}

impl BlobHasher {
    fn new(file: &RemoteFile) -> Self {
        if file.lfs {
            BlobHasher::Sha256(Sha256::new())
        } else {
            let mut sha1 = Sha1::new();
            sha1.update(format!("blob {}\0", file.size).as_bytes());
            BlobHasher::GitBlob(sha1)
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            BlobHasher::Sha256(h) => h.update(bytes),
            BlobHasher::GitBlob(h) => h.update(bytes),
        }
    }

    /// Lower-case hex, as the Hub writes it.
    fn finish(&mut self) -> String {
        let digest: Vec<u8> = match self {
            BlobHasher::Sha256(h) => h.finalize_reset().to_vec(),
            BlobHasher::GitBlob(h) => h.finalize_reset().to_vec(),
        };
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Throttles progress reports.
struct Reporter<'a> {
    progress: DownloadProgress,
    last_sent: Option<Instant>,
    sink: &'a mut dyn FnMut(&DownloadProgress),
}

impl Reporter<'_> {
    fn advance(&mut self, bytes: u64) {
        self.progress.bytes_done += bytes;
        if self
            .last_sent
            .is_none_or(|at| at.elapsed() >= PROGRESS_INTERVAL)
        {
            self.send();
        }
    }

    fn retreat(&mut self, bytes: u64) {
        self.progress.bytes_done = self.progress.bytes_done.saturating_sub(bytes);
    }

    fn send(&mut self) {
        (self.sink)(&self.progress);
        self.last_sent = Some(Instant::now());
    }
}

/// Refuses a snapshot whose repository id, revision, commit, file paths or blob hashes could
/// name a path outside its repository's folder in the cache.
fn check_snapshot(snapshot: &RemoteSnapshot) -> Result<(), HubError> {
    check_repo_id(&snapshot.repo_id)?;
    check_revision(&snapshot.revision)?;
    if !is_commit_hash(&snapshot.commit) {
        return Err(HubError::InvalidRevision {
            revision: snapshot.commit.clone(),
            reason: "a snapshot's commit must be 40 or 64 hex digits".into(),
        });
    }
    for file in &snapshot.files {
        check_file(file).map_err(|reason| HubError::InvalidFile {
            path: file.path.clone(),
            reason,
        })?;
    }
    Ok(())
}

/// `{blob}.incomplete`: the name `huggingface_hub` also resumes (one writer at a time, under
/// the blob's lock).
fn partial_path(blob: &Path) -> PathBuf {
    let mut name = blob.as_os_str().to_owned();
    name.push(".incomplete");
    PathBuf::from(name)
}

/// `{path}.{pid}.{n}.tmp`: a name next to `path` that no other process, thread or call uses, to
/// write a link or ref under before renaming it into place.
fn temporary_path(path: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{}.{n}.tmp", std::process::id()));
    PathBuf::from(name)
}

/// Renames `temporary` to `path`, removing `temporary` when that fails.
fn rename_into_place(temporary: &Path, path: &Path) -> Result<(), HubError> {
    fs::rename(temporary, path).map_err(|err| {
        let _ = fs::remove_file(temporary);
        io_error(path)(err)
    })
}

fn is_complete(blob: &Path, size: u64) -> bool {
    fs::metadata(blob).is_ok_and(|m| m.is_file() && m.len() == size)
}

/// Bytes of `file` already in the cache: all of a complete blob, or a partial file's length.
fn bytes_present(blobs: &Path, file: &RemoteFile) -> u64 {
    let blob = blobs.join(&file.etag);
    if is_complete(&blob, file.size) {
        return file.size;
    }
    fs::metadata(partial_path(&blob)).map_or(0, |m| m.len().min(file.size))
}

/// Fails with [`HubError::DiskFull`] when the disk holding `dir` has fewer than `needed` bytes
/// free. An unknown disk passes: writing will tell.
fn check_disk_space(dir: &Path, needed: u64) -> Result<(), HubError> {
    let Some(available) = available_space(dir) else {
        return Ok(());
    };
    if needed > available {
        return Err(HubError::DiskFull {
            dir: dir.to_owned(),
            needed,
            available,
        });
    }
    Ok(())
}

/// Free bytes on the disk mounted deepest above `dir`.
fn available_space(dir: &Path) -> Option<u64> {
    let dir = fs::canonicalize(dir).ok()?;
    let disks = sysinfo::Disks::new_with_refreshed_list();
    disks
        .list()
        .iter()
        .filter(|disk| dir.starts_with(disk.mount_point()))
        .max_by_key(|disk| disk.mount_point().components().count())
        .map(|disk| disk.available_space())
}

/// Takes the `.lock` file `huggingface_hub` also uses for this blob, waiting while another
/// process holds it (and checking `cancel` meanwhile).
fn lock(path: &Path, cancel: &AtomicBool) -> Result<File, HubError> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io_error(path))?;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(fs::TryLockError::WouldBlock) => {
                if cancel.load(Ordering::Relaxed) {
                    return Err(HubError::Cancelled);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(fs::TryLockError::Error(err)) => return Err(io_error(path)(err)),
        }
    }
}

/// Links `snapshots/{commit}/{path}` to its blob (relative, as `huggingface_hub` does),
/// replacing whatever was there in one rename (another process may be linking it too).
fn link(snapshot_dir: &Path, file: &RemoteFile) -> Result<(), HubError> {
    let pointer = snapshot_dir.join(&file.path);
    let parent = pointer.parent().unwrap_or(snapshot_dir);
    fs::create_dir_all(parent).map_err(io_error(parent))?;
    // From the pointer's directory up to the repository folder: `snapshots/{commit}` + subdirs.
    let ups = 2 + file.path.matches('/').count();
    let target: PathBuf = std::iter::repeat_n(Path::new(".."), ups)
        .collect::<PathBuf>()
        .join("blobs")
        .join(&file.etag);
    if fs::read_link(&pointer).is_ok_and(|existing| existing == target) {
        return Ok(());
    }
    let temporary = temporary_path(&pointer);
    symlink(&target, &temporary).map_err(io_error(&temporary))?;
    rename_into_place(&temporary, &pointer)
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(windows)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::windows::fs::symlink_file(target, link)
}

/// Writes `refs/{revision}` (a branch or tag, checked by [`check_revision`]; `refs/pr/1`
/// becomes `refs/refs/pr/1`, as `huggingface_hub` writes it) atomically.
fn write_ref(repo_dir: &Path, revision: &str, commit: &str) -> Result<(), HubError> {
    let path = repo_dir.join("refs").join(revision);
    let parent = path.parent().unwrap_or(repo_dir);
    fs::create_dir_all(parent).map_err(io_error(parent))?;
    let temporary = temporary_path(&path);
    if let Err(err) = fs::write(&temporary, commit) {
        let _ = fs::remove_file(&temporary);
        return Err(io_error(&temporary)(err));
    }
    rename_into_place(&temporary, &path)
}

/// The first byte of a `Content-Range: bytes {first}-{last}/{size}` header.
fn content_range_start(headers: &ureq::http::HeaderMap) -> Option<u64> {
    let value = headers.get("content-range")?.to_str().ok()?;
    let range = value.strip_prefix("bytes ")?;
    range.split('-').next()?.trim().parse().ok()
}

/// Percent-encodes each part of a repository path, keeping the `/`s.
fn encode_path(path: &str) -> String {
    path.split('/')
        .map(percent_encode)
        .collect::<Vec<_>>()
        .join("/")
}
