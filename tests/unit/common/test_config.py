"""CPU tests of services/common/config.py (loading, overrides, errors, YAML limits; the run config serves as the
config loaded) and that every config's leaf fields are documented. The run config's own checks are in
tests/unit/run/test_config.py."""

from __future__ import annotations

import re
import typing

import pytest

from services.common.config import (ConfigError, Section, ServeConfig, apply_overrides, load_config, parse_yaml,
                                   read_yaml, to_yaml, validate)
from services.run.config import RunConfig
from services.coordctl.config import LocalConfig
from services.coordinator.config import CoordinatorServiceConfig
from services.reward.config import RewardServiceConfig
from services.rollout.config import RolloutServiceConfig
from services.trainer.config import TrainerServiceConfig

# ---------------------------------------------------------------------------
# apply_overrides


def test_overrides_create_nested_keys_and_leave_the_input_alone():
    data = {"data": {"train_batch_size": 32}, "trainer": {"seed": 0}}
    result = apply_overrides(data, ["data.train_batch_size=64", "a.b.c=1", "trainer.seed=7"])
    assert result == {"data": {"train_batch_size": 64}, "trainer": {"seed": 7}, "a": {"b": {"c": 1}}}
    assert data == {"data": {"train_batch_size": 32}, "trainer": {"seed": 0}}


@pytest.mark.parametrize(("raw", "value"), [
    ("true", True),
    ("false", False),
    ("[a,b]", ["a", "b"]),
    ("[1, 2]", [1, 2]),
    ("3", 3),
    ("3.0e-4", 3.0e-4),
    ("0.5", 0.5),
    ("hello", "hello"),
    ("'007'", "007"),
    ("null", None),
    ("{x: 1}", {"x": 1}),
    ("", ""),
    ("  ", ""),
    ("a=b", "a=b"),  # only the first '=' splits key from value
])
def test_override_value_is_parsed_as_yaml(raw, value):
    assert apply_overrides({}, [f"k={raw}"])["k"] == value


@pytest.mark.parametrize("raw", ["1e-3", "1E-3", "1e+3"])
def test_override_exponent_without_dot_is_a_float(raw):
    value = apply_overrides({}, [f"actor_rollout_ref.actor.optim.lr={raw}"])["actor_rollout_ref"]["actor"]["optim"]["lr"]
    assert isinstance(value, float) and value == float(raw)


def test_exponent_without_dot_still_reaches_a_float_field_as_a_float():
    # pydantic coerces the string that PyYAML leaves, so a typed float field ends up right.
    config = load_config(RunConfig, None, ["actor_rollout_ref.actor.optim.lr=1e-3"])
    assert config.actor_rollout_ref.actor.optim.lr == 1e-3


@pytest.mark.parametrize("override", ["no_equals_sign", "=5", ""])
def test_bad_override_format_raises_config_error(override):
    with pytest.raises(ConfigError, match=r"must look like key.path=value"):
        apply_overrides({}, [override])


def test_override_through_a_scalar_raises_config_error():
    with pytest.raises(ConfigError, match=r"override 'data.train_batch_size.x=1': train_batch_size is not a section"):
        apply_overrides({"data": {"train_batch_size": 32}}, ["data.train_batch_size.x=1"])


def test_override_with_invalid_yaml_value_raises_config_error():
    with pytest.raises(ConfigError, match=r"override 'k=\[1, 2': value is not valid YAML"):
        apply_overrides({}, ["k=[1, 2"])


# ---------------------------------------------------------------------------
# load_config


def write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_config_from_yaml_with_overrides(tmp_path):
    path = write(tmp_path, """
data:
  train_batch_size: 64
  train_files: [a.parquet]
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: 16
    optim: {lr: 3.0e-4, betas: [0.9, 0.99]}
  rollout: {n: 4}
""")
    config = load_config(RunConfig, path, ["trainer.seed=5", "data.shuffle=false", "actor_rollout_ref.model.path=/m"])
    assert config.data.train_batch_size == 64
    assert config.data.train_files == ["a.parquet"]
    assert config.data.shuffle is False
    assert config.actor_rollout_ref.actor.optim.lr == 3.0e-4
    assert config.actor_rollout_ref.actor.optim.betas == (0.9, 0.99)
    assert config.actor_rollout_ref.rollout.n == 4
    assert config.trainer.seed == 5
    assert config.data.max_prompt_length == 512  # a default kept
    config.require_paths()
    assert load_config(RunConfig, write(tmp_path, to_yaml(config), "again.yaml")) == config


def test_load_config_without_a_file_gives_the_defaults():
    assert load_config(RunConfig, None) == RunConfig()
    assert load_config(ServeConfig, None, ["port=8080"]).port == 8080


def test_empty_yaml_file_gives_the_defaults(tmp_path):
    assert load_config(RunConfig, write(tmp_path, "# nothing\n")) == RunConfig()


def test_config_is_frozen():
    config = RunConfig()
    with pytest.raises(Exception, match=r"frozen"):
        config.data.train_batch_size = 3


def test_unknown_key_names_its_dotted_path():
    with pytest.raises(ConfigError, match=r"^data\.trian_batch_size: unknown key \(did you mean train_batch_size( or "
                                          r"val_batch_size)?\?\)$"):
        load_config(RunConfig, None, ["data.trian_batch_size=64"])


