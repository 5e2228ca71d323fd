"""The reference store's Python class, ``MooncakeDistributedStore``, answered by kvfs.

vLLM's MooncakeStoreConnector, SGLang's HiCache backend and LMCache's Mooncake connector call
this class; kvfs answers the same calls with the same arguments, return codes and meaning:

* every call returns ``0`` / a count / a size / ``1``-``0`` on success and a negative error code
  of the reference (``ERROR_CODES``; -704 not found, -706 leased, -200 no space, -600 invalid
  parameters, ...) on failure; ``get`` returns ``b""`` on a miss;
* ``put`` of an existing key returns 0 and keeps the first value (first writer wins); ``upsert``
  replaces it;
* a read lease granted by ``get``/``is_exist``/``get_into`` blocks ``remove`` (-706) until it
  expires (the master's ``--default_kv_lease_ttl``) unless ``force=True``;
* ``setup`` with ``global_segment_size > 0`` makes this process contribute that much DRAM to the
  pool (an embedded kvfs node, like the reference's embedded mode); ``close`` leaves the pool
  and the objects stored only in this process's segment disappear;
* ``local_buffer_size`` bounds the bytes the bytes API (``put``/``get``) stages at once;
* the tensor calls (``put_tensor``, ``get_tensor``, their batch, ``*_with_tp``, ``*_into``,
  ``*_from``, ``pub_*`` and ``upsert_*`` forms) store the reference's byte format (a 304-byte
  header and the payload: :mod:`kvfs._tensor`), so tensors written by either store read back
  from the other; they take torch tensors (torch is imported on first use, never required) or
  numpy arrays, and return torch tensors where torch imports, numpy arrays otherwise;
* a store that is garbage-collected, or still open when the interpreter exits, leaves the pool
  as ``close`` does (its native object's destructor, and an ``atexit`` hook bounded by
  ``KVFS_EXIT_CLOSE_TIMEOUT_MS``, default 5 s for all stores together).

Every call releases the GIL and ends within ``KVFS_CALL_TIMEOUT_MS`` (default 60 s). Where kvfs
differs from the reference, docs/mooncake-compat.md says how.
"""

import atexit
import ctypes
import enum
import logging
import os
import platform
import re
import time
import weakref

from kvfs._native import BufferHandle, ERROR_CODES, MooncakeCore

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "ObjectDataType",
    "ReplicaStatus",
    "BufferHandle",
    "ERROR_CODES",
    "MooncakeHostMemAllocator",
    "bind_to_numa_node",
    "ReplicaDescriptor",
    "MemoryDescriptor",
    "DiskDescriptor",
    "Descriptor",
    "parse_size",
]

log = logging.getLogger("kvfs.mooncake")


def _tensor():
    """The tensor codec (imported on first use: it needs numpy, which only tensor calls do)."""
    from kvfs import _tensor as codec

    return codec

OK = 0
INVALID_PARAMS = ERROR_CODES["INVALID_PARAMS"]
NOT_SUPPORTED = ERROR_CODES["NOT_SUPPORTED"]
# The reference's code when a tensor to export is missing (kvfs never returns it otherwise).
FILE_NOT_FOUND = -1100
OBJECT_NOT_FOUND = ERROR_CODES["OBJECT_NOT_FOUND"]
INTERNAL_ERROR = ERROR_CODES["INTERNAL_ERROR"]

_U64_MAX = (1 << 64) - 1
_DEFAULT_SEGMENT = 16 << 20
_DEFAULT_LOCAL_BUFFER = 16 << 20


class SoftPinAction(enum.IntEnum):
    """What a put does to the object's soft pin (applied when it becomes readable)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """The reference's object tag; kvfs accepts it and does not interpret it."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class ReplicateConfig:
    """Placement of a put, with the reference's fields and defaults.

    kvfs honours ``replica_num`` (replicas on distinct nodes, best effort), ``with_hard_pin``,
    ``soft_pin_action`` (ENABLE soft-pins; kvfs soft pins have no TTL), the legacy
    ``with_soft_pin``, ``preferred_segments``/``preferred_segment`` (segment names, i.e. what
    ``get_hostname()`` returns) and ``prefer_alloc_in_same_node`` (local-first placement).
    ``nof_replica_num``/``dfs_replica_num`` > 0 return NOT_SUPPORTED (-1012); ``data_type``,
    ``group_ids`` (length-checked) and ``preferred_nof_segments`` are accepted and ignored.
    kvfs extensions: ``persistence`` ("none", "lazy", "eager") asks the nodes to write the
    object back to object storage; ``tier`` ("dram", the default, or "hbm") places it in the GPU
    memory nodes contribute (``hbm_segment_size`` in ``setup``, ``kvfs node --hbm``).
    """

    __slots__ = (
        "replica_num",
        "nof_replica_num",
        "dfs_replica_num",
        "soft_pin_action",
        "_soft_pin_ttl_ms",
        "with_hard_pin",
        "with_soft_pin",
        "preferred_segments",
        "preferred_segment",
        "preferred_nof_segments",
        "prefer_alloc_in_same_node",
        "data_type",
        "group_ids",
        "persistence",
        "tier",
    )

    def __init__(self):
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms = None
        self.with_hard_pin = False
        self.with_soft_pin = False
        self.preferred_segments = []
        self.preferred_segment = ""
        self.preferred_nof_segments = []
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids = None
        self.persistence = "none"
        self.tier = "dram"

    @property
    def soft_pin_ttl_ms(self):
        """Soft-pin lifetime in ms, or None (only valid with ``SoftPinAction.ENABLE``)."""
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError("soft_pin_ttl_ms must be an int or None")
            if value < 0 or value > _U64_MAX:
                raise TypeError("soft_pin_ttl_ms must fit an unsigned 64-bit integer")
        self._soft_pin_ttl_ms = value

    def __str__(self):
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin}, "
            f"soft_pin_action={SoftPinAction(self.soft_pin_action).name}, "
            f"soft_pin_ttl_ms={self._soft_pin_ttl_ms}, "
            f"preferred_segments={list(self.preferred_segments)}, "
            f"preferred_segment={self.preferred_segment!r}, "
            f"prefer_alloc_in_same_node={self.prefer_alloc_in_same_node}, "
            f"persistence={self.persistence!r}, tier={self.tier!r})"
        )

    __repr__ = __str__


