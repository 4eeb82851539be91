"""HF exports into MLflow's model registry, as real MLflow models, and the promoted policy as its ``champion``.

**Registration** (:func:`register`, called by the MLflow hook when a ``*_hf`` catalog version is stored): an export
whose ``align_export_check.json`` says passed (or skipped: ``export.check: false``) is logged as an MLflow model of
the ``transformers`` flavor - the directory is copied into MLflow's artifact store (a *logged model* of the export
node's run, MLflow 3), laid out as ``mlflow.transformers`` lays it out (``model/``, ``components/tokenizer/``,
``MLmodel`` with the ``transformers`` and ``python_function`` flavors, the environment files), plus ``align/`` (the
export's meta and check record) - and registered as a version of the registered model named like the catalog entry
(``dpo_policy_hf``). The version's source is the logged model in MLflow's artifact store, served by MLflow wherever the tracking server
is: ``mlflow.transformers.load_model("models:/dpo_policy_hf/3")`` (or ``mlflow.pyfunc.load_model``, ``mlflow models
serve``) needs no path on the machine that exported. Version tags: the node's ``lineage.*`` (the checkpoint version it
exports: ``lineage.dpo_policy``), ``lineage.out.<entry>`` (the export's own catalog version), ``export.check``.

The MLmodel is written here, not by ``mlflow.transformers.save_model``: the Kedro process imports no torch or
transformers (``tests/test_layout.py``). Class names it records are the export's own architecture
(``LlamaForCausalLM``, ``Qwen3ForSequenceClassification``: names ``transformers`` has, so MLflow never falls back to
``trust_remote_code``) and ``AutoTokenizer``.

**Promotion** (:func:`promote`): the evaluation's ``promoted_policy`` entry names the evaluated checkpoint versions and
each policy's gate results. Every registered version exported from an evaluated checkpoint gets the results as tags
(``gate.min_gain_over_sft = pass (0.0875 vs 0.05)``, ``gates.passed``, ``evaluation.promoted``), and the newest
version exported from the promoted checkpoint gets the alias ``champion`` - taken from any other policy model that
had it, so ``champion`` names one model in the registry. It runs when ``promoted_policy`` is stored (exports made
before the evaluation) and after each registration (the latest ``promoted_policy``: exports made after it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from align_pipeline.kedro.tracking_store import TrackingStore
from align_pipeline.model.export_check import CHECK_FILE, read_status
from align_pipeline.tracking.mlflow_logger import MAX_TAG_VALUE, clean_key

logger = logging.getLogger("align_pipeline.kedro.mlflow_hook")

CHAMPION = "champion"
"""The alias of the promoted policy's registered version."""
ARCHITECTURE = re.compile(r"^[A-Za-z0-9]+For(CausalLM|SequenceClassification)$")
"""Architectures our exports write (``hf_export.architecture``); anything else is not logged as a model."""
TASKS = {"CausalLM": ("text-generation", "TextGenerationPipeline"),
         "SequenceClassification": ("text-classification", "TextClassificationPipeline")}
"""Architecture suffix -> (transformers pipeline task, its pipeline class)."""
MODEL_FILES = re.compile(r"^(config\.json|generation_config\.json|.*\.safetensors(\.index\.json)?)$")
"""Files of ``model/`` (the rest of an export's top level is its tokenizer, or ``align_*``)."""
ALIGN_FILES = re.compile(r"^align_")
"""Our records in an export (meta, check result, the packed tokenizer): logged under ``align/``."""


# ---------------------------------------------------------------------------------------------------------------------
# An export as an MLflow model directory


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=_link_file)
    else:
        _link_file(str(src), str(dst))


def _link_file(src: str, dst: str) -> None:
    try:  # the staging directory only lives until the artifact store has its copy
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _versions(*names: str) -> list[str]:
    """``name==version`` of each installed distribution (read from its metadata: nothing is imported)."""
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pins.append(name)
    return pins


