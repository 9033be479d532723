"""coordctl: start, watch and stop runs; list services; export and evaluate models.

    coordctl start-run --local                       # the embedded default, all on this machine
    coordctl start-run run.yaml data.train_batch_size=64 --coordinator host:7070
    coordctl start-run actor_rollout_ref.model.path=M data.train_files=F ...   # verl's main_ppo overrides as typed
    coordctl start-run --local --dry-run             # the resolved config and what would start
    coordctl init FOLDER                             # a run config, model, data and token to start services by hand
    coordctl runs | status RUN | watch RUN | stop RUN | resume RUN | services
    coordctl samples RUN --step N                    # a step's responses, scores, weight versions, services
    coordctl plot RUN [METRIC ...]                   # PNGs of the run's metrics
    coordctl export RUN OUT_DIR | eval MODEL_DIR --data FILE
    coordctl certs OUT_DIR --host node1 --host node2,10.0.0.2   # a CA and certificates for mTLS
    coordctl checkpoint trust PATH                   # sign a checkpoint saved before meshrl signed them
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Optional

import grpc
import typer

from services.common.about import meshrl_version
from services.common.auth import cluster_tls, cluster_token, write_token
from services.common.config import ConfigError, apply_overrides, to_yaml, validate
from services.run.checks import check_loggers_installed
from services.run.config import RunConfig
from services.coordctl.config import LocalConfig
from services.coordctl.control import CoordinatorClient, RunStatus
from services.coordctl.follow import begin_and_follow, print_eval, print_summary, read_metrics, run_local
from services.coordctl.resolve import (checked, hydra_config_file, local_services, plan, readable_here,
                                      resolve_config, start_notices, unsandboxed_here)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Control a meshrl coordinator.")
DEFAULT_COORDINATOR = "127.0.0.1:7070"
COORDINATOR = typer.Option(DEFAULT_COORDINATOR, "--coordinator", "-c", envvar="MESHRL_COORDINATOR",
                           help="host:port of the coordinator (env MESHRL_COORDINATOR)")
FINAL_STATES = ("finished", "stopped", "failed", "interrupted")
LOCAL_STATE_DIRS = Path("meshrl-runs")  # where --local runs and evals keep their state_dirs unless told otherwise


def show_version(asked: bool) -> None:
    if asked:
        typer.echo(f"meshrl {meshrl_version() or '(not installed: run from a checkout)'}")
        raise typer.Exit()


@app.callback()
def main(_: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                help="print the version and exit")) -> None:
    """Control a meshrl coordinator."""


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(message, err=True)
    return typer.Exit(code)


def require_valid_security_settings() -> None:
    """Exit, naming the variable and file, if the token or mTLS settings are broken (before connecting)."""
    try:
        cluster_token()
        cluster_tls()
    except ValueError as error:
        raise fail(f"error: {error}")


def refused(error: grpc.aio.AioRpcError, coordinator: str | None) -> str:
    """A failed call to the coordinator at ``coordinator`` (None: the one this command started, --local), in
    words, with what to do where there is something to do."""
    code = error.code()
    if coordinator is None:
        return f"the local coordinator refused: {code.name}: {error.details()}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return (f"no coordinator answers at {coordinator} ({code.name}): start one (python -m services.coordinator), "
                "or point coordctl at it with --coordinator HOST:PORT or MESHRL_COORDINATOR")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return (f"the coordinator at {coordinator} refused coordctl ({code.name}: {error.details()}): give coordctl "
                "the cluster's token with MESHRL_TOKEN or MESHRL_TOKEN_FILE")
    return f"the coordinator at {coordinator} refused: {code.name}: {error.details()}"


def with_client(coordinator: str, work, on_interrupt: str = ""):
    """``await work(client)`` with a client of the coordinator; exits with the reason if a call fails, and on
    Ctrl-C with ``on_interrupt`` (when given)."""
    async def go():
        client = CoordinatorClient(coordinator)
        try:
            return await work(client)
        finally:
            await client.close()

    require_valid_security_settings()
    try:
        return asyncio.run(go())
    except grpc.aio.AioRpcError as error:
        raise fail(refused(error, coordinator), 1)
    except KeyboardInterrupt:
        if not on_interrupt:
            raise
        raise fail(f"\n{on_interrupt}", 130)


def call(coordinator: str, method: str, *args):
    """One call to the coordinator; exits with the reason if it fails."""
    return with_client(coordinator, lambda client: getattr(client, method)(*args))


def print_final(run: RunStatus) -> None:
    typer.echo(f"run {run.run_id} {run.state} at step {run.step}/{run.total_steps}" + (f": {run.error}" if run.error
                                                                                      else ""))


def follow_run(begin, coordinator: str, services: tuple | None, state_dir: Path | None, detach: bool,
               said: Collection[str] = ()) -> RunStatus:
    """Begin a run (start or resume) on ``services`` (ServiceSpecs, started on this machine) or on the
    coordinator's, and follow it, not showing again the notes in ``said``; its final status (its first, with
    ``detach``)."""
    require_valid_security_settings()
    try:
        if services is not None:
            return asyncio.run(run_local(begin, state_dir.resolve(), services, said=said))  # type: ignore[union-attr]  # --local sets both
        return asyncio.run(begin_and_follow(coordinator, begin, detach, stop_on_interrupt=False, said=said))
    except grpc.aio.AioRpcError as error:
        raise fail(refused(error, None if services is not None else coordinator), 1)


def drive(begin, coordinator: str, services: tuple | None, state_dir: Path | None, detach: bool,
          started: float, said: Collection[str] = ()) -> None:
    """Begin a run locally or on the coordinator, follow it (``said``: the notes printed already), summarise;
    exit 1 unless it finished."""
    final = follow_run(begin, coordinator, services, state_dir, detach, said)
    if detach:
        return
    print_summary(final, read_metrics(final.run_dir), time.monotonic() - started,
                  state_dir=state_dir if services is not None else None)
    if final.state != "finished":
        raise typer.Exit(1)


def refuse_local_with(context: typer.Context, detach: bool) -> None:
    """--local starts its own services and stops them when coordctl ends: --coordinator and --detach do not fit."""
    source = context.get_parameter_source("coordinator")
    if source is not None and source.name == "COMMANDLINE":
        raise fail("--local starts its own coordinator on this machine: leave out --coordinator, or leave out "
                   "--local to run on the coordinator named")
    if detach:
        raise fail("--detach does not go with --local: the local services stop when coordctl does")


@app.command("start-run")
def start_run(
    context: typer.Context,
    args: Optional[list[str]] = typer.Argument(None, help="[CONFIG.yaml] [key.path=value | +key=value | ~key ...]"),
    local: bool = typer.Option(False, "--local", help="start every service on this machine and run there"),
    coordinator: str = COORDINATOR,
    detach: bool = typer.Option(False, "--detach", help="return once the run has started"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and what would start; start "
                                                          "nothing"),
    state_dir: Optional[Path] = typer.Option(None, help="--local: folder for the run DB, runs and logs"),
    config_path: Optional[str] = typer.Option(None, "--config-path", "-cp",
                                              help="Hydra's (verl's): the folder of --config-name (default: here)"),
    config_name: Optional[str] = typer.Option(None, "--config-name", "-cn",
                                              help="Hydra's (verl's): the run config file NAME[.yaml] in "
                                                   "--config-path, as CONFIG.yaml"),
) -> None:
    """Start a run and follow it to the end (Ctrl-C stops it at a step boundary). The overrides apply to
    CONFIG.yaml, or with none to meshrl's defaults (as verl's main_ppo applies them to its own). With --local: on
    this machine, from the embedded default (a CONFIG.yaml given too is laid over it). The config, the model
    folder and the data are checked before anything starts."""
    started = time.monotonic()
    if local:
        refuse_local_with(context, detach)
    try:
        config_file = hydra_config_file(config_path, config_name)
        config, local_config = resolve_config(list(args or []), local, config_file)
        data = None
        if local or readable_here(config):
            config, data = checked(config)
        if local:  # the coordinator will run here, with this Python
            check_loggers_installed(config.trainer.logger)
        services = local_services(local_config, config) if local_config is not None else None
        notices = start_notices(config, services)
    except (ConfigError, ValueError) as error:
        raise fail(f"bad config: {error}")
    if dry_run:
        typer.echo(plan(config, data, services, coordinator=coordinator, notices=notices))
        return
    for notice in notices:
        typer.echo(f"note: {notice}")
    if any("sandbox=false" in spec.settings for spec in services or ()):
        typer.echo(f"note: the env service runs your tools unsandboxed, as you: this machine cannot sandbox them "
                   f"({unsandboxed_here()})")
    if local:
        state_dir = state_dir or LOCAL_STATE_DIRS / time.strftime("local-%Y%m%d-%H%M%S")
    drive(lambda client: client.start_run(to_yaml(config)), coordinator, services, state_dir, detach, started,
          said=notices)


@app.command("init")
def init(
    folder: Path = typer.Argument(..., metavar="FOLDER", help="where to write them (new or empty)"),
    coordinator_host: str = typer.Option("coord-host", "--coordinator-host",
                                         help="the host name or address other machines reach the coordinator by"),
    port: int = typer.Option(7070, "--port", help="the coordinator's port"),
) -> None:
    """Write what starting the services by hand needs: a ready run config (run.yaml), the tiny model and the
    synthetic data it trains on, and a cluster token (mode 0600); then print the commands."""
    from services.coordctl.local import task_files
    from services.coordctl.resolve import default_config
    from services.coordctl.tiny_model import build_tiny_model

    if folder.exists() and any(folder.iterdir()):
        raise fail(f"{folder} is not empty: give a new folder")
    folder = folder.resolve()
    defaults = default_config()
    local = validate(LocalConfig, defaults.pop("local"), "local")
    tiny = local.tiny_model
    model = build_tiny_model(folder / "model", tiny.hidden_size, tiny.num_layers, num_heads=tiny.num_heads,
                             seed=tiny.seed,
                             num_experts=tiny.num_experts, experts_per_token=tiny.experts_per_token)
    train, test = task_files(local, folder)
    config = validate(RunConfig, apply_overrides(defaults, [
        f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{test}]"]))
    (folder / "run.yaml").write_text(to_yaml(config))
    token = write_token(folder / "token")
    coordinator = f"{coordinator_host}:{port}"
    typer.echo(f"""wrote {folder / 'run.yaml'}, {model}, {train.parent}, {token}

