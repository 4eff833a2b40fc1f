"""Structured JSON log lines per operation, and TensorBoard scalars per step."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore.errors import InvalidNameError
from ckptstore.observability import JsonFormatter, Metrics, configure_logging


@pytest.fixture
def clean_logger() -> Iterator[logging.Logger]:
    """The ckptstore logger, restored after the test (handlers, level, propagation)."""
    target = logging.getLogger("ckptstore")
    saved = (list(target.handlers), target.level, target.propagate)
    yield target
    target.handlers[:] = saved[0]
    target.setLevel(saved[1])
    target.propagate = saved[2]


def test_one_json_line_per_operation(clean_logger: logging.Logger) -> None:
    stream = io.StringIO()
    handler = configure_logging(json_lines=True, stream=stream)
    assert handler is not None
    assert configure_logging(json_lines=True, stream=stream) is handler  # idempotent
    metrics = Metrics(prometheus=False)
    metrics.observe("save", seconds=0.25, blocked_seconds=0.25, bytes_logical=100,
                    bytes_stored=40, run="run-a", tier="hot", step=7)
    with pytest.raises(InvalidNameError), metrics.timed("restore", run="run-a"):
        raise InvalidNameError("bad ref")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["event"] == "ckpt.operation" and first["logger"] == "ckptstore.operations"
    assert first["op"] == "save" and first["ok"] is True and first["level"] == "INFO"
    assert first["seconds"] == 0.25 and first["bytes_stored"] == 40 and first["step"] == 7
    assert first["run"] == "run-a" and first["tier"] == "hot"
    assert "save ok" in first["msg"] and first["ts"].endswith("+00:00")
    assert second["op"] == "restore" and second["ok"] is False
    assert second["error_type"] == "InvalidNameError" and second["level"] == "WARNING"


def test_env_switch_turns_json_on(
    clean_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPT_LOG_JSON", raising=False)
    assert configure_logging() is None
    monkeypatch.setenv("CKPT_LOG_JSON", "1")
    Metrics(prometheus=False)  # the store creates one on open; that honours the switch
    handlers = [h for h in clean_logger.handlers if isinstance(h.formatter, JsonFormatter)]
    assert len(handlers) == 1 and clean_logger.propagate is False


def test_formatter_keeps_the_envelope_and_exceptions() -> None:
    record = logging.LogRecord("ckptstore.x", logging.ERROR, __file__, 1, "boom %s", ("now",),
                               None)
    record.ckpt = {"msg": "must not replace the message", "path": Path("/a"), "n": {1, 2}}
    try:
        raise ValueError("inner")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    doc = json.loads(JsonFormatter().format(record))
    assert doc["msg"] == "boom now" and doc["path"] == "/a" and sorted(doc["n"]) == [1, 2]
    assert "ValueError: inner" in doc["exc"]


def test_tensorboard_scalars_per_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="pip install tensorboard (in ckptstore[dev])")
    from tensorboard.backend.event_processing import event_accumulator

    metrics = Metrics(prometheus=False, tensorboard_dir=tmp_path / "tb")
    for step in (10, 20, 30):
        metrics.observe("save", seconds=step / 100, blocked_seconds=0.01, bytes_logical=200,
                        bytes_stored=100, run="r", step=step)
    metrics.observe("load", seconds=0.5)  # no step: not a TensorBoard point
    sink = metrics.tensorboard
    assert sink is not None and sink.flush()
    metrics.close()
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"ckpt/save/seconds", "ckpt/save/blocked_seconds", "ckpt/save/compression_ratio",
            "ckpt/save/throughput_bytes_per_s"} <= tags
    assert not any(t.startswith("ckpt/load/") for t in tags)
    seconds = acc.Scalars("ckpt/save/seconds")
    assert [e.step for e in seconds] == [10, 20, 30]
    assert [round(e.value, 3) for e in seconds] == [0.1, 0.2, 0.3]
    assert acc.Scalars("ckpt/save/compression_ratio")[0].value == 2.0
