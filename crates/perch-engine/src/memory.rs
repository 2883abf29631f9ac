//! How much memory this process can still take, asked before an allocation that matters (a
//! model's weights), so that too little memory is a sentence instead of the kernel's OOM killer.
//!
//! The answer is the smaller of the system's available memory (`MemAvailable` on Linux, through
//! `sysinfo`) and, on Linux, the room left under every memory cgroup the process runs in: its
//! own and each ancestor, cgroup v1 (`memory.limit_in_bytes` − the working set) and v2
//! (`memory.max` − the working set), the working set being usage less the inactive file cache
//! the kernel reclaims first (`memory.stat`'s `inactive_file`, `total_inactive_file` in v1), as
//! the kernel's OOM decision and container runtimes count it. `sysinfo`'s own cgroup reading
//! looks only at the root of the cgroup mount, which is not the process's cgroup outside a
//! container. The cgroup files: <https://docs.kernel.org/admin-guide/cgroup-v2.html>,
//! <https://docs.kernel.org/admin-guide/cgroup-v1/memory.html>.
//!
//! On macOS the answer also follows the kernel's memory pressure level (the
//! `kern.memorystatus_vm_pressure_level` sysctl, the level `DISPATCH_SOURCE_TYPE_MEMORYPRESSURE`
//! reports): under a warning, half of what `sysinfo` counts as available (the system is already
//! compressing memory, and what it counts as available would come from swap); at critical,
//! nothing ([`under_pressure`]). Not run here (no Mac): the mapping is unit-tested, the sysctl
//! read is not.

use std::path::{Path, PathBuf};

/// What bounds the memory available to the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum MemoryBound {
    /// The machine's available memory.
    System,
    /// A memory cgroup's limit (a container's, a service's or a test's).
    Cgroup,
    /// macOS's memory pressure ([`PressureLevel`]).
    Pressure,
    /// Another rank's memory, where a model divided over ranks has the least room
    /// ([`crate::distributed`]): rank 0 admits within it.
    Rank(u32),
}

/// macOS's memory pressure level (`kern.memorystatus_vm_pressure_level`: 1, 2, 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PressureLevel {
    Normal,
    Warning,
    Critical,
}

impl PressureLevel {
    /// The sysctl's value; `None` for one it does not define.
    pub fn from_sysctl(value: u32) -> Option<Self> {
        match value {
            1 => Some(Self::Normal),
            2 => Some(Self::Warning),
            4 => Some(Self::Critical),
            _ => None,
        }
    }
}

/// `available` as the pressure `level` leaves it: all of it when normal (or unknown), half under
/// a warning, nothing at critical (bounded by [`MemoryBound::Pressure`] when that is less).
pub fn under_pressure(available: Available, level: Option<PressureLevel>) -> Available {
    let bytes = match level {
        None | Some(PressureLevel::Normal) => return available,
        Some(PressureLevel::Warning) => available.bytes / 2,
        Some(PressureLevel::Critical) => 0,
    };
    Available {
        bytes,
        bound: MemoryBound::Pressure,
    }
}

/// macOS's memory pressure level now; `None` where it cannot be read.
#[cfg(target_os = "macos")]
fn pressure_level() -> Option<PressureLevel> {
    let mut value: u32 = 0;
    let mut size = std::mem::size_of::<u32>();
    // SAFETY: the name is NUL-terminated, `value` and `size` outlive the call and `size` is
    // `value`'s size; no new value is set.
    let status = unsafe {
        libc::sysctlbyname(
            c"kern.memorystatus_vm_pressure_level".as_ptr(),
            (&mut value as *mut u32).cast(),
            &mut size,
            std::ptr::null_mut(),
            0,
        )
    };
    (status == 0 && size == std::mem::size_of::<u32>())
        .then(|| PressureLevel::from_sysctl(value))
        .flatten()
}

/// Only macOS reports a pressure level.
#[cfg(not(target_os = "macos"))]
fn pressure_level() -> Option<PressureLevel> {
    None
}

/// Bytes the process can still allocate, and what bounds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Available {
    pub bytes: u64,
    pub bound: MemoryBound,
}

/// "N MB is available", with what bounds it when that is not the machine (error messages).
impl std::fmt::Display for Available {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is available", describe_bytes(self.bytes))?;
        match self.bound {
            MemoryBound::System => Ok(()),
            MemoryBound::Cgroup => write!(f, " (the memory limit of the cgroup Perch runs in)"),
            MemoryBound::Pressure => write!(f, " (macOS reports memory pressure)"),
            MemoryBound::Rank(rank) => write!(
                f,
                " on rank {rank}, the rank dividing the model with the least memory"
            ),
        }
    }
}

