"""Import shim: ``mooncake.store`` served by kvfs.

Engines written against the reference (``from mooncake.store import MooncakeDistributedStore``)
get :mod:`kvfs.mooncake` unchanged, and ``mooncake.engine`` (``TransferEngine``) runs on the
kvfs Transfer Engine. The reference's PG and EP modules are not provided (see
docs/mooncake-compat.md in the kvfs repository).
"""
