"""The Metrics recorder: totals, Prometheus series over real HTTP, textfile, cost."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptstore.errors import ConfigError, InvalidNameError, StorageError
from ckptstore.observability import OPS, Metrics, dedup_bytes, off_training_path

EXPECTED_FAMILIES = {
    "ckptstore_save_seconds",
    "ckptstore_operation_seconds",
    "ckptstore_blocked_seconds",
    "ckptstore_bytes",
    "ckptstore_failures",
    "ckptstore_staging_bytes_in_use",
    "ckptstore_flow_queue_depth",
    "ckptstore_compression_ratio",
    "ckptstore_dedup_ratio",
    "checkpoint_save_time",
    "io_throughput",
    "memory_fragmentation",
}


def parse(text: str) -> dict[str, Any]:
    """Family name → family, from Prometheus text exposition."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], family: str, name: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"no sample {name}{labels} in {family}")


def fill(metrics: Metrics) -> None:
    metrics.observe("save", seconds=0.5, blocked_seconds=0.5, bytes_logical=1000,
                    bytes_stored=400, bytes_deduplicated=100, run="run-a", tier="hot", step=10)
    metrics.observe("save", seconds=1.5, blocked_seconds=0.02, bytes_logical=1000,
                    bytes_stored=600, run="run-a", tier="hot", step=20)
    metrics.observe("load", seconds=0.25, bytes_logical=1000, bytes_stored=400, run="run-a")
    metrics.observe("archive", seconds=2.0, bytes_transferred=4000, tier="warm")
    metrics.observe("archive", seconds=0.1, ok=False, error_type="StorageError", tier="warm")


def test_totals_track_every_observation() -> None:
    metrics = Metrics(prometheus=False)
    fill(metrics)
    totals = metrics.totals()
    assert totals["save"].count == 2 and totals["save"].seconds == pytest.approx(2.0)
    assert totals["save"].blocked_seconds == pytest.approx(0.52)
    assert totals["save"].bytes_stored == 1000 and totals["save"].bytes_deduplicated == 100
    assert totals["archive"].failures == 1 and totals["archive"].errors == {"StorageError": 1}
    # Totals are a copy: mutating them does not touch the recorder.
    totals["save"].count = 99
    assert metrics.totals()["save"].count == 2


def test_unknown_operation_is_refused() -> None:
    metrics = Metrics(prometheus=False)
    with pytest.raises(InvalidNameError, match="unknown metrics operation 'sav'"):
        metrics.observe("sav", seconds=1.0)
    with pytest.raises(InvalidNameError):
        metrics.timed("nope")
    assert set(OPS) >= {"save", "load", "archive", "prune", "restore", "convert", "verify"}


def test_bad_numbers_never_break_the_caller() -> None:
    metrics = Metrics()
    metrics.observe("save", seconds=float("nan"), blocked_seconds=-1.0)
    metrics.observe("load", seconds=-3.0)
    assert metrics.totals()["save"].seconds == 0.0
    assert metrics.totals()["load"].seconds == 0.0


def test_exposition_has_every_series_with_the_right_values() -> None:
    metrics = Metrics()
    fill(metrics)
    fams = parse(metrics.exposition().decode())
    assert set(fams) >= EXPECTED_FAMILIES, EXPECTED_FAMILIES - set(fams)
    assert sample(fams, "ckptstore_save_seconds", "ckptstore_save_seconds_count",
                  run="run-a") == 2
    assert sample(fams, "ckptstore_operation_seconds", "ckptstore_operation_seconds_sum",
                  op="archive") == pytest.approx(2.1)
    # Blocked time is recorded only where the caller gave it (not for off-path flows).
    assert sample(fams, "ckptstore_blocked_seconds", "ckptstore_blocked_seconds_count",
                  op="save") == 2
    assert not [s for s in fams["ckptstore_blocked_seconds"].samples
                if s.labels.get("op") == "archive"]
    assert sample(fams, "ckptstore_bytes", "ckptstore_bytes_total", op="save",
                  kind="stored") == 1000
    assert sample(fams, "ckptstore_bytes", "ckptstore_bytes_total", op="archive",
                  kind="transferred") == 4000
    assert sample(fams, "ckptstore_failures", "ckptstore_failures_total", op="archive",
                  error_type="StorageError") == 1
    assert sample(fams, "ckptstore_compression_ratio", "ckptstore_compression_ratio") == 2.0
    assert sample(fams, "ckptstore_dedup_ratio", "ckptstore_dedup_ratio") == pytest.approx(
        100 / 1100
    )
    assert sample(fams, "checkpoint_save_time", "checkpoint_save_time") == 1.5
    assert sample(fams, "io_throughput", "io_throughput", op="archive") == 2000
    assert sample(fams, "io_throughput", "io_throughput", op="save") == 400


def test_registries_are_per_recorder() -> None:
    first, second = Metrics(), Metrics()
    first.observe("save", seconds=1.0, run="x")
    fams = parse(second.exposition().decode())
    assert not [s for s in fams["ckptstore_save_seconds"].samples if s.labels.get("run") == "x"]


def test_live_gauges_are_read_at_scrape_time() -> None:
    metrics = Metrics()
    staged = {"bytes": 0}
    metrics.bind_gauges(staging_bytes=lambda: staged["bytes"], queue_depth=lambda: 3)
    staged["bytes"] = 4096
    fams = parse(metrics.exposition().decode())
    assert sample(fams, "ckptstore_staging_bytes_in_use", "ckptstore_staging_bytes_in_use") == 4096
    assert sample(fams, "ckptstore_flow_queue_depth", "ckptstore_flow_queue_depth") == 3

    def broken() -> float:
        raise RuntimeError("pool gone")

    metrics.bind_gauges(staging_bytes=broken)
    fams = parse(metrics.exposition().decode())  # a broken callback must not break a scrape
    assert not fams["ckptstore_staging_bytes_in_use"].samples
    frag = fams["memory_fragmentation"].samples
    assert frag and all(0.0 <= s.value <= 1.0 for s in frag)
    assert {s.labels["source"] for s in frag} >= {"glibc_malloc"}


