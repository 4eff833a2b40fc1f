"""Copies of a checkpoint across tiers and hosts: where they are, moving and deleting them.

``replicas`` (manifests per tier, chunk references, safe deletes), ``parts`` (checkpoints
saved across hosts), ``archive`` (hot -> warm, demote), ``restore`` (into the hot tier from
the fastest verified copy), ``thaw``/``thaw_poll`` (archival copies), ``reencode`` (copies in
another codec), ``gc`` (dead saves) and ``retention/`` (plan, then apply). Uses
:mod:`ckptstore.ops.writing` and the leases, never the groups above it.
"""
