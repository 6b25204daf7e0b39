"""``serl demo``: the whole pipeline on the embedded default (:mod:`~serl_cli.demo.pipeline`), its
online arms side by side (:mod:`~serl_cli.demo.side_by_side`)."""
