"""Errors a user can fix. The CLI prints them as one line and exits with status 2."""


class UserError(Exception):
    """Bad input: a config key, a value, a file or a row. The message names the culprit."""


class ConfigError(UserError):
    """A recipe or override that does not validate."""


class DataError(UserError):
    """A data file that is missing, unreadable, empty, or has a row without a needed field."""


class TrainingError(UserError):
    """A run that cannot go on as configured (steps whose loss or gradients are not finite, again and again); the
    message says where it stopped and which checkpoint holds it."""