Copy {token} to every host (keep it private), then on every host:
    export MESHRL_TOKEN_FILE={token}
on the coordinator's host ({coordinator_host}):
    python -m services.coordinator host=0.0.0.0 port={port} state_dir={folder / 'state'}
on each host that trains, generates or scores (host=0.0.0.0: reachable by the others; each registers its
host name with the coordinator):
    python -m services.trainer --coordinator {coordinator} host=0.0.0.0 checkpoint_root={folder / 'state'}
    python -m services.rollout --coordinator {coordinator} host=0.0.0.0
    python -m services.reward --coordinator {coordinator} host=0.0.0.0
then, from any host with the token (the run config's paths must be readable on the trainer's and rollout's
hosts: a shared folder, or the same path on each):
    coordctl start-run {folder / 'run.yaml'} --coordinator {coordinator}""")


@app.command("resume")
def resume(
    context: typer.Context,
    run_id: str,
    coordinator: str = COORDINATOR,
    local: bool = typer.Option(False, "--local", help="restart the local services on --state-dir and resume there"),
    state_dir: Optional[Path] = typer.Option(None, help="--local: the folder the run was started with"),
    detach: bool = typer.Option(False, "--detach", help="return once the run has resumed"),
) -> None:
    """Continue a stopped, failed or interrupted run from its last complete checkpoint."""
    services = None
    if local:
        from services.coordctl.local import saved_services

        refuse_local_with(context, detach)
        if state_dir is None or not (state_dir / "meshrl.db").exists():
            raise fail("--local resume needs --state-dir, the folder holding the run's meshrl.db")
        try:  # the services the run was started with (a state_dir from before they were kept: the default ones)
            services = saved_services(state_dir) or local_services(LocalConfig(), RunConfig())
        except ValueError as error:
            raise fail(f"error: {error}")
    drive(lambda client: client.resume_run(run_id), coordinator, services, state_dir, detach, time.monotonic())


@app.command("runs")
def list_runs(coordinator: str = COORDINATOR) -> None:
    """List the coordinator's runs."""
    runs = call(coordinator, "list_runs")
    if not runs:
        typer.echo(f"no runs on the coordinator at {coordinator}")
        return
    typer.echo(f"{'RUN':<44} {'STATE':<11} {'STEP':>11}  REWARD")
    for run in runs:
        reward = run.metrics.get("critic/score/mean")
        typer.echo(f"{run.run_id:<44} {run.state:<11} {f'{run.step}/{run.total_steps}':>11}  "
                   + (f"{reward:.3f}" if reward is not None else "-"))


