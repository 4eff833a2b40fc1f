"""The tiny classification dataset the Hugging Face tests train on: 32 fixed examples, each
made from its own seed, so every run and every process sees the same batches."""

from __future__ import annotations

import torch


class TinyData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """32 sequences of 8 token ids below 100, labelled by parity of their index."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        return {"input_ids": torch.randint(0, 100, (8,), generator=gen),
                "labels": torch.tensor(index % 2)}
