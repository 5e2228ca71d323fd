"""Import shim: ``mooncake.store`` served by kvfs.

Engines written against the reference (``from mooncake.store import MooncakeDistributedStore``)
get :mod:`kvfs.mooncake` unchanged. Only the store module is provided; the reference's Transfer
Engine, PG and EP modules are not (see docs/mooncake-compat.md in the kvfs repository).
"""
