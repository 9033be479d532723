"""coordctl: start, watch and stop runs; list services.

    coordctl start-run --local                       # the embedded default, all on this machine
    coordctl start-run run.yaml data.train_batch_size=64 --coordinator host:7070
    coordctl runs | status RUN | watch RUN | stop RUN | services
    coordctl certs OUT_DIR --host node1 --host node2,10.0.0.2   # a CA and certificates for mTLS
"""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import re
import signal
import time
from pathlib import Path
from typing import Optional

import grpc
import typer
from tqdm import tqdm

from services.common.auth import cluster_tls, cluster_token
from services.common.config import ConfigError, apply_overrides, read_yaml, to_yaml, validate
from services.common.run_config import RunConfig
from services.coordctl.config import LocalConfig
from services.coordctl.control import CoordinatorClient, RunStatus

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Control a meshrl coordinator.")
COORDINATOR = typer.Option(os.environ.get("MESHRL_COORDINATOR", "127.0.0.1:7070"), "--coordinator", "-c",
                           help="host:port of the coordinator (env MESHRL_COORDINATOR)")
FINAL_STATES = ("finished", "stopped", "failed", "interrupted")
VALIDATION_KEY = re.compile(r"^val-(core|aux)/(?P<source>.+)/(?P<variable>reward|acc)/(?P<metric>[^/]+(/[^/]+)?)$")


def default_config() -> dict:
    text = importlib.resources.files("services.coordctl").joinpath("defaults/local.yaml").read_text()
    import yaml

    return yaml.safe_load(text)


