"""Kedro project settings."""

import os

# Kedro's telemetry plugin (pulled in by kedro-viz) tries the network at start-up.
os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "true")

from align_pipeline.kedro.config_loader import ProjectConfigLoader
from align_pipeline.kedro.jobs_hook import JobsHook
from align_pipeline.kedro.mlflow_hook import MlflowHook
from align_pipeline.kedro.params_hook import ParamsValidationHook
from align_pipeline.kedro.staged_outputs import StagedOutputsHook

# pluggy calls the most recently registered implementation first: parameters are validated before the MLflow parent
# run is opened, so a bad config neither launches anything nor leaves a run behind.
# StagedOutputsHook writes data_prep's outputs as one unit (catalog entries with ``commit_group``); JobsHook deletes a
# training node's run directory once its outputs are stored (kept on failure) and releases multi-node workers.
HOOKS = (MlflowHook(), JobsHook(), ParamsValidationHook(), StagedOutputsHook())
# Our MlflowHook does the tracking (parent run per `kedro run`, child run per node); kedro-mlflow, if a user has it
# installed, would open a conflicting run of its own.
DISABLE_HOOKS_FOR_PLUGINS = ("kedro-mlflow",)

# Each env but the default one keeps its data under data/<env>/ (conf/base/globals.yml, config_loader.py).
CONFIG_LOADER_CLASS = ProjectConfigLoader
CONFIG_LOADER_ARGS = {
    "base_env": "base",
    "default_run_env": "local",
    # conf/local (or -e <env>) overrides single keys of a parameters file instead of replacing the whole file.
    "merge_strategy": {"parameters": "soft", "catalog": "soft"},
    "config_patterns": {
        "catalog": ["catalog*", "catalog*/**", "**/catalog*"],
        "parameters": ["parameters*", "parameters*/**", "**/parameters*"],
    },
}
