"""The reward servicer: wire <-> scorer, nothing else.

A sample whose scoring fails is reported invalid with its error; the others
in the batch are scored as usual. A batch is cut into one slice per scoring
thread (user functions run in worker processes behind them); at most
``max_concurrent_batches`` Score calls run at once.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import structlog

from meshrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.common.request_text import json_object
from services.reward import telemetry
from services.reward.config import RewardServiceConfig
from services.reward.scoring import Sample, Scorer

log = structlog.get_logger()


def extra_info_of(sample: reward_pb2.Sample, index: int) -> dict:
    return json_object(sample.extra_info_json, f"samples[{index}].extra_info_json") if sample.extra_info_json else {}


def sample_from_pb(sample: reward_pb2.Sample, index: int) -> Sample:
    """The scorer's sample from samples[index] of a ScoreRequest."""
    return Sample(data_source=sample.data_source, response=sample.response, ground_truth=sample.ground_truth,
                  extra_info=extra_info_of(sample, index), prompt=sample.prompt)


def samples_from_pb(samples) -> list[Sample]:
    return [sample_from_pb(sample, index) for index, sample in enumerate(samples)]


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, config: RewardServiceConfig, identity: common_pb2.ServiceIdentity):
        self.config = config
        self.identity = identity
        self.scorer = Scorer(config)
        self._threads = ThreadPoolExecutor(max_workers=config.score_threads, thread_name_prefix="score")
        self._batches = asyncio.Semaphore(config.max_concurrent_batches)

    async def Score(self, request, context):
        samples = await asyncio.to_thread(samples_from_pb, request.samples)  # their JSON read off the loop
        loop = asyncio.get_running_loop()
        size = max(1, -(-len(samples) // self.config.score_threads))  # one slice of the batch per thread
        async with self._batches:
            parts = await asyncio.gather(*(
                loop.run_in_executor(self._threads, self.scorer.score_batch, samples[start:start + size])
                for start in range(0, len(samples), size)))
        results = [result for part in parts for result in part]
        telemetry.count(results)
        invalid = [r.error for r in results if not r.valid]
        if invalid:
            log.warning("samples_not_scored", count=len(invalid), first_error=invalid[0][:300])
        timed_out = [sample.data_source for sample, r in zip(samples, results) if r.timed_out]
        if timed_out:
            log.warning("samples_timed_out", count=len(timed_out), first_data_source=timed_out[0],
                        timeout_s=self.config.sample_timeout_s)
        return reward_pb2.ScoreResponse(service_id=self.identity.service_id, scores=[
            reward_pb2.SampleScore(score=r.score, valid=r.valid, error=r.error, seconds=r.seconds, pred=r.pred,
                                   acc=r.acc,
                                   components=[reward_pb2.RewardComponent(name=name, weight=weight, value=value)
                                               for name, weight, value in r.components],
                                   timed_out=r.timed_out)
            for r in results])

    async def Info(self, request, context):
        scorers = {source: [c.name for c in components] for source, components in self.config.scorers.items()}
        return common_pb2.ServiceInfo(identity=self.identity, details={
            "scorers": json.dumps(scorers), "default": json.dumps([c.name for c in self.config.default or []])})

    def weight_version(self) -> None:
        return None  # a scorer; a reward model's weights do not change

    async def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.scorer.close)


def attach(server, config: RewardServiceConfig, identity: common_pb2.ServiceIdentity) -> RewardServicer:
    servicer = RewardServicer(config, identity)
    reward_pb2_grpc.add_RewardServicer_to_server(servicer, server)
    return servicer