def test_unknown_key_in_yaml_names_its_dotted_path(tmp_path):
    path = write(tmp_path, "actor_rollout_ref:\n  rollout:\n    temprature: 0.5\n")
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.temprature: unknown key \(did you mean temperature\?\)$"):
        load_config(RunConfig, path)


def test_every_bad_field_is_named():
    with pytest.raises(ConfigError) as caught:
        load_config(RunConfig, None, ["data.bogus=1", "trainer.seed=x"])
    assert "data.bogus: unknown key" in str(caught.value)
    assert "trainer.seed: " in str(caught.value)


@pytest.mark.parametrize(("override", "field"), [
    ("data.train_batch_size=abc", "data.train_batch_size"),
    ("data.train_batch_size=0", "data.train_batch_size"),
    ("actor_rollout_ref.rollout.name=trtllm", "actor_rollout_ref.rollout.name"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", "actor_rollout_ref.actor.optim.betas"),
    ("actor_rollout_ref.rollout.top_p=1.5", "actor_rollout_ref.rollout.top_p"),
    ("actor_rollout_ref.rollout.partial_rollout=resume", "actor_rollout_ref.rollout.partial_rollout"),
    ("data.train_files={a: 1}", "data.train_files"),
    ("trainer=5", "trainer"),
])
def test_wrong_type_names_the_field(override, field):
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}(\.\d+)?: "):
        load_config(RunConfig, None, [override])


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"config file {path} does not exist"):
        load_config(RunConfig, path)


def test_invalid_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "data: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"config file {path} is not valid YAML"):
        load_config(RunConfig, path)


def test_yaml_that_is_not_a_mapping_names_the_file(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match=rf"config file {path} must hold a mapping at the top, not list"):
        read_yaml(path)


def test_directory_as_config_file_raises_config_error(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_config(RunConfig, tmp_path)


def test_validate_top_level_error_is_labelled():
    with pytest.raises(ConfigError, match=r"^\(top level\): "):
        validate(RunConfig, {"data": {"train_batch_size": 48}, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 32}}})


# ---------------------------------------------------------------------------
# every leaf field documented (its docstring becomes its description)

CONFIG_ROOTS = (RunConfig, LocalConfig, CoordinatorServiceConfig, RolloutServiceConfig, TrainerServiceConfig,
                RewardServiceConfig)


def _sections_in(annotation) -> list[type[Section]]:
    """The Section classes an annotation holds, through Optional, list, dict and the like."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [annotation]
    return [section for arg in typing.get_args(annotation) for section in _sections_in(arg)]


def _owner(model: type[Section], name: str) -> str:
    """The class that declares field ``name`` of ``model`` (ServeConfig for a service's host, port, ...)."""
    return next(c.__name__ for c in reversed(model.__mro__)
                if isinstance(c, type) and issubclass(c, Section) and name in c.model_fields)


def _undocumented_leaves(roots) -> tuple[list[str], set[str]]:
    """Leaf fields (those holding no Section) without a description, as DeclaringClass.field, each once, and
    the classes walked."""
    missing, seen = [], set()

    def walk(model: type[Section]) -> None:
        if model.__name__ in seen:
            return
        seen.add(model.__name__)
        for name, field in model.model_fields.items():
            nested = _sections_in(field.annotation)
            for section in nested:
                walk(section)
            where = f"{_owner(model, name)}.{name}"
            if not nested and not (field.description or "").strip() and where not in missing:
                missing.append(where)

    for root in roots:
        walk(root)
    return missing, seen


def test_every_leaf_config_field_has_a_docstring():
    missing, seen = _undocumented_leaves(CONFIG_ROOTS)
    assert not missing, f"config fields without a docstring: {', '.join(missing)}"
    # the walk reached the nested sections, through Optional and list/dict fields too
    assert {"OptimConfig", "MixedPrecisionConfig", "PlacementConfig", "ComponentConfig", "RewardServiceConfig",
            "TinyModelConfig"} <= seen


def test_undocumented_leaf_walk_names_fields_behind_optional_and_containers():
    class Inner(Section):
        documented: int = 0
        """Has one."""
        bare: int = 0

    class Outer(Section):
        parts: dict[str, list[Inner]] | None = None
        blank: str = ""
        """ """

    class Derived(Outer):
        extra: float = 0.0

    missing, seen = _undocumented_leaves([Outer, Derived])
    assert missing == ["Inner.bare", "Outer.blank", "Derived.extra"]  # an inherited field is named once, by its class
    assert seen == {"Outer", "Inner", "Derived"}


def test_yaml_nested_deeper_than_the_limit_is_refused_before_it_is_loaded():
    with pytest.raises(ConfigError, match="run_config_yaml nests deeper than 64 levels"):
        parse_yaml("a: " + "[" * 30_000 + "]" * 30_000, "run_config_yaml")
    assert parse_yaml("a: " + "[" * 63 + "]" * 63, "x") is not None  # the mapping and 63 lists: 64 deep


def test_yaml_longer_than_the_limit_is_refused_before_it_is_read():
    with pytest.raises(ConfigError, match=f"run config is {65 << 10} characters long, more than {64 << 10}"):
        parse_yaml("#" * (65 << 10), "run config")


def test_yaml_tags_that_build_objects_are_refused_naming_the_text():
    with pytest.raises(ConfigError, match="run_config_yaml is not valid YAML: could not determine a constructor"):
        parse_yaml('a: !!python/object/apply:os.system ["true"]', "run_config_yaml")


