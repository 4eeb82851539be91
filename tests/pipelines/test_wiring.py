"""The Kedro side: every pipeline input resolves to a catalog entry, a params section or another node's output; the
pipeline registry loads without torch or Megatron."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _catalog():
    """The base catalog's entries, with its dataset factories (``"{artifact}_stored"``) resolved as Kedro does."""
    from kedro.io.catalog_config_resolver import CatalogConfigResolver

    config = {}
    for f in (REPO / "conf" / "base").glob("catalog*.yml"):
        config.update(yaml.safe_load(f.read_text().replace("${globals:data_root}", "data")))
    resolver = CatalogConfigResolver(config)

    class Entries:
        def __contains__(self, name: str) -> bool:
            return name in config or resolver.match_dataset_pattern(name) is not None

    return Entries()


def test_every_pipeline_input_is_in_the_catalog_or_params_or_produced():
    from align_pipeline.pipeline_registry import register_pipelines

    catalog = _catalog()
    params = {}
    for f in (REPO / "conf" / "base").glob("parameters*.yml"):
        params.update(yaml.safe_load(f.read_text()))
    for name, pipeline in register_pipelines().items():
        produced = set(pipeline.all_outputs())
        for node in pipeline.nodes:
            for inp in node.inputs:
                if inp.startswith("params:"):
                    assert inp.split(":", 1)[1].split(".")[0] in params, (name, node.name, inp)
                else:
                    assert inp in catalog or inp in produced, (name, node.name, inp)


def test_every_stage_node_runs_alone_on_persisted_inputs():
    """`kedro run --nodes <node>` / `--from-nodes <node>` for every training, evaluation and export node: each input
    is a catalog entry or a params section, never an in-memory intermediate that a partial run would miss (such as
    dpo_reference_logps was). data_prep's own intermediates stay in memory on purpose: its last node writes every
    output, all-or-nothing."""
    from align_pipeline.pipeline_registry import register_pipelines

    catalog = _catalog()
    for name, pipeline in register_pipelines().items():
        for node in pipeline.nodes:
            if "data_prep" in node.tags:
                continue
            missing = [i for i in node.inputs if not i.startswith("params:") and i not in catalog]
            assert not missing, (name, node.name, missing)


def test_pipeline_registry_imports_no_torch_or_megatron():
    code = ("import sys, align_pipeline.pipeline_registry, align_pipeline.settings; "
            "print(sorted(m for m in ('torch', 'megatron.core', 'torch.distributed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout
    assert "Apex" not in out.stderr and "Transformer Engine" not in out.stderr


def test_kedro_viz_layers_follow_the_data_folders_and_every_node_has_its_stage_tag():
    import re

    from align_pipeline.pipeline_registry import register_pipelines

    layers = {"01_raw": "raw", "03_primary": "primary", "05_model_input": "model_input", "06_models": "models",
              "07_model_output": "model_output", "08_reporting": "reporting"}
    for f in (REPO / "conf" / "base").glob("catalog*.yml"):
        for name, entry in yaml.safe_load(f.read_text()).items():
            folder = re.match(r"data/(\d\d_\w+)/", str(entry.get("filepath") or entry.get("path") or ""))
            if folder and "@" not in name:  # transcoded entries share their dataset's node in kedro-viz
                assert entry["metadata"]["kedro-viz"]["layer"] == layers[folder.group(1)], (f.name, name)
    stages = {"data_prep", "sft", "reward_model", "dpo", "ppo", "reinforce", "distill", "evaluation", "export"}
    for name, pipeline in register_pipelines().items():
        for node in pipeline.nodes:
            assert len(node.tags & stages) == 1, (name, node.name, node.tags)
