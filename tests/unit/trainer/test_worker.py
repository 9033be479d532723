"""A trainer InitRun whose models fail to load after the servicer's checks: what it leaves loaded, and says."""

from __future__ import annotations

import shutil

import pytest
import torch
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
