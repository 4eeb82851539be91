"""``data_prep``: validate the raw jsonl, build the tokenizer, tokenize/mask/pad/split, persist the artifacts."""

from align_pipeline import lazy_exports

_EXPORTS = {
    "create_pipeline": "pipeline",
    "create_prompts_pipeline": "pipeline",
    "create_regression_pipeline": "pipeline",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
