"""``mooncake.engine``: the reference's Transfer Engine module, answered by kvfs.

``TransferEngine`` moves bytes between registered memory of two processes with the reference's
calls and return codes (``initialize``, ``register_memory``, ``transfer_sync_write`` /
``read``, their batch and async forms, ``get_notifies``, ...), on the kvfs Transfer Engine:
shared memory between processes of one host for managed buffers, TCP (or RDMA) otherwise.
docs/mooncake-compat.md in the kvfs repository lists every call and difference.
"""

from enum import IntEnum

from kvfs._native import TransferEngine as _TransferEngine
from kvfs._native import TransferNotify

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode", "Read", "Write"]

# Build flags of the reference's wheel: kvfs has none of these device paths.
SUPPORT_CUDA = False
SUPPORT_HIP = False
SUPPORT_MUSA = False
SUPPORT_EFA = False
SUPPORT_MNNVL = False
SUPPORT_INTRA_NVLINK = False


class TransferOpcode(IntEnum):
    """Direction of a transfer, with the reference's member names and values."""

    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferEngine(_TransferEngine):
    """The reference's ``mooncake.engine.TransferEngine`` on kvfs."""

    TransferOpcode = TransferOpcode
