"""PPOLoop (services/coordinator/step/loop.py) driven over fake trainer, rollout and reward clients.

The fakes answer the calls the loop, its RolloutSet and its RewardSet make, and record what they were sent:
the rollouts sample prompt i's responses so that a known number of each group is right, the reward service
scores a response 1 when it is the prompt's ground truth. So every advantage the actor is sent, every weight
version and every count can be worked out by hand. The real services are tested end to end in
tests/integration.
"""

from __future__ import annotations

import asyncio
import errno
import math
from pathlib import Path

import grpc
import pytest
import torch

from services.common.config import validate
from services.run.config import RunConfig
from services.common.sequences import SequenceBatch, split_ragged
from services.coordctl.tiny_model import build_char_tokenizer
from services.coordinator.fleet.clients import (Generated, Received, RewardSample, RolloutInfo, RolloutScores,
                                                ScoredSample, SyncResult, TrainerPlacement, TrainerTop)
from services.run.data import Prompt
from services.coordinator.step import checkpointer
from services.coordinator.step.loop import PPOLoop, Trainers, mismatch_warning
from services.coordinator.fleet.reward_set import RewardSet
from services.coordinator.fleet.targets import ServiceTarget
from services.coordinator.fleet.rollout_set import RolloutSet
from services.coordinator.settings import loop_settings, rollout_set_settings
from services.coordinator.store import Checkpoint

TOKENIZER = build_char_tokenizer()
N = 4  # responses per prompt
RIGHT_PER_PROMPT = {"12": 2, "345": 1, "67": 4, "890": 0}  # of the N responses of each prompt, this many are right


def prompt(digits: str) -> Prompt:
    return Prompt(token_ids=TOKENIZER(f"{digits}=", add_special_tokens=False)["input_ids"],
                  data_source="meshrl/reverse", ground_truth=digits[::-1],
                  extra_info={"digits": digits})


PROMPTS = [prompt(digits) for digits in RIGHT_PER_PROMPT]


def text(ids) -> str:
    return TOKENIZER.decode(list(ids), skip_special_tokens=True)


class FakeTrainer:
    """The actor: logprobs of -0.5 a token, an update bumps the weight version, a broadcast sends it."""

    address = "trainer:1"

    def __init__(self):
        self.version, self.updates, self.saved, self.loaded, self.taught = 0, [], [], [], []

    async def init_run(self, run_id, config_yaml, roles, seed, timeout):
        self.roles = roles

    async def compute_log_probs(self, batch: SequenceBatch, step, timeout, role="actor", temperature=0.0):
        return torch.full((batch.num_response_tokens,), -0.5)

    async def compute_candidate_log_probs(self, batch: SequenceBatch, candidate_ids, *, timeout, temperature=0.0):
        """The weight check's: the tokens' logprobs and each candidate's, the rollout's (log 0.5 each)."""
        return torch.full((batch.num_response_tokens,), -0.5), torch.full(candidate_ids.shape, math.log(0.5))

    async def compute_top_log_probs(self, batch: SequenceBatch, top_k, *, timeout, temperature=0.0):
        """The weight check's, beside the rollouts: the tokens' logprobs and a top of ids 3 and 4 at log 0.5 each
        (the rollout's)."""
        tokens = batch.num_response_tokens
        return TrainerTop(logprobs=torch.full((tokens,), -0.5), top_logprobs=torch.full((tokens, 2), math.log(0.5)),
                          top_ids=torch.tensor([[3, 4]] * tokens))

    async def update_actor(self, batch, old_logprobs, advantages, ref_logprobs, step, timeout, rollout_logprobs=None):
        self.version += 1
        self.updates.append({"step": step, "batch": batch, "advantages": advantages, "old_logprobs": old_logprobs,
                             "rollout_logprobs": rollout_logprobs})
        return {"actor/pg_loss": 0.25}, self.version

    async def train_supervised(self, batch: SequenceBatch, step, timeout):
        self.version += 1
        self.taught.append(batch)
        return {"warm_start/loss": 1.0, "warm_start/lr": 1e-3}, self.version

    async def placement(self, timeout=30.0):
        return TrainerPlacement(gpu="", ranks=1)

    async def prepare_channel(self, channel_id, backend, world_size, timeout, keep_joined=False):
        assert backend == "gloo"
        return b"127.0.0.1:1"

    async def join_channel(self, channel_id, backend, rendezvous, world_size, timeout):
        pass

    async def broadcast_weights(self, channel_id, bucket_bytes, timeout):
        await asyncio.sleep(0)
        return SyncResult(weight_version=self.version, total_bytes=1024, buckets=1, seconds=0.001)

    async def save_checkpoint(self, run_id, path, timeout):
        self.saved.append(path)
        return 1024

    async def load_checkpoint(self, run_id, path, timeout):
        self.loaded.append(path)
        return self.version

    async def close(self):
        pass


