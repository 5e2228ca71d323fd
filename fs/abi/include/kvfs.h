/*
 * kvfs.h — the kvfs fast path: ioctls on <mountpoint>/.kvfs/control.
 *
 * ABI version 1. Mirrors the Rust crate kvfs-fs-abi (fs/abi/src/lib.rs); a test compiles this
 * header with gcc and checks every size, offset and ioctl number against the crate.
 *
 * FUSE passes ioctls on regular files in restricted mode only: at most 16383 bytes in and out,
 * as the size field of the command says. So the ioctl carries descriptors, never object bytes:
 *
 *   1. Create a shared buffer: memfd_create(name, MFD_ALLOW_SEALING), ftruncate it, seal it
 *      with F_SEAL_SHRINK (the daemon maps it and must never be made to fault), mmap it.
 *      (/dev/shm files cannot be sealed and are refused with EPERM.)
 *   2. open("<mnt>/.kvfs/control", O_RDONLY) and ioctl(KVFS_IOC_REGISTER) with the memfd's fd:
 *      the daemon takes its own reference to the file (from the caller's fd table, so only the
 *      process that holds the fd can register it), maps it and returns a buffer id. Ids belong
 *      to the registering process and die with the control fd that registered them.
 *   3. Lay out an array of struct kvfs_item in the buffer (8-byte aligned), with the keys and
 *      the data areas it names anywhere in the same buffer, and ioctl(KVFS_IOC_SUBMIT): the
 *      ioctl is the doorbell; the daemon reads the items, moves the bytes straight between the
 *      pool and the buffer, writes each item's status and size, and returns.
 *
 * Whole-call errors are the ioctl's errno (-1/errno); per-item outcomes are in kvfs_item.status
 * (0 or a negative errno). Every input field is checked; see the errno tables below and in the
 * kvfs README.
 *
 * Ioctl errno (whole call):
 *   ENOTTY   unknown command, or an ioctl on a file other than .kvfs/control
 *   EPROTO   abi_version is not KVFS_ABI_VERSION
 *   EINVAL   a reserved or flags field is not 0; len 0; count 0; unknown op;
 *            items_offset not 8-byte aligned
 *   EBADF    register: fd is not open in the calling process;
 *            submit/unregister: no buffer has this id
 *   EPERM    register: the file is not sealed with F_SEAL_SHRINK;
 *            submit/unregister: the id belongs to another process
 *   ENODEV   register: fd is not a shared-memory file (memfd, tmpfs, hugetlbfs)
 *   EACCES   register: the file cannot be mapped for reading and writing
 *   ERANGE   register: len exceeds the file's size;
 *            submit: the item array does not lie inside the buffer
 *   EFBIG    register: len exceeds buffer_bytes_max
 *   EMFILE   register: the process has buffers_max buffers registered
 *   E2BIG    submit: count exceeds batch_items_max
 *   ESRCH    the calling process could not be identified (it is exiting)
 *   ETIMEDOUT the batch did not finish within the daemon's operation timeout
 *
 * Item status (negative errno):
 *   0           done (put: stored, or the key already existed: the first writer wins)
 *   -EINVAL     key_len 0, key not UTF-8, a reserved field not 0, put of 0 bytes
 *   -ENAMETOOLONG key_len exceeds key_bytes_max
 *   -ERANGE     the key or data range does not lie inside the buffer
 *   -ENOENT     get: no such object
 *   -EOVERFLOW  get: the object is larger than data_len (size holds its size)
 *   -ENOSPC     put: the pool has no room
 *   -EFBIG      put: larger than the pool's largest object
 *   -EAGAIN     put: another writer is putting the key, or the master is recovering
 *   -ENOTCONN   the master cannot be reached
 *   -EIO        moving the bytes failed on every replica
 *   -EBADMSG    the bytes read do not match the object's checksum
 *   -ETIMEDOUT  the batch timed out
 */
#ifndef KVFS_H
#define KVFS_H

#include <stdint.h>
#include <linux/ioctl.h>

#define KVFS_ABI_VERSION 1u
#define KVFS_IOC_MAGIC 'K'

/* Path of the control file under the mount point. */
#define KVFS_CONTROL_PATH ".kvfs/control"

#define KVFS_OP_GET 1u
#define KVFS_OP_PUT 2u

/* KVFS_IOC_INFO: the daemon's ABI version and limits. All fields are out. */
struct kvfs_info {
	uint32_t abi_version;
	uint32_t batch_items_max;
	uint32_t key_bytes_max;
	uint32_t buffers_max;      /* per process */
	uint64_t buffer_bytes_max; /* per buffer */
	uint64_t item_size;        /* sizeof(struct kvfs_item) */
	uint64_t reserved[4];
};

/* KVFS_IOC_REGISTER: register [0, len) of a sealed memfd held by the caller. */
struct kvfs_register {
	uint32_t abi_version; /* in */
	int32_t fd;           /* in: a descriptor in the caller's own table */
	uint64_t len;         /* in: bytes to register, from offset 0 */
	uint64_t flags;       /* in: 0 */
	uint64_t buffer_id;   /* out */
	uint64_t reserved[2]; /* in: 0 */
};

/* KVFS_IOC_UNREGISTER: forget a buffer (the daemon unmaps it once no batch uses it). */
struct kvfs_unregister {
	uint32_t abi_version; /* in */
	uint32_t reserved;    /* in: 0 */
	uint64_t buffer_id;   /* in */
};

/* KVFS_IOC_SUBMIT: run `count` items laid out at items_offset in the buffer. */
struct kvfs_submit {
	uint32_t abi_version;  /* in */
	uint32_t op;           /* in: KVFS_OP_GET or KVFS_OP_PUT */
	uint64_t buffer_id;    /* in */
	uint64_t items_offset; /* in: 8-byte aligned offset of the struct kvfs_item array */
	uint32_t count;        /* in: 1..=batch_items_max */
	uint32_t flags;        /* in: 0 */
	uint32_t ok;           /* out: items with status 0 */
	uint32_t failed;       /* out: items with a negative status */
	uint64_t reserved[2];  /* in: 0 */
};

/* One item, in the registered buffer. */
struct kvfs_item {
	uint64_t key_offset;  /* in: the key's bytes (UTF-8, no terminator) in the buffer */
	uint32_t key_len;     /* in */
	uint32_t flags;       /* in: 0 */
	uint64_t data_offset; /* in */
	uint64_t data_len;    /* in: get: capacity; put: the object's size */
	uint64_t size;        /* out: get: the object's size; put: bytes stored */
	int32_t status;       /* out: 0 or a negative errno */
	uint32_t reserved;    /* in: 0 */
};

#define KVFS_IOC_INFO _IOR(KVFS_IOC_MAGIC, 0x00, struct kvfs_info)
#define KVFS_IOC_REGISTER _IOWR(KVFS_IOC_MAGIC, 0x01, struct kvfs_register)
#define KVFS_IOC_UNREGISTER _IOW(KVFS_IOC_MAGIC, 0x02, struct kvfs_unregister)
#define KVFS_IOC_SUBMIT _IOWR(KVFS_IOC_MAGIC, 0x03, struct kvfs_submit)

#endif /* KVFS_H */
