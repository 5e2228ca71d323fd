/*
 * Fast-path conformance test, run as a separate process against a real mount.
 *
 * usage: fastpath MOUNTPOINT PREFIX NGET
 *
 * The harness has put PREFIX/get/<i> for i < NGET, of (i + 1) * 4096 + 123 bytes, byte j being
 * (j * 31 + i) % 251. This program checks every documented errno of the ABI, gets those
 * objects in one batch, and puts PREFIX/put/<i> for i < 3 (same pattern, (i + 1) * 65536 + 7
 * bytes) for the harness to read back. It prints "ok <case>" per case and exits non-zero on
 * the first failure.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvfs.h"

#define BUF_BYTES (64u << 20)
#define ITEMS_OFF 0
#define KEYS_OFF 4096
#define DATA_OFF (1u << 20)

static const char *mnt, *prefix;

#define FAIL(...)                                                                                  \
	do {                                                                                       \
		fprintf(stderr, "FAIL line %d: ", __LINE__);                                       \
		fprintf(stderr, __VA_ARGS__);                                                      \
		fprintf(stderr, "\n");                                                             \
		exit(1);                                                                           \
	} while (0)
#define OK(name) printf("ok %s\n", name)

/* ioctl must fail with `want`. */
static void expect_errno(int fd, unsigned long cmd, void *arg, int want, const char *what)
{
	errno = 0;
	int r = ioctl(fd, cmd, arg);
	if (r != -1 || errno != want)
		FAIL("%s: ioctl returned %d errno %d (%s), wanted errno %d (%s)", what, r, errno,
		     strerror(errno), want, strerror(want));
	OK(what);
}