class Descriptor:
    """Where a memory replica's bytes are: ``size``, ``buffer_address`` (an address in the
    holder's Transfer Engine segment) and ``transport_endpoint`` (that segment's name)."""

    __slots__ = ("size", "buffer_address", "transport_endpoint")

    def __init__(self, size=0, buffer_address=0, transport_endpoint=""):
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self):
        return (
            f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
            f"transport_endpoint={self.transport_endpoint}>"
        )


class MemoryDescriptor:
    __slots__ = ("buffer_descriptor",)

    def __init__(self, buffer_descriptor):
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    """A replica in shared storage: ``file_path`` (empty: kvfs's object store names objects by
    key, not by a path the client can open) and ``object_size``."""

    __slots__ = ("file_path", "object_size")

    def __init__(self, file_path="", object_size=0):
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica of an object, as ``get_replica_desc`` describes it.

    kvfs tiers map to the reference's replica kinds: DRAM and HBM copies are memory replicas
    (``get_memory_descriptor()``), a node's NVMe copy is a local-disk replica (the reference's
    client-side SSD tier), an object-store copy is a disk replica (``get_disk_descriptor()``).
    Every replica kvfs reports is complete. kvfs extras: ``tier`` ("dram", "hbm", "nvme",
    "objectstore"), ``endpoint`` (the holder's segment name, empty for the object store) and
    ``node`` (the holder's node id, None for the object store).
    """

    __slots__ = ("status", "tier", "endpoint", "node", "_size", "_addr")

    def __init__(self, tier, endpoint, node, addr, size):
        self.status = ReplicaStatus.COMPLETE
        self.tier, self.endpoint, self.node = tier, endpoint, node
        self._addr, self._size = addr, size

    def is_memory_replica(self):
        return self.tier in ("dram", "hbm")

    def is_disk_replica(self):
        return self.tier == "objectstore"

    def is_local_disk_replica(self):
        return self.tier == "nvme"

    def is_nof_replica(self):
        return False

    def get_memory_descriptor(self):
        if not self.is_memory_replica():
            raise RuntimeError("Expected MemoryDescriptor")
        return MemoryDescriptor(Descriptor(self._size, self._addr, self.endpoint))

    def get_disk_descriptor(self):
        if not self.is_disk_replica():
            raise RuntimeError("Expected DiskDescriptor")
        return DiskDescriptor("", self._size)

    def __repr__(self):
        return (
            f"ReplicaDescriptor(tier={self.tier!r}, endpoint={self.endpoint!r}, "
            f"size={self._size}, status={self.status.name})"
        )


class MooncakeHostMemAllocator:
    """Shared host memory for the zero-copy calls, as the reference's allocator hands out:
    ``alloc(size)`` maps ``size`` bytes (a memfd, every page faulted in; huge pages with
    ``MC_STORE_USE_HUGEPAGE``) and returns the address, ``RuntimeError`` if the system refuses;
    ``free(ptr)`` unmaps it and returns 0, or -1 for an address ``alloc`` did not return. All
    allocators of a process share one table. Register the memory (``register_buffer``) before
    using it in zero-copy calls, and unregister it before ``free``."""

    def alloc(self, size):
        return MooncakeCore.host_alloc(int(size))

    def free(self, ptr):
        return MooncakeCore.host_free(int(ptr))


_NUMA_NODES = "/sys/devices/system/node"
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261, "riscv64": 237}
_MPOL_PREFERRED = 1


def _cpu_list(text):
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind_to_numa_node(node):
    """Runs the calling thread on NUMA node ``node``'s CPUs and prefers that node for its
    future allocations (falling back to other nodes when it is full), as the reference does.
    Never raises: where NUMA is unavailable, or the node is invalid, it logs a warning and
    leaves the thread as it was."""
    node = int(node)
    try:
        nodes = sorted(
            int(n[4:]) for n in os.listdir(_NUMA_NODES) if n.startswith("node") and n[4:].isdigit()
        )
    except OSError:
        nodes = []
    if not nodes:
        log.warning("NUMA is not available on this system; binding skipped")
        return
    if node not in nodes:
        log.warning("Invalid NUMA node: %d. Valid range: 0-%d", node, nodes[-1])
        log.warning("numa_run_on_node failed for node %d", node)
        return
    try:
        with open(f"{_NUMA_NODES}/node{node}/cpulist") as f:
            cpus = _cpu_list(f.read())
        if cpus:
            os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as e:
        log.warning("numa_run_on_node failed for node %d: %s", node, e)
    nr = _SYS_SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        log.warning("NUMA memory preference is not supported on %s", platform.machine())
        return
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(
        ctypes.c_long(nr), ctypes.c_int(_MPOL_PREFERRED), mask, ctypes.c_ulong(words * 64 + 1)
    )
    if rc != 0:
        log.warning(
            "preferring NUMA node %d for allocations failed: %s",
            node,
            os.strerror(ctypes.get_errno()),
        )


class _Invalid(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def _convert_config(config, nkeys=1):
    """ReplicateConfig -> the native placement tuple (or None for the defaults)."""
    if config is None:
        return None
    replicas = getattr(config, "replica_num", 1)
    if not isinstance(replicas, int) or not 1 <= replicas <= 255:
        raise _Invalid(INVALID_PARAMS, f"replica_num {replicas!r} must be in 1..255")
    if getattr(config, "nof_replica_num", 0) or getattr(config, "dfs_replica_num", 0):
        raise _Invalid(NOT_SUPPORTED, "kvfs has no NVMe-oF or DFS replicas (use persistence)")
    action = SoftPinAction(getattr(config, "soft_pin_action", SoftPinAction.PRESERVE))
    ttl = getattr(config, "soft_pin_ttl_ms", None)
    if ttl is not None and action != SoftPinAction.ENABLE:
        raise _Invalid(INVALID_PARAMS, "soft_pin_ttl_ms is only valid with SoftPinAction.ENABLE")
    group_ids = getattr(config, "group_ids", None)
    if group_ids is not None and len(group_ids) != nkeys:
        raise _Invalid(INVALID_PARAMS, f"{len(group_ids)} group_ids for {nkeys} keys")
    if getattr(config, "with_hard_pin", False):
        pin = "hard"
    elif action == SoftPinAction.ENABLE or getattr(config, "with_soft_pin", False):
        pin = "soft"
    else:
        pin = "none"
    preferred = [str(s) for s in (getattr(config, "preferred_segments", None) or []) if s]
    single = getattr(config, "preferred_segment", "")
    if single and single not in preferred:
        preferred.append(str(single))
    strategy = "local_first" if getattr(config, "prefer_alloc_in_same_node", False) else "random"
    persistence = str(getattr(config, "persistence", "none") or "none")
    if persistence not in ("none", "lazy", "eager"):
        raise _Invalid(INVALID_PARAMS, f"persistence {persistence!r}: none, lazy or eager")
    tier = str(getattr(config, "tier", "dram") or "dram").lower()
    if tier not in ("dram", "hbm"):
        raise _Invalid(INVALID_PARAMS, f"tier {tier!r}: dram or hbm")
    return (replicas, pin, persistence, strategy, preferred, tier)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(value):
    """A byte count from an int or a human-readable string ("16MB", "16 MB", "4gb", "1GiB").

    Units are binary (1 MB = 1 MiB = 2**20 bytes), as the reference reads them. Raises
    ``ValueError`` for anything else ("50%", negative numbers).
    """
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is not a number of bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value} is negative")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"size {value!r} is not a number of bytes (e.g. 16MB)")
    number, unit = float(m.group(1)), m.group(2).lower()
    scale = 1024 ** "_kmgtp".index(unit) if unit else 1
    return int(number * scale)


def _timeout_ms():
    try:
        return max(1, int(os.environ.get("KVFS_CALL_TIMEOUT_MS", "60000")))
    except ValueError:
        return 60000


def _tcp_only(protocol):
    # The reference's "tcp" is a transport choice between hosts; kvfs also picks shared memory
    # on one host. KVFS_TRANSPORT=tcp forces TCP everywhere (benchmarks of the network path).
    return os.environ.get("KVFS_TRANSPORT", "").lower() == "tcp"


def _master_from_config(cfg):
    """``master_server_addr``, or LMCache's ``master_server_address`` spelling of it."""
    alias = cfg.get("master_server_address")
    if "master_server_addr" in cfg:
        if alias is not None and str(alias) != str(cfg["master_server_addr"]):
            log.warning(
                "setup: master_server_address %r is ignored; master_server_addr %r is given",
                alias,
                cfg["master_server_addr"],
            )
        return cfg["master_server_addr"]
    if alias is not None:
        log.warning("setup: reading master_server_address as master_server_addr")
        return alias
    return "127.0.0.1:50051"


def _keys_ok(keys, *lists):
    return all(len(x) == len(keys) for x in lists)


class MooncakeDistributedStore:
    """The reference store class (see the module docstring for the conventions)."""

    def __init__(self):
        self._core = MooncakeCore()
        _LIVE.add(self)

    # ----- setup / lifecycle -------------------------------------------------------------

    def setup(self, *args, **kwargs):
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config: dict)``; returns 0 or an error code.

        kvfs extension: ``hbm_segment_size`` (a dict key, or ``KVFS_HBM_SEGMENT_SIZE`` in the
        environment for either form) makes this process's node also contribute that much GPU
        memory (device 0) as an HBM segment, beside its ``global_segment_size`` of DRAM; setup
        fails with a clear message where no CUDA driver is found."""
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            return self._setup_dict(args[0])
        return self._setup_positional(*args, **kwargs)

    def _setup_positional(
        self,
        local_hostname,
        metadata_server,
        global_segment_size,
        local_buffer_size,
        protocol,
        rdma_devices,
        master_server_addr,
        engine=None,
        enable_ssd_offload=False,
        ssd_offload_path="",
        tenant_id="default",
        enable_client_http_server=False,
        client_http_port=9300,
    ):
        if engine is not None:
            log.warning("setup: engine= is ignored; kvfs runs its own Transfer Engine")
        return self._do_setup(
            local_hostname,
            metadata_server,
            global_segment_size,
            local_buffer_size,
            protocol,
            master_server_addr,
            enable_ssd_offload=enable_ssd_offload,
            tenant_id=tenant_id,
        )

    def _setup_dict(self, config):
        cfg = {str(k): v for k, v in config.items()}
        if "local_hostname" not in cfg or "metadata_server" not in cfg:
            log.error("setup: local_hostname and metadata_server are required")
            return INVALID_PARAMS
        return self._do_setup(
            str(cfg["local_hostname"]),
            str(cfg["metadata_server"]),
            cfg.get("global_segment_size", _DEFAULT_SEGMENT),
            cfg.get("local_buffer_size", _DEFAULT_LOCAL_BUFFER),
            str(cfg.get("protocol", "tcp")),
            str(_master_from_config(cfg)),
            enable_ssd_offload=str(cfg.get("enable_ssd_offload", "false")).lower()
            in ("1", "true", "yes"),
            tenant_id=str(cfg.get("tenant_id", "default")),
            hbm_segment_size=cfg.get("hbm_segment_size"),
        )

    def _do_setup(
        self,
        local_hostname,
        metadata_server,
        global_segment_size,
        local_buffer_size,
        protocol,
        master,
        enable_ssd_offload=False,
        tenant_id="default",
        hbm_segment_size=None,
    ):
        if hbm_segment_size is None:
            hbm_segment_size = os.environ.get("KVFS_HBM_SEGMENT_SIZE") or 0
        try:
            segment = parse_size(global_segment_size)
            local_buffer = parse_size(local_buffer_size)
            hbm = parse_size(hbm_segment_size)
        except ValueError as e:
            log.error("setup: %s", e)
            return INVALID_PARAMS
        if not isinstance(local_hostname, str) or not local_hostname:
            log.error("setup: local_hostname must be a non-empty string")
            return INVALID_PARAMS
        master = str(master)
        if "://" in master and not master.startswith("etcd://"):
            log.error(
                "setup: %s: kvfs finds its leader master through etcd (etcd://host:port) or "
                "takes a master's host:port", master)
            return NOT_SUPPORTED
        if enable_ssd_offload:
            log.warning("setup: enable_ssd_offload is ignored; kvfs nodes own their NVMe tier")
        # The reference's "default" tenant is the shared namespace; any other tenant's keys
        # live under tenants/TENANT_ID/ and count against its quota on the master.
        tenant = None if tenant_id in (None, "", "default") else str(tenant_id)
        del metadata_server  # kvfs engines always handshake peer to peer (P2PHANDSHAKE)
        return self._core.setup(
            local_hostname,
            master,
            segment,
            local_buffer,
            tcp_only=_tcp_only(protocol),
            timeout_ms=_timeout_ms(),
            tenant=tenant,
            hbm_bytes=hbm,
        )

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address):
        """A client without a segment. kvfs has no separate "real client" daemon: the nodes
        register with the master, so ``server_address`` names the kvfs master (or set
        ``KVFS_MASTER``); ``mem_pool_size`` is accepted and ignored."""
        master = os.environ.get("KVFS_MASTER") or str(server_address)
        try:
            parse_size(mem_pool_size)
            local_buffer = parse_size(local_buffer_size)
        except ValueError as e:
            log.error("setup_dummy: %s", e)
            return INVALID_PARAMS
        return self._core.setup(
            "127.0.0.1",
            master,
            0,
            local_buffer,
            tcp_only=_tcp_only("tcp"),
            timeout_ms=_timeout_ms(),
        )

    def init_all(self, protocol, device_name, mount_segment_size=16 << 20):
        """Test-only in the reference; not supported."""
        return NOT_SUPPORTED

    def close(self):
        """Leaves the pool (this process's segment and its objects go); returns 0."""
        rc = self._core.close()
        for ptr in getattr(self, "_pool_allocs", ()):
            MooncakeCore.host_free(ptr)
        self._pool_allocs = []
        return rc

    def alloc_from_mem_pool(self, size):
        """Shared host memory of ``size`` bytes for the zero-copy calls (the reference's
        dummy-client pool; register it with ``register_buffer`` before use, as there); its
        address, or 0. It lives until ``close``."""
        try:
            ptr = MooncakeCore.host_alloc(int(size))
        except (RuntimeError, ValueError, OverflowError):
            return 0
        if not hasattr(self, "_pool_allocs"):
            self._pool_allocs = []
        self._pool_allocs.append(ptr)
        return ptr

    def health_check(self):
        """0 healthy, 1 not set up or closed, 2 master unreachable."""
        return self._core.health_check()

    def get_hostname(self):
        """This process's segment name, ``host:port`` (use it as ``preferred_segment``)."""
        return self._core.get_hostname()

    # ----- bytes API ---------------------------------------------------------------------

    def _cfg(self, config, nkeys=1):
        return _convert_config(config, nkeys)

    def put(self, key, value, config=None):
        try:
            cfg = self._cfg(config)
        except _Invalid as e:
            return e.code
        return self._core.put(key, value, cfg, False)

    def upsert(self, key, value, config=None):
        try:
            cfg = self._cfg(config)
        except _Invalid as e:
            return e.code
        return self._core.put(key, value, cfg, True)

    def put_parts(self, key, *parts, config=None):
        try:
            cfg = self._cfg(config)
        except _Invalid as e:
            return e.code
        return self._core.put_parts(key, list(parts), cfg, False)

    def upsert_parts(self, key, *parts, config=None):
        try:
            cfg = self._cfg(config)
        except _Invalid as e:
            return e.code
        return self._core.put_parts(key, list(parts), cfg, True)

    def put_batch(self, keys, values, config=None):
        try:
            cfg = self._cfg(config, len(keys))
        except _Invalid as e:
            return e.code
        return self._core.put_batch(list(keys), list(values), cfg, False)

    def upsert_batch(self, keys, values, config=None):
        try:
            cfg = self._cfg(config, len(keys))
        except _Invalid as e:
            return e.code
        return self._core.put_batch(list(keys), list(values), cfg, True)

    def get(self, key):
        """The object's bytes, or ``b""`` when it is missing (never raises)."""
        return self._core.get(key)

    def get_batch(self, keys):
        return self._core.get_batch(list(keys))

    def get_buffer(self, key):
        """A :class:`BufferHandle` (buffer protocol, ``ptr()``, ``size()``) or None."""
        return self._core.get_buffer(key)

    def batch_get_buffer(self, keys):
        return self._core.batch_get_buffer(list(keys))

    # ----- zero-copy API -----------------------------------------------------------------

    def register_buffer(self, buffer_ptr, size):
        """Registers ``[buffer_ptr, buffer_ptr+size)`` for the zero-copy calls; the caller
        keeps the memory valid until ``unregister_buffer``."""
        return self._core.register_buffer(int(buffer_ptr), int(size))

    def unregister_buffer(self, buffer_ptr):
        return self._core.unregister_buffer(int(buffer_ptr))

    def put_from(self, key, buffer_ptr, size, config=None):
        try:
            cfg = self._cfg(config)
        except _Invalid as e:
            return e.code
        return self._core.put_from(key, int(buffer_ptr), int(size), cfg, False)

    def upsert_from(self, key, buffer_ptr, size, config=None):
        try:
            cfg = self._cfg(config)
        except _Invalid as e:
            return e.code
        return self._core.put_from(key, int(buffer_ptr), int(size), cfg, True)

    def get_into(self, key, buffer_ptr, size):
        """Bytes read into registered memory, or a negative code (``size`` >= object size)."""
        return self._core.get_into(key, int(buffer_ptr), int(size))

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._batch_put_from(keys, buffer_ptrs, sizes, config, False)

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._batch_put_from(keys, buffer_ptrs, sizes, config, True)

    def _batch_put_from(self, keys, buffer_ptrs, sizes, config, upsert):
        keys = list(keys)
        if not _keys_ok(keys, buffer_ptrs, sizes):
            return [INVALID_PARAMS] * len(keys)
        try:
            cfg = self._cfg(config, len(keys))
        except _Invalid as e:
            return [e.code] * len(keys)
        ptrs = [int(p) for p in buffer_ptrs]
        return self._core.batch_put_from(keys, ptrs, [int(s) for s in sizes], cfg, upsert)

    def batch_get_into(self, keys, buffer_ptrs, sizes):
        keys = list(keys)
        if not _keys_ok(keys, buffer_ptrs, sizes):
            return [INVALID_PARAMS] * len(keys)
        ptrs = [int(p) for p in buffer_ptrs]
        return self._core.batch_get_into(keys, ptrs, [int(s) for s in sizes])

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        """One object per key, the concatenation of its scatter buffers (staged: one copy)."""
        keys = list(keys)
        if not _keys_ok(keys, all_buffer_ptrs, all_sizes):
            return [INVALID_PARAMS] * len(keys)
        try:
            cfg = self._cfg(config, len(keys))
        except _Invalid as e:
            return [e.code] * len(keys)
        out = []
        for key, ptrs, sizes in zip(keys, all_buffer_ptrs, all_sizes):
            if len(ptrs) != len(sizes):
                out.append(INVALID_PARAMS)
                continue
            parts = [(ctypes.c_char * int(s)).from_address(int(p)) for p, s in zip(ptrs, sizes)]
            out.append(self._core.put_parts(key, parts, cfg, False))
        return out

    def batch_get_into_multi_buffers(
        self, keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node=False
    ):
        """Scatters each object over its buffers in order (staged: one copy); bytes or code."""
        keys = list(keys)
        if not _keys_ok(keys, all_buffer_ptrs, all_sizes):
            return [INVALID_PARAMS] * len(keys)
        handles = self._core.batch_get_buffer(keys)
        out = []
        for h, ptrs, sizes in zip(handles, all_buffer_ptrs, all_sizes):
            if h is None:
                out.append(OBJECT_NOT_FOUND)
                continue
            if len(ptrs) != len(sizes) or sum(int(s) for s in sizes) < h.size():
                out.append(INVALID_PARAMS)
                continue
            src, left = h.ptr(), h.size()
            for p, s in zip(ptrs, sizes):
                n = min(int(s), left)
                if n <= 0:
                    break
                ctypes.memmove(int(p), src, n)
                src, left = src + n, left - n
            out.append(h.size())
        return out

    # ----- existence, size, removal ------------------------------------------------------

    def is_exist(self, key):
        """1 exists, 0 missing, negative on failure; grants a read lease when it exists."""
        return self._core.is_exist(key)

    def batch_is_exist(self, keys):
        return self._core.batch_is_exist(list(keys))

    def get_size(self, key):
        """Size in bytes, or a negative code (grants no lease in kvfs)."""
        return self._core.get_size(key)

    def remove(self, key, force=False):
        """0, -704 missing, -706 while a read lease (or a hard pin) protects it."""
        return self._core.remove(key, force)

    def batch_remove(self, keys, force=False):
        return self._core.batch_remove(list(keys), force)

    def rename(self, src, dst, replace=True):
        """kvfs extension: give ``src`` the name ``dst`` (its bytes stay where they are).

        0; -704 when ``src`` is missing; -705 when ``dst`` exists and ``replace`` is false.
        With ``replace`` an object under ``dst`` is replaced, even while read.
        """
        return self._core.rename(src, dst, replace)

    def remove_by_regex(self, regex_pattern, force=False):
        """Objects removed, or a negative code (bad pattern: -600)."""
        return self._core.remove_by_regex(regex_pattern, force)

    def remove_all(self, force=False):
        """Objects removed; leased (and hard-pinned) ones stay unless ``force``."""
        return self._core.remove_all(force)

    # ----- replicas ----------------------------------------------------------------------

    def get_replica_desc(self, key):
        """The replicas of ``key`` as :class:`ReplicaDescriptor` objects; ``[]`` when it is
        missing or the call fails. Grants no read lease (the reference's does)."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys):
        """``{key: [ReplicaDescriptor, ...]}`` for the keys that exist (missing keys and
        failures are left out, as the reference does)."""
        keys = list(keys)
        out = {}
        for key, (code, _size, _lease, reps) in zip(keys, self._core.stat_batch(keys)):
            if code == OK:
                out[key] = [
                    ReplicaDescriptor(tier, endpoint, node, addr, length)
                    for tier, endpoint, _host, node, addr, length in reps
                ]
        return out

    def batch_replica_clear(self, keys, segment_name=""):
        """Clears the keys whose read lease has expired and returns those cleared: every
        replica (the object goes), or with ``segment_name`` only the replicas on that segment
        (the object goes with its last copy). Missing, leased and hard-pinned keys are skipped.
        Any client may clear any key (kvfs does not record which client wrote an object)."""
        keys = [str(k) for k in keys if k]
        if not keys:
            return []
        return self._core.batch_replica_clear(keys, str(segment_name or ""))

    def get_into_ranges(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes):
        """Byte ranges of objects into registered buffers: ``results[i][j][k]`` is the length
        read for fragment ``k`` of ``all_keys[i][j]`` (source range ``all_src_offsets[i][j][k]``
        + ``all_sizes[i][j][k]``) into ``buffer_ptrs[i] + all_dst_offsets[i][j][k]``, or a
        negative code: -704 missing, -600 a bad shape, a range past the object or outside the
        registered buffer."""
        return self._core.get_into_ranges(
            [int(p) for p in buffer_ptrs],
            [[str(k) for k in ks] for ks in all_keys],
            [[[int(o) for o in frag] for frag in per] for per in all_dst_offsets],
            [[[int(o) for o in frag] for frag in per] for per in all_src_offsets],
            [[[int(o) for o in frag] for frag in per] for per in all_sizes],
        )

    # ----- tensors -----------------------------------------------------------------------
    # The reference's tensor calls over its byte format (kvfs._tensor); the shard of rank r
    # of a tensor-parallel put lives under "<key>_tp_<r>".

    @staticmethod
    def _tp_key(key, rank):
        return f"{key}_tp_{rank}"

    def _write_tensors(self, keys, tensors, config, upsert):
        """One code per key: ``tensors`` are torch tensors or numpy arrays (-600 for others)."""
        objects = []
        for t in tensors:
            enc = _tensor().encode(t)
            objects.append(None if enc is None else [_tensor().header(enc), enc.payload])
        return self._write_objects(keys, objects, config, upsert)

    def _write_objects(self, keys, objects, config, upsert):
        """One code per key: each object is ``[header, payload]``, or None (-600)."""
        keys = list(keys)
        if len(keys) != len(objects):
            return [INVALID_PARAMS] * len(keys)
        try:
            cfg = self._cfg(config, len(keys))
        except _Invalid as e:
            return [e.code] * len(keys)
        out = [INVALID_PARAMS] * len(keys)
        todo = [i for i, o in enumerate(objects) if o is not None]
        if todo:
            codes = self._core.put_parts_batch(
                [keys[i] for i in todo], [objects[i] for i in todo], cfg, upsert
            )
            for i, c in zip(todo, codes):
                out[i] = c
        return out

    def _write_shards(self, base_keys, tensors, config, upsert, tp_size, split_dim):
        """Splits each tensor into ``tp_size`` shards stored under ``<key>_tp_<rank>``; one code
        per base key (0, or its first shard's failure)."""
        base_keys = list(base_keys)
        out = [INVALID_PARAMS] * len(base_keys)
        keys, objects, owner = [], [], []
        for i, (key, t) in enumerate(zip(base_keys, tensors)):
            enc = _tensor().encode(t)
            shards = None if enc is None else _tensor().split(enc, tp_size, split_dim)
            if shards is None:
                continue
            for rank, shard in enumerate(shards):
                axis = (_tensor().AXIS_TP, rank, tp_size, split_dim)
                keys.append(self._tp_key(key, rank))
                objects.append([_tensor().header(shard, enc.shape, [axis]), shard.payload])
                owner.append(i)
        if not keys:
            return out
        if config is not None and getattr(config, "group_ids", None) is not None:
            if len(config.group_ids) != len(base_keys):
                return [INVALID_PARAMS] * len(base_keys)
            config = _with_group_ids(config, [config.group_ids[i] for i in owner])
        codes = self._write_objects(keys, objects, config, upsert)
        for i in set(owner):
            out[i] = OK
        for i, c in zip(owner, codes):
            if c != OK and out[i] == OK:
                out[i] = c
        return out

    def _tensor_batch(self, keys, tensors_list, config, upsert):
        keys = list(keys)
        tensors = list(tensors_list)
        if not keys or len(keys) != len(tensors):
            return [INVALID_PARAMS] * len(keys)
        return self._write_tensors(keys, tensors, config, upsert)

    def _tensor_tp(self, key, tensor, config, upsert, tp_size, split_dim):
        if tp_size <= 1:
            return self._write_tensors([key], [tensor], config, upsert)[0]
        return self._write_shards([key], [tensor], config, upsert, tp_size, split_dim)[0]

    def _tensor_tp_batch(self, base_keys, tensors_list, config, upsert, tp_size, split_dim):
        base_keys = list(base_keys)
        tensors = list(tensors_list)
        if tp_size <= 1:
            return self._tensor_batch(base_keys, tensors, config, upsert)
        if not base_keys or len(base_keys) != len(tensors):
            return [INVALID_PARAMS] * len(base_keys)
        return self._write_shards(base_keys, tensors, config, upsert, tp_size, split_dim)

    def put_tensor(self, key, tensor):
        """Stores a tensor (torch or numpy) in the reference's format; 0 or a code (-600 for
        anything that is not a tensor of a supported dtype)."""
        return self._write_tensors([key], [tensor], None, False)[0]

    def upsert_tensor(self, key, tensor):
        return self._write_tensors([key], [tensor], None, True)[0]

    def pub_tensor(self, key, tensor, config=None):
        """``put_tensor`` with a :class:`ReplicateConfig`."""
        return self._write_tensors([key], [tensor], config, False)[0]

    def upsert_pub_tensor(self, key, tensor, config=None):
        return self._write_tensors([key], [tensor], config, True)[0]

    def batch_put_tensor(self, keys, tensors_list):
        """One code per key; mismatched lengths give -600 for every key."""
        return self._tensor_batch(keys, tensors_list, None, False)

    def batch_upsert_tensor(self, keys, tensors_list):
        return self._tensor_batch(keys, tensors_list, None, True)

    def batch_pub_tensor(self, keys, tensors_list, config=None):
        return self._tensor_batch(keys, tensors_list, config, False)

    def batch_upsert_pub_tensor(self, keys, tensors_list, config=None):
        return self._tensor_batch(keys, tensors_list, config, True)

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0):
        """Splits the tensor into ``tp_size`` uniform shards along ``split_dim`` and stores every
        shard under ``<key>_tp_<rank>`` (``tp_rank`` is not used by puts, as in the reference);
        0, or the first shard's code (-600 when the dimension does not divide)."""
        return self._tensor_tp(key, tensor, None, False, tp_size, split_dim)

    def pub_tensor_with_tp(self, key, tensor, config=None, tp_rank=0, tp_size=1, split_dim=0):
        return self._tensor_tp(key, tensor, config, False, tp_size, split_dim)

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1,
                                 split_dim=0):
        return self._tensor_tp_batch(base_keys, tensors_list, None, False, tp_size, split_dim)

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None, tp_rank=0,
                                 tp_size=1, split_dim=0):
        return self._tensor_tp_batch(base_keys, tensors_list, config, False, tp_size, split_dim)

    def save_tensor_to_safetensor(self, key, file_name=None):
        """Writes the tensor stored under ``key`` to a safetensors file (``file_name``, or the
        key), under the key's name; 0, -1100 (FILE_NOT_FOUND) when no tensor is stored there,
        -600 when the file cannot be written or ``safetensors`` is not installed."""
        if not self._core.get_hostname():
            return INVALID_PARAMS
        tensor = self.get_tensor(key)
        if tensor is None:
            return FILE_NOT_FOUND
        try:
            from safetensors.torch import save_file

            save_file({key: tensor}, key if file_name is None else file_name)
            return 0
        except Exception as e:  # noqa: BLE001 (the reference answers every failure with -600)
            log.error("save_tensor_to_safetensor(%r): %s", key, e)
            return INVALID_PARAMS

    def load_tensor_from_safetensor(self, key=None, file_name=None):
        """Stores a tensor of a safetensors file under ``key`` (or the file name) and returns
        it: the entry named ``key``, else the file's first entry; None on any failure."""
        if file_name is None or not self._core.get_hostname():
            return None
        try:
            from safetensors.torch import load_file

            loaded = load_file(file_name)
        except Exception as e:  # noqa: BLE001
            log.error("load_tensor_from_safetensor(%r): %s", file_name, e)
            return None
        if not loaded:
            return None
        store_key = file_name if key is None else key
        entry = key if key is not None and key in loaded else next(iter(loaded))
        tensor = loaded[entry]
        return tensor if self.put_tensor(store_key, tensor) == 0 else None

    def get_tensor(self, key):
        """The tensor stored under ``key`` (a copy: torch where it imports, numpy otherwise),
        or None when it is missing or not in the tensor format."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys):
        keys = list(keys)
        if not keys:
            return []
        handles = self._core.batch_get_buffer(keys)
        out = []
        for i, h in enumerate(handles):
            out.append(None if h is None else _tensor().decode_copy(h))
            handles[i] = h = None  # its staging memory goes back now
        return out

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        """The shard of rank ``tp_rank`` (``<key>_tp_<rank>``), or the tensor when
        ``tp_size <= 1``."""
        return self.get_tensor(key if tp_size <= 1 else self._tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1):
        keys = list(base_keys)
        if tp_size > 1:
            keys = [self._tp_key(k, tp_rank) for k in keys]
        return self.batch_get_tensor(keys)

    def get_tensor_into(self, key, buffer_ptr, size):
        """Reads the object into registered memory and returns a tensor that views it (no
        copy: valid while that memory is), or None."""
        buffer_ptr = int(buffer_ptr)
        if not buffer_ptr:
            return None
        n = self._core.get_into(key, buffer_ptr, int(size))
        return _tensor().decode_at(buffer_ptr, n) if n >= 0 else None

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        """A tensor (viewing its buffer) or None per key; -600 per key for mismatched lengths
        or a null pointer."""
        keys = list(keys)
        if not _keys_ok(keys, buffer_ptrs, sizes) or any(not int(p) for p in buffer_ptrs):
            return [INVALID_PARAMS] * len(keys)
        ptrs = [int(p) for p in buffer_ptrs]
        lengths = self._core.batch_get_into(keys, ptrs, [int(s) for s in sizes])
        return [_tensor().decode_at(p, n) if n >= 0 else None for p, n in zip(ptrs, lengths)]

    def get_tensor_with_tp_into(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        return self.get_tensor_into(
            key if tp_size <= 1 else self._tp_key(key, tp_rank), buffer_ptr, size
        )

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1):
        keys = list(base_keys)
        if tp_size > 1:
            keys = [self._tp_key(k, tp_rank) for k in keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def _from_checked(self, keys, buffer_ptrs, sizes):
        """The pointers and sizes of ``*_tensor_from`` when every buffer holds a valid
        ``[header][payload]`` object, else None."""
        if not _keys_ok(list(keys), buffer_ptrs, sizes):
            return None
        ptrs, lens = [int(p) for p in buffer_ptrs], [int(s) for s in sizes]
        if any(_tensor().parse_at(p, n) is None for p, n in zip(ptrs, lens)):
            return None
        return ptrs, lens

    def put_tensor_from(self, key, buffer_ptr, size):
        """Stores registered memory already laid out as ``[header][payload]`` (zero copy);
        -600 when it does not hold a valid header."""
        return self._tensor_from([key], [buffer_ptr], [size], False)[0]

    def upsert_tensor_from(self, key, buffer_ptr, size):
        return self._tensor_from([key], [buffer_ptr], [size], True)[0]

    def batch_put_tensor_from(self, keys, buffer_ptrs, sizes):
        """One code per key; any invalid buffer gives -600 for every key (as the reference)."""
        return self._tensor_from(keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_from(self, keys, buffer_ptrs, sizes):
        return self._tensor_from(keys, buffer_ptrs, sizes, True)

    def _tensor_from(self, keys, buffer_ptrs, sizes, upsert):
        keys = list(keys)
        if not keys:
            return []
        checked = self._from_checked(keys, buffer_ptrs, sizes)
        if checked is None:
            return [INVALID_PARAMS] * len(keys)
        return self._core.batch_put_from(keys, checked[0], checked[1], None, upsert)

    # ----- the parallelism family: whole tensors ------------------------------------------
    # The reference's newer TensorParallelism / writer-partition layouts (several axes, manifest
    # objects) are not built; without them these calls store and read whole tensors exactly as
    # the reference does, and a request that names a layout is refused with -1012.

    @staticmethod
    def _whole(op, *layouts):
        """Whether the request names no layout; logs the refusal otherwise."""
        named = [x for x in layouts if x is not None and not (isinstance(x, (list, tuple))
                                                              and all(v is None for v in x))]
        if named:
            log.error("%s: TensorParallelism / writer_partition layouts are not supported "
                      "by kvfs (docs/mooncake-compat.md)", op)
        return not named

    def put_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None,
                                    writer_partition=None):
        if not self._whole("put_tensor_with_parallelism", parallelism, writer_partition):
            return NOT_SUPPORTED
        return self._write_tensors([key], [tensor], config, False)[0]

    def upsert_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None,
                                       writer_partition=None):
        if not self._whole("upsert_tensor_with_parallelism", parallelism, writer_partition):
            return NOT_SUPPORTED
        return self._write_tensors([key], [tensor], config, True)[0]

    def batch_put_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None,
                                          config=None, writer_partitions=None):
        if not self._whole("batch_put_tensor_with_parallelism", parallelisms, writer_partitions):
            return [NOT_SUPPORTED] * len(list(keys))
        return self._tensor_batch(keys, tensors_list, config, False)

    def batch_upsert_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None,
                                             config=None, writer_partitions=None):
        if not self._whole("batch_upsert_tensor_with_parallelism", parallelisms,
                           writer_partitions):
            return [NOT_SUPPORTED] * len(list(keys))
        return self._tensor_batch(keys, tensors_list, config, True)

    def put_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None,
                                         config=None, writer_partition=None):
        if not self._whole("put_tensor_with_parallelism_from", parallelism, writer_partition):
            return NOT_SUPPORTED
        return self._tensor_from([key], [buffer_ptr], [size], False)[0]

    def upsert_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None,
                                            config=None, writer_partition=None):
        if not self._whole("upsert_tensor_with_parallelism_from", parallelism, writer_partition):
            return NOT_SUPPORTED
        return self._tensor_from([key], [buffer_ptr], [size], True)[0]

    def batch_put_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, parallelisms=None,
                                               config=None, writer_partitions=None):
        if not self._whole("batch_put_tensor_with_parallelism_from", parallelisms,
                           writer_partitions):
            return [NOT_SUPPORTED] * len(list(keys))
        return self._tensor_from(keys, buffer_ptrs, sizes, False)

    def batch_upsert_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes,
                                                  parallelisms=None, config=None,
                                                  writer_partitions=None):
        if not self._whole("batch_upsert_tensor_with_parallelism_from", parallelisms,
                           writer_partitions):
            return [NOT_SUPPORTED] * len(list(keys))
        return self._tensor_from(keys, buffer_ptrs, sizes, True)

    @staticmethod
    def _as_stored(target):
        mode = getattr(target, "mode", "as_stored") if target is not None else "as_stored"
        return mode == "as_stored" and getattr(target, "parallelism", None) is None

    def get_tensor_with_parallelism(self, key, target=None):
        """The tensor as stored (``target`` None or ``ReadTarget("as_stored")``); None for a
        target that asks for a reshard (not supported)."""
        return self.get_tensor(key) if self._as_stored(target) else None

    def batch_get_tensor_with_parallelism(self, keys, targets=None):
        keys = list(keys)
        targets = [None] * len(keys) if targets is None else list(targets)
        return [self.get_tensor(k) if self._as_stored(t) else None
                for k, t in zip(keys, targets)]

    def get_tensor_with_parallelism_into(self, key, buffer_ptr, size, target=None):
        return self.get_tensor_into(key, buffer_ptr, size) if self._as_stored(target) else None

    def batch_get_tensor_with_parallelism_into(self, keys, buffer_ptrs, sizes, targets=None):
        keys = list(keys)
        if targets is not None and not all(self._as_stored(t) for t in targets):
            return [None] * len(keys)
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    def put_tensor_with_tp_from(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        """Splits the full tensor in registered memory (``[header][payload]``) into shards as
        ``put_tensor_with_tp`` does."""
        if tp_size <= 1:
            return self.put_tensor_from(key, buffer_ptr, size)
        tensor = _tensor().decode_at(int(buffer_ptr), int(size)) if int(buffer_ptr) else None
        if tensor is None:
            return INVALID_PARAMS
        return self._tensor_tp(key, tensor, None, False, tp_size, split_dim)

    def batch_put_tensor_with_tp_from(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1,
                                      split_dim=0):
        base_keys = list(base_keys)
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        if not base_keys or not _keys_ok(base_keys, buffer_ptrs, sizes):
            return [INVALID_PARAMS] * len(base_keys)
        out = [INVALID_PARAMS] * len(base_keys)
        todo, tensors = [], []
        for i, (p, n) in enumerate(zip(buffer_ptrs, sizes)):
            t = _tensor().decode_at(int(p), int(n)) if int(p) else None
            if t is not None:
                todo.append(i)
                tensors.append(t)
        codes = self._write_shards([base_keys[i] for i in todo], tensors, None, False, tp_size,
                                   split_dim)
        for i, c in zip(todo, codes):
            out[i] = c
        return out


def _with_group_ids(config, group_ids):
    """A copy of a ReplicateConfig-like object with other ``group_ids`` (one per shard)."""
    copy = ReplicateConfig()
    for name in ReplicateConfig.__slots__:
        if name == "_soft_pin_ttl_ms":
            copy.soft_pin_ttl_ms = getattr(config, "soft_pin_ttl_ms", None)
        elif hasattr(config, name):
            setattr(copy, name, getattr(config, name))
    copy.group_ids = list(group_ids)
    return copy


# ----- leaving the pool at exit -----------------------------------------------------------

# Every store of this process (weakly: a collected store has already left in its destructor).
_LIVE = weakref.WeakSet()
_PID = os.getpid()


def _exit_budget_s():
    try:
        return max(0.1, int(os.environ.get("KVFS_EXIT_CLOSE_TIMEOUT_MS", "5000")) / 1000)
    except ValueError:
        return 5.0


def _close_all_at_exit():
    """Closes every store still open, within one budget for all of them, so the master stops
    placing on this process's segments now instead of after their TTL."""
    if os.getpid() != _PID:
        return  # a forked child: the stores are the parent's
    deadline = time.monotonic() + _exit_budget_s()
    for store in list(_LIVE):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            store._core.close(max(1, int(left * 1000)))
        except Exception:  # noqa: BLE001 - exit must go on
            log.debug("closing a store at exit failed", exc_info=True)


atexit.register(_close_all_at_exit)