class FakeRollout:
    """Samples response j of a prompt as its ground truth when j < RIGHT_PER_PROMPT[digits], else "x"; stamps
    each response with the version it served when the call began and the one it serves when it ends (as under
    partial_rollout keep, new weights may come in meanwhile)."""

    def __init__(self, address: str, trainer: FakeTrainer | None):
        self.address, self.trainer = address, trainer
        self.run_id, self.version, self.generated, self.calls = "", 0, 0, []
        self.spanning = 0  # responses sampled across a swap

    async def info(self, timeout=30.0):
        return RolloutInfo(run_id=self.run_id, weight_version=self.version, channel_ranks=1)

    async def init_run(self, run_id, model_path, dtype, timeout, allow_pickle=False, lora_rank=0, adapter_versions=0,
                       routed_experts=False):
        self.run_id = run_id
        return 1

    async def join_channel(self, channel_id, backend, rendezvous, rank, world_size, timeout):
        pass

    async def receive_weights(self, channel_id, timeout, partial_rollout="finish"):
        await asyncio.sleep(0)
        self.version = self.trainer.version
        return Received(version=self.version, transfer_s=0.001, pause_s=0.0)

    async def generate(self, prompts, sampling, seed, first_index, timeout):
        version = self.version
        self.calls.append((seed, sampling, version))
        await asyncio.sleep(0.01)  # long enough for the loop to get on with other work meanwhile
        responses = []
        for ids in prompts:
            digits = text(ids).rstrip("=")
            responses += [TOKENIZER(digits[::-1] if j < RIGHT_PER_PROMPT[digits] else "x",
                                    add_special_tokens=False)["input_ids"] for j in range(sampling.n)]
        self.generated += len(responses)
        self.spanning += len(responses) if self.version != version else 0
        lens = torch.tensor([len(r) for r in responses])
        return Generated(response_ids=torch.tensor([t for r in responses for t in r]), response_lens=lens,
                         logprobs=torch.full((int(lens.sum()),), -0.5),
                         truncated=torch.zeros(len(responses),
                                               dtype=torch.bool), weight_versions=torch.full((len(responses),),
                                                                                             version),
                         last_weight_versions=torch.full((len(responses),), self.version))

    async def compute_log_probs(self, batch: SequenceBatch, timeout, *, top_k=0):
        """The weight check's probe: the trainer's logprobs, -0.5 a token, and a top-k of two tokens at log 0.5
        each (it serves the trainer's weights)."""
        tokens = batch.num_response_tokens
        return RolloutScores(version=self.version, logprobs=torch.full((tokens,), -0.5),
                             top_ids=torch.tensor([[3, 4]] * tokens), top_logprobs=torch.full((tokens, 2), math.log(0.5)))

    async def close(self):
        pass


class FakeReward:
    def __init__(self, address: str):
        self.address, self.scored = address, []

    async def score(self, samples: list[RewardSample], timeout):
        self.scored += samples
        return [ScoredSample(score=float(s.response == s.ground_truth), valid=True, error="",
                             acc=s.response == s.ground_truth, pred=s.response,
                             components=(("exact", 1.0, float(s.response == s.ground_truth)),),
                             timed_out=s.response != s.ground_truth)  # as if it ran out of time on every wrong one
                for s in samples], f"id-of-{self.address}"

    async def close(self):
        pass


class Reporter:
    def __init__(self):
        self.steps, self.messages, self.checkpoints, self.validations, self.samples_of = {}, [], [], [], {}
        self.warnings = []

    async def step(self, step, metrics):
        self.steps[step] = metrics

    def log(self, message, kind="log"):
        self.messages.append(message)
        if kind == "warning":
            self.warnings.append(message)

    def checkpoint(self, step, path, loop_state, keep):
        self.checkpoints.append((step, path, loop_state))

    def waiting(self, reason):
        pass

    def validation(self, validated):
        self.validations.append(validated)

    async def samples(self, step, records):
        self.samples_of[step] = records

    def disk_waiting(self, cause):
        self.messages.append(f"waiting: {cause}")


