"""Hostile and overlapping remotes: another store is untrusted, and must never be able to
destroy this one.

* forged chunks: every chunk of a checkpoint (its own, a delta's, a base's read by a later
  checkpoint), forged with the same size and crc32c (tests/forge_support.py), through pull,
  push, sync and import-bundle: each refused, nothing of it visible, doctor clean;
* overlapping tiers: every kind of remote tier (hot, warm, cold; local and S3) pointed at
  every tier of this store (the same, inside, above, through a symlink, through ``..``): each
  refused at ``remote add`` and, after the remote's config changed, at push, pull and sync;
  nothing of this store lost;
* a remote vanishing mid-pull, after each file in turn: the destination as it was before;
* a lying catalog (sizes, step, codec, lossy flags, kind, another checkpoint's digest):
  either refused or recorded from the manifest;
* prunes on either side between syncs and pulls: nothing fails, what was pruned here comes
  back on request, what the remote pruned stays pruned.

Each test counts what it tried in ``figures`` for ``benchmarks/reliability.py``'s table.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from forge_support import forge_chunk_bytes, forgeable
from remote_support import write_config
from sqlalchemy import update

from ckptstore.catalog.models import CheckpointRow
from ckptstore.errors import CkptError, IntegrityError, RemoteError
from ckptstore.ops.sharing.bundle import export_bundle, import_bundle
from ckptstore.ops.sharing.push import push_checkpoints
from ckptstore.ops.sharing.remote import add_remote, open_remote
from ckptstore.ops.sharing.sync import sync_run
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.ops.upkeep.doctor import doctor
from ckptstore.records import CheckpointState
from ckptstore.retention import RetentionPolicy
from ckptstore.store import CheckpointStore

CHUNK = 16 * 1024
NBYTES = 96 * 1024


def _config(path: Path, root: Path, **tiers: str) -> Path:
    endpoint = tiers.pop("endpoint", None)
    return write_config(path, root, tiers=tiers, endpoint_url=endpoint, chunk_bytes=CHUNK)


@dataclass
class _Pair:
    """Store ``a`` (hot + local warm) and store ``b`` (hot only), each knowing the other."""

    a: Any
    b: Any
    a_config: Path
    b_config: Path


@pytest.fixture
def pair(new_root: Callable[[str], Path], tmp_path: Path) -> Iterator[_Pair]:
    a_cfg = _config(tmp_path / "a.toml", new_root("a"), warm=str(tmp_path / "a-warm"))
    b_cfg = _config(tmp_path / "b.toml", new_root("b"))
    with CheckpointStore.open(config=a_cfg) as a, CheckpointStore.open(config=b_cfg) as b:
        add_remote(a, "b", b_cfg)
        add_remote(b, "a", a_cfg)
        yield _Pair(a, b, a_cfg, b_cfg)


def _snapshot(store: Any) -> tuple[Any, ...]:
    """Everything a failed transfer must leave as it was: every path under the hot tier (and
    each file's bytes), every row, every run."""
    paths = sorted((str(p.relative_to(store.hot)), p.read_bytes() if p.is_file() else None)
                   for p in store.hot.rglob("*"))
    rows = sorted((c.id, str(c.state)) for c in store.catalog.list(state=None))
    return tuple(paths), tuple(rows), tuple(sorted(r.name for r in store.runs()))


def _refused(action: Callable[[], Any], expected: type[BaseException] = IntegrityError) -> str:
    with pytest.raises(expected) as caught:
        action()
    return str(caught.value)


# ---------------------------------------------------------------------- forged chunks
def test_forged_chunks_are_refused_everywhere(pair: _Pair, w: Any, figures: Any,
                                              tmp_path: Path) -> None:
    a, b = pair.a, pair.b
    full = a.save("forge", 1, w.make_state(1, NBYTES), delta=False)
    base = a.save("xor", 1, w.make_state(2, NBYTES), delta="xor")
    delta = a.save("xor", 2, w.make_state(3, NBYTES), delta="xor")
    push_checkpoints(a, b, [base.id], remote="b")  # b holds the base: only the delta travels
    archive_checkpoints(a)
    tried = 0

    def forged_copies(ck: Any, tier: Any) -> Iterator[str]:
        """Forge each chunk file of ``ck`` on ``tier`` in turn (restoring it afterwards)."""
        keys = [k for k in tier.list_prefix(tier.prefix_for(ck.run, ck.id)) if "/c/" in k]
        for n, key in enumerate(keys):
            data = tier.get_bytes(key)
            if not forgeable(data):
                continue  # a 0-d tensor's chunk: its crc32c determines its 4 bytes
            tier.delete(key)
            tier.put_bytes(key, forge_chunk_bytes(data, at=(n * 97) % 64))
            try:
                yield key
            finally:
                tier.delete(key)
                tier.put_bytes(key, data)

    before = _snapshot(b)
    # Push and sync from a hot copy that was forged.
    hot = a.tier("hot")
    for _key in forged_copies(full, hot):
        _refused(lambda: push_checkpoints(a, b, [full.id], remote="b"))
        _refused(lambda: sync_run(a, b, "forge", remote="b"))
        assert _snapshot(b) == before
        tried += 2
    # A bundle with each chunk member forged.
    bundle = export_bundle(a, full.id, tmp_path / "full.tar")
    with tarfile.open(bundle) as src:
        members = [(info, src.extractfile(info).read())  # type: ignore[union-attr]
                   for info in src.getmembers()]
    chunks = [m for m in members if "/c/" in m[0].name and forgeable(m[1])]
    for n, (target, _) in enumerate(chunks):
        forged = tmp_path / f"forged-{n}.tar"
        with tarfile.open(forged, "w", format=tarfile.PAX_FORMAT) as out:
            for info, data in members:
                out.addfile(info, io.BytesIO(forge_chunk_bytes(data) if info is target
                                             else data))
        message = _refused(lambda f=forged: import_bundle(b, f))
        assert full.id in message and "tensor" in message
        assert _snapshot(b) == before
        tried += 1
    for tier_name in ("hot", "warm"):
        if tier_name == "warm":
            # Only the warm copies are left to pull from (a delta's before its base's).
            for ck in (delta, full, base):
                delete_replica(a, a.get(ck.id), "hot")
        tier = a.tier(tier_name)
        for ck in (full, delta):
            for key in forged_copies(ck, tier):
                with open_remote(b, "a") as remote:
                    message = _refused(lambda r=remote, c=ck: push_checkpoints(
                        r, b, [c.id], remote="a", direction="pull"))
                assert ck.id in message and "chunk" in message and "tensor" in message, key
                assert _snapshot(b) == before
                tried += 1
        # The base's own chunk, read by the delta (the destination already has the base).
        for _key in forged_copies(base, tier):
            with open_remote(b, "a") as remote:
                _refused(lambda r=remote: push_checkpoints(r, b, [delta.id], remote="a",
                                                           direction="pull"))
            assert _snapshot(b) == before
            tried += 1
            break
    assert doctor(b).ok
    # The genuine copies still arrive, bit-exact.
    with open_remote(b, "a") as remote:
        push_checkpoints(remote, b, [full.id, delta.id], remote="a", direction="pull")
    assert w.states_equal(b.load(full.id), w.make_state(1, NBYTES))
    assert w.states_equal(b.load(delta.id), w.make_state(3, NBYTES))
    figures.add("forged_chunks_refused", tried)


# ---------------------------------------------------------------------- overlapping tiers
def _places(location: str, tmp: Path, n: int) -> Iterator[tuple[str, str]]:
    """(relation, url) pointing at ``location``: the same, inside, above, via a symlink and
    via ``..`` (the last two for local paths)."""
    if location.startswith("s3://"):
        yield "same", location
        yield "inside", location.rstrip("/") + "/sub"
        yield "above", location.rsplit("/", 1)[0]
        return
    yield "same", location
    yield "inside", str(Path(location) / "sub")
    yield "above", str(Path(location).parent)
    link = tmp / f"link-{n}"
    link.symlink_to(location, target_is_directory=True)
    yield "symlink", str(link)
    yield "dotdot", str(tmp / "nowhere" / ".." / os.path.relpath(location, tmp))


def test_overlapping_remotes_are_refused_and_destroy_nothing(
        new_root: Callable[[str], Path], tmp_path: Path, s3: Any, w: Any,
        figures: Any) -> None:
    prefix = s3.url("home")
    home_cfg = _config(tmp_path / "home.toml", new_root("home"), warm=prefix,
                       cold=str(tmp_path / "home-cold"), endpoint=s3.endpoint_url)
    good_cfg = _config(tmp_path / "good.toml", new_root("good"))
    with CheckpointStore.open(config=home_cfg) as home:
        ck = home.save("keep", 1, w.make_state(4, NBYTES))
        archive_checkpoints(home)
        archive_checkpoints(home, src="warm", tier="cold")
        (tmp_path / "home-cold").mkdir(exist_ok=True)
        warm = home.tier("warm")
        hot_files = {p: p.read_bytes() for p in home.hot.rglob("*") if p.is_file()}
        warm_keys = {k: warm.get_bytes(k) for k in warm.list_prefix("")}
        cold_files = {p: p.read_bytes() for p in (tmp_path / "home-cold").rglob("*")
                      if p.is_file()}
        add_remote(home, "good", good_cfg)
        good_text = good_cfg.read_text()
        ours = {"hot": str(home.hot), "warm": prefix, "cold": str(tmp_path / "home-cold")}
        added = at_use = 0
        n = 0
        for our_tier, location in ours.items():
            for relation, url in _places(location, tmp_path, n):
                n += 1
                kinds = ("warm", "cold") if url.startswith("s3://") else ("hot", "warm", "cold")
                for kind in kinds:
                    tiers = {kind: url}
                    if url.startswith("s3://"):
                        tiers["endpoint"] = s3.endpoint_url
                    root = tmp_path / f"remote-{n}-{kind}"
                    cfg = _config(tmp_path / f"remote-{n}-{kind}.toml", root, **tiers)
                    name = f"r{n}{kind}"
                    message = _refused(lambda c=cfg, m=name: add_remote(home, m, c),
                                       RemoteError)
                    # It names the first of our tiers it overlaps (above the cold one is
                    # above the hot one too).
                    assert "this store's" in message, (our_tier, relation, kind, message)
                    assert not root.exists()  # refused before the remote was opened
                    added += 1
                    # The good remote's config now says the same: refused at every use,
                    # before the remote is opened.
                    good_cfg.write_text(good_text + cfg.read_text().split("\n", 2)[2])
                    _refused(lambda: open_remote(home, "good"), RemoteError)
                    at_use += 1
                    if kind == "hot":
                        continue  # opening such a store would write into this one's tier
                    # A caller that opened both stores itself: push, pull and sync refuse.
                    with CheckpointStore.open(config=cfg) as other:
                        for action in (
                            lambda o=other: push_checkpoints(home, o, [ck.id], remote="good"),
                            lambda o=other: push_checkpoints(o, home, [ck.id], remote="good",
                                                             direction="pull"),
                            lambda o=other: sync_run(home, o, "keep", remote="good"),
                        ):
                            _refused(action, RemoteError)
                            at_use += 1
                    good_cfg.write_text(good_text)
        # Nothing of this store was lost or changed.
        assert {p: p.read_bytes() for p in hot_files} == hot_files
        assert {k: warm.get_bytes(k) for k in warm_keys} == warm_keys
        assert {p: p.read_bytes() for p in cold_files} == cold_files
        assert w.states_equal(home.load(ck.id), w.make_state(4, NBYTES))
        assert home.verify(ck.id) == []
    figures.add("overlaps_refused_at_add", added)
    figures.add("overlaps_refused_at_use", at_use)


# ---------------------------------------------------------------------- vanishing remote
def test_a_remote_vanishing_mid_pull_leaves_the_destination_as_it_was(
        pair: _Pair, w: Any, figures: Any) -> None:
    a, b = pair.a, pair.b
    ck = a.save("gone", 1, w.make_state(5, NBYTES), delta=False)
    hot = a.tier("hot")
    prefix = hot.prefix_for(ck.run, ck.id)
    originals = {k: hot.get_bytes(k) for k in hot.list_prefix(prefix)}
    before = _snapshot(b)
    runs = 0
    for cut in range(len(originals) - 1):
        written = 0

        def vanish(_nbytes: int, cut: int = cut) -> None:
            nonlocal written
            written += 1
            if written > cut:
                hot.delete_keys(hot.list_prefix(prefix))

        with open_remote(b, "a") as remote, pytest.raises(CkptError):
            push_checkpoints(remote, b, [ck.id], remote="a", direction="pull",
                             progress=vanish, threads=1)
        assert _snapshot(b) == before, f"after {cut + 1} files"
        for key, data in originals.items():
            if not hot.exists(key):
                hot.put_bytes(key, data)
        runs += 1
    assert doctor(b).ok
    figures.add("vanished_mid_pull", runs)


# ---------------------------------------------------------------------- lying catalog
def test_a_lying_catalog_is_refused_or_ignored(pair: _Pair, w: Any, figures: Any) -> None:
    a, b = pair.a, pair.b
    other = a.save("lie", 1, w.make_state(6, NBYTES), delta=False)
    lies: list[dict[str, Any]] = [
        {"stored_bytes": 2**63 - 1}, {"logical_bytes": 2**63 - 1}, {"step": 10**15},
        {"codec": "zstd-3"}, {"lossy": True, "error_bound": 1e30},
        {"kind": "delta", "base_id": other.id},
        {"manifest_digest": a.get(other.id).manifest_digest},
    ]
    tried = 0
    for n, lie in enumerate(lies):
        ck = a.save("lie", 10 + n, w.make_state(10 + n, NBYTES), delta=False)
        manifest = a.manifest(ck.id)
        with a.catalog._write() as session:
            session.execute(update(CheckpointRow).where(CheckpointRow.id == ck.id)
                            .values(**lie))
        with open_remote(b, "a") as remote:
            try:
                push_checkpoints(remote, b, [ck.id], remote="a", direction="pull")
            except IntegrityError:
                assert "manifest_digest" in lie
                tried += 1
                continue
        got = b.get(ck.id)
        assert (got.stored_bytes, got.logical_bytes, got.step, got.codec, got.lossy,
                got.kind, got.base_id) == (manifest.stored_bytes, manifest.logical_bytes,
                                           10 + n, manifest.codec, False, "full", None), lie
        assert w.states_equal(b.load(ck.id), w.make_state(10 + n, NBYTES))
        tried += 1
    figures.add("catalog_lies", tried)


# ---------------------------------------------------------------------- prunes
def test_prunes_on_either_side_between_syncs_and_pulls(pair: _Pair, w: Any,
                                                       figures: Any) -> None:
    """Source ``b`` (hot only: a prune deletes) syncs to ``a`` after every save; both prune
    every other step; in between ``b`` pulls back what it pruned and ``a`` still has, and
    ``a`` prunes hard. No sync or pull fails; what ``a`` pruned stays pruned there."""
    a, b = pair.a, pair.b
    prunes = syncs = revived = pruned_there = 0
    sent: list[str] = []
    for step in range(1, 7):
        ck = b.save("pr", step, w.make_state(20 + step, NBYTES))  # dedup'd against the last
        sent.append(ck.id)
        report = sync_run(b, a, "pr", remote="a")
        syncs += 1
        assert ck.id in report.pushed + report.present
        pruned_there += len(report.pruned_there)
        if step % 2 == 0:
            # Both sides prune; this side harder.
            pruned = apply_retention(a, run="pr", tier="warm",
                                     policy=RetentionPolicy(keep_last=3))
            prunes += len(pruned.executed)
            pruned = apply_retention(b, run="pr", policy=RetentionPolicy(keep_last=1))
            prunes += len(pruned.executed)
            continue
        # Whatever b pruned comes back from a on request, same id and content ...
        for ckpt_id in sent:
            mine = b.catalog.get_any(ckpt_id)
            there = a.catalog.get_any(ckpt_id)
            if mine.state == CheckpointState.DELETED and there.state == CheckpointState.COMMITTED:
                with open_remote(b, "a") as remote:
                    report = push_checkpoints(remote, b, [ckpt_id], remote="a",
                                              direction="pull")
                assert ckpt_id in report.revived
                revived += len(report.revived)
        # ... then the remote prunes hard: the next sync leaves those pruned there.
        pruned = apply_retention(a, run="pr", tier="warm", policy=RetentionPolicy(keep_last=1))
        prunes += len(pruned.executed)
    for ckpt_id, step in zip(sent, range(1, 7), strict=True):
        if b.catalog.get_any(ckpt_id).state == CheckpointState.COMMITTED:
            assert w.states_equal(b.load(ckpt_id), w.make_state(20 + step, NBYTES))
    assert prunes > 0 and revived > 0 and pruned_there > 0
    assert doctor(b).ok
    figures.add("prunes", prunes)
    figures.add("syncs_after_prunes", syncs)
    figures.add("revived", revived)
    figures.add("left_pruned_there", pruned_there)