/// The memory the weights and KV cache of `backend` are allocated from can take now: host memory
/// on CPU and Metal (unified memory), [`available`]; `None` on CUDA, whose device memory this
/// module does not judge.
pub fn available_for(backend: crate::device::Backend) -> Option<Available> {
    (backend != crate::device::Backend::Cuda).then(available)
}

/// The memory this process can take now ([module docs](self)).
pub fn available() -> Available {
    available_under(&memory_cgroups())
}

/// [`available`], with the memory cgroups that limit the process already found
/// ([`memory_cgroups`]): what a caller that asks often reads again, without the mount tables.
fn available_under(cgroups: &[(PathBuf, CgroupVersion)]) -> Available {
    let mut system = sysinfo::System::new();
    system.refresh_memory();
    let mut answer = Available {
        bytes: system.available_memory(),
        bound: MemoryBound::System,
    };
    if let Some(room) = cgroup_room(cgroups) {
        if room < answer.bytes {
            answer = Available {
                bytes: room,
                bound: MemoryBound::Cgroup,
            };
        }
    }
    under_pressure(answer, pressure_level())
}

/// The memory cgroup directories this process is in and each ancestor (none outside Linux or
/// where the tables cannot be read).
fn memory_cgroups() -> Vec<(PathBuf, CgroupVersion)> {
    if !cfg!(target_os = "linux") {
        return Vec::new();
    }
    let read = |path| std::fs::read_to_string(path).unwrap_or_default();
    memory_cgroup_dirs(&read("/proc/self/mountinfo"), &read("/proc/self/cgroup"))
}

/// The least room left under `cgroups` (`None`: none of them is limited).
fn cgroup_room(cgroups: &[(PathBuf, CgroupVersion)]) -> Option<u64> {
    cgroups
        .iter()
        .filter_map(|(dir, version)| {
            let (dir, version) = (dir, *version);
            let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
            let (limit, usage) = match version {
                CgroupVersion::V1 => ("memory.limit_in_bytes", "memory.usage_in_bytes"),
                CgroupVersion::V2 => ("memory.max", "memory.current"),
            };
            room(
                &read(limit)?,
                &read(usage)?,
                read("memory.stat").as_deref().unwrap_or(""),
                version,
            )
        })
        .min()
}

/// Which interface a cgroup directory speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CgroupVersion {
    V1,
    V2,
}

/// The memory cgroup directories that limit this process, its own first and then each ancestor
/// up to the mount's root, from `/proc/self/mountinfo` and `/proc/self/cgroup`: the v1 memory
/// hierarchy's and the v2 unified hierarchy's (a machine may mount both).
fn memory_cgroup_dirs(mountinfo: &str, membership: &str) -> Vec<(PathBuf, CgroupVersion)> {
    let mut dirs = Vec::new();
    for line in membership.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let version = if id == "0" && controllers.is_empty() {
            CgroupVersion::V2
        } else if controllers.split(',').any(|c| c == "memory") {
            CgroupVersion::V1
        } else {
            continue;
        };
        let Some((root, mount)) = cgroup_mount(mountinfo, version) else {
            continue;
        };
        // The mount shows the hierarchy from `root` on (a container sees its own cgroup as `/`).
        let Ok(inside) = Path::new(path).strip_prefix(&root) else {
            continue;
        };
        let mut dir = mount.join(inside);
        loop {
            dirs.push((dir.clone(), version));
            if dir == mount || !dir.pop() || !dir.starts_with(&mount) {
                break;
            }
        }
    }
    dirs
}

/// The root and mount point of the v1 memory hierarchy's or the v2 hierarchy's mount.
fn cgroup_mount(mountinfo: &str, version: CgroupVersion) -> Option<(PathBuf, PathBuf)> {
    mountinfo.lines().find_map(|line| {
        // `ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`
        let (before, after) = line.split_once(" - ")?;
        let fields: Vec<&str> = before.split(' ').collect();
        let mut after = after.split(' ');
        let fstype = after.next()?;
        let super_options = after.nth(1).unwrap_or("");
        let wanted = match version {
            CgroupVersion::V2 => fstype == "cgroup2",
            CgroupVersion::V1 => {
                fstype == "cgroup" && super_options.split(',').any(|o| o == "memory")
            }
        };
        (wanted && fields.len() >= 5).then(|| {
            (
                PathBuf::from(unescape(fields[3])),
                PathBuf::from(unescape(fields[4])),
            )
        })
    })
}

