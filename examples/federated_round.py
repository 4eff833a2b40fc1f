"""One round of federated averaging between three sites, through a remote none of them trusts.

Five stores, each with its own catalog and hot tier: three sites (``site-a``, ``site-b``,
``site-c``), an aggregator, and a shared ``hub`` whose warm tier is the shared bucket (S3 with
``--hub-warm s3://...``; a local directory by default). The hub only ever holds ciphertext:
its catalog records nothing of what passes through it.

1. Keys. Every party makes a signing pair (``ckpt keygen --out keys --name site-a-sign``)
   and an encryption pair (``ckpt keygen --encryption --out keys --name site-a-enc``);
   public keys are exchanged out of band.
2. Each site trains the same small model on its own data, saves a checkpoint with its
   sample count as the ``samples`` metric, signs it (``ckpt sign``) and pushes it encrypted
   to the aggregator (``ckpt push site-a@latest --to hub --encrypt-to agg-enc.pub``).
3. An impostor who can write to the bucket leaves two contributions under site-b's name, one
   unsigned and one signed with its own key, encrypted to the aggregator too.
4. The aggregator pulls each site's contribution with ``--require-signature`` and that
   site's public key:
   ``ckpt pull site-b@20 --from hub --key agg-enc.key --require-signature site-b-sign.pub``.
   The impostor's copies are refused, the site's is
   decrypted and every chunk checked against the manifest's blake3. It merges them weighted
   by sample count (FedAvg), signs the global model and pushes it encrypted to all three
   sites (``--encrypt-to`` once per site):
   ``ckpt merge site-a@20 site-b@20 site-c@20 --run global --step 1 --weights-from-metric samples``.
5. Each site pulls the global model (its own key, the aggregator's signature required),
   loads it and resumes training from it.

Run it::

    python examples/federated_round.py --workdir /tmp/fedavg
    python examples/federated_round.py --workdir /tmp/fedavg2 --hub-warm s3://bucket/hub \\
        --endpoint-url http://127.0.0.1:9000

It prints one line per step and, at the end, the global model's loss on each site's data
before and after the round as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptstore.cli.app import main as ckpt_main
from ckptstore.store import CheckpointStore

SITES = ("site-a", "site-b", "site-c")
#: Samples each site trains on (FedAvg weighs the sites by them).
SAMPLES = {"site-a": 256, "site-b": 128, "site-c": 64}
LOCAL_STEPS = 20


def make_model() -> nn.Module:
    """The shared architecture: 8 inputs → 16 → 1."""
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def site_data(site: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A site's private data: the same target function, each site its own inputs."""
    gen = torch.Generator().manual_seed(SITES.index(site) + 1)
    x = torch.randn(SAMPLES[site], 8, generator=gen) + 0.3 * SITES.index(site)
    y = x[:, :3].sum(dim=1, keepdim=True)
    return x, y


def loss_on(model: nn.Module, site: str) -> float:
    """Mean squared error of ``model`` on a site's data."""
    x, y = site_data(site)
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def train(model: nn.Module, site: str, steps: int) -> float:
    """Full-batch SGD on the site's data; returns the last loss."""
    x, y = site_data(site)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return float(loss.detach())


class Federation:
    """The five stores' config files and the parties' keys under ``workdir``."""

    def __init__(self, workdir: Path, hub_warm: str | None, endpoint_url: str | None) -> None:
        self.workdir = workdir
        self.keys = workdir / "keys"
        self.hub_warm = hub_warm or str(workdir / "bucket")
        self.endpoint_url = endpoint_url
        self.log: list[str] = []

    def config(self, name: str) -> Path:
        """The config file of store ``name`` (written on first use)."""
        path = self.workdir / f"{name}.toml"
        if not path.exists():
            lines = [f'root = "{self.workdir / name}"']
            if name == "hub":
                lines += ["[tiers]", f'warm = "{self.hub_warm}"']
                if self.endpoint_url:
                    lines += ["[storage_options]", f'endpoint_url = "{self.endpoint_url}"']
            path.write_text("\n".join(lines) + "\n")
        return path

    def ckpt(self, store: str, *args: str, ok: bool = True) -> Any:
        """Run the ckpt command ``args`` on store ``store`` (its config, ``--json``); returns
        the JSON it printed.

        With ``ok=False`` the command is expected to fail: returns its exit status.
        """
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = ckpt_main([*args, "--config", str(self.config(store)), "--json"])
        self.log.append(f"[{store}] ckpt {' '.join(args)} -> exit {code}")
        print(self.log[-1], file=sys.stderr)
        if not ok:
            return code
        if code != 0:
            raise RuntimeError(f"ckpt {' '.join(args)} failed ({code}): {out.getvalue()}")
        text = out.getvalue().strip()
        return json.loads(text) if text else None

    def key(self, name: str, suffix: str) -> str:
        """Path of key file ``name.suffix``."""
        return str(self.keys / f"{name}.{suffix}")

    def store(self, name: str) -> CheckpointStore:
        """Open store ``name`` (the caller closes it)."""
        return CheckpointStore.open(config=self.config(name))


