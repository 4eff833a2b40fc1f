"""Retention: table-driven and property tests of the pure policy, then plan/apply on real
stores (hot tier, a local warm tier, S3 warm/cold tiers through moto)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from ckptstore import CheckpointStore
from ckptstore.errors import ConfigError
from ckptstore.format import BaseRef, read_manifest, write_checkpoint
from ckptstore.ops.tiering.retention import (
    ActionKind,
    apply_plan,
    apply_retention,
    plan_retention,
)
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState
from ckptstore.retention import CandidateInfo, RetentionPolicy
from ckptstore.testing.invariants import check_invariants
from ckptstore.testing.s3 import MotoS3

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def cand(
    cid: str,
    step: int,
    version: int | None = None,
    *,
    run: str = "r",
    age_days: float = 0.0,
    metrics: dict[str, float] | None = None,
    pinned: bool = False,
    aliases: tuple[str, ...] = (),
    base: str | None = None,
    leased: bool = False,
) -> CandidateInfo:
    return CandidateInfo(
        checkpoint_id=cid,
        run=run,
        step=step,
        version=version if version is not None else step,
        created_at=NOW - timedelta(days=age_days),
        metrics=metrics or {},
        pinned=pinned,
        aliases=aliases,
        base_id=base,
        leased=leased,
    )


def kept_ids(policy: RetentionPolicy, cands: list[CandidateInfo]) -> set[str]:
    return {d.checkpoint_id for d in policy.decide(cands, now=NOW) if d.keep}


SIX = [cand(f"c{i}", step=i * 10, version=i) for i in range(1, 7)]  # steps 10..60

TABLE = [
    pytest.param(RetentionPolicy(), SIX, {c.checkpoint_id for c in SIX}, id="no-rule-keeps-all"),
    pytest.param(RetentionPolicy(keep_last=2), SIX, {"c5", "c6"}, id="keep-last-2"),
    pytest.param(RetentionPolicy(keep_last=0), SIX, {"c6"}, id="keep-last-0-keeps-newest"),
    pytest.param(RetentionPolicy(keep_last=10), SIX, {c.checkpoint_id for c in SIX}, id="n>len"),
    pytest.param(RetentionPolicy(keep_every=20), SIX, {"c2", "c4", "c6"}, id="keep-every-20"),
    pytest.param(
        RetentionPolicy(keep_last=1, keep_every=30), SIX, {"c3", "c6"}, id="last-plus-every"
    ),
    pytest.param(
        RetentionPolicy(keep_last=1),
        [cand("a", 9, 1), cand("b", 100, 2), cand("c", 10, 3)],
        {"b", "c"},
        id="steps-sort-numerically-and-latest-version-kept",
    ),
    pytest.param(
        RetentionPolicy(keep_last=2),
        [cand("a", 9, 1), cand("b", 100, 2), cand("c", 10, 3), cand("d", 11, 4)],
        {"b", "d"},
        id="string-sort-would-pick-9",
    ),
    pytest.param(
        RetentionPolicy(keep_last=1),
        [cand("c", 40, 1), cand("a", 50, 2), cand("b", 50, 3)],
        {"b"},
        id="same-step-higher-version-wins",
    ),
    pytest.param(
        RetentionPolicy(keep_last=1),
        [cand("old", 10, pinned=True), cand("mid", 20), cand("new", 30)],
        {"old", "new"},
        id="pinned-kept-and-not-counted",
    ),
    pytest.param(
        RetentionPolicy(keep_last=1),
        [cand("old", 10, aliases=("prod",)), cand("mid", 20), cand("new", 30)],
        {"old", "new"},
        id="aliased-kept",
    ),
    pytest.param(
        RetentionPolicy(keep_last=1),
        [cand("old", 10, leased=True), cand("mid", 20), cand("new", 30)],
        {"old", "new"},
        id="leased-skipped",
    ),
    pytest.param(
        RetentionPolicy(keep_last=1),
        [cand("full", 10), cand("d1", 20, base="full"), cand("d2", 30, base="d1")],
        {"full", "d1", "d2"},
        id="delta-chain-bases-kept",
    ),
    pytest.param(
        RetentionPolicy(keep_last=1),
        [cand("full", 10), cand("d1", 20, base="full"), cand("full2", 30)],
        {"full2"},
        id="pruned-delta-frees-base",
    ),
    pytest.param(
        RetentionPolicy(keep_best=("loss", "min", 2)),
        [
            cand("a", 1, metrics={"loss": 3.0}),
            cand("b", 2, metrics={"loss": 1.0}),
            cand("c", 3, metrics={"loss": 2.0}),
            cand("d", 4, metrics={"acc": 0.5}),
            cand("e", 5, metrics={"loss": float("nan")}),
            cand("f", 6, metrics={"loss": 9.0}),
        ],
        {"b", "c", "f"},
        id="keep-best-min-missing-and-nan-not-best",
    ),
    pytest.param(
        RetentionPolicy(keep_best=("acc", "max", 1)),
        [cand("a", 1, metrics={"acc": 0.9}), cand("b", 2, metrics={"acc": 0.1}), cand("c", 3)],
        {"a", "c"},
        id="keep-best-max",
    ),
    pytest.param(
        RetentionPolicy(max_age_days=7),
        [cand("old", 1, age_days=30), cand("young", 2, age_days=1), cand("newest", 3, age_days=40)],
        {"young", "newest"},
        id="max-age-keeps-young-and-newest",
    ),
    pytest.param(
        RetentionPolicy(max_age_days=7, keep_every=100),
        [cand("old100", 100, 1, age_days=30), cand("old", 150, 2, age_days=30),
         cand("new", 160, 3, age_days=0)],
        {"old100", "new"},
        id="max-age-unless-kept-by-another-rule",
    ),
    pytest.param(
        RetentionPolicy(keep_last=1),
        [cand("a1", 10, 1, run="a"), cand("a2", 20, 2, run="a"),
         cand("b1", 5, 1, run="b"), cand("b2", 6, 2, run="b")],
        {"a2", "b2"},
        id="per-run",
    ),
]


@pytest.mark.parametrize(("policy", "cands", "expected"), TABLE)
def test_policy_table(
    policy: RetentionPolicy, cands: list[CandidateInfo], expected: set[str]
) -> None:
    assert kept_ids(policy, cands) == expected


def test_decisions_carry_reasons() -> None:
    decisions = {
        d.checkpoint_id: d
        for d in RetentionPolicy(keep_last=1, keep_every=20).decide(SIX, now=NOW)
    }
    assert decisions["c6"].keep
    assert "newest of run" in decisions["c6"].reasons
    assert decisions["c2"].reasons == ("step multiple of 20",)
    assert not decisions["c1"].keep
    assert any("not among last 1" in r for r in decisions["c1"].reasons)
    assert [d.checkpoint_id for d in RetentionPolicy().decide(SIX, now=NOW)] == [
        c.checkpoint_id for c in SIX
    ]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": -1},
        {"keep_every": 0},
        {"keep_best": ("loss", "median", 2)},
        {"keep_best": ("loss", "min", -1)},
        {"max_age_days": -1.0},
        {"max_age_days": float("inf")},
    ],
)
def test_invalid_policy(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]


def test_from_settings() -> None:
    from ckptstore.config import load_settings

    s = load_settings(None, keep_last=3, keep_every=0, keep_best=("loss", "min", 2))
    p = RetentionPolicy.from_settings(s)
    assert p == RetentionPolicy(keep_last=3, keep_every=None, keep_best=("loss", "min", 2))
    assert RetentionPolicy.from_settings(load_settings(None)).empty


def test_duplicate_ids_rejected() -> None:
    with pytest.raises(ValueError, match="distinct"):
        RetentionPolicy(keep_last=1).decide([cand("a", 1), cand("a", 2)], now=NOW)


# ---------------------------------------------------------------------- property
@st.composite
def histories(draw: st.DrawFn) -> list[CandidateInfo]:
    n = draw(st.integers(1, 40))
    versions: dict[str, int] = {}
    out: list[CandidateInfo] = []
    for i in range(n):
        run = draw(st.sampled_from(["a", "b"]))
        versions[run] = versions.get(run, 0) + 1
        metric = draw(st.one_of(st.none(), st.floats(-5, 5), st.just(float("nan"))))
        base = None
        if out and draw(st.booleans()):
            base = out[draw(st.integers(0, len(out) - 1))].checkpoint_id
        out.append(
            CandidateInfo(
                checkpoint_id=f"id{i}",
                run=run,
                step=draw(st.integers(0, 3000)),
                version=versions[run],
                created_at=NOW - timedelta(days=draw(st.floats(0, 100))),
                metrics={} if metric is None else {"loss": metric},
                pinned=draw(st.integers(0, 9)) == 0,
                aliases=("prod",) if draw(st.integers(0, 9)) == 0 else (),
                base_id=base,
                leased=draw(st.integers(0, 9)) == 0,
            )
        )
    return out


policies = st.builds(
    RetentionPolicy,
    keep_last=st.one_of(st.none(), st.integers(0, 8)),
    keep_every=st.one_of(st.none(), st.integers(1, 1000)),
    keep_best=st.one_of(
        st.none(), st.tuples(st.just("loss"), st.sampled_from(["min", "max"]), st.integers(0, 4))
    ),
    max_age_days=st.one_of(st.none(), st.floats(0, 60)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cands=histories(), policy=policies)
def test_policy_properties(cands: list[CandidateInfo], policy: RetentionPolicy) -> None:
    decisions = policy.decide(cands, now=NOW)
    assert [d.checkpoint_id for d in decisions] == [c.checkpoint_id for c in cands]
    kept = {d.checkpoint_id for d in decisions if d.keep}
    by_id = {c.checkpoint_id: c for c in cands}
    for d in decisions:
        assert d.reasons, "every decision says why"
    for run in {c.run for c in cands}:
        members = [c for c in cands if c.run == run]
        newest = max(members, key=lambda c: (c.step, c.version))
        latest = max(members, key=lambda c: c.version)
        assert newest.checkpoint_id in kept, "the newest checkpoint of a run is never pruned"
        assert latest.checkpoint_id in kept, "run@latest is never pruned"
        if policy.keep_last is not None:
            open_members = sorted(
                (c for c in members if not (c.pinned or c.aliases or c.leased)),
                key=lambda c: (c.step, c.version),
                reverse=True,
            )
            top = {c.checkpoint_id for c in open_members[: policy.keep_last]}
            assert top <= kept
            if policy.keep_every is None and policy.keep_best is None and (
                policy.max_age_days is None
            ):
                # Exactly: anything else unprotected is kept only as newest or as a base.
                needed = {by_id[k].base_id for k in kept if by_id[k].base_id}
                for c in open_members[policy.keep_last :]:
                    expect = c.checkpoint_id in needed or c is newest or c is latest
                    assert (c.checkpoint_id in kept) == expect
    for c in cands:
        if c.pinned or c.aliases or c.leased:
            assert c.checkpoint_id in kept
        if c.checkpoint_id in kept and c.base_id is not None:
            assert c.base_id in kept, "a kept delta's base is kept"
    if policy.empty:
        assert kept == set(by_id)


# ---------------------------------------------------------------------- on a real store
@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    s = CheckpointStore.open(tmp_path / "store")
    yield s
    s.close()


@pytest.fixture
def warm_store(tmp_path: Path) -> Iterator[CheckpointStore]:
    s = CheckpointStore.open(tmp_path / "store", warm=str(tmp_path / "warm"))
    yield s
    s.close()


def _state(i: int) -> dict[str, object]:
    return {"w": torch.full((16,), float(i)), "frozen": torch.arange(64.0), "step": i}


def _copy_to_warm(store: CheckpointStore, ck: Checkpoint) -> None:
    """Stand-in for the archive flow on a local-path warm tier: copy, then record PRESENT."""
    assert store.settings.warm is not None
    dst = Path(store.settings.warm) / ck.run / ck.id
    shutil.copytree(store.checkpoint_dir(ck.run, ck.id), dst)
    store.catalog.set_replica(ck.id, "warm", uri=str(dst), state=ReplicaState.PRESENT,
                              bytes=ck.stored_bytes, verified=True)


def _save_delta(store: CheckpointStore, run: str, step: int, state: object, base: Checkpoint
                ) -> Checkpoint:
    """A delta checkpoint that dedups its unchanged chunks against ``base`` (real format)."""
    ck = store.catalog.begin_checkpoint(run, step, kind="delta", base_id=base.id, codec="lz4")
    directory = store.checkpoint_dir(run, ck.id)
    base_dir = store.checkpoint_dir(base.run, base.id)
    manifest = write_checkpoint(
        directory, state, ckpt_id=ck.id, run=run, step=step, codec="lz4",
        base=BaseRef(read_manifest(base_dir), base_dir),
    )
    return store.catalog.commit_checkpoint(
        ck.id, manifest_digest=manifest.digest, logical_bytes=manifest.logical_bytes,
        stored_bytes=manifest.stored_bytes, uri=str(directory),
    )


def test_keep_last_on_real_store(store: CheckpointStore) -> None:
    saved = [store.save("r", i * 100, _state(i)) for i in range(10)]
    report = apply_retention(store, policy=RetentionPolicy(keep_last=3))
    assert report.ok, report.to_dict()
    assert report.executed == report.plan.actions
    assert {a.kind for a in report.executed} == {ActionKind.DELETE_CHECKPOINT}
    assert [ck.id for ck in store.list(run="r")] == [ck.id for ck in saved[-3:]]
    for i, ck in enumerate(saved):
        row = store.catalog.get_any(ck.id)
        directory = store.checkpoint_dir("r", ck.id)
        if i < 7:
            assert row.state == CheckpointState.DELETED
            assert not directory.exists()
        else:
            assert row.state == CheckpointState.COMMITTED
            loaded = store.load(ck.id)
            assert torch.equal(loaded["w"], torch.full((16,), float(i)))
            assert loaded["step"] == i
    assert check_invariants(store) == []
    assert len([e for e in store.events() if e.kind == "pruned"]) == 7
    # Idempotent: the second run has nothing to do.
    again = apply_retention(store, policy=RetentionPolicy(keep_last=3))
    assert again.plan.actions == [] and again.executed == []


def test_dry_run_changes_nothing(store: CheckpointStore) -> None:
    saved = [store.save("r", i, _state(i)) for i in range(5)]
    before = [(ck.id, ck.state, ck.replicas) for ck in store.list(state=None)]
    report = apply_retention(store, policy=RetentionPolicy(keep_last=2), dry_run=True)
    assert report.dry_run and report.executed == []
    assert [(ck.id, ck.state, ck.replicas) for ck in store.list(state=None)] == before
    assert all(store.checkpoint_dir("r", ck.id).is_dir() for ck in saved)
    rendered = report.plan.render()
    assert "3 actions" in rendered
    for ck in saved[:3]:
        assert ck.id in rendered
    # The real run executes exactly what the dry run showed.
    real = apply_plan(store, report.plan)
    assert real.executed == report.plan.actions


def test_interrupted_delete_is_finished(store: CheckpointStore) -> None:
    saved = [store.save("r", i, _state(i)) for i in range(3)]
    victim = saved[0]
    # A crash after DELETING was recorded and the marker was removed.
    store.catalog.mark_deleting(victim.id)
    (store.checkpoint_dir("r", victim.id) / "COMMITTED").unlink()
    plan = plan_retention(store, RetentionPolicy(), run="r")  # no rule: only the resume
    assert [(a.checkpoint_id, a.resume) for a in plan.actions] == [(victim.id, True)]
    report = apply_plan(store, plan)
    assert report.executed == plan.actions, report.to_dict()
    assert store.catalog.get_any(victim.id).state == CheckpointState.DELETED
    assert not store.checkpoint_dir("r", victim.id).exists()
    assert check_invariants(store) == []


def test_hot_waits_for_archive_then_drops_hot_copy(warm_store: CheckpointStore) -> None:
    store = warm_store
    saved = [store.save("r", i, _state(i)) for i in range(3)]
    plan = plan_retention(store, RetentionPolicy(keep_last=1))
    assert plan.actions == []
    assert {k.checkpoint_id: k.reasons for k in plan.kept}[saved[0].id] == (
        "awaiting archive to warm",
    )
    _copy_to_warm(store, saved[0])
    _copy_to_warm(store, saved[2])
    report = apply_retention(store, policy=RetentionPolicy(keep_last=1))
    assert [(a.checkpoint_id, a.kind) for a in report.executed] == [
        (saved[0].id, ActionKind.DELETE_REPLICA)
    ], report.to_dict()
    ck0 = store.catalog.get_any(saved[0].id)
    assert ck0.state == CheckpointState.COMMITTED
    assert ck0.tiers == ("warm",)
    assert not store.checkpoint_dir("r", saved[0].id).exists()
    assert check_invariants(store) == []
    # The warm tier is the last one: there the pruned checkpoint goes entirely...
    warm = apply_retention(store, tier="warm", policy=RetentionPolicy(keep_last=1))
    assert [(a.checkpoint_id, a.kind) for a in warm.executed] == [
        (saved[0].id, ActionKind.DELETE_CHECKPOINT)
    ], warm.to_dict()
    assert store.catalog.get_any(saved[0].id).state == CheckpointState.DELETED
    assert not (Path(store.settings.warm or "") / "r" / saved[0].id).exists()
    # ...while the newest keeps its warm copy.
    assert store.catalog.get_any(saved[2].id).tiers == ("hot", "warm")
    assert check_invariants(store) == []


def test_protections_and_races(store: CheckpointStore) -> None:
    saved = [store.save("r", i, _state(i)) for i in range(6)]
    store.pin(saved[0].id)
    store.alias(saved[1].id, "prod")
    assert store.catalog.acquire_lease(saved[2].id, "restore:hot", "someone", 60)
    plan = plan_retention(store, RetentionPolicy(keep_last=1))
    assert {a.checkpoint_id for a in plan.actions} == {saved[3].id, saved[4].id}
    reasons = {k.checkpoint_id: k.reasons for k in plan.kept}
    assert "pinned" in reasons[saved[0].id]
    assert "alias prod" in reasons[saved[1].id]
    assert "leased" in reasons[saved[2].id]
    # Between plan and apply another flow leases one and a user pins the other.
    assert store.catalog.acquire_lease(saved[3].id, "archive:warm", "archiver", 60)
    store.pin(saved[4].id)
    report = apply_plan(store, plan)
    assert report.executed == []
    assert sorted(why.split(" ")[0] for _a, why in report.skipped) == ["leased", "pinned"]
    assert all(store.catalog.get_any(ck.id).state == CheckpointState.COMMITTED for ck in saved)
    assert store.catalog.lease_holder(saved[3].id, "retention") is None


def test_delta_chain_survives_until_a_full_checkpoint(store: CheckpointStore) -> None:
    full = store.save("r", 10, _state(1))
    d1 = _save_delta(store, "r", 20, _state(2), full)
    d2 = _save_delta(store, "r", 30, _state(3), d1)
    other = store.save("ft-base", 5, _state(9))
    ft = _save_delta(store, "ft", 1, _state(9), other)  # another run's delta uses ft-base
    report = apply_retention(store, policy=RetentionPolicy(keep_last=1))
    assert report.plan.actions == [], report.plan.render()
    assert check_invariants(store) == []
    # Once the newest is a full checkpoint the chain can go: deltas before their bases.
    newest = store.save("r", 40, _state(4))
    report = apply_retention(store, policy=RetentionPolicy(keep_last=1))
    assert report.ok, report.to_dict()
    assert [a.checkpoint_id for a in report.executed] == [d2.id, d1.id, full.id]
    assert store.catalog.get_any(other.id).state == CheckpointState.COMMITTED
    assert store.catalog.get_any(ft.id).state == CheckpointState.COMMITTED
    assert torch.equal(store.load(newest.id)["w"], torch.full((16,), 4.0))
    assert torch.equal(store.load(ft.id)["frozen"], torch.arange(64.0))
    assert check_invariants(store) == []


def _backdate(store: CheckpointStore, ckpt_id: str, days: float) -> None:
    # Test setup only: age a row to exercise max_age_days.
    with store.catalog.engine.begin() as conn:
        conn.execute(
            text("UPDATE checkpoints SET created_at = :at WHERE id = :id"),
            {"at": datetime.now(UTC) - timedelta(days=days), "id": ckpt_id},
        )


_FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") else None  # fsync-heavy catalog writes


@settings(max_examples=int(os.environ.get("CKPT_PROP_EXAMPLES", "15")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), policy=policies)
def test_plan_equals_apply_property(data: st.DataObject, policy: RetentionPolicy) -> None:
    with tempfile.TemporaryDirectory(dir=_FAST_TMP) as root, CheckpointStore.open(root) as store:
        made: list[Checkpoint] = []
        for i in range(data.draw(st.integers(1, 8), label="n")):
            run = data.draw(st.sampled_from(["a", "b"]), label="run")
            step = data.draw(st.integers(0, 30), label="step")
            loss = data.draw(st.one_of(st.none(), st.floats(-5, 5)), label="loss")
            metrics = None if loss is None else {"loss": loss}
            base_index = data.draw(st.one_of(st.none(), st.integers(0, max(0, i - 1))))
            if made and base_index is not None:
                ck = _save_delta(store, run, step, _state(i), made[base_index])
            else:
                ck = store.save(run, step, _state(i), metrics=metrics)
            made.append(ck)
            if data.draw(st.integers(0, 5), label="pin") == 0:
                store.pin(ck.id)
            if data.draw(st.integers(0, 5), label="lease") == 0:
                store.catalog.acquire_lease(ck.id, "restore:hot", "other", 600)
            _backdate(store, ck.id, data.draw(st.floats(0, 90), label="age"))
        before = {ck.id: store.catalog.get_any(ck.id) for ck in made}
        plan = plan_retention(store, policy)
        report = apply_plan(store, plan)
        assert report.failed == [] and report.skipped == [], report.to_dict()
        assert report.executed == plan.actions
        after = {cid: store.catalog.get_any(cid) for cid in before}
        deleted = {cid for cid, ck in after.items() if ck.state == CheckpointState.DELETED}
        assert deleted == {a.checkpoint_id for a in plan.actions}
        for run in ("a", "b"):
            members = [ck for ck in before.values() if ck.run == run]
            if members:
                assert max(members, key=lambda c: (c.step, c.version)).id not in deleted
                assert max(members, key=lambda c: c.version).id not in deleted
        for cid in deleted:
            assert not before[cid].pinned
            assert store.catalog.lease_holder(cid, "restore:hot") is None
            assert not store.checkpoint_dir(after[cid].run, cid).exists()
        assert check_invariants(store) == []


def test_tier_lifecycle_on_s3(tiered_store: CheckpointStore, s3: MotoS3) -> None:
    """hot → warm (S3) → cold (S3): each tier drops only copies a later tier holds."""
    from ckptstore.ops.tiering.archive import archive_checkpoints, demote_checkpoints

    store = tiered_store
    saved = [store.save("r", i, _state(i)) for i in range(3)]
    archive_checkpoints(store)
    policy = RetentionPolicy(keep_last=1)
    hot = apply_retention(store, policy=policy)
    assert [(a.checkpoint_id, a.kind) for a in hot.executed] == [
        (ck.id, ActionKind.DELETE_REPLICA) for ck in saved[1::-1]
    ], hot.to_dict()
    # Warm keeps its copies until they reach cold (no ping-pong with hot retention).
    warm = apply_retention(store, tier="warm", policy=policy)
    assert warm.plan.actions == []
    assert {k.reasons for k in warm.plan.kept if k.checkpoint_id != saved[2].id} == {
        ("awaiting demotion to cold",)
    }
    demote_checkpoints(store, older_than_days=0)
    cold = apply_retention(store, tier="cold", policy=policy)
    assert [(a.checkpoint_id, a.kind) for a in cold.executed] == [
        (ck.id, ActionKind.DELETE_CHECKPOINT) for ck in saved[1::-1]
    ], cold.to_dict()
    keys = s3.keys()
    for ck in saved[:2]:
        assert store.catalog.get_any(ck.id).state == CheckpointState.DELETED
        assert not any(ck.id in key for key in keys)
    newest = store.catalog.get_any(saved[2].id)
    assert newest.state == CheckpointState.COMMITTED and "hot" in newest.tiers
    assert check_invariants(store) == []


def test_invariants_report_a_lost_copy(store: CheckpointStore) -> None:
    ck = store.save("r", 1, _state(1))
    orphan = store.hot / "r" / "00000000-0000-4000-8000-000000000002"
    orphan.mkdir(parents=True)
    shutil.rmtree(store.checkpoint_dir("r", ck.id))
    problems = check_invariants(store)
    assert len(problems) == 2, problems
    assert ck.id in problems[0] and "has no catalog row" in problems[1]

