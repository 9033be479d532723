"""A reward plugin that cannot be imported."""

import a_module_that_does_not_exist  # noqa: F401


def score(data_source, solution_str, ground_truth, extra_info):
    return 1.0
