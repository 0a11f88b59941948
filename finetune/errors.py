"""The one error type for bad input: the CLI prints its message on one line and exits with code 2."""

EXIT_USAGE = 2


class UserError(Exception):
    """Bad input from the user (config, data, paths). The message names the file/key and what was expected."""
