"""examples/federated_round.py, end to end, with the shared remote's tier on S3 (moto): three
sites push signed, encrypted contributions; an impostor's are refused; the aggregator merges
by sample count, signs and sends the global model back encrypted; every site resumes from it.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from ckptstore.catalog.lineage import MERGED_FROM
from ckptstore.cli.app import main
from ckptstore.format.sealed import SEALED_DIR
from ckptstore.store import CheckpointStore
from ckptstore.testing.s3 import MotoS3

pytestmark = [pytest.mark.s3, pytest.mark.slow]  # ~30 s: five stores, 25 commands

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "federated_round.py"


@pytest.fixture
def example() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("federated_round_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    level = logging.getLogger().level
    try:
        yield module
    finally:
        torch.set_num_threads(threads)
        logging.getLogger().setLevel(level)


def test_federated_round(example: ModuleType, tmp_path: Path, s3_a: MotoS3,
                         capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "fed"
    hub_warm = s3_a.url("hub-" + tmp_path.name[-8:])
    outcome: dict[str, Any] = example.run_round(work, hub_warm=hub_warm,
                                                endpoint_url=s3_a.endpoint_url)
    # The impostor's unsigned and forged contributions under site-b's name were refused.
    assert outcome["refused"] == 2

    with CheckpointStore.open(config=work / "hub.toml") as hub:
        # The shared remote learned nothing: no catalog rows, ciphertext objects only.
        assert hub.catalog.list() == []
        keys = hub.tier("warm").list_prefix("")
        assert keys and all(k.startswith(f"{SEALED_DIR}/") for k in keys)
        blob = b"".join(hub.tier("warm").get_bytes(k) for k in keys if "/o/" in k)
        for secret in (b"site-a", b"samples", b"model.0.weight", b"global"):
            assert secret not in blob

    with CheckpointStore.open(config=work / "agg.toml") as agg:
        glob = agg.get(outcome["global"])
        inputs = agg.catalog.merge_inputs(glob.id)
        assert [link.kind for link in inputs] == [MERGED_FROM] * 3
        assert {link.src for link in inputs} == set(outcome["contributions"].values())
        # FedAvg: weights are the sites' sample counts, normalised.
        samples = example.SAMPLES
        total = sum(samples.values())
        merged = agg.load(glob.id)["model"]
        expect = None
        for site, ck_id in outcome["contributions"].items():
            part = agg.load(ck_id)["model"]
            w = samples[site] / total
            expect = ({k: w * v.double() for k, v in part.items()} if expect is None else
                      {k: expect[k] + w * v.double() for k, v in part.items()})
        assert expect is not None
        for key, value in merged.items():
            torch.testing.assert_close(value.double(), expect[key], rtol=1e-6, atol=1e-6)

    for site in example.SITES:
        with CheckpointStore.open(config=work / f"{site}.toml") as store:
            assert store.get(outcome["global"]).run == "global"
            resumed = store.get(f"{site}@latest")
            assert resumed.step == 2 * example.LOCAL_STEPS
            assert resumed.parent_id == outcome["global"]
        # Resuming from the global model helped every site.
        assert outcome["loss_after"][site] < outcome["loss_before"][site]

    # Only forged contributions left: the aggregator refuses, exit 1, nothing written.
    agg_cfg = str(work / "agg.toml")
    with CheckpointStore.open(config=work / "agg.toml") as agg:
        before = len(agg.catalog.list())
    code = main(["pull", f"site-b@{example.LOCAL_STEPS}", "--from", "hub", "--config", agg_cfg,
                 "--key", str(work / "keys" / "agg-enc.key"), "--require-signature",
                 str(work / "keys" / "site-a-sign.pub"), "--json"])
    assert code == 1 and "unsigned or forged" in capsys.readouterr().out
    with CheckpointStore.open(config=work / "agg.toml") as agg:
        assert len(agg.catalog.list()) == before
