"""Security: no load path unpickles, hostile metadata is refused, names cannot escape the
roots, catalog queries cannot be injected, credentials never leak, hostile manifests are
rejected in bounded time and memory.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

import ckpt_reliability_checks as checks
import pytest
import torch
from ckpt_reliability_checks import join, start_child

from ckptstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidNameError,
    StorageError,
)
from ckptstore.format.constants import MAX_MANIFEST_BYTES
from ckptstore.format.manifest import manifest_digest
from ckptstore.format.zarrcheck import check_zarr_metadata
from ckptstore.ops.upkeep.doctor import doctor
from ckptstore.store import CheckpointStore

REPO = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this creates ``path`` (the proof that code ran)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _evil(marker: Path) -> bytes:
    return pickle.dumps({"w": _Payload(marker)}, protocol=2)


# ---------------------------------------------------------------------- no unpickling
def _plant(directory: Path, where: str, payload: bytes) -> None:
    if where == "chunk":
        target = directory / "float32" / "c" / "0"
    elif where == "manifest":
        target = directory / "manifest.json"
        # A consistent marker too: only the catalog's digest can tell it is not ours.
        (directory / "COMMITTED").write_text(manifest_digest(payload) + "\n")
    elif where == "marker":
        target = directory / "COMMITTED"
    elif where == "zarr-json":
        target = directory / "float32" / "zarr.json"
    else:
        raise AssertionError(where)
    target.write_bytes(payload)


@pytest.mark.parametrize("where", ["chunk", "manifest", "marker", "zarr-json"])
def test_planted_pickle_never_runs(new_root: Any, procs: Any, w: Any, tmp_path: Path,
                                   where: str, figures: Any) -> None:
    marker = tmp_path / "PWNED"
    root = new_root()
    with CheckpointStore.open(root) as store:
        ck = store.save("r", 1, w.make_state(1, 256 * 1024))
        _plant(store.checkpoint_dir("r", ck.id), where, _evil(marker))
    for env in ({}, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}):
        queue = procs.SimpleQueue()
        child = start_child(procs, w.load_everything, str(root), ck.id, env, queue)
        assert join(child) == 0
        outcomes = queue.get()
        assert not marker.exists(), f"pickle ran via {outcomes}"
        allowed = {"IntegrityError", "IncompleteCheckpointError", "CheckpointNotFoundError", "ok"}
        assert set(outcomes.values()) <= allowed, outcomes
        if where != "zarr-json":
            assert outcomes["load"] != "ok", outcomes
        else:
            assert outcomes["load"] == "ok"  # our loader never reads zarr.json
    figures.add("bad_inputs", 2)


def test_pickle_in_foreign_formats_never_runs(new_root: Any, procs: Any, w: Any,
                                              tmp_path: Path, figures: Any) -> None:
    """.pt with a __reduce__ payload, DCP folders with a hostile .metadata or object item."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "PWNED"
    pt = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(3), "evil": _Payload(marker)}, pt)
    dcp_meta = tmp_path / "dcp-meta"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(dcp_meta))
    (dcp_meta / ".metadata").write_bytes(_evil(marker))
    dcp_item = tmp_path / "dcp-item"
    dcp.save({"w": torch.ones(3), "evil": _Payload(marker)}, checkpoint_id=str(dcp_item))
    assert not marker.exists()
    root = new_root()
    CheckpointStore.open(root).close()
    for source in (pt, dcp_meta, dcp_item):
        # The forcing variable is the stricter case: torch would unpickle freely by default.
        for env in ({"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},):
            queue = procs.SimpleQueue()
            child = start_child(procs, w.import_file, str(root), str(source), env, queue)
            assert join(child) == 0
            outcome = queue.get()
            assert not marker.exists(), f"pickle ran importing {source.name}: {outcome}"
            assert outcome[0] in ("UnsafeObjectError", "IntegrityError"), outcome
            figures.add("bad_inputs")


_ALLOWED_UNPICKLERS = {"dcp_read.py"}  # restricted: find_class allows DCP metadata only


def test_no_code_path_can_unpickle() -> None:
    """Static guard: no pickle.load(s), every torch.load passes weights_only=True, numpy
    never allow_pickle, and the only Unpickler subclass restricts find_class."""
    problems: list[str] = []
    for path in sorted((REPO / "src" / "ckptstore").rglob("*.py")):
        if "testing" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                if any("Unpickler" in b for b in bases):
                    methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                    if path.name not in _ALLOWED_UNPICKLERS or "find_class" not in methods:
                        problems.append(f"{path}:{node.lineno}: unrestricted Unpickler")
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
            if name in ("pickle.load", "pickle.loads", "cPickle.loads", "dill.loads",
                        "cloudpickle.loads", "marshal.loads", "shelve.open"):
                problems.append(f"{path}:{node.lineno}: {name}")
            if name == "torch.load" and kwargs.get("weights_only") != "True":
                problems.append(f"{path}:{node.lineno}: torch.load without weights_only=True")
            if name.endswith(("np.load", "numpy.load")) and kwargs.get("allow_pickle") == "True":
                problems.append(f"{path}:{node.lineno}: numpy allow_pickle")
            if name.endswith("Pickle") or "numcodecs.pickles" in name:
                problems.append(f"{path}:{node.lineno}: pickle codec")
    assert problems == [], "\n".join(problems)


def test_planted_object_codec_has_no_effect(new_root: Any, w: Any, tmp_path: Path,
                                            figures: Any) -> None:
    """A zarr.json naming a pickle codec (v3) and Zarr v2 metadata with a pickle compressor:
    our loads ignore zarr metadata entirely; zarr itself refuses pickle; doctor reports the
    tampering and rewrites the documents from the manifest."""
    import zarr

    marker = tmp_path / "PWNED"
    with CheckpointStore.open(new_root()) as store:
        ck = store.save("r", 1, w.make_state(2, 256 * 1024))
        directory = store.checkpoint_dir("r", ck.id)
        meta = json.loads((directory / "float32" / "zarr.json").read_text())
        meta["codecs"] = [{"name": "numcodecs.pickle", "configuration": {}}]
        meta["data_type"] = "object"
        (directory / "float32" / "zarr.json").write_text(json.dumps(meta))
        (directory / "int64" / ".zarray").write_text(json.dumps({
            "zarr_format": 2, "shape": [4], "chunks": [4], "dtype": "<f4", "order": "C",
            "compressor": {"id": "pickle"}, "filters": None, "fill_value": 0}))
        (directory / "int64" / "evil").write_bytes(_evil(marker))
        assert w.states_equal(store.load(ck.id), w.make_state(2, 256 * 1024))
        problems = check_zarr_metadata(directory, store.manifest(ck.id))
        assert any("numcodecs.pickle" in p for p in problems), problems
        assert any(".zarray" in p for p in problems), problems
        with pytest.raises(Exception):  # noqa: B017 - zarr's own error types vary
            zarr.open_group(str(directory), mode="r")["float32"][:]
        report = doctor(store, fix=True, grace_s=0)
        assert [f.kind for f in report.findings] == ["zarr-metadata"]
        assert report.ok
        group = zarr.open_group(str(directory), mode="r")
        flat = torch.from_numpy(group["float32"][:])
        assert torch.equal(flat[: 64 * 1024 - 4096], w.make_state(2, 256 * 1024)["model"]["w"])
        assert check_zarr_metadata(directory, store.manifest(ck.id)) == []
    assert not marker.exists()
    figures.add("bad_inputs", 2)


# ---------------------------------------------------------------------- names
BAD_NAMES = [
    "../x", "/abs", "a/../../b", "..%2f", "%2e%2e/", "#", "?", "//proc/self/root", "a\x00b",
    "a\\b", "a\u2215b", "a\uff0fb", ".", "..", "x" * 256, "trailing ", " lead", "a b", "",
    "a\nb", "-rf", "a/b", "~root", "$(id)", "`id`", "a;b", "@latest", "a@b", "a:b",
]


_PATH_ESCAPES = {"../x", "/abs", "a/../../b", "//proc/self/root", "a\x00b", "a\\b", ".", "..",
                 "", "a\nb"}


def test_names_are_refused_at_the_api_boundary(new_root: Any, tmp_path: Path, w: Any,
                                               figures: Any) -> None:
    from ckptstore.ops.tiering.replicas import tier_of
    from ckptstore.ops.upkeep.convert import import_checkpoint

    root = new_root()
    outside = tmp_path
    state = w.make_state(1, 4096)
    pt = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, pt)
    with CheckpointStore.open(root, warm=str(tmp_path / "warm")) as store:
        good = store.save("ok", 1, state)
        before = checks.dir_snapshot(outside)
        attempts = 0
        for bad in BAD_NAMES:
            calls = [
                lambda bad=bad: store.save(bad, 1, state),
                lambda bad=bad: store.save("ok", 2, state, tags=[bad]),
                lambda bad=bad: store.save("ok", 2, state, experiment=bad),
                lambda bad=bad: store.save("ok", 2, state, metrics={bad: 1.0}),
                lambda bad=bad: store.alias(good.id, bad),
                lambda bad=bad: store.list(run=bad),
                lambda bad=bad: store.list(tag=bad),
                lambda bad=bad: store.latest(bad),
                lambda bad=bad: store.checkpoint_dir(bad, good.id),
                lambda bad=bad: tier_of(store, "warm").key_for(bad, good.id, "x"),
                lambda bad=bad: tier_of(store, "warm").key_for("ok", bad, "x"),
                lambda bad=bad: import_checkpoint(store, pt, run=bad, step=1),
            ]
            if bad in _PATH_ESCAPES:
                # File paths inside a checkpoint are internal, but still never escape it.
                calls.append(lambda bad=bad: tier_of(store, "warm").key_for("ok", good.id, bad))
            if bad == "a/b":
                calls.pop(3)  # "val/acc" style metric names are fine: they are never paths
            for call in calls:
                attempts += 1
                with pytest.raises((InvalidNameError, CheckpointNotFoundError)):
                    call()
        after = checks.dir_snapshot(outside)
        new = sorted(after - before)
        assert new == [], f"files appeared: {new[:10]}"
        for absolute in ("/abs", "/proc/self/root/x", "/x"):
            assert not Path(absolute).exists()
        figures.add("bad_inputs", attempts)


def test_trailing_dot_names_are_refused() -> None:
    """T35 lists trailing dots: 'run.' and 'run' are one directory on some file systems."""
    from ckptstore.names import validate_name

    with pytest.raises(InvalidNameError):
        validate_name("run.")


def test_symlinked_run_directory_is_not_followed(new_root: Any, tmp_path: Path,
                                                 w: Any) -> None:
    """Someone replaced <hot>/<run> with a symlink to a directory outside the store: a save
    must not write through it."""
    root = new_root()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with CheckpointStore.open(root) as store:
        store.hot.mkdir(parents=True, exist_ok=True)
        (store.hot / "r").symlink_to(elsewhere, target_is_directory=True)
        try:
            store.save("r", 1, w.make_state(1, 4096))
        except (StorageError, InvalidNameError):
            pass
        written = sorted(p.name for p in elsewhere.iterdir())
        assert not written, f"store.save wrote {written} through the link into {elsewhere}"


def test_planted_fifo_cannot_hang_a_load(new_root: Any, procs: Any, w: Any) -> None:
    """A FIFO in place of a chunk file: opening it for reading blocks until a writer shows
    up (forever). A load must fail fast instead (open non-blocking, refuse non-files)."""
    root = new_root()
    with CheckpointStore.open(root, codec="none") as store:
        ck = store.save("r", 1, w.make_state(1, 64 * 1024))
        chunk = store.checkpoint_dir("r", ck.id) / "float32" / "c" / "0"
        chunk.unlink()
        os.mkfifo(chunk)
    queue = procs.SimpleQueue()
    child = start_child(procs, w.load_one, str(root), ck.id, queue)
    child.join(15)
    if child.is_alive():
        child.kill()
        child.join(10)
        pytest.fail("store.load blocked on a FIFO planted as a chunk file")
    assert queue.get() in ("IntegrityError", "StorageError")


# ---------------------------------------------------------------------- SQL injection
INJECTIONS: list[tuple[str, dict[str, Any]]] = [
    ("order", {"order_by": "step; DROP TABLE checkpoints"}),
    ("order", {"order_by": "-step, (SELECT 1)"}),
    ("order", {"order_by": "metric:loss; DROP TABLE checkpoints --"}),
    ("order", {"order_by": "step DESC NULLS FIRST"}),
    ("order", {"order_by": "version) UNION SELECT * FROM runs --"}),
    ("metric", {"metrics": {"loss; DROP TABLE runs --": ("<", 1.0)}}),
    ("metric", {"metrics": {"loss": ("< 1 OR 1=1 --", 1.0)}}),
    ("metric", {"metrics": {"loss": ("<", "1 OR 1=1")}}),
    ("metric", {"metrics": {"lo'ss": ("<", 1.0)}}),
    ("metric", {"metrics": {'lo"ss': ("<", 1.0)}}),
    ("tag", {"tag": "x' OR '1'='1"}),
    ("tag", {"tag": "%"}),
    ("tag", {"tag": "_"}),
    ("run", {"run": "a' OR 1=1 --"}),
    ("run", {"run": "%"}),
    ("experiment", {"experiment": "e'; DELETE FROM checkpoints; --"}),
    ("step", {"step_range": ("1 OR 1=1", None)}),
    ("limit", {"limit": "1; DROP TABLE checkpoints"}),
    ("state", {"state": "COMMITTED' OR '1'='1"}),
    ("tier", {"tier": "hot' OR 1=1 --"}),
]


def _db_fingerprint(store: CheckpointStore) -> str:
    from sqlalchemy import inspect, text

    digest = hashlib.sha256()
    with store.catalog.engine.connect() as conn:
        for table in sorted(inspect(conn).get_table_names()):
            rows = conn.execute(text(f'SELECT * FROM "{table}"')).all()
            digest.update(table.encode())
            for row in sorted(repr(tuple(r)) for r in rows):
                digest.update(row.encode())
    return digest.hexdigest()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_catalog_queries_cannot_be_injected(new_root: Any, w: Any, request: Any,
                                            backend: str, figures: Any) -> None:
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else None
    run = f"inj-{uuid.uuid4().hex[:6]}"
    with CheckpointStore.open(new_root(), catalog_url=url) as store:
        odd_config = {"a'\"; DROP TABLE runs; --": "x' OR '1'='1", "%_": ["\\", "\x00"]}
        store.run(run, config=odd_config)
        for i in range(3):
            store.save(run, i, w.make_state(i, 4096), metrics={"loss": 1.0 / (i + 1)},
                       tags=["t1"])
        fingerprint = _db_fingerprint(store)
        count = len(store.list(state=None))
        for _what, kwargs in INJECTIONS:
            with pytest.raises(InvalidNameError):
                store.list(**kwargs)
        for ref in (f"{run}@best:loss'; DROP TABLE runs --", f"{run}'--@latest",
                    "x' OR 1=1 --", f"{run}@v1 OR 1=1", f"{run}@1; DROP TABLE runs"):
            with pytest.raises((InvalidNameError, CheckpointNotFoundError)):
                store.get(ref)
        # Values are stored and returned literally.
        assert store.catalog.get_run(run).config == odd_config
        assert len(store.list(state=None)) == count
        assert _db_fingerprint(store) == fingerprint
    figures.add("bad_inputs", len(INJECTIONS) + 5)


def test_cli_where_filter_cannot_be_injected() -> None:
    from ckptstore.cli.common import parse_where

    for text in ("loss<1; DROP TABLE runs", "loss<1 OR 1=1", "loss' < 1", "loss<(SELECT 1)"):
        with pytest.raises(InvalidNameError):
            parse_where(text)


# ---------------------------------------------------------------------- credentials
def test_credentials_never_leak(new_root: Any, s3: Any, tmp_path: Path, w: Any,
                                caplog: pytest.LogCaptureFixture, monkeypatch: Any,
                                figures: Any) -> None:
    from ckptstore.ops.tiering.archive import archive_checkpoints
    from ckptstore.ops.tiering.restore import restore_checkpoint
    from ckptstore.testing.fault_injection import FaultyProxy

    key_id = "AKIA" + uuid.uuid4().hex[:16].upper()
    secret = "SECRET" + uuid.uuid4().hex
    token = "TOKEN" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    root = new_root()
    with FaultyProxy(s3.endpoint_url, deny=1.0) as proxy:
        options = {"endpoint_url": proxy.endpoint_url,
                   "config_kwargs": {"retries": {"max_attempts": 1}}}
        with CheckpointStore.open(root, warm=s3.url(f"{uuid.uuid4().hex[:8]}/w"),
                                  storage_options=options) as store:
            ck = store.save("r", 1, w.make_state(1, 64 * 1024))
            # Every S3 request is refused with 403, the server echoing the Authorization
            # header (which holds the access key id) into its error message.
            with pytest.raises(StorageError) as info:
                archive_checkpoints(store, tier="warm", threads=1)
            texts.append(str(info.value))
            texts.extend(str(note) for note in getattr(info.value, "__notes__", []))
            assert proxy.counts["denied"] > 0
            proxy.set_rates()
            archive_checkpoints(store, tier="warm", threads=1)
            from ckptstore.ops.tiering.replicas import delete_replica

            delete_replica(store, store.catalog.get(ck.id), "hot")
            restore_checkpoint(store, ck.id, threads=1)
            texts.append(json.dumps([e.detail for e in store.events()], default=str))
            texts.append(json.dumps(store.show(ck.id), default=str))
            # Inline credentials in the configuration are refused, without echoing them.
            for bad in ({"secret": secret}, {"key": key_id},
                        {"client_kwargs": {"aws_secret_access_key": secret}}):
                with pytest.raises(ConfigError) as refused:
                    _archive_with(root, s3.url("x"), {**options, **bad})
                texts.append(str(refused.value))
            texts.append(_catalog_dump(store))
    for path in root.rglob("*"):
        if path.is_file() and path.suffix not in (".db", ".db-wal", ".db-shm"):
            texts.append(path.read_bytes().decode("latin-1"))
    texts.append("\n".join(s3.keys()))
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("ckptstore")]
    # Third-party DEBUG output is out of our hands (botocore logs its canonical request, session
    # token included, at DEBUG); everything at INFO and above must be clean.
    everything = [r.getMessage() for r in caplog.records
                  if r.name.startswith("ckptstore") or r.levelno >= logging.INFO]
    assert not [t for t in texts + everything if secret in t], "the secret key leaked"
    assert not [t for t in texts + everything if token in t], "the session token leaked"
    leaked_id = [t for t in texts + ours if key_id in t]
    assert leaked_id == [], leaked_id[:3]
    texts.append(_flow_parameters(root))
    assert secret not in texts[-1] and key_id not in texts[-1]
    figures.add("bad_inputs", 4)


