"""A local cluster's token: made per cluster unless the user gave one, and forgotten when the cluster stops, so
that a later cluster in the same process (a test module, a notebook) never hands its services a token file that
an earlier cluster's removed folder held."""

from __future__ import annotations

import os
import shutil

import pytest

from services.common.auth import cluster_token
from services.coordctl.local import LocalCluster


@pytest.fixture
def no_token(monkeypatch):
    monkeypatch.delenv("MESHRL_TOKEN", raising=False)
    monkeypatch.delenv("MESHRL_TOKEN_FILE", raising=False)
    cluster_token.cache_clear()
    yield monkeypatch
    cluster_token.cache_clear()


def test_a_cluster_started_after_another_was_stopped_and_its_folder_removed_makes_its_own_token(no_token, tmp_path):
    first = LocalCluster(tmp_path / "first")
    assert os.environ["MESHRL_TOKEN_FILE"] == str(tmp_path / "first" / "token")
    first.stop()
    shutil.rmtree(tmp_path / "first")
    assert "MESHRL_TOKEN_FILE" not in os.environ and cluster_token() is None

    second = LocalCluster(tmp_path / "second")
    assert os.environ["MESHRL_TOKEN_FILE"] == str(tmp_path / "second" / "token")
    assert cluster_token() == (tmp_path / "second" / "token").read_text().strip()
    second.stop()
    assert "MESHRL_TOKEN_FILE" not in os.environ


def test_a_token_the_user_gave_is_used_and_kept(no_token, tmp_path):
    mine = tmp_path / "my-token"
    mine.write_text("a-token-of-my-own\n")
    no_token.setenv("MESHRL_TOKEN_FILE", str(mine))
    cluster = LocalCluster(tmp_path / "state")
    assert not (tmp_path / "state" / "token").exists() and cluster_token() == "a-token-of-my-own"
    cluster.stop()
    assert os.environ["MESHRL_TOKEN_FILE"] == str(mine)
