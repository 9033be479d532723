"""Prometheus /metrics of a `coordctl start-run --local` run, as an operator reads them: each service's exposition
parsed with prometheus_client's own parser (a scrape without the run's token refused with 401), and a real
Prometheus server (Debian's package) scraping the run through the targets file coordctl prints, with the token
file as its authorization, whose query API sees the step rise. One local run serves the module."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_cli import coordctl, start_local, terminal_env

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
SMALL_RUN = ("data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
             "actor_rollout_ref.actor.ppo_mini_batch_size=8", "local.synthetic_task.rows=400")


def fetch(url: str, token_file: Path | None = None) -> str:
    """The body of a GET of ``url``, presenting the token in ``token_file`` as Prometheus's authorization does."""
    headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"} if token_file else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
        return reply.read().decode()


def samples(text: str) -> dict[str, list]:
    """Every sample of an exposition, by sample name (histogram buckets under NAME_bucket, ...)."""
    by_name: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            by_name.setdefault(sample.name, []).append(sample)
    return by_name


def value(text: str, name: str, **labels: str) -> float:
    """The one sample ``name`` with ``labels`` among its labels."""
    [match] = [s.value for s in samples(text).get(name, []) if labels.items() <= s.labels.items()]
    return match


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, local_cache):
    """A --local run going on, and a Prometheus server scraping it from the start (None without Debian's
    package): the coordinator's address, the targets file coordctl printed, Prometheus's address. Stopped after
    the module, the run with two Ctrl-C (at once: nothing of it is looked at after)."""
    folder = tmp_path_factory.mktemp("metrics")
    process = start_local(folder / "state", local_cache, *SMALL_RUN)
    prometheus = None
    try:
        said = ""
        while "for file_sd_configs:" not in said:
            line = process.stdout.readline().decode()
            assert line, said[-2000:]
            said += line
        coordinator = re.search(r"coordinator at (\S+);", said).group(1)
        targets = Path(re.search(r"for file_sd_configs: (\S+)", said).group(1))
        if PROMETHEUS is not None:
            prometheus, address = start_prometheus(targets, folder / "prometheus")
        yield process, coordinator, targets, address if prometheus else None
    finally:
        for _ in range(2):
            process.send_signal(signal.SIGINT)
            time.sleep(0.5)
        process.communicate(timeout=120)
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)


def start_prometheus(targets: Path, folder: Path, attempts: int = 5) -> tuple[subprocess.Popen, str]:
    """Prometheus scraping the services ``targets`` lists every second, as docs/operations/metrics.md says, once it
    answers; and its loopback address. It cannot bind port 0 and say which port it got, so it is given one found
    free here; should another process take that port first, Prometheus exits saying so and is started again on
    another."""
    folder.mkdir()
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "meshrl-local", "file_sd_configs": [{"files": [str(targets)]}],
                            "authorization": {"credentials_file": str(targets.parent / "token")}}]}))
    log = folder / "prometheus.log"
    for _ in range(attempts):
        address = f"127.0.0.1:{free_port()}"
        with log.open("w") as errors:
            process = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                                        f"--web.listen-address={address}"], stdout=subprocess.DEVNULL, stderr=errors)
        deadline = time.monotonic() + 120
        while process.poll() is None and not answers(f"http://{address}/-/ready"):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        if process.poll() is None:
            return process, address
        assert "address already in use" in log.read_text(), log.read_text()[-2000:]
    raise AssertionError(f"Prometheus found its port taken {attempts} times: {log.read_text()[-2000:]}")


def answers(url: str) -> bool:
    try:
        fetch(url)
    except OSError:
        return False
    return True


def metrics_of(targets: Path) -> dict[str, str]:
    """Each service's /metrics text, by its job."""
    return {group["labels"]["job"]: fetch(f"http://{group['targets'][0]}/metrics", targets.parent / "token")
            for group in json.loads(targets.read_text())}


def wait_for_steps(targets: Path, steps: int, timeout_s: float = 120) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        texts = metrics_of(targets)
        if max((s.value for s in samples(texts["meshrl-coordinator"]).get("meshrl_coordinator_run_step", [])),
               default=0) >= steps:
            return texts
        assert time.monotonic() < deadline, f"the coordinator's metrics never reached step {steps}"
        time.sleep(0.5)