class Mesh:
    """A PPOLoop over one fake trainer, the fake rollouts and reward services named, from a run config."""

    def __init__(self, tmp_path: Path, overrides: dict, rollouts=("rollout:1",), rewards=("reward-a:1", "reward-b:1"),
                 stop_after: int | None = None, val_prompts=(), stop_after_taught: int | None = None):
        data = {"train_batch_size": 4, "shuffle": False, "max_response_length": 4,
                "val_files": ["held-out.jsonl"] if val_prompts else []}
        config = validate(RunConfig, {"data": data, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4},
                                                                          "rollout": {"n": N}},
                                      "trainer": {"total_training_steps": 3}, **overrides})
        only = config.trainer.val_only
        self.trainer, self.reporter = None if only else FakeTrainer(), Reporter()
        self.rollouts = {address: FakeRollout(address, self.trainer) for address in rollouts}
        self.rewards = {address: FakeReward(address) for address in rewards}
        groups = {"group default": ["reward-a:1"], "group b": ["reward-b:1"]}
        stop = (lambda: len(self.reporter.steps) >= stop_after) if stop_after is not None else (lambda: False)
        if stop_after_taught is not None:  # a stop asked once the warm start has taught that many steps
            stop = lambda: len(self.trainer.taught) >= stop_after_taught  # noqa: E731
        rollout_set = RolloutSet("run", rollout_set_settings(config), self.trainer, find=lambda: list(self.rollouts),
                                 notices=self.reporter, should_stop=stop, connect=self.rollouts.__getitem__)
        reward_set = RewardSet(ServiceTarget("group", "default"), lambda target: groups[str(target)], self.reporter,
                               should_stop=stop, timeout_s=60.0, connect=self.rewards.__getitem__)
        self.loop = PPOLoop(run_id="run", settings=loop_settings(config), config_yaml="",
                            trainers=None if only else Trainers(self.trainer, None, None), rollout_set=rollout_set,
                            reward_set=reward_set, env_set=None, prompts=[] if only else PROMPTS, val_prompts=list(val_prompts),
                            tokenizer=TOKENIZER, reporter=self.reporter, should_stop=stop,
                            checkpoint_dir=tmp_path / "checkpoints")

    def run(self, resume: Checkpoint | None = None) -> bool:
        return asyncio.run(self.loop.run(resume))


def grpo_by_hand(right: int) -> list[float]:
    """GRPO advantages of a group of N scores, ``right`` of them 1: (x - mean) / (unbiased std + 1e-6)."""
    scores = [1.0] * right + [0.0] * (N - right)
    mean = sum(scores) / N
    std = math.sqrt(sum((x - mean) ** 2 for x in scores) / (N - 1))
    return [(x - mean) / (std + 1e-6) for x in scores]


def per_sequence(advantages: torch.Tensor, batch: SequenceBatch) -> list[float]:
    """Each sequence's advantage (the same on all its tokens)."""
    values = []
    for part in torch.split(advantages, batch.response_lens.tolist()):
        assert torch.all(part == part[0])
        values.append(float(part[0]))
    return values


