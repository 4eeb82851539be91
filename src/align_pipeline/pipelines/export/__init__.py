"""Export: every policy and reward model the project has -> a versioned Hugging Face directory (``<artifact>_hf``)."""

from .pipeline import EXPORTED, create_pipeline  # noqa: F401