def test_timed_records_success_failure_and_blocking() -> None:
    metrics = Metrics()
    with metrics.timed("save", run="r", tier="hot", step=5, blocking=True) as op:
        op.add(bytes_logical=64, bytes_stored=32)
    with pytest.raises(OSError, match="disk full"), metrics.timed("restore", run="r"):
        raise OSError("disk full")
    with metrics.timed("save", run="r") as op:
        op.blocked_seconds = 0.0  # an async save that never waited
    totals = metrics.totals()
    assert totals["save"].count == 2 and totals["save"].bytes_stored == 32
    # The blocking save counts its whole wall time; the async one blocked for 0 s.
    assert 0.0 < totals["save"].blocked_seconds <= totals["save"].seconds
    assert totals["restore"].errors == {"OSError": 1}
    fams = parse(metrics.exposition().decode())
    assert sample(fams, "ckptstore_failures", "ckptstore_failures_total", op="restore",
                  error_type="OSError") == 1
    assert sample(fams, "ckptstore_blocked_seconds", "ckptstore_blocked_seconds_count",
                  op="save") == 2
    assert not [s for s in fams["ckptstore_blocked_seconds"].samples
                if s.labels.get("op") == "restore"]


def test_scrape_over_real_http() -> None:
    metrics = Metrics()
    fill(metrics)
    server = metrics.serve_metrics(0)
    try:
        assert server.host == "127.0.0.1" and server.port > 0
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            body = resp.read().decode()
        fams = parse(body)
        assert set(fams) >= EXPECTED_FAMILIES
        assert sample(fams, "ckptstore_bytes", "ckptstore_bytes_total", op="load",
                      kind="logical") == 1000
        # New observations show up in the next scrape.
        metrics.observe("verify", seconds=0.3)
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            fams = parse(resp.read().decode())
        assert sample(fams, "ckptstore_operation_seconds", "ckptstore_operation_seconds_count",
                      op="verify") == 1
        with pytest.raises(StorageError, match="cannot serve metrics"):
            metrics.serve_metrics(server.port)  # the port is taken
    finally:
        metrics.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=2)


def test_textfile_for_node_exporter(tmp_path: Path) -> None:
    metrics = Metrics()
    fill(metrics)
    target = tmp_path / "ckptstore.prom"
    metrics.write_textfile(target)
    fams = parse(target.read_text())
    assert sample(fams, "ckptstore_save_seconds", "ckptstore_save_seconds_count",
                  run="run-a") == 2
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically, nothing left over
    with pytest.raises(StorageError, match="cannot write metrics textfile"):
        metrics.write_textfile(tmp_path / "missing-dir" / "x.prom")


def test_without_prometheus_export_is_refused_clearly() -> None:
    metrics = Metrics(prometheus=False)
    metrics.observe("save", seconds=0.1)
    with pytest.raises(ConfigError, match=r"ckptstore\[metrics\]"):
        metrics.exposition()
    with pytest.raises(ConfigError):
        metrics.serve_metrics(0)


def test_dedup_bytes_counts_chunks_held_elsewhere() -> None:
    class Chunk:
        def __init__(self, nbytes: int, src: str | None) -> None:
            self.nbytes, self.src = nbytes, src

    class Array:
        def __init__(self, *chunks: Chunk) -> None:
            self.chunks = list(chunks)

    class Manifest:
        arrays = {"float32": Array(Chunk(10, None), Chunk(20, "base")),
                  "int64": Array(Chunk(5, "base"))}

    assert dedup_bytes(Manifest()) == 25


def test_observation_is_cheap() -> None:
    """An observation is counters in memory: no file, socket or import on its way, and the
    memory it keeps does not grow with the number of observations (steps are not labels).
    (A per-call time bound here failed on a loaded machine; what makes it cheap is this.)"""
    import tracemalloc

    from audit_support import io_events

    metrics = Metrics()
    kwargs: dict[str, Any] = {"seconds": 0.1, "blocked_seconds": 0.1, "bytes_logical": 100,
                              "bytes_stored": 50, "run": "r", "tier": "hot"}
    for i in range(200):  # warm the label cache
        metrics.observe("save", step=i, **kwargs)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with io_events() as events:
            for i in range(200, 5200):
                metrics.observe("save", step=i, **kwargs)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert events == [], events
    assert grown < 64 * 1024, f"5000 observations kept {grown} bytes"


def test_async_save_counts_staging_not_the_background_write() -> None:
    metrics = Metrics()
    metrics.observe_blocked("save", 0.01, run="r", step=1)  # what submit() blocked
    with off_training_path(), metrics.timed("save", run="r", blocking=True) as op:
        op.add(bytes_stored=10)  # the background write: not training time
    with metrics.timed("save", run="r", blocking=True):
        pass  # a plain synchronous save blocks for all of it
    totals = metrics.totals()["save"]
    assert totals.count == 2
    assert totals.blocked_seconds == pytest.approx(0.01 + (totals.last_seconds or 0.0))
    fams = parse(metrics.exposition().decode())
    assert sample(fams, "ckptstore_blocked_seconds", "ckptstore_blocked_seconds_count",
                  op="save") == 2
    assert sample(fams, "ckptstore_operation_seconds", "ckptstore_operation_seconds_count",
                  op="save") == 2
