"""Plain checkpoint files in and out: ``.pt``/``.bin``, safetensors, Hugging Face and DCP folders.

Nothing here touches a store: these modules read and write files on their own, using only the
base modules and :mod:`ckptstore.format` (for the key and skeleton rules). The operations
that move checkpoints between a store and these files (export, import, codec conversion) are
in :mod:`ckptstore.ops.upkeep.convert`.

* :mod:`~ckptstore.convert.readers`: safe readers of every input format (never unpickle code).
* :mod:`~ckptstore.convert.writers`: atomic writers of ``.pt`` files, safetensors files and
  HF folders.
* :mod:`~ckptstore.convert.safetensors`: the safetensors file layout, a streaming writer
  and the HF sharding plan.
* :mod:`~ckptstore.convert.dcp_read` / :mod:`~ckptstore.convert.dcp_write`: reading
  ``torch.distributed.checkpoint`` folders without pickle, writing them from a tensor stream.
* :mod:`~ckptstore.convert.directory`: ``ckpt convert --input-dir D --output-dir O``.
* :mod:`~ckptstore.convert.heap`: hands freed tensor memory back to the OS while streaming.
"""
