"""The error of a bad command-line argument (light: the parser and ``--help`` import it without torch)."""


class UsageError(Exception):
    """A bad argument: reported in one line with exit status 2."""
