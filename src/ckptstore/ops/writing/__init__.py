"""Writing checkpoints: the save transaction and what feeds it.

``save`` (the transaction), ``async_save`` (background saves), ``staging`` (reused host
buffers), ``delta`` (choosing a save's base and encoding) and ``memory`` (the shared-memory
copies of the memory tier). Nothing here imports another group of :mod:`ckptstore.ops`.
"""
