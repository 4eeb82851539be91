"""The project's config loader: Kedro's ``OmegaConfigLoader`` plus one rule, each env keeps its own data.

Every path the catalog and the parameters write under is ``${globals:data_root}/...`` (``data/01_raw``, the inputs a
user ships, is read by every env). ``conf/base/globals.yml`` sets ``data_root: data``; a run in any env other than
the default one (``kedro run -e hf_example``) writes under ``data/<env>/`` instead, unless that env's own
``globals.yml`` names its ``data_root``. So ``kedro run -e hf_example`` never replaces the tokenizer, data or models
of a plain ``kedro run``, and the two never read each other's artifacts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kedro.config import OmegaConfigLoader

DATA_ROOT = "data_root"


def env_data_root(base_root: str, env: str) -> str:
    """The data root of a non-default ``env`` whose globals do not name one: ``<base root>/<env>``."""
    return f"{base_root.rstrip('/')}/{env}"


class ProjectConfigLoader(OmegaConfigLoader):
    """``OmegaConfigLoader`` whose ``globals`` give each non-default env its own ``data_root``."""

    def __init__(self, conf_source: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(conf_source, *args, **kwargs)
        env = self.env or self.default_run_env
        if not env or env in (self.base_env, self.default_run_env) or self._env_names_data_root(env):
            return
        base_root = str(self._globals.get(DATA_ROOT, "data"))
        self._globals = {**self._globals, DATA_ROOT: env_data_root(base_root, env)}
        self._globals_oc = None  # the globals resolver re-reads them

    def _env_names_data_root(self, env: str) -> bool:
        path = Path(self.conf_source) / env / "globals.yml"
        if not path.is_file():
            return False
        own = yaml.safe_load(path.read_text()) or {}
        return isinstance(own, dict) and DATA_ROOT in own


__all__ = ["DATA_ROOT", "ProjectConfigLoader", "env_data_root"]
