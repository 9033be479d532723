"""A trainer InitRun whose models fail to load after the servicer's checks: what it leaves loaded, and says."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file, save_file

from services.run.config import RunConfig
from services.coordctl.tiny_model import build_tiny_model
from services.trainer.ranks import Ranks
from services.trainer.settings import run_settings
from services.trainer.worker import Roles, RankWorker, unloaded_notice


def test_on_one_cpu_rank_a_run_that_fails_to_load_leaves_the_run_held(tmp_path):
    tiny = build_tiny_model(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2, seed=0)
    wide = shutil.copytree(tiny, tmp_path / "wide")
    tensors = load_file(wide / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = torch.zeros(tensors[name].shape[0], 7)
    save_file(tensors, wide / "model.safetensors", metadata={"format": "pt"})
    worker = RankWorker(Ranks.single("cpu"))

    def init(run_id, folder):
        config = yaml.safe_dump({"actor_rollout_ref": {"model": {"path": str(folder)}}})
        return worker.init_run({}, run_id=run_id, run_config_yaml=config, roles=["actor"], seed=0)

    held = init("first", tiny)
    with pytest.raises(ValueError, match=rf"model.path {wide}: the run's models cannot be loaded \(RuntimeError: "
                                         r".*\); run first is still loaded"):
        init("second", wide)
    assert worker.roles is held


def test_what_a_failed_init_run_says_it_left():
    held = Roles(run_id="a", settings=run_settings(RunConfig(), torch.device("cpu")), actor=None, critic=None,
                 reference=None, pad_id=0)
    assert unloaded_notice(None, beside=True) == "no run is loaded"
    assert unloaded_notice(held, beside=True) == "run a is still loaded"
    assert unloaded_notice(held, beside=False) == ("run a was let go first to make room: no run is loaded now; "
                                                   "InitRun it again to go on")


WARM_START_BATCH = {"prompt_ids": torch.tensor([5, 6, 7, 8, 9, 10, 11]), "prompt_lens": torch.tensor([3, 4]),
                    "response_ids": torch.tensor([12, 13, 14, 15, 16]), "response_lens": torch.tensor([2, 3])}


def warm_started(folder, steps: int, lora_rank: int = 0) -> RankWorker:
    """A worker holding a run whose warm start has 4 steps (a warmup and a cosine: every step's lr differs); with
    ``lora_rank``, a LoRA actor whose warm start trains its full weights."""
    worker = RankWorker(Ranks.single("cpu"))
    warm_start = {"steps": 4, "batch_size": 2, "lr": 1e-2, "lr_warmup_steps": 1, "warmup_style": "cosine"}
    config = yaml.safe_dump({"actor_rollout_ref": {"model": {"path": str(folder), "lora_rank": lora_rank},
                                                   "actor": {"warm_start": warm_start}}})
    worker.init_run({}, run_id="warm", run_config_yaml=config, roles=["actor"], seed=0)
    for _ in range(steps):
        worker.train_supervised(WARM_START_BATCH)
    return worker


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_checkpoint_part_way_through_the_warm_start_goes_on_as_if_it_had_not_stopped(tmp_path, lora_rank):
    """Saved after 2 of 4 warm-start steps, loaded by a new trainer, 2 more steps: the weights of 4 steps in a row,
    exactly (AdamW's moments and the schedule's place come back with the weights)."""
    tiny = build_tiny_model(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2, seed=0)
    whole = warm_started(tiny, steps=4, lora_rank=lora_rank)
    stopped = warm_started(tiny, steps=2, lora_rank=lora_rank)
    stopped.save_checkpoint({}, path=str(tmp_path / "part"))
    resumed = warm_started(tiny, steps=0, lora_rank=lora_rank)
    assert resumed.load_checkpoint({}, path=str(tmp_path / "part")) == 2
    assert resumed.roles.actor.warm_start.lr == stopped.roles.actor.warm_start.lr  # the third step's
    for _ in range(2):
        resumed.train_supervised(WARM_START_BATCH)
    expected = dict(whole.roles.actor.model.named_parameters())
    assert all(torch.equal(weight, expected[name]) for name, weight in resumed.roles.actor.model.named_parameters())

    # once the warm start is done its optimizer is not kept; nor before it began
    whole.save_checkpoint({}, path=str(tmp_path / "done"))
    warm_started(tiny, steps=0, lora_rank=lora_rank).save_checkpoint({}, path=str(tmp_path / "none"))
    keys = {name: dcp.FileSystemReader(str(tmp_path / name)).read_metadata().state_dict_metadata
            for name in ("part", "done", "none")}
    assert any(key.startswith("actor.warm_start_optim.state.") for key in keys["part"])
    assert not any(key.startswith("actor.warm_start_optim") for key in [*keys["done"], *keys["none"]])
