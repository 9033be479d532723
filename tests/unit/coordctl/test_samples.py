"""coordctl samples' reading and layout of a run's kept samples (services/coordctl/samples.py)."""

from __future__ import annotations

import json

import pytest

from services.coordctl.samples import describe, read_samples, kept_samples_dir, steps_kept, wrapped

RECORD = {"step": 7, "input": "12=", "output": "21", "gts": "21", "score": 1.0, "acc": True, "pred": "21",
          "valid": True, "error": "", "reward_components": [{"name": "meshrl/reverse", "weight": 1.0, "value": 1.0}],
          "weight_version": 36, "staleness": 1, "rollout": "127.0.0.1:4001", "reward_service": "reward-1",
          "reward_address": "127.0.0.1:4002", "advantage": 0.625, "response_length": 3, "truncated": False,
          "group": 0}


def test_a_sample_reads_as_its_score_lineage_and_text():
    lines = describe(0, RECORD, 100)
    assert lines == [
        "#0  step 7  group 0  score 1.000 (acc True, pred '21')  advantage +0.625  3 tokens",
        "    version 36 (staleness 1)  rollout 127.0.0.1:4001  reward reward-1 (127.0.0.1:4002)",
        "    parts     meshrl/reverse 1.000 x1",
        "    prompt    12=",
        "    response  21",
        "    expected  21"]
    unscored = describe(3, {**RECORD, "valid": False, "error": "TimeoutError: 5 s", "reward_components": [],
                            "acc": None}, 100)
    assert "    unscored  TimeoutError: 5 s" in unscored and not any("parts" in line for line in unscored)
    assert describe(1, {"step": 2}, 100)[0] == "#1  step 2  group ?  score ?  advantage ?  ? tokens"
    spanning = describe(2, {**RECORD, "last_weight_version": 37}, 100)  # new weights came in while sampled
    assert spanning[1] == "    version 36-37 (staleness 1)  rollout 127.0.0.1:4001  reward reward-1 (127.0.0.1:4002)"
    assert describe(2, {**RECORD, "last_weight_version": 36}, 100)[1] == lines[1]


def test_long_text_wraps_under_its_label_and_keeps_its_line_breaks():
    lines = wrapped("    response  ", "word " * 30 + "\nsecond paragraph", 60)
    assert lines[0].startswith("    response  word") and all(len(line) <= 60 for line in lines)
    assert all(line.startswith(" " * 14) for line in lines[1:])
    assert lines[-1] == " " * 14 + "second paragraph"
    assert wrapped("  x ", "", 60) == ["  x (empty)"]


def test_the_folder_and_steps_come_from_the_runs_config_and_a_bad_line_is_named(tmp_path):
    (tmp_path / "config.yaml").write_text("trainer:\n  rollout_data_dir: rollout_data\n")
    folder = kept_samples_dir(tmp_path)
    assert folder == tmp_path / "rollout_data"
    folder.mkdir()
    for step in (10, 2, 1):
        (folder / f"{step}.jsonl").write_text(json.dumps(RECORD) + "\n")
    assert steps_kept(folder) == [1, 2, 10]
    assert read_samples(folder / "2.jsonl") == [RECORD]
    (folder / "3.jsonl").write_text(json.dumps(RECORD) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"3\.jsonl:2: not JSON"):
        read_samples(folder / "3.jsonl")
    (tmp_path / "config.yaml").write_text("trainer:\n  experiment_name: x\n")
    assert kept_samples_dir(tmp_path) is None and kept_samples_dir(tmp_path / "elsewhere") is None