def test_every_service_kind_exports_its_metrics(local_run):
    process, coordinator, targets, _ = local_run
    assert sorted(group["labels"]["job"] for group in json.loads(targets.read_text())) == [
        "meshrl-coordinator", "meshrl-reward", "meshrl-rollout", "meshrl-trainer"]
    token = terminal_env(MESHRL_TOKEN_FILE=str(targets.parent / "token"))
    assert coordctl("status", "no-such-run", "--coordinator", coordinator, env=token).returncode != 0
    texts = wait_for_steps(targets, 2)
    for group in json.loads(targets.read_text()):  # the services demand the run's token of a scrape too
        with pytest.raises(urllib.error.HTTPError) as refused:
            fetch(f"http://{group['targets'][0]}/metrics")
        assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"].startswith("Bearer")

    coordinator_text = texts["meshrl-coordinator"]
    assert value(coordinator_text, "meshrl_coordinator_runs", state="running") == 1
    assert value(coordinator_text, "meshrl_coordinator_step_seconds") > 0
    assert 0 <= value(coordinator_text, "meshrl_coordinator_reward_mean") <= 1
    ages = {s.labels["kind"]: s.value for s in samples(coordinator_text)["meshrl_coordinator_heartbeat_age_seconds"]}
    assert ages.keys() == {"trainer", "rollout", "reward"} and max(ages.values()) < 5
    assert value(coordinator_text, "meshrl_rpc_duration_seconds_count", grpc_method="GetRun",
                 grpc_code="NOT_FOUND") == 1
    assert value(coordinator_text, "meshrl_rpc_duration_seconds_count", grpc_method="Heartbeat", grpc_code="OK") > 0

    rollout = texts["meshrl-rollout"]
    assert value(rollout, "meshrl_rollout_generated_tokens_total") >= value(
        rollout, "meshrl_rollout_generated_sequences_total") > 0
    assert value(rollout, "meshrl_rollout_requests_in_flight") in (0, 1)
    assert value(rollout, "meshrl_rpc_duration_seconds_count", grpc_method="Generate", grpc_code="OK") >= 2

    trainer = texts["meshrl-trainer"]
    assert value(trainer, "meshrl_trainer_op_seconds_count", op="update_actor") >= 2
    assert value(trainer, "meshrl_trainer_memory_bytes", device="cpu", measure="allocated") > 10 ** 7
    assert value(trainer, "meshrl_weight_version") >= 2
    assert value(rollout, "meshrl_weight_version") >= 1  # synced after each step

    reward = texts["meshrl-reward"]
    assert value(reward, "meshrl_reward_samples_total", outcome="scored") > 0
    assert value(reward, "meshrl_reward_samples_total", outcome="timed_out") == 0
    assert "meshrl_weight_version" not in samples(reward) and "meshrl_weight_version" not in samples(coordinator_text)
    for text in texts.values():
        assert value(text, "process_resident_memory_bytes") > 0
    assert process.poll() is None


@pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus package is not installed (apt-get install "
                                               "prometheus): no Prometheus server to scrape the run")
def test_prometheus_scrapes_the_run_and_sees_the_step_rise(local_run, tmp_path):
    *_, prometheus = local_run
    shipped = (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()  # its token file made here
    (tmp_path / "meshrl-token").write_text("a-token\n")
    (tmp_path / "prometheus.yml").write_text(shipped.replace("/etc/prometheus/", f"{tmp_path}/"))
    checked = subprocess.run(["promtool", "check", "config", tmp_path / "prometheus.yml"], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    def query(expression: str) -> list[dict]:
        reply = json.loads(fetch(f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expression})))
        return reply["data"]["result"]

    deadline, steps = time.monotonic() + 120, []
    while len(set(steps)) < 2:
        assert time.monotonic() < deadline, f"Prometheus saw the steps {steps}"
        time.sleep(1)
        series = query("meshrl_coordinator_run_step[5m]")
        steps = [float(v) for _, v in series[0]["values"]] if series else []
    assert steps == sorted(steps)
    assert series[0]["metric"]["job"] == "meshrl-coordinator"  # the job label of coordctl's targets file
    # each scraped whole at least once (one scrape that a loaded service answers late marks it down till the next)
    up = {result["metric"]["job"]: result["value"][1] for result in query("max_over_time(up[5m])")}
    assert up == {f"meshrl-{kind}": "1" for kind in ("coordinator", "trainer", "rollout", "reward")}
