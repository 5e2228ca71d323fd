//! NVMe over Fabrics: a remote NVMe namespace reached over nvme-tcp, attached so that the NVMe
//! medium ([`crate::nvme`]) can keep its files on it exactly as on a local disk.
//!
//! Mechanism ([`Attachment::attach`]):
//! 1. **Connect** through the kernel's fabrics interface: the options
//!    (`transport=tcp,traddr=..,trsvcid=..,nqn=..` plus any host options given) are written in
//!    one `write` to `/dev/nvme-fabrics`; the kernel connects the admin and I/O queues and
//!    answers `instance=N,cntlid=M` when the same descriptor is read. A controller already
//!    connected to the same subsystem at the same address (left by a process that died; the
//!    kernel refuses a duplicate connect) is adopted instead: the attachment then owns it like
//!    one it connected, except that a failed attach disconnects only what it connected itself.
//! 2. **Find the namespace**: `/sys/class/nvme/nvmeN/` lists the controller's namespaces, as
//!    `nvmeSnK` or, with native multipath (Debian's default), as the hidden path `nvmeScNnK`
//!    whose block device is the subsystem's head `nvmeSnK`; each has an `nsid` file. Polled until
//!    the wanted namespace (default 1) and its `/dev` node appear.
//! 3. **Mount** its ext4 file system on the given directory (`noatime,nosuid,nodev,noexec`).
//!    A namespace that holds no file system is formatted only when the spec says `format`, and
//!    only when it is blank (its first MiB all zeros): `mkfs.ext4 -m 0 -E nodiscard`. Anything
//!    else that is not ext4 is refused with what was found, `format` or not.
//!
//! [`Attachment::detach`] (also what dropping an attachment does) unmounts, retrying while the
//! file system is busy for a bounded time, and then deletes the controller
//! (`/sys/class/nvme/nvmeN/delete_controller`) after checking it is still the one attached.
//! [`Attachment::leave`] keeps both for another process (`kvfs nvmeof attach`), and
//! [`detach_existing`] finds and undoes such an attachment later.
//!
//! Policy: why a file system rather than the raw block device: the NVMe medium keeps one file
//! per object with a sidecar header (crash-safe renames, FUSE passthrough of the data file,
//! objects that survive restarts), so putting a file system on the namespace reuses all of it
//! unchanged, local and remote tiers behave the same, and the behaviour suite covers both.
//! Why ext4: it supports O_DIRECT and io_uring, hard links (the medium's renames) and
//! `fallocate`, its journal makes the metadata crash-safe, and `mkfs.ext4` is on every Debian
//! system (e2fsprogs is `Priority: required`). Why refuse to format by default: the namespace
//! is remote storage someone else may have put data on; kvfs erases nothing without being told
//! to, and even then only a blank namespace, so a typo in `traddr` or `nqn` cannot destroy
//! another host's file system. An ext4 file system already there is mounted, never formatted
//! again: it holds the tier's objects from the previous run.
//!
//! Limits: every step that can block in the kernel (connect, mount, unmount, controller
//! deletion, the probe read) runs on a helper thread the caller waits for at most its bound
//! (`connect_timeout_ms`, `device_wait_ms`, [`FORMAT_TIMEOUT`], [`STEP_TIMEOUT`]); a step that
//! overruns is `Timeout` and its thread is left to finish (a connect that completes after its
//! caller gave up deletes the controller it made). `mkfs.ext4` is killed at its bound.
//!
//! Invariants: an attachment owns its controller and its mount while it lives: the directory
//! is a mount of exactly that namespace, and nothing else mounts it (a namespace mounted
//! elsewhere is refused). Every error names the step and what it was given.
//!
//! Not handled: transports other than tcp (rdma, fc), TLS and in-band authentication (DH-HMAC-
//! CHAP keys), discovery controllers (the subsystem NQN is given), multipath over several
//! addresses, namespaces that change size, and file systems other than ext2/3/4.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};
use crate::uring::AlignedBuf;

/// The NVMe/TCP port IANA assigned, used when the spec gives no `trsvcid`.
pub const DEFAULT_TRSVCID: u16 = 4420;
/// NQNs are at most 223 bytes (NVMe base specification, 4.5).
pub const NQN_BYTES_MAX: usize = 223;
/// Bound of each blocking kernel step that has no bound of its own (mount, unmount, probe
/// read, controller deletion).
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound of `mkfs.ext4`.
pub const FORMAT_TIMEOUT: Duration = Duration::from_secs(600);
/// How long an unmount is retried while the file system is busy.
pub const UNMOUNT_BUSY_WAIT: Duration = Duration::from_secs(10);
/// Bytes at the start of a namespace that must be zero for `format` to format it.
pub const BLANK_PROBE_BYTES: usize = 1 << 20;
/// Share of the file system's data blocks the NVMe tier may fill when no capacity is given
/// (the rest covers directories, header blocks' slack and fragmentation).
pub const CAPACITY_SHARE: f64 = 0.95;

/// Options of the kernel's fabrics interface that a spec may pass through, and how their value
/// is checked.
const KERNEL_OPTIONS: &[(&str, ValueKind)] = &[
    ("hostnqn", ValueKind::Nqn),
    ("hostid", ValueKind::Uuid),
    ("host_traddr", ValueKind::Ip),
    ("host_iface", ValueKind::Name),
    ("nr_io_queues", ValueKind::Count),
    ("nr_write_queues", ValueKind::Count),
    ("nr_poll_queues", ValueKind::Count),
    ("queue_size", ValueKind::Count),
    ("keep_alive_tmo", ValueKind::Count),
    ("reconnect_delay", ValueKind::Count),
    ("ctrl_loss_tmo", ValueKind::Seconds),
    ("fast_io_fail_tmo", ValueKind::Seconds),
    ("tos", ValueKind::Count),
];

#[derive(Clone, Copy)]
enum ValueKind {
    Nqn,
    Uuid,
    Ip,
    Name,
    Count,
    /// A count, or -1 (forever).
    Seconds,
}

/// Where a remote namespace is and how to attach it: what `--nvmeof` gives.
///
/// Grammar: comma-separated `key=value` items, in any order, each at most once:
/// `transport=tcp` (required; the only transport), `traddr=IP` (required; an address, the
/// kernel resolves no names), `trsvcid=PORT` (default 4420), `nqn=SUBSYSTEM-NQN` (required),
/// `nsid=N` (the namespace, default 1), `format` (no value: make an ext4 file system on a blank
/// namespace), `connect_timeout_ms=MS` (default 30000), `device_wait_ms=MS` (default 10000),
/// and the kernel's own `hostnqn`, `hostid`, `host_traddr`, `host_iface`, `nr_io_queues`,
/// `nr_write_queues`, `nr_poll_queues`, `queue_size`, `keep_alive_tmo`, `reconnect_delay`,
/// `ctrl_loss_tmo`, `fast_io_fail_tmo`, `tos`, passed through to the kernel unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmeofSpec {
    pub traddr: IpAddr,
    pub trsvcid: u16,
    pub nqn: String,
    pub nsid: u32,
    /// Make an ext4 file system on the namespace if it is blank.
    pub format: bool,
    pub connect_timeout_ms: u64,
    pub device_wait_ms: u64,
    /// Kernel options passed through, in the order given.
    pub kernel_options: Vec<(String, String)>,
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidArgument, msg)
}

