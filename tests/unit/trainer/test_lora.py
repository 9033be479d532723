"""A LoRA actor on the trainer (actor_rollout_ref.model.lora_rank > 0): what trains, the reference without a
second copy, the adapter-only sync's tensors, checkpoints of the adapters, and the keys refused before a run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import save_file

from services.common.adapters import adapter_pairs, merged_weight
from services.common.sequences import SequenceBatch
from services.common.weight_sync import full
from services.coordctl.export import holds_base, lora_role_model
from services.coordctl.tiny_model import build_tiny_model
from services.run.config import RunConfig
from services.run.lora import ADAPTER, check_lora
from services.run.models import load_causal_lm
from services.trainer import checkpoint
from services.trainer.forward import batched_logprobs, response_logprobs, response_values
from services.trainer.ranks import Ranks
from services.trainer.worker import RankWorker

SEQUENCES = {"prompt_ids": torch.tensor([5, 6, 7, 8, 9, 10, 11]), "prompt_lens": torch.tensor([3, 4]),
             "response_ids": torch.tensor([12, 13, 14, 15, 16]), "response_lens": torch.tensor([2, 3])}
ADVANTAGES = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=2, num_heads=2, seed=0)


def run_yaml(folder, warm_start=None, **model_keys) -> str:
    return yaml.safe_dump({"actor_rollout_ref": {
        "model": {"path": str(folder), **model_keys},
        "actor": {"use_kl_loss": True, "optim": {"lr": 1e-2}, "warm_start": warm_start or {}}}})


def loaded(tiny, roles=("actor", "ref"), warm_start=None, **model_keys) -> RankWorker:
    worker = RankWorker(Ranks.single("cpu"))
    worker.init_run({}, run_id="r", run_config_yaml=run_yaml(tiny, warm_start, **model_keys), roles=list(roles),
                    seed=0)
    return worker


def critic_loaded(tiny, dtype: str, lora_rank: int = 0) -> RankWorker:
    worker = RankWorker(Ranks.single("cpu"))
    config = yaml.safe_dump({"actor_rollout_ref": {"model": {"path": str(tiny), "dtype": dtype}},
                             "critic": {"model": {"lora_rank": lora_rank}}, "algorithm": {"adv_estimator": "gae"}})
    worker.init_run({}, run_id="r", run_config_yaml=config, roles=["critic"], seed=0)
    return worker


def update(worker: RankWorker) -> None:
    ref = worker.compute_log_probs(SEQUENCES, role="ref" if "ref" in worker.roles.hosted() else "actor")
    worker.update_actor({**SEQUENCES, "advantages": ADVANTAGES, "ref_logprobs": ref})


def test_only_the_adapters_train_and_only_they_are_in_the_optimizer(tiny):
    worker = loaded(tiny, lora_rank=4, lora_alpha=8)
    actor = worker.roles.actor
    trained = [name for name, p in actor.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    # all-linear: the 7 linear layers of each of the 2 decoder layers, not the output layer
    assert len(trained) == 2 * 7 * 2
    assert {id(p) for p in actor.optimizer.params} == {id(p) for p in actor.model.parameters() if p.requires_grad}
    frozen = {name: p.clone() for name, p in actor.model.named_parameters() if not p.requires_grad}
    update(worker)
    assert all(torch.equal(p, frozen[name]) for name, p in actor.model.named_parameters() if not p.requires_grad)
    assert any(p.abs().max() > 0 for name, p in actor.model.named_parameters() if ".lora_B." in name)


def test_the_reference_is_the_base_model_with_no_second_copy(tiny):
    worker = loaded(tiny, lora_rank=4, lora_alpha=8)
    update(worker)  # the adapters have moved the actor away from its base
    base = load_causal_lm(tiny)  # loaded independently, from the model folder
    from services.trainer.worker import sequences

    want = batched_logprobs(base, sequences(SEQUENCES), worker.roles.pad_id, temperature=1.0,
                            micro=worker.roles.settings.ref_log_probs,
                            ranks=worker.ranks)
    assert torch.allclose(worker.compute_log_probs(SEQUENCES, role="ref"), want, atol=1e-6)
    assert not torch.allclose(worker.compute_log_probs(SEQUENCES, role="actor"), want, atol=1e-4)
    counts = worker.roles.parameter_counts()
    base_count = sum(p.numel() for p in base.parameters())
    assert worker.roles.reference is None and counts["ref"] == 0
    assert counts["actor"] - counts["actor_trainable"] == base_count  # the base, once
    full = loaded(tiny).roles.parameter_counts()
    assert full["ref"] == base_count  # full fine-tuning holds a second copy


def test_a_sync_sends_each_adapted_layer_s_factors_b_scaled(tiny):
    worker = loaded(tiny, roles=("actor",), lora_rank=4, lora_alpha=8)
    update(worker)
    named = dict(worker.roles.actor.named_weights())
    assert len(named) == 2 * 7 * 2
    layer = "model.layers.1.mlp.down_proj"
    module = worker.roles.actor.model.base_model.model.model.layers[1].mlp.down_proj
    assert torch.equal(named[f"{layer}.lora_A"], module.lora_A["default"].weight)
    assert torch.allclose(named[f"{layer}.lora_B"], module.lora_B["default"].weight * 2.0)  # alpha / rank = 2


def test_a_merged_sync_sends_each_adapted_layer_s_weight_with_its_adapter_merged(tiny):
    """With lora.merge each adapted layer's weight is sent with its adapter merged in, as PEFT's own merge makes
    it, and nothing else: the layers no adapter touches never change."""
    worker = loaded(tiny, roles=("actor",), lora_rank=4, lora_alpha=8, lora={"merge": True})
    update(worker)
    named = worker.roles.actor.named_weights()
    peft_merged = copy.deepcopy(worker.roles.actor.model).merge_and_unload().state_dict()
    layers = [f"model.layers.{i}.{part}" for i in range(2) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")]
    assert sorted(name for name, _ in named) == sorted(f"{layer}.weight" for layer in layers)
    base = load_causal_lm(tiny).state_dict()
    for name, weight in named:
        made = full(weight)
        assert torch.allclose(made, peft_merged[name], atol=1e-6, rtol=0), name
        assert not torch.allclose(made, base[name], atol=1e-4, rtol=0), name  # the adapter has moved it


def test_target_modules_and_exclude_modules_choose_the_layers(tiny):
    worker = loaded(tiny, roles=("actor",), lora_rank=4, target_modules=["q_proj", "v_proj"],
                    exclude_modules=["model.layers.0.self_attn.v_proj"])
    names = sorted(name.rsplit(".", 1)[0] for name, _ in worker.roles.actor.named_weights())
    assert names == sorted(["model.layers.0.self_attn.q_proj"] * 2 + ["model.layers.1.self_attn.q_proj"] * 2
                           + ["model.layers.1.self_attn.v_proj"] * 2)


def test_a_checkpoint_holds_the_adapters_alone_and_restores_them(tiny, tmp_path):
    worker = loaded(tiny, roles=("actor",), lora_rank=4)
    update(worker)
    saved = {name: t.clone() for name, t in worker.roles.actor.named_weights()}
    worker.save_checkpoint({}, path=str(tmp_path / "lora"))
    full_worker = loaded(tiny, roles=("actor",))
    full_worker.save_checkpoint({}, path=str(tmp_path / "full"))
    stored = dcp.FileSystemReader(str(tmp_path / "lora")).read_metadata().state_dict_metadata
    weights = {key: meta.size.numel() for key, meta in stored.items() if key.startswith("actor.model.")}
    assert all(".lora_A." in key or ".lora_B." in key for key in weights)  # no base weight
    assert sum(weights.values()) == worker.roles.parameter_counts()["actor_trainable"]
    moments = [key for key in stored if key.startswith("actor.optim.state.") and key.endswith(".exp_avg")]
    assert len(moments) == len(weights)  # and the optimizer state of each adapter tensor
    update(worker)
    worker.load_checkpoint({}, path=str(tmp_path / "lora"))
    assert all(torch.equal(t, saved[name]) for name, t in worker.roles.actor.named_weights())
    with pytest.raises(ValueError, match=r"holds the actor's full weights, and this run trains its LoRA adapters "
                                         r"\(actor_rollout_ref.model.lora_rank\)"):
        checkpoint.read_extra(worker.roles, tmp_path / "full")
    with pytest.raises(ValueError, match=r"holds the actor.s LoRA adapters, and this run trains its full weights"):
        checkpoint.read_extra(full_worker.roles, tmp_path / "lora")


def lora_keys(tiny, **keys):
    config = RunConfig.model_validate({"actor_rollout_ref": {"model": {"path": str(tiny), **keys}}})
    return config.actor_rollout_ref.model


@pytest.mark.parametrize("keys, message", [
    ({"lora_rank": 4, "target_modules": ["q_proj", "qkv"]},
     r"actor_rollout_ref.model.target_modules: \['qkv'\] match no linear layer of the model; its linear layers are "
     r"named \['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"),
    ({"lora_rank": 33}, r"actor_rollout_ref.model.lora_rank: 33 is larger than layer model.layers.0.self_attn.q_proj "
                        r"\(32 x 32\) can hold; choose at most 32"),
    ({"lora_rank": 4, "target_modules": ["q_proj"], "exclude_modules": ["q_proj"]},
     r"actor_rollout_ref.model.exclude_modules: \['q_proj'\] leaves no layer to adapt"),
])
def test_bad_lora_keys_are_refused_naming_the_key(tiny, keys, message):
    with pytest.raises(ValueError, match=message):
        check_lora(lora_keys(tiny, **keys), str(tiny), "actor_rollout_ref.model")


def test_an_adapter_folder_of_another_model_is_refused(tiny, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{name}.lora_A.weight": torch.zeros(4, 64), f"{name}.lora_B.weight": torch.zeros(32, 4)},
              folder / "adapter_model.safetensors")
    keys = lora_keys(tiny, lora_rank=4, lora_adapter_path=str(folder))
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.lora_adapter_path: .* adapts "
                                         r"model.layers.0.self_attn.q_proj with a factor of shape \[4, 64\], which "
                                         r"does not fit its 32 x 32 weight: the adapter was made for another base"):
        check_lora(keys, str(tiny), "actor_rollout_ref.model")
    with pytest.raises(ValueError, match=r"lora_adapter_path: .* is not a PEFT adapter folder"):
        check_lora(lora_keys(tiny, lora_rank=4, lora_adapter_path=str(tmp_path)), str(tiny), "actor_rollout_ref.model")
    with pytest.raises(ValueError, match=r"lora_adapter_path: .* needs lora_rank > 0"):
        lora_keys(tiny, lora_adapter_path=str(folder))


def test_lora_merge_without_adapters_is_refused_naming_the_key(tiny):
    with pytest.raises(ValueError, match=r"lora.merge: true merges LoRA adapters into the rollout's weights, and this "
                                         r"run trains full weights \(lora_rank 0\)"):
        lora_keys(tiny, lora={"merge": True})


def test_verl_s_lora_and_rollout_keys_are_accepted_and_the_unused_ones_said(tiny):
    config = RunConfig.model_validate({"actor_rollout_ref": {
        "model": {"path": str(tiny), "lora_rank": 32, "lora_alpha": 32, "target_modules": "all-linear",
                  "use_shm": True},
        "rollout": {"load_format": "safetensors", "layered_summon": True}}, "critic": {"model": {"lora_rank": 8}}})
    assert config.critic.model.lora_rank == 8
    notices = "\n".join(config.notices())
    assert "actor_rollout_ref.model.use_shm=True" in notices
    assert "actor_rollout_ref.rollout.load_format=safetensors: not used" in notices
    assert "actor_rollout_ref.rollout.layered_summon=True: not used" in notices


def test_a_lora_critic_trains_its_adapters_and_its_value_head(tiny, tmp_path):
    worker = RankWorker(Ranks.single("cpu"))
    config = yaml.safe_dump({"actor_rollout_ref": {"model": {"path": str(tiny)}},
                             "critic": {"model": {"lora_rank": 4}}, "algorithm": {"adv_estimator": "gae"}})
    worker.init_run({}, run_id="r", run_config_yaml=config, roles=["critic"], seed=0)
    trained = [name for name, p in worker.roles.critic.model.named_parameters() if p.requires_grad]
    assert any(".lora_A." in name for name in trained)
    assert any("score" in name and "lora" not in name for name in trained)
    assert all(".lora_" in name or "score" in name for name in trained)
    saved = {name: p.clone() for name, p in worker.roles.critic.model.named_parameters() if p.requires_grad}
    worker.save_checkpoint({}, path=str(tmp_path / "critic"))
    stored = dcp.FileSystemReader(str(tmp_path / "critic")).read_metadata().state_dict_metadata
    weights = [key for key in stored if key.startswith("critic.model.")]
    assert len(weights) == len(trained)  # its adapters and its head, no frozen base
    with torch.no_grad():
        for p in worker.roles.critic.model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    worker.load_checkpoint({}, path=str(tmp_path / "critic"))
    assert all(torch.equal(p, saved[name]) for name, p in worker.roles.critic.model.named_parameters()
               if p.requires_grad)


def test_lora_adapter_path_starts_from_a_saved_adapter_with_its_own_rank(tiny, tmp_path):
    first = loaded(tiny, roles=("actor",), lora_rank=4, lora_alpha=8)
    update(first)
    first.roles.actor.model.save_pretrained(tmp_path / "adapter")  # PEFT's adapter folder
    check_lora(lora_keys(tiny, lora_rank=16, lora_adapter_path=str(tmp_path / "adapter")), str(tiny),
               "actor_rollout_ref.model")
    again = loaded(tiny, roles=("actor",), lora_rank=16, lora_adapter_path=str(tmp_path / "adapter"))
    started = dict(again.roles.actor.named_weights())
    assert started.keys() == dict(first.roles.actor.named_weights()).keys()
    for name, tensor in first.roles.actor.named_weights():
        assert torch.allclose(started[name], tensor)  # rank 4 and alpha 8, the adapter's own
    update(again)  # and it trains on
    assert any(not torch.equal(t, started[name]) for name, t in again.roles.actor.named_weights())


def test_under_fsdp2_mixed_precision_the_reference_pass_may_come_first(tiny):
    """PEFT's disable_adapter freezes the adapters; were the reference pass FSDP2's first forward with them
    frozen, FSDP2 would keep the gradients in bf16 for good and the update would fail (pytorch#186998)."""
    worker = RankWorker(Ranks.single("cpu"))
    config = yaml.safe_dump({"actor_rollout_ref": {
        "model": {"path": str(tiny), "lora_rank": 4},
        "actor": {"use_kl_loss": True, "optim": {"lr": 1e-2},
                  "fsdp_config": {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}}}})
    worker.init_run({}, run_id="r", run_config_yaml=config, roles=["actor", "ref"], seed=0)
    before = {name: t.full_tensor().clone() for name, t in worker.roles.actor.named_weights()}
    update(worker)  # the reference's logprobs first, then the update
    after = {name: t.full_tensor() for name, t in worker.roles.actor.named_weights()}
    assert any(not torch.equal(after[name], before[name]) for name in before)
    assert all(p.requires_grad == (".lora_" in name) for name, p in worker.roles.actor.model.named_parameters())


def saved_for_backward_bytes(model: torch.nn.Module, forward_pass) -> int:
    """The bytes that ``forward_pass(model)`` keeps for its backward: each storage once, the model's parameters
    left out (a frozen linear layer keeps its weight, which costs nothing more)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        outputs = forward_pass(model)  # held until counted: nothing saved is freed and its address reused
    del outputs
    return sum(storages.values())


def low_rank_bytes(model: torch.nn.Module, tokens: int, element_size: int) -> int:
    """What LoRA may keep for backward beyond the frozen model's activations, in a dtype of ``element_size``
    bytes: per adapted layer of rank r, x @ A's [tokens, r] (B's input) and A and B cast to the compute dtype."""
    from peft.tuners.lora import LoraLayer

    total = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            rank = module.r[ADAPTER]
            total += (tokens * rank + rank * (module.in_features + module.out_features)) * element_size
    return total


def a_long_batch(rows: int = 4, length: int = 48) -> SequenceBatch:
    """``rows`` sequences of ``length`` tokens each (half prompt, half response): no padding."""
    ids = torch.randint(3, 60, (rows, length), generator=torch.Generator().manual_seed(0)).tolist()
    return SequenceBatch.of_lists([row[:length // 2] for row in ids], [row[length // 2:] for row in ids])


def test_a_bf16_lora_actor_keeps_no_more_for_backward_than_full_fine_tuning_and_its_low_rank_products(tiny):
    """PEFT keeps the adapters in fp32 on a bf16 base; were each adapted layer's input cast to fp32 for them, that
    copy would be kept for backward in every layer: more than full fine-tuning keeps (issue 29)."""
    batch, rank = a_long_batch(), 4
    full, lora = loaded(tiny, roles=("actor",), dtype="bfloat16"), loaded(
        tiny, roles=("actor",), dtype="bfloat16", lora_rank=rank, lora_alpha=8)

    def trainer_pass(worker: RankWorker):
        return lambda model: response_logprobs(model, batch, worker.roles.pad_id, temperature=1.0, with_entropy=True,
                                               device=torch.device("cpu"))

    full_bytes = saved_for_backward_bytes(full.roles.actor.model, trainer_pass(full))
    lora_bytes = saved_for_backward_bytes(lora.roles.actor.model, trainer_pass(lora))
    tokens = int(batch.sequence_lens.sum())
    assert lora_bytes <= full_bytes + low_rank_bytes(lora.roles.actor.model, tokens, element_size=2)


def test_a_bf16_lora_critic_keeps_no_more_for_backward_than_a_fully_trained_one_and_its_low_rank_products(tiny):
    batch = a_long_batch()
    full, lora = critic_loaded(tiny, "bfloat16"), critic_loaded(tiny, "bfloat16", lora_rank=4)

    def trainer_pass(worker: RankWorker):
        return lambda model: response_values(model, batch, worker.roles.pad_id, device=torch.device("cpu"))

    full_bytes = saved_for_backward_bytes(full.roles.critic.model, trainer_pass(full))
    lora_bytes = saved_for_backward_bytes(lora.roles.critic.model, trainer_pass(lora))
    tokens = int(batch.sequence_lens.sum())
    assert lora_bytes <= full_bytes + low_rank_bytes(lora.roles.critic.model, tokens, element_size=2)


def test_on_a_bf16_base_the_adapters_train_in_fp32(tiny):
    """The optimizer updates fp32 adapters: in bf16 an update smaller than 1/256 of a weight would be lost."""
    worker = loaded(tiny, roles=("actor",), dtype="bfloat16", lora_rank=4, lora_alpha=8)
    update(worker)
    factors = {name: p for name, p in worker.roles.actor.model.named_parameters() if ".lora_" in name}
    assert factors and all(p.dtype == torch.float32 for p in factors.values())
    assert all(p.abs().max() > 0 for name, p in factors.items() if ".lora_B." in name)  # all started at zero
    assert all(p.dtype == torch.bfloat16 for name, p in worker.roles.actor.model.named_parameters()
               if name not in factors)
    sent = worker.roles.actor.named_weights()  # a sync carries them in the base's dtype, as the rollout computes
    assert sent and all(t.dtype == torch.bfloat16 for _, t in sent)


def test_a_bf16_lora_actor_s_logprobs_are_those_of_its_merged_weights(tiny):
    """What the trainer computes for a bf16 LoRA actor is what a rollout computes on the base with the adapters
    merged into its bf16 weights, to bf16's precision."""
    worker = loaded(tiny, roles=("actor",), dtype="bfloat16", lora_rank=4, lora_alpha=8)
    update(worker)
    merged, base = load_causal_lm(tiny, "bfloat16"), load_causal_lm(tiny, "bfloat16")
    weights = dict(merged.named_parameters())
    with torch.no_grad():
        for module, (a, b) in adapter_pairs(worker.roles.actor.named_weights()).items():
            weights[f"{module}.weight"].copy_(merged_weight(weights[f"{module}.weight"], a, b))
    from services.trainer.worker import sequences

    def logprobs(model):
        return batched_logprobs(model, sequences(SEQUENCES), worker.roles.pad_id, temperature=1.0,
                                micro=worker.roles.settings.actor_log_probs, ranks=worker.ranks)

    actor = worker.compute_log_probs(SEQUENCES, role="actor")
    assert (actor - logprobs(merged)).abs().max() < 0.02
    assert (actor - logprobs(base)).abs().max() > 0.1  # the adapters have moved it further than that


