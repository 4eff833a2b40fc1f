"""The merge flow under Prefect's real engine: run directly, and started with store.trigger."""

from __future__ import annotations

import pytest
import torch

from ckptstore import CheckpointStore

pytestmark = pytest.mark.prefect


def _sites(store: CheckpointStore) -> list[str]:
    return [store.save(run, 1, {"w": torch.full((16,), float(i)), "round": 3},
                       metrics={"samples": float(10 * (i + 1))}).ref
            for i, run in enumerate(("site-a", "site-b", "site-c"))]


def test_merge_flow_merges_and_is_idempotent(flow_store: CheckpointStore) -> None:
    from ckptstore.flows.merge import merge_flow

    refs = _sites(flow_store)
    root = str(flow_store.settings.root)
    result = merge_flow(refs, "global", 3, weights_from_metric="samples", store_root=root)
    merged = flow_store.get(result["merged"])
    assert result["ref"] == merged.ref == "global@v1"
    assert [i["ref"] for i in result["merge"]["inputs"]] == [
        "site-a@v1", "site-b@v1", "site-c@v1"]
    state = flow_store.load(merged.ref)
    assert torch.allclose(state["w"], torch.full((16,), (1 * 20 + 2 * 30) / 60))
    assert state["round"] == 3
    # Run again (a retried flow): the same checkpoint, nothing new written.
    again = merge_flow(refs, "global", 3, weights_from_metric="samples", store_root=root)
    assert again["merged"] == merged.id
    assert len(flow_store.list(run="global")) == 1


def test_trigger_runs_the_merge_off_the_callers_thread(flow_store: CheckpointStore) -> None:
    refs = _sites(flow_store)
    flow_store.trigger("merge", refs=refs, run="global", step=3, weights=[1.0, 1.0, 2.0],
                       keys=["w"])
    flow_store.close()  # returns once the flows it started have finished
    with CheckpointStore.open(flow_store.settings.root) as store:
        merged = store.get("global@latest")
        assert [p.weight for p in store.catalog.merge_inputs(merged.id)] == [0.25, 0.25, 0.5]
        assert set(store.load(merged.ref)) == {"w"}
