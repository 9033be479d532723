"""Weight sync trainer (GPU 0) -> vLLM (GPU 1): every parameter arrives, and logprobs agree."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from tests.gpu.conftest import needs

BENCH = Path(__file__).resolve().parents[2] / "bench" / "weight_sync.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("weight_sync_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@needs(2)
def test_sync_to_vllm_and_logprob_agreement(qwen_05b):
    report = asyncio.run(load_bench().measure(qwen_05b, repeats=2))
    print(f"\nsync {report.total_bytes / 1e9:.2f} GB: {[round(s * 1e3, 1) for s in report.sync_s]} ms, "
          f"raw {[round(s * 1e3, 1) for s in report.raw_s]} ms; logprob gap mean {report.logprob_diff_mean:.4f} "
          f"max {report.logprob_diff_max:.4f}")
    assert report.mismatched == [] and report.unmatched == []  # (a) every vLLM parameter equals the trainer's
    assert report.logprob_diff_mean < 0.02  # (b)
