"""Thin Prefect tasks around ckptstore's operations (retries, logging); no business rules here.

Every task takes an open :class:`ckptstore.CheckpointStore` plus plain values and returns a
JSON-able summary. The operations are imported lazily, so this package imports even when an
optional operation module is missing. Importing it sets Prefect's settings first (telemetry
off; see :mod:`ckptstore.observability.prefect_env`) unless the user set them.
"""

from ckptstore.observability.prefect_env import apply_prefect_defaults

apply_prefect_defaults()  # before the modules below import Prefect

from ckptstore.tasks.archive import archive_task, demote_task  # noqa: E402
from ckptstore.tasks.convert import export_task, import_task  # noqa: E402
from ckptstore.tasks.maintenance import gc_task  # noqa: E402
from ckptstore.tasks.merge import merge_task  # noqa: E402
from ckptstore.tasks.restore import restore_task  # noqa: E402
from ckptstore.tasks.retention import apply_retention_plan_task, plan_retention_task  # noqa: E402
from ckptstore.tasks.verify import verify_task  # noqa: E402

__all__ = [
    "apply_retention_plan_task",
    "archive_task",
    "demote_task",
    "export_task",
    "gc_task",
    "import_task",
    "merge_task",
    "plan_retention_task",
    "restore_task",
    "verify_task",
]