@app.command("status")
def status(run_id: str, coordinator: str = COORDINATOR) -> None:
    """One run's state (and what it waits for, or why it failed) and last metrics."""
    run = call(coordinator, "get_run", run_id)
    typer.echo(f"{run.run_id}  {run.state}  step {run.step}/{run.total_steps}  {run.run_dir}")
    if run.error:
        typer.echo(f"{'waiting for' if run.state == 'waiting' else 'error'}: {run.error}")
    for key in sorted(run.metrics):
        typer.echo(f"  {key:<40} {run.metrics[key]:.6g}")


@app.command("watch")
def watch(run_id: str, coordinator: str = COORDINATOR) -> None:
    """Follow a run until it ends (Ctrl-C stops watching; the run goes on). In a terminal: a table of its last
    steps (reward, validation, the step's time by stage, tokens/s, staleness), the services up and its last
    events, redrawn in place; piped: one line per event."""
    from services.coordctl.live import watch_run

    async def follow_it(client: CoordinatorClient) -> RunStatus:
        await watch_run(client, run_id, sys.stdout, live=sys.stdout.isatty())
        return await client.get_run(run_id)

    try:
        print_final(with_client(coordinator, follow_it,
                                f"stopped watching; the run goes on (coordctl stop {run_id} stops it)"))
    except BrokenPipeError:  # `coordctl watch RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@app.command("stop")