def _archive_with(root: Path, warm: str, options: dict[str, Any]) -> None:
    from ckptstore.ops.tiering.archive import archive_checkpoints

    with CheckpointStore.open(root, warm=warm, storage_options=options) as store:
        archive_checkpoints(store, tier="warm")


def _catalog_dump(store: CheckpointStore) -> str:
    from sqlalchemy import inspect, text

    out = io.StringIO()
    with store.catalog.engine.connect() as conn:
        for table in inspect(conn).get_table_names():
            for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                out.write(repr(tuple(row)) + "\n")
    return out.getvalue()


def _flow_parameters(root: Path) -> str:
    """The parameters every served deployment would run with."""
    from ckptstore.config import load_settings
    from ckptstore.flows.deployments import build_deployments

    deployments = build_deployments(load_settings(root=root))
    return json.dumps([d.parameters for d in deployments], default=str)


# ---------------------------------------------------------------------- hostile manifests
def _hostile(kind: str, directory: Path) -> None:
    directory.mkdir(parents=True)
    head = (b'{"arrays":{},"base_id":null,"chunk_bytes":1024,"codec":"none",'
            b'"created_at":"2026-01-01T00:00:00+00:00","extra":{},"format_version":1,'
            b'"id":"00000000-0000-4000-8000-000000000000","kind":"full","logical_bytes":0,'
            b'"run":"r","step":1,"stored_bytes":0,"tree":null,"tensors":')
    if kind == "10M-entries":
        data = head + b"[" + b",".join([b"{}"] * 10_000_000) + b"]}"
    elif kind == "10M-ints":
        data = head + b"[]," + b'"x":[' + b",".join([b"0"] * 10_000_000) + b"]}"
    elif kind == "deep-nesting":
        data = head + b"[" * 200_000 + b"]" * 200_000 + b"}"
    elif kind == "negative-shape":
        data = head.replace(b'"arrays":{}', b'"arrays":{"float32":{"torch_dtype":"float32",'
                            b'"zarr_dtype":"float32","itemsize":4,"length":4,"chunk_len":4,'
                            b'"codec":"none","chunks":[{"i":0,"nbytes":20,"crc32c":0,'
                            b'"blake3":"' + b"0" * 64 + b'","src":null}]}}')
        data += (b'[{"key":"w","array":"float32","offset":0,"numel":4,"shape":[-2,-2],'
                 b'"torch_dtype":"float32","chunk_start":0,"chunk_stop":1}]}')
    elif kind == "overflowing-shape":
        data = head + (b'[{"key":"w","array":"float32","offset":0,"numel":0,"shape":['
                       + b",".join([b"18446744073709551616"] * 60)
                       + b'],"torch_dtype":"float32","chunk_start":0,"chunk_stop":0}]}')
    elif kind == "oversized":
        path = directory / "manifest.json"
        with open(path, "wb") as fh:
            fh.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk
        (directory / "COMMITTED").write_text("0" * 64 + "\n")
        return
    else:
        raise AssertionError(kind)
    (directory / "manifest.json").write_bytes(data)
    (directory / "COMMITTED").write_text(manifest_digest(data) + "\n")


