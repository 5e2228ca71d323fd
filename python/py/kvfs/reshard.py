"""Model weights between parallel layouts, through the kvfs pool (kvfs-reshard).

A model is described once, as the JSON spec ``kvfs reshard`` reads: each tensor's name,
global shape, dtype and itemsize, and how a layout places it (``tp_dim``: the dimension TP
splits; ``ep_dim``: the one EP splits; ``layer``: ``[layer, layers]``, owned by one PP stage).
A layout is ``"tp4/pp2/ep8/dp2"``; participant ``((d*pp + p)*ep + e)*tp + t`` holds the
fragments :meth:`Model.fragments` lists.

Every participant of the layout a job trained in calls :meth:`Model.store` with its
fragments, then one calls :meth:`Model.commit`; any participant of any other layout calls
:meth:`Model.load` and gets its fragments of that layout, byte for byte::

    m = reshard.Model(spec)
    m.store(client, "llama-8b", "tp2/pp2", rank, {"l0.qkv": arr, ...})
    m.commit(client, "llama-8b", "tp2/pp2")
    mine = m.load(client, "llama-8b", "tp4", rank)   # {"l0.qkv": ndarray, ...}

Failures raise :class:`ReshardError` with ``kind`` (``coverage_gap``, ``overlap``,
``mismatch``, ``limit``, ``not_found``, ``invalid_argument``, ``store``, ...).
"""

import json

import numpy as np

from kvfs import _native
from kvfs._errors import KvfsError

__all__ = ["Model", "ReshardError"]

_NP = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
       "bfloat16": np.uint16, "int8": np.int8, "uint8": np.uint8, "int32": np.int32,
       "int64": np.int64}


class ReshardError(KvfsError):
    """A reshard call failed; ``kind`` says how."""


def _error(kind, message):
    return ReshardError(message, kind=kind)


class Model:
    """A model's tensors and how layouts place them (a spec dict, or its JSON)."""

    def __init__(self, spec):
        self._json = spec if isinstance(spec, str) else json.dumps(spec)
        self._tensors = {t["name"]: t for t in json.loads(self._json)["tensors"]}

    def fragments(self, layout, participant):
        """``{tensor: (offset, shape)}`` of ``participant``'s fragments under ``layout``."""
        return {name: (tuple(off), tuple(shape)) for name, off, shape in
                _native.reshard_fragments(self._json, layout, int(participant))}

    def slice(self, layout, participant, name, full):
        """``participant``'s fragment of tensor ``name`` cut from the whole tensor ``full``."""
        off, shape = self.fragments(layout, participant)[name]
        return full[tuple(slice(o, o + s) for o, s in zip(off, shape))]

    def plan(self, src, dst):
        """What resharding ``src`` -> ``dst`` moves: regions, segments, bytes, remote bytes."""
        return _native.reshard_plan(self._json, src, dst)

    def store(self, client, model, layout, participant, tensors):
        """Stores ``participant``'s fragments (``{tensor: array}``); returns how many went in
        (one DP replica is stored; the others' calls store nothing)."""
        arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
        return _native.reshard_store(client, model,
                                     self._json, layout, int(participant), arrays)

    def commit(self, client, model, layout):
        """Records the model's layout once every participant stored (first layout wins)."""
        _native.reshard_commit(client, model,
                               self._json, layout)

    def load(self, client, model, layout, participant):
        """``{tensor: ndarray}``: ``participant``'s fragments under ``layout`` (bfloat16 as
        uint16 bits)."""
        raw = _native.reshard_load(client, model,
                                   self._json, layout, int(participant))
        frags = self.fragments(layout, participant)
        out = {}
        for name, b in raw.items():
            t = self._tensors[name]
            dt = _NP.get(t["dtype"], {1: np.uint8, 2: np.uint16, 4: np.uint32,
                                      8: np.uint64}[t["itemsize"]])
            out[name] = np.frombuffer(b, dtype=dt).reshape(frags[name][1]).copy()
        return out
