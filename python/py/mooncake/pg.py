"""The reference's ``mooncake.pg`` on kvfs: ``from mooncake import pg`` registers the
``torch.distributed`` backend ``"mooncake-cpu"`` (the kvfs backend, :mod:`kvfs.torch_pg`,
under the reference's name) and provides its options class and elastic helpers.

Differences from the reference, by design: calls always run over the live ranks. With
``auto_deactivate_on_failure=False`` a failed rank stays listed in ``get_active_ranks`` and
every call reports it (``get_local_success`` false, ``get_failed_ranks_hint``) until
``deactivate_ranks`` names it, as in the reference, but the calls' results are already the
live ranks' (the reference's are too); ``sync_after_failure`` has nothing to wait for;
a replacement's ``init_process_group`` (``is_extension=False``) returns once the active ranks
activate it; there is no CUDA backend (``"mooncake"``).
"""

import enum
import os

import torch

from kvfs import torch_pg as _tpg

__all__ = [
    "MooncakeBackendOptions", "ProposalStatus", "ViewUpdateStatus", "SyncAfterFailureStatus",
    "ProposeViewUpdateResponse", "SyncAfterFailureResponse", "get_active_ranks",
    "get_peer_state", "recover_ranks", "activate_ranks", "deactivate_ranks", "join_group",
    "sync_after_failure", "get_failed_ranks_hint", "get_local_success", "get_current_epoch",
    "set_host_ip", "set_device_filter", "set_collective_timeout_us", "set_p2p_timeout_us",
    "set_fault_reconciliation_window_us",
]


class MooncakeBackendOptions:
    """``(max_group_size, is_extension=False, auto_deactivate_on_failure=True,
    auto_sync_on_failure=True)``; also ``(active_ranks_tensor, is_extension, max_group_size)``."""

    def __init__(self, max_group_size=0, is_extension=False, auto_deactivate_on_failure=True,
                 auto_sync_on_failure=True):
        if isinstance(max_group_size, torch.Tensor):
            active = max_group_size
            max_group_size = int(auto_deactivate_on_failure) if not isinstance(auto_deactivate_on_failure, bool) else active.numel()
            auto_deactivate_on_failure = True
        if auto_sync_on_failure and not auto_deactivate_on_failure:
            raise ValueError("auto_sync_on_failure needs auto_deactivate_on_failure")
        self.max_group_size = int(max_group_size)
        self.is_extension = bool(is_extension)
        self.auto_deactivate_on_failure = bool(auto_deactivate_on_failure)
        self.auto_sync_on_failure = bool(auto_sync_on_failure)


class ProposalStatus(enum.Enum):
    Rejected = 0
    Applied = 1
    AppliedWithDroppedRanks = 2


ViewUpdateStatus = ProposalStatus


class SyncAfterFailureStatus(enum.Enum):
    Reconciled = 0
    NoPending = 1
    Rejected = 2


class ProposeViewUpdateResponse:
    def __init__(self, status, new_epoch=0, dropped_ranks=(), reject_reason=""):
        self.status = status
        self.new_epoch = new_epoch
        self.dropped_ranks = list(dropped_ranks)
        self.reject_reason = reject_reason


class SyncAfterFailureResponse:
    def __init__(self, status, reject_reason=""):
        self.status = status
        self.reject_reason = reject_reason


def _pg(group):
    import torch.distributed as dist

    g = group if group is not None else dist.group.WORLD
    if not isinstance(g, _tpg.ProcessGroup):
        raise TypeError(f"{g!r} is not a kvfs process group")
    return g


def _max_size(g):
    m = getattr(g.options, "max_group_size", 0) if g.options is not None else 0
    return max(int(m or 0), g._declared, g.getSize())


def get_active_ranks(group=None):
    g = _pg(group)
    t = torch.zeros(_max_size(g), dtype=torch.int32)
    for s in g._listed():
        if s < t.numel():
            t[s] = 1
    return t


def get_peer_state(group, ranks):
    """Whether each rank has a live process waiting at the coordinator to be activated."""
    g = _pg(group)
    waiting = set(g.kvfs_group.waiting_slots())
    return [int(r) in waiting for r in ranks]


def _change(group, activate=(), deactivate=()):
    g = _pg(group)
    from kvfs.pg import PgError

    try:
        v = g.kvfs_group.change(activate=[int(r) for r in activate],
                                deactivate=[int(r) for r in deactivate])
    except PgError as e:
        return ProposeViewUpdateResponse(ProposalStatus.Rejected, g.kvfs_group.epoch,
                                         reject_reason=str(e))
    return ProposeViewUpdateResponse(ProposalStatus.Applied, v["epoch"])


def recover_ranks(group, ranks):
    return _change(group, activate=ranks)


activate_ranks = recover_ranks


def deactivate_ranks(group, ranks):
    """A rank deactivating itself leaves the group at once; deactivating others is done by
    every other active rank together."""
    g = _pg(group)
    ranks = [int(r) for r in ranks]
    if ranks == [g.getRank()]:
        epoch = g.kvfs_group.epoch
        g.kvfs_group.close()
        return ProposeViewUpdateResponse(ProposalStatus.Applied, epoch + 1)
    # Failed ranks kvfs already runs without (manual deactivation): the program acknowledges.
    gone = [r for r in ranks if r in g._unacked()]
    g._known -= set(gone)
    rest = [r for r in ranks if r not in gone]
    if not rest:
        return ProposeViewUpdateResponse(ProposalStatus.Applied, g.kvfs_group.epoch)
    return _change(group, deactivate=rest)


def join_group(group=None):
    """Waits until the active ranks activate this joining process (an extension's
    ``init_process_group`` returns at once; its calls run locally until then)."""
    g = _pg(group)
    if g.kvfs_group.pending:
        g.kvfs_group.wait_active()


def sync_after_failure(group=None):
    _pg(group)
    return SyncAfterFailureResponse(SyncAfterFailureStatus.NoPending)


def get_failed_ranks_hint(work, max_group_size=None):
    failed = getattr(work, "failed_ranks", [])
    pg = getattr(work, "_pg", None)
    n = max_group_size or (_max_size(pg) if pg is not None else (max(failed) + 1 if failed else 0))
    t = torch.zeros(n, dtype=torch.int32)
    for r in failed:
        if r < n:
            t[r] = 1
    return t


def get_local_success(work):
    return bool(getattr(work, "local_success", True))


def get_current_epoch(group=None):
    return _pg(group).kvfs_group.epoch


def set_host_ip(ip):
    os.environ["KVFS_PG_HOST"] = str(ip)


def set_device_filter(devices):
    """Accepted for compatibility (kvfs chooses transports itself)."""


def set_collective_timeout_us(us):
    os.environ["KVFS_PG_OP_TIMEOUT_MS"] = str(max(1, int(us) // 1000))


set_p2p_timeout_us = set_collective_timeout_us


def set_fault_reconciliation_window_us(us):
    """Accepted for compatibility (kvfs reconciles as soon as the survivors report)."""


_tpg.register("mooncake-cpu")
