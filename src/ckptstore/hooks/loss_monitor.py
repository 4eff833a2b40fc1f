"""LossMonitor: save (or alert) when the training loss turns unstable.

The monitor watches one number per step. It fires when the loss is NaN or infinite, or when
the newest value breaks away from the recent trend of the loss (a spike). A slow, steady
drift, which is what a healthy loss does, does not fire. See :class:`LossMonitor` for the
exact rule.

Example:
    >>> monitor = LossMonitor(window_size=100, threshold=0.05, manager=mgr)  # doctest: +SKIP
    >>> for step in range(start, steps):                                    # doctest: +SKIP
    ...     loss = train_step()
    ...     monitor.update(step, loss)  # first: an anomaly save counts as this step's save
    ...     mgr.step(step, state_fn, metrics={"loss": loss})
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ckptstore.errors import CkptError, ConfigError
from ckptstore.names import validate_metric_name
from ckptstore.ops.upkeep.history import MetricHistory

if TYPE_CHECKING:
    from ckptstore.hooks.manager import CheckpointManager, StateFn
    from ckptstore.ops.writing.async_save import SaveHandle
    from ckptstore.records import Checkpoint
    from ckptstore.store import CheckpointStore

__all__ = ["Anomaly", "LossMonitor", "spike_reason"]

logger = logging.getLogger(__name__)

#: Smallest magnitude the relative deviation divides by (a loss near 0 is not "infinitely" off).
EPS = 1e-8
#: Converts a median absolute deviation into a standard deviation for normal noise.
MAD_TO_SIGMA = 1.4826
#: Tag put on anomaly checkpoints.
ANOMALY_TAG = "anomaly"


@dataclass(frozen=True)
class Anomaly:
    """One firing of the monitor.

    Attributes:
        step: Training step.
        loss: The loss value that fired.
        reason: Why, in words.
        kind: ``"nonfinite"`` or ``"spike"``.
    """

    step: int
    loss: float
    reason: str
    kind: str


def spike_reason(
    window: Sequence[float],
    loss: float,
    *,
    threshold: float,
    sigmas: float,
    direction: Literal["up", "both"] = "both",
) -> str | None:
    """Whether ``loss`` breaks away from the trend of ``window`` (oldest first); why if so.

    Rule (all three must hold):

    1. **Relative jump**: ``abs(loss - pred) / max(abs(pred), EPS) > threshold``, where
       ``pred`` extrapolates a robust line through the window to the next position. The line
       goes through the medians of the window's first and second halves (a median-based
       two-group slope), so one earlier spike inside the window barely moves it, and a
       steady drift is predicted instead of being mistaken for a jump.
    2. **Beyond the noise**: ``abs(loss - pred) > sigmas * sigma``, with ``sigma`` the
       median absolute deviation of the window's residuals around that line times 1.4826
       (the standard deviation for normal noise). A noisy loss needs a bigger jump.
    3. **Outside the window's range**: ``loss > max(window)`` (upward) or
       ``loss < min(window)`` (downward; only with ``direction="both"``).

    Args:
        window: Recent finite losses, oldest first (at least 4).
        loss: The newest loss (finite).
        threshold: Relative deviation that counts as a jump (0.05 = 5%).
        sigmas: How many noise standard deviations a jump must also exceed.
        direction: ``"up"`` fires on increases only; ``"both"`` also on sudden drops.

    Returns:
        A human-readable reason, or None when the loss is in line with the window.
    """
    low, high = float(min(window)), float(max(window))
    # Rule 3 first: it is the cheapest and rejects almost every step of a healthy loss.
    if not (loss > high or (direction == "both" and loss < low)):
        return None
    x = np.asarray(window, dtype=np.float64)
    n = x.size
    half = n // 2
    first = float(np.median(x[:half]))
    second = float(np.median(x[n - half :]))
    # Centres (positions) of the two halves; the new value sits at position n.
    c_first = (half - 1) / 2
    c_second = n - half + (half - 1) / 2
    slope = (second - first) / (c_second - c_first)
    pred = second + slope * (n - c_second)
    residuals = x - (second + slope * (np.arange(n) - c_second))
    sigma = MAD_TO_SIGMA * float(np.median(np.abs(residuals - np.median(residuals))))
    deviation = loss - pred
    relative = abs(deviation) / max(abs(pred), EPS)
    if relative <= threshold or abs(deviation) <= sigmas * sigma:
        return None
    if loss > high:
        return (
            f"loss {loss:.6g} jumped {relative:.1%} above the trend ({pred:.6g}) of the last "
            f"{n} steps (threshold {threshold:.1%}, noise sigma {sigma:.3g})"
        )
    if direction == "both" and loss < low:
        return (
            f"loss {loss:.6g} dropped {relative:.1%} below the trend ({pred:.6g}) of the last "
            f"{n} steps (threshold {threshold:.1%}, noise sigma {sigma:.3g})"
        )
    return None


class LossMonitor:
    """Watch the loss; save or alert when it turns NaN/inf or spikes.

    Firing rule, checked by :meth:`update` for each value:

    * a NaN or infinite loss fires at once (even before the window is full); it is not added
      to the window;
    * otherwise, once ``window_size`` finite values were seen, the value fires when
      :func:`spike_reason` finds it breaks away from the window's trend by more than
      ``threshold`` (relative), more than ``sigmas`` noise deviations, and lies outside the
      window's range. Every finite value then joins the window.
    * after firing, the same kind (``nonfinite`` or ``spike``) does not fire again for
      ``cooldown`` steps (default ``window_size``).

    Actions: ``"save"`` saves the state at once tagged ``anomaly`` and pinned (so retention
    keeps it), through ``manager.save_now`` or else ``store.save``; ``"alert"`` only reports.
    Both log a warning and call ``on_alert(step, loss, reason)`` when given.

    Every finite loss is recorded as the run's metric history and every firing as a
    ``loss-anomaly`` event (``history=True``, the default), so ``ckpt ui`` draws the curve
    with the alerts on it.

    Attributes:
        anomalies: The most recent firings (up to 100).
        last_checkpoint: The checkpoint (or pending handle) of the last anomaly save.
        history: The recorder the losses and alerts go to, if any.
    """

    def __init__(
        self,
        window_size: int = 100,
        threshold: float = 0.05,
        action: Literal["save", "alert"] = "save",
        on_alert: Callable[[int, float, str], None] | None = None,
        store: CheckpointStore | None = None,
        run: str | None = None,
        state_fn: StateFn | None = None,
        manager: CheckpointManager | None = None,
        *,
        cooldown: int | None = None,
        sigmas: float = 5.0,
        direction: Literal["up", "both"] = "both",
        history: bool = True,
        metric: str = "loss",
    ) -> None:
        """Create a monitor.

        Args:
            window_size: Number of recent finite losses compared against (at least 4).
            threshold: Relative jump that counts as unstable (0.05 = 5%).
            action: ``"save"`` or ``"alert"``.
            on_alert: Called with ``(step, loss, reason)`` whenever the monitor fires.
            store: Store to save into when there is no manager.
            run: Run to save under when there is no manager.
            state_fn: Builds the state to save (with a manager, defaults to the one last
                passed to ``manager.step``).
            manager: A :class:`CheckpointManager` to save through.
            cooldown: Steps during which the same kind does not fire again.
            sigmas: Noise standard deviations a spike must also exceed.
            direction: ``"up"`` ignores sudden drops; ``"both"`` reports them too.
            history: Record every finite loss as the run's metric history and every firing
                as a ``loss-anomaly`` event of the run, batched off the training path:
                through ``manager.history`` with a manager, else through a recorder of
                the monitor's own when ``store`` and ``run`` are given (written when its
                buffer fills, at each firing and by :meth:`close`). Without a run there
                is nothing to record against.
            metric: Name of the series the loss is recorded under.

        Raises:
            ConfigError: For an invalid window, threshold, action, or a ``"save"`` action
                with neither a manager nor a store, run and state_fn.
            InvalidNameError: For an invalid ``metric`` name.
        """
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 4:
            raise ConfigError(f"window_size must be an int >= 4, got {window_size!r}")
        if not threshold > 0:
            raise ConfigError(f"threshold must be positive, got {threshold!r}")
        if action not in ("save", "alert"):
            raise ConfigError(f"action must be 'save' or 'alert', got {action!r}")
        if direction not in ("up", "both"):
            raise ConfigError(f"direction must be 'up' or 'both', got {direction!r}")
        standalone = store is not None and run is not None and state_fn is not None
        if action == "save" and manager is None and not standalone:
            raise ConfigError(
                "LossMonitor(action='save') needs manager=, or store=, run= and state_fn=; "
                "pass them or use action='alert'"
            )
        self.window_size = window_size
        self.threshold = threshold
        self.action = action
        self.on_alert = on_alert
        self.store = store
        self.run = run
        self.state_fn = state_fn
        self.manager = manager
        self.cooldown = window_size if cooldown is None else cooldown
        self.sigmas = sigmas
        self.direction: Literal["up", "both"] = direction
        self.metric = validate_metric_name(metric)
        self.history: MetricHistory | None = None
        self._own_history = False
        if history:
            if manager is not None:
                self.history = manager.history
            elif store is not None and run is not None:
                store.run(run)
                self.history = MetricHistory(store, run)
                self._own_history = True
        self._window: deque[float] = deque(maxlen=window_size)
        self._last_fired: dict[str, int] = {}
        self.anomalies: deque[Anomaly] = deque(maxlen=100)
        self.last_checkpoint: Checkpoint | SaveHandle | None = None

    def update(self, step: int, loss: Any) -> bool:
        """Feed the loss of ``step``; act if it is unstable.

        Args:
            step: Training step.
            loss: A number or a one-element tensor.

        Returns:
            True when the monitor fired at this step.

        Raises:
            ConfigError: If it must save through a manager that has no state function yet.
        """
        value = float(loss)
        if self.history is not None:
            # Before the manager's own step(): this records the value, the manager's copy of
            # the same step is then ignored.
            self.history.add(step, value, self.metric)
        if not math.isfinite(value):
            kind, reason = "nonfinite", f"loss is {value}"
        else:
            kind = "spike"
            reason = None
            if len(self._window) == self.window_size:
                reason = spike_reason(
                    self._window,
                    value,
                    threshold=self.threshold,
                    sigmas=self.sigmas,
                    direction=self.direction,
                )
            self._window.append(value)
        if reason is None:
            return False
        last = self._last_fired.get(kind)
        if last is not None and 0 <= step - last < self.cooldown:
            logger.debug("loss anomaly at step %s within cooldown: %s", step, reason)
            return False
        self._last_fired[kind] = step
        self._fire(Anomaly(step=step, loss=value, reason=reason, kind=kind))
        return True

    def reset(self) -> None:
        """Forget the window and cooldowns (e.g. after restoring an earlier checkpoint)."""
        self._window.clear()
        self._last_fired.clear()

    def flush(self) -> None:
        """Write the recorded losses and alerts to the catalog now.

        Raises:
            CkptError: If the catalog cannot be written.
        """
        if self.history is not None:
            self.history.flush()

    def close(self) -> None:
        """Write what the monitor's own recorder holds (a manager's is closed by the
        manager); errors are logged."""
        if self.history is not None and self._own_history:
            self.history.close()

    def _fire(self, anomaly: Anomaly) -> None:
        self.anomalies.append(anomaly)
        if self.history is not None:
            self.history.alert(anomaly.step, anomaly.loss, anomaly.kind, anomaly.reason,
                               self.metric)
        logger.warning("loss anomaly at step %s: %s", anomaly.step, anomaly.reason)
        if self.on_alert is not None:
            self.on_alert(anomaly.step, anomaly.loss, anomaly.reason)
        if self.action == "save":
            self._save(anomaly)

    def _save(self, anomaly: Anomaly) -> None:
        metrics = {"loss": anomaly.loss} if math.isfinite(anomaly.loss) else None
        try:
            if self.manager is not None:
                self.last_checkpoint = self.manager.save_now(
                    anomaly.step, self.state_fn, metrics=metrics, tags=(ANOMALY_TAG,), pin=True
                )
            elif self.store is not None and self.run is not None and self.state_fn is not None:
                ck = self.store.save(
                    self.run, anomaly.step, self.state_fn(), metrics=metrics, tags=(ANOMALY_TAG,)
                )
                self.store.pin(ck.id)
                self.last_checkpoint = ck
        except ConfigError:
            raise
        except CkptError:
            # The monitor is a safety net: its own failure must not stop training.
            logger.exception("could not save the anomaly checkpoint at step %s", anomaly.step)
