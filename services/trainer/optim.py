"""AdamW with gradient clipping and verl's schedule: warmup, then constant or cosine.

The schedule advances once per update call (a training step), not once per
optimizer step, as verl's does. Where every parameter is on a GPU the AdamW
step is torch's fused kernel (a few launches for the whole model instead of
several per tensor; it takes FSDP2's DTensor shards), elsewhere torch's default.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from services import algos


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float
    warmup_steps: int
    warmup_style: str  # constant or cosine
    min_lr_ratio: float
    total_steps: int
    offload: bool = False  # keep the AdamW state in CPU memory between update calls


class Optimizer:
    def __init__(self, params: Iterable[torch.nn.Parameter], settings: OptimSettings):
        self.params = [p for p in params if p.requires_grad]
        self.settings = settings
        self.adamw = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=settings.weight_decay,
                                       betas=settings.betas, fused=fusable(self.params) or None)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.adamw, lambda step: algos.lr_factor(
            step, settings.warmup_steps, settings.total_steps, style=settings.warmup_style,
            min_lr_ratio=settings.min_lr_ratio))

    def step(self) -> float:
        """Clip the gradients, step, zero them; returns the gradient norm before clipping.

        With sharded (DTensor) parameters the norm is over the whole model, every rank's shards."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        return float(grad_norm)

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Around an update call: with offload, the AdamW state comes to the parameters' device for the call
        and goes back to CPU memory after it (verl's optimizer_offload)."""
        if not self.settings.offload:
            yield
            return
        self._move_state(self.params[0].device)
        try:
            yield
        finally:
            self._move_state(torch.device("cpu"))

    def _move_state(self, device: torch.device) -> None:
        for state in self.adamw.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(device)

    def advance_schedule(self) -> None:
        self.schedule.step()

    @property
    def lr(self) -> float:
        return float(self.schedule.get_last_lr()[0])


def fusable(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters: all on CUDA (with parameter offload they are
    on the CPU)."""
    return bool(params) and all(param.device.type == "cuda" for param in params)


def chunks(rows: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """Consecutive slices of ``rows`` holding at most ``size`` rows each."""
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


def shuffled_mini_batches(num_rows: int, mini_batch_size: int, epochs: int,
                          *, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Row indices of each mini-batch: every epoch a fresh shuffle cut into mini-batches."""
    for _ in range(epochs):
        yield from chunks(torch.randperm(num_rows, generator=generator), mini_batch_size)


def mean_metrics(per_mini_batch: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the mini-batches that reported it."""
    keys = {key for metrics in per_mini_batch for key in metrics}
    return {key: sum(m[key] for m in per_mini_batch if key in m) / sum(key in m for m in per_mini_batch)
            for key in keys}
