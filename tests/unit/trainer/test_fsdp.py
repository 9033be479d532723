"""FSDP2 on two CPU ranks (gloo) against one rank: the sharded update, the ranks' shares of each mini-batch,
logprobs gathered back in order, token-budget micro-batches, checkpoints across ranks, the command relay.

The models are float64, so that what is compared is the math and not the rounding: summing the same
gradients in another order (two ranks' shares, other micro-batches) changes them by ~1e-16 relative, and
AdamW's step lr * m / (sqrt(v) + eps) amplifies an error in the gradient by at most lr / eps = 1e5 (where the
gradient is ~0), so weights within 1e-10 are equal math (measured: 3e-15). Logprobs and entropies are
computed in chunks of 8 tokens through the output layer (``chunked_head``, inside the root's FSDP forward, the
output layer tied to the embeddings) and stay float64: logprobs agree with one rank's whole-logits pass within
2e-6, metrics summed over other micro-batches within 1e-6 relative or 1e-7 absolute near 0 (measured: 2e-8,
2e-9). A wrong loss scale (gradients averaged instead of summed over ranks, a divisor of one rank's share instead
of the mini-batch's) moves weights by ~lr = 1e-3 and metrics by 2x.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services import algos
from services.common.sequences import SequenceBatch
from services.coordctl.tiny_model import build_tiny_model
from services.run.models import load_causal_lm, load_value_model
from services.trainer import checkpoint
from services.trainer.actor import Actor, ActorSettings, UpdateInputs
from services.trainer.batching import MicroBatching, micro_batch_plan
from services.trainer.critic import Critic, CriticSettings
from services.trainer.optim import OptimSettings, shuffled_mini_batches
from services.trainer.ranks import join
from services.trainer.sharding import Sharding, place

OPTIM = OptimSettings(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.99), grad_clip=1.0, warmup_steps=0,
                      warmup_style="constant", min_lr_ratio=0.0, total_steps=10)
SEED = 5
CHECKPOINT_KEY = b"k" * 32  # the manifest's signing key (a trainer reads it from its checkpoint root)
MODES = ("token-mean", "seq-mean-token-mean")
PROMPTS = (2, 5, 3, 4, 1, 6, 2, 3)
RESPONSES = (9, 1, 4, 20, 3, 5, 8, 2)  # one long response: the rank that takes it has fewer micro-batches
CHUNK_TOKENS = 8  # logprobs from the hidden states, 8 tokens at a time
LOG_PROB_PASS = MicroBatching(size=2, max_tokens=30, remove_padding=True, chunk_tokens=CHUNK_TOKENS)
COMMAND = {"ids": torch.arange(5), "half": torch.linspace(-2, 2, 6, dtype=torch.bfloat16).reshape(2, 3),
           "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5, dtype=torch.float64)}


def settings(mode: str, micro: int = 2, max_tokens: int | None = None, remove_padding: bool = False) -> ActorSettings:
    return ActorSettings(mini_batch_size=4, micro_batch_size=micro, epochs=2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         clip_ratio_c=3.0, loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                         kl_loss_type="low_var_kl", temperature=0.9, max_response_length=20, max_token_len=max_tokens,
                         remove_padding=remove_padding, logprob_chunk_tokens=CHUNK_TOKENS)


def own_logprobs(inputs: UpdateInputs) -> UpdateInputs:
    """An update without old logprobs, its random ones standing for the rollout's."""
    return replace(inputs, old_logprobs=None, rollout_logprobs=inputs.old_logprobs)


