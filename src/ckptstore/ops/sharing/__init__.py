"""Checkpoints crossing to and from other stores: remotes, push/pull/sync, bundles, signatures.

Everything that arrives through this group comes from outside the store and is verified
against the manifest's digests before it is committed (docs/REMOTES.md). Uses
:mod:`ckptstore.ops.tiering` and :mod:`ckptstore.ops.writing`.
"""
