"""A user's advantage estimator: GRPO's group centring, divided by the group's score range instead of its std.

Load it in the coordinator's config (never a run's):   adv_estimator_modules: [examples/plugins/range_norm_estimator.py]
Choose it in a run:                                     algorithm.adv_estimator=range_norm
"""

import torch

from services import algos
from services.algo_registry import EstimatorInputs, EstimatorParams, register_adv_est


@register_adv_est("range_norm")
def range_norm(inputs: EstimatorInputs, params: EstimatorParams) -> algos.Advantages:
    """(score - group mean) / (group max - group min), 0 where the group's scores are all equal. [T] out."""
    scores = algos.sequence_sums(inputs.rewards.double(), inputs.lengths)  # each response's score [B]
    advantages = torch.zeros_like(scores)
    with_signal = 0
    for group in inputs.group_ids.unique():
        rows = inputs.group_ids == group
        spread = scores[rows].max() - scores[rows].min()
        if spread > 0:
            advantages[rows] = (scores[rows] - scores[rows].mean()) / spread
            with_signal += 1
    per_token = algos.masked(algos.expand_per_token(advantages.float(), inputs.lengths), inputs.mask)
    return algos.Advantages(per_token, per_token, metrics={"critic/range_norm/groups_with_signal": with_signal})
