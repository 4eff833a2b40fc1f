"""Business operations on a store: archive, restore, verify, retention, convert.

Plain functions over a CheckpointStore; Prefect tasks and flows in ckptstore.tasks/flows only
orchestrate them. Nothing here imports prefect.
"""
