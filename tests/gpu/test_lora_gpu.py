"""A LoRA actor on one GPU, against full fine-tuning of the same model, at Qwen2.5-0.5B's shape (random weights),
fp32 master weights computing in bf16: the trainer's peak GPU memory over one update, the reference from the
base with its adapters off, and the adapters served by an hf engine on the GPU as the trainer computes them.

    python -m pytest tests/gpu/test_lora_gpu.py -s       (skips without a GPU)

Not yet run: written in a session without a GPU.
"""

from __future__ import annotations

import gc

import pytest
import torch
import yaml

from services.common.weight_sync import full
from services.coordctl.tiny_model import QWEN25_SHAPES, build_random_model
from services.rollout.hf_engine import HFEngine
from services.run.models import load_causal_lm
from services.trainer.ranks import Ranks
from services.trainer.worker import RankWorker
from tests.gpu.conftest import needs

ROWS, PROMPT, RESPONSE = 16, 64, 192


@pytest.fixture(scope="module")
def model_0_5b(tmp_path_factory):
    shape = {**QWEN25_SHAPES["0.5b"], "max_position_embeddings": 1024}
    return build_random_model(tmp_path_factory.mktemp("qwen") / "m", shape, "bfloat16", seed=0)


def batch(vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"prompt_ids": torch.randint(0, vocab, (ROWS * PROMPT,), generator=generator),
            "prompt_lens": torch.full((ROWS,), PROMPT), "response_lens": torch.full((ROWS,), RESPONSE),
            "response_ids": torch.randint(0, vocab, (ROWS * RESPONSE,), generator=generator),
            "advantages": torch.randn(ROWS * RESPONSE, generator=generator)}


def peak_update_memory(folder, **lora) -> tuple[float, RankWorker]:
    """GiB of GPU memory at the peak of one actor update (with the reference's logprobs for the KL loss)."""
    config = yaml.safe_dump({"actor_rollout_ref": {
        "model": {"path": str(folder), "dtype": "bfloat16", "enable_gradient_checkpointing": True, **lora},
        "actor": {"use_kl_loss": True, "ppo_micro_batch_size_per_gpu": 4, "optim": {"lr": 1e-4},
                  "fsdp_config": {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}}}})
    worker = RankWorker(Ranks.single("cuda"))
    worker.init_run({}, run_id="gpu", run_config_yaml=config, roles=["actor", "ref"], seed=0)
    tensors = batch(worker.roles.actor.vocab_size)
    sequences = {key: tensors[key] for key in ("prompt_ids", "prompt_lens", "response_ids", "response_lens")}
    torch.cuda.reset_peak_memory_stats()
    ref = worker.compute_log_probs(sequences, role="ref")
    worker.update_actor({**tensors, "ref_logprobs": ref})
    return torch.cuda.max_memory_allocated() / 2**30, worker


@needs(1, vllm=False)
def test_lora_holds_less_than_full_fine_tuning_and_serves_what_it_trains(model_0_5b):
    full_gib, full_worker = peak_update_memory(model_0_5b)
    del full_worker
    gc.collect()
    torch.cuda.empty_cache()
    lora_gib, worker = peak_update_memory(model_0_5b, lora_rank=64, lora_alpha=128)
    print(f"peak GPU memory of one update: full {full_gib:.2f} GiB, LoRA rank 64 {lora_gib:.2f} GiB "
          f"({lora_gib / full_gib:.2f}x)")
    assert lora_gib < 0.6 * full_gib  # no reference copy, no AdamW state for the base, no base gradients
    assert worker.roles.parameter_counts()["ref"] == 0

    # an hf engine on the GPU, given the adapters, computes as the trainer's model does
    engine = HFEngine(load_causal_lm(model_0_5b, "float32").cuda(), pad_id=0, eos_ids=(1,), batch_size=8)
    engine.load_adapter([(name, full(tensor).float()) for name, tensor in worker.roles.actor.named_weights()])
    ids = batch(worker.roles.actor.vocab_size)["prompt_ids"][:PROMPT].unsqueeze(0).cuda()
    with torch.no_grad():
        served = engine.model(input_ids=ids).logits.float()
        trained = worker.roles.actor.model(input_ids=ids).logits.float()
    assert torch.allclose(served.softmax(-1), trained.softmax(-1), atol=2e-2)  # bf16 compute on the trainer
