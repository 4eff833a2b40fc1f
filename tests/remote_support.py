"""Fixtures of the push/pull tests: two stores and a third for pull-backs, each opened from
a config file as a remote is. Used by tests/ops/sharing/ and tests/flows/test_sync_flow.py.

``a``: SQLite catalog, warm tier on one moto bucket. ``b``: PostgreSQL catalog (127.0.0.1,
see tests/pg_support.py), warm tier on a second moto bucket. ``c``: SQLite catalog, hot tier
only. Chunks are 4 KiB so tiny states span several chunks and dedup has something to share.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from pg_support import create_pg_database, drop_pg_database, require_pg

from ckptstore import CheckpointStore
from ckptstore.ops.sharing.remote import add_remote
from ckptstore.testing.s3 import MotoS3

CHUNK_BYTES = 4096


@pytest.fixture(scope="session")
def s3_a() -> Iterator[MotoS3]:
    """The first moto server and bucket."""
    with MotoS3() as server:
        yield server


@pytest.fixture(scope="session")
def s3_b(s3_a: MotoS3) -> Iterator[MotoS3]:
    """A second moto server with its own bucket (entered after ``s3_a``: same fake keys)."""
    with MotoS3() as server:
        yield server


def write_config(path: Path, root: Path, *, catalog_url: str | None = None,
                 s3: MotoS3 | None = None, tiers: dict[str, str] | None = None,
                 endpoint_url: str | None = None, chunk_bytes: int = CHUNK_BYTES) -> Path:
    """A store config file: root, optional catalog URL, optional warm tier on ``s3`` (or any
    ``tiers``, with the S3 ``endpoint_url`` they need)."""
    lines = [f'root = "{root}"', f"chunk_bytes = {chunk_bytes}"]
    if catalog_url is not None:
        lines.append(f'catalog_url = "{catalog_url}"')
    tiers = dict(tiers or {})
    if s3 is not None:
        tiers["warm"] = s3.url(uuid.uuid4().hex[:12])
        endpoint_url = s3.endpoint_url
    if tiers:
        lines += ["[tiers]", *(f'{name} = "{url}"' for name, url in tiers.items())]
    if endpoint_url is not None:
        lines += ["[storage_options]", f'endpoint_url = "{endpoint_url}"']
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Stores:
    """The three open stores and their config files."""

    a: CheckpointStore
    b: CheckpointStore
    c: CheckpointStore
    a_config: Path
    b_config: Path
    c_config: Path


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A throwaway PostgreSQL database."""
    require_pg()
    url = create_pg_database("ckpt_remote")
    try:
        yield url
    finally:
        drop_pg_database(url)


@pytest.fixture
def stores(tmp_path: Path, s3_a: MotoS3, s3_b: MotoS3, pg_url: str) -> Iterator[Stores]:
    """Stores a (SQLite + S3), b (PostgreSQL + S3) and c (SQLite, hot only); a and c know
    b as remote ``b``, b knows a as remote ``a``."""
    a_config = write_config(tmp_path / "a.toml", tmp_path / "a", s3=s3_a)
    b_config = write_config(tmp_path / "b.toml", tmp_path / "b", catalog_url=pg_url, s3=s3_b)
    c_config = write_config(tmp_path / "c.toml", tmp_path / "c")
    opened: list[CheckpointStore] = []
    try:
        for config in (a_config, b_config, c_config):
            opened.append(CheckpointStore.open(config=config))
        a, b, c = opened
        add_remote(a, "b", b_config)
        add_remote(c, "b", b_config)
        add_remote(b, "a", a_config)
        yield Stores(a, b, c, a_config, b_config, c_config)
    finally:
        for store in opened:
            store.close()


def tiny_state(seed: int) -> dict[str, torch.Tensor]:
    """4 chunks of float32 weights and a small bias: tiny, but enough chunks to dedup."""
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4 * CHUNK_BYTES // 4, generator=gen),
            "b": torch.randn(16, generator=gen)}


def tweaked(state: dict[str, torch.Tensor], delta: float = 0.5) -> dict[str, torch.Tensor]:
    """``state`` with its first few weights changed: one chunk differs."""
    out = {k: v.clone() for k, v in state.items()}
    out["w"][:8] += delta
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-exact equality of two flat states."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


class Kit:
    """The helpers above, for test modules (imported by fixture: --import-mode=importlib)."""

    state: Callable[[int], dict[str, torch.Tensor]] = staticmethod(tiny_state)
    tweaked: Callable[..., dict[str, torch.Tensor]] = staticmethod(tweaked)
    same: Callable[..., bool] = staticmethod(same)
    write_config: Callable[..., Path] = staticmethod(write_config)


@pytest.fixture
def kit() -> type[Kit]:
    """The shared helpers."""
    return Kit