/// mountinfo's octal escapes (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Room left under one cgroup from its files' text: the limit less the working set (usage less
/// the inactive file cache). `None` when it has no limit (v2's `max`, or v1's near-`u64::MAX`
/// "unlimited") or a file does not parse.
fn room(limit: &str, usage: &str, stat: &str, version: CgroupVersion) -> Option<u64> {
    let limit: u64 = limit.trim().parse().ok()?;
    // v1 writes "unlimited" as the largest page-aligned i64.
    if limit >= (i64::MAX as u64) & !0xfff {
        return None;
    }
    let usage: u64 = usage.trim().parse().ok()?;
    let inactive_key = match version {
        CgroupVersion::V1 => "total_inactive_file",
        CgroupVersion::V2 => "inactive_file",
    };
    let inactive = stat
        .lines()
        .find_map(|l| {
            l.strip_prefix(inactive_key)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0u64);
    Some(limit.saturating_sub(usage.saturating_sub(inactive)))
}

/// The largest share of the memory available once the model is loaded that the KV cache budget
/// takes: the pool's real use reaches about 2.5× its budget (the prefix cache's copies beside the
/// running sequences' own caches; docs/reliability.md, "The KV cache's real bound"), and a step's
/// activations come on top.
pub const KV_SHARE_OF_AVAILABLE: f64 = 0.3;

/// A KV cache budget of `configured` bytes, lowered to [`KV_SHARE_OF_AVAILABLE`] of `available`
/// bytes where that is less.
pub fn kv_budget_within(configured: usize, available: u64) -> usize {
    configured.min((available as f64 * KV_SHARE_OF_AVAILABLE) as usize)
}

/// The share of the memory available once the model is loaded that MLX may keep in its cache of
/// freed buffers (which it reuses instead of allocating; resident all the same). MLX's own
/// default is its memory limit, about the machine's RAM: under a tight limit the cache alone
/// pushed a batch over it.
pub const CACHE_SHARE_OF_AVAILABLE: f64 = 0.1;

/// MLX's buffer-cache limit: [`CACHE_SHARE_OF_AVAILABLE`] of `available` bytes, and no more
/// than the KV cache budget `kv_budget` or [`CACHE_FLOOR`], whichever is more (what a step's
/// buffers and the caches' growth come to is of that order). Without that bound a small budget
/// on a large machine kept the cache at its share whatever it served: the soak's process (256
/// MiB budget, 23 GB available) held 2.3 GB of freed buffers beside 0.9 GB of live ones
/// (docs/reliability.md).
pub fn cache_limit_within(available: u64, kv_budget: usize) -> usize {
    ((available as f64 * CACHE_SHARE_OF_AVAILABLE) as usize).min(kv_budget.max(CACHE_FLOOR))
}

/// The cache a small KV budget still gets: a long prompt's prefill chunk allocates buffers of
/// this order every step, which a smaller cache would free and allocate again each time.
pub const CACHE_FLOOR: usize = 256 << 20;

/// Watches the memory left while the engine runs (CPU and Metal): [`PressureGuard::low`] says
/// when it has fallen under a floor, so the engine frees what it can (MLX's buffer cache, the
/// prefix cache's free blocks) and stops admitting requests until memory is back, rather than
/// growing into the OOM killer. Reads the memory at most every [`PressureGuard::INTERVAL`].
#[derive(Debug)]
pub struct PressureGuard {
    /// What was available once the model loaded.
    available_after_load: u64,
    floor: u64,
    /// The process's memory cgroups, found once.
    cgroups: Vec<(PathBuf, CgroupVersion)>,
    /// Reads the memory instead of [`available`] (tests of what a reading makes an engine do).
    reading: Option<fn() -> Available>,
    checked: Option<std::time::Instant>,
    low: bool,
    /// The last reading.
    available: Available,
}

impl PressureGuard {
    /// How often the memory is read (each read costs a few system calls).
    pub const INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);
    /// The floor: this share of the memory available once the model was loaded, and at least
    /// [`PressureGuard::MIN_FLOOR`].
    pub const FLOOR_SHARE: f64 = 0.2;
    pub const MIN_FLOOR: u64 = 32 << 20;

    /// A guard for an engine that had `available_after_load` bytes left once its model loaded.
    pub fn new(available_after_load: u64) -> Self {
        Self {
            available_after_load,
            floor: ((available_after_load as f64 * Self::FLOOR_SHARE) as u64).max(Self::MIN_FLOOR),
            cgroups: memory_cgroups(),
            reading: None,
            checked: None,
            low: false,
            available: Available {
                bytes: u64::MAX,
                bound: MemoryBound::System,
            },
        }
    }

    /// A guard reading the memory with `read` (what was available after loading is its first
    /// reading): tests of how an engine answers a reading.
    pub fn reading(read: fn() -> Available) -> Self {
        Self {
            reading: Some(read),
            ..Self::new(read().bytes)
        }
    }

    /// Whether the memory available is under the floor, and whether that was read just now
    /// (it is read again when the last reading is older than [`PressureGuard::INTERVAL`]).
    pub fn low(&mut self) -> (bool, bool) {
        let fresh = self.checked.is_none_or(|at| at.elapsed() >= Self::INTERVAL);
        if fresh {
            self.checked = Some(std::time::Instant::now());
            self.available = match self.reading {
                Some(read) => read(),
                None => available_under(&self.cgroups),
            };
            self.low = self.available.bytes < self.floor;
        }
        (self.low, fresh)
    }

    /// Makes the next [`PressureGuard::low`] read the memory again, however recent the last
    /// reading (after memory was given back, to judge on what is left now).
    pub fn read_again(&mut self) {
        self.checked = None;
    }

    /// What the engine had above the floor once its model loaded, with nothing else running:
    /// more than this no request can take however long it waits (unless other processes
    /// give memory back).
    pub fn capacity(&self) -> u64 {
        self.available_after_load.saturating_sub(self.floor)
    }

    /// What the last reading had above the floor (and what bounded it): what the engine may
    /// still take before it is under pressure.
    pub fn headroom(&self) -> Available {
        Available {
            bytes: self.available.bytes.saturating_sub(self.floor),
            bound: self.available.bound,
        }
    }
}

