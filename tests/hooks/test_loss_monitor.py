"""LossMonitor on synthetic loss curves (alert action; saving is covered in test_manager.py)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from ckptstore.errors import ConfigError
from ckptstore.hooks.loss_monitor import LossMonitor, spike_reason


def fired_steps(monitor: LossMonitor, curve: np.ndarray | list[float]) -> list[int]:
    return [step for step, loss in enumerate(curve) if monitor.update(step, loss)]


def noisy(level: float, n: int, noise: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return level * (1 + noise * rng.standard_normal(n))


def alert_monitor(**kw: object) -> LossMonitor:
    return LossMonitor(action="alert", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(5))
def test_spike_fires_once(seed: int) -> None:
    curve = noisy(2.0, 400, 0.01, seed)
    curve[250] *= 1.5
    assert fired_steps(alert_monitor(), curve) == [250]


@pytest.mark.parametrize("seed", range(3))
def test_small_spike_above_threshold_fires(seed: int) -> None:
    curve = noisy(2.0, 300, 0.005, seed)
    curve[200] *= 1.08
    assert fired_steps(alert_monitor(threshold=0.05), curve) == [200]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_fires_even_before_window_is_full(bad: float) -> None:
    curve = list(noisy(2.0, 30, 0.01, 0))
    curve[10] = bad
    monitor = alert_monitor()
    assert fired_steps(monitor, curve) == [10]
    assert monitor.anomalies[-1].kind == "nonfinite"


def test_nan_does_not_enter_the_window() -> None:
    curve = list(noisy(2.0, 220, 0.01, 1))
    curve[150] = math.nan
    curve[180] = 4.0  # a spike later still fires: the NaN did not poison the statistics
    assert fired_steps(alert_monitor(), curve) == [150, 180]


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("noise", [0.0, 0.002, 0.01])
def test_slow_drift_does_not_fire(seed: int, noise: float) -> None:
    # Loss falls 0.1% per step for 1000 steps (10% over one window): healthy training.
    steps = np.arange(1000)
    rng = np.random.default_rng(seed)
    curve = 3.0 * 0.999**steps * (1 + noise * rng.standard_normal(1000))
    assert fired_steps(alert_monitor(), curve) == []


@pytest.mark.parametrize("seed", range(5))
def test_slow_upward_drift_and_fast_early_decay_do_not_fire(seed: int) -> None:
    steps = np.arange(1000)
    rng = np.random.default_rng(seed)
    rising = 1.0 * 1.001**steps * (1 + 0.01 * rng.standard_normal(1000))
    early = 2 + 8 * np.exp(-steps / 50) + 0.01 * rng.standard_normal(1000)
    assert fired_steps(alert_monitor(), rising) == []
    assert fired_steps(alert_monitor(), early) == []


def test_drift_with_spike_fires_on_the_spike_only() -> None:
    steps = np.arange(1000)
    rng = np.random.default_rng(7)
    curve = 3.0 * 0.999**steps * (1 + 0.01 * rng.standard_normal(1000))
    curve[600] *= 1.3
    assert fired_steps(alert_monitor(), curve) == [600]


def test_window_not_full_does_not_fire() -> None:
    curve = noisy(2.0, 100, 0.01, 3)
    curve[50] *= 3.0
    assert fired_steps(alert_monitor(window_size=100), curve) == []


def test_cooldown_suppresses_repeats_then_fires_again() -> None:
    curve = noisy(2.0, 600, 0.01, 4)
    for step in (200, 210, 450):
        curve[step] *= 2.0
    # 210 is within the 100-step cooldown of 200; 450 is not (its window holds 2 old spikes,
    # which the median-based statistics ignore).
    assert fired_steps(alert_monitor(window_size=100), curve) == [200, 450]
    assert fired_steps(alert_monitor(window_size=100, cooldown=5), curve) == [200, 210, 450]


def test_level_shift_fires_once() -> None:
    curve = noisy(2.0, 500, 0.01, 5)
    curve[250:] *= 1.25
    assert fired_steps(alert_monitor(), curve) == [250]


def test_sudden_drop_respects_direction() -> None:
    curve = noisy(2.0, 300, 0.01, 6)
    curve[200:] *= 0.7  # e.g. a learning-rate decay step
    assert fired_steps(alert_monitor(direction="both"), curve) == [200]
    assert fired_steps(alert_monitor(direction="up"), curve) == []


def test_noisy_loss_needs_a_bigger_jump() -> None:
    # 5% noise: a 10% bump is noise (2 sigma), a 60% one is not.
    curve = noisy(2.0, 300, 0.05, 8)
    curve[150] = curve[:150].max() * 1.01
    curve[260] = 2.0 * 1.6
    assert fired_steps(alert_monitor(), curve) == [260]


def test_alert_calls_back_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[tuple[int, float, str]] = []
    monitor = LossMonitor(action="alert", on_alert=lambda s, v, r: calls.append((s, v, r)))
    curve = noisy(1.0, 150, 0.01, 9)
    curve[120] = 5.0
    with caplog.at_level(logging.WARNING, logger="ckptstore.hooks.loss_monitor"):
        assert fired_steps(monitor, curve) == [120]
    assert [(s, v) for s, v, _ in calls] == [(120, 5.0)]
    assert "jumped" in calls[0][2]
    assert any("loss anomaly at step 120" in rec.getMessage() for rec in caplog.records)


def test_accepts_tensor_losses() -> None:
    monitor = alert_monitor(window_size=4)
    for step, value in enumerate([1.0, 1.0, 1.01, 0.99]):
        assert not monitor.update(step, torch.tensor(value))
    assert monitor.update(4, torch.tensor(float("nan")))


def test_spike_reason_on_flat_window() -> None:
    window = [1.0] * 20
    assert spike_reason(window, 1.0, threshold=0.05, sigmas=5.0) is None
    assert spike_reason(window, 1.04, threshold=0.05, sigmas=5.0) is None
    reason = spike_reason(window, 1.2, threshold=0.05, sigmas=5.0)
    assert reason is not None and "20.0%" in reason


def test_reset_forgets_the_window() -> None:
    monitor = alert_monitor(window_size=10)
    fired_steps(monitor, noisy(1.0, 20, 0.01, 0))
    monitor.reset()
    assert not monitor.update(100, 10.0)  # window empty again: no spike possible


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_size": 3, "action": "alert"},
        {"threshold": 0.0, "action": "alert"},
        {"action": "page"},
        {"action": "alert", "direction": "down"},
        {"action": "save"},  # neither manager nor store/run/state_fn
    ],
)
def test_rejects_bad_configuration(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LossMonitor(**kwargs)  # type: ignore[arg-type]
