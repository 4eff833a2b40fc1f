"""Keeping a store healthy and its contents usable: verify, doctor, compact, diff, convert.

Also the training-metric series of a run (``history``) and merging checkpoints
(``merge/``). The top group of
:mod:`ckptstore.ops`: it may use every other group.
"""
