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
* ``local_buffer_size`` bounds the bytes the bytes API (``put``/``get``) stages at once.

Every call releases the GIL and ends within ``KVFS_CALL_TIMEOUT_MS`` (default 60 s). Where kvfs
differs from the reference, docs/mooncake-compat.md says how.
"""

import ctypes
import enum
import logging
import os
import re

from kvfs._native import BufferHandle, ERROR_CODES, MooncakeCore

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "ObjectDataType",
    "ReplicaStatus",
    "BufferHandle",
    "ERROR_CODES",
    "parse_size",
]

log = logging.getLogger("kvfs.mooncake")

OK = 0
INVALID_PARAMS = ERROR_CODES["INVALID_PARAMS"]
NOT_SUPPORTED = ERROR_CODES["NOT_SUPPORTED"]
OBJECT_NOT_FOUND = ERROR_CODES["OBJECT_NOT_FOUND"]

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
    kvfs extension: ``persistence`` ("none", "lazy", "eager") asks the nodes to write the object
    back to object storage.
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
            f"persistence={self.persistence!r})"
        )

    __repr__ = __str__


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
    return (replicas, pin, persistence, strategy, preferred)


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


def _keys_ok(keys, *lists):
    return all(len(x) == len(keys) for x in lists)


class MooncakeDistributedStore:
    """The reference store class (see the module docstring for the conventions)."""

    def __init__(self):
        self._core = MooncakeCore()

    # ----- setup / lifecycle -------------------------------------------------------------

    def setup(self, *args, **kwargs):
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config: dict)``; returns 0 or an error code."""
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
            str(cfg.get("master_server_addr", "127.0.0.1:50051")),
            enable_ssd_offload=str(cfg.get("enable_ssd_offload", "false")).lower()
            in ("1", "true", "yes"),
            tenant_id=str(cfg.get("tenant_id", "default")),
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
    ):
        try:
            segment = parse_size(global_segment_size)
            local_buffer = parse_size(local_buffer_size)
        except ValueError as e:
            log.error("setup: %s", e)
            return INVALID_PARAMS
        if not isinstance(local_hostname, str) or not local_hostname:
            log.error("setup: local_hostname must be a non-empty string")
            return INVALID_PARAMS
        master = str(master)
        if "://" in master:
            log.error("setup: %s: kvfs has one master; give its host:port", master)
            return NOT_SUPPORTED
        if enable_ssd_offload:
            log.warning("setup: enable_ssd_offload is ignored; kvfs nodes own their NVMe tier")
        if tenant_id not in ("", "default"):
            log.warning("setup: tenant_id %r is ignored; kvfs has one namespace", tenant_id)
        del metadata_server  # kvfs engines always handshake peer to peer (P2PHANDSHAKE)
        return self._core.setup(
            local_hostname,
            master,
            segment,
            local_buffer,
            tcp_only=_tcp_only(protocol),
            timeout_ms=_timeout_ms(),
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
        return self._core.close()

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

    def remove_by_regex(self, regex_pattern, force=False):
        """Objects removed, or a negative code (bad pattern: -600)."""
        return self._core.remove_by_regex(regex_pattern, force)

    def remove_all(self, force=False):
        """Objects removed; leased (and hard-pinned) ones stay unless ``force``."""
        return self._core.remove_all(force)
