"""Reading checkpoints: load dispatch, progressive restore, prefetch, sweeps, ``show`` views.

Uses the groups below it (:mod:`ckptstore.ops.dcp`, :mod:`ckptstore.ops.sharing` for
signature checks, :mod:`ckptstore.ops.tiering` for restores).
"""
