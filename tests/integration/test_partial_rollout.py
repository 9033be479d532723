"""New weights arriving while a Generate call is in flight, on a real rollout service (hf engine, CPU).

The test process plays the trainer: rank 0 of a gloo weight channel, sending with a WeightSender. With
restart_in_flight the call is stopped and sampled again under the new weights, and returns exactly what a fresh
call under them returns (same seed, same first_index); with neither flag the call finishes under the old
weights; with keep_in_flight it is held only for the swap and goes on under the new weights with the tokens it
had. (tests/gpu/test_partial_rollout_vllm.py and test_keep_swap_vllm.py play the same scenario against the vLLM
engine over NCCL.) A swap that fails part way leaves the rollout refusing Generate until a whole version is
swapped in.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import torch

from bench.faults import service_address
from services.common.channel import open_weight_channel
from services.common.gloo_channel import prepare_gloo_rendezvous
from services.run.models import load_causal_lm
from services.common.weight_sync import WeightSender
from services.coordinator.fleet.clients import Generated, Received, RolloutClient
from services.coordinator.settings import Sampling
from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.test_faults import LogTail

PROMPTS = [[5, 6, 7, 16], [9, 12, 4], [17, 3], [6, 6, 6, 6, 6]]
N = 2
# a long call: the rollout samples one sequence at a time (batch_size=1), and at this temperature the tiny
# model almost never picks EOS, so each of the 8 sequences runs about 150 token steps (about 1 s in all)
TOKENS, TEMPERATURE = 150, 0.02
LONG = 250  # tokens of the one sequence of the keep phase (the tiny model takes 256 positions): new weights come in
# while it runs
TIMEOUT_S = 60


def same(a: Generated, b: Generated) -> bool:
    return all(torch.equal(getattr(a, name), getattr(b, name))
               for name in ("response_ids", "response_lens", "logprobs", "truncated", "weight_versions",
                            "last_weight_versions"))


def flatten(named: list[tuple[str, torch.Tensor]]) -> None:
    """New weights whose logits are all 0 (the final norm zeroed): each token they sample has logprob -log(V)."""
    with torch.no_grad():
        dict(named)["model.norm.weight"].zero_()


def change(named: list[tuple[str, torch.Tensor]], seed: int) -> None:
    """New weights, as after an update."""
    device = named[0][1].device
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for _, tensor in named:
            tensor.add_(torch.randn(tensor.shape, generator=generator, device=device, dtype=tensor.dtype) * 0.02)


async def scenario(cluster: LocalCluster, model_path: str, dtype: str = "float32", backend: str = "gloo",
                   device: str = "cpu", tokens: int = TOKENS, long_tokens: int = LONG,
                   phases: tuple[str, ...] = ("restart and finish", "keep")) -> Received | None:
    """The rollout of ``cluster`` loads the model; this process, the trainer, holds it in ``dtype`` on ``device``
    and sends it over a ``backend`` channel; each Generate call asks for ``tokens`` new tokens per sample, that of
    the keep phase for ``long_tokens``. Returns the rollout's side of the keep phase's sync, if it ran."""
    rollout, log = RolloutClient(service_address(cluster, "rollout")), LogTail(cluster, "rollout")
    model = load_causal_lm(model_path, dtype)
    named = [(name, tensor.detach().to(device)) for name, tensor in model.named_parameters()]
    channel_id = "partial-rollout-weights"
    if backend == "nccl":
        from services.common.nccl_channel import new_unique_id

        store, rendezvous = None, new_unique_id()
    else:
        store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", TIMEOUT_S)
    channel, sender = None, WeightSender()

    async def generate() -> Generated:
        return await rollout.generate(PROMPTS, Sampling(n=N, temperature=TEMPERATURE, top_p=1.0,
                                                        max_new_tokens=tokens, stop_token_ids=()), seed=5,
                                      first_index=3,
                                      timeout=TIMEOUT_S)

    async def generate_long() -> Generated:
        return await rollout.generate(PROMPTS[:1], Sampling(n=1, temperature=TEMPERATURE, top_p=1.0,
                                                            max_new_tokens=long_tokens, stop_token_ids=()), seed=5,
                                      first_index=3, timeout=TIMEOUT_S)

    async def sync_while_generating(version: int, partial_rollout: str, call=generate, then=lambda named: None):
        """Start a ``call``, send new weights (changed, then ``then``) while it runs; (its samples, the
        rollout's side of the sync)."""
        calls = sum(event["event"] == "generating" for event in log.read())
        in_flight_call = asyncio.create_task(call())
        await log.wait_for("generating", calls + 1)  # the rollout has begun sampling it
        change(named, seed=version)
        then(named)
        receiving = asyncio.create_task(rollout.receive_weights(channel_id, TIMEOUT_S, partial_rollout))
        await asyncio.to_thread(sender.send, channel, named, version, bucket_bytes=1 << 20)
        assert not in_flight_call.done()  # the whole broadcast has gone out while the call was still sampling
        received = await receiving
        assert received.version == version
        return await in_flight_call, received

    async def restart_and_finish() -> None:
        under_0 = await generate()
        assert set(under_0.weight_versions.tolist()) == {0} and under_0.response_lens.float().mean() > tokens / 2

        # restart: the call in flight is dropped at the swap and sampled again, whole, under version 1
        restarted, restarting_sync = await sync_while_generating(1, "restart")
        assert [e["calls"] for e in log.read() if e["event"] == "generate_calls_restarted"] == [1]
        under_1 = await generate()
        assert set(restarted.weight_versions.tolist()) == {1}
        assert same(restarted, under_1)
        assert not torch.equal(under_1.response_ids, under_0.response_ids)  # the new weights sample otherwise

        # finish: the call in flight completes under version 1 while the swap to version 2 waits for it
        finished, finishing_sync = await sync_while_generating(2, "finish")
        assert set(finished.weight_versions.tolist()) == {1}
        assert same(finished, under_1)
        assert [e["calls"] for e in log.read() if e["event"] == "generate_calls_restarted"] == [1]  # none more
        under_2 = await generate()
        assert set(under_2.weight_versions.tolist()) == {2}
        assert not torch.equal(under_2.response_ids, under_1.response_ids)
        # generation was held back while the call in flight finished, not while it was dropped
        assert finishing_sync.pause_s > 0.2 and restarting_sync.pause_s < finishing_sync.pause_s
        assert set(under_2.last_weight_versions.tolist()) == {2}  # no call so far went on over a swap

    async def keep(version: int) -> Received:
        """A sync with nothing in flight (as a run's first, before step 1: vLLM learns where each tensor goes and
        copies straight there from then on), then one while a call runs, which is held for the swap and goes on
        under the new version, keeping its tokens; that version's logits are all 0, so each token it samples
        has logprob -log(V)."""
        receiving = asyncio.create_task(rollout.receive_weights(channel_id, TIMEOUT_S, "keep"))
        await asyncio.to_thread(sender.send, channel, named, version, bucket_bytes=1 << 20)
        assert (await receiving).version == version
        whole = await generate_long()
        served = int(whole.weight_versions[0])
        kept, keeping_sync = await sync_while_generating(served + 1, "keep", generate_long, then=flatten)
        assert (kept.weight_versions.tolist(), kept.last_weight_versions.tolist()) == ([served], [served + 1])
        flat = torch.isclose(kept.logprobs, torch.tensor(-math.log(model.config.vocab_size)), atol=1e-3, rtol=0)
        before = int((~flat).sum())  # tokens sampled under the old version, then those of the new
        assert 0 < before < len(flat) and flat[before:].all()
        assert torch.equal(kept.response_ids[:before], whole.response_ids[:before])
        torch.testing.assert_close(kept.logprobs[:before], whole.logprobs[:before])
        return keeping_sync

    try:
        await rollout.init_run("partial-rollout", model_path, dtype, timeout=TIMEOUT_S)
        joining = asyncio.create_task(rollout.join_channel(channel_id, backend, rendezvous, rank=1, world_size=2,
                                                          timeout=TIMEOUT_S))
        channel = await asyncio.to_thread(open_weight_channel, channel_id, backend, rendezvous=rendezvous, rank=0,
                                          world_size=2, timeout_s=TIMEOUT_S, device=device)
        await joining
        synced, keeping_sync = [], None
        if "restart and finish" in phases:
            await restart_and_finish()
            synced += [(1, "restart"), (2, "finish")]
        if "keep" in phases:
            keeping_sync = await keep(len(synced) + 1)
            synced += [(len(synced) + 1, "keep"), (len(synced) + 2, "keep")]
        assert [(e["weight_version"], e["in_flight"]) for e in log.read() if e["event"] == "weights_received"] == synced
        return keeping_sync
    finally:
        if channel is not None:
            channel.close()
        await rollout.close()
        del store


def test_a_sync_restarts_finishes_or_keeps_the_generate_call_in_flight(tmp_path, tiny_model):
    cluster = LocalCluster(tmp_path / "state", (ServiceSpec(kind="rollout", settings=("batch_size=1",)),))
    try:
        asyncio.run(cluster.start(timeout_s=120))
        kept = asyncio.run(scenario(cluster, str(tiny_model)))
        print(f"\nkeep: generation held {kept.pause_s * 1e3:.1f} ms for the swap")
        assert kept.pause_s < 0.1
    finally:
        cluster.stop()


def test_a_swap_that_fails_part_way_leaves_the_hf_rollout_refusing_to_generate_until_a_whole_one(tmp_path,
                                                                                                 tiny_model):
    """The test process sends weights that do not fit the rollout's model: in a bucket after others (so part of
    the new weights went in: the rollout is damaged, as a vLLM rollout is, and refuses Generate with
    UNAVAILABLE, which sends the call elsewhere), or in the first bucket (nothing went in: it serves its last
    whole version as before). A whole sync after either makes it generate again."""
    cluster = LocalCluster(tmp_path / "state", (ServiceSpec(kind="rollout"),))

    async def go():
        rollout = RolloutClient(service_address(cluster, "rollout"))
        model = load_causal_lm(str(tiny_model), "float32")
        named = [(name, tensor.detach().clone()) for name, tensor in model.named_parameters()]
        unknown = ("model.layers.9.mlp.extra.weight", torch.zeros(4))  # no such weight in the rollout's model
        store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", TIMEOUT_S)
        channel, sender = None, WeightSender()

        async def sync(weights, version) -> Received | grpc.aio.AioRpcError:
            receiving = asyncio.create_task(rollout.receive_weights("weights", TIMEOUT_S))
            await asyncio.to_thread(sender.send, channel, weights, version,
                                    bucket_bytes=1 << 10)  # about a tensor a bucket
            try:
                return await receiving
            except grpc.aio.AioRpcError as error:
                return error

        async def generate() -> Generated | grpc.aio.AioRpcError:
            try:
                return await rollout.generate(PROMPTS, Sampling(n=N, temperature=1.0, top_p=1.0, max_new_tokens=4,
                                                                stop_token_ids=()), seed=5, first_index=0,
                                              timeout=TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                return error

        try:
            await rollout.init_run("damaged", str(tiny_model), "float32", timeout=TIMEOUT_S)
            joining = asyncio.create_task(rollout.join_channel("weights", "gloo", rendezvous, rank=1, world_size=2,
                                                              timeout=TIMEOUT_S))
            channel = await asyncio.to_thread(open_weight_channel, "weights", "gloo", rendezvous=rendezvous, rank=0,
                                              world_size=2, timeout_s=TIMEOUT_S, device="cpu")
            await joining
            assert (await sync(named, 1)).version == 1
            return (await sync([unknown, *named], 2), await generate(), await sync([*named, unknown], 3),
                    await generate(), await sync(named, 4), await generate())
        finally:
            if channel is not None:
                channel.close()
            await rollout.close()
            del store

    try:
        asyncio.run(cluster.start(timeout_s=120))
        untouched, served, partial, refused, whole, healed = asyncio.run(go())
    finally:
        cluster.stop()
    not_in_model = "received weight 'model.layers.9.mlp.extra.weight' is not in the rollout model"
    assert isinstance(untouched, grpc.aio.AioRpcError) and not_in_model in untouched.details()
    assert isinstance(served, Generated) and set(served.weight_versions.tolist()) == {1}  # still whole: version 1
    assert isinstance(partial, grpc.aio.AioRpcError) and not_in_model in partial.details()
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.UNAVAILABLE
    assert (f"this rollout's weights are not one whole version (the swap after version 1 failed: WeightsNotLoaded: "
            f"{not_in_model}); it generates again once a sync swaps one in") in refused.details()
    assert whole.version == 4
    assert isinstance(healed, Generated) and set(healed.weight_versions.tolist()) == {4}
