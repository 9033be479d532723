"""CPU tests of routing replay (services/run/routing.py): the choice and weights of a replayed route worked out by
hand, and on a tiny Qwen3-MoE the routes the hf engine records while it samples are the routes the trainer's
passes then compute with, whatever the trainer's own routers would choose."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from services.common.sequences import NO_ROUTE, SequenceBatch
from services.coordctl.tiny_model import build_tiny_model
from services.rollout.hf_engine import HFEngine
from services.rollout.sampling import SamplingSettings
from services.run.models import load_causal_lm
from services.run.routing import (RouteTally, agreeing_routes, replayed_choice, replaying, route_dtype,
                                  routers)
from services.trainer.forward import response_logprobs

LAYERS, EXPERTS, TOP_K = 2, 4, 2


def test_a_replayed_route_is_weighed_by_the_routers_softmax_at_its_experts():
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]]))  # softmax .1 .2 .3 .4
    own = torch.tensor([[3, 2], [3, 2]])
    given = torch.tensor([[0, 1], [NO_ROUTE, NO_ROUTE]])  # the second token keeps its own choice
    chosen, weights = replayed_choice(logits, own, given, renormalise=True)
    assert chosen.tolist() == [[0, 1], [3, 2]]
    assert torch.allclose(weights, torch.tensor([[1 / 3, 2 / 3], [4 / 7, 3 / 7]]))
    _, weights = replayed_choice(logits, own, given, renormalise=False)
    assert torch.allclose(weights, torch.tensor([[0.1, 0.2], [0.4, 0.3]]))


def test_the_router_gets_its_gradient_through_the_replayed_experts_weights():
    logits = torch.zeros(1, 4, requires_grad=True)
    _, weights = replayed_choice(logits, torch.tensor([[2, 3]]), torch.tensor([[0, 1]]), renormalise=False)
    weights[0, 0].backward()  # d softmax_0 / d logit_j = p0 (delta_0j - p_j), p = 1/4 each
    assert torch.allclose(logits.grad, torch.tensor([[3 / 16, -1 / 16, -1 / 16, -1 / 16]]))


def test_agreement_counts_same_sets_of_experts_in_any_order_and_skips_positions_given_none():
    own = torch.tensor([[1, 2], [0, 3], [1, 2], [0, 1]])
    given = torch.tensor([[2, 1], [0, 2], [NO_ROUTE, NO_ROUTE], [0, 1]])
    assert agreeing_routes(own, given) == (2, 3)


def test_routes_are_the_smallest_integers_that_name_every_expert():
    assert route_dtype(128) == torch.uint8 and route_dtype(256) == torch.uint8 and route_dtype(257) == torch.int16


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-moe", hidden_size=32, num_layers=LAYERS,
                            num_heads=2, seed=0, num_experts=EXPERTS, experts_per_token=TOP_K)


def sampled(moe: Path) -> tuple[SequenceBatch, torch.Tensor]:
    """Three prompts of different lengths, two samples each, sampled by the hf engine with their routes; and the
    rollout's logprobs."""
    engine = HFEngine(load_causal_lm(moe), pad_id=0, eos_ids=(1,), batch_size=4)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]
    sampling = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=3, stop_token_ids=(),
                                routed_experts=True)
    completions = [c for group in engine.generate(prompts, sampling) for c in group]
    for completion, prompt in zip(completions, [p for p in prompts for _ in range(2)]):
        assert completion.routed_experts is not None and completion.routed_experts.dtype == torch.uint8
        assert completion.routed_experts.shape == (len(prompt) + len(completion.token_ids) - 1, LAYERS, TOP_K)
    batch = SequenceBatch.of_lists([p for p in prompts for _ in range(2)], [c.token_ids for c in completions])
    routes = torch.cat([c.routed_experts for c in completions if c.routed_experts is not None])
    return (SequenceBatch(prompt_ids=batch.prompt_ids, prompt_lens=batch.prompt_lens, response_ids=batch.response_ids,
                          response_lens=batch.response_lens, routed_experts=routes),
            torch.tensor([lp for c in completions for lp in c.logprobs]))


def experts_inputs(model: torch.nn.Module) -> tuple[list[torch.Tensor], list]:
    """The experts each MoE layer computed with in the model's forward passes (filled as they run), and the hooks'
    handles."""
    seen: list[torch.Tensor] = []
    handles = [router.register_forward_hook(lambda module, args, output: seen.append(output[2].detach().clone()))
               for router in routers(model)]
    return seen, handles


