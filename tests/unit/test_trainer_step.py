"""bench/trainer_step.py end to end at its tiny shape on the CPU: the table and JSON it gives, and that meshrl's
trainer and the plain loop do the same work (the same logprobs and gradient on the same weights)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.trainer_step import main


@pytest.fixture
def one_thread():
    """Tiny matrices: more threads only add waiting (3x slower on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_bench_compares_meshrl_with_the_plain_loop_on_the_same_work(tmp_path, capsys, one_thread):
    out = tmp_path / "result.json"
    packed = ["actor_rollout_ref.model.use_remove_padding=true",  # the GPU's path: packed rows, the head in chunks
              "actor_rollout_ref.model.logprob_chunk_tokens=40"]
    main(["--tiny", "--device", "cpu", "--warmup", "1", "--repeats", "1", "--profile", "--work", str(tmp_path),
          "--out", str(out), *packed])
    result = json.loads(out.read_text())
    sides = result["sides"]
    assert list(sides) == ["reference", "reference+ckpt", "meshrl"]
    for side in sides.values():
        assert side["old_log_prob"]["seconds"] > 0 and side["update"]["seconds"] > 0
        assert side["update"]["peak_gb"] is None and side["update"]["mfu"] is None  # CUDA only
    assert sides["meshrl"]["logprob_max_diff"] < 1e-5  # float32: the same logprobs of the same weights
    assert sides["meshrl"]["first_grad_norm"] == pytest.approx(sides["reference"]["first_grad_norm"], rel=1e-5)
    assert result["overrides"] == packed
    assert set(result["profiles"]) == {"meshrl old_log_prob", "meshrl update", "reference old_log_prob",
                                       "reference update"}
    update = result["profiles"]["meshrl update"]
    times = [op["self_ms"] for op in update["top"]]
    assert len(times) == 15 and times == sorted(times, reverse=True) and times[0] > 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == (f"meshrl / reference: old_log_prob {result['ratios']['old_log_prob']:.2f}x, "
                           f"update {result['ratios']['update']:.2f}x")
    assert next(line for line in printed if line.startswith("meshrl ")).split()[-1] == \
        f"{sides['meshrl']['first_grad_norm']:.4g}"
