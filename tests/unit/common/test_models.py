"""Model folders load from safetensors; pickled weights only when the run allows them."""

from __future__ import annotations

import pytest

from services.common.models import check_weights


def test_pickled_weights_are_refused_unless_allowed_and_safetensors_pass(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.path: .*pytorch_model.bin holds pickled weights.*"
                                         r"allow_pickle=true"):
        check_weights(tmp_path, False, "actor_rollout_ref.model.path")
    check_weights(tmp_path, True, "actor_rollout_ref.model.path")
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_weights(tmp_path, False, "actor_rollout_ref.model.path")