def test_a_trajectory_is_shown_turn_by_turn_with_what_trained_and_which_weights_sampled_it():
    record = {"step": 3, "group": 0, "score": 1.0, "advantage": 0.5, "response_length": 12, "weight_version": 7,
              "input": "code of QX?", "output": "1234", "gts": "1234", "num_turns": 3, "ended": "answer",
              "env_service": "env-a (0.1.0)", "env_reward": 0.0, "restarts": 1,
              "turns": [{"role": "model", "text": "<tool_call>{}</tool_call>", "tokens": 6, "trained": True,
                         "weight_version": 7, "tool": "", "seconds": 0.25},
                        {"role": "reply", "text": "1234", "tokens": 4, "trained": False, "weight_version": None,
                         "tool": "lookup", "seconds": 0.01},
                        {"role": "model", "text": "1234", "tokens": 2, "trained": True, "weight_version": 8,
                         "tool": "", "seconds": 0.1}]}
    lines = describe(0, record, width=100)
    assert "    episode   env-a (0.1.0): 3 turns, ended answer, env reward 0.000, restarts 1" in lines
    at = lines.index("    model     trained, weight version 7, 6 tokens, 0.25 s")
    assert lines[at + 1].strip() == "<tool_call>{}</tool_call>"
    assert lines[at + 2] == "    reply from lookup  not trained, 4 tokens, 0.01 s" and lines[at + 3].strip() == "1234"
    assert lines[at + 4] == "    model     trained, weight version 8, 2 tokens, 0.10 s"
    assert lines[-1].strip() == "expected  1234"


def test_a_trajectory_that_went_on_in_new_samples_shows_which_sample_each_turn_is_in():
    record = {"step": 1, "num_turns": 3, "ended": "done", "env_service": "env-a (0.1.0)", "env_reward": 0.0,
              "restarts": 0, "trajectory_sample": 1, "trajectory_samples": 2,
              "turns": [{"role": "model", "text": "<think>hm</think>go", "tokens": 20, "trained": True,
                         "weight_version": 7, "tool": "", "seconds": 0.25, "sample": 0},
                        {"role": "reply", "text": "42", "tokens": 0, "trained": False, "weight_version": None,
                         "tool": "lookup", "seconds": 0.01, "sample": 1},
                        {"role": "model", "text": "42", "tokens": 3, "trained": True, "weight_version": 7,
                         "tool": "", "seconds": 0.1, "sample": 1}]}
    lines = describe(0, record, width=100)
    assert "    episode   env-a (0.1.0): 3 turns, ended done, env reward 0.000, restarts 0, sample 2 of 2" in lines
    assert [line for line in lines if line.startswith("    model") or line.startswith("    reply")] == [
        "    model     trained, weight version 7, 20 tokens, 0.25 s, sample 1",
        "    reply from lookup  not trained, 0 tokens, 0.01 s, sample 2",
        "    model     trained, weight version 7, 3 tokens, 0.10 s, sample 2"]


def test_a_finished_local_runs_id_is_found_under_meshrl_runs_here_without_a_coordinator(tmp_path, monkeypatch):
    """After ``coordctl start-run --local`` its coordinator is gone: the run id its summary names still works."""
    from typer.testing import CliRunner

    from services.coordctl.cli import app

    run_id = "local-tools-lookup-20261205-172048-04b9"
    folder = tmp_path / "meshrl-runs" / "local-20261205-172034" / "runs" / run_id
    (folder / "rollout_data").mkdir(parents=True)
    (folder / "config.yaml").write_text("trainer:\n  rollout_data_dir: rollout_data\n")
    (folder / "rollout_data" / "3.jsonl").write_text(json.dumps({**RECORD, "step": 3}) + "\n")
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(app, ["samples", run_id, "--coordinator", "127.0.0.1:1"])
    assert shown.exit_code == 0, shown.output
    assert f"{folder.relative_to(tmp_path)}/rollout_data/3.jsonl: 1 of 1 samples of step 3" in shown.output
    unknown = CliRunner().invoke(app, ["samples", "no-such-run", "--coordinator", "127.0.0.1:1"])
    assert unknown.exit_code != 0 and "no coordinator answers at 127.0.0.1:1" in unknown.output
