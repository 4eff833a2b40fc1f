"""``ckpt merge`` and the merged lineage as a user sees it: output, JSON, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.app import main


@pytest.fixture
def sites(store_root: Path) -> Path:
    """Three sites' checkpoints of one model, with their sample counts; a-site's has a parent."""
    with CheckpointStore.open(store_root) as store:
        store.save("site-a", 0, {"w": torch.zeros(4), "n": torch.tensor(0)})
        for i, (run, samples) in enumerate([("site-a", 10), ("site-b", 30), ("site-c", 60)]):
            parent = "site-a@0" if run == "site-a" else None
            store.save(run, 1, {"w": torch.full((4,), float(i)), "n": torch.tensor(i)},
                       metrics={"samples": float(samples)}, parent=parent)
        store.save("other", 1, {"v": torch.zeros(4)})
    return store_root


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


INPUTS = ("site-a@1", "site-b@latest", "site-c@latest")


def test_merge_prints_the_checkpoint_and_how_it_was_made(
    sites: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "-s", str(sites), "merge", *INPUTS, "--run", "global",
                         "--step", "1", "--weights-from-metric", "samples")
    assert code == 0, err
    assert "global@v1" in out
    assert "merged from: site-a@v2 (weight 0.1), site-b@v1 (weight 0.3), site-c@v1" in out
    assert "weighted by metric samples" in out
    with CheckpointStore.open(sites) as store:
        got = store.load("global@latest")
    assert torch.allclose(got["w"], torch.full((4,), 0.3 * 1 + 0.6 * 2))
    assert int(got["n"]) == 0  # from the first input

    code, out, _ = run(capsys, "-s", str(sites), "merge", *INPUTS, "--run", "global",
                       "--step", "2", "--keys", "w", "--accumulate", "float32", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["checkpoint"]["ref"] == "global@v2"
    assert doc["merge"]["method"] == "mean" and doc["merge"]["keys"] == ["w"]
    assert doc["merge"]["accumulate"] == "float32"
    assert [i["weight"] for i in doc["merge"]["inputs"]] == pytest.approx([1 / 3] * 3)

    code, out, _ = run(capsys, "-s", str(sites), "show", "global@1")
    assert code == 0 and "merged from" in out and "site-b@v1 (weight 0.3)" in out
    code, out, _ = run(capsys, "-s", str(sites), "show", "global@1", "--json")
    assert [i["position"] for i in json.loads(out)["merge"]["inputs"]] == [0, 1, 2]


def test_lineage_shows_every_parent_of_a_merge(
    sites: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "-s", str(sites), "merge", *INPUTS, "--run", "global", "--step", "1",
               "--weights", "1,1,2")[0] == 0
    code, out, _ = run(capsys, "-s", str(sites), "lineage", "global@latest")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("global@v1 (step 1, ")
    assert lines[1].startswith("└─ merged from site-a@v2 (step 1, ") and \
        lines[1].endswith(", weight 0.25")
    assert lines[2].startswith("   └─ from site-a@v1 (step 0, ")  # the input's own parent
    assert lines[3].startswith("└─ merged from site-b@v1") and lines[3].endswith("weight 0.25")
    assert lines[4].startswith("└─ merged from site-c@v1") and lines[4].endswith("weight 0.5")

    code, out, _ = run(capsys, "-s", str(sites), "lineage", "global@latest", "-f", "dot")
    assert '"site-c@v1" -> "global@v1" [label="merged-from 0.5", style=dashed];' in out
    assert '"site-a@v1" -> "site-a@v2";' in out
    code, out, _ = run(capsys, "-s", str(sites), "lineage", "global@latest", "-f", "mermaid")
    assert 'n_site_b_v1["site-b@v1"] -. "merged-from 0.25" .-> n_global_v1["global@v1"]' in out
    code, out, _ = run(capsys, "-s", str(sites), "lineage", "global@latest", "--json")
    doc = json.loads(out)
    assert {n["ref"] for n in doc["nodes"]} == {"site-a@v2", "site-a@v1", "site-b@v1",
                                                "site-c@v1"}
    assert {"from": "site-c@v1", "to": "global@v1", "kind": "merged-from",
            "weight": 0.5} in doc["edges"]
    assert {"from": "site-a@v1", "to": "site-a@v2", "kind": "parent"} in doc["edges"]

    code, out, _ = run(capsys, "-s", str(sites), "lineage", "site-a@v1", "--descendants")
    assert "└─ derived site-a@v2" in out
    assert "   └─ merged into global@v1" in out and out.rstrip().endswith("weight 0.25")


USAGE = [
    (["--method", "median"], "median"),
    (["--weights", "1,two,3"], "'two' is not a number"),
    (["--weights", "1,2"], "2 weights for 3 inputs"),
    (["--method", "mean", "--weights", "1,2,3"], "--method weighted"),
    (["--method", "weighted"], "needs --weights"),
    (["--weights", "1,1,1", "--weights-from-metric", "samples"], "not both"),
    (["--accumulate", "float16"], "float16"),
]


@pytest.mark.parametrize(("extra", "words"), USAGE, ids=[w for _, w in USAGE])
def test_usage_errors_exit_2_before_opening_the_store(
    sites: Path, capsys: pytest.CaptureFixture[str], extra: list[str], words: str
) -> None:
    code, _, err = run(capsys, "-s", str(sites), "merge", *INPUTS, "--run", "global",
                       "--step", "1", *extra)
    assert code == 2 and words in err


FAILURES = [
    (["site-a@1"], [], "at least two"),
    (["site-a@1", "site-a@v2"], [], "same checkpoint"),
    (["site-a@1", "site-z@latest"], [], "site-z"),
    (list(INPUTS), ["--weights", "1,nan,1"], "finite"),
    (list(INPUTS), ["--weights", "1,-1,1"], "negative"),
    (list(INPUTS), ["--weights", "0,0,0"], "positive"),
    (["site-a@1", "other@latest"], [], "tensor w is in site-a@v2 but not in other@v1"),
]


@pytest.mark.parametrize(("refs", "extra", "words"), FAILURES, ids=[f[2] for f in FAILURES])
def test_failed_merges_exit_1_and_leave_nothing(
    sites: Path, capsys: pytest.CaptureFixture[str], refs: list[str], extra: list[str],
    words: str,
) -> None:
    code, out, err = run(capsys, "-s", str(sites), "merge", *refs, "--run", "global",
                         "--step", "1", *extra)
    assert code == 1 and words in err and "error:" in err
    code, out, _ = run(capsys, "-s", str(sites), "merge", *refs, "--run", "global",
                       "--step", "1", *extra, "--json")
    assert code == 1 and words in json.loads(out)["error"]["message"]
    with CheckpointStore.open(sites) as store:
        assert [ck for ck in store.list(state=None) if ck.run == "global"] == []