def test_a_lora_warm_start_trains_the_full_weights_and_the_adapters_learn_on_top(tiny, tmp_path):
    """warm_start.full_weights (the default): the warm start trains every weight but the adapters, RL the adapters
    alone; the reference is the warm-started base; each sync sends the whole model, merged, under the base's
    names; a checkpoint holds the base with the adapters, restores it exactly, and exports as the trainer computes."""
    worker = loaded(tiny, lora_rank=4, lora_alpha=8, warm_start={"steps": 2, "batch_size": 2})
    actor = worker.roles.actor
    initial = {name: p.clone() for name, p in actor.model.named_parameters()}
    worker.train_supervised(SEQUENCES)
    taught = {name: p.clone() for name, p in actor.model.named_parameters()}
    changed = {name for name in initial if not torch.equal(taught[name], initial[name])}
    assert changed and not any(".lora_" in name for name in changed)  # the base learnt, the adapters did not
    assert "base_model.model.model.embed_tokens.weight" in changed  # every weight, not only the adapted layers'
    assert all(p.requires_grad == (".lora_" in name) for name, p in actor.model.named_parameters())  # RL's again
    reference = worker.compute_log_probs(SEQUENCES, role="ref")
    update(worker)
    updated = {name for name, p in actor.model.named_parameters() if not torch.equal(p, taught[name])}
    assert updated and all(".lora_" in name for name in updated)  # RL trains the adapters alone
    assert torch.equal(worker.compute_log_probs(SEQUENCES, role="ref"), reference)  # the warm-started base

    sent = {name: full(weight) for name, weight in actor.named_weights()}
    merged = copy.deepcopy(actor.model).merge_and_unload()
    assert sent.keys() == dict(merged.named_parameters()).keys()  # the whole model under its own names
    assert all(torch.allclose(sent[name], p, atol=1e-6, rtol=0) for name, p in merged.named_parameters())

    worker.save_checkpoint({}, path=str(tmp_path / "ckpt"))
    stored = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert "actor.model.base_model.model.model.embed_tokens.weight" in stored
    again = loaded(tiny, lora_rank=4, lora_alpha=8, warm_start={"steps": 2, "batch_size": 2})
    again.load_checkpoint({}, path=str(tmp_path / "ckpt"))
    assert all(torch.equal(p, dict(actor.model.named_parameters())[name])
               for name, p in again.roles.actor.model.named_parameters())
    # coordctl export's model: the checkpoint's base with its adapters merged in, as the trainer computes
    config = RunConfig.model_validate(yaml.safe_load(run_yaml(tiny, {"steps": 2, "batch_size": 2}, lora_rank=4,
                                                              lora_alpha=8)))
    assert holds_base(tmp_path / "ckpt", "actor")
    exported = lora_role_model(config, "actor", tmp_path / "ckpt").merge_and_unload()
    assert all(torch.allclose(p, sent[name], atol=1e-6, rtol=0) for name, p in exported.named_parameters())


def test_with_full_weights_off_a_lora_warm_start_trains_the_adapters(tiny):
    worker = loaded(tiny, lora_rank=4, lora_alpha=8, warm_start={"steps": 2, "batch_size": 2, "full_weights": False})
    actor = worker.roles.actor
    initial = {name: p.clone() for name, p in actor.model.named_parameters()}
    worker.train_supervised(SEQUENCES)
    changed = {name for name, p in actor.model.named_parameters() if not torch.equal(p, initial[name])}
    assert changed and all(".lora_" in name for name in changed)
    assert all(".lora_" in name for name, _ in actor.named_weights())  # adapter syncs