fn check_value(key: &str, value: &str, kind: ValueKind) -> Result<()> {
    let bad = |what: &str| invalid(format!("nvmeof: {key}={value:?}: {what}"));
    match kind {
        ValueKind::Nqn => check_nqn(key, value),
        ValueKind::Uuid => {
            let groups: Vec<&str> = value.split('-').collect();
            let ok = groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
                && groups.iter().all(|g| g.chars().all(|c| c.is_ascii_hexdigit()));
            if ok { Ok(()) } else { Err(bad("not a UUID (8-4-4-4-12 hex digits)")) }
        }
        ValueKind::Ip => value.parse::<IpAddr>().map(drop).map_err(|_| bad("not an IP address")),
        ValueKind::Name => {
            let ok = !value.is_empty()
                && value.len() <= 15
                && value.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
            if ok { Ok(()) } else { Err(bad("not an interface name")) }
        }
        ValueKind::Count => value.parse::<u32>().map(drop).map_err(|_| bad("not a whole number")),
        ValueKind::Seconds => match value.parse::<i64>() {
            Ok(v) if v >= -1 && v <= i64::from(i32::MAX) => Ok(()),
            _ => Err(bad("not a number of seconds (or -1)")),
        },
    }
}

fn check_nqn(key: &str, value: &str) -> Result<()> {
    if value.is_empty() || value.len() > NQN_BYTES_MAX {
        return Err(invalid(format!(
            "nvmeof: {key} must be 1 to {NQN_BYTES_MAX} bytes, not {}",
            value.len()
        )));
    }
    if let Some(c) = value.chars().find(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(format!("nvmeof: {key}={value:?} contains {c:?}")));
    }
    Ok(())
}

fn parse_ms(key: &str, value: &str) -> Result<u64> {
    match value.parse::<u64>() {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(invalid(format!("nvmeof: {key}={value:?} is not a positive number of ms"))),
    }
}

impl NvmeofSpec {
    /// Parse the `--nvmeof` value (see the type's grammar).
    pub fn parse(s: &str) -> Result<NvmeofSpec> {
        let mut items: BTreeMap<&str, &str> = BTreeMap::new();
        let mut order = Vec::new();
        for item in s.split(',') {
            let item = item.trim();
            if item.is_empty() {
                return Err(invalid(format!("nvmeof: empty item in {s:?}")));
            }
            let (k, v) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None => (item, ""),
            };
            if items.insert(k, v).is_some() {
                return Err(invalid(format!("nvmeof: {k} given twice in {s:?}")));
            }
            order.push(k);
        }
        let required = |k: &str| {
            items.get(k).copied().filter(|v| !v.is_empty()).ok_or_else(|| {
                invalid(format!(
                    "nvmeof: {k}= is required (transport=tcp,traddr=IP,trsvcid=PORT,nqn=NQN)"
                ))
            })
        };
        let transport = required("transport")?;
        if transport != "tcp" {
            return Err(invalid(format!(
                "nvmeof: transport {transport:?} is not supported: kvfs reaches namespaces over tcp only"
            )));
        }
        let traddr = required("traddr")?;
        let traddr = traddr.parse::<IpAddr>().map_err(|_| {
            invalid(format!(
                "nvmeof: traddr={traddr:?} is not an IP address (the kernel resolves no host names)"
            ))
        })?;
        let nqn = required("nqn")?;
        check_nqn("nqn", nqn)?;
        let mut spec = NvmeofSpec {
            traddr,
            trsvcid: DEFAULT_TRSVCID,
            nqn: nqn.to_string(),
            nsid: 1,
            format: false,
            connect_timeout_ms: 30_000,
            device_wait_ms: 10_000,
            kernel_options: Vec::new(),
        };
        for k in order {
            let v = items[k];
            match k {
                "transport" | "traddr" | "nqn" => {}
                "format" if v.is_empty() => spec.format = true,
                "format" => {
                    return Err(invalid(format!("nvmeof: format takes no value (got {v:?})")));
                }
                "trsvcid" => {
                    spec.trsvcid = v.parse().ok().filter(|p| *p > 0).ok_or_else(|| {
                        invalid(format!("nvmeof: trsvcid={v:?} is not a port (1-65535)"))
                    })?;
                }
                "nsid" => {
                    spec.nsid = v.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        invalid(format!("nvmeof: nsid={v:?} is not a namespace id (1 or more)"))
                    })?;
                }
                "connect_timeout_ms" => spec.connect_timeout_ms = parse_ms(k, v)?,
                "device_wait_ms" => spec.device_wait_ms = parse_ms(k, v)?,
                _ => {
                    let Some((_, kind)) = KERNEL_OPTIONS.iter().find(|(name, _)| *name == k) else {
                        let known: Vec<&str> = ["transport", "traddr", "trsvcid", "nqn", "nsid"]
                            .into_iter()
                            .chain(["format", "connect_timeout_ms", "device_wait_ms"])
                            .chain(KERNEL_OPTIONS.iter().map(|(n, _)| *n))
                            .collect();
                        return Err(invalid(format!(
                            "nvmeof: unknown option {k:?} (known: {})",
                            known.join(", ")
                        )));
                    };
                    check_value(k, v, *kind)?;
                    spec.kernel_options.push((k.to_string(), v.to_string()));
                }
            }
        }
        Ok(spec)
    }

    /// What is written to `/dev/nvme-fabrics`.
    pub fn connect_options(&self) -> String {
        let mut s = format!(
            "transport=tcp,traddr={},trsvcid={},nqn={}",
            self.traddr, self.trsvcid, self.nqn
        );
        for (k, v) in &self.kernel_options {
            s.push_str(&format!(",{k}={v}"));
        }
        s
    }

    fn kernel_option(&self, key: &str) -> Option<&str> {
        self.kernel_options.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

impl std::str::FromStr for NvmeofSpec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        NvmeofSpec::parse(s)
    }
}

impl fmt::Display for NvmeofSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let addr = match self.traddr {
            IpAddr::V4(a) => format!("{a}:{}", self.trsvcid),
            IpAddr::V6(a) => format!("[{a}]:{}", self.trsvcid),
        };
        write!(f, "{} namespace {} at tcp {addr}", self.nqn, self.nsid)
    }
}

/// The kernel's files this module reads and writes (other roots in unit tests).
#[derive(Debug, Clone)]
struct Sys {
    fabrics: PathBuf,
    class_nvme: PathBuf,
    dev: PathBuf,
    sys_block: PathBuf,
    mountinfo: PathBuf,
}

impl Default for Sys {
    fn default() -> Self {
        Sys {
            fabrics: "/dev/nvme-fabrics".into(),
            class_nvme: "/sys/class/nvme".into(),
            dev: "/dev".into(),
            sys_block: "/sys/block".into(),
            mountinfo: "/proc/self/mountinfo".into(),
        }
    }
}

