"""Paths named from outside stay inside their service's root; run names are names."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, validate
from services.common.paths import inside
from services.run.config import RunConfig


def test_a_path_inside_the_root_resolves_and_one_outside_is_refused_naming_the_field(tmp_path):
    root = tmp_path / "state"
    root.mkdir()
    assert inside(root, "runs/a/step_1", "path") == root / "runs/a/step_1"
    assert inside(root, root / "runs", "path") == root / "runs"
    for outside in ("../elsewhere", "runs/../../..", "/etc", str(tmp_path)):
        with pytest.raises(ValueError, match=r"^path: .* is outside"):
            inside(root, outside, "path")


def test_a_link_inside_the_root_that_leads_out_is_refused(tmp_path):
    root = tmp_path / "state"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="trainer.default_local_dir"):
        inside(root, "link/checkpoints", "trainer.default_local_dir")


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "a/b", "..", ".", "", "x" * 101])
def test_an_experiment_name_that_is_a_path_is_refused_naming_the_key(name):
    with pytest.raises(ConfigError, match="trainer.experiment_name: .*is not a name"):
        validate(RunConfig, {"trainer": {"experiment_name": name}})


def test_an_experiment_name_may_hold_any_other_characters():
    assert validate(RunConfig, {"trainer": {"experiment_name": "qwen2_7b-grpo.v2 (try 3)"}})
