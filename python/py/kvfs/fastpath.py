"""``kvfs.fastpath``: a kvfs mount's ioctl fast path, from Python.

The bytes of gets and puts move straight between the pool and a shared buffer of this process;
the mount's FUSE file operations are bypassed (the ABI is ``fs/abi/include/kvfs.h`` in the kvfs
repository)::

    import kvfs.fastpath

    with kvfs.fastpath.open("/mnt/kvfs") as fp:
        buf = fp.alloc(64 << 20)               # sealed memfd, registered with the daemon
        a = buf.numpy()                        # writable uint8 view, no copy (buf.tensor():
        a[:4096] = 7                           #   the same memory as a torch tensor)
        fp.put(buf, [("layer0/k", 0, 4096)])   # -> [(0, 4096)]
        fp.get(buf, [("layer0/k", 8192, 4096), ("missing", 0, 16)])
        # -> [(0, 4096), (-errno.ENOENT, 0)]
        n = fp.get_one(buf, "layer0/k", 8192)  # raises OSError on a failure

Buffer layout. A buffer of ``nbytes`` is one memfd sealed against shrinking and growing, laid
out as ``[item table | key area | data area]``: the table holds ``batch_items_max`` items of 48
bytes, the key area (``key_area_bytes``, 1 MiB unless given to ``alloc``) the keys of the batch
being run, packed; both are page multiples, so the data area (what ``len(buf)``,
``memoryview(buf)``, ``buf.numpy()`` and ``buf.tensor()`` show, and what the offsets of items
count from) is page aligned. The library lays each batch out there; a batch whose keys exceed
the key area runs as several consecutive ioctls. Batches on one buffer from several threads run
one after another; batches on different buffers run in parallel. The GIL is released while the
ioctl runs.

Outcomes. ``get`` and ``put`` return ``(status, size)`` per item: status 0, or a negative errno
(kvfs.h's item table): ``-ENOENT`` no such object, ``-EOVERFLOW`` the destination is smaller
than the object (``size`` is the object's size), ``-EINVAL`` an empty key or a put of 0 bytes,
``-ENAMETOOLONG`` a key over ``key_bytes_max``, ``-ENOSPC``, ``-EFBIG``, ``-EAGAIN``,
``-ENOTCONN``, ``-EIO``, ``-EBADMSG``, ``-ETIMEDOUT``. A put of an existing key succeeds and keeps
the old value (the first writer wins). :func:`error` turns a status into an ``OSError`` (the
key as its ``filename``, ``size`` as an attribute) and :func:`check` raises the first failure
of a batch; ``get_one``/``put_one`` raise it themselves.

Whole-call errors: no mount, or a directory that is not a kvfs mount: ``OSError`` (``ENOENT``,
``ENOTTY``) saying so; a daemon of another ABI version: ``OSError`` ``EPROTO``; more items than
``batch_items_max``, or a range outside the data area: ``ValueError`` (nothing is submitted);
a closed buffer or fast path: ``ValueError``; an ioctl that fails as a whole: ``OSError`` with
its errno.

Lifetime. ``buf.close()`` unregisters a buffer; ``fp.close()`` (also on leaving the ``with``
block, or when ``fp`` is collected) closes the control file, which unregisters every buffer
registered through it. A buffer's memory stays mapped until the buffer object and every view
of it are gone, so a view never points at unmapped memory. Buffer ids belong to the process:
a forked child cannot use its parent's.
"""

from kvfs._native import FASTPATH_KEY_AREA_BYTES_DEFAULT as KEY_AREA_BYTES_DEFAULT
from kvfs._native import FastPath, FastPathBuffer, fastpath_error

__all__ = ["open", "FastPath", "FastPathBuffer", "error", "check", "KEY_AREA_BYTES_DEFAULT"]


def open(mount):  # noqa: A001 - the module's entry point, as io.open
    """Opens the fast path of the kvfs mount at ``mount`` (a path): a :class:`FastPath`."""
    return FastPath(mount)


def error(status, key, size=0, length=0):
    """The ``OSError`` for an item's negative ``status`` (errno ``-status``, ``filename`` the
    key, ``size`` the item's size; ``length`` the destination's, for the message)."""
    return fastpath_error(status, key, size, length)


def check(results, items):
    """Raises the ``OSError`` of the first failed item of a batch; returns the sizes otherwise.

    ``results`` is what ``get``/``put`` returned for ``items`` (the ``(key, offset, length)``
    list passed to them).
    """
    sizes = []
    for (status, size), (key, _offset, length) in zip(results, items):
        if status != 0:
            raise error(status, key, size, length)
        sizes.append(size)
    return sizes
