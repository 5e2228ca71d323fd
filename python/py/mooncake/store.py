"""``mooncake.store``: the reference store's Python module, answered by kvfs.

Re-exports :mod:`kvfs.mooncake`: ``MooncakeDistributedStore``, ``ReplicateConfig``,
``SoftPinAction``, ``ObjectDataType``, ``ReplicaStatus``, ``BufferHandle``,
``MooncakeHostMemAllocator``, ``bind_to_numa_node`` and the replica descriptor classes
(``ReplicaDescriptor``, ``MemoryDescriptor``, ``DiskDescriptor``, ``Descriptor``).
"""

from kvfs.mooncake import *  # noqa: F401,F403
from kvfs.mooncake import __all__  # noqa: F401
