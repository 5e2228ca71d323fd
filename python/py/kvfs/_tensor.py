"""The reference store's on-store tensor format, and tensors as torch or numpy objects.

An object written by the tensor calls (``put_tensor`` and the rest) is a 304-byte header
followed by the tensor's bytes in C order, laid out as the reference store lays it out, so an
object written by either is read by the other. Little-endian, natural alignment (no padding):

* header, 40 bytes: ``magic`` u32 = 0x4d4f4f4e, ``version`` u16 = 1, ``header_size`` u16 = 304,
  ``dtype`` i32 (``DTYPE_CODES``), ``ndim`` i32 (at most 8), ``layout_kind`` u32 (0 full tensor,
  1 shard), a reserved u32, ``data_offset`` u64 (= 304), ``data_bytes`` u64;
* layout, 264 bytes: ``global_shape`` and ``local_shape`` as 8 i64 each (``-1`` past ``ndim``),
  ``axis_count`` u32, a reserved u32, then 4 axes of 32 bytes: ``kind`` (0 DP, 1 TP, 2 EP, 3 PP),
  ``axis_index``, ``shard_rank``, ``shard_count``, ``split_dim``, a reserved i32 (all i32) and
  an i64 holding the shard's extent along ``split_dim``.

A full tensor has ``global_shape == local_shape`` and no axes. A tensor-parallel shard written
by ``put_tensor_with_tp`` (key ``<key>_tp_<rank>``) has layout 1, the full tensor's shape as
``global_shape``, its own as ``local_shape`` and one TP axis. Shards are uniform: the split
dimension must divide by the TP size.

Tensors are torch tensors where torch imports (it is imported on first use, never required)
and numpy arrays otherwise; puts take either. Without torch, bfloat16 and float8 objects come
back as numpy arrays of those types where ``ml_dtypes`` is installed, and as their raw unsigned
integers (uint16, uint8) where it is not.
"""

import ctypes
import importlib
import struct

import numpy as np

MAGIC = 0x4D4F4F4E
VERSION = 1
HEADER_BYTES = 304
DIMS_MAX = 8
AXES_MAX = 4
LAYOUT_FULL = 0
LAYOUT_SHARD = 1
AXIS_TP = 1

_HEADER = struct.Struct("<IHHiiIIQQ8q8qII" + "iiiiiiq" * AXES_MAX)
assert _HEADER.size == HEADER_BYTES

# The reference's dtype codes, by name (torch's and numpy's names agree for these).
DTYPE_CODES = {
    "float32": 0,
    "float64": 1,
    "int8": 2,
    "uint8": 3,
    "int16": 4,
    "uint16": 5,
    "int32": 6,
    "uint32": 7,
    "int64": 8,
    "uint64": 9,
    "bool": 10,
    "float16": 11,
    "bfloat16": 12,
    "float8_e4m3fn": 13,
    "float8_e5m2": 14,
}
_NAMES = {c: n for n, c in DTYPE_CODES.items()}
_ITEM_BYTES = {0: 4, 1: 8, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 4, 8: 8, 9: 8, 10: 1, 11: 2, 12: 2,
               13: 1, 14: 1}
# numpy has no bfloat16/float8 of its own: their raw storage when ml_dtypes is absent.
_RAW_STORAGE = {12: np.uint16, 13: np.uint8, 14: np.uint8}

_UNSET = object()
_torch_module = _UNSET
_ml_dtypes = _UNSET


def torch():
    """The torch module, or None where it does not import (imported once, on first use)."""
    global _torch_module
    if _torch_module is _UNSET:
        try:
            _torch_module = importlib.import_module("torch")
        except ImportError:
            _torch_module = None
    return _torch_module


def _ml():
    global _ml_dtypes
    if _ml_dtypes is _UNSET:
        try:
            _ml_dtypes = importlib.import_module("ml_dtypes")
        except ImportError:
            _ml_dtypes = None
    return _ml_dtypes