def merge(base: dict, top: dict) -> dict:
    """``top`` laid over ``base``, section by section."""
    merged = dict(base)
    for key, value in top.items():
        merged[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return merged


def resolve_config(args: list[str], local: bool) -> tuple[RunConfig, LocalConfig | None]:
    """The run config from an optional YAML file and key=value overrides, and (with ``local``) the ``local``
    section; ConfigError naming the field if bad.

    With ``local``, the file and overrides are laid over the embedded default, and their ``local`` section
    (what to build, how to start the services) is taken off before the rest is validated as the run config."""
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if len(files) > 1:
        raise typer.BadParameter(f"one config file at most, got {files}")
    if not files and not local:
        raise typer.BadParameter("give a run config file, or --local for the embedded default")
    data = read_yaml(files[0]) if files else {}
    if local:  # a file given with --local is laid over the embedded default
        data = merge(default_config(), data)
    data = apply_overrides(data, overrides)
    local_section = data.pop("local", None)
    if local_section is not None and not local:
        raise ConfigError("local: only `coordctl start-run --local` reads this section (what it builds)")
    config = validate(RunConfig, data)
    local_config = validate(LocalConfig, local_section or {}, "local") if local else None
    if local_config is not None:
        from services.coordctl.local import cache_dir, prepare_assets

        assets = prepare_assets(config, local_config, cache_dir())
        config = validate(RunConfig, apply_overrides(config.model_dump(mode="json"), assets))
    config.require_paths()
    return config, local_config


async def follow(client: CoordinatorClient, run: RunStatus) -> RunStatus:
    """Show the run's progress (step, reward, step time) until it ends; return its final status."""
    with tqdm(total=run.total_steps, desc=run.run_id, unit="step", dynamic_ncols=True) as bar:
        async for update in client.watch(run.run_id):
            if update.kind == "step":
                bar.update(update.step - bar.n)
                bar.set_postfix(reward=f"{update.metrics.get('critic/score/mean', float('nan')):.3f}",
                                step_s=f"{update.metrics.get('timing_s/step', float('nan')):.2f}")
            elif update.kind in ("log", "reward", "validation"):
                bar.write(update.message)
            elif update.kind == "state":
                bar.write(f"run {update.state}" + (f": {update.message}" if update.message else ""))
    return await client.get_run(run.run_id)


def print_summary(client_status: RunStatus, lines: list[dict], seconds: float, state_dir: Path | None) -> None:
    """What the run did, from its metrics.jsonl ``lines``: reward over the steps, validation before and after."""
    typer.echo("")
    typer.echo(f"run        {client_status.run_id}  ({client_status.state}, {client_status.step}/"
               f"{client_status.total_steps} steps in {seconds:.0f} s)")
    rewards = [line["critic/score/mean"] for line in lines if "critic/score/mean" in line]
    if rewards:
        head, tail = rewards[: min(5, len(rewards))], rewards[-min(5, len(rewards)):]
        typer.echo(f"reward     first steps {sum(head) / len(head):.3f} -> last steps {sum(tail) / len(tail):.3f}"
                   f" (best step {max(rewards):.3f})")
    validations = [line for line in lines if "val/weight_version" in line]
    if validations:
        first, last = validations[0], validations[-1]
        for key in sorted(k for k in last if k.startswith("val-core/") and "/mean@" in k):
            name = key.removeprefix("val-core/")
            before = f"{first[key]:.3f} at step {first['step']} -> " if len(validations) > 1 and key in first else ""
            best = max((line for line in validations if key in line), key=lambda line: line[key])
            typer.echo(f"validation {name}: {before}{last[key]:.3f} at step {last['step']} "
                       f"(best {best[key]:.3f} at step {best['step']}; held-out)")
    run_dir = Path(client_status.run_dir)
    typer.echo(f"run folder {run_dir}")
    typer.echo(f"  metrics  {run_dir / 'metrics.jsonl'}")
    typer.echo(f"  config   {run_dir / 'config.yaml'}")
    typer.echo(f"  plot     {run_dir / 'reward.png'}")
    if validations:
        typer.echo(f"  samples  {run_dir / 'validation'} (every validation's responses and scores)")
    if state_dir is not None:
        typer.echo(f"  run DB   {state_dir / 'meshrl.db'}")
        typer.echo(f"  logs     {state_dir / 'logs'}")
    if client_status.error:
        typer.echo(f"error      {client_status.error}")


def read_metrics(run_dir: str) -> list[dict]:
    """The lines of a run's metrics.jsonl (none when the file is not here: a coordinator on another host)."""
    import json

    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


async def begin_and_follow(coordinator: str, begin, detach: bool, stop_on_interrupt: bool) -> RunStatus:
    """Start (or resume) a run with ``begin(client)`` and follow it. Ctrl-C (or SIGTERM): with
    ``stop_on_interrupt`` the run is stopped at its next step boundary (a second Ctrl-C stops following at
    once); otherwise coordctl just detaches."""
    client = CoordinatorClient(coordinator)
    try:
        run = await begin(client)
        typer.echo(f"run {run.run_id} {run.state}, from step {run.step}")
        if detach:
            return run
        watching = asyncio.ensure_future(follow(client, run))
        if not await until_done_or_interrupted(watching):
            if not stop_on_interrupt:
                watching.cancel()
                typer.echo(f"\ndetached; the run goes on (coordctl stop {run.run_id} stops it)")
                return await client.get_run(run.run_id)
            typer.echo("\nstopping the run at its next step boundary (Ctrl-C again to stop now)")
            await client.stop_run(run.run_id)
            if not await until_done_or_interrupted(watching):
                watching.cancel()
        return await client.get_run(run.run_id)
    finally:
        await client.close()


async def until_done_or_interrupted(task: asyncio.Future) -> bool:
    """Wait for ``task``; False if SIGINT or SIGTERM came first."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupted.set)
    waiter = asyncio.ensure_future(interrupted.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        return task.done()
    finally:
        waiter.cancel()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


async def run_local(begin, state_dir: Path, services: tuple) -> RunStatus:
    """Start the coordinator and ``services`` (ServiceSpecs) on ``state_dir``, begin the run there and follow it;
    stop them all after."""
    from services.coordctl.local import LocalCluster

    cluster = LocalCluster(state_dir, services)
    try:
        typer.echo(f"starting the local services (logs in {cluster.log_dir})")
        await cluster.start()
        typer.echo(f"coordinator at {cluster.coordinator}: more services can join it, e.g. "
                   f"python -m services.reward --coordinator {cluster.coordinator} group=b")
        return await begin_and_follow(cluster.coordinator, begin, detach=False, stop_on_interrupt=True)
    finally:
        cluster.stop()


@app.command("start-run")
def start_run(
    args: Optional[list[str]] = typer.Argument(None, help="[CONFIG.yaml] [key.path=value ...]"),
    local: bool = typer.Option(False, "--local", help="start every service on this machine and run there"),
    coordinator: str = COORDINATOR,
    detach: bool = typer.Option(False, "--detach", help="return once the run has started"),
    state_dir: Optional[Path] = typer.Option(None, help="--local: folder for the run DB, runs and logs"),
) -> None:
    """Start a run and follow it to the end. With --local: on this machine, from the embedded default
    (a CONFIG.yaml given too is laid over it)."""
    started = time.monotonic()
    try:
        config, local_config = resolve_config(list(args or []), local)
    except (ConfigError, ValueError) as error:
        typer.echo(f"bad config: {error}", err=True)
        raise typer.Exit(2)
    if local:
        state_dir = state_dir or Path("meshrl-runs") / time.strftime("local-%Y%m%d-%H%M%S")
    drive(lambda client: client.start_run(to_yaml(config)), coordinator, local_config, state_dir, detach, started)


def require_valid_security_settings() -> None:
    """Exit, naming the variable and file, if the token or mTLS settings are broken (before connecting)."""
    try:
        cluster_token()
        cluster_tls()
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)


def follow_run(begin, coordinator: str, local: tuple | None, state_dir: Path | None, detach: bool) -> RunStatus:
    """Begin a run (start or resume) on the services of ``local`` (ServiceSpecs, started on this machine) or
    on the coordinator's, and follow it; its final status (its first, with ``detach``)."""
    require_valid_security_settings()
    try:
        if local is not None:
            return asyncio.run(run_local(begin, state_dir.resolve(), local))
        return asyncio.run(begin_and_follow(coordinator, begin, detach, stop_on_interrupt=False))
    except grpc.aio.AioRpcError as error:
        typer.echo(f"coordinator refused: {error.code().name}: {error.details()}", err=True)
        raise typer.Exit(1)


def drive(begin, coordinator: str, local: LocalConfig | None, state_dir: Path | None, detach: bool,
          started: float) -> None:
    """Begin a run (start or resume) locally (the services ``local`` says) or on the coordinator, follow it,
    summarise; exit 1 unless it finished."""
    from services.coordctl.local import service_specs

    final = follow_run(begin, coordinator, service_specs(local) if local else None, state_dir, detach)
    if detach:
        return
    print_summary(final, read_metrics(final.run_dir), time.monotonic() - started,
                  state_dir if local is not None else None)
    if final.state != "finished":
        raise typer.Exit(1)


def call(coordinator: str, method: str, *args):
    async def go():
        client = CoordinatorClient(coordinator)
        try:
            return await getattr(client, method)(*args)
        finally:
            await client.close()

    require_valid_security_settings()
    try:
        return asyncio.run(go())
    except grpc.aio.AioRpcError as error:
        typer.echo(f"{error.code().name}: {error.details()}", err=True)
        raise typer.Exit(1)


@app.command("resume")
def resume(
    run_id: str,
    coordinator: str = COORDINATOR,
    local: bool = typer.Option(False, "--local", help="restart the local services on --state-dir and resume there"),
    state_dir: Optional[Path] = typer.Option(None, help="--local: the folder the run was started with"),
    detach: bool = typer.Option(False, "--detach", help="return once the run has resumed"),
) -> None:
    """Continue a stopped, failed or interrupted run from its last complete checkpoint."""
    if local and (state_dir is None or not (state_dir / "meshrl.db").exists()):
        raise typer.BadParameter("--local resume needs --state-dir, the folder holding the run's meshrl.db")
    drive(lambda client: client.resume_run(run_id), coordinator, LocalConfig() if local else None, state_dir, detach,
          time.monotonic())


@app.command("runs")
def list_runs(coordinator: str = COORDINATOR) -> None:
    """List the coordinator's runs."""
    for run in call(coordinator, "list_runs"):
        reward = run.metrics.get("critic/score/mean")
        typer.echo(f"{run.run_id}  {run.state:<11} step {run.step}/{run.total_steps}"
                   + (f"  reward {reward:.3f}" if reward is not None else ""))


@app.command("status")
def status(run_id: str, coordinator: str = COORDINATOR) -> None:
    """One run's state and last metrics."""
    run = call(coordinator, "get_run", run_id)
    typer.echo(f"{run.run_id}  {run.state}  step {run.step}/{run.total_steps}  {run.run_dir}")
    if run.error:
        typer.echo(f"error: {run.error}")
    for key in sorted(run.metrics):
        typer.echo(f"  {key:<40} {run.metrics[key]:.6g}")


@app.command("watch")
def watch(run_id: str, coordinator: str = COORDINATOR) -> None:
    """Follow a run's progress until it ends."""

    async def go():
        client = CoordinatorClient(coordinator)
        try:
            return await follow(client, await client.get_run(run_id))
        finally:
            await client.close()

    require_valid_security_settings()
    typer.echo(asyncio.run(go()).state)


@app.command("stop")
def stop(run_id: str, coordinator: str = COORDINATOR) -> None:
    """Stop a run at its next step boundary."""
    typer.echo(call(coordinator, "stop_run", run_id).state)


@app.command("export")
def export_model(
    run: str = typer.Argument(..., metavar="RUN", help="a run folder, or a run id (under --state-dir/runs, or asked "
                                                       "of the coordinator)"),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="the Hugging Face folder to write (new or empty)"),
    step: Optional[int] = typer.Option(None, "--step", help="the checkpoint's step (default: the last)"),
    role: str = typer.Option("actor", "--role", help="actor (a causal LM) or critic (a value model)"),
    state_dir: Optional[Path] = typer.Option(None, help="the coordinator's state_dir, to find RUN by id here"),
    coordinator: str = COORDINATOR,
) -> None:
    """Write a checkpoint of a run as a Hugging Face model folder (config, safetensors, tokenizer, generation
    config) that transformers and vLLM load and a new run can start from; FSDP shards of any number of ranks
    are merged."""
    from services.coordctl.export import export

    run_dir = find_run_dir(run, state_dir, coordinator)
    try:
        exported_step, folder = export(run_dir, out_dir, step, role)
    except (ValueError, FileNotFoundError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)
    typer.echo(f"exported the {role} of step {exported_step} of {run_dir.name} to {folder}")