/// Run `f` on a helper thread and wait for it at most `limit`; past that, `Timeout` (the thread
/// is left to finish on its own).
fn bounded<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("kvfs-nvmeof".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| Error::io(format!("{what}: spawn a helper thread"), e))?;
    match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(mpsc::RecvTimeoutError::Timeout) => Err(Error::new(
            ErrorKind::Timeout,
            format!("{what} did not finish within {} ms", limit.as_millis()),
        )),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            Err(Error::new(ErrorKind::Io, format!("{what}: the helper thread panicked")))
        }
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// `k=v,k=v` (a controller's `address` file) as pairs.
fn address_fields(s: &str) -> BTreeMap<String, String> {
    s.trim()
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

/// Whether the kernel's rendering of an address equals `want` (IPv6 is printed in full forms
/// the parser accepts too).
fn same_ip(have: Option<&String>, want: &IpAddr) -> bool {
    have.and_then(|h| h.split('%').next().and_then(|h| h.parse::<IpAddr>().ok()))
        .is_some_and(|h| h == *want)
}

/// A connected controller: `nvme<instance>`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Controller {
    instance: u32,
}

impl Controller {
    fn name(&self) -> String {
        format!("nvme{}", self.instance)
    }

    fn dir(&self, sys: &Sys) -> PathBuf {
        sys.class_nvme.join(self.name())
    }

    fn state(&self, sys: &Sys) -> Option<String> {
        read_trimmed(&self.dir(sys).join("state"))
    }

    /// Whether this controller is connected to `spec`'s subsystem at `spec`'s address.
    fn matches(&self, sys: &Sys, spec: &NvmeofSpec) -> bool {
        let dir = self.dir(sys);
        if read_trimmed(&dir.join("transport")).as_deref() != Some("tcp")
            || read_trimmed(&dir.join("subsysnqn")).as_deref() != Some(spec.nqn.as_str())
        {
            return false;
        }
        let Some(addr) = read_trimmed(&dir.join("address")) else { return false };
        let f = address_fields(&addr);
        let port_ok = f.get("trsvcid").and_then(|p| p.parse::<u16>().ok()) == Some(spec.trsvcid);
        let host_ok = match spec.kernel_option("host_traddr") {
            Some(h) => h.parse().is_ok_and(|h| same_ip(f.get("host_traddr"), &h)),
            None => true,
        };
        same_ip(f.get("traddr"), &spec.traddr) && port_ok && host_ok
    }
}

/// Controllers connected to `spec`'s subsystem at its address.
fn find_controllers(sys: &Sys, spec: &NvmeofSpec) -> Vec<Controller> {
    let Ok(rd) = std::fs::read_dir(&sys.class_nvme) else { return Vec::new() };
    let mut found: Vec<Controller> = rd
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("nvme")?.parse().ok())
        .map(|instance| Controller { instance })
        .filter(|c| c.matches(sys, spec))
        .collect();
    found.sort_by_key(|c| c.instance);
    found
}

fn fabrics_error(sys: &Sys, spec: &NvmeofSpec, e: std::io::Error) -> Error {
    let dev = sys.fabrics.display();
    let (kind, why) = match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ENODEV) | Some(libc::ENXIO) => (
            ErrorKind::Unavailable,
            format!("the kernel has no nvme-fabrics module (no {dev}; load it: modprobe nvme-tcp)"),
        ),
        Some(libc::EACCES) | Some(libc::EPERM) => (
            ErrorKind::Unavailable,
            format!("{dev} needs root (CAP_SYS_ADMIN) to connect a controller"),
        ),
        Some(libc::EINVAL) => (
            ErrorKind::InvalidArgument,
            format!(
                "the kernel refused the connect options {:?} (EINVAL: is the nvme-tcp module loaded? the kernel log says which option)",
                spec.connect_options()
            ),
        ),
        Some(libc::ECONNREFUSED) => (
            ErrorKind::Unavailable,
            "nothing accepts NVMe/TCP connections at that address (connection refused)".into(),
        ),
        Some(libc::EALREADY) => (
            ErrorKind::Unavailable,
            "the kernel already has a controller for this subsystem at this address".into(),
        ),
        Some(libc::ETIMEDOUT) | Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) => {
            (ErrorKind::Unavailable, format!("the target is unreachable ({e})"))
        }
        Some(libc::EIO) => (
            ErrorKind::Unavailable,
            "the target refused the connection (EIO: is the subsystem exported on that port, and is this host allowed? the kernel log says why)".into(),
        ),
        _ => (ErrorKind::Io, format!("writing the connect options to {dev}: {e}")),
    };
    Error::new(kind, format!("nvmeof: connect {spec}: {why}"))
}

/// Write the connect options to the fabrics device and parse the kernel's answer.
fn fabrics_connect(sys: &Sys, spec: &NvmeofSpec) -> Result<Controller> {
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&sys.fabrics)
        .map_err(|e| fabrics_error(sys, spec, e))?;
    let opts = spec.connect_options();
    // One write: the kernel parses exactly what one write(2) gives it.
    let n = f.write(opts.as_bytes()).map_err(|e| fabrics_error(sys, spec, e))?;
    if n != opts.len() {
        return Err(Error::new(
            ErrorKind::Io,
            format!("nvmeof: connect {spec}: short write of the options ({n} of {})", opts.len()),
        ));
    }
    let mut answer = String::new();
    f.read_to_string(&mut answer).map_err(|e| {
        Error::io(
            format!("nvmeof: connect {spec}: read the answer of {}", sys.fabrics.display()),
            e,
        )
    })?;
    parse_connect_answer(&answer).ok_or_else(|| {
        Error::new(
            ErrorKind::Io,
            format!(
                "nvmeof: connect {spec}: the kernel answered {answer:?}, not instance=N,cntlid=M"
            ),
        )
    })
}

fn parse_connect_answer(answer: &str) -> Option<Controller> {
    let f = address_fields(answer);
    Some(Controller { instance: f.get("instance")?.parse().ok()? })
}

/// Delete a controller, after checking it is still connected to `spec` (instance numbers are
/// reused).
fn delete_controller(sys: &Sys, c: &Controller, spec: &NvmeofSpec) -> Result<()> {
    if !c.matches(sys, spec) {
        tracing::warn!(controller = %c.name(), %spec, "controller gone or replaced; not deleting it");
        return Ok(());
    }
    let path = c.dir(sys).join("delete_controller");
    let what = format!("nvmeof: disconnect {} ({spec})", c.name());
    let p = path.clone();
    bounded(&what, STEP_TIMEOUT, move || {
        std::fs::write(&p, b"1").or_else(|e| match e.raw_os_error() {
            // Deleted meanwhile (the kernel's own error path, or another process).
            Some(libc::ENOENT) | Some(libc::ENODEV) | Some(libc::EBUSY) => Ok(()),
            _ => Err(Error::io("", e)),
        })
    })
    .map_err(|e| e.context(format!("{what}: write 1 to {}", path.display())))
}