def stop(run_id: str, coordinator: str = COORDINATOR) -> None:
    """Stop a run at its next step boundary, where it saves a checkpoint; wait for it and print how it ended."""
    async def stop_it(client: CoordinatorClient) -> RunStatus:
        run = await client.stop_run(run_id)
        if run.state not in FINAL_STATES:
            typer.echo(f"run {run_id} stops at its next step boundary (now at step {run.step}); waiting "
                       "(Ctrl-C stops waiting, not the stop)")
            async for _ in client.watch(run_id, run.last_event_id):
                pass
        return await client.get_run(run_id)

    print_final(with_client(coordinator, stop_it, f"stopped waiting; run {run_id} still stops at its next step "
                                                  "boundary"))


@app.command("export")
def export_model(
    run: str = typer.Argument(..., metavar="RUN", help="a run folder, or a run id (under --state-dir/runs, or asked "
                                                       "of the coordinator)"),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="the Hugging Face folder to write (new or empty)"),
    step: Optional[int] = typer.Option(None, "--step", help="the checkpoint's step (default: the last)"),
    role: str = typer.Option("actor", "--role", help="actor (a causal LM) or critic (a value model)"),
    adapter: bool = typer.Option(False, "--adapter", help="a LoRA run: write its adapter alone as a PEFT adapter "
                                                          "folder (default: merged into the base model)"),
    state_dir: Optional[Path] = typer.Option(None, help="the coordinator's state_dir, to find RUN by id here"),
    coordinator: str = COORDINATOR,
) -> None:
    """Write a checkpoint of a run as a Hugging Face model folder (config, safetensors, tokenizer, generation
    config) that transformers and vLLM load and a new run can start from; FSDP shards of any number of ranks
    are merged, and a LoRA run's adapters merged into its base unless --adapter asks for the adapter folder."""
    from services.coordctl.export import export

    run_dir = find_run_dir(run, state_dir, coordinator)
    try:
        exported_step, folder = export(run_dir, out_dir, step, role=role, adapter=adapter)
    except (ValueError, FileNotFoundError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2)
    typer.echo(f"exported the {role} of step {exported_step} of {run_dir.name} to {folder}")


