"""Export: every policy and reward model the project has -> a versioned Hugging Face directory (``<artifact>_hf``)."""

from align_pipeline import lazy_exports

_EXPORTS = {
    "EXPORTED": "pipeline",
    "create_pipeline": "pipeline",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
