"""kvfs: a tiered, distributed KV-cache store for LLM inference.

Two APIs over the same native client (the GIL is released during every I/O call, and every
call ends within its deadline):

* :class:`kvfs.Client`, the native API::

      import kvfs, numpy as np
      with kvfs.Client("127.0.0.1:50051") as c:
          c.put("k", b"value")                 # first writer wins; upsert=True replaces
          assert c.get("k") == b"value"        # NotFoundError (a KeyError) on a miss
          a = np.arange(1 << 20, dtype=np.uint8)
          c.register(a)                        # zero-copy calls need registered memory
          c.put_from("a", a)
          out = np.empty_like(a); c.register(out)
          assert c.get_into("a", out) == a.nbytes

* :class:`kvfs.mooncake.MooncakeDistributedStore`, the reference store's Python class with
  its arguments, return codes and semantics (also importable as ``mooncake.store``).

:mod:`kvfs.fastpath` is a kvfs mount's ioctl fast path (``import kvfs.fastpath``): registered
shared buffers shown as numpy arrays or torch tensors, and batches of gets and puts on them.

Errors: :class:`KvfsError` and its subclasses; ``ERROR_CODES`` maps the reference's code names
to numbers and ``KIND_CODES`` each kvfs error kind to its code.
"""

from kvfs._native import (  # noqa: F401
    Client,
    BufferHandle,
    ERROR_CODES,
    KIND_CODES,
    BUILD_PROFILE,
    __version__,
)
from kvfs._errors import (  # noqa: F401
    KvfsError,
    NotFoundError,
    AlreadyExistsError,
    NoSpaceError,
    LeasedError,
    PinnedError,
    InvalidArgumentError,
    NotRegisteredError,
    BufferTooSmallError,
    PutInProgressError,
    UnavailableError,
    TransferError,
    CorruptError,
    TimeoutError,
    NotConnectedError,
)

__all__ = [
    "Client",
    "BufferHandle",
    "ERROR_CODES",
    "KIND_CODES",
    "BUILD_PROFILE",
    "KvfsError",
    "NotFoundError",
    "AlreadyExistsError",
    "NoSpaceError",
    "LeasedError",
    "PinnedError",
    "InvalidArgumentError",
    "NotRegisteredError",
    "BufferTooSmallError",
    "PutInProgressError",
    "UnavailableError",
    "TransferError",
    "CorruptError",
    "TimeoutError",
    "NotConnectedError",
]
