"""Code-contest rewards on a real reward service process: a batch of programs scored on their test cases in the code
sandbox, a user's function running code there too, and the service answering while slow programs are judged."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import pytest

from meshrl.v1 import common_pb2, reward_pb2_grpc
from services.common.auth import cluster_token
from services.common.rpc import open_channel
from services.common.sandbox import check_sandbox
from services.coordinator.fleet.clients import RewardClient, RewardSample
from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.plugins.hostile_tools import secrets_probe
from tests.integration.test_rewards import reward_address, reward_config, score_through_service

REASON = check_sandbox()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no code sandbox here: {REASON}")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "code_reward.py"
SUMS = json.dumps({"inputs": ["1 2\n", "-1 5\n", "2 2\n"], "outputs": ["3\n", "4\n", "4\n"]})
MAX_OF = json.dumps({"fn_name": "largest", "inputs": [[[1, 5, 2]], "[-3, -1]"], "outputs": [[5], "-1"]})


def python(code: str) -> str:
    return f"Let me write it.\n```python\n{code}```\nThat should work."


@pytest.fixture(scope="module")
def code_cluster(tmp_path_factory):
    """Coordinator and one reward service that scores apps and codeforces by their rules (codeforces all or nothing)
    and my_code with the example function; each case 3 s of wall clock at most."""
    root = tmp_path_factory.mktemp("code_rewards")
    scorers = {"apps": [{"rule": "apps"}],
               "codeforces": [{"rule": "codeforces", "options": {"all_or_nothing": True}}],
               "my_code": [{"function": f"{EXAMPLE}:score"}]}
    config = reward_config(root, "reward", scorers, function_workers=1, sample_timeout_s=10,
                           sandbox={"wall_s": 3, "cpu_s": 1, "memory_mb": 256, "processes": 8, "concurrent_runs": 2})
    cluster = LocalCluster(root / "state", (ServiceSpec(kind="reward", settings=("--config", config)),))
    asyncio.run(cluster.start(timeout_s=60))
    yield cluster
    cluster.stop()


def test_a_batch_of_programs_is_scored_on_its_test_cases(code_cluster):
    adds = python("a, b = map(int, input().split())\nprint(a + b)\n")
    forgets_signs = python("a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n")
    batch = [RewardSample(data_source=source, response=response, ground_truth=truth, extra_info=extra) for source,
             response, truth, extra in (
        ("apps", adds, SUMS, {}),
        ("apps", forgets_signs, SUMS, {}),
        ("codeforces", forgets_signs, SUMS, {}),
        ("taco", python("def largest(xs):\n    return max(xs)\n"), MAX_OF, {}),  # the built-in rule of its name
        ("codecontests", python("import time\ntime.sleep(600)\n"), SUMS, {}),
        ("apps", python("print(open('/etc/shadow').read())\n"), SUMS, {}),
        ("apps", "In C++: ```cpp\nint main() {}\n```", SUMS, {}),
        ("apps", adds, '{"inputs": ["1 2"], "outputs": []}', {}),
        ("my_code", python("print(int(input()) * 2)\n"), "42", {"stdin": "21\n"}),
    )]
    [(scores, _)] = asyncio.run(score_through_service(code_cluster.coordinator, [batch]))
    assert [(s.valid, s.score, s.acc, s.pred) for s in scores[:7]] == [
        (True, 1.0, True, "3/3 PPP"),
        (True, pytest.approx(2 / 3), False, "2/3 PWP"),
        (True, 0.0, False, "2/3 PWP"),
        (True, 1.0, True, "2/2 PP"),
        (True, 0.0, False, "0/3 TTT"),
        (True, 0.0, False, "0/3 EEE"),
        (True, 0.0, False, "")]
    assert scores[1].components == (("apps", 1.0, pytest.approx(2 / 3)),)
    assert not scores[7].valid and "ground_truth has 1 inputs but 0 outputs" in scores[7].error
    assert (scores[8].valid, scores[8].score, scores[8].acc, scores[8].pred) == (True, 1.0, True, "42\n")


def test_the_service_answers_while_slow_programs_are_judged(code_cluster):
    sleepers = [RewardSample(data_source="apps", response=python("import time\ntime.sleep(600)\n"), ground_truth=SUMS,
                             extra_info={})]

    async def info_while_scoring() -> tuple[bool, list]:
        address = await reward_address(code_cluster.coordinator)
        client, channel = RewardClient(address), open_channel(address)
        try:
            scoring = asyncio.ensure_future(client.score(sleepers, timeout=120))
            await asyncio.sleep(0.5)
            await reward_pb2_grpc.RewardStub(channel).Info(common_pb2.InfoRequest(), timeout=60)
            answered_before_the_batch = not scoring.done()
            scores, _ = await scoring
            return answered_before_the_batch, scores
        finally:
            await client.close()
            await channel.close()

    answered_first, scores = asyncio.run(info_while_scoring())
    assert answered_first  # 3 cases of 3 s on 2 sandbox threads: 6 s of judging, while Info came back at once
    assert [(s.valid, s.pred) for s in scores] == [(True, "0/3 TTT")]



def test_a_judged_program_sees_nothing_of_the_services_token_or_state_folder(code_cluster):
    """The reward service holds the cluster's token file (MESHRL_TOKEN_FILE, in its state folder): a program that
    looks for the token, its path, the state folder and the variables' names everywhere it can reach prints []
    and so passes its one case."""
    token_file = Path(os.environ["MESHRL_TOKEN_FILE"])
    state = code_cluster.state_dir
    secrets = [token_file.read_text().strip(), str(token_file), str(state), "MESHRL_"]
    probe = secrets_probe(secrets, [str(token_file), str(state)])
    case = json.dumps({"inputs": [""], "outputs": ["[]\n"]})
    [(scores, _)] = asyncio.run(score_through_service(code_cluster.coordinator, [
        [RewardSample(data_source="apps", response=python(probe), ground_truth=case, extra_info={})]]))
    assert [(s.valid, s.score, s.pred) for s in scores] == [(True, 1.0, "1/1 P")]


def test_a_judged_program_sees_nothing_of_a_token_given_as_a_variable(tmp_path, monkeypatch):
    """The cluster's token in MESHRL_TOKEN, which the reward service inherits: the same program finds neither it,
    nor the state folder, nor any variable's name."""
    token = f"token-{uuid.uuid4().hex}"
    monkeypatch.delenv("MESHRL_TOKEN_FILE", raising=False)
    monkeypatch.setenv("MESHRL_TOKEN", token)
    cluster_token.cache_clear()
    config = reward_config(tmp_path, "reward", {"apps": [{"rule": "apps"}]}, sandbox={"wall_s": 10})
    cluster = LocalCluster(tmp_path / "state", (ServiceSpec(kind="reward", settings=("--config", config)),))
    try:
        asyncio.run(cluster.start(timeout_s=60))
        assert cluster.own_token_file is None, "the services run with the variable's token"
        probe = secrets_probe([token, str(cluster.state_dir), "MESHRL_"], [str(cluster.state_dir)])
        case = json.dumps({"inputs": [""], "outputs": ["[]\n"]})
        [(scores, _)] = asyncio.run(score_through_service(cluster.coordinator, [
            [RewardSample(data_source="apps", response=python(probe), ground_truth=case, extra_info={})]]))
        assert [(s.valid, s.score, s.pred) for s in scores] == [(True, 1.0, "1/1 P")]
    finally:
        cluster.stop()
        monkeypatch.undo()
        cluster_token.cache_clear()