def run_round(workdir: Path, *, hub_warm: str | None = None,
              endpoint_url: str | None = None) -> dict[str, Any]:
    """Set up the federation under ``workdir`` and run one round; returns what happened."""
    fed = Federation(workdir, hub_warm, endpoint_url)
    workdir.mkdir(parents=True, exist_ok=True)
    parties = [*SITES, "agg", "eve"]
    for party in parties:
        fed.ckpt("hub", "keygen", "--out", str(fed.keys), "--name", f"{party}-sign")
        fed.ckpt("hub", "keygen", "--encryption", "--out", str(fed.keys),
                 "--name", f"{party}-enc")
    hub = fed.store("hub")  # created before anyone adds it as a remote
    hub.close()
    for name in (*SITES, "agg", "eve"):
        with fed.store(name):
            pass
        code = ckpt_main(["--config", str(fed.config(name)), "remote", "add", "hub",
                          "--config", str(fed.config("hub")), "--json"])
        if code != 0:
            raise RuntimeError(f"{name}: remote add hub failed ({code})")

    # 2. Every site trains the same initial model on its own data and shares it.
    torch.manual_seed(0)
    initial = make_model().state_dict()
    step = LOCAL_STEPS
    contributions: dict[str, str] = {}
    for site in SITES:
        model = make_model()
        model.load_state_dict(initial)
        loss = train(model, site, LOCAL_STEPS)
        with fed.store(site) as store:
            ck = store.save(site, step, {"model": model.state_dict()},
                            metrics={"samples": float(SAMPLES[site]), "loss": loss})
        contributions[site] = ck.id
        fed.ckpt(site, "sign", f"{site}@latest", "--key", fed.key(f"{site}-sign", "key"))
        fed.ckpt(site, "push", f"{site}@latest", "--to", "hub",
                 "--encrypt-to", fed.key("agg-enc", "pub"))

    # 3. An impostor leaves contributions under site-b's name: unsigned, and signed by eve.
    poisoned = make_model()
    with torch.no_grad():
        for p in poisoned.parameters():
            p.fill_(100.0)
    with fed.store("eve") as store:
        unsigned = store.save("site-b", step, {"model": poisoned.state_dict()},
                              metrics={"samples": 1e9})
        forged = store.save("site-b", step, {"model": poisoned.state_dict()},
                            metrics={"samples": 1e9})
    fed.ckpt("eve", "sign", forged.id, "--key", fed.key("eve-sign", "key"))
    for ck_id in (unsigned.id, forged.id):
        fed.ckpt("eve", "push", ck_id, "--to", "hub", "--encrypt-to", fed.key("agg-enc", "pub"))

    # 4. The aggregator takes only what each site signed, merges, signs and sends back.
    refused = 0
    for site in SITES:
        pulled = fed.ckpt("agg", "pull", f"{site}@{step}", "--from", "hub",
                          "--key", fed.key("agg-enc", "key"),
                          "--require-signature", fed.key(f"{site}-sign", "pub"))
        refused += pulled["refused"]
    merged = fed.ckpt("agg", "merge", *(f"{s}@{step}" for s in SITES), "--run", "global",
                      "--step", "1", "--weights-from-metric", "samples")
    global_id = merged["checkpoint"]["id"]
    fed.ckpt("agg", "sign", global_id, "--key", fed.key("agg-sign", "key"))
    fed.ckpt("agg", "push", global_id, "--to", "hub",
             *(arg for s in SITES for arg in ("--encrypt-to", fed.key(f"{s}-enc", "pub"))))

    # 5. Every site takes the global model (signed by the aggregator) and resumes from it.
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    for site in SITES:
        fed.ckpt(site, "pull", "global@latest", "--from", "hub",
                 "--key", fed.key(f"{site}-enc", "key"),
                 "--require-signature", fed.key("agg-sign", "pub"))
        model = make_model()
        with fed.store(site) as store:
            state = store.load("global@latest")
            model.load_state_dict(state["model"])
            before[site] = loss_on(model, site)
            loss = train(model, site, LOCAL_STEPS)
            store.save(site, 2 * step, {"model": model.state_dict()},
                       metrics={"samples": float(SAMPLES[site]), "loss": loss},
                       parent=global_id)
        after[site] = loss_on(model, site)
    return {"contributions": contributions, "global": global_id, "refused": refused,
            "loss_before": before, "loss_after": after, "steps": fed.log}


def main(argv: list[str] | None = None) -> int:
    """Run one round; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, type=Path,
                        help="directory for the five stores and the keys (created)")
    parser.add_argument("--hub-warm", default=None,
                        help="the shared bucket: the hub's warm tier (default: a directory)")
    parser.add_argument("--endpoint-url", default=None, help="S3 endpoint of --hub-warm")
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    outcome = run_round(args.workdir, hub_warm=args.hub_warm, endpoint_url=args.endpoint_url)
    if args.json:
        print(json.dumps(outcome, indent=1))
    else:
        print(f"global model {outcome['global']}: {outcome['refused']} forged or unsigned "
              "contributions refused")
        for site in SITES:
            print(f"{site}: loss {outcome['loss_before'][site]:.4f} from the global model, "
                  f"{outcome['loss_after'][site]:.4f} after resuming")
    return 0


if __name__ == "__main__":
    sys.exit(main())