/// Connect, or adopt a controller already connected to the same subsystem and address; says
/// which (true: connected here).
fn connect(sys: &Sys, spec: &NvmeofSpec) -> Result<(Controller, bool)> {
    let deadline = Instant::now() + Duration::from_millis(spec.connect_timeout_ms);
    // A controller left by an earlier process: adopt it once it is live (the kernel refuses a
    // second connect with the same options).
    loop {
        let existing = find_controllers(sys, spec);
        let Some(c) = existing.first().cloned() else { break };
        match c.state(sys).as_deref() {
            Some("live") => {
                tracing::info!(controller = %c.name(), %spec, "adopting a connected controller");
                return Ok((c, false));
            }
            state if Instant::now() >= deadline => {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "nvmeof: connect {spec}: controller {} is connected but {} after {} ms",
                        c.name(),
                        state.unwrap_or("gone"),
                        spec.connect_timeout_ms
                    ),
                ));
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    // A connect the caller stopped waiting for must not leave a controller behind: whichever
    // of the two finishes second (under the lock) deletes it.
    #[derive(Default)]
    struct Late {
        gave_up: bool,
        made: Option<Controller>,
    }
    let late = Arc::new(Mutex::new(Late::default()));
    let (sys2, spec2, late2) = (sys.clone(), spec.clone(), late.clone());
    let what = format!("nvmeof: connect {spec}");
    let limit = deadline.saturating_duration_since(Instant::now());
    let r = bounded(&what, limit, move || {
        let r = fabrics_connect(&sys2, &spec2);
        if let Ok(c) = &r {
            let mut l = late2.lock().unwrap_or_else(|p| p.into_inner());
            if l.gave_up {
                drop(l);
                let _ = delete_controller(&sys2, c, &spec2);
            } else {
                l.made = Some(c.clone());
            }
        }
        r
    });
    if let Err(e) = &r
        && e.kind() == ErrorKind::Timeout
    {
        let mut l = late.lock().unwrap_or_else(|p| p.into_inner());
        l.gave_up = true;
        if let Some(c) = l.made.take() {
            drop(l);
            let _ = delete_controller(sys, &c, spec);
        }
    }
    let c = r?;
    tracing::info!(controller = %c.name(), %spec, "connected");
    Ok((c, true))
}

/// A namespace entry under a controller: (block device name, nsid), if `name` is one.
/// `nvme0n1` (no multipath) or `nvme0c1n1` (a multipath path; its device is the head,
/// `nvme0n1`).
fn namespace_entry(name: &str) -> Option<String> {
    let rest = name.strip_prefix("nvme")?;
    let (subsys, rest) = rest.split_at(rest.find(|c: char| !c.is_ascii_digit())?);
    let rest = match rest.strip_prefix('c') {
        Some(r) => {
            let (ctrl, r) = r.split_at(r.find(|c: char| !c.is_ascii_digit())?);
            if ctrl.is_empty() {
                return None;
            }
            r
        }
        None => rest,
    };
    let ns = rest.strip_prefix('n')?;
    if subsys.is_empty() || ns.is_empty() || !ns.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    Some(format!("nvme{subsys}n{ns}"))
}

/// The block device name of namespace `nsid` of controller `c`, if the kernel shows it yet, and
/// every nsid it shows.
fn find_namespace(sys: &Sys, c: &Controller, nsid: u32) -> (Option<String>, Vec<u32>) {
    let mut seen = Vec::new();
    let Ok(rd) = std::fs::read_dir(c.dir(sys)) else { return (None, seen) };
    let mut hit = None;
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(dev) = name.to_str().and_then(namespace_entry) else { continue };
        let Some(id) = read_trimmed(&e.path().join("nsid")).and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        seen.push(id);
        if id == nsid {
            hit = Some(dev);
        }
    }
    seen.sort_unstable();
    (hit, seen)
}

/// `major:minor` of a block device as sysfs gives it.
fn sys_dev_numbers(sys: &Sys, name: &str) -> Option<(u32, u32)> {
    let s = read_trimmed(&sys.sys_block.join(name).join("dev"))?;
    let (a, b) = s.split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Wait (at most `spec.device_wait_ms`) for the namespace's block device to appear in sysfs
/// and `/dev`.
fn wait_for_device(sys: &Sys, c: &Controller, spec: &NvmeofSpec) -> Result<(PathBuf, (u32, u32))> {
    let deadline = Instant::now() + Duration::from_millis(spec.device_wait_ms);
    loop {
        let (hit, seen) = find_namespace(sys, c, spec.nsid);
        let ready = hit.as_ref().and_then(|name| {
            let numbers = sys_dev_numbers(sys, name)?;
            let path = sys.dev.join(name);
            let md = std::fs::metadata(&path).ok()?;
            let rdev = md.rdev();
            let same = md.file_type().is_block_device()
                && (libc::major(rdev), libc::minor(rdev)) == numbers;
            same.then_some((path, numbers))
        });
        if let Some(r) = ready {
            return Ok(r);
        }
        if Instant::now() >= deadline {
            let why = match (&hit, c.state(sys)) {
                (_, Some(s)) if s != "live" => format!("controller {} is {s}", c.name()),
                (Some(name), _) => format!(
                    "{} did not appear as a block device matching /sys/block/{name}/dev (is devtmpfs mounted on {}?)",
                    sys.dev.join(name).display(),
                    sys.dev.display()
                ),
                (None, _) if seen.is_empty() => {
                    format!(
                        "controller {} shows no namespace (does the subsystem export one?)",
                        c.name()
                    )
                }
                (None, _) => format!(
                    "controller {} shows namespaces {seen:?} but not {} (give nsid=)",
                    c.name(),
                    spec.nsid
                ),
            };
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("nvmeof: {spec}: after {} ms: {why}", spec.device_wait_ms),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One line of `/proc/self/mountinfo`: the device numbers and the mount point.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MountEntry {
    dev: (u32, u32),
    point: PathBuf,
}

/// Undo mountinfo's octal escapes (`\040` for a space, ...).
fn unescape_mount_path(s: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let (a, b) = f.get(2)?.split_once(':')?;
            Some(MountEntry {
                dev: (a.parse().ok()?, b.parse().ok()?),
                point: unescape_mount_path(f.get(4)?),
            })
        })
        .collect()
}

fn mounts(sys: &Sys) -> Result<Vec<MountEntry>> {
    let text = std::fs::read_to_string(&sys.mountinfo)
        .map_err(|e| Error::io(format!("nvmeof: read {}", sys.mountinfo.display()), e))?;
    Ok(parse_mountinfo(&text))
}

/// What the start of a namespace holds.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Content {
    Ext4,
    Blank,
    /// Not ext and not blank: the offset of the first non-zero byte.
    Other(usize),
}

const EXT_MAGIC_OFFSET: usize = 1024 + 0x38;

fn classify(head: &[u8]) -> Content {
    if head.get(EXT_MAGIC_OFFSET..EXT_MAGIC_OFFSET + 2) == Some(&[0x53, 0xEF][..]) {
        return Content::Ext4;
    }
    match head.iter().position(|b| *b != 0) {
        None => Content::Blank,
        Some(at) => Content::Other(at),
    }
}

/// Read the first [`BLANK_PROBE_BYTES`] of the device (O_DIRECT: the device, not a cache).
fn probe(device: &Path) -> Result<Content> {
    let dev = device.to_path_buf();
    let what = format!("nvmeof: read the start of {}", device.display());
    bounded(&what.clone(), STEP_TIMEOUT, move || {
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(&dev)
            .map_err(|e| Error::io(what.clone(), e))?;
        let mut buf = AlignedBuf::new(BLANK_PROBE_BYTES);
        let mut got = 0;
        while got < buf.len() {
            // SAFETY: pread into our own aligned buffer, within its length.
            let n = unsafe {
                libc::pread(
                    f.as_raw_fd(),
                    buf.as_mut_ptr().add(got).cast(),
                    buf.len() - got,
                    got as libc::off_t,
                )
            };
            match n {
                0 => break, // a namespace smaller than the probe
                n if n > 0 => got += n as usize,
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(Error::io(what.clone(), e));
                    }
                }
            }
        }
        Ok(classify(&buf[..got]))
    })
}

