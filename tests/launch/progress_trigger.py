"""Act in the middle of a running job: when rank 0's streamed progress reaches step 2 (launcher tests)."""

from __future__ import annotations

import contextlib
import logging

import psutil


class OnStep(logging.Handler):
    """When rank 0's progress reaches step 2: remember our descendants, then ``action()`` (in the main thread)."""

    def __init__(self, action):
        super().__init__()
        self.action, self.procs = action, []

    def emit(self, record):
        if "step 2/" in record.getMessage() and not self.procs:
            self.procs = psutil.Process().children(recursive=True) or [psutil.Process()]
            self.action()


@contextlib.contextmanager
def acting_on_step(action):
    """``action()`` runs once the launcher logs rank 0's "step 2/" line; yields the :class:`OnStep` handler."""
    handler = OnStep(action)
    launch_logger = logging.getLogger("align_pipeline.launch")
    launch_logger.addHandler(handler)
    old_level = launch_logger.level
    launch_logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        launch_logger.removeHandler(handler)
        launch_logger.setLevel(old_level)
