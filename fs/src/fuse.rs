//! The `fuser::Filesystem` implementation: each kernel request is answered from a task on the
//! daemon's tokio runtime, so no FUSE worker thread ever waits on the network; every task is
//! bounded by the operation timeout (`ETIMEDOUT`). The operations themselves live in
//! [`crate::state`], [`crate::read`], [`crate::write`], [`crate::dir`] and
//! [`crate::fastpath`]; this file only unpacks requests and packs replies.

use std::ffi::OsStr;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use fuser::{
    Errno, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    IoctlFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyOpen,
    ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use kvfs_fs_abi as abi;

use crate::inode::{self, Kind, ObjAttr};
use crate::read::{OpenPlan, ReadHandle};
use crate::state::{Found, Handle, Inner, JOBS_DIR, STATUS_FILES, bump, lock};
use crate::{errno, procfs};

pub struct KvFs {
    pub inner: Arc<Inner>,
    pub rt: tokio::runtime::Handle,
}

fn err(e: i32) -> Errno {
    Errno::from_i32(e)
}

impl KvFs {
    /// Runs `f` on the runtime, bounded by the operation timeout.
    fn spawn<T, F, R>(&self, f: impl FnOnce(Arc<Inner>) -> F + Send + 'static, reply: R)
    where
        T: Send + 'static,
        F: Future<Output = Result<T, i32>> + Send + 'static,
        R: FnOnce(Result<T, i32>) + Send + 'static,
    {
        let inner = self.inner.clone();
        let limit = Duration::from_millis(inner.cfg.op_timeout_ms);
        self.rt.spawn(async move {
            let r = tokio::time::timeout(limit, f(inner)).await.unwrap_or(Err(libc::ETIMEDOUT));
            reply(r);
        });
    }

    fn handle(&self, fh: FileHandle) -> Option<HandleRef> {
        lock(&self.inner.handles).get(&fh.0).map(|h| match h {
            Handle::Dir(d) => HandleRef::Dir(d.clone()),
            Handle::Read(r) => HandleRef::Read(r.clone()),
            Handle::Passthrough { .. } => HandleRef::Passthrough,
            Handle::Write(w) => HandleRef::Write(w.clone()),
            Handle::Text { text, .. } => HandleRef::Text(text.clone()),
            Handle::Jobs(ids) => HandleRef::Jobs(ids.clone()),
        })
    }
}

enum HandleRef {
    Dir(Arc<tokio::sync::Mutex<crate::dir::DirStream>>),
    Read(Arc<ReadHandle>),
    Passthrough,
    Write(Arc<tokio::sync::Mutex<crate::write::Writer>>),
    Text(Arc<Vec<u8>>),
    Jobs(Arc<Vec<u64>>),
}

fn ttl_of(inner: &Inner, f: &Found) -> Duration {
    match f {
        // A file being written changes size with every write.
        Found::Object { pending: true, .. } => Duration::ZERO,
        _ => inner.entry_ttl(),
    }
}

fn is_kvfs_xattr(name: &OsStr) -> bool {
    name.as_encoded_bytes().starts_with(b"user.kvfs.")
}

fn reply_xattr(reply: ReplyXattr, size: u32, v: Result<Vec<u8>, i32>) {
    match v {
        Ok(v) if size == 0 => reply.size(v.len() as u32),
        Ok(v) if v.len() > size as usize => reply.error(Errno::ERANGE),
        Ok(v) => reply.data(&v),
        Err(e) => reply.error(err(e)),
    }
}

impl Filesystem for KvFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_readahead(u32::MAX) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // No FUSE_ATOMIC_O_TRUNC: with it the kernel zeroes the size of the inode readers of
        // the old object share at open(O_TRUNC); without it the truncation is a setattr whose
        // answer (the old object's size) the kernel keeps until the replacement commits.
        if self.inner.cfg.passthrough.is_some() {
            let ok = config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                && config.set_max_stack_depth(1).is_ok();
            if !ok {
                tracing::warn!(
                    "the kernel offers no FUSE passthrough; objects in local files are read through the daemon"
                );
                self.inner.passthrough_works.store(false, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name.to_os_string();
        self.spawn(
            move |inner| async move {
                let f = inner.resolve(parent.0, &name).await?;
                let (_, attr) = inner.remember(&f);
                Ok((attr, ttl_of(&inner, &f)))
            },
            move |r| match r {
                Ok((attr, ttl)) => reply.entry(&ttl, &attr, Generation(0)),
                Err(e) => reply.error(err(e)),
            },
        );
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        lock(&self.inner.table).forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.spawn(
            move |inner| async move {
                let attr = inner.getattr(ino.0).await?;
                let ttl = if attr.perm == 0o644 { Duration::ZERO } else { inner.entry_ttl() };
                Ok((attr, ttl))
            },
            move |r| match r {
                Ok((attr, ttl)) => reply.attr(&ttl, &attr),
                Err(e) => reply.error(err(e)),
            },
        );
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let writer = match fh.and_then(|fh| self.handle(fh)) {
            Some(HandleRef::Write(w)) => Some(w),
            _ => None,
        };
        let changes =
            mode.is_some() || uid.is_some() || gid.is_some() || atime.is_some() || mtime.is_some();
        self.spawn(
            move |inner| async move {
                match inner.kind_of(ino.0)? {
                    // Directories are implicit: mode and times are not kept.
                    Kind::Dir(_) | Kind::ControlDir | Kind::JobsDir => {
                        return Ok(inner.dir_attr(ino.0));
                    }
                    Kind::Object { key } => {
                        // A file being written takes truncation; its mode, owner and times
                        // are accepted and not kept (the object gets 0444 and its put time).
                        if let Some(w) = writer {
                            let mut w = w.lock().await;
                            if !w.is_open() && (changes || size.is_some()) {
                                return Err(libc::EPERM);
                            }
                            if let Some(len) = size {
                                inner.truncate_staged(&mut w, len)?;
                            }
                            if let Some(old) = w.replacing() {
                                // Readers share this inode until the commit: its size stays
                                // the old object's.
                                return Ok(inner.obj_attr(ino.0, old, false));
                            }
                            if w.is_open() {
                                let a = ObjAttr { size: w.staged_len(), version: 0 };
                                return Ok(inner.obj_attr(ino.0, a, true));
                            }
                        } else if let (Some(0), Some(w)) = (size, inner.untruncated_writer(ino.0)) {
                            // open(O_TRUNC) of an existing object: the kernel's truncation
                            // comes without a handle; it starts the replacement.
                            let mut w = w.lock().await;
                            inner.truncate_staged(&mut w, 0)?;
                            if let Some(old) = w.replacing() {
                                return Ok(inner.obj_attr(ino.0, old, false));
                            }
                        } else if let Some(w) = inner.writer_of(&key) {
                            let mut w = w.lock().await;
                            if let Some(len) = size {
                                inner.truncate_staged(&mut w, len)?;
                            }
                        } else if changes || size.is_some() {
                            // Objects are immutable.
                            return Err(libc::EPERM);
                        }
                    }
                    _ if changes || size.is_some() => return Err(libc::EPERM),
                    _ => {}
                }
                inner.getattr(ino.0).await
            },
            move |r| match r {
                Ok(attr) => reply.attr(&Duration::ZERO, &attr),
                Err(e) => reply.error(err(e)),
            },
        );
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EPERM);
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let name = name.to_os_string();
        self.spawn(
            move |inner| async move {
                let f = inner.mkdir(parent.0, &name).await?;
                Ok(inner.remember(&f).1)
            },
            move |r| match r {
                Ok(attr) => reply.entry(&Duration::ZERO, &attr, Generation(0)),
                Err(e) => reply.error(err(e)),
            },
        );
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name.to_os_string();
        self.spawn(
            move |inner| async move { inner.unlink(parent.0, &name).await },
            answer_empty(reply),
        );
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name.to_os_string();
        self.spawn(
            move |inner| async move { inner.rmdir(parent.0, &name).await },
            answer_empty(reply),
        );
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let (name, newname) = (name.to_os_string(), newname.to_os_string());
        self.spawn(
            move |inner| async move {
                inner.rename(parent.0, &name, newparent.0, &newname, flags.bits()).await
            },
            answer_empty(reply),
        );
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EPERM);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        // Without atomic O_TRUNC the kernel strips the flag and truncates with a setattr.
        let trunc = flags.0 & libc::O_TRUNC != 0;
        let write = flags.acc_mode() != OpenAccMode::O_RDONLY || trunc;
        let replace = flags.acc_mode() == OpenAccMode::O_WRONLY && flags.0 & libc::O_APPEND == 0;
        let inner = self.inner.clone();
        self.spawn(
            move |inner| async move { inner.plan_open(ino.0, write, replace).await },
            move |r| match r {
                Ok(plan) => finish_open(&inner, ino.0, plan, reply),
                Err(e) => reply.error(err(e)),
            },
        );
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.handle(fh) {
            Some(HandleRef::Text(t)) => {
                let start = (offset as usize).min(t.len());
                let end = start.saturating_add(size as usize).min(t.len());
                reply.data(&t[start..end]);
            }
            Some(HandleRef::Read(h)) => self.spawn(
                move |inner| async move {
                    let f = inner.bytes(&h).await?;
                    bump(&inner.counters.reads, 1);
                    Ok((f, inner))
                },
                move |r| match r {
                    Ok((f, inner)) => {
                        let data = f.slice(offset, size);
                        bump(&inner.counters.read_bytes, data.len() as u64);
                        reply.data(data);
                    }
                    Err(e) => reply.error(err(e)),
                },
            ),
            Some(HandleRef::Write(w)) => self.spawn(
                move |inner| async move { Ok(inner.read_staged(&*w.lock().await, offset, size)) },
                move |r| match r {
                    Ok(d) => reply.data(&d),
                    Err(e) => reply.error(err(e)),
                },
            ),
            Some(HandleRef::Passthrough) => reply.error(Errno::EIO),
            Some(HandleRef::Dir(_) | HandleRef::Jobs(_)) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::EBADF),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(HandleRef::Write(w)) = self.handle(fh) else {
            // Every other handle is read-only: objects are immutable.
            reply.error(Errno::EBADF);
            return;
        };
        let data = data.to_vec();
        self.spawn(
            move |inner| async move { inner.write(&mut *w.lock().await, offset, &data) },
            move |r| match r {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(err(e)),
            },
        );
    }

    fn flush(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let Some(HandleRef::Write(w)) = self.handle(fh) else {
            reply.ok();
            return;
        };
        // A signal killed the closing process: the kernel is closing its files for it.
        let killed = procfs::killed_by_signal(req.pid());
        self.spawn(
            move |inner| async move {
                let mut w = w.lock().await;
                if killed {
                    inner.abort(&mut w, libc::ECANCELED);
                    return Ok(());
                }
                inner.commit(&mut w).await
            },
            answer_empty(reply),
        );
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let Some(h) = lock(&self.inner.handles).remove(&fh.0) else {
            reply.ok();
            return;
        };
        let inner = self.inner.clone();
        match h {
            Handle::Write(w) => self.spawn(
                move |inner| async move {
                    inner.abort(&mut *w.lock().await, libc::ECANCELED);
                    Ok(())
                },
                move |_: Result<(), i32>| {
                    lock(&inner.table).close(ino.0);
                    reply.ok()
                },
            ),
            Handle::Read(r) => {
                inner.close_cached(r.ino);
                lock(&inner.table).close(r.ino);
                reply.ok();
            }
            Handle::Passthrough { ino } => {
                lock(&inner.backings).release(ino);
                lock(&inner.table).close(ino);
                reply.ok();
            }
            Handle::Text { ino, .. } => {
                if ino == inode::CONTROL {
                    inner.fastpath.release_fh(fh.0);
                }
                reply.ok();
            }
            Handle::Dir(_) | Handle::Jobs(_) => reply.ok(),
        }
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let Some(HandleRef::Write(w)) = self.handle(fh) else {
            reply.ok();
            return;
        };
        self.spawn(
            move |inner| async move { inner.commit(&mut *w.lock().await).await },
            answer_empty(reply),
        );
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.inner.kind_of(ino.0) {
            Ok(Kind::Dir(d)) => {
                let s = crate::dir::DirStream::open(&self.inner, ino.0, d);
                let fh = self.inner.add_handle(Handle::Dir(Arc::new(tokio::sync::Mutex::new(s))));
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Ok(Kind::ControlDir) => reply.opened(FileHandle(0), FopenFlags::empty()),
            // The jobs as the master lists them now; readdir pages through this snapshot.
            Ok(Kind::JobsDir) => self.spawn(
                move |inner| async move {
                    let ids = crate::control::job_ids(&inner).await?;
                    Ok(inner.add_handle(Handle::Jobs(Arc::new(ids))))
                },
                move |r| match r {
                    Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
                    Err(e) => reply.error(err(e)),
                },
            ),
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(e) => reply.error(err(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino.0 == inode::CONTROL_DIR {
            let mut names = vec![
                (inode::CONTROL_DIR, FileType::Directory, ".".to_string()),
                (inode::ROOT, FileType::Directory, "..".to_string()),
                (inode::CONTROL, FileType::RegularFile, "control".to_string()),
            ];
            for (i, s) in STATUS_FILES.iter().enumerate() {
                names.push((inode::STATUS_FIRST + i as u64, FileType::RegularFile, s.to_string()));
            }
            names.push((inode::JOBS_DIR, FileType::Directory, JOBS_DIR.to_string()));
            reply_names(names, offset, reply);
            return;
        }
        let d = match self.handle(fh) {
            Some(HandleRef::Dir(d)) => d,
            Some(HandleRef::Jobs(ids)) => {
                let mut names = vec![
                    (inode::JOBS_DIR, FileType::Directory, ".".to_string()),
                    (inode::CONTROL_DIR, FileType::Directory, "..".to_string()),
                ];
                let t = lock(&self.inner.table);
                for &id in ids.iter() {
                    let ino = t.ino_of(&Kind::Job(id));
                    names.push((ino, FileType::RegularFile, crate::control::job_name(id)));
                }
                drop(t);
                reply_names(names, offset, reply);
                return;
            }
            _ => {
                reply.error(Errno::EBADF);
                return;
            }
        };
        let inner = self.inner.clone();
        let limit = Duration::from_millis(inner.cfg.op_timeout_ms);
        self.rt.spawn(async move {
            let mut d = d.lock().await;
            match tokio::time::timeout(limit, d.from(&inner, offset)).await {
                Ok(Ok(entries)) => {
                    for (i, e) in entries.iter().enumerate() {
                        if reply.add(INodeNo(e.ino.max(1)), offset + i as u64 + 1, e.kind, &e.name)
                        {
                            break;
                        }
                    }
                    reply.ok();
                }
                Ok(Err(e)) => reply.error(err(e)),
                Err(_) => reply.error(Errno::from_i32(libc::ETIMEDOUT)),
            }
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        lock(&self.inner.handles).remove(&fh.0);
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.spawn(
            move |inner| async move { inner.client.stats().await.map_err(|e| errno::of(&e)) },
            move |r| match r {
                Ok(s) => {
                    let (cap, used) = s
                        .tiers
                        .iter()
                        .filter(|t| t.tier != kvfs_client::Tier::ObjectStore)
                        .fold((0u64, 0u64), |(c, u), t| (c + t.capacity_bytes, u + t.used_bytes));
                    let free = cap.saturating_sub(used) / 4096;
                    // Objects are the files; there is no inode table to run out of.
                    let free_files = u64::from(u32::MAX);
                    reply.statfs(
                        cap / 4096,
                        free,
                        free,
                        s.objects + free_files,
                        free_files,
                        4096,
                        255,
                        4096,
                    );
                }
                Err(e) => reply.error(err(e)),
            },
        );
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        // A file being written has no attributes to keep (copying tools such as `mv` across
        // directories preserve xattrs and carry on past EOPNOTSUPP); an object's are computed.
        let pending = matches!(self.inner.kind_of(ino.0), Ok(Kind::Object { key })
            if lock(&self.inner.pending).contains_key(&key));
        reply.error(if is_kvfs_xattr(name) && !pending { Errno::EPERM } else { Errno::EOPNOTSUPP });
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if !is_kvfs_xattr(name) {
            reply.error(Errno::from_i32(libc::ENODATA));
            return;
        }
        let name = name.to_os_string();
        self.spawn(
            move |inner| async move { Ok(inner.getxattr(ino.0, &name).await) },
            move |r: Result<Result<Vec<u8>, i32>, i32>| reply_xattr(reply, size, r.and_then(|v| v)),
        );
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        reply_xattr(reply, size, self.inner.xattr_names(ino.0));
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply.error(if is_kvfs_xattr(name) { Errno::EPERM } else { Errno::EOPNOTSUPP });
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let name = name.to_os_string();
        self.spawn(
            move |inner| async move {
                let (f, ino, fh) = inner.create(parent.0, &name, flags).await?;
                Ok((inner.found_attr(ino, &f), fh))
            },
            move |r| match r {
                // Direct I/O: writes reach the daemon as they happen, and no page cache or
                // writable shared mapping holds bytes the commit would miss.
                Ok((attr, fh)) => reply.created(
                    &Duration::ZERO,
                    &attr,
                    Generation(0),
                    FileHandle(fh),
                    FopenFlags::FOPEN_DIRECT_IO,
                ),
                Err(e) => reply.error(err(e)),
            },
        );
    }

    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        if ino.0 != inode::CONTROL {
            reply.error(Errno::ENOTTY);
            return;
        }
        let tid = req.pid();
        let input = in_data.to_vec();
        let done = move |r: Result<Vec<u8>, i32>| match r {
            Ok(out) => reply.ioctl(0, &out),
            Err(e) => reply.error(err(e)),
        };
        match cmd {
            abi::IOC_INFO => done(Ok(self.inner.fastpath.info().to_bytes().to_vec())),
            abi::IOC_UNREGISTER => done(self.inner.fastpath.unregister(tid, &input)),
            abi::IOC_REGISTER => self.spawn(
                move |inner| async move {
                    let i = inner.clone();
                    // Mapping populates every page: off the async workers.
                    tokio::task::spawn_blocking(move || {
                        i.fastpath.register(tid, fh.0, &input, &i.counters)
                    })
                    .await
                    .unwrap_or(Err(libc::EIO))
                },
                done,
            ),
            abi::IOC_SUBMIT => self.spawn(
                move |inner| async move {
                    let put = inner.cfg.put.clone();
                    inner.fastpath.submit(tid, &input, &inner.client, &put, &inner.counters).await
                },
                done,
            ),
            _ => done(Err(libc::ENOTTY)),
        }
    }
}

/// Answers an open according to its plan (passthrough needs the reply to register the file).
fn finish_open(inner: &Arc<Inner>, ino: u64, plan: OpenPlan, reply: ReplyOpen) {
    match plan {
        OpenPlan::Text(text) => {
            let fh = inner.add_handle(Handle::Text { ino, text });
            reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
        }
        OpenPlan::Cached { handle, keep_cache } => {
            lock(&inner.table).open(ino);
            let fh = inner.add_handle(Handle::Read(handle));
            let flags = if keep_cache { FopenFlags::FOPEN_KEEP_CACHE } else { FopenFlags::empty() };
            reply.opened(FileHandle(fh), flags);
        }
        OpenPlan::Replace(w) => {
            lock(&inner.table).open(ino);
            let fh = inner.add_handle(Handle::Write(w));
            reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
        }
        OpenPlan::PassthroughReuse(id) => {
            lock(&inner.table).open(ino);
            let fh = inner.add_handle(Handle::Passthrough { ino });
            reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
        }
        OpenPlan::PassthroughNew { fd, key, attr } => {
            // One backing file per inode: decide under the lock so two opens agree.
            let mut backings = lock(&inner.backings);
            let id = match backings.reuse(ino) {
                Some(id) => Some(id),
                None => match reply.open_backing(&fd) {
                    Ok(id) => {
                        let id = Arc::new(id);
                        backings.insert(ino, id.clone());
                        Some(id)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the kernel refused a passthrough backing file; reading through the daemon");
                        inner.passthrough_works.store(false, Ordering::Relaxed);
                        None
                    }
                },
            };
            drop(backings);
            match id {
                Some(id) => {
                    lock(&inner.table).open(ino);
                    let fh = inner.add_handle(Handle::Passthrough { ino });
                    reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id);
                }
                None => {
                    *lock(&inner.cached_opens).entry(ino).or_insert(0) += 1;
                    let handle = Arc::new(ReadHandle::new(ino, key, attr));
                    finish_open(inner, ino, OpenPlan::Cached { handle, keep_cache: false }, reply);
                }
            }
        }
    }
}

/// Answers a readdir from a fixed list of entries, from index `offset` on.
fn reply_names(names: Vec<(u64, FileType, String)>, offset: u64, mut reply: ReplyDirectory) {
    for (i, (ino, kind, name)) in names.into_iter().enumerate().skip(offset as usize) {
        if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
            break;
        }
    }
    reply.ok();
}

/// The answer to a request whose success carries nothing.
fn answer_empty(reply: ReplyEmpty) -> impl FnOnce(Result<(), i32>) + Send + 'static {
    move |r| match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(err(e)),
    }
}