/// `mkfs.ext4` from PATH or the usual sbin directories (daemons often lack sbin in PATH).
fn find_mkfs() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join("mkfs.ext4"))
        .find(|p| p.is_file())
}

fn format_ext4(device: &Path) -> Result<()> {
    let mkfs = find_mkfs().ok_or_else(|| {
        Error::new(
            ErrorKind::Unavailable,
            "nvmeof: format needs mkfs.ext4 (Debian package e2fsprogs); not in PATH, /usr/sbin or /sbin",
        )
    })?;
    let what = format!("nvmeof: {} {}", mkfs.display(), device.display());
    tracing::info!(device = %device.display(), "formatting the namespace (ext4)");
    let t = Instant::now();
    // -m 0: no blocks reserved for root (the file system only holds the tier); nodiscard: a
    // discard of a whole remote namespace can take long and the namespace was checked blank.
    let mut child = std::process::Command::new(&mkfs)
        .args(["-q", "-F", "-m", "0", "-E", "nodiscard", "-L", "kvfs-nvme"])
        .arg(device)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(what.clone(), e))?;
    loop {
        match child.try_wait().map_err(|e| Error::io(what.clone(), e))? {
            Some(status) => {
                let out = child.wait_with_output().map_err(|e| Error::io(what.clone(), e))?;
                if !status.success() {
                    let msg = String::from_utf8_lossy(&out.stderr);
                    return Err(Error::new(
                        ErrorKind::Io,
                        format!("{what} failed ({status}): {}", msg.trim()),
                    ));
                }
                tracing::info!(device = %device.display(), ms = t.elapsed().as_millis() as u64, "formatted");
                return Ok(());
            }
            None if t.elapsed() > FORMAT_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{what} did not finish within {} s", FORMAT_TIMEOUT.as_secs()),
                ));
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn cstring(p: &Path) -> Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|_| invalid(format!("nvmeof: {} contains a NUL byte", p.display())))
}

fn mount_ext4(device: &Path, dir: &Path) -> Result<()> {
    let (src, target) = (cstring(device)?, cstring(dir)?);
    let what = format!("nvmeof: mount {} on {}", device.display(), dir.display());
    bounded(&what.clone(), STEP_TIMEOUT, move || {
        let flags = libc::MS_NOATIME | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        // SAFETY: NUL-terminated strings that outlive the call; no data argument.
        let r = unsafe {
            libc::mount(src.as_ptr(), target.as_ptr(), c"ext4".as_ptr(), flags, std::ptr::null())
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        let why = match e.raw_os_error() {
            Some(libc::EPERM) | Some(libc::EACCES) => {
                "mounting needs root (CAP_SYS_ADMIN)".to_string()
            }
            Some(libc::ENODEV) => "the kernel has no ext4 module (modprobe ext4)".into(),
            Some(libc::EINVAL) | Some(libc::EUCLEAN) | Some(libc::EIO) => {
                format!(
                    "the ext4 file system does not mount ({e}); the kernel log says why (e2fsck it?)"
                )
            }
            _ => e.to_string(),
        };
        Err(Error::new(ErrorKind::Unavailable, format!("{what}: {why}")))
    })
}

/// Unmount `dir`, retrying while busy for up to [`UNMOUNT_BUSY_WAIT`].
fn unmount(dir: &Path) -> Result<()> {
    let target = cstring(dir)?;
    let what = format!("nvmeof: unmount {}", dir.display());
    bounded(&what.clone(), STEP_TIMEOUT + UNMOUNT_BUSY_WAIT, move || {
        let deadline = Instant::now() + UNMOUNT_BUSY_WAIT;
        loop {
            // SAFETY: a NUL-terminated path that outlives the call.
            if unsafe { libc::umount2(target.as_ptr(), 0) } == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EBUSY) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Some(libc::EBUSY) => {
                    return Err(Error::new(
                        ErrorKind::Busy,
                        format!(
                            "{what}: still busy after {} s (a process has files open there)",
                            UNMOUNT_BUSY_WAIT.as_secs()
                        ),
                    ));
                }
                _ => return Err(Error::io(what.clone(), e)),
            }
        }
    })
}

/// Make sure `dir` is a mount of `device` (numbers `dev`): adopt an existing mount there,
/// refuse one elsewhere, refuse a non-empty directory, probe and (with `format`) format.
fn mount_namespace(
    sys: &Sys,
    spec: &NvmeofSpec,
    device: &Path,
    dev: (u32, u32),
    dir: &Path,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("nvmeof: create {}", dir.display()), e))?;
    let dir = std::fs::canonicalize(dir)
        .map_err(|e| Error::io(format!("nvmeof: resolve {}", dir.display()), e))?;
    let all = mounts(sys)?;
    if let Some(m) = all.iter().find(|m| m.dev == dev) {
        if all.iter().filter(|m| m.dev == dev).all(|m| m.point == dir) {
            tracing::info!(device = %device.display(), dir = %dir.display(), "already mounted there; adopting the mount");
            return Ok(());
        }
        return Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "nvmeof: {} ({spec}) is already mounted at {}; the NVMe tier needs it to itself",
                device.display(),
                m.point.display()
            ),
        ));
    }
    if let Some(m) = all.iter().rev().find(|m| m.point == dir) {
        return Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "nvmeof: {} is already a mount point (device {}:{}), not of {}",
                dir.display(),
                m.dev.0,
                m.dev.1,
                device.display()
            ),
        ));
    }
    let non_empty = std::fs::read_dir(&dir)
        .map_err(|e| Error::io(format!("nvmeof: read {}", dir.display()), e))?
        .next()
        .is_some();
    if non_empty {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "nvmeof: {} is not empty (a local NVMe tier's files?): mounting the namespace there would hide them; move them away or use another data directory",
                dir.display()
            ),
        ));
    }
    match probe(device)? {
        Content::Ext4 => {}
        Content::Blank if spec.format => format_ext4(device)?,
        Content::Blank => {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "nvmeof: {} ({spec}) is blank (no file system): add `format` to --nvmeof to make an ext4 file system on it",
                    device.display()
                ),
            ));
        }
        Content::Other(at) => {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "nvmeof: {} ({spec}) holds data that is not an ext4 file system (first non-zero byte at offset {at}); kvfs formats only blank namespaces, even with `format`: erase it first (blkdiscard, or zero its first MiB) if its contents are not needed",
                    device.display()
                ),
            ));
        }
    }
    mount_ext4(device, &dir)
}