def test_a_grpo_step_trains_on_hand_worked_advantages_and_every_rollout_serves_the_new_weights(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 3, "save_freq": 2}})
    assert mesh.run() is True
    # groups [1,1,0,0] -> +-0.866; [1,0,0,0] -> 1.5 and -0.5; [1,1,1,1] and [0,0,0,0] -> 0
    expected = [a for right in RIGHT_PER_PROMPT.values() for a in grpo_by_hand(right)]
    assert [round(a, 4) for a in expected[:5]] == [0.866, 0.866, -0.866, -0.866, 1.5]
    assert [u["step"] for u in mesh.trainer.updates] == [1, 2, 3]
    for update in mesh.trainer.updates:
        assert per_sequence(update["advantages"], update["batch"]) == pytest.approx(expected, abs=1e-5)
        # one optimizer step over the batch: no old logprobs, the update takes its own; the rollout's go along
        # for the mismatch metrics the trainer then reports
        assert update["old_logprobs"] is None and torch.all(update["rollout_logprobs"] == -0.5)
    metrics = mesh.reporter.steps
    assert not any("timing_s/old_log_prob" in metrics[s] for s in (1, 2, 3))
    assert [metrics[s]["training/weight_version"] for s in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert [metrics[s]["rollout/weight_version"] for s in (1, 2, 3)] == [0.0, 1.0, 2.0]
    assert all(metrics[s]["training/off_policy/staleness/max"] == 0.0 for s in (1, 2, 3))
    # every sync's weight check passed: the rollout's probe logprobs are the trainer's
    assert all(metrics[s]["weights/probe_logprob_diff_max"] == 0.0 for s in (1, 2, 3))
    assert all(metrics[s]["weights/probe_topk_kl_max"] == 0.0 for s in (1, 2, 3))
    assert all(0 < metrics[s]["timing_s/weight_probe"] <= metrics[s]["timing_s/update_weights"] for s in (1, 2, 3))
    assert metrics[1]["critic/score/mean"] == pytest.approx(sum(RIGHT_PER_PROMPT.values()) / (4 * N))
    assert mesh.rollouts["rollout:1"].version == 3
    # tokens per second per device: a one-rank trainer and one rollout on the CPU, two processes
    assert all(metrics[s]["perf/devices"] == 2.0 for s in (1, 2, 3))
    assert metrics[1]["perf/throughput"] == pytest.approx(
        metrics[1]["perf/total_num_tokens"] / metrics[1]["timing_s/step"] / 2)
    # every sample generated once and scored once, all by the default group's service
    assert mesh.rollouts["rollout:1"].generated == 3 * 4 * N
    assert len(mesh.rewards["reward-a:1"].scored) == 3 * 4 * N and not mesh.rewards["reward-b:1"].scored
    assert metrics[2]["reward/samples_by/id-of-reward-a:1"] == 4 * N
    assert all(metrics[s]["reward/timeouts"] == 4 * N - sum(RIGHT_PER_PROMPT.values()) for s in (1, 2, 3))
    # save_freq 2: one checkpoint, after step 2, with the sampler right after step 2's batch (4 of 4 prompts:
    # the next epoch starts at the next batch)
    [(step, path, state)] = mesh.reporter.checkpoints
    assert (step, Path(path).name, state["position"]) == (2, "step_000002", 4)
    assert mesh.trainer.saved == [str(Path(path) / "actor")]


def test_generating_one_step_ahead_trains_samples_one_version_old_with_rollout_correction(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 3, "async_": {"max_staleness": 1}}})
    assert mesh.run() is True
    metrics = mesh.reporter.steps
    # step 1 from version 0, trained at 0; step 2 begun once step 0 was "done" (at once), so from version 0,
    # trained at 1; step 3 begun once step 1 was synced: from version 1, trained at 2
    assert [metrics[s]["rollout/weight_version"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]
    assert [metrics[s]["training/off_policy/staleness/max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert all(metrics[s]["training/off_policy/dropped_samples"] == 0.0 for s in (1, 2, 3))
    # responses whose call went on under weights that came in meanwhile are counted (staleness: from the first)
    assert sum(metrics[s]["training/off_policy/samples_spanning_swap"] for s in (1, 2, 3)) == \
        mesh.rollouts["rollout:1"].spanning
    # with staleness, the rollout's own logprobs go with every update (rollout correction, enable: auto)
    assert all(u["rollout_logprobs"] is not None for u in mesh.trainer.updates)
    assert mesh.rollouts["rollout:1"].generated == 3 * 4 * N


def test_an_update_of_two_mini_batches_gets_the_old_logprobs_of_a_pass_before_it(tmp_path):
    mesh = Mesh(tmp_path, {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}, "rollout": {"n": N}}})
    assert mesh.run() is True
    for update in mesh.trainer.updates:
        assert torch.all(update["old_logprobs"] == -0.5) and update["rollout_logprobs"] is None
    metrics = mesh.reporter.steps
    assert all("timing_s/old_log_prob" in metrics[s] for s in (1, 2, 3))
    assert all(metrics[s]["training/rollout_probs_diff_max"] == 0.0 for s in (1, 2, 3))  # both -0.5 a token


def test_the_reward_services_score_a_batch_beside_the_actor_s_old_logprobs_not_before_them(tmp_path):
    """The scores are first needed by the advantages: at max_staleness 0 a step's reward call and its old-logprob
    call are in flight together. The reward answers only once the actor was asked, so scoring the batch before
    the actor's call would fail here (the wait's deadline); the advantages are still the hand-worked ones."""
    mesh = Mesh(tmp_path, {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}, "rollout": {"n": N}}})
    asked, scoring, overlaps = asyncio.Event(), mesh.rewards["reward-a:1"].score, []
    logprobs = mesh.trainer.compute_log_probs

    async def old_logprobs(batch, step, timeout, role="actor", temperature=0.0):
        asked.set()
        return await logprobs(batch, step, timeout, role=role, temperature=temperature)

    async def score(samples, timeout):
        await asyncio.wait_for(asked.wait(), timeout=30)
        overlaps.append(True)
        asked.clear()
        return await scoring(samples, timeout)

    mesh.trainer.compute_log_probs, mesh.rewards["reward-a:1"].score = old_logprobs, score
    assert mesh.run() is True
    assert len(overlaps) == 3  # every step's batch
    expected = [a for right in RIGHT_PER_PROMPT.values() for a in grpo_by_hand(right)]
    for update in mesh.trainer.updates:
        assert per_sequence(update["advantages"], update["batch"]) == pytest.approx(expected, abs=1e-5)
    metrics = mesh.reporter.steps
    assert all(metrics[s]["timing_s/reward"] > 0 and metrics[s]["reward/samples_by/id-of-reward-a:1"] == 4 * N
               for s in (1, 2, 3))


def test_a_run_stopped_with_a_batch_generated_ahead_stops_its_scoring(tmp_path):
    """One step ahead, step 2's batch is generated (and handed over, its scores coming) while step 1 trains; a stop
    after step 1 ends the run without training on it, and its reward call is cancelled as the run returns, not left
    running after it."""
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 3, "async_": {"max_staleness": 1}}}, stop_after=1,
                rewards=("reward-a:1",))
    scoring, update, calls, cancelled = mesh.rewards["reward-a:1"].score, mesh.trainer.update_actor, [], []
    second_scoring = asyncio.Event()

    async def score(samples, timeout):
        calls.append(len(samples))
        if len(calls) == 1:
            return await scoring(samples, timeout)
        second_scoring.set()
        try:
            await asyncio.Event().wait()  # the scores of step 2 never come
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def update_actor(*args, **kwargs):  # step 1 ends (and the stop is seen) once step 2's scoring has begun
        await asyncio.wait_for(second_scoring.wait(), timeout=30)
        return await update(*args, **kwargs)

    async def run_and_look() -> tuple[bool, list[bool]]:
        stopped = await mesh.loop.run(None)
        return stopped, list(cancelled)  # as the run returns, before asyncio.run cancels what is left

    mesh.rewards["reward-a:1"].score, mesh.trainer.update_actor = score, update_actor
    assert asyncio.run(run_and_look()) == (False, [True])
    assert sorted(mesh.reporter.steps) == [1] and len(calls) == 2