def find_run_dir(run: str, state_dir: Path | None, coordinator: str) -> Path:
    """The folder of a run named by its folder, or its id under ``state_dir``, or its id under a --local run's
    default state_dir here (``meshrl-runs/*/runs``: the coordinator of a finished --local run is gone), or its id
    on the coordinator."""
    if (Path(run) / "config.yaml").exists():
        return Path(run)
    if state_dir is not None:
        folder = state_dir / "runs" / run
        if not (folder / "config.yaml").exists():
            typer.echo(f"error: no run {run} under {state_dir / 'runs'}", err=True)
            raise typer.Exit(2)
        return folder
    local = sorted(LOCAL_STATE_DIRS.glob(f"*/runs/{glob.escape(run)}/config.yaml")) if "/" not in run else []
    if local:
        return local[-1].parent
    folder = Path(call(coordinator, "get_run", run).run_dir)
    if not (folder / "config.yaml").exists():
        typer.echo(f"error: run {run}'s folder {folder} is not readable here: run coordctl on a host that sees "
                   "it, or give the folder itself", err=True)
        raise typer.Exit(2)
    return folder


@app.command("samples")
def samples(
    run: str = typer.Argument(..., metavar="RUN", help="a run folder, or a run id (under --state-dir/runs, or asked "
                                                       "of the coordinator)"),
    step: Optional[int] = typer.Option(None, "--step", help="the step (default: the last kept)"),
    limit: int = typer.Option(8, "--limit", min=1, help="print at most this many of the step's samples"),
    state_dir: Optional[Path] = typer.Option(None, help="the coordinator's state_dir, to find RUN by id here"),
    coordinator: str = COORDINATOR,
) -> None:
    """Print a step's samples as the run kept them (trainer.rollout_data_dir): each response with its prompt,
    score and its parts, the weight version that sampled it and its staleness, the rollout and the reward
    service that handled it, and its advantage."""
    from services.coordctl.samples import describe, read_samples, kept_samples_dir, steps_kept

    run_dir = find_run_dir(run, state_dir, coordinator)
    folder = kept_samples_dir(run_dir)
    if folder is None:
        raise fail(f"run {run_dir.name} keeps no samples: start it with trainer.rollout_data_dir=FOLDER")
    kept = steps_kept(folder) if folder.is_dir() else []
    if not kept:
        raise fail(f"no step's samples in {folder} yet")
    step = kept[-1] if step is None else step
    if step not in kept:
        raise fail(f"no samples of step {step} in {folder}: it has steps {kept[0]} to {kept[-1]}")
    path = folder / f"{step}.jsonl"
    try:
        records = read_samples(path)
    except ValueError as error:
        raise fail(f"error: {error}")
    width = shutil.get_terminal_size().columns
    typer.echo(f"{path}: {min(limit, len(records))} of {len(records)} samples of step {step}")
    for index, record in enumerate(records[:limit]):
        typer.echo("")
        for line in describe(index, record, width):
            typer.echo(line)


