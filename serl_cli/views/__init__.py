"""Views of a run directory: ``serl show`` (:mod:`~serl_cli.views.show`, an online run:
:mod:`~serl_cli.views.show_online`) and ``serl plot`` (:mod:`~serl_cli.views.plot`). They read a
run's files and run nothing."""
