"""Kedro datasets of align-pipeline's artifacts."""

from .checkpoint import CheckpointDataset, HFModelDataset  # noqa: F401
from .data import PromptsJsonlDataset, RawJsonlDataset, TokenizedNpzDataset, TokenizerDirDataset  # noqa: F401
