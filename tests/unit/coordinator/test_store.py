"""CPU tests of services/coordinator/store.py: the run DB."""

from __future__ import annotations

import os
import sqlite3

import pytest

from services.coordinator.store import DamagedRunDB, RunStore


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "state" / "runs.sqlite"  # the folder does not exist yet


def test_create_and_get_run(db_path):
    store = RunStore(db_path)
    store.create_run("r1", "first", "data: {}\n", run_dir="/runs/r1", total_steps=10)
    run = store.get_run("r1")
    assert (run.run_id, run.name, run.state, run.config_yaml, run.run_dir, run.step, run.total_steps, run.error) == (
        "r1", "first", "pending", "data: {}\n", "/runs/r1", 0, 10, "")
    with pytest.raises(LookupError):
        store.get_run("nope")
    store.close()


def test_set_state_emits_an_event(db_path):
    store = RunStore(db_path)
    store.create_run("r1", "first", "", run_dir="/d", total_steps=10)
    store.record_step("r1", 3, {"loss": 0.5})
    event = store.set_state("r1", "failed", "trainer down")
    assert (event.run_id, event.kind, event.step, event.state, event.message, event.metrics) == (
        "r1", "state", 3, "failed", "trainer down", {})
    run = store.get_run("r1")
    assert (run.state, run.error) == ("failed", "trainer down")
    assert store.events_after("r1", 0)[-1] == event
    with pytest.raises(LookupError):
        store.set_state("ghost", "running")
    store.close()


def test_steps_metrics_and_events_in_order(db_path):
    store = RunStore(db_path)
    store.create_run("r1", "first", "", run_dir="/d", total_steps=10)
    store.create_run("r2", "second", "", run_dir="/d", total_steps=10)
    assert store.last_step_metrics("r1") == {} and store.step_metrics("r1") == []
    e1 = store.set_state("r1", "running")
    e2 = store.record_step("r1", 2, {"loss": 2.0})
    store.record_step("r2", 1, {"loss": 9.0})
    e3 = store.record_step("r1", 1, {"loss": 1.0, "score": 0.25})
    e4 = store.add_event("r1", "log", 1, state="", message="hello", metrics={})
    store.record_step("r1", 2, {"loss": 1.5})  # a redone step replaces the old metrics

    assert store.step_metrics("r1") == [(1, {"loss": 1.0, "score": 0.25}), (2, {"loss": 1.5})]
    assert store.last_step_metrics("r1") == {"loss": 1.5}
    assert store.get_run("r1").step == 2
    events = store.events_after("r1", 0)
    assert [e.id for e in events] == sorted(e.id for e in events)
    assert events[:4] == [e1, e2, e3, e4]
    assert [(e.kind, e.step) for e in events] == [("state", 0), ("step", 2), ("step", 1), ("log", 1), ("step", 2)]
    assert store.events_after("r1", e3.id) == events[3:]
    assert store.events_after("r1", events[-1].id) == []
    assert [e.kind for e in store.events_after("r2", 0)] == ["step"]
    store.close()


def test_data_survives_closing_and_reopening(db_path):
    store = RunStore(db_path)
    store.create_run("r1", "first", "cfg", run_dir="/d", total_steps=10)
    store.set_state("r1", "running")
    store.record_step("r1", 1, {"loss": 1.0})
    before = store.events_after("r1", 0)
    store.close()

    store = RunStore(db_path)
    assert store.get_run("r1").state == "running" and store.get_run("r1").step == 1
    assert store.step_metrics("r1") == [(1, {"loss": 1.0})]
    assert store.events_after("r1", 0) == before
    assert store.add_event("r1", "log", 1, state="", message="again", metrics={}).id > before[-1].id  # ids keep growing
    assert [r.run_id for r in store.list_runs()] == ["r1"]
    store.close()


def test_list_runs_in_creation_order(db_path):
    store = RunStore(db_path)
    for run_id in ("b", "a", "c"):
        store.create_run(run_id, run_id, "", run_dir="/d", total_steps=1)
    assert [r.run_id for r in store.list_runs()] == ["b", "a", "c"]
    with pytest.raises(sqlite3.IntegrityError):  # run ids are unique
        store.create_run("a", "again", "", run_dir="/d", total_steps=1)
    store.close()


def test_step_records_carry_the_time_of_each_steps_last_record(db_path):
    store = RunStore(db_path)
    store.create_run("r1", "first", "", run_dir="/d", total_steps=10)
    store.record_step("r1", 1, {"loss": 1.0})
    store.record_validation("r1", 1, {"val-core/x": 0.5})
    [(step, at, metrics)] = store.step_records("r1")
    assert (step, metrics) == (1, {"loss": 1.0, "val-core/x": 0.5}) and at > 0
    store.close()


@pytest.mark.parametrize("damage", ["header", "truncated", "emptied"])
def test_a_damaged_run_db_is_refused_naming_the_file_and_what_to_do(db_path, damage):
    store = RunStore(db_path)
    store.create_run("r1", "first", "", run_dir="/d", total_steps=10)
    for index in range(500):
        store.add_event("r1", "log", index, state="", message="x" * 100, metrics={})
    store.close()
    (db_path.parent / "runs" / "r1").mkdir(parents=True)
    (db_path.parent / "runs" / "r1" / "config.yaml").write_text("data: {}\n")
    if damage == "header":
        with db_path.open("r+b") as db:
            db.write(b"\xff" * 100)
    elif damage == "emptied":
        os.truncate(db_path, 0)
    else:
        os.truncate(db_path, db_path.stat().st_size // 2)
    with pytest.raises(DamagedRunDB) as refused:
        RunStore(db_path)
    message = str(refused.value)
    assert f"the run DB {db_path} is damaged" in message and f"mv {db_path} {db_path}.damaged" in message


def test_an_empty_run_db_file_with_no_run_folders_is_a_new_run_db(db_path):
    db_path.parent.mkdir()
    db_path.touch()
    store = RunStore(db_path)
    assert store.list_runs() == []
    store.close()
