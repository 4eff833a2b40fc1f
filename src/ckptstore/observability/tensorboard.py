"""Optional TensorBoard output: checkpoint timings and sizes as scalars per training step.

``torch.utils.tensorboard.SummaryWriter`` needs the ``tensorboard`` package
(``pip install 'ckptstore[tensorboard]'``). One ``add_scalar`` costs about 0.1 ms (protobuf
encoding), more than a whole metrics observation may cost on the save path, so values are
queued and a daemon thread writes them; :meth:`TensorBoardSink.close` drains the queue.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any

from ckptstore.extras import missing_extra, require

__all__ = ["TensorBoardSink"]

logger = logging.getLogger(__name__)

_STOP = object()
_MAX_QUEUED = 100_000  # bounded: a stuck writer must not grow memory without limit


class TensorBoardSink:
    """Write ``ckpt/<op>/<name>`` scalars to a TensorBoard event file.

    Lifecycle: create it (imports tensorboard, starts the writer thread) → :meth:`log` from
    any thread, cheap → :meth:`close` flushes and stops. Values logged after close are
    dropped.

    Example:
        >>> sink = TensorBoardSink("runs/ckpt")                  # doctest: +SKIP
        >>> sink.log(100, "save", {"seconds": 1.2, "blocked_seconds": 0.1})  # doctest: +SKIP
        >>> sink.close()                                         # doctest: +SKIP
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        """Open a SummaryWriter on ``log_dir``.

        Args:
            log_dir: Directory for the event files (created if missing).

        Raises:
            MissingExtraError: If the 'tensorboard' extra is not installed.
        """
        # torch.utils.tensorboard imports the tensorboard package, which the extra brings;
        # either missing is the same missing extra.
        require("tensorboard", "TensorBoard logging")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise missing_extra("tensorboard", "TensorBoard logging") from exc

        self.log_dir = os.fspath(log_dir)
        self._writer: Any = SummaryWriter(log_dir=self.log_dir)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=_MAX_QUEUED)
        self._closed = False
        self._dropped = 0
        self._thread = threading.Thread(target=self._main, name="ckpt-tensorboard", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Values dropped because the queue was full or the sink closed."""
        return self._dropped

    def log(self, step: int, op: str, values: dict[str, float]) -> None:
        """Queue scalars ``ckpt/<op>/<name>`` at ``step`` (never blocks).

        Args:
            step: The training step (TensorBoard's global step).
            op: Operation name (``save``, ``load``...).
            values: Scalar name → value.
        """
        if self._closed:
            self._dropped += len(values)
            return
        try:
            self._queue.put_nowait((step, op, values))
        except queue.Full:
            self._dropped += len(values)

    def _main(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            if isinstance(item, threading.Event):  # a flush request: all before it is written
                self._writer.flush()
                item.set()
                continue
            step, op, values = item
            try:
                for name, value in values.items():
                    self._writer.add_scalar(f"ckpt/{op}/{name}", value, global_step=step)
            except Exception:  # a broken event file must never break training
                logger.warning("TensorBoard write failed; dropping values", exc_info=True)

    def flush(self, timeout: float = 10.0) -> bool:
        """Write what is queued so far and flush the event file.

        Args:
            timeout: Most seconds to wait for the queue to drain.

        Returns:
            True when everything queued before the call is on disk.
        """
        if self._closed:
            return True
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Drain the queue, flush and close the event file (idempotent).

        Args:
            timeout: Most seconds to wait for queued values to be written.
        """
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._writer.close()
