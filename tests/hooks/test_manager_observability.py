"""CheckpointManager(metrics_port=..., tensorboard_dir=...): the endpoint and the event file
live as long as the manager, over real HTTP and a real TensorBoard event file."""

from __future__ import annotations

import signal
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from ckptstore.errors import ConfigError, StorageError
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.store import CheckpointStore
from ckptstore.testing.ports import free_port


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), float(step))}


def _scrape(url: str) -> dict[str, float]:
    """``name{labels}`` → value of every sample at ``url``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        body = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = float(s.value)
    return out


@pytest.mark.parametrize("async_save", [True, False])
def test_endpoint_serves_the_saves_and_stops_on_close(
    store: CheckpointStore, async_save: bool
) -> None:
    pytest.importorskip("prometheus_client")
    mgr = CheckpointManager(store, "obs", save_interval=2, async_save=async_save,
                            handle_sigterm=False, metrics_port=0)
    server = mgr.metrics_server
    assert server is not None and server.port > 0 and server.host == "127.0.0.1"
    for step in range(1, 7):
        mgr.step(step, lambda step=step: _state(step))
    mgr.wait()
    samples = _scrape(server.url)
    assert samples["ckptstore_save_seconds_count{run=obs}"] == 3
    assert samples["ckptstore_bytes_total{kind=logical,op=save}"] == 3 * 256 * 4
    mgr.close()
    assert mgr.metrics_server is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)
    # The port is free again: a later manager can take it.
    with CheckpointManager(store, "obs", handle_sigterm=False, metrics_port=server.port) as again:
        assert again.metrics_server is not None and again.metrics_server.port == server.port


def test_a_port_in_use_is_our_error_and_nothing_is_left_running(store: CheckpointStore) -> None:
    pytest.importorskip("prometheus_client")
    before = signal.getsignal(signal.SIGTERM)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = int(taken.getsockname()[1])
        with pytest.raises(StorageError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}"):
            CheckpointManager(store, "obs", metrics_port=port)
    assert signal.getsignal(signal.SIGTERM) is before  # the failed manager installed nothing


def test_tensorboard_event_file_has_each_save(store: CheckpointStore, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    logdir = tmp_path / "tb"
    with CheckpointManager(store, "tb", save_interval=2, handle_sigterm=False,
                           tensorboard_dir=logdir) as mgr:
        assert mgr.tensorboard is not None and store.metrics.tensorboard is mgr.tensorboard
        for step in range(1, 7):
            mgr.step(step, lambda step=step: _state(step))
    # close() waited for the saves, then flushed and detached the sink.
    assert mgr.tensorboard is None and store.metrics.tensorboard is None
    acc = event_accumulator.EventAccumulator(str(logdir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("ckpt/save/seconds")] == [2, 4, 6]
    # The async save's staging time, logged from the training thread at each save.
    assert [e.step for e in acc.Scalars("ckpt/save/blocked_seconds")] == [2, 4, 6]
    # Saves after close are not logged any more.
    store.save("tb", 8, _state(8))
    acc.Reload()
    assert [e.step for e in acc.Scalars("ckpt/save/seconds")] == [2, 4, 6]


def test_missing_extras_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without prometheus_client the store records totals only; asking for an endpoint says
    # which extra to install.
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with CheckpointStore.open(tmp_path / "no-prom") as bare:
        assert bare.metrics.prom is None
        with pytest.raises(ConfigError, match=r"pip install 'ckptstore\[metrics\]'"):
            CheckpointManager(bare, "x", handle_sigterm=False, metrics_port=0)
    monkeypatch.undo()

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    port = free_port()
    with CheckpointStore.open(tmp_path / "no-tb") as st:
        with pytest.raises(ConfigError, match=r"ckptstore\[tensorboard\]"):
            CheckpointManager(st, "x", handle_sigterm=False, metrics_port=port,
                              tensorboard_dir=tmp_path / "tb")
        # The endpoint started before the sink failed was stopped again.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))
        assert st.metrics.tensorboard is None
