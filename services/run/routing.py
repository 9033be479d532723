"""Routing replay (R3): the experts a mixture-of-experts model routed each token to, recorded where the rollout
samples and replayed where the trainer scores and updates, so both compute each token with the same experts.

A transformers MoE layer (Qwen3-MoE's ``Qwen3MoeTopKRouter``, Qwen2-MoE's, ...) routes through one module, its
router (``<layer>.mlp.gate``), whose forward maps the layer's hidden states [N, H] to (router logits [N, E], the
chosen experts' weights [N, k], the chosen experts [N, k]). Both hooks act on that output, layer by layer in the
model's order:

- ``RouteRecorder`` keeps the chosen experts of the last forward pass.
- ``replaying`` swaps the chosen experts for given ones (a token given none keeps its own) and weighs them by the
  router's own softmax at those experts, renormalised over the k where the router renormalises its top-k. The
  router's weights so still get their gradient through the experts' weights, as in verl's and slime's R3; only
  the choice is replayed. It also counts the token-layer routes on which the router, left alone, would have
  chosen the same set of experts (``RouteTally``: the routing agreement).

Routes travel as small integers, [tokens, layers, k]: uint8 up to 256 experts, int16 beyond (``route_dtype``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from services.common.sequences import NO_ROUTE


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, one per MoE layer in layer order (none for a dense model)."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopKRouter")]


def experts_of(router: torch.nn.Module) -> int:
    """How many experts a router chooses among."""
    return int(router.num_experts)  # type: ignore[arg-type]  # an int attribute of every TopKRouter


def top_k_of(router: torch.nn.Module) -> int:
    """How many experts a router chooses for each token."""
    return int(router.top_k)  # type: ignore[arg-type]  # an int attribute of every TopKRouter


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that names every expert: uint8 up to 256 experts, else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class RouteRecorder:
    """Records the experts each router chose in a model's forward passes (``take`` after each pass)."""

    def __init__(self, model: torch.nn.Module):
        self._routers = routers(model)
        if not self._routers:
            raise ValueError("routed experts were asked for, but the model has no mixture-of-experts layers")
        self.dtype = route_dtype(experts_of(self._routers[0]))
        self._chosen: list[torch.Tensor | None] = [None] * len(self._routers)
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(self._routers)]

    def _hook(self, layer: int) -> Callable[..., None]:
        def keep(module: torch.nn.Module, args: tuple[object, ...], output: tuple[torch.Tensor, ...]) -> None:
            self._chosen[layer] = output[2].detach().to("cpu", self.dtype)
        return keep

    def take(self) -> torch.Tensor:
        """The routes of the last forward pass: [N, layers, k], N its tokens in the order the router saw them."""
        if any(chosen is None for chosen in self._chosen):
            raise RuntimeError("a router of the model did not run in the last forward pass")
        routes = torch.stack(self._chosen, dim=1)  # type: ignore[arg-type]  # none is None (checked above)
        self._chosen = [None] * len(self._routers)
        return routes

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class RouteTally:
    """Token-layer routes given to a replay, and those on which the model's own router chose the same experts."""

    agreed: int = 0
    given: int = 0

    def agreement(self) -> float | None:
        """The share of given routes the router agreed with (None: none given)."""
        return self.agreed / self.given if self.given else None


def replayed_choice(router_logits: torch.Tensor, own: torch.Tensor, given: torch.Tensor,
                    *, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts to use and their weights. [N, E], [N, k], [N, k] (``NO_ROUTE`` rows: the router's own) ->
    [N, k] int64, [N, k] in the logits' dtype.

    The weights are the router's softmax over all experts at the experts used, divided by their sum when
    ``renormalise`` (the router's norm_topk_prob); differentiable in the logits."""
    has_route = given[:, :1] != NO_ROUTE
    chosen = torch.where(has_route, given.to(own.dtype), own)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, chosen)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return chosen, weights.to(router_logits.dtype)


def agreeing_routes(own: torch.Tensor, given: torch.Tensor) -> tuple[int, int]:
    """(routes on which ``own`` chose the same set of experts as ``given``, routes given). [N, k], [N, k]."""
    has_route = given[:, 0] != NO_ROUTE
    same = (torch.sort(own, dim=-1).values == torch.sort(given.to(own.dtype), dim=-1).values).all(dim=-1)
    return int((same & has_route).sum()), int(has_route.sum())


@contextmanager
def replaying(model: torch.nn.Module, routes: torch.Tensor, replay: bool = True,
              *, tally: RouteTally | None = None) -> Iterator[None]:
    """Inside, every forward pass of ``model`` routes its N = rows x positions tokens by ``routes`` [N, layers, k]
    (``NO_ROUTE`` rows: by the router); with ``replay`` false the router chooses but is compared with them.
    ``tally`` counts the routes given and those the router agreed with, layer by layer, in every pass (a pass
    recomputed for gradient checkpointing counts again)."""
    layers = routers(model)
    if not layers:
        raise ValueError("the batch carries routed_experts, but the model has no mixture-of-experts layers")
    experts, top_k = experts_of(layers[0]), top_k_of(layers[0])
    if routes.dim() != 3 or tuple(routes.shape[1:]) != (len(layers), top_k):
        raise ValueError(f"routed_experts has routes of shape {list(routes.shape[1:])} per token; the model routes "
                         f"[{len(layers)} layers, top-{top_k}]")
    if routes.numel() and (routes.min() < NO_ROUTE or routes.max() >= experts):
        raise ValueError(f"routed_experts names experts outside [0, {experts})")

    def hook(layer: int) -> Callable[..., tuple[torch.Tensor, ...] | None]:
        def swap(module: torch.nn.Module, args: tuple[object, ...],
                 output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
            router_logits, _, own = output
            given = routes[:, layer].to(own.device)
            if given.shape != own.shape:
                raise ValueError(f"routed_experts gives {tuple(given.shape)} routes at layer {layer}, the forward "
                                 f"pass routes {tuple(own.shape)} (tokens x top-k)")
            if tally is not None:
                agreed, given_count = agreeing_routes(own, given)
                tally.agreed += agreed
                tally.given += given_count
            if not replay:
                return None
            chosen, weights = replayed_choice(router_logits, own, given, renormalise=bool(module.norm_topk_prob))
            return router_logits, weights, chosen
        return swap

    handles = [router.register_forward_hook(hook(layer)) for layer, router in enumerate(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
