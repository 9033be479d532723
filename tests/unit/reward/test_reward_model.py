"""The reward model scores prompt + response the way the model does alone, whatever the batch."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2ForSequenceClassification

from services.coordctl.tiny_model import build_char_tokenizer, build_tiny_reward_model
from services.reward.reward_model import RewardModel

TEXTS = ["12=21", "345=543", "7=", "9999=9999 and more", "1"]


@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm", hidden_size=32, num_layers=1, seed=0)


def test_batched_scores_equal_each_text_alone_and_the_model_itself(reward_model_path):
    batched = RewardModel(str(reward_model_path), "cpu", batch_size=4).score(TEXTS)
    alone = [RewardModel(str(reward_model_path), "cpu", batch_size=1).score([t])[0] for t in TEXTS]
    model = Qwen2ForSequenceClassification.from_pretrained(reward_model_path).eval()
    tokenizer = build_char_tokenizer()
    with torch.no_grad():
        direct = [float(model(input_ids=torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])).logits[0, 0])
                  for t in TEXTS]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert batched == pytest.approx(direct, abs=1e-5)
    assert len(set(round(s, 6) for s in batched)) == len(TEXTS)  # different texts, different scores


def test_a_folder_without_a_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        RewardModel(str(tmp_path), "cpu", 4)
