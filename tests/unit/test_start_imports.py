"""What a service imports to start: torch (two to three CPU-seconds in each process that imports it, paid again
at every start) only where the service computes with it.

Each check runs in a fresh interpreter, as a service's process starts: the modules its ``__main__`` imports, then
its config's ``torch_threads=1`` applied as ``run_service`` applies it (every --local service gets it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import services

ROOT = Path(services.__file__).parent.parent
HEAVY = ("torch", "transformers")


def start_imports(kind: str, config: str) -> dict:
    """In a fresh interpreter: import ``services.<kind>.__main__``, build its config from ``config`` (Python
    keyword arguments) with torch_threads=1 and limit torch's threads as run_service does; which of HEAVY it
    then holds, and torch's thread count where it holds torch."""
    model = {"reward": "RewardServiceConfig", "env": "EnvServiceConfig"}[kind]
    script = f"""
import json, sys
import services.{kind}.__main__
from services.common.service import limit_torch_threads
from services.{kind}.config import {model}
limit_torch_threads({model}(torch_threads=1, {config}))
held = [name for name in {HEAVY!r} if name in sys.modules]
threads = sys.modules["torch"].get_num_threads() if "torch" in held else None
print(json.dumps({{"held": held, "threads": threads}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(("kind", "config"), [
    ("env", ""),
    ("reward", "default=[{'rule': 'openai/gsm8k'}], scorers={'mine': [{'function': 'scores.py:score'}]}"),
])
def test_a_service_that_computes_nothing_with_torch_starts_without_it(kind, config):
    assert start_imports(kind, config) == {"held": [], "threads": None}


def test_a_reward_service_with_a_reward_model_has_torch_on_the_threads_it_was_given():
    assert start_imports("reward", "default=[{'reward_model': '/models/rm'}]") == {"held": ["torch"], "threads": 1}
