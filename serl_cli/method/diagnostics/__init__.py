"""Diagnostics of SERL's method, apart from its annotate core (:mod:`serl_cli.method`): the
selection-bias report, the teacher-signal gate, what the weights do to one update."""