HOSTILE = ["10M-entries", "10M-ints", "deep-nesting", "negative-shape", "overflowing-shape",
           "oversized"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_manifest_is_rejected_in_bounded_time_and_memory(
    tmp_path: Path, procs: Any, w: Any, kind: str, figures: Any
) -> None:
    directory = tmp_path / "ck"
    _hostile(kind, directory)
    queue = procs.SimpleQueue()
    child = start_child(procs, w.parse_hostile, str(directory), queue)
    child.join(8.0)  # the budget is 2 s of CPU; leave room for a loaded machine
    if child.is_alive():
        child.kill()
        child.join(10)
        outcome, cpu, grown = "timeout", 8.0, float("nan")
    else:
        outcome, cpu, _wall, grown = queue.get()
    figures.add("bad_inputs")
    figures.set(f"manifest_{kind}", {"outcome": outcome, "cpu_s": round(cpu, 2),
                                     "rss_growth_mb": round(grown, 1)})
    assert outcome == "IntegrityError", outcome
    assert cpu < 2.0, f"{cpu:.2f}s CPU"
    assert grown < 200, f"RSS grew {grown:.0f} MiB"


# ------------------------------------------------ numbers, foreign digits, planted links
HUGE = 10**400

#: References to steps or versions no catalog column can hold (step: BIGINT, version:
#: INTEGER), or written with digits that are not ASCII: a full-width 3, an Arabic-Indic 3,
#: a superscript 3, a full-width and an Arabic-Indic 1.
BAD_REFS = ["h@99999999999999999999", f"h@{2**63}", f"h@v{2**31}", "h@v99999999999999999999",
            "h@" + "9" * 5000, "h@\uff13", "h@\u0663", "h@\u00b3", "h@v\uff11", "h@v\u0661"]

#: save() arguments no catalog column can hold.
BAD_SAVES: list[dict[str, Any]] = [{"step": 2**63}, {"step": HUGE},
                                   {"step": 1, "metrics": {"loss": HUGE}},
                                   {"step": 1, "metrics": {"loss": -HUGE}}]


@pytest.fixture(params=["sqlite", "postgresql"])
def own_catalog(request: pytest.FixtureRequest) -> str | None:
    """None (the store's embedded SQLite catalog) or a PostgreSQL database of its own."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("own_pg_url")
    return url


def test_numbers_no_column_holds_and_foreign_digits_are_refused(
    new_root: Any, own_catalog: str | None, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], figures: Any,
) -> None:
    """Each one a clear InvalidNameError (a one-line CLI error), never a driver error or a
    traceback, never the wrong checkpoint (a full-width 3 is not step 3), and nothing written."""
    from ckptstore.cli.app import main

    url = own_catalog
    if url is not None:
        monkeypatch.setenv("CKPT_CATALOG_URL", url)
    root = new_root()
    attempts = 0
    with CheckpointStore.open(root, catalog_url=url) as store:
        store.save("h", 3, {"w": torch.zeros(4)}, metrics={"loss": 1.0})
        store.save("h", 4, {"w": torch.ones(4)}, metrics={"loss": 0.5})
        hot_before, rows_before = checks.dir_snapshot(store.hot), len(store.list(state=None))
        for ref in BAD_REFS:
            for call in (store.get, store.catalog.lineage):
                attempts += 1
                with pytest.raises(InvalidNameError):
                    call(ref)
            attempts += 1
            code = main(["--store", str(root), "show", ref])
            err = capsys.readouterr().err
            assert code == 2 and err.startswith("error:"), err  # a malformed reference
            assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        for kwargs in BAD_SAVES:
            attempts += 2
            with pytest.raises(InvalidNameError):
                store.save("h2", state={"w": torch.ones(2)}, **kwargs)
            with pytest.raises(InvalidNameError):
                store.save_async("h2", state={"w": torch.ones(2)}, **kwargs)
        store.wait()
        for query in ({"limit": 10**20}, {"limit": HUGE}, {"step_range": (0, 2**63)},
                      {"metrics": {"loss": ("<", HUGE)}}):
            attempts += 1
            with pytest.raises(InvalidNameError):
                store.list(**query)
        assert checks.dir_snapshot(store.hot) == hot_before  # no directory, no chunk
        assert len(store.list(state=None)) == rows_before  # no row, not even FAILED
        assert [c.step for c in store.list(run="h")] == [3, 4]
    figures.add("bad_inputs", attempts)


#: Where a symlink is planted in a checkpoint's hot directory.
PLANTS = ["chunk-file", "chunk-directory", "marker", "checkpoint-directory"]


def _plant_link(directory: Path, where: str, outside: Path) -> None:
    if where == "chunk-file":
        victim = directory / "float32" / "c" / "0"
        victim.unlink()
        victim.symlink_to(outside / "precious")
    elif where == "chunk-directory":
        shutil.rmtree(directory / "float32" / "c")
        (directory / "float32" / "c").symlink_to(outside, target_is_directory=True)
    elif where == "marker":
        (directory / "COMMITTED").unlink()
        (directory / "COMMITTED").symlink_to(outside / "precious")
    else:
        shutil.rmtree(directory)
        directory.symlink_to(outside, target_is_directory=True)


@pytest.mark.parametrize("where", PLANTS)
def test_planted_links_are_flagged_unlinked_never_followed(
    new_root: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], figures: Any,
    where: str,
) -> None:
    """A symlink planted in a checkpoint: loads refuse it, verify and doctor flag it, and
    retention deletes the checkpoint by unlinking the link (never what it points at)."""
    from ckptstore.cli.app import main
    from ckptstore.records import CheckpointState

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"do not delete")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    root = new_root()
    with CheckpointStore.open(root, chunk_bytes=64 * 1024) as store:
        first, *_ = [store.save("r", i, {"w": torch.arange(40_000.0) + i * 1000})
                     for i in range(3)]
        directory = store.checkpoint_dir(first.run, first.id)
        _plant_link(directory, where, outside)
        with pytest.raises((IntegrityError, IncompleteCheckpointError, StorageError)):
            store.load(first.ref)
        if where.startswith("chunk"):  # the others have no marker to verify against
            assert any("symlink" in p for p in store.verify(first.ref)), where
        assert not doctor(store, grace_s=0).ok
        for _ in range(2):  # a planted manifest may hold the others' deletes to a 2nd run
            main(["--store", str(root), "prune", "--keep-last", "1"])
        capsys.readouterr()
        assert store.catalog.get_any(first.id).state == CheckpointState.DELETED
        assert not directory.exists() and not directory.is_symlink()
        assert [c.step for c in store.list()] == [2]
        assert doctor(store, grace_s=0).ok
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    figures.add("bad_inputs")


def test_manifests_whose_tensors_share_bytes_are_refused(new_root: Any, figures: Any) -> None:
    """Two tensors pointing into the same array bytes: the manifest is damaged, whatever
    its digest says."""
    from ckptstore.format import Manifest
    from ckptstore.format.layout import chunk_span

    with CheckpointStore.open(new_root()) as store:
        ck = store.save("r", 1, {"a": torch.arange(20_000.0), "b": torch.arange(20_000.0) + 1})
        doc = json.loads((store.checkpoint_dir(ck.run, ck.id) / "manifest.json").read_bytes())
    a, b = sorted(doc["tensors"], key=lambda t: t["offset"])
    chunk_len = doc["arrays"][a["array"]]["chunk_len"]
    for offset in (a["offset"], a["offset"] + 1, a["offset"] + a["numel"] - 1):
        b["offset"] = offset
        b["chunk_start"], b["chunk_stop"] = chunk_span(offset, b["numel"], chunk_len)
        with pytest.raises(IntegrityError, match="overlap"):
            Manifest.from_json(json.dumps(doc).encode())
        figures.add("bad_inputs")
