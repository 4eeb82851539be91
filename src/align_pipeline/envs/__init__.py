"""Multi-turn environments for the RL stages (``<stage>.env``): the protocol (:mod:`.base`), the worker processes that
run them with a per-step timeout (:mod:`.pool`) and the built-in environments (:mod:`.builtin`)."""

from align_pipeline.envs.base import EnvError, Environment, Step, as_step, load_environment_class

__all__ = ["EnvError", "Environment", "Step", "as_step", "load_environment_class"]
