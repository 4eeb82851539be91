"""Multi-turn environments for the RL stages (``<stage>.env``): the protocol (:mod:`.base`), the worker processes that
run them with a per-step timeout (:mod:`.pool`) and the built-in environments (:mod:`.builtin`)."""

from align_pipeline import lazy_exports

_EXPORTS = {
    "Calculator": "builtin",
    "EnvError": "base",
    "EnvPool": "pool",
    "Environment": "base",
    "Step": "base",
    "StepVerifier": "builtin",
    "as_step": "base",
}
"""Re-exported name -> the submodule that defines it (imported when the name is first read; sorted)."""

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = list(_EXPORTS)