def _numpy_dtype(code):
    name = _NAMES[code]
    if code in _RAW_STORAGE:
        ml = _ml()
        return np.dtype(getattr(ml, name)) if ml is not None else np.dtype(_RAW_STORAGE[code])
    return np.dtype(name)


class Encoded:
    """A tensor ready to store: its dtype code, shape and C-order bytes (a buffer that keeps
    the source alive)."""

    __slots__ = ("code", "shape", "payload", "nbytes", "source")

    def __init__(self, code, shape, payload, nbytes, source):
        self.code, self.shape, self.payload, self.nbytes = code, shape, payload, nbytes
        self.source = source  # the array or tensor the payload views, for slicing shards


def encode(obj):
    """A torch tensor or numpy array as :class:`Encoded`, or None if it is neither, or has a
    dtype the format has no code for, or more than 8 dimensions."""
    t = torch()
    if t is not None and isinstance(obj, t.Tensor):
        x = obj.detach()
        if x.device.type != "cpu":
            x = x.to("cpu")
        x = x.contiguous()
        code = DTYPE_CODES.get(str(x.dtype).rsplit(".", 1)[-1])
        if code is None or x.dim() > DIMS_MAX:
            return None
        nbytes = x.numel() * x.element_size()
        payload = x.reshape(-1).view(t.uint8).numpy() if nbytes else b""
        return Encoded(code, tuple(int(d) for d in x.shape), payload, nbytes, x)
    if isinstance(obj, np.ndarray):
        code = DTYPE_CODES.get(obj.dtype.name)
        if code is None or obj.ndim > DIMS_MAX:
            return None
        a = obj if obj.dtype.isnative else obj.astype(obj.dtype.newbyteorder("="))
        a = np.ascontiguousarray(a).reshape(obj.shape)
        payload = a.reshape(-1).view(np.uint8) if a.nbytes else b""
        return Encoded(code, tuple(int(d) for d in a.shape), payload, a.nbytes, a)
    return None


def header(enc, global_shape=None, axes=()):
    """The 304-byte header of ``enc``: a full tensor, or with ``global_shape`` a shard whose
    ``axes`` are ``(kind, shard_rank, shard_count, split_dim)`` tuples."""
    ndim = len(enc.shape)
    full = global_shape is None
    dims = lambda shape: list(shape) + [-1] * (DIMS_MAX - len(shape))  # noqa: E731
    fields = [MAGIC, VERSION, HEADER_BYTES, enc.code, ndim, LAYOUT_FULL if full else LAYOUT_SHARD,
              0, HEADER_BYTES, enc.nbytes]
    fields += dims(enc.shape if full else global_shape) + dims(enc.shape)
    fields += [len(axes), 0]
    for i in range(AXES_MAX):
        if i < len(axes):
            kind, rank, count, split_dim = axes[i]
            extent = enc.shape[split_dim] if 0 <= split_dim < ndim else -1
            fields += [kind, i, rank, count, split_dim, 0, extent]
        else:
            fields += [0, 0, 0, 0, 0, 0, 0]
    return _HEADER.pack(*fields)


class Parsed:
    """A checked header: dtype code, the stored tensor's (local) shape, where its bytes are."""

    __slots__ = ("code", "shape", "data_offset", "data_bytes", "layout_kind", "global_shape")

    def __init__(self, code, shape, data_offset, data_bytes, layout_kind, global_shape):
        self.code, self.shape = code, shape
        self.data_offset, self.data_bytes = data_offset, data_bytes
        self.layout_kind, self.global_shape = layout_kind, global_shape