@pytest.mark.parametrize("remove_padding", [False, True])
def test_the_trainer_computes_with_the_routes_its_rollout_recorded(moe, remove_padding):
    batch, rollout_logprobs = sampled(moe)
    # the trainer's routers drift from the rollout's: left alone they would choose otherwise on some tokens
    trainer_model = load_causal_lm(moe)
    with torch.no_grad():
        for router in routers(trainer_model):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    seen, handles = experts_inputs(trainer_model)  # registered before the replay: they see the router's own
    routes_used: list[tuple[int, torch.Tensor]] = []  # what each layer's experts computed with
    for layer, experts in enumerate(module for name, module in trainer_model.named_modules()
                                    if name.endswith("mlp.experts")):
        handles.append(experts.register_forward_pre_hook(
            lambda module, args, layer=layer: routes_used.append((layer, args[1].detach().clone()))))
    tally = RouteTally()
    response_logprobs(trainer_model, batch, pad_id=0, temperature=1.0, with_entropy=False, device=torch.device("cpu"),
                      remove_padding=remove_padding, replay_routes=True, tally=tally)
    for handle in handles:
        handle.remove()
    layout = batch.packed() if remove_padding else batch.padded(0)
    expected = layout.routed_experts.flatten(0, 1)  # [rows x positions, layers, k]; pads and last tokens NO_ROUTE
    recorded = expected[:, 0, 0] != NO_ROUTE
    assert int(recorded.sum()) == batch.routed_experts.shape[0]
    assert [layer for layer, _ in routes_used] == list(range(LAYERS))
    for layer, used in routes_used:
        assert torch.equal(used[recorded], expected[recorded, layer])
    assert 0 < tally.agreed < tally.given == batch.routed_experts.shape[0] * LAYERS  # the drift changed some
    assert not all(torch.equal(own[recorded], expected[recorded, layer]) for layer, own in enumerate(seen))

    # on the rollout's own weights, the trainer's replayed logprobs are the rollout's (fp32, one CPU), in either
    # layout of the forward pass, and its routers agree with every recorded route
    same_model = load_causal_lm(moe)
    tally = RouteTally()
    logprobs, _ = response_logprobs(same_model, batch, pad_id=0, temperature=1.0, with_entropy=False,
                                    device=torch.device("cpu"), remove_padding=remove_padding, replay_routes=True,
                                    tally=tally)
    assert torch.allclose(logprobs, rollout_logprobs, atol=1e-5)
    assert tally.agreed == tally.given == batch.routed_experts.shape[0] * LAYERS


def test_replay_changes_the_trainers_logprobs_where_its_routers_disagree(moe):
    batch, _ = sampled(moe)
    drifted = load_causal_lm(moe)
    with torch.no_grad():
        for router in routers(drifted):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    kwargs = dict(pad_id=0, temperature=1.0, with_entropy=False, device=torch.device("cpu"))
    own, _ = response_logprobs(drifted, batch, replay_routes=False, **kwargs)
    unrouted, _ = response_logprobs(drifted, SequenceBatch.of_lists(
        [p.tolist() for p in torch.split(batch.prompt_ids, batch.prompt_lens.tolist())],
        [r.tolist() for r in torch.split(batch.response_ids, batch.response_lens.tolist())]), **kwargs)
    replayed, _ = response_logprobs(drifted, batch, replay_routes=True, **kwargs)
    assert torch.equal(own, unrouted)  # without replay the routes are only compared
    assert not torch.allclose(replayed, own, atol=1e-4)
    assert all(math.isfinite(v) for v in replayed.tolist())


def test_routes_that_do_not_fit_the_model_are_refused_naming_them(moe):
    model = load_causal_lm(moe)
    refused = [(torch.zeros(5, 3, 2, dtype=torch.int64), "routed_experts has routes of shape \\[3, 2\\]"),
               (torch.full((5, LAYERS, TOP_K), 4), "outside \\[0, 4\\)")]
    for routes, message in refused:
        with pytest.raises(ValueError, match=message), replaying(model, routes):
            pass
    dense = copy.deepcopy(model)
    for name, _ in list(dense.named_modules()):
        if name.endswith("mlp.gate"):
            dense.get_submodule(name.rpartition(".")[0]).gate = torch.nn.Identity()
    with pytest.raises(ValueError, match="no mixture-of-experts layers"), replaying(dense, refused[0][0]):
        pass
