"""Errors that moebox reports to people, not to debuggers.

Every failure a user can cause (a bad config, a damaged checkpoint, a wrong flag) raises a
`MoeboxError` whose message names the file/key/tensor and, where there is one, the fix. The CLI
prints such errors as one line without a traceback; anything else is a bug and keeps its traceback.
"""


class MoeboxError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class ConfigError(MoeboxError):
    """config.json is missing, unreadable, or has an unknown/contradictory value."""


class CheckpointError(MoeboxError):
    """A checkpoint file is missing, truncated, or does not match the config."""