static int sealed_memfd(size_t len, int seal)
{
	int fd = memfd_create("kvfs-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0 || ftruncate(fd, len) != 0)
		FAIL("memfd: %s", strerror(errno));
	if (seal && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
		FAIL("seal: %s", strerror(errno));
	return fd;
}

static int open_control(void)
{
	char path[4096];
	snprintf(path, sizeof path, "%s/%s", mnt, KVFS_CONTROL_PATH);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		FAIL("open %s: %s", path, strerror(errno));
	return fd;
}

static unsigned char pattern(size_t j, unsigned i)
{
	return (unsigned char)((j * 31 + i) % 251);
}

/* Fills item `n`: key at KEYS_OFF + n * 256, data at `data_off`. */
static struct kvfs_item *item(unsigned char *buf, unsigned n, const char *key, uint64_t data_off,
			      uint64_t data_len)
{
	struct kvfs_item *it = (struct kvfs_item *)(buf + ITEMS_OFF) + n;
	memset(it, 0, sizeof *it);
	it->key_offset = KEYS_OFF + n * 256;
	it->key_len = (uint32_t)strlen(key);
	memcpy(buf + it->key_offset, key, it->key_len);
	it->data_offset = data_off;
	it->data_len = data_len;
	it->status = 12345;
	return it;
}

static struct kvfs_submit submit_args(unsigned op, uint64_t id, unsigned count)
{
	struct kvfs_submit s;
	memset(&s, 0, sizeof s);
	s.abi_version = KVFS_ABI_VERSION;
	s.op = op;
	s.buffer_id = id;
	s.items_offset = ITEMS_OFF;
	s.count = count;
	return s;
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: %s MOUNTPOINT PREFIX NGET\n", argv[0]);
		return 2;
	}
	mnt = argv[1];
	prefix = argv[2];
	unsigned nget = (unsigned)atoi(argv[3]);
	int ctl = open_control();

	/* Info. */
	struct kvfs_info info;
	memset(&info, 0, sizeof info);
	if (ioctl(ctl, KVFS_IOC_INFO, &info) != 0)
		FAIL("info: %s", strerror(errno));
	if (info.abi_version != KVFS_ABI_VERSION || info.item_size != sizeof(struct kvfs_item))
		FAIL("info: version %u item size %lu", info.abi_version, (unsigned long)info.item_size);
	OK("info");

	/* Registration errors. */
	int good = sealed_memfd(BUF_BYTES, 1);
	struct kvfs_register reg;
	memset(&reg, 0, sizeof reg);
	reg.abi_version = KVFS_ABI_VERSION + 7;
	reg.fd = good;
	reg.len = BUF_BYTES;
	expect_errno(ctl, KVFS_IOC_REGISTER, &reg, EPROTO, "register-bad-version");
	reg.abi_version = KVFS_ABI_VERSION;
	reg.flags = 1;
	expect_errno(ctl, KVFS_IOC_REGISTER, &reg, EINVAL, "register-flags");
	reg.flags = 0;
	reg.len = 0;
	expect_errno(ctl, KVFS_IOC_REGISTER, &reg, EINVAL, "register-zero-len");
	reg.len = (uint64_t)BUF_BYTES + 4096;
	expect_errno(ctl, KVFS_IOC_REGISTER, &reg, ERANGE, "register-len-past-file");
	reg.len = BUF_BYTES;
	reg.fd = 1000;
	expect_errno(ctl, KVFS_IOC_REGISTER, &reg, EBADF, "register-fd-not-open");
	int unsealed = sealed_memfd(1 << 20, 0);
	reg.fd = unsealed;
	reg.len = 1 << 20;
	expect_errno(ctl, KVFS_IOC_REGISTER, &reg, EPERM, "register-unsealed");
	int pipefd[2];
	if (pipe(pipefd) != 0)
		FAIL("pipe");
	reg.fd = pipefd[0];
	expect_errno(ctl, KVFS_IOC_REGISTER, &reg, ENODEV, "register-not-shared-memory");

	/* Register the good buffer. */
	reg.fd = good;
	reg.len = BUF_BYTES;
	if (ioctl(ctl, KVFS_IOC_REGISTER, &reg) != 0 || reg.buffer_id == 0)
		FAIL("register: %s", strerror(errno));
	uint64_t id = reg.buffer_id;
	unsigned char *buf = mmap(NULL, BUF_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, good, 0);
	if (buf == MAP_FAILED)
		FAIL("mmap");
	OK("register");

	/* Batch get: NGET objects plus the per-item errors. */
	char key[256];
	uint64_t off = DATA_OFF;
	unsigned n = 0;
	for (unsigned i = 0; i < nget; i++) {
		snprintf(key, sizeof key, "%s/get/%u", prefix, i);
		item(buf, n++, key, off, 1 << 20);
		off += 1 << 20;
	}
	snprintf(key, sizeof key, "%s/missing", prefix);
	unsigned missing = n;
	item(buf, n++, key, off, 4096);
	snprintf(key, sizeof key, "%s/get/%u", prefix, nget - 1);
	unsigned small = n;
	item(buf, n++, key, off, 100);
	unsigned past = n;
	item(buf, n++, key, BUF_BYTES - 10, 4096);
	unsigned badkey = n;
	item(buf, n, key, off, 4096)->key_offset = BUF_BYTES - 2;
	n++;
	unsigned emptykey = n;
	item(buf, n, key, off, 4096)->key_len = 0;
	n++;
	unsigned reserved = n;
	item(buf, n, key, off, 4096)->reserved = 1;
	n++;
	struct kvfs_submit s = submit_args(KVFS_OP_GET, id, n);
	if (ioctl(ctl, KVFS_IOC_SUBMIT, &s) != 0)
		FAIL("get: %s", strerror(errno));
	if (s.ok != nget || s.failed != n - nget)
		FAIL("get: ok %u failed %u", s.ok, s.failed);
	struct kvfs_item *items = (struct kvfs_item *)(buf + ITEMS_OFF);
	for (unsigned i = 0; i < nget; i++) {
		size_t want = (size_t)(i + 1) * 4096 + 123;
		if (items[i].status != 0 || items[i].size != want)
			FAIL("get %u: status %d size %lu", i, items[i].status, (unsigned long)items[i].size);
		const unsigned char *d = buf + items[i].data_offset;
		for (size_t j = 0; j < want; j++)
			if (d[j] != pattern(j, i))
				FAIL("get %u: byte %zu is %u", i, j, d[j]);
	}
	OK("batch-get");
#define ITEM_ERR(idx, err, name)                                                                    \
	do {                                                                                       \
		if (items[idx].status != -(err))                                                   \
			FAIL("%s: status %d, wanted %d", name, items[idx].status, -(err));         \
		OK(name);                                                                          \
	} while (0)
	ITEM_ERR(missing, ENOENT, "item-missing-key");
	ITEM_ERR(small, EOVERFLOW, "item-buffer-too-small");
	if (items[small].size != (size_t)nget * 4096 + 123)
		FAIL("too small: size %lu", (unsigned long)items[small].size);
	ITEM_ERR(past, ERANGE, "item-data-past-buffer");
	ITEM_ERR(badkey, ERANGE, "item-key-past-buffer");
	ITEM_ERR(emptykey, EINVAL, "item-empty-key");
	ITEM_ERR(reserved, EINVAL, "item-reserved-field");

	/* Batch put. */
	off = DATA_OFF;
	for (unsigned i = 0; i < 3; i++) {
		size_t len = (size_t)(i + 1) * 65536 + 7;
		for (size_t j = 0; j < len; j++)
			buf[off + j] = pattern(j, i);
		snprintf(key, sizeof key, "%s/put/%u", prefix, i);
		item(buf, i, key, off, len);
		off += len + 4096;
	}
	item(buf, 3, "put-empty", off, 0);
	s = submit_args(KVFS_OP_PUT, id, 4);
	if (ioctl(ctl, KVFS_IOC_SUBMIT, &s) != 0)
		FAIL("put: %s", strerror(errno));
	if (s.ok != 3 || s.failed != 1)
		FAIL("put: ok %u failed %u (statuses %d %d %d %d)", s.ok, s.failed, items[0].status,
		     items[1].status, items[2].status, items[3].status);
	ITEM_ERR(3, EINVAL, "item-put-zero-bytes");
	OK("batch-put");

	/* Whole-call errors. */
	s = submit_args(KVFS_OP_GET, id + 1000, 1);
	expect_errno(ctl, KVFS_IOC_SUBMIT, &s, EBADF, "submit-bad-id");
	s = submit_args(KVFS_OP_GET, id, 1);
	s.items_offset = BUF_BYTES;
	expect_errno(ctl, KVFS_IOC_SUBMIT, &s, ERANGE, "submit-items-past-buffer");
	s.items_offset = BUF_BYTES - 8;
	expect_errno(ctl, KVFS_IOC_SUBMIT, &s, ERANGE, "submit-items-straddle-end");
	s.items_offset = 4;
	expect_errno(ctl, KVFS_IOC_SUBMIT, &s, EINVAL, "submit-unaligned");
	s = submit_args(KVFS_OP_GET, id, 0);
	expect_errno(ctl, KVFS_IOC_SUBMIT, &s, EINVAL, "submit-zero-items");
	s = submit_args(KVFS_OP_GET, id, info.batch_items_max + 1);
	expect_errno(ctl, KVFS_IOC_SUBMIT, &s, E2BIG, "submit-too-many-items");
	s = submit_args(9, id, 1);
	expect_errno(ctl, KVFS_IOC_SUBMIT, &s, EINVAL, "submit-bad-op");
	s = submit_args(KVFS_OP_GET, id, 1);
	s.abi_version = 99;
	expect_errno(ctl, KVFS_IOC_SUBMIT, &s, EPROTO, "submit-bad-version");
	expect_errno(ctl, _IOWR(KVFS_IOC_MAGIC, 0x7f, struct kvfs_submit), &s, ENOTTY, "unknown-command");

	/* Another process: neither our id nor our descriptors are its to use. */
	int late = -1;
	pid_t child = fork();
	if (child == 0) {
		/* The shared control fd, but another process. */
		struct kvfs_submit cs = submit_args(KVFS_OP_GET, id, 1);
		item(buf, 0, key, DATA_OFF, 1 << 20);
		errno = 0;
		if (ioctl(ctl, KVFS_IOC_SUBMIT, &cs) != -1 || errno != EPERM)
			_exit(10);
		struct kvfs_unregister cu = { KVFS_ABI_VERSION, 0, id };
		if (ioctl(ctl, KVFS_IOC_UNREGISTER, &cu) != -1 || errno != EPERM)
			_exit(11);
		/* The parent's memfd made after the fork is not in our table. */
		usleep(200 * 1000);
		int own = open_control();
		struct kvfs_register cr;
		memset(&cr, 0, sizeof cr);
		cr.abi_version = KVFS_ABI_VERSION;
		cr.fd = 900;
		cr.len = 4096;
		errno = 0;
		if (ioctl(own, KVFS_IOC_REGISTER, &cr) != -1 || errno != EBADF)
			_exit(12);
		_exit(0);
	}
	late = sealed_memfd(1 << 20, 1);
	if (dup2(late, 900) < 0)
		FAIL("dup2");
	int status = 0;
	if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
		FAIL("other process: child exited with %d", WEXITSTATUS(status));
	OK("other-process-id");
	OK("other-process-fd");

	/* An ioctl on an object is not the control file's. */
	char path[4096];
	snprintf(path, sizeof path, "%s/%s/get/0", mnt, prefix);
	int obj = open(path, O_RDONLY);
	if (obj < 0)
		FAIL("open %s: %s", path, strerror(errno));
	expect_errno(obj, KVFS_IOC_INFO, &info, ENOTTY, "ioctl-on-object");
	close(obj);

	/* Unregister: the id is gone. */
	struct kvfs_unregister u = { KVFS_ABI_VERSION, 0, id };
	if (ioctl(ctl, KVFS_IOC_UNREGISTER, &u) != 0)
		FAIL("unregister: %s", strerror(errno));
	OK("unregister");
	s = submit_args(KVFS_OP_GET, id, 1);
	expect_errno(ctl, KVFS_IOC_SUBMIT, &s, EBADF, "submit-unregistered-buffer");
	expect_errno(ctl, KVFS_IOC_UNREGISTER, &u, EBADF, "unregister-twice");

	/* Ids die with the control fd that registered them. */
	reg.fd = good;
	if (ioctl(ctl, KVFS_IOC_REGISTER, &reg) != 0)
		FAIL("register again: %s", strerror(errno));
	int ctl2 = open_control();
	close(ctl);
	usleep(100 * 1000);
	s = submit_args(KVFS_OP_GET, reg.buffer_id, 1);
	expect_errno(ctl2, KVFS_IOC_SUBMIT, &s, EBADF, "id-dies-with-control-fd");
	printf("done\n");
	return 0;
}