def test_a_step_that_does_not_update_the_actor_still_computes_old_logprobs_for_the_mismatch(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 3, "critic_warmup": 1}})  # one mini-batch a step
    assert mesh.run() is True
    metrics = mesh.reporter.steps
    assert "timing_s/old_log_prob" in metrics[1] and metrics[1]["training/rollout_probs_diff_max"] == 0.0
    assert [u["step"] for u in mesh.trainer.updates] == [2, 3]
    assert all(u["old_logprobs"] is None for u in mesh.trainer.updates)
    assert not any("timing_s/old_log_prob" in metrics[s] for s in (2, 3))


def test_each_steps_samples_carry_their_text_score_versions_replicas_and_advantage(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 3, "rollout_data_dir": "rollouts",
                                       "async_": {"max_staleness": 1}}}, rollouts=("rollout:1", "rollout:2"))
    assert mesh.run() is True
    expected = [a for right in RIGHT_PER_PROMPT.values() for a in grpo_by_hand(right)]
    for step, records in mesh.reporter.samples_of.items():
        assert len(records) == 4 * N and {r["step"] for r in records} == {step}
        assert [r["advantage"] for r in records] == pytest.approx(expected, abs=1e-5)
        for index, record in enumerate(records):
            digits = list(RIGHT_PER_PROMPT)[index // N]
            right = index % N < RIGHT_PER_PROMPT[digits]
            assert (record["input"], record["gts"], record["group"]) == (f"{digits}=", digits[::-1], index // N)
            assert record["output"] == (digits[::-1] if right else "x")
            assert record["score"] == float(right) and record["acc"] is right
            assert record["reward_components"] == [{"name": "exact", "weight": 1.0, "value": float(right)}]
            assert (record["reward_service"], record["reward_address"]) == ("id-of-reward-a:1", "reward-a:1")
        # the batch is split over both rollouts, prompts 0-1 on the first and 2-3 on the second
        assert [r["rollout"] for r in records] == ["rollout:1"] * 2 * N + ["rollout:2"] * 2 * N
    # one step ahead: step 1 sampled by and trained from version 0, step 2 by 0 trained from 1, step 3 by 1 from 2
    versions = {step: {(r["weight_version"], r["staleness"]) for r in records}
                for step, records in mesh.reporter.samples_of.items()}
    assert versions == {1: {(0, 0)}, 2: {(0, 1)}, 3: {(1, 1)}}
    # and the version of each one's last token: later where weights came in while its call went on
    records = [r for step_records in mesh.reporter.samples_of.values() for r in step_records]
    assert all(r["weight_version"] <= r["last_weight_version"] <= r["weight_version"] + 1 for r in records)
    assert sum(r["last_weight_version"] > r["weight_version"] for r in records) == \
        sum(rollout.spanning for rollout in mesh.rollouts.values())
    plain = Mesh(tmp_path, {})  # no trainer.rollout_data_dir: nothing kept
    assert plain.run() is True and plain.reporter.samples_of == {}


def test_samples_kept_after_dapo_filtering_are_those_trained_each_with_its_own_prompt(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 1, "rollout_data_dir": "rollouts"},
                           "algorithm": {"filter_groups": {"enable": True}}})
    assert mesh.run() is True
    # "67" (all right) and "890" (all wrong) carry no signal and are dropped; two rounds refill the batch
    records = mesh.reporter.samples_of[1]
    assert [r["input"] for r in records] == [f"{digits}=" for digits in ("12", "345", "12", "345") for _ in range(N)]
    assert [r["group"] for r in records] == [g for g in range(4) for _ in range(N)]
    for group in range(4):
        answers = [r for r in records if r["group"] == group]
        right = sum(r["output"] == r["gts"] == r["input"][:-1][::-1] for r in answers)
        assert right == RIGHT_PER_PROMPT[answers[0]["input"][:-1]]
    assert len(mesh.trainer.updates[0]["batch"]) == len(records)