/// A KV cache budget lowered to fit the memory left after loading the model
/// ([`kv_budget_within`]): what was configured and what was available.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LoweredBudget {
    pub configured_bytes: usize,
    pub available_bytes: u64,
}

impl LoweredBudget {
    /// `Some` when [`kv_budget_within`] lowers `configured` for `available`.
    pub fn of(configured: usize, available: u64) -> Option<Self> {
        (kv_budget_within(configured, available) < configured).then_some(Self {
            configured_bytes: configured,
            available_bytes: available,
        })
    }
}

/// `bytes` in the largest unit that keeps a whole number in front (`1.5 GB`, `96 MB`), decimal
/// units as the OS's memory displays give them.
pub fn describe_bytes(bytes: u64) -> String {
    const UNITS: [(&str, f64); 3] = [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)];
    for (unit, size) in UNITS {
        let value = bytes as f64 / size;
        if value >= 1.0 {
            return match value < 10.0 {
                true => format!("{value:.1} {unit}"),
                false => format!("{value:.0} {unit}"),
            };
        }
    }
    format!("{bytes} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A warning halves what is available and critical leaves nothing, said in the sentence;
    /// normal, unknown or undefined levels change nothing.
    #[test]
    fn memory_pressure_lowers_what_is_available() {
        let system = Available {
            bytes: 8_000_000_000,
            bound: MemoryBound::System,
        };
        assert_eq!(under_pressure(system, None), system);
        assert_eq!(
            under_pressure(system, PressureLevel::from_sysctl(1)),
            system
        );
        assert_eq!(PressureLevel::from_sysctl(3), None);
        let warning = under_pressure(system, PressureLevel::from_sysctl(2));
        assert_eq!(
            warning,
            Available {
                bytes: 4_000_000_000,
                bound: MemoryBound::Pressure,
            }
        );
        assert_eq!(
            warning.to_string(),
            "4.0 GB is available (macOS reports memory pressure)"
        );
        let critical = under_pressure(system, PressureLevel::from_sysctl(4));
        assert_eq!((critical.bytes, critical.bound), (0, MemoryBound::Pressure));
        // Elsewhere there is no level to read.
        if !cfg!(target_os = "macos") {
            assert_eq!(pressure_level(), None);
        }
    }

    const MOUNTINFO: &str = "\
24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
35 24 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
36 35 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
40 35 0:35 / /sys/fs/cgroup/cpu rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,cpu
41 35 0:36 /outer /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,memory
";

    #[test]
    fn finds_the_process_cgroup_and_its_ancestors_in_both_hierarchies() {
        let membership = "\
9:name=systemd:/
4:memory:/outer/job/test
1:cpu:/
0::/user.slice/app
";
        let dirs = memory_cgroup_dirs(MOUNTINFO, membership);
        let v1 = |p: &str| (PathBuf::from(p), CgroupVersion::V1);
        let v2 = |p: &str| (PathBuf::from(p), CgroupVersion::V2);
        assert_eq!(
            dirs,
            vec![
                v1("/sys/fs/cgroup/memory/job/test"),
                v1("/sys/fs/cgroup/memory/job"),
                v1("/sys/fs/cgroup/memory"),
                v2("/sys/fs/cgroup/unified/user.slice/app"),
                v2("/sys/fs/cgroup/unified/user.slice"),
                v2("/sys/fs/cgroup/unified"),
            ]
        );
        // A cgroup outside what the mount shows, and no memory controller: nothing to read.
        assert!(memory_cgroup_dirs(MOUNTINFO, "4:memory:/elsewhere\n1:cpu:/x\n").is_empty());
        assert!(memory_cgroup_dirs("", membership).is_empty());
    }

    #[test]
    fn mount_points_with_escaped_spaces() {
        let line = "41 35 0:36 / /mnt/my\\040cgroups rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup_mount(line, CgroupVersion::V2),
            Some((PathBuf::from("/"), PathBuf::from("/mnt/my cgroups")))
        );
        assert_eq!(cgroup_mount(line, CgroupVersion::V1), None);
    }

    #[test]
    fn room_is_the_limit_less_the_working_set() {
        let stat_v1 = "cache 100\ntotal_inactive_file 30000000\ninactive_file 5\n";
        assert_eq!(
            room("67108864\n", "50000000\n", stat_v1, CgroupVersion::V1),
            Some(67_108_864 - (50_000_000 - 30_000_000))
        );
        assert_eq!(
            room("1000\n", "400\n", "inactive_file 100\n", CgroupVersion::V2),
            Some(700)
        );
        // Over the limit (usage can pass it briefly): no room, not an underflow.
        assert_eq!(room("1000", "1500", "", CgroupVersion::V2), Some(0));
        // No limit: v2's `max`, v1's page-aligned i64::MAX.
        assert_eq!(room("max\n", "400\n", "", CgroupVersion::V2), None);
        assert_eq!(
            room("9223372036854771712\n", "4", "", CgroupVersion::V1),
            None
        );
        assert_eq!(room("1000", "garbage", "", CgroupVersion::V2), None);
    }

    #[test]
    fn the_kv_budget_leaves_room_for_its_real_use() {
        assert_eq!(kv_budget_within(2 << 30, 64 << 30), 2 << 30);
        assert_eq!(kv_budget_within(2 << 30, 1_000_000_000), 300_000_000);
        assert_eq!(kv_budget_within(2 << 30, 0), 0);
    }

    #[test]
    fn bytes_in_words() {
        assert_eq!(describe_bytes(1_500_000_000), "1.5 GB");
        assert_eq!(describe_bytes(96_000_000), "96 MB");
        assert_eq!(describe_bytes(67_108_864), "67 MB");
        assert_eq!(describe_bytes(512), "512 bytes");
    }

    #[test]
    fn available_memory_is_known_here() {
        let now = available();
        // A Mac at critical memory pressure reads 0, and says so.
        assert!(
            now.bytes > 0 || now.bound == MemoryBound::Pressure,
            "{now:?}"
        );
    }

    /// The cache takes its share of what is available, never more than the KV budget (or the
    /// floor).
    #[test]
    fn the_buffer_cache_is_bounded_by_the_kv_budget() {
        const GIB: u64 = 1 << 30;
        assert_eq!(cache_limit_within(23 * GIB, 512 << 20), 512 << 20);
        // A small budget: the floor.
        assert_eq!(cache_limit_within(23 * GIB, 64 << 20), CACHE_FLOOR);
        assert_eq!(
            cache_limit_within(4 * GIB, 2 << 30),
            (4 * GIB / 10) as usize
        );
        assert_eq!(cache_limit_within(0, 2 << 30), 0);
    }
}