@app.command("plot")
def plot(
    run: str = typer.Argument(..., metavar="RUN", help="a run folder, or a run id (under --state-dir/runs, or asked "
                                                       "of the coordinator)"),
    metrics: Optional[list[str]] = typer.Argument(None, metavar="[METRIC]...",
                                                  help="metric names or patterns (timing_s/*), one PNG each; "
                                                       "default: reward, validation, step times, tokens/s, staleness"),
    out: Optional[Path] = typer.Option(None, "--out", help="the folder for the PNGs (default: the run's plots/)"),
    state_dir: Optional[Path] = typer.Option(None, help="the coordinator's state_dir, to find RUN by id here"),
    coordinator: str = COORDINATOR,
) -> None:
    """Draw metrics of a run over its steps, from its metrics.jsonl: one PNG per METRIC (a pattern draws every
    metric it matches on one)."""
    from services.coordctl.plotting import file_name, plotted, steps_of
    from services.run.plot import plot_metrics

    run_dir = find_run_dir(run, state_dir, coordinator)
    steps = steps_of(read_metrics(str(run_dir)))
    try:
        wanted = plotted(metrics or [], {key for _, values in steps for key in values})
    except ValueError as error:
        raise fail(f"error: {error}")
    if not wanted:
        raise fail(f"run {run_dir.name} has no metrics yet")
    out = out or run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    for name, keys in wanted.items():
        written = plot_metrics(steps, keys, out / file_name(name), title=f"{run_dir.name}: {name}")
        typer.echo(f"wrote {written}  ({', '.join(keys)})")


@app.command("eval")
def evaluate(
    model_dir: Path = typer.Argument(..., metavar="MODEL_DIR", help="a Hugging Face model folder, or a PEFT LoRA "
                                                                     "adapter folder (merged onto its base first)"),
    data: list[Path] = typer.Option(..., "--data", help="parquet or JSONL in verl's schema; repeat for several"),
    n: int = typer.Option(1, "--n", min=1, help="responses per prompt: mean@n, best@k, maj@k and pass@k"),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0,
                                                help="default: greedy for --n 1, 1.0 otherwise"),
    max_response_length: Optional[int] = typer.Option(
        None, "--max-response-length", min=1,
        help="default: the run's, for a folder coordctl export wrote (meshrl_export.json); 512 otherwise"),
    out: Optional[Path] = typer.Option(None, "--out", help="the per-response JSONL to write (default: "
                                                           "<MODEL_DIR name>-eval.jsonl here)"),
    overrides: Optional[list[str]] = typer.Argument(None, help="more run config: key.path=value ... (and, with "
                                                               "--local, local.services.rollout=[...])"),
    local: bool = typer.Option(False, "--local", help="start a rollout and a reward service on this machine (and "
                                                       "an env service to evaluate a multi-turn model)"),
    coordinator: str = COORDINATOR,
    state_dir: Optional[Path] = typer.Option(None, help="--local: folder for the run DB and logs"),
) -> None:
    """Score a model folder on a dataset through the rollout and reward services (a run that only validates):
    print mean@n and pass@k per data source, write every response with its score. A folder that coordctl export
    wrote is scored with its run's prompt and response lengths unless told otherwise. An adapter folder is
    merged onto its base model into <MODEL_DIR name>-merged here, which the rollouts then serve."""
    from services.coordctl.export import exported_settings, merge_adapter
    from services.run.lora import ADAPTER_CONFIG

    if (model_dir / ADAPTER_CONFIG).exists():
        merged = Path(f"{model_dir.resolve().name}-merged")
        try:
            model_dir = merge_adapter(model_dir, merged)
        except ValueError as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(2)
        typer.echo(f"merged the adapter {model_dir} onto its base into {merged}")

    sampled = temperature if temperature is not None else (1.0 if n > 1 else 0.0)
    exported = exported_settings(model_dir)
    data_settings = {"max_response_length": 512, **exported.get("data", {})}
    if max_response_length is not None:
        data_settings["max_response_length"] = max_response_length
    rollout = {**exported.get("actor_rollout_ref", {}).get("rollout", {}),
               "val_kwargs": {"n": n, "do_sample": sampled > 0, "temperature": sampled}}
    try:
        run_data = apply_overrides({
            "data": {"val_files": [str(path.resolve()) for path in data], **data_settings},
            "actor_rollout_ref": {"model": {"path": str(model_dir.resolve())}, "rollout": rollout},
            "trainer": {"val_only": True, "experiment_name": f"eval-{model_dir.resolve().name}"}},
            list(overrides or []))
        local_config = validate(LocalConfig, run_data.pop("local", {}), "local")
        config = validate(RunConfig, run_data)
        config.require_paths()
        specs = tuple(spec for spec in local_services(local_config, config) if spec.kind != "trainer")
    except (ConfigError, ValueError) as error:
        typer.echo(f"bad config: {error}", err=True)
        raise typer.Exit(2)
    if local:
        state_dir = state_dir or LOCAL_STATE_DIRS / time.strftime("eval-%Y%m%d-%H%M%S")
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