def find_run_dir(run: str, state_dir: Path | None, coordinator: str) -> Path:
    """The folder of a run named by its folder, or its id under ``state_dir``, or its id on the coordinator."""
    if (Path(run) / "config.yaml").exists():
        return Path(run)
    if state_dir is not None:
        folder = state_dir / "runs" / run
        if not (folder / "config.yaml").exists():
            typer.echo(f"error: no run {run} under {state_dir / 'runs'}", err=True)
            raise typer.Exit(2)
        return folder
    folder = Path(call(coordinator, "get_run", run).run_dir)
    if not (folder / "config.yaml").exists():
        typer.echo(f"error: run {run}'s folder {folder} is not readable here: run coordctl on a host that sees "
                   "it, or give the folder itself", err=True)
        raise typer.Exit(2)
    return folder


@app.command("eval")
def evaluate(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR", help="a Hugging Face model folder"),
    data: list[Path] = typer.Option(..., "--data", help="parquet or JSONL in verl's schema; repeat for several"),
    n: int = typer.Option(1, "--n", min=1, help="responses per prompt: mean@n, best@k, maj@k and pass@k"),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0,
                                                help="default: greedy for --n 1, 1.0 otherwise"),
    max_response_length: int = typer.Option(512, "--max-response-length", min=1),
    out: Optional[Path] = typer.Option(None, "--out", help="the per-response JSONL to write (default: "
                                                           "<MODEL_DIR name>-eval.jsonl here)"),
    overrides: Optional[list[str]] = typer.Argument(None, help="more run config: key.path=value ... (and, with "
                                                               "--local, local.services.rollout=[...])"),
    local: bool = typer.Option(False, "--local", help="start a rollout and a reward service on this machine"),
    coordinator: str = COORDINATOR,
    state_dir: Optional[Path] = typer.Option(None, help="--local: folder for the run DB and logs"),
) -> None:
    """Score a model folder on a dataset through the rollout and reward services (a run that only validates):
    print mean@n and pass@k per data source, write every response with its score."""
    from services.coordctl.local import ServiceSpec

    sampled = temperature if temperature is not None else (1.0 if n > 1 else 0.0)
    try:
        data = apply_overrides({
            "data": {"val_files": [str(path.resolve()) for path in data], "max_response_length": max_response_length},
            "actor_rollout_ref": {"model": {"path": str(model_dir.resolve())}, "rollout": {"val_kwargs": {
                "n": n, "do_sample": sampled > 0, "temperature": sampled}}},
            "trainer": {"val_only": True, "experiment_name": f"eval-{model_dir.resolve().name}"}},
            list(overrides or []))
        services = validate(LocalConfig, data.pop("local", {}), "local").services
        config = validate(RunConfig, data)
        config.require_paths()
    except (ConfigError, ValueError) as error:
        typer.echo(f"bad config: {error}", err=True)
        raise typer.Exit(2)
    if local:
        state_dir = state_dir or Path("meshrl-runs") / time.strftime("eval-%Y%m%d-%H%M%S")
    specs = tuple(ServiceSpec(kind, settings=tuple(services.get(kind, ()))) for kind in ("rollout", "reward"))
    final = follow_run(lambda client: client.start_run(to_yaml(config)), coordinator, specs if local else None,
                       state_dir, False)
    if final.state != "finished":
        typer.echo(f"eval {final.state}: {final.error}", err=True)
        raise typer.Exit(1)
    print_eval(final.metrics)
    samples = Path(final.run_dir) / "validation" / "step_000000.jsonl"
    if samples.exists():
        out = out or Path(f"{model_dir.resolve().name}-eval.jsonl")
        out.write_text(samples.read_text())
        typer.echo(f"responses  {out} (prompt, response, score, acc, pred of each)")
    else:
        typer.echo(f"responses  {samples} on the coordinator's host")


