"""Kedro datasets of align-pipeline's artifacts."""

from align_pipeline import lazy_exports

_EXPORTS = {
    "CheckpointDataset": "checkpoint",
    "HFModelDataset": "checkpoint",
    "PromptsJsonlDataset": "data",
    "RawDataset": "data",
    "RawJsonlDataset": "data",
    "ReferenceLogpsDataset": "data",
    "StoredVersions": "stored",
    "StoredVersionsDataset": "stored",
    "TokenizedNpzDataset": "data",
    "TokenizerDirDataset": "data",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
