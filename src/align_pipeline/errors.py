"""The one error family a user is expected to fix: bad data, bad config, a failed job or gate.

``kedro run`` (the project CLI, :mod:`align_pipeline.cli`) and ``align-pipeline`` end such an error with its message
alone and exit code 2; any other exception is a bug and keeps its traceback. Nothing here imports Kedro or torch.
"""

from __future__ import annotations


class UserError(Exception):
    """An error whose message tells the user what to fix (file/line/field or config key); printed without a
    traceback."""


__all__ = ["UserError"]