def flavor(export: Path) -> dict[str, Any] | None:
    """The ``transformers`` flavor of an export (what ``mlflow.transformers.load_model`` reads), or None when its
    architecture is not one our exports write."""
    config = json.loads((export / "config.json").read_text())
    architecture = (config.get("architectures") or [""])[0]
    match = ARCHITECTURE.match(architecture)
    if not match:
        return None
    task, pipeline_class = TASKS[match.group(1)]
    conf = {"task": task, "instance_type": pipeline_class, "pipeline_model_type": architecture,
            "source_model_name": export.name, "model_binary": "model", "framework": "pt",
            "components": ["tokenizer"], "tokenizer_type": "AutoTokenizer", "tokenizer_name": export.name,
            "transformers_version": _versions("transformers")[0].partition("==")[2] or None}
    dtype = config.get("dtype") or config.get("torch_dtype")
    if isinstance(dtype, str) and re.fullmatch(r"float(16|32|64)|bfloat16", dtype):
        conf["torch_dtype"] = f"torch.{dtype}"
    return conf


def stage_model(export: Path, into: Path, model_id: str, run_id: str, artifact_location: str) -> Path:
    """Lay the export out as an MLflow ``transformers`` model under ``into`` (hard links where the filesystem allows);
    ValueError for an export :func:`flavor` refuses."""
    from mlflow.models import Model, ModelSignature
    from mlflow.pyfunc import add_to_model
    from mlflow.types.schema import ColSpec, Schema

    conf = flavor(export)
    if conf is None:
        raise ValueError(f"{export}: config.json's architecture is not one align-pipeline exports")
    for item in sorted(export.iterdir()):
        if ALIGN_FILES.match(item.name):
            _link_or_copy(item, into / "align" / item.name)
        elif MODEL_FILES.match(item.name):
            _link_or_copy(item, into / "model" / item.name)
        else:  # tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja, ...
            _link_or_copy(item, into / "components" / "tokenizer" / item.name)
    outputs = (Schema([ColSpec("string")]) if conf["task"] == "text-generation"
               else Schema([ColSpec("string", "label"), ColSpec("double", "score")]))
    model = Model(artifact_path=artifact_location, run_id=run_id, model_uuid=model_id, model_id=model_id,
                  signature=ModelSignature(inputs=Schema([ColSpec("string")]), outputs=outputs))
    model.add_flavor("transformers", **conf)
    python = ".".join(map(str, sys.version_info[:3]))
    add_to_model(model, loader_module="mlflow.transformers", conda_env="conda.yaml", python_env="python_env.yaml")
    requirements = _versions("mlflow", "transformers", "torch", "safetensors", "accelerate")
    (into / "requirements.txt").write_text("\n".join(requirements) + "\n")
    (into / "python_env.yaml").write_text(yaml.safe_dump(
        {"python": python, "build_dependencies": _versions("pip"), "dependencies": ["-r requirements.txt"]}))
    (into / "conda.yaml").write_text(yaml.safe_dump(
        {"name": "mlflow-env", "channels": ["conda-forge"],
         "dependencies": [f"python={python}", "pip", {"pip": requirements}]}, sort_keys=False))
    model.model_size_bytes = sum(f.stat().st_size for f in into.rglob("*") if f.is_file())
    model.save(str(into / "MLmodel"))
    return into


# ---------------------------------------------------------------------------------------------------------------------
# Registration


