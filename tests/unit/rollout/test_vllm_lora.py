"""A LoRA run on the vLLM engine, the parts that run without vLLM (services/rollout/vllm_lora.py and the engine's
adapter syncs in services/rollout/vllm_engine.py).

The names and config a received adapter is given are checked against what PEFT itself writes for the trainer's
model (``get_peft_model_state_dict``, the keys of adapter_model.safetensors); the engine's syncs run against a
stand-in for AsyncLLM that records the worker calls (vLLM cannot run here). tests/gpu/test_lora_vllm.py runs
them on vLLM."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
import yaml

from services.coordctl.tiny_model import build_tiny_model
from services.rollout.config import RolloutServiceConfig
from services.rollout.vllm_engine import VLLMEngine
from services.rollout.vllm_lora import (AdapterServing, AdapterWindow, LoadedAdapter, lora_engine_args, peft_config,
                                        peft_tensors, unserved_modules, vllm_max_lora_rank)
from services.trainer.ranks import Ranks
from tests.unit.rollout.test_vllm_keep_swap import in_flight
from services.trainer.worker import RankWorker


@pytest.fixture(scope="module")
def lora_actor(tmp_path_factory):
    tiny = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=2, num_heads=2, seed=0)
    config = yaml.safe_dump({"actor_rollout_ref": {"model": {"path": str(tiny), "lora_rank": 4, "lora_alpha": 8,
                                                             "target_modules": ["q_proj", "v_proj", "down_proj"]}}})
    return RankWorker(Ranks.single("cpu")).init_run({}, run_id="r", run_config_yaml=config, roles=["actor"],
                                                 seed=0).actor


def test_received_factors_get_the_names_peft_writes_in_an_adapter_file(lora_actor):
    from peft import get_peft_model_state_dict

    with torch.no_grad():  # B is zero at the start: give it values, so that the scale shows
        for name, parameter in lora_actor.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn_like(parameter))
    written = get_peft_model_state_dict(lora_actor.model)
    renamed = peft_tensors(lora_actor.named_weights())
    assert set(renamed) == set(written)
    name = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(renamed[f"{name}.lora_A.weight"], written[f"{name}.lora_A.weight"])
    # B comes scaled by lora_alpha / rank = 2, so vLLM is given alpha = rank (a scale of 1)
    assert torch.allclose(renamed[f"{name}.lora_B.weight"], 2 * written[f"{name}.lora_B.weight"])
    assert peft_config(lora_actor.named_weights()) == {"r": 4, "lora_alpha": 4, "bias": "none",
                                                       "target_modules": ["down_proj", "q_proj", "v_proj"]}


def test_factors_that_do_not_pair_up_are_refused_naming_the_module():
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj came without its lora_B"):
        peft_tensors([("model.layers.0.self_attn.q_proj.lora_A", torch.zeros(4, 32))])


def test_modules_vllm_serves_no_lora_on_are_named():
    served = {"qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "gate_proj", "up_proj", "down_proj"}
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "model.layers.0.router"]
    assert unserved_modules(modules, served) == ["model.layers.0.router"]


@pytest.mark.parametrize(("rank", "max_rank"), [(1, 1), (4, 8), (8, 8), (9, 16), (64, 64), (300, 320), (512, 512)])
def test_max_lora_rank_is_the_smallest_vllm_accepts_that_holds_the_rank(rank, max_rank):
    assert vllm_max_lora_rank(rank) == max_rank


def test_a_rank_over_vllms_largest_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="lora_rank: 513 is more than the vllm engine serves"):
        vllm_max_lora_rank(513)


def test_engine_arguments_of_a_lora_run():
    assert lora_engine_args(AdapterServing(rank=64, versions=2)) == {
        "enable_lora": True, "max_lora_rank": 64, "max_loras": 2, "max_cpu_loras": 4}


def loaded(window: AdapterWindow, version: int, in_use: frozenset[int] = frozenset()) -> list[int]:
    """Load version ``version`` into ``window`` as a sync does; the ids loaded after it."""
    kept = window.kept_beside_new(set(in_use))
    window.serve(kept, LoadedAdapter(version=version, adapter_id=window.new_id()))
    return [adapter.adapter_id for adapter in window.loaded]


def test_the_last_versions_stay_loaded_and_those_calls_in_flight_use():
    window = AdapterWindow(versions=2, capacity=3)
    assert window.current is None  # before the first sync: the base model
    assert loaded(window, 1) == [1]
    assert loaded(window, 2) == [1, 2]
    assert loaded(window, 3) == [2, 3]  # version 1 (id 1) removed
    assert loaded(window, 4, in_use=frozenset({2})) == [2, 3, 4]  # a call in flight still runs under id 2
    assert window.current == LoadedAdapter(version=4, adapter_id=4)
    with pytest.raises(RuntimeError, match="calls in flight still use 2 adapter versions older than the last 2"):
        window.kept_beside_new({2, 3})  # with 4 and the new one: 4 loaded, more than the 3 vLLM holds
    assert loaded(window, 5) == [4, 5]
    assert window.current is not None and window.current.name == "meshrl-v5-5"


def test_with_one_version_the_one_served_until_the_sync_stays_beside_the_new_one():
    window = AdapterWindow(versions=1, capacity=3)  # (a call may begin under it while the new one loads)
    assert loaded(window, 1) == [1]
    assert loaded(window, 2) == [1, 2]
    assert loaded(window, 3) == [2, 3]


class StandIn:
    """What the engine asks of AsyncLLM: the workers receive at once and load adapter version ``version``, or
    fail to."""

    def __init__(self, version: int, apply_fails: bool = False):
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=64))
        self.version, self.apply_fails, self.asked = version, apply_fails, []

    async def collective_rpc(self, method, timeout=None, args=()):
        self.asked.append((method, *args[:2]) if method in ("meshrl_apply_adapter", "meshrl_remove_adapter")
                          else (method,))
        if method == "meshrl_wait_received":
            return [True]
        if method == "meshrl_apply_adapter":
            if self.apply_fails:
                raise ValueError("the adapter adapts ['model.layers.0.router'], which vLLM serves no LoRA on")
            return [(self.version, {"apply": 0.001})]
        return [None]

    async def reset_prefix_cache(self):
        self.asked.append(("reset_prefix_cache",))
        return True


def lora_engine(llm: StandIn, versions: int = 2) -> VLLMEngine:
    return VLLMEngine(llm, 100, 0, config=RolloutServiceConfig(engine="vllm", enable_prefix_caching=True), gpus=(),
                      lora=AdapterServing(rank=8, versions=versions))


async def test_an_adapter_sync_loads_a_new_id_and_keeps_the_last_versions():
    llm = StandIn(version=1)
    engine = lora_engine(llm)
    swap = await asyncio.wait_for(engine.receive_weights("weights", 5), 5)
    assert swap.version == engine.weight_version == 1
    llm.version = 2
    await asyncio.wait_for(engine.receive_weights("weights", 5), 5)
    llm.version = 3
    await asyncio.wait_for(engine.receive_weights("weights", 5), 5)
    applied = [asked for asked in llm.asked if asked[0] == "meshrl_apply_adapter"]
    # each version a new id; the workers keep the previous one beside it (max_staleness 1) and drop the rest
    assert applied == [("meshrl_apply_adapter", 1, [1]), ("meshrl_apply_adapter", 2, [1, 2]),
                       ("meshrl_apply_adapter", 3, [2, 3])]
    assert engine.adapters is not None and engine.adapters.current == LoadedAdapter(version=3, adapter_id=3)
    # the prefix cache keys blocks by the adapter's name, one per version: never cleared for an adapter
    assert ("reset_prefix_cache",) not in llm.asked


async def test_an_adapter_that_fails_to_load_leaves_the_previous_one_serving():
    llm = StandIn(version=1)
    engine = lora_engine(llm)
    await asyncio.wait_for(engine.receive_weights("weights", 5), 5)
    llm.version, llm.apply_fails = 2, True
    with pytest.raises(ValueError, match="serves no LoRA on"):
        await asyncio.wait_for(engine.receive_weights("weights", 5), 5)
    assert llm.asked[-1] == ("meshrl_remove_adapter", 2)  # from the workers that did load it
    assert engine.weight_version == 1 and not engine.damaged
    assert engine.adapters is not None and engine.adapters.current == LoadedAdapter(version=1, adapter_id=1)
    llm.apply_fails = False  # the version sent again loads under an id of its own
    await asyncio.wait_for(engine.receive_weights("weights", 5), 5)
    assert llm.asked[-1] == ("meshrl_apply_adapter", 3, [1, 3]) and engine.weight_version == 2


@pytest.mark.parametrize("mode", ["finish", "keep"])
async def test_an_adapter_swap_waits_for_no_call_in_flight(mode):
    llm, release = StandIn(version=1), asyncio.Event()
    engine = lora_engine(llm)
    call, attempts = await in_flight(engine, release)
    swap = await asyncio.wait_for(engine.receive_weights("weights", 5, mode), 5)
    assert swap.version == 1 and not call.done()  # loaded while the call goes on (under the adapter it began with)
    release.set()
    await call
    assert len(attempts) == 1


async def test_restart_samples_the_calls_in_flight_again_under_the_new_adapter():
    llm, release = StandIn(version=1), asyncio.Event()
    engine = lora_engine(llm)
    call, attempts = await in_flight(engine, release)
    await asyncio.wait_for(engine.receive_weights("weights", 5, "restart"), 5)
    release.set()
    assert await call == 1 and len(attempts) == 2


def test_initrun_tells_a_lora_run_from_a_full_weights_one():
    from meshrl.v1 import rollout_pb2
    from services.rollout.server import adapter_serving_from_pb

    assert adapter_serving_from_pb(rollout_pb2.RolloutInitRequest(model_path="m")) is None
    assert adapter_serving_from_pb(rollout_pb2.RolloutInitRequest(lora_rank=64, adapter_versions=2)) == \
        AdapterServing(rank=64, versions=2)
    with pytest.raises(ValueError, match="adapter_versions 2 is for a LoRA run: set lora_rank too"):
        adapter_serving_from_pb(rollout_pb2.RolloutInitRequest(adapter_versions=2))
