"""Kedro datasets of align-pipeline's artifacts."""

from .checkpoint import CheckpointDataset, HFModelDataset  # noqa: F401
from .data import (  # noqa: F401
    PromptsJsonlDataset,
    RawJsonlDataset,
    ReferenceLogpsDataset,
    TokenizedNpzDataset,
    TokenizerDirDataset,
)
from .stored import StoredVersions, StoredVersionsDataset  # noqa: F401
