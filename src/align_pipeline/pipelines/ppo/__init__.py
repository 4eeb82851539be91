"""PPO stage: actor from sft_policy, critic from reward_model, frozen reference and reward model."""

from align_pipeline import lazy_exports

_EXPORTS = {
    "create_pipeline": "pipeline",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
