"""coordctl plot's choice of metrics (services/coordctl/plotting.py) and the PNG it draws
(services/run/plot.py)."""

from __future__ import annotations

import pytest

from services.coordctl.plotting import file_name, plotted, steps_of
from services.run.plot import plot_metrics

LINES = [{"step": 0, "time": 1.0, "val-core/r/acc/mean@1": 0.3},
         {"step": 1, "time": 2.0, "critic/score/mean": 0.5, "timing_s/gen": 0.2, "timing_s/step": 1.0},
         {"step": 2, "time": 3.0, "critic/score/mean": 0.6, "timing_s/gen": 0.3, "timing_s/step": 1.1},
         {"step": 2, "time": 3.5, "val-core/r/acc/mean@1": 0.4, "val/weight_version": 2}]


def test_a_validation_line_joins_its_steps_metrics():
    assert steps_of(LINES) == [(0, {"val-core/r/acc/mean@1": 0.3}),
                               (1, {"critic/score/mean": 0.5, "timing_s/gen": 0.2, "timing_s/step": 1.0}),
                               (2, {"critic/score/mean": 0.6, "timing_s/gen": 0.3, "timing_s/step": 1.1,
                                    "val-core/r/acc/mean@1": 0.4, "val/weight_version": 2})]


def test_names_and_patterns_choose_metrics_and_a_misspelt_one_is_named_with_the_closest():
    known = {key for _, metrics in steps_of(LINES) for key in metrics}
    assert plotted(["timing_s/*", "critic/score/mean"], known) == {
        "timing_s/*": ["timing_s/gen", "timing_s/step"], "critic/score/mean": ["critic/score/mean"]}
    assert plotted([], known) == {"critic/score/mean": ["critic/score/mean"],
                                  "val-core/*/mean@*": ["val-core/r/acc/mean@1"],
                                  "timing_s/*": ["timing_s/gen", "timing_s/step"]}  # the defaults the run has
    with pytest.raises(ValueError, match=r"no metric 'critic/score/maen'; did you mean critic/score/mean"):
        plotted(["critic/score/maen"], known)
    with pytest.raises(ValueError, match=r"no metric 'actor/\*'"):
        plotted(["actor/*"], known)
    assert (file_name("critic/score/mean"), file_name("timing_s/*")) == ("critic_score_mean.png", "timing_s_all.png")


def test_a_metric_is_drawn_over_the_steps_that_have_it(tmp_path):
    steps = steps_of(LINES)
    drawn = plot_metrics(steps, ["critic/score/mean", "val-core/r/acc/mean@1"], tmp_path / "m.png", title="run")
    assert drawn == tmp_path / "m.png" and drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics(steps, ["actor/pg_loss"], tmp_path / "none.png", title="run") is None
    assert not (tmp_path / "none.png").exists()
