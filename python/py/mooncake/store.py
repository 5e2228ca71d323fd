"""``mooncake.store``: the reference store's Python module, answered by kvfs.

Re-exports :mod:`kvfs.mooncake`: ``MooncakeDistributedStore``, ``ReplicateConfig``,
``SoftPinAction``, ``ObjectDataType``, ``ReplicaStatus`` and ``BufferHandle``.
"""

from kvfs.mooncake import *  # noqa: F401,F403
from kvfs.mooncake import __all__  # noqa: F401
