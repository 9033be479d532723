"""The reward servicer: wire <-> scorers, nothing else.

A sample whose scoring fails is reported invalid with its error; the others
in the batch are scored as usual.
"""

from __future__ import annotations

import asyncio

import structlog

from meshrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.reward.config import RewardServiceConfig
from services.reward.rules import score_sample

log = structlog.get_logger()


def score_one(sample: reward_pb2.Sample) -> reward_pb2.SampleScore:
    try:
        return reward_pb2.SampleScore(score=score_sample(sample.data_source, sample.response, sample.ground_truth), valid=True)
    except Exception as error:  # noqa: BLE001 - one bad sample must not fail the batch
        return reward_pb2.SampleScore(score=0.0, valid=False, error=f"{type(error).__name__}: {error}")


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, config: RewardServiceConfig, identity: common_pb2.ServiceIdentity):
        self.config = config
        self.identity = identity

    async def Score(self, request, context):
        scores = await asyncio.to_thread(lambda: [score_one(s) for s in request.samples])
        invalid = sum(not s.valid for s in scores)
        if invalid:
            log.warning("samples_not_scored", count=invalid, first_error=next(s.error for s in scores if not s.valid))
        return reward_pb2.ScoreResponse(scores=scores, service_id=self.identity.service_id)

    async def Info(self, request, context):
        return common_pb2.ServiceInfo(identity=self.identity, details={"scorers": "rules"})

    async def close(self) -> None:
        pass


def attach(server, config: RewardServiceConfig, identity: common_pb2.ServiceIdentity) -> RewardServicer:
    servicer = RewardServicer(config, identity)
    reward_pb2_grpc.add_RewardServicer_to_server(servicer, server)
    return servicer