def print_eval(metrics: dict[str, float]) -> None:
    """Per data source: each variable's mean@n, and pass@k where the scorer judges answers."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        named = VALIDATION_KEY.match(key)  # a data source's name may hold "/" (openai/gsm8k)
        if named and named["metric"].startswith(("mean@", "pass@")):
            rows.setdefault(named["source"], {})[f"{named['variable']}/{named['metric']}"] = value
    typer.echo("")
    for source, values in sorted(rows.items()):
        typer.echo(f"{source}: " + "  ".join(f"{name} {value:.3f}" for name, value in sorted(
            values.items(), key=lambda item: (item[0].split("/")[0], item[0].split("@")[0], int(item[0].split("@")[1])))))


reward_app = typer.Typer(no_args_is_help=True, help="The reward services of a running run.")
app.add_typer(reward_app, name="reward")


@reward_app.command("set")
def reward_set(
    run_id: str,
    group: str = typer.Option("", "--group", help="switch to every reward service up in this group"),
    address: str = typer.Option("", "--address", help="switch to the reward service at host:port"),
    coordinator: str = COORDINATOR,
) -> None:
    """Switch a running run to other reward services at its next step boundary (after a probe batch)."""
    if bool(group) == bool(address):
        raise typer.BadParameter("give exactly one of --group or --address")
    run = call(coordinator, "set_reward", run_id, group, address)
    typer.echo(f"run {run.run_id}: reward swap accepted; it applies at the next step boundary")


@app.command("services")
def services(coordinator: str = COORDINATOR) -> None:
    """The coordinator's service registry."""
    for entry in call(coordinator, "list_services"):
        typer.echo(f"{entry.kind:<8} {entry.address:<22} {entry.group:<10} {entry.state:<5} "
                   f"seen {entry.last_seen_s:.1f} s ago  {entry.service_id}")


