"""DPO-family stage: cached reference log-probs, then preference optimisation."""

from .pipeline import create_pipeline  # noqa: F401
