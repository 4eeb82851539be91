"""Kedro datasets of align-pipeline's artifacts."""

from .data import PromptsJsonlDataset, RawJsonlDataset, TokenizedNpzDataset, TokenizerDirDataset  # noqa: F401
from .checkpoint import CheckpointDataset  # noqa: F401
