"""User-facing errors: the CLI prints one line and exits with code 2."""


class SerlError(Exception):
    """Bad input or a refused operation. Its message is the one line the user sees."""

    exit_code = 2
