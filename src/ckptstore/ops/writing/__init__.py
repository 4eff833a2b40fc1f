"""Writing checkpoints: the save transaction and what feeds it.

``save`` (the transaction), ``async_save`` (background saves), ``staging`` (reused host
buffers), ``delta`` (choosing a save's base and encoding), ``memory`` (the shared-memory
copies of the memory tier), ``snapshot`` (the state in reused shared-memory slots every few
steps) and ``snapshot_peer`` (snapshots replicated to a neighbour node). Nothing here
imports another group of :mod:`ckptstore.ops`.
"""
