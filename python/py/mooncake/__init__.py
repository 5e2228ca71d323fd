"""Import shim: ``mooncake.store`` served by kvfs.

Engines written against the reference (``from mooncake.store import MooncakeDistributedStore``)
get :mod:`kvfs.mooncake` unchanged, and ``mooncake.engine`` (``TransferEngine``) runs on the
kvfs Transfer Engine. The reference's PG and EP modules are not provided (see
docs/mooncake-compat.md in the kvfs repository).
"""

try:  # the reference's local-buffer pool, where the native store provides one
    from mooncake.store import BufferPool
except ImportError:  # kvfs does not: None, as the reference's own wheel exports without it
    BufferPool = None

RegisteredBufferPool = BufferPool

__all__ = ["BufferPool", "RegisteredBufferPool"]