/// A remote namespace connected, its file system mounted on a directory; undone on drop.
#[derive(Debug)]
pub struct Attachment {
    sys: Sys,
    spec: NvmeofSpec,
    controller: Controller,
    device: PathBuf,
    dir: PathBuf,
    /// Set once detached or left: drop then does nothing.
    done: bool,
}

impl Attachment {
    /// Connect the namespace `spec` names, wait for its block device, and mount its ext4 file
    /// system on `dir` (created if missing; it must be empty or already this namespace's
    /// mount). Blocking (up to the spec's and this module's bounds): call it from a blocking
    /// thread in async code.
    pub fn attach(spec: &NvmeofSpec, dir: &Path) -> Result<Attachment> {
        Self::attach_with(Sys::default(), spec, dir)
    }

    fn attach_with(sys: Sys, spec: &NvmeofSpec, dir: &Path) -> Result<Attachment> {
        let (controller, fresh) = connect(&sys, spec)?;
        let mut a = Attachment {
            sys,
            spec: spec.clone(),
            controller,
            device: PathBuf::new(),
            dir: dir.to_path_buf(),
            done: false,
        };
        // A failure from here on undoes the connect, but only one made here: an adopted
        // controller may be serving a mount elsewhere (which is why this attach fails).
        let (device, numbers) = match wait_for_device(&a.sys, &a.controller, spec) {
            Ok(d) => d,
            Err(e) => {
                a.abandon(fresh);
                return Err(e);
            }
        };
        a.device = device;
        if let Err(e) = mount_namespace(&a.sys, spec, &a.device, numbers, dir) {
            a.abandon(fresh);
            return Err(e);
        }
        a.dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        tracing::info!(controller = %a.controller.name(), device = %a.device.display(),
            dir = %a.dir.display(), %spec, "NVMe-oF namespace attached");
        Ok(a)
    }

    /// Give up a failed attach: disconnect (nothing was mounted) if the controller was
    /// connected here.
    fn abandon(&mut self, connected_here: bool) {
        self.done = true;
        if !connected_here {
            return;
        }
        if let Err(e) = delete_controller(&self.sys, &self.controller, &self.spec) {
            tracing::error!(error = %e, "could not disconnect after a failed attach");
        }
    }

    /// The namespace's block device (`/dev/nvmeXnY`).
    pub fn device(&self) -> &Path {
        &self.device
    }

    /// The controller's name (`nvmeN`).
    pub fn controller(&self) -> String {
        self.controller.name()
    }

    /// Where the file system is mounted.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A capacity for the NVMe tier: [`CAPACITY_SHARE`] of the file system's data blocks.
    pub fn capacity_bytes(&self) -> Result<u64> {
        let p = cstring(&self.dir)?;
        // SAFETY: statvfs fills the zeroed struct we own; the path outlives the call.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::statvfs(p.as_ptr(), &mut st) } != 0 {
            return Err(Error::io(
                format!("nvmeof: statvfs {}", self.dir.display()),
                std::io::Error::last_os_error(),
            ));
        }
        #[allow(clippy::unnecessary_cast)] // u64 on 64-bit Linux, narrower elsewhere
        let bytes = st.f_blocks as u64 * st.f_frsize as u64;
        Ok((bytes as f64 * CAPACITY_SHARE) as u64)
    }

    /// Unmount (retrying while busy, bounded) and disconnect. On an unmount failure the
    /// controller stays connected (pulling the device from under a mounted file system would
    /// lose its dirty state) and the error says so.
    pub fn detach(mut self) -> Result<()> {
        self.detach_inner()
    }

    fn detach_inner(&mut self) -> Result<()> {
        self.done = true;
        unmount(&self.dir).map_err(|e| {
            e.context(format!("controller {} left connected", self.controller.name()))
        })?;
        delete_controller(&self.sys, &self.controller, &self.spec)?;
        tracing::info!(controller = %self.controller.name(), spec = %self.spec, "NVMe-oF namespace detached");
        Ok(())
    }

    /// Keep the namespace connected and mounted after this attachment is gone (for another
    /// process; [`detach_existing`] undoes it).
    pub fn leave(mut self) {
        self.done = true;
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        if !self.done
            && let Err(e) = self.detach_inner()
        {
            tracing::error!(error = %e, "could not detach the NVMe-oF namespace");
        }
    }
}

/// What [`detach_existing`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DetachReport {
    pub unmounted: bool,
    /// The controllers deleted (`nvmeN`).
    pub disconnected: Vec<String>,
}

/// Undo an attachment made by another process ([`Attachment::leave`]): unmount `dir` if it is
/// a mount of `spec`'s namespace, then delete the controllers connected to `spec`'s subsystem
/// at its address. Nothing attached is not an error (an empty report).
pub fn detach_existing(spec: &NvmeofSpec, dir: &Path) -> Result<DetachReport> {
    detach_existing_with(&Sys::default(), spec, dir)
}

