"""User-facing errors: the CLI prints one line and exits with code 2; and the exit code of a stop."""

PREEMPTED_EXIT = 75  # sysexits' EX_TEMPFAIL: the online loop stopped on a signal, checkpointed; --resume continues


class SerlError(Exception):
    """Bad input or a refused operation. Its message is the one line the user sees."""

    exit_code = 2
