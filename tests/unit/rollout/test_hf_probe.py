"""The weight check's probe on the hf rollout engine (services/rollout/engines.py): scored between two token steps
of the Generate call in flight, not after it, under the weights of one version, which it reports."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.coordctl.tiny_model import build_tiny_model
from services.rollout.config import RolloutServiceConfig
from services.rollout.engines import HFRolloutEngine
from services.rollout.sampling import SamplingSettings

WAIT_S = 60.0  # the most a step of the test waits for another (never reached when the engine does what it should)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=1, num_heads=2, seed=0)


def test_the_probe_is_scored_between_two_token_steps_of_the_generation_in_flight(tiny):
    """The generation's first token step is held until the probe is asked for; every token step after the probe
    is scored is held until the probe's answer is back. So the probe comes back while the generation is in
    flight only if it was scored between two of its token steps; an engine that scored it after the generation
    would answer it once the generation had ended (the holds time out, and the test fails)."""
    engine = HFRolloutEngine(str(tiny), "float32", RolloutServiceConfig(batch_size=1))
    probe = "not asked"  # -> "scoring" -> "scored", on the engine thread
    generating, asked, answered = threading.Event(), threading.Event(), threading.Event()

    def hold(module, args, kwargs) -> None:  # before each forward of the model, on the engine thread
        if probe == "not asked":
            generating.set()
            asked.wait(WAIT_S)
        elif probe == "scored":
            answered.wait(WAIT_S)

    score = engine.engine.compute_log_probs

    def scoring(prompts, responses):
        nonlocal probe
        probe = "scoring"
        try:
            return score(prompts, responses)
        finally:
            probe = "scored"

    engine.engine.model.register_forward_pre_hook(hold, with_kwargs=True)
    engine.engine.compute_log_probs = scoring  # type: ignore[method-assign]  # (tells when it is scored)
    prompts, response = [[5, 6, 7], [8, 9], [10]], [[11, 12, 13]]
    sampling = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=0, stop_token_ids=())

    async def main():
        generation = asyncio.ensure_future(engine.generate(prompts, sampling, seed_indices=[0, 1, 2]))
        await asyncio.to_thread(generating.wait, WAIT_S)
        checking = asyncio.ensure_future(engine.compute_log_probs(prompts[:1], response))
        await asyncio.sleep(0)  # (the probe is left for the engine thread)
        asked.set()
        scored = await asyncio.wait_for(checking, WAIT_S)
        in_flight = not generation.done()
        answered.set()
        completions = await asyncio.wait_for(generation, WAIT_S)
        await engine.close()
        return scored, in_flight, completions

    scored, in_flight, completions = asyncio.run(main())
    assert in_flight
    assert [len(group) for group in completions] == [1, 1, 1]  # the generation went on after the probe, whole
    assert scored.version == 0 and scored.logprobs == score(prompts[:1], response)