@app.command("data")
def data_convert(
    fmt: str = typer.Argument(..., metavar="FORMAT", help="gsm8k | math"),
    input_path: Path = typer.Argument(..., metavar="INPUT",
                                      help="raw JSONL: {question, answer} (gsm8k) or {problem, solution} (math)"),
    output: Path = typer.Argument(..., metavar="OUTPUT", help="the .parquet file to write"),
    split: str = typer.Option("train", help="extra_info.split of every row"),
    data_source: Optional[str] = typer.Option(None, help="default: openai/gsm8k (gsm8k), lighteval/MATH (math)"),
    instruction: Optional[str] = typer.Option(None, help="appended to each question; default: the format's, "
                                                         "as in verl's preprocessing"),
) -> None:
    """Convert GSM8K / MATH JSONL into verl-schema parquet (prompt, reward_model.ground_truth, extra_info)."""
    from services.coordctl.convert import Format, convert_file, write_parquet

    try:
        if fmt not in Format.__members__:
            raise ValueError(f"FORMAT must be one of {list(Format.__members__)}, got {fmt!r}")
        rows = convert_file(input_path, Format(fmt), split, data_source, instruction)
        write_parquet(rows, Format(fmt), output)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {len(rows)} rows to {output}")


@app.command("certs")
def certs(
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="where to write them; nothing there is overwritten"),
    hosts: list[str] = typer.Option(..., "--host", metavar="NAME[,ALIAS...]",
                                    help="one host: its name (as `hostname` prints it, the file name) and any other "
                                         "DNS names or IPs peers dial it by; repeat per host"),
    days: int = typer.Option(365, min=1, help="validity of the CA and the host certificates"),
) -> None:
    """Make a CA and one certificate and key per host for mTLS (keys mode 0600; localhost and 127.0.0.1 are
    always named)."""
    from services.coordctl.certs import HostNames, write_cluster_certs

    try:
        written = write_cluster_certs(out_dir, [HostNames.parse(spec) for spec in hosts], days)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)
    for path in written:
        typer.echo(f"wrote {path}")
    typer.echo(f"give every process on host H (services and coordctl): MESHRL_TLS_CERT={out_dir}/H.pem "
               f"MESHRL_TLS_KEY={out_dir}/H-key.pem MESHRL_TLS_CA={out_dir}/ca.pem")


if __name__ == "__main__":
    app()