fn detach_existing_with(sys: &Sys, spec: &NvmeofSpec, dir: &Path) -> Result<DetachReport> {
    let mut report = DetachReport::default();
    let controllers = find_controllers(sys, spec);
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let all = mounts(sys)?;
    for c in &controllers {
        let (Some(name), _) = find_namespace(sys, c, spec.nsid) else { continue };
        let Some(dev) = sys_dev_numbers(sys, &name) else { continue };
        if let Some(m) = all.iter().find(|m| m.dev == dev && m.point != dir) {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "nvmeof: {name} ({spec}) is mounted at {}, not {}; not detaching it",
                    m.point.display(),
                    dir.display()
                ),
            ));
        }
        if all.iter().any(|m| m.dev == dev && m.point == dir) {
            unmount(&dir)
                .map_err(|e| e.context(format!("controller {} left connected", c.name())))?;
            report.unmounted = true;
        }
    }
    for c in &controllers {
        delete_controller(sys, c, spec)?;
        report.disconnected.push(c.name());
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> NvmeofSpec {
        NvmeofSpec::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn err(s: &str) -> String {
        let e = NvmeofSpec::parse(s).expect_err(s);
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{s}: {e}");
        e.to_string()
    }

    const BASE: &str = "transport=tcp,traddr=127.0.0.1,trsvcid=4420,nqn=nqn.2026-12.io.kvfs:t";

    #[test]
    fn specs_parse_with_defaults_and_pass_kernel_options_through() {
        let s = spec(BASE);
        assert_eq!(s.traddr, "127.0.0.1".parse::<IpAddr>().unwrap());
        assert_eq!((s.trsvcid, s.nsid, s.format), (4420, 1, false));
        assert_eq!(s.connect_options(), BASE);
        let s = spec(
            "nqn=nqn.x, transport=tcp,traddr=::1,format,nsid=3,hostnqn=nqn.h,ctrl_loss_tmo=-1,nr_io_queues=2,connect_timeout_ms=500",
        );
        assert_eq!((s.trsvcid, s.nsid, s.format, s.connect_timeout_ms), (4420, 3, true, 500));
        assert_eq!(
            s.connect_options(),
            "transport=tcp,traddr=::1,trsvcid=4420,nqn=nqn.x,hostnqn=nqn.h,ctrl_loss_tmo=-1,nr_io_queues=2"
        );
        assert_eq!(s.to_string(), "nqn.x namespace 3 at tcp [::1]:4420");
        assert_eq!(
            "transport=tcp,traddr=10.0.0.1,nqn=n".parse::<NvmeofSpec>().unwrap().trsvcid,
            4420
        );
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        assert!(err("").contains("empty item"));
        assert!(err("traddr=1.2.3.4,nqn=n").contains("transport= is required"));
        assert!(err("transport=rdma,traddr=1.2.3.4,nqn=n").contains("tcp only"));
        assert!(err("transport=tcp,nqn=n").contains("traddr= is required"));
        assert!(err("transport=tcp,traddr=host.example,nqn=n").contains("resolves no host names"));
        assert!(err("transport=tcp,traddr=1.2.3.4").contains("nqn= is required"));
        assert!(err("transport=tcp,traddr=1.2.3.4,nqn=").contains("nqn= is required"));
        assert!(
            err(&format!("transport=tcp,traddr=1.2.3.4,nqn={}", "n".repeat(224))).contains("223")
        );
        assert!(err("transport=tcp,traddr=1.2.3.4,nqn=a b").contains("contains ' '"));
        assert!(err(&format!("{BASE},trsvcid=0")).contains("given twice"));
        assert!(err("transport=tcp,traddr=1.2.3.4,nqn=n,trsvcid=70000").contains("not a port"));
        assert!(err("transport=tcp,traddr=1.2.3.4,nqn=n,nsid=0").contains("namespace id"));
        assert!(err(&format!("{BASE},format=yes")).contains("takes no value"));
        assert!(err(&format!("{BASE},,format")).contains("empty item"));
        assert!(err(&format!("{BASE},bogus=1")).contains("unknown option \"bogus\""));
        assert!(err(&format!("{BASE},hostid=xyz")).contains("not a UUID"));
        assert!(err(&format!("{BASE},ctrl_loss_tmo=-2")).contains("seconds"));
        assert!(err(&format!("{BASE},host_traddr=eth0")).contains("not an IP"));
        assert!(err(&format!("{BASE},connect_timeout_ms=0")).contains("positive"));
        spec(&format!("{BASE},hostid=0f0e0d0c-0b0a-0908-0706-050403020100,host_iface=eth0"));
    }

    /// A fake root for the kernel's files, so the discovery logic runs without nvme modules.
    struct FakeSys {
        root: tempfile::TempDir,
        sys: Sys,
    }

    impl FakeSys {
        fn new() -> FakeSys {
            let root = tempfile::tempdir().unwrap();
            let p = root.path();
            let sys = Sys {
                fabrics: p.join("dev/nvme-fabrics"),
                class_nvme: p.join("class/nvme"),
                dev: p.join("dev"),
                sys_block: p.join("block"),
                mountinfo: p.join("mountinfo"),
            };
            for d in [&sys.class_nvme, &sys.dev, &sys.sys_block] {
                std::fs::create_dir_all(d).unwrap();
            }
            std::fs::write(&sys.mountinfo, "").unwrap();
            FakeSys { root, sys }
        }

        fn controller(&self, instance: u32, nqn: &str, address: &str, state: &str) {
            let d = self.sys.class_nvme.join(format!("nvme{instance}"));
            std::fs::create_dir_all(&d).unwrap();
            for (f, v) in [
                ("transport", "tcp"),
                ("subsysnqn", nqn),
                ("address", address),
                ("state", state),
                ("delete_controller", ""),
            ] {
                std::fs::write(d.join(f), format!("{v}\n")).unwrap();
            }
        }

        fn namespace(&self, instance: u32, entry: &str, nsid: u32, dev: &str, numbers: &str) {
            let d = self.sys.class_nvme.join(format!("nvme{instance}")).join(entry);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("nsid"), format!("{nsid}\n")).unwrap();
            let b = self.sys.sys_block.join(dev);
            std::fs::create_dir_all(&b).unwrap();
            std::fs::write(b.join("dev"), format!("{numbers}\n")).unwrap();
        }
    }

    #[test]
    fn no_fabrics_device_is_a_clear_error() {
        let fx = FakeSys::new();
        let e = fabrics_connect(&fx.sys, &spec(BASE)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unavailable);
        assert!(e.to_string().contains("the kernel has no nvme-fabrics module"), "{e}");
        // And through the whole attach, with nothing left behind.
        let dir = fx.root.path().join("mnt");
        let e = Attachment::attach_with(fx.sys.clone(), &spec(BASE), &dir).unwrap_err();
        assert!(e.to_string().contains("no nvme-fabrics module"), "{e}");
        assert!(!dir.exists(), "nothing made before the connect");
    }

    /// The host running the unit tests has no nvme-fabrics module: the real path says so.
    #[test]
    fn the_real_attach_fails_clearly_without_the_module() {
        if Path::new("/dev/nvme-fabrics").exists() {
            return; // a host with the module: covered by scripts/test-nvmeof
        }
        let dir = tempfile::tempdir().unwrap();
        let e = Attachment::attach(&spec(BASE), &dir.path().join("m")).unwrap_err();
        assert!(e.to_string().contains("the kernel has no nvme-fabrics module"), "{e}");
        let r = detach_existing(&spec(BASE), dir.path()).unwrap();
        assert_eq!(r, DetachReport::default(), "nothing attached, nothing done");
    }

    #[test]
    fn connect_answers_parse() {
        assert_eq!(parse_connect_answer("instance=3,cntlid=1\n"), Some(Controller { instance: 3 }));
        assert_eq!(parse_connect_answer("cntlid=1"), None);
        assert_eq!(parse_connect_answer("instance=x"), None);
    }

    #[test]
    fn namespace_entries_name_their_block_device() {
        assert_eq!(namespace_entry("nvme0n1").as_deref(), Some("nvme0n1"));
        assert_eq!(namespace_entry("nvme2c5n13").as_deref(), Some("nvme2n13"));
        for not in
            ["nvme0", "nvme0c1", "nvmen1", "nvme0cn1", "nvme0n", "ng0n1", "nvme0n1p1", "power"]
        {
            assert_eq!(namespace_entry(not), None, "{not}");
        }
    }

    #[test]
    fn controllers_match_subsystem_and_address() {
        let fx = FakeSys::new();
        let s = spec(BASE);
        fx.controller(0, "nqn.other", "traddr=127.0.0.1,trsvcid=4420", "live");
        fx.controller(1, "nqn.2026-12.io.kvfs:t", "traddr=127.0.0.1,trsvcid=4421", "live");
        fx.controller(
            2,
            "nqn.2026-12.io.kvfs:t",
            "traddr=127.0.0.1,trsvcid=4420,src_addr=127.0.0.1",
            "live",
        );
        std::fs::create_dir_all(fx.sys.class_nvme.join("nvme-fabrics")).unwrap();
        assert_eq!(find_controllers(&fx.sys, &s), vec![Controller { instance: 2 }]);
        // A live one is adopted rather than connected again.
        assert_eq!(connect(&fx.sys, &s).unwrap(), (Controller { instance: 2 }, false));
        // One that never becomes live is a timeout naming its state.
        fx.controller(2, "nqn.2026-12.io.kvfs:t", "traddr=127.0.0.1,trsvcid=4420", "connecting");
        let e = connect(&fx.sys, &spec(&format!("{BASE},connect_timeout_ms=100"))).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.to_string().contains("nvme2 is connected but connecting"), "{e}");
        let v6 = spec("transport=tcp,traddr=fd00::1,nqn=n6");
        fx.controller(7, "n6", "traddr=fd00:0:0:0:0:0:0:1,trsvcid=4420", "live");
        assert_eq!(find_controllers(&fx.sys, &v6), vec![Controller { instance: 7 }]);
    }

    #[test]
    fn namespaces_are_found_with_and_without_multipath() {
        let fx = FakeSys::new();
        let c = Controller { instance: 4 };
        fx.controller(4, "n", "traddr=127.0.0.1,trsvcid=4420", "live");
        fx.namespace(4, "nvme1c4n1", 1, "nvme1n1", "259:1");
        fx.namespace(4, "nvme1c4n2", 5, "nvme1n2", "259:2");
        assert_eq!(find_namespace(&fx.sys, &c, 5), (Some("nvme1n2".into()), vec![1, 5]));
        assert_eq!(find_namespace(&fx.sys, &c, 2), (None, vec![1, 5]));
        let s = spec("transport=tcp,traddr=127.0.0.1,nqn=n,nsid=2,device_wait_ms=60");
        let e = wait_for_device(&fx.sys, &c, &s).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.to_string().contains("shows namespaces [1, 5] but not 2"), "{e}");
        // Namespace 1 is in sysfs but has no /dev node (a regular file is not one either).
        std::fs::write(fx.sys.dev.join("nvme1n1"), "").unwrap();
        let s = spec("transport=tcp,traddr=127.0.0.1,nqn=n,device_wait_ms=60");
        let e = wait_for_device(&fx.sys, &c, &s).unwrap_err();
        assert!(e.to_string().contains("did not appear as a block device"), "{e}");
        let empty = Controller { instance: 9 };
        fx.controller(9, "n", "traddr=127.0.0.1,trsvcid=4420", "live");
        let e = wait_for_device(&fx.sys, &empty, &s).unwrap_err();
        assert!(e.to_string().contains("shows no namespace"), "{e}");
    }

    #[test]
    fn mountinfo_parses_numbers_and_escaped_points() {
        let text = "36 35 98:0 / /mnt/a\\040b rw,noatime shared:1 - ext4 /dev/x rw\n\
                    37 35 259:1 / /var/kvfs/nvme rw - ext4 /dev/nvme0n1 rw\nbroken line\n";
        assert_eq!(
            parse_mountinfo(text),
            vec![
                MountEntry { dev: (98, 0), point: "/mnt/a b".into() },
                MountEntry { dev: (259, 1), point: "/var/kvfs/nvme".into() },
            ]
        );
    }

    #[test]
    fn content_is_classified() {
        let mut head = vec![0u8; 4096];
        assert_eq!(classify(&head), Content::Blank);
        head[EXT_MAGIC_OFFSET] = 0x53;
        head[EXT_MAGIC_OFFSET + 1] = 0xEF;
        assert_eq!(classify(&head), Content::Ext4);
        let mut xfs = vec![0u8; 4096];
        xfs[..4].copy_from_slice(b"XFSB");
        assert_eq!(classify(&xfs), Content::Other(0));
        assert_eq!(classify(&[]), Content::Blank);
    }

    #[test]
    fn mounting_refuses_a_mount_elsewhere_and_a_non_empty_directory() {
        let fx = FakeSys::new();
        let s = spec(BASE);
        let dir = fx.root.path().join("tier");
        std::fs::write(&fx.sys.mountinfo, "40 1 259:1 / /elsewhere rw - ext4 /dev/nvme0n1 rw\n")
            .unwrap();
        let e =
            mount_namespace(&fx.sys, &s, Path::new("/dev/nvme0n1"), (259, 1), &dir).unwrap_err();
        assert!(e.to_string().contains("already mounted at /elsewhere"), "{e}");
        std::fs::write(&fx.sys.mountinfo, "").unwrap();
        std::fs::write(dir.join("objects"), "x").unwrap();
        let e =
            mount_namespace(&fx.sys, &s, Path::new("/dev/nvme0n1"), (259, 1), &dir).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("is not empty"), "{e}");
        // Already mounted on that very directory (a process that died): adopted.
        let canon = std::fs::canonicalize(&dir).unwrap();
        std::fs::write(
            &fx.sys.mountinfo,
            format!("40 1 259:1 / {} rw - ext4 /dev/nvme0n1 rw\n", canon.display()),
        )
        .unwrap();
        mount_namespace(&fx.sys, &s, Path::new("/dev/nvme0n1"), (259, 1), &dir).unwrap();
    }

    /// Any block device of this machine, to stand in for a namespace's /dev node.
    fn some_block_device() -> Option<(PathBuf, (u32, u32))> {
        std::fs::read_dir("/dev").ok()?.flatten().find_map(|e| {
            let md = e.metadata().ok()?;
            md.file_type()
                .is_block_device()
                .then(|| (e.path(), (libc::major(md.rdev()), libc::minor(md.rdev()))))
        })
    }

    #[test]
    fn a_failed_attach_leaves_an_adopted_controller_connected() {
        let Some((blk, (maj, min))) = some_block_device() else {
            eprintln!("skipped: no block device in /dev to stand in for a namespace");
            return;
        };
        let fx = FakeSys::new();
        fx.controller(3, "nqn.2026-12.io.kvfs:t", "traddr=127.0.0.1,trsvcid=4420", "live");
        fx.namespace(3, "nvme0c3n1", 1, "nvme0n1", &format!("{maj}:{min}"));
        std::os::unix::fs::symlink(&blk, fx.sys.dev.join("nvme0n1")).unwrap();
        std::fs::write(
            &fx.sys.mountinfo,
            format!(
                "40 1 {maj}:{min} / /elsewhere rw - ext4 x rw
"
            ),
        )
        .unwrap();
        let e = Attachment::attach_with(fx.sys.clone(), &spec(BASE), &fx.root.path().join("m"))
            .unwrap_err();
        assert!(e.to_string().contains("already mounted at /elsewhere"), "{e}");
        let written = std::fs::read_to_string(fx.sys.class_nvme.join("nvme3/delete_controller"));
        assert_eq!(written.unwrap(), "\n", "the adopted controller was not deleted");
    }

    #[test]
    fn bounded_steps_time_out() {
        let e = bounded("a stuck step", Duration::from_millis(20), || {
            std::thread::sleep(Duration::from_millis(500));
            Ok(())
        })
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        assert!(e.to_string().contains("a stuck step did not finish within 20 ms"), "{e}");
        assert_eq!(bounded("quick", Duration::from_secs(5), || Ok(7)).unwrap(), 7);
    }
}
