"""The command line every service shares: a bad config stops the process with the field named and exit code 2,
which the systemd units do not answer with a restart (RestartPreventExitStatus=2)."""

import pytest

from services.common.cli import REFUSED_EXIT_CODE, parse_service_config
from services.reward.config import RewardServiceConfig


@pytest.mark.parametrize(("argv", "message"), [
    (["bogus_key=1"], "reward: bad config: bogus_key: unknown key\n"),
    (["--config", "/nonexistent/reward.yaml"],
     "reward: bad config: config file /nonexistent/reward.yaml does not exist\n"),
])
def test_a_bad_config_exits_with_code_2_naming_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_service_config("reward", RewardServiceConfig, argv)
    assert exited.value.code == REFUSED_EXIT_CODE == 2
    assert capsys.readouterr().err == message


def test_a_good_config_is_read_with_its_shorthands():
    config = parse_service_config("reward", RewardServiceConfig, ["--port", "7071", "--coordinator", "node1:7070"])
    assert (config.port, config.coordinator) == (7071, "node1:7070")