def test_a_reward_swap_is_probed_and_scores_from_the_next_boundary(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 3}})
    swapped = {}

    async def swap_after_step_one():
        loop = mesh.loop
        running = asyncio.ensure_future(loop.run())
        while 1 not in mesh.reporter.steps:
            await asyncio.sleep(0.001)
        swapped["addresses"] = await loop.reward_set.swap(ServiceTarget("group", "b"), [
            RewardSample(data_source=p.data_source, response=p.ground_truth, ground_truth=p.ground_truth,
                         extra_info=p.extra_info) for p in PROMPTS])
        return await running

    assert asyncio.run(swap_after_step_one()) is True
    assert swapped["addresses"] == ["reward-b:1"]
    probe, *scored_by_b = mesh.rewards["reward-b:1"].scored
    assert probe.response == probe.ground_truth  # the probe scores ground truths
    samples_a = len(mesh.rewards["reward-a:1"].scored)
    assert samples_a + len(scored_by_b) + 1 - len(PROMPTS) == 3 * 4 * N
    assert samples_a in (4 * N, 2 * 4 * N)  # the swap lands at the boundary after step 1 or 2
    [switched] = [m for m in mesh.reporter.messages if "reward services switched to group b" in m]
    first = int(switched.split("from step ")[1].split(":")[0])  # the first batch group b scored
    assert samples_a == (first - 1) * 4 * N
    assert mesh.loop.checkpoints.loop_state(3, mesh.loop.kl_coef)["reward_target"] == ["group", "b"]


def test_a_stop_request_checkpoints_the_last_step_and_a_resume_goes_on_from_it(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 3}}, stop_after=2)
    assert mesh.run() is False
    [(step, path, state)] = mesh.reporter.checkpoints
    assert step == 2 and sorted(mesh.reporter.steps) == [1, 2]
    again = Mesh(tmp_path, {"trainer": {"total_training_steps": 3}})
    again.trainer.version = 2  # the trainer restores the weights of step 2
    assert again.run(Checkpoint(run_id="run", step=step, path=path, loop_state=state)) is True
    assert again.trainer.loaded == [str(Path(path) / "actor")]
    assert sorted(again.reporter.steps) == [3]
    assert again.reporter.steps[3]["training/weight_version"] == 3.0
    assert again.rollouts["rollout:1"].generated == 4 * N  # only step 3 is generated


def taught_rows(trainer: FakeTrainer) -> list[str]:
    return [text(ids) for batch in trainer.taught for ids in split_ragged(batch.prompt_ids, batch.prompt_lens)]


def test_a_stop_asked_during_the_warm_start_lands_at_its_next_step_and_a_resume_goes_on_from_there(tmp_path):
    warm = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "warm_start": {"steps": 5, "batch_size": 1}},
                                  "rollout": {"n": N}}}
    whole = Mesh(tmp_path / "whole", warm)  # the same warm start, not stopped
    assert whole.run() is True and len(whole.trainer.taught) == 5

    mesh = Mesh(tmp_path, warm, stop_after_taught=2)  # asked during the second step
    assert mesh.run() is False
    [(step, path, state)] = mesh.reporter.checkpoints
    assert step == 0 and len(mesh.trainer.taught) == 2 and not mesh.reporter.steps  # not the 3 steps left
    assert state["warm_start"] == {"taught": 2, "epoch": 0, "position": 2}  # 2 rows of the 5 drawn
    assert mesh.trainer.saved == [str(Path(path) / "actor")]
    assert "warm start stopped after 2/5 steps: a resume goes on from step 3" in mesh.reporter.messages

    again = Mesh(tmp_path, warm)
    again.trainer.version = 2  # the trainer restores the weights (and the warm start's optimizer) of its step 2
    assert again.run(Checkpoint(run_id="run", step=step, path=path, loop_state=state)) is True
    assert again.trainer.loaded == [str(Path(path) / "actor")]
    assert taught_rows(mesh.trainer) + taught_rows(again.trainer) == taught_rows(whole.trainer)  # the rows it would
    assert sorted(again.reporter.steps) == [1, 2, 3]                                            # have drawn
    assert again.reporter.steps[1]["training/weight_version"] == 6.0  # RL from the 5 steps' weights


def test_a_stop_asked_before_or_after_the_warm_start_keeps_step_0_and_a_resume_does_not_teach_again(tmp_path):
    warm = {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "warm_start": {"steps": 2, "batch_size": 1}},
                                  "rollout": {"n": N}}}
    early = Mesh(tmp_path / "early", warm, stop_after_taught=0)  # asked before its first step: nothing taught
    assert early.run() is False and early.trainer.taught == []
    [(step, _, state)] = early.reporter.checkpoints
    assert step == 0 and state["warm_start"]["taught"] == 0

    mesh = Mesh(tmp_path, warm, stop_after_taught=2)  # asked as its last step ends
    assert mesh.run() is False
    [(step, path, state)] = mesh.reporter.checkpoints
    assert step == 0 and len(mesh.trainer.taught) == 2 and state["warm_start"]["taught"] == 2
    again = Mesh(tmp_path, warm)
    again.trainer.version = 2  # the trainer restores the warm start's weights
    assert again.run(Checkpoint(run_id="run", step=step, path=path, loop_state=state)) is True
    assert again.trainer.taught == [] and sorted(again.reporter.steps) == [1, 2, 3]
    cold = Mesh(tmp_path / "cold", {}, stop_after=0)  # no warm start: nothing to keep before step 1
    assert cold.run() is False and cold.reporter.checkpoints == []