env_app = typer.Typer(no_args_is_help=True, help="The env services of a running multi-turn run.")
app.add_typer(env_app, name="env")


@env_app.command("set")
def env_set(
    run_id: str,
    group: str = typer.Option("", "--group", help="switch to every env service up in this group"),
    address: str = typer.Option("", "--address", help="switch to the env service at host:port"),
    coordinator: str = COORDINATOR,
) -> None:
    """Switch a running multi-turn run to other env services at its next step boundary (after each hosts the run's
    environment and opens and closes a probe episode on one of its rows)."""
    if bool(group) == bool(address):
        raise typer.BadParameter("give exactly one of --group or --address")
    run = call(coordinator, "set_env", run_id, group, address)
    typer.echo(f"run {run.run_id}: env swap accepted; it applies at the next step boundary")


checkpoint_app = typer.Typer(no_args_is_help=True, help="A run's checkpoint folders.")
app.add_typer(checkpoint_app, name="checkpoint")


@checkpoint_app.command("trust")
def checkpoint_trust(
    path: Path = typer.Argument(..., metavar="PATH", help="a checkpoint's step_<N> folder, or a trainer's folder in "
                                                          "it"),
    state_dir: Optional[Path] = typer.Option(None, help="the folder the checkpoints are kept under (its "
                                                        "checkpoint.key signs them; default: the nearest above PATH)"),
    run_id: Optional[str] = typer.Option(None, "--run", help="the run it belongs to (default: the <run_id> of the "
                                                             "runs/<run_id>/ folder PATH is in)"),
    yes: bool = typer.Option(False, "--yes", "-y", help="sign without asking"),
) -> None:
    """Sign a checkpoint saved before meshrl wrote manifests, so that a resume and coordctl export accept it:
    its files and sizes are shown, and signed once you confirm. Sign only a folder you know is what the run
    saved: a trainer unpickles what a signed checkpoint holds."""
    from services.common.manifest import checkpoint_key, write_manifest
    from services.coordctl.trust import describe, key_folder, run_of, trainer_folders, unsigned

    try:
        folders = [unsigned(folder) for folder in trainer_folders(path)]
        key, run = key_folder(path, state_dir), run_of(path, run_id)
    except ValueError as error:
        raise fail(f"error: {error}")
    typer.echo(describe(folders, run, key))
    if not yes and not typer.confirm("sign these files as they are now?"):
        raise fail("not signed", code=1)
    for each in folders:
        if unsigned(each.folder) != each:
            raise fail(f"error: {each.folder} changed since it was shown: nothing more signed; look again")
        write_manifest(each.folder, run, checkpoint_key(key))
        typer.echo(f"signed {each.folder}")


@app.command("services")
def services(coordinator: str = COORDINATOR) -> None:
    """Every service registered with the coordinator: its host, kind, group and address, its GPUs, the meshrl
    version it runs, the weight version it holds (trainer) or serves (rollout), and how long ago it was last
    heard from (a service silent for the heartbeat window is down); then the algorithms each registered: the
    coordinator's advantage estimators and each trainer's policy losses ("?" from one too old to say)."""
    from services.coordctl.tables import SERVICE_COLUMNS, algorithm_lines, aligned, service_rows

    entries = call(coordinator, "list_services")
    if not entries:
        typer.echo(f"no service has registered with the coordinator at {coordinator}")
    else:
        for line in aligned(SERVICE_COLUMNS, service_rows(entries), right=("WEIGHTS", "SEEN")):
            typer.echo(line)
        typer.echo("")
    for line in algorithm_lines(coordinator, call(coordinator, "adv_estimators"), entries):
        typer.echo(line)


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
        rows = convert_file(input_path, Format(fmt), split, data_source=data_source, instruction=instruction)
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