def register(store: TrackingStore, name: str, version: str, path: str, run_id: str,
             promoted: dict[str, Any] | None = None) -> str | None:
    """Log the export at ``path`` (catalog ``name``, ``version``, made by the node run ``run_id``) as an MLflow model
    and register it; then apply ``promoted`` (the latest ``promoted_policy`` entry, if any). Returns the registered
    version, or None (one warning) for an export whose check failed or was not recorded."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.exceptions import MlflowException

    export = Path(path)
    status = read_status(path)
    if status not in ("passed", "skipped"):
        logger.warning("%s version %s: not registered in MLflow's model registry (its %s says %s)", name,
                       version, CHECK_FILE, status or "nothing: missing or unreadable")
        return None
    if flavor(export) is None:
        logger.warning("%s version %s: not registered in MLflow's model registry (config.json's architecture is not"
                       " one align-pipeline exports)", name, version)
        return None
    client = store.client()
    run = store.call(client.get_run, run_id)
    tags = {k: v for k, v in run.data.tags.items() if k.startswith(("lineage.", "kedro.run"))}
    tags[clean_key(f"lineage.out.{name}")] = version
    tags["export.check"] = status
    logged = store.call(client.create_logged_model, run.info.experiment_id, name=name, source_run_id=run_id,
                        tags=tags, model_type="transformers")
    with tempfile.TemporaryDirectory(prefix=f"{name}-mlflow-", dir=export.parent) as staging:
        stage_model(export, Path(staging), logged.model_id, run_id, logged.artifact_location)
        store.call(client.log_model_artifacts, logged.model_id, staging)
    store.call(client.finalize_logged_model, logged.model_id, LoggedModelStatus.READY)
    store.call(client.log_outputs, run_id, [LoggedModelOutput(logged.model_id, step=0)])
    try:
        store.call(client.create_registered_model, name, tags={"align.dataset": name},
                   description=f"Hugging Face exports of the catalog entry {name}")  # fmt: skip
    except MlflowException:  # already registered
        pass
    # the source is the logged model's place in the artifact store (what MLflow resolves ``models:/<model_id>`` to;
    # its registry resolves that through the process's global tracking URI, which need not be this store)
    registered = store.call(client.create_model_version, name, source=logged.artifact_location, run_id=run_id,
                            tags=tags, model_id=logged.model_id)
    logger.info("%s: registered in MLflow's model registry as models:/%s/%s", name, name, registered.version)
    if promoted:
        promote(store, promoted)
    return registered.version


# ---------------------------------------------------------------------------------------------------------------------
# Promotion


def _exported_from(client: Any, store: TrackingStore, dataset: str, checkpoint_version: str) -> list[Any]:
    """The registered versions of ``<dataset>_hf`` exported from ``dataset``'s ``checkpoint_version``, oldest first."""
    from mlflow.exceptions import MlflowException

    try:
        found = store.call(client.search_model_versions, f"name = '{dataset}_hf'")
    except MlflowException:
        return []
    key = clean_key(f"lineage.{dataset}")
    return sorted((v for v in found if v.tags.get(key) == checkpoint_version), key=lambda v: int(v.version))


def gate_version_tags(entry: dict[str, Any], policy: str) -> dict[str, str]:
    """The version tags of one evaluated policy of a ``promoted_policy`` entry: each gate's result with its numbers,
    whether it passed them all, whether it was promoted."""
    checks = entry.get("gates", {}).get(policy)
    promoted = entry.get("policy") == policy
    if checks is None:  # the reference (SFT) the gates measure the others against
        return {"gates.passed": "reference (not gated)", "evaluation.promoted": str(promoted).lower()}
    tags = {}
    for check in checks:
        value = "missing" if check["value"] is None else f"{check['value']:.4g}"
        tags[clean_key(f"gate.{check['gate'].rsplit('.', 1)[-1]}")] = (
            f"{'pass' if check['passed'] else 'fail'} ({value} vs {check['threshold']:g})")[:MAX_TAG_VALUE]
    tags["gates.passed"] = "true" if all(c["passed"] for c in checks) else "false"
    if not checks:
        tags["gates.passed"] = "true (no gates configured: evaluation.gate)"
    tags["evaluation.promoted"] = str(promoted).lower()
    return tags


def promote(store: TrackingStore, entry: dict[str, Any]) -> str | None:
    """Apply a ``promoted_policy`` entry to the registry (see the module docstring). Returns ``models:/<name>@champion``
    when the promoted policy has a registered export, else None."""
    from mlflow.exceptions import MlflowException

    client = store.client()
    for dataset, checkpoint_version in (entry.get("versions") or {}).items():
        tags = gate_version_tags(entry, dataset.removesuffix("_policy"))
        for registered in _exported_from(client, store, dataset, checkpoint_version):
            for key, value in tags.items():
                store.call(client.set_model_version_tag, registered.name, registered.version, key, value)
    dataset, checkpoint_version = entry.get("dataset"), entry.get("version")
    exports = _exported_from(client, store, dataset, checkpoint_version) if dataset and checkpoint_version else []
    if not exports:
        return None
    champion = exports[-1]
    for model in store.call(client.search_registered_models):  # one champion in the registry
        if model.name != champion.name and CHAMPION in (model.aliases or {}):
            store.call(client.delete_registered_model_alias, model.name, CHAMPION)
    try:
        current = store.call(client.get_model_version_by_alias, champion.name, CHAMPION).version
    except MlflowException:
        current = None
    if current != champion.version:
        store.call(client.set_registered_model_alias, champion.name, CHAMPION, champion.version)
        logger.info("promoted %s@%s: models:/%s@%s (version %s)", dataset, checkpoint_version, champion.name,
                    CHAMPION, champion.version)
    return f"models:/{champion.name}@{CHAMPION}"