HELD_OUT = [prompt(digits) for digits in ("12", "345")]  # the fake rollout answers 12 twice right, 345 once


def test_validation_before_training_every_test_freq_steps_and_after_the_last(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 3, "test_freq": 2}}, val_prompts=HELD_OUT)
    assert mesh.run() is True
    validations = mesh.reporter.validations
    assert [(v.step, v.version) for v in validations] == [(0, 0), (2, 2), (3, 3)]
    # greedy (val_kwargs' default), one response a prompt, all from the weights validated
    rollout = mesh.rollouts["rollout:1"]
    seed = mesh.loop.settings.validation.seed
    calls = [(sampling, version) for call_seed, sampling, version in rollout.calls if call_seed == seed]
    assert [(s.n, s.temperature, version) for s, version in calls] == [(1, 0.0, 0), (1, 0.0, 2), (1, 0.0, 3)]
    # response 0 of each prompt is right for both held-out prompts: reward and acc 1, the answer read kept
    metrics = validations[-1].metrics
    assert metrics["val-core/meshrl/reverse/reward/mean@1"] == 1.0 and metrics["val-core/meshrl/reverse/acc/mean@1"] == 1.0
    assert metrics["val/weight_version"] == 3.0 and metrics["timing_s/testing"] > 0
    assert [(s["prompt"], s["response"], s["score"], s["pred"]) for s in validations[-1].samples] == [
        ("12=", "21", 1.0, "21"), ("345=", "543", 1.0, "543")]


def test_validation_sampling_n_measures_best_and_majority(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 1, "val_before_train": False, "test_freq": 1},
                           "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}, "rollout": {
                               "n": N, "val_kwargs": {"n": 4, "do_sample": True, "temperature": 1.0}}}},
                val_prompts=HELD_OUT)
    assert mesh.run() is True
    [validated] = mesh.reporter.validations
    metrics = validated.metrics
    # 12: 2 of 4 right, 345: 1 of 4 right
    assert metrics["val-core/meshrl/reverse/reward/mean@4"] == pytest.approx((0.5 + 0.25) / 2)
    assert metrics["val-aux/meshrl/reverse/acc/pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert metrics["val-aux/meshrl/reverse/acc/pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)  # 1 - C(2,2)/C(4,2)
    assert "val-core/meshrl/reverse/acc/maj@4/mean" in metrics and "val-core/meshrl/reverse/reward/best@4/mean" in metrics


def test_a_run_that_only_validates_needs_no_trainer(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"val_only": True}}, val_prompts=HELD_OUT)
    assert mesh.run() is True
    [validated] = mesh.reporter.validations
    assert (validated.step, validated.version) == (0, 0) and not mesh.reporter.steps
    assert mesh.rollouts["rollout:1"].run_id == "run"  # the rollout loaded the run's model itself


def test_one_step_ahead_the_validation_of_a_step_runs_while_the_next_trains_and_holds_its_sync(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 2, "test_freq": 1, "val_before_train": False,
                                       "async_": {"max_staleness": 1}}}, val_prompts=HELD_OUT)
    timeline = []
    rollout, trainer = mesh.rollouts["rollout:1"], mesh.trainer
    generate, update, receive = rollout.generate, trainer.update_actor, rollout.receive_weights
    validation_seed = mesh.loop.settings.validation.seed

    async def traced_generate(prompts, sampling, seed, first_index, timeout):
        kind = "validation" if seed == validation_seed else "generation"
        timeline.append(f"{kind} from v{rollout.version} begins")
        generated = await generate(prompts, sampling, seed, first_index, timeout)
        timeline.append(f"{kind} from v{int(generated.weight_versions[0])} ends")
        return generated

    async def traced_update(batch, old, advantages, *, ref_logprobs, step, timeout, rollout_logprobs=None):
        timeline.append(f"update of step {step}")
        return await update(batch, old, advantages, ref_logprobs, step, timeout, rollout_logprobs)

    async def traced_receive(channel_id, timeout, partial_rollout="finish"):
        received = await receive(channel_id, timeout, partial_rollout)
        timeline.append(f"sync of v{received.version}")
        return received

    rollout.generate, trainer.update_actor, rollout.receive_weights = traced_generate, traced_update, traced_receive
    assert mesh.run() is True
    assert timeline.index("validation from v1 begins") < timeline.index("update of step 2")  # beside step 2
    assert timeline.index("validation from v1 ends") < timeline.index("sync of v2")  # v1 measured, whole
    assert [(v.step, v.version) for v in mesh.reporter.validations] == [(1, 1), (2, 2)]
    assert "timing_s/wait_validation" in mesh.reporter.steps[2]


