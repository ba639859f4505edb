"""Next-token loss with the per-kind and per-task split, and held-out evaluation.

The loss is a mean over every non-padding target. Its split keeps sums and counts per kind
(L_I|T, L_I|0, L_T|I, caption-first text, specials) and per trained task (t2i, i2t, img):
each partitions the targets, so both add back up to the total exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from pairforge.train.sequences import METRICS, TASKS, Batch, Kind

N_KINDS = len(Kind)


class LossSums:
    """Summed token losses and target counts per kind and per task."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.kind = torch.zeros(N_KINDS, 2, dtype=torch.float64, device=device)
        self.task = torch.zeros(len(TASKS), 2, dtype=torch.float64, device=device)

    def add(self, losses: torch.Tensor, batch: Batch) -> None:
        """losses: (B, T) per-token loss, zero where the target is padding."""
        losses = losses.detach().double()
        real = (batch.kinds != Kind.PAD).double()
        self.kind[:, 0].index_add_(0, batch.kinds.flatten(), losses.flatten())
        self.kind[:, 1].index_add_(0, batch.kinds.flatten(), real.flatten())
        self.task[:, 0].index_add_(0, batch.tasks, losses.sum(1))
        self.task[:, 1].index_add_(0, batch.tasks, real.sum(1))

    def all_reduce(self) -> LossSums:
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.kind)
            torch.distributed.all_reduce(self.task)
        return self

    def state(self) -> dict[str, torch.Tensor]:
        return {"kind": self.kind.cpu(), "task": self.task.cpu()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.kind.copy_(state["kind"])
        self.task.copy_(state["task"])

    def summary(self) -> dict[str, Any]:
        """Mean losses (None where nothing was measured) and target counts."""
        kind, task = self.kind.cpu().tolist(), self.task.cpu().tolist()
        total_loss = sum(s for s, _ in kind[1:])
        total_n = sum(n for _, n in kind[1:])
        out: dict[str, Any] = {"loss": total_loss / total_n if total_n else None,
                               "targets": int(total_n)}
        for name, k in METRICS.items():
            s, n = kind[k]
            out[name] = s / n if n else None
            out[f"n_{name}"] = int(n)
        out["tasks"] = {t: {"loss": s / n if n else None, "targets": int(n)}
                        for t, (s, n) in zip(TASKS, task, strict=True)}
        return out


def token_losses(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """(B, T) cross-entropy per target, exactly zero on padding (never a target)."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(),
                             reduction="none").view_as(batch.targets)
    return losses.masked_fill(batch.kinds == Kind.PAD, 0.0)


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """bf16 autocast on GPU, plain fp32 elsewhere."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch], device: torch.device,
             precision: str) -> dict[str, Any]:
    """Per-kind and per-task held-out losses, summed over every process's share."""
    was_training = model.training
    model.eval()
    sums = LossSums(device)
    for batch in batches:
        batch = batch.to(device)
        with autocast(device, precision):
            logits = model(batch.inputs)
        sums.add(token_losses(logits, batch), batch)
    model.train(was_training)
    return sums.all_reduce().summary()
