"""What the integration tests and their trainer scripts share: the tiny classification
dataset the Hugging Face tests train on (32 fixed examples, each made from its own seed, so
every run and every process sees the same batches), and a digest of a training state that a
killed process and its restart can compare."""

from __future__ import annotations

import hashlib
from typing import Any

import torch


class TinyData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """32 sequences of 8 token ids below 100, labelled by parity of their index."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        return {"input_ids": torch.randint(0, 100, (8,), generator=gen),
                "labels": torch.tensor(index % 2)}


def state_digest(model: Any, optimizer: Any) -> str:
    """sha256 of the weights and the optimizer state's tensors, in a fixed order."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for index, entry in sorted(optimizer.state_dict()["state"].items()):
        for name, t in sorted(entry.items()):
            if isinstance(t, torch.Tensor):
                h.update(f"{index}.{name}".encode())
                h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