def test_a_checkpoint_save_the_trainers_disk_refuses_waits_saying_why_and_is_tried_again(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointer, "SAVE_RETRY_FIRST_S", 0.01)
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 2, "save_freq": 2}})
    refusals = ["CheckpointNotWritten: the checkpoint was not written to /ckpt/step_000002/actor: No space left on "
                "device (/ckpt/step_000002.tmp/__0_0.distcp); 0.0 MiB free on the disk of /ckpt"] * 2
    save = mesh.trainer.save_checkpoint

    async def refused_twice(run_id, path, timeout):
        if refusals:
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(("meshrl-errno", str(errno.ENOSPC))), refusals.pop())
        return await save(run_id, path, timeout)

    mesh.trainer.save_checkpoint = refused_twice
    assert mesh.run() is True
    assert [step for step, _, _ in mesh.reporter.checkpoints] == [2] and len(mesh.trainer.saved) == 1
    waits = [m for m in mesh.reporter.messages if m.startswith("waiting: ")]
    assert waits == ["waiting: the disk: the trainer at trainer:1 cannot save the checkpoint: CheckpointNotWritten: "
                     "the checkpoint was not written to /ckpt/step_000002/actor: No space left on device "
                     "(/ckpt/step_000002.tmp/__0_0.distcp); 0.0 MiB free on the disk of /ckpt", "waiting: None"]


def test_a_checkpoint_save_that_fails_for_another_reason_fails_the_run(tmp_path):
    mesh = Mesh(tmp_path, {"trainer": {"total_training_steps": 2, "save_freq": 2}})

    async def broken(run_id, path, timeout):
        raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "ValueError: no actor")

    mesh.trainer.save_checkpoint = broken
    with pytest.raises(grpc.aio.AioRpcError, match="no actor"):
        mesh.run()
    assert not mesh.reporter.checkpoints and not any(m.startswith("waiting") for m in mesh.reporter.messages)


def test_a_warm_start_with_its_own_rows_teaches_rows_that_rl_never_draws(tmp_path):
    def prompts_of(batch: SequenceBatch) -> set[str]:
        return {text(ids) for ids in split_ragged(batch.prompt_ids, batch.prompt_lens)}

    warm_start = {"steps": 2, "batch_size": 1, "own_rows": True}
    mesh = Mesh(tmp_path, {"data": {"train_batch_size": 2, "shuffle": True, "max_response_length": 4},
                           "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2, "warm_start": warm_start},
                                                 "rollout": {"n": N}},
                           "trainer": {"total_training_steps": 3}})
    assert mesh.run()
    taught = set().union(*(prompts_of(batch) for batch in mesh.trainer.taught))
    drawn = set().union(*(prompts_of(update["batch"]) for update in mesh.trainer.updates))
    assert len(mesh.trainer.taught) == 2 and len(taught) == 2  # two steps, each a row of its own
    assert len(drawn) == 2 and not taught & drawn  # RL's three steps draw from the two rows left
    assert taught | drawn == {text(p.token_ids) for p in PROMPTS}


def test_a_step_whose_rollout_trainer_mismatch_kl_is_over_the_limit_is_reported_with_its_figures():
    spanning = {"training/rollout_mismatch_kl": 0.579, "training/off_policy/samples_spanning_swap": 512.0}
    assert mismatch_warning(2, spanning, 0.1) == (
        "step 2: rollout/trainer mismatch KL 0.579, over 0.1 (actor_rollout_ref.rollout.weight_check."
        "mismatch_kl_warning): the trainer disowns the tokens the rollouts sampled, and the update's ratios are off; "
        "512 samples spanned a weight swap")
    assert mismatch_warning(3, {"training/rollout_mismatch_kl": 0.013}, 0.1) is None  # a healthy bf16 vLLM step
    assert mismatch_warning(3, {"training/rollout_mismatch_kl": 0.1}, 0.1) is None  # at the limit: within it
    assert mismatch_warning(3, {}, 0.1) is None  # not measured (no rollout logprobs)
    assert mismatch_warning(3, spanning, None) is None  # turned off


def reporting_mismatch(trainer: FakeTrainer, kls: list[float]) -> None:
    """The fake trainer's updates report these rollout/trainer mismatch KLs, one a step."""
    update, left = trainer.update_actor, iter(kls)

    async def update_reporting_mismatch(*args, **kwargs):
        metrics, version = await update(*args, **kwargs)
        return {**metrics, "training/rollout_mismatch_kl": next(left)}, version

    trainer.update_actor = update_reporting_mismatch


def test_the_loop_reports_each_step_whose_mismatch_kl_is_over_the_limit_and_goes_on(tmp_path):
    mesh = Mesh(tmp_path, {})
    reporting_mismatch(mesh.trainer, [0.001, 0.58, 0.79])
    assert mesh.run() is True
    assert [w.split(":")[0] for w in mesh.reporter.warnings] == ["step 2", "step 3"]
    assert "rollout/trainer mismatch KL 0.58, over 0.1" in mesh.reporter.warnings[0]
    off = Mesh(tmp_path / "off", {"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}, "rollout": {
        "n": N, "weight_check": {"mismatch_kl_warning": None}}}})
    reporting_mismatch(off.trainer, [0.5, 0.5, 0.5])
    assert off.run() is True and off.reporter.warnings == []