def case():
    """Eight sequences and random float64 update inputs."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 70, (n,), generator=generator).tolist() for n in PROMPTS]
    responses = [torch.randint(3, 70, (n,), generator=generator).tolist() for n in RESPONSES]
    batch = SequenceBatch.of_lists(prompts, responses)
    tokens = batch.num_response_tokens
    inputs = UpdateInputs(old_logprobs=torch.randn(tokens, generator=generator, dtype=torch.float64) - 4,
                          advantages=torch.randn(tokens, generator=generator, dtype=torch.float64),
                          ref_logprobs=torch.randn(tokens, generator=generator, dtype=torch.float64) - 4)
    return batch, inputs


def actor(model_path: Path, ranks=None, sharding: Sharding | None = None, checkpointing: bool = False) -> Actor:
    model = load_causal_lm(model_path).double()
    if ranks is not None:
        model = place(model, ranks, sharding, gradient_checkpointing=checkpointing)
    return Actor(model, OPTIM, OPTIM, pad_id=0, seed=SEED, ranks=ranks)


def critic(model_path: Path, ranks=None) -> Critic:
    torch.manual_seed(3)  # the value head's initialisation
    model = load_value_model(model_path).double()
    if ranks is not None:
        model = place(model, ranks, Sharding(fsdp=True), gradient_checkpointing=False)
    return Critic(model, OPTIM, pad_id=0, seed=SEED, ranks=ranks)


def critic_case(model_path: Path, ranks=None) -> tuple[torch.Tensor | None, tuple]:
    """A critic's values of the batch, then its update towards random returns: (values, (metrics, weights))."""
    batch, _ = case()
    values_critic = critic(model_path, ranks)
    values = values_critic.compute_values(batch, LOG_PROB_PASS)
    returns = torch.randn(batch.num_response_tokens, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    old_values = torch.zeros_like(returns)
    metrics = values_critic.update(batch, old_values, returns, settings=CriticSettings(mini_batch_size=4,
                                                                                       micro_batch_size=2, epochs=2,
                                                                                       cliprange_value=0.5, vf_coef=1.0,
                                                                                       loss_agg_mode="token-mean",
                                                                                       max_response_length=20))
    return values, (metrics, full_weights(values_critic.model))


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def two_rank_job(rank: int, port: int, model_path: Path, out: Path) -> None:
    """One of two ranks: logprobs, an update per loss mode, a checkpoint saved and loaded, a relayed command."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True")  # the store is the parent's
    ranks = join("cpu", 60.0)
    batch, inputs = case()
    results = {}
    for mode in MODES:
        sharded = actor(model_path, ranks, Sharding(fsdp=True), checkpointing=True)
        if mode == MODES[0]:
            results["logprobs"] = sharded.compute_log_probs(batch, 0.9, LOG_PROB_PASS)
        results[mode] = (sharded.update(batch, inputs, settings(mode)), full_weights(sharded.model))
    one_step = actor(model_path, ranks, Sharding(fsdp=True), checkpointing=True)
    results["own"] = one_step.update(batch, own_logprobs(inputs),
                                     replace(settings(MODES[0]), mini_batch_size=len(batch), epochs=1))
    results["critic"] = critic_case(model_path, ranks)
    roles = SimpleNamespace(actor=sharded, critic=None, run_id="run-a")
    checkpoint.save(roles, out / "checkpoint", 7, ranks=ranks, key=CHECKPOINT_KEY)
    sharded.update(batch, inputs, settings(MODES[-1]))  # move away from the saved weights
    results["loaded_version"] = checkpoint.load(roles, out / "checkpoint")
    results["loaded"] = full_weights(sharded.model)
    if rank == 0:
        ranks.send_command("probe", {"n": 3}, COMMAND)
    else:
        results["received"] = ranks.receive_command()
    torch.save(results, out / f"rank{rank}.pt")
    ranks.close()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=2, num_heads=2, seed=0)


@pytest.fixture(scope="module")
def two_ranks(model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    # the ranks meet at a store this process listens on already (as torchrun's agent hosts it), on a port it got
    # by binding port 0: a port found free here and bound later by rank 0 could be taken by then
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(two_rank_job, args=(store.port, model_path, out), nprocs=2, join=True)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)], out


def one_rank(model_path: Path, mode: str, **micro) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    whole = actor(model_path)
    batch, inputs = case()
    metrics = whole.update(batch, inputs, settings(mode, **micro))
    return metrics, full_weights(whole.model)


def assert_same_update(got, expected) -> None:
    (got_metrics, got_weights), (expected_metrics, expected_weights) = got, expected
    assert sorted(got_metrics) == sorted(expected_metrics)
    for key, value in expected_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    for name, weight in expected_weights.items():
        torch.testing.assert_close(got_weights[name], weight, rtol=0, atol=1e-10, msg=name)


def test_the_long_sequence_leaves_one_rank_with_fewer_micro_batches():
    """Precondition of the tests below: some mini-batch needs stand-ins (on the rank with the long sequence)."""
    batch, _ = case()
    plans = [micro_batch_plan(batch.sequence_lens, rows, 2, micro=MicroBatching(size=2))
             for rows in shuffled_mini_batches(len(batch), 4, 2, generator=torch.Generator().manual_seed(SEED))]
    assert any(len(part) == 0 for plan in plans for batches in plan for part in batches)


@pytest.mark.parametrize("mode", MODES)
def test_two_rank_update_equals_the_one_rank_update(two_ranks, model_path, mode):
    (rank0, rank1), _ = two_ranks
    expected = one_rank(model_path, mode)
    assert expected[1]["model.embed_tokens.weight"].sub(full_weights(actor(model_path).model)[
        "model.embed_tokens.weight"]).abs().max() > 1e-4  # the update moved the weights
    assert_same_update(rank0[mode], expected)
    assert_same_update(rank1[mode], expected)  # both ranks hold the same metrics and (gathered) weights


def test_logprobs_are_gathered_in_the_batch_order(two_ranks, model_path):
    (rank0, rank1), _ = two_ranks
    batch, _ = case()
    expected = actor(model_path).compute_log_probs(batch, 0.9, MicroBatching(size=len(batch)))
    assert rank1["logprobs"] is None
    assert rank0["logprobs"].shape == (batch.num_response_tokens,)
    torch.testing.assert_close(rank0["logprobs"], expected, rtol=0, atol=2e-6)


def test_one_step_on_its_own_logprobs_gathers_them_in_the_batch_order_for_the_mismatch(two_ranks, model_path):
    (rank0, _), _ = two_ranks
    batch, inputs = case()
    passed = actor(model_path).compute_log_probs(batch, 0.9, MicroBatching(size=len(batch)))
    expected = algos.mismatch_metrics(inputs.old_logprobs, passed, batch.response_lens)
    assert {key: rank0["own"][key] for key in expected} == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_critic_on_two_ranks_equals_one(two_ranks, model_path):
    (rank0, _), _ = two_ranks
    values, update = rank0["critic"]
    expected_values, expected_update = critic_case(model_path)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=1e-10)  # the value head stays float64
    assert_same_update(update, expected_update)


@pytest.mark.parametrize("remove_padding", [False, True])
def test_token_budget_micro_batches_give_the_fixed_size_update(model_path, remove_padding):
    batch, _ = case()
    budget = 30  # the longest sequence has 26 tokens; a micro-batch holds one to four sequences
    micro = MicroBatching(size=2, max_tokens=budget, remove_padding=remove_padding)
    micro_sizes = {len(part) for rows in shuffled_mini_batches(len(batch), 4, 2,
                                                               generator=torch.Generator().manual_seed(SEED))
                   for part in micro_batch_plan(batch.sequence_lens, rows, 1, micro=micro)[0]}
    assert len(micro_sizes) > 1  # the budget, not a count, cut them
    expected = one_rank(model_path, "token-mean")
    assert_same_update(one_rank(model_path, "token-mean", max_tokens=budget, remove_padding=remove_padding), expected)


def test_checkpoint_saved_on_two_ranks_loads_on_two_ranks_and_on_one(two_ranks, model_path):
    (rank0, rank1), out = two_ranks
    saved = rank0[MODES[-1]][1]
    for rank in (rank0, rank1):
        assert rank["loaded_version"] == 7
        for name, weight in saved.items():
            assert torch.equal(rank["loaded"][name], weight), name
    whole = actor(model_path)
    roles = SimpleNamespace(actor=whole, critic=None, run_id="run-a")
    checkpoint.check_complete(roles, out / "checkpoint", CHECKPOINT_KEY)  # the manifest two ranks wrote holds
    version = checkpoint.load(roles, out / "checkpoint")
    assert version == 7
    loaded = full_weights(whole.model)
    for name, weight in saved.items():
        assert torch.equal(loaded[name], weight), name


def test_a_relayed_command_arrives_whole(two_ranks):
    (_, rank1), _ = two_ranks
    op, args, tensors = rank1["received"]
    assert (op, args) == ("probe", {"n": 3})
    assert list(tensors) == list(COMMAND)
    for name, tensor in COMMAND.items():
        assert tensors[name].dtype == tensor.dtype and torch.equal(tensors[name], tensor), name