def parse(head, total):
    """Checks a header (the first 304 bytes of an object of ``total`` bytes) as the reference
    does; returns :class:`Parsed`, or None for anything it would refuse."""
    if total < HEADER_BYTES or len(head) < HEADER_BYTES:
        return None
    f = _HEADER.unpack_from(head, 0)
    magic, version, header_size, code, ndim, layout, _, data_offset, data_bytes = f[:9]
    global_shape, local_shape = f[9:17], f[17:25]
    axis_count = f[25]
    if magic != MAGIC or version != VERSION or header_size != HEADER_BYTES:
        return None
    if code not in _NAMES or not 0 <= ndim <= DIMS_MAX or axis_count > AXES_MAX:
        return None
    if layout > LAYOUT_SHARD or not HEADER_BYTES <= data_offset <= total:
        return None
    if data_bytes != total - data_offset:
        return None
    if any(d < 0 for d in global_shape[:ndim] + local_shape[:ndim]):
        return None
    if any(d != -1 for d in global_shape[ndim:] + local_shape[ndim:]):
        return None
    numel = 1
    for d in local_shape[:ndim]:
        numel *= d
    if numel * _ITEM_BYTES[code] != data_bytes:
        return None
    for i in range(axis_count):
        kind, _, rank, count, split_dim = f[27 + 7 * i: 32 + 7 * i]
        if not 0 <= kind <= 4 or count <= 0 or not 0 <= rank < count:
            return None
        if not -1 <= split_dim < ndim:
            return None
    return Parsed(code, tuple(local_shape[:ndim]), data_offset, data_bytes, layout,
                  tuple(global_shape[:ndim]))


def build(parsed, u8):
    """The tensor whose bytes are the uint8 array ``u8`` (used as is: a copy, or a view of the
    caller's memory): torch where it imports, numpy otherwise."""
    t = torch()
    if t is not None:
        dtype = getattr(t, _NAMES[parsed.code], None)
        if dtype is None:
            return None
        if parsed.data_bytes == 0:
            return t.empty(parsed.shape, dtype=dtype)
        return t.from_numpy(u8).view(dtype).reshape(parsed.shape)
    return u8.view(_numpy_dtype(parsed.code)).reshape(parsed.shape)


def decode_copy(buf):
    """The tensor stored in a buffer-protocol object holding a whole object (its bytes are
    copied, so ``buf`` can go), or None."""
    view = memoryview(buf)
    if view.nbytes < HEADER_BYTES:
        return None
    parsed = parse(view[:HEADER_BYTES], view.nbytes)
    if parsed is None:
        return None
    if parsed.data_bytes == 0:
        return build(parsed, np.empty(0, dtype=np.uint8))
    raw = np.frombuffer(view, dtype=np.uint8, count=parsed.data_bytes, offset=parsed.data_offset)
    return build(parsed, raw.copy())


def memory_at(ptr, size):
    """A writable uint8 array over ``size`` bytes at address ``ptr`` (no copy)."""
    if size == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))


def parse_at(ptr, size):
    """The checked header of an object of ``size`` bytes at address ``ptr``, or None."""
    if not ptr or size < HEADER_BYTES:
        return None
    return parse(ctypes.string_at(ptr, HEADER_BYTES), size)


def decode_at(ptr, size):
    """The tensor stored at ``ptr`` (``size`` bytes), viewing that memory (no copy), or None."""
    parsed = parse_at(ptr, size)
    if parsed is None:
        return None
    return build(parsed, memory_at(ptr + parsed.data_offset, parsed.data_bytes))


def shard_range(extent, rank, count):
    """Start and length of shard ``rank`` of ``count`` along a dimension of ``extent``."""
    start = extent * rank // count
    return start, extent * (rank + 1) // count - start


def split(enc, tp_size, split_dim):
    """The ``tp_size`` uniform shards of ``enc`` along ``split_dim`` as :class:`Encoded`, or
    None where the reference refuses (split dimension out of range or not divisible)."""
    shape = enc.shape
    if tp_size <= 0 or not 0 <= split_dim < len(shape) or shape[split_dim] % tp_size:
        return None
    out = []
    for rank in range(tp_size):
        start, length = shard_range(shape[split_dim], rank, tp_size)
        src = enc.source
        t = torch()
        if t is not None and isinstance(src, t.Tensor):
            part = src.narrow(split_dim, start, length).contiguous()
        else:
            index = (slice(None),) * split_dim + (slice(start, start + length),)
            part = np.ascontiguousarray(src[index])
        shard = encode(part)
        if shard is None:
            return None
        out.append(shard)
    return out
