"""The online loop (``serl train --iterations K``): :mod:`~serl_cli.online.loop` runs it, from its
settings (:mod:`~serl_cli.online.config`, a run file: :mod:`~serl_cli.online.run_file`), each
stage's config derived from them (:mod:`~serl_cli.online.derive`). Nothing is imported here, so
reading a run's settings does not load torch."""
