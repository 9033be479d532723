"""bench/trainer_step.py at its tiny shape on a GPU (about 20 s): what only runs there works before the full
run is spent on it (each job's peak memory, meshrl's reported one included; the MFU; the profile's CUDA times
and its waits for the device), and both sides give the same logprobs within bf16's agreement.

    python -m pytest tests/gpu/test_trainer_step_gpu.py -s      (skips without a GPU)
"""

from __future__ import annotations

import json

from bench.trainer_step import main
from tests.gpu.conftest import needs


@needs(1, vllm=False)
def test_the_bench_measures_memory_mfu_and_cuda_time_on_a_gpu(tmp_path, capsys):
    out = tmp_path / "result.json"
    main(["--tiny", "--device", "cuda", "--profile", "--work", str(tmp_path), "--out", str(out)])
    print(capsys.readouterr().out)
    result = json.loads(out.read_text())
    for name, side in result["sides"].items():
        for job in ("old_log_prob", "update"):
            assert side[job]["peak_gb"] > 0, (name, job)
        assert side["update"]["mfu"] > 0
        assert side["logprob_max_diff"] < 0.1  # bf16, through different attention kernels
    update = result["profiles"]["meshrl update"]
    assert update["time"] == "device" and update["busy_ms"] > 0 and update["top"][0]["self_ms"] > 0
    waits = update["host_device"]  # the gradient norm's .item() at least: a copy to the host and a wait
    assert any("Synchronize" in event for event in waits) and any(event.startswith("Memcpy") for event in waits)
