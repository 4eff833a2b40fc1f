"""Training states for the benchmarks: a GPT-2-style model plus AdamW moments after one step.

The model is written here as plain ``torch.nn`` (no ``transformers`` dependency). The output
head is tied to the token embedding by computing the logits with the embedding matrix, so the
state dict holds every parameter exactly once (148 tensors for GPT-2 small): formats that refuse
shared storage (safetensors) and formats that would save a shared tensor twice (ckptstore saves
values, not storages) see the same bytes.

Also here: helpers every benchmark needs to handle such a state (flatten for safetensors,
copy a loaded state into the live one, fingerprint tensors to check a load).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PRESETS",
    "GPTConfig",
    "GPTModel",
    "TrainState",
    "build_state",
    "copy_into",
    "fingerprint",
    "flat_tensors",
    "iter_tensors",
    "state_bytes",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2-style decoder.

    Attributes:
        vocab: Vocabulary size (rows of the token embedding, tied to the head).
        context: Maximum sequence length (rows of the position embedding).
        width: Model width.
        layers: Number of transformer blocks.
        heads: Attention heads per block.
    """

    vocab: int
    context: int
    width: int
    layers: int
    heads: int


PRESETS: dict[str, GPTConfig] = {
    # GPT-2 small: 124.4M parameters, 1.49 GB as fp32 weights + exp_avg + exp_avg_sq.
    "gpt2-small": GPTConfig(vocab=50257, context=1024, width=768, layers=12, heads=12),
    # CI smoke size: 13.9M parameters, 167 MB of state, same structure (304 tensors).
    "quick": GPTConfig(vocab=8192, context=256, width=384, layers=6, heads=6),
    # Warm-up size: a few MB with the same structure (imports, first-call set-up, checks).
    "tiny": GPTConfig(vocab=512, context=32, width=64, layers=2, heads=2),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        """Create the block's layers for ``cfg``."""
        super().__init__()
        self.heads = cfg.heads
        self.ln_1 = nn.LayerNorm(cfg.width)
        self.c_attn = nn.Linear(cfg.width, 3 * cfg.width)
        self.c_proj = nn.Linear(cfg.width, cfg.width)
        self.ln_2 = nn.LayerNorm(cfg.width)
        self.c_fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.mlp_proj = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply attention and MLP with residual connections to ``x`` of shape (B, T, C)."""
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return out


class GPTModel(nn.Module):
    """GPT-2-style language model with the output head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        """Create the embeddings, ``cfg.layers`` blocks and the final layer norm."""
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self._init_weights(cfg)

    def _init_weights(self, cfg: GPTConfig) -> None:
        # GPT-2's scheme: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers), so the
        # bytes look like a real initialisation (this matters for compression ratios).
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = 0.02
            if name.endswith(("c_proj.weight", "mlp_proj.weight")):
                std /= math.sqrt(2 * cfg.layers)
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return next-token logits of shape (B, T, vocab) for token ids ``idx`` (B, T)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


TrainState = dict[str, Any]


def build_state(preset: str = "gpt2-small", *, seed: int = 0, mixed: bool = False) -> TrainState:
    """Build ``{"model": ..., "optimizer": ...}`` after one real AdamW training step.

    One forward/backward pass on a small random batch fills every gradient, so AdamW creates
    ``step``, ``exp_avg`` and ``exp_avg_sq`` for every parameter (dense, non-zero moments).

    Args:
        preset: A key of :data:`PRESETS`.
        seed: Seed for the weights and the batch.
        mixed: Mixed-precision training's state instead: the model's weights in bf16, fp32
            master weights under ``"master"`` and fp32 moments (GPT-2 small: 1.74 GB, a
            quarter of its tensors bf16).

    Returns:
        The training state; its tensors are the model's parameters and the optimizer's state.

    Raises:
        KeyError: If ``preset`` is unknown.
    """
    cfg = PRESETS[preset]
    torch.manual_seed(seed)
    model = GPTModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    idx = torch.randint(0, cfg.vocab, (2, 32))
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), idx[:, 1:].reshape(-1))
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        model_state = {k: v.detach() for k, v in model.state_dict().items()}
    if not mixed:
        return {"model": model_state, "optimizer": opt.state_dict()}
    master = {k: v.clone() for k, v in model_state.items()}
    bf16 = {k: v.to(torch.bfloat16) for k, v in model_state.items()}
    return {"model": bf16, "master": master, "optimizer": opt.state_dict()}


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in a nested state, in a stable order.

    Args:
        obj: A nesting of dicts, lists and tuples.
        prefix: Path of ``obj`` itself.

    Yields:
        Slash-separated key paths (``optimizer/state/3/exp_avg``) and their tensors.
    """
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from iter_tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{prefix}/{i}" if prefix else str(i))


def flat_tensors(state: Any) -> dict[str, torch.Tensor]:
    """Flatten a nested state into ``{path: tensor}`` (the shape safetensors accepts)."""
    return dict(iter_tensors(state))


def state_bytes(state: Any) -> int:
    """Total tensor payload of a state in bytes."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


def copy_into(dst: Any, src: Any) -> None:
    """Copy every tensor of ``src`` into the tensor at the same path of ``dst`` (in place).

    Args:
        dst: The live state (same nesting as ``src``).
        src: A loaded state; may be a nested state or a flat ``{path: tensor}`` dict.

    Raises:
        KeyError: If ``src`` lacks a tensor that ``dst`` has.
    """
    flat = src if _is_flat(src) else flat_tensors(src)
    with torch.no_grad():
        for path, tensor in iter_tensors(dst):
            tensor.copy_(flat[path])


def _is_flat(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(isinstance(v, torch.Tensor) for v in obj.values())


def fingerprint(state: Any) -> dict[str, int]:
    """Per-tensor crc32c of the raw bytes, to check that a load returned the saved values.

    Args:
        state: A nested state or a flat ``{path: tensor}`` dict.

    Returns:
        ``{path: crc32c}``.
    """
    items = state.items() if _is_flat(state) else iter_tensors(state)
    out: dict[str, int] = {}
    for path, tensor in items:
        data: Any = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[path] = crc32c.crc32c(data)
    return out
