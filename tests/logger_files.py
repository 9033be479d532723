"""A run's experiment loggers read back as their own tools read them: TensorBoard's EventAccumulator, the records
of W&B's offline run file (its own protobuf), MLflow's client."""

from __future__ import annotations

import json
import struct
from pathlib import Path

WANDB_BLOCK = 32768  # the .wandb file is LevelDB's log format: 32 KiB blocks of records, after a 7-byte header
WANDB_FULL, WANDB_FIRST, WANDB_LAST = 1, 2, 4


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the event files under ``folder``: name -> step -> value (steps replaced by a later attempt's
    purge step dropped, as TensorBoard drops them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    scalars: dict[str, dict[int, float]] = {}
    for name in events.Tags()["scalars"]:
        for point in events.Scalars(name):
            assert point.step not in scalars.setdefault(name, {}), f"{name} twice at step {point.step}"
            scalars[name][point.step] = point.value
    return scalars


def wandb_records(path: Path):
    """The Record messages of an offline W&B run file (run-<id>.wandb), in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = 7, b""
    while position + 7 <= len(data):
        if WANDB_BLOCK - position % WANDB_BLOCK < 7:  # a block's tail too short for a header is padding
            position += WANDB_BLOCK - position % WANDB_BLOCK
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        pending = chunk if kind in (WANDB_FULL, WANDB_FIRST) else pending + chunk
        if kind in (WANDB_FULL, WANDB_LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """step -> the metrics W&B holds for it, from the one offline run under ``run_dir``/wandb."""
    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history: dict[int, dict] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(row["_step"], {}).update(row)
    return history
