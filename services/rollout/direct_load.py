"""Loading HF-named tensors straight into a vLLM model's parameters, once a real ``load_weights`` has shown
where each one lands.

vLLM's ``load_weights`` reslices HF tensors into its own layout (q/k/v and
gate/up stacked, tensor-parallel shards), one Python call per tensor. With a
single worker the layout is a renaming plus a row offset into a stacked
parameter (q, k, v and gate, up, in that order). After a sync through
``load_weights``, ``DirectLoader.learn`` checks that each received tensor
sits where that layout puts it, equal byte for byte, and keeps the view;
later buckets whose tensors all have views are copied into them directly. If any tensor
is found nowhere (tensor parallelism, quantized or unfamiliar layers), the
loader stops learning and the worker keeps using ``load_weights``.
"""

from __future__ import annotations

import torch

STACKED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def stacked_place(name: str) -> tuple[str, int, str] | None:
    """(stacked parameter name, index of the part, the part) when HF tensor ``name`` is a part of one."""
    for fused, parts in STACKED:
        for index, part in enumerate(parts):
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), index, part
    return None


class DirectLoader:
    """The learned view of each HF tensor name in the model's parameters."""

    def __init__(self, model: torch.nn.Module):
        self.params = {name: p.data for name, p in model.named_parameters()}
        self.views: dict[str, torch.Tensor] = {}
        self.unknown: set[str] = set()  # names seen in a sync but found nowhere
        self._rows: dict[tuple[str, int], int] = {}  # (stacked parameter, part index) -> rows of that part

    def place(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """Where the TP-1 layout puts ``name``: its own parameter, or its rows of the stacked parameter, after
        the rows of the parts before it (which come first in HF order)."""
        own = self.params.get(name)
        if own is not None:
            return own if own.shape == tensor.shape else None
        stacked = stacked_place(name)
        if stacked is None or stacked[0] not in self.params or tensor.dim() == 0:
            return None
        fused, index, _ = stacked
        self._rows[(fused, index)] = tensor.shape[0]
        if any((fused, earlier) not in self._rows for earlier in range(index)):
            return None
        offset = sum(self._rows[(fused, earlier)] for earlier in range(index))
        target = self.params[fused]
        if target.shape[1:] != tensor.shape[1:] or offset + tensor.shape[0] > target.shape[0]:
            return None
        return target[offset : offset + tensor.shape[0]]

    def learn(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """After ``load_weights(named)``: remember where each tensor now sits, equal to what was sent (once a
        tensor was found nowhere, nothing more is learned)."""
        if self.unknown:
            return
        for name, tensor in named:
            view = self.place(name, tensor)
            if view is not None and view.dtype == tensor.dtype and torch.equal(view, tensor):
                self.views[name] = view
            else:
                self.unknown.add(name)

    def knows(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether every tensor of a bucket can be copied straight into its view."""
        return not self.unknown and all(name in self.views for name, _ in named)

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy a known bucket into the model, in one batched copy."""
        torch._foreach_copy_([self.views[name] for name, _ in named], [tensor for _, tensor in named])
