"""On-policy distillation stage: a student policy learns a teacher's per-token log-probs on its own samples."""

from align_pipeline import lazy_exports

_EXPORTS = {
    "create_pipeline": "pipeline",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
