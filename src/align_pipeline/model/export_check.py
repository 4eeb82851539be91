"""What makes an HF export trustworthy: it packs the checkpoint's own tokenizer, and ``--check`` verifies all of it.

:func:`export_tokenizer` picks the tokenizer an export packs *before anything is written*: the one the checkpoint's
``meta.json`` records (``tokenizer.path`` + ``tokenizer.fingerprint``; a copy the artifact carries itself,
``<checkpoint>/tokenizer``, first). A tokenizer whose fingerprint differs from the recorded one (a ``--tokenizer`` of
another model, or the recorded path rewritten since by another env's data_prep) is refused with one line naming both
fingerprints and paths, as is one with more tokens than the checkpoint has embedding rows. Torch-free: the Kedro
node calls it before launching the export job.

:func:`check_export` (``align-pipeline export --check``, ``params:export.check``) runs every check on a written
export and returns one :class:`Check` per line it prints:

    vocab          the export's tokenizer (``len``, added tokens included) <= the export's embedding rows
    fingerprint    the packed tokenizer (``align_tokenizer/``) has the checkpoint's fingerprint, and the tokenizer
                   ``transformers`` loads from the export has its vocabulary
    special_tokens AutoTokenizer's bos/eos/pad ids and generation_config.json's eos ids equal ours (EOS + end of turn)
    chat_template  the same template string as ours (or none, as ours), rendering a conversation the same
    prompt_ids     a real prompt (rendered as data_prep renders prompts) tokenized by AutoTokenizer equals ours
    logits         max |dlogit| (or |dvalue|) on fixed random ids within the tolerance
    greedy         ``transformers``' ``model.generate`` (greedy) from that prompt equals our Megatron generation token
                   for token (policies; a bfloat16/float16 export may part on a near-tie within the tolerance)

Ours (logits + greedy generation) is what :mod:`align_pipeline.train.jobs.logits` computes: in the export job's own
process, or in a one-rank job the ``export --check`` command launches. The
result is written into the export as ``align_export_check.json`` (``status``: passed / failed / skipped); MLflow's
model registry takes an export only when it says passed (or skipped: the user opted out, tagged so).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from align_pipeline.errors import UserError

PACKED_TOKENIZER = "align_tokenizer"
"""The export's copy of the checkpoint's tokenizer directory (ours, byte for byte: its fingerprint is verifiable)."""
CHECK_FILE = "align_export_check.json"
"""The result of the export's checks, in the export: {"status": "passed" | "failed" | "skipped", "checks": [...]}."""
OWN_TOKENIZER = "tokenizer"
"""A copy of its tokenizer that a self-contained checkpoint artifact carries (preferred to ``meta.json``'s path)."""
PROMPTS = ["add: 12+34\n", "reverse: hello\n"]
"""Fixed real prompts of the demo task (any tokenizer encodes them; characters it lacks become its unknown token)."""
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "add: 12+34"}, {"role": "assistant", "content": "46"},
                {"role": "user", "content": "reverse: hello"}]
"""The conversation both renderers must render the same (system turn dropped for templates that refuse one)."""


class ExportRefused(UserError, ValueError):
    """The export would not carry the tokenizer its checkpoint was trained with."""


@dataclass
class Check:
    """One line of ``--check``."""

    name: str
    """vocab, fingerprint, special_tokens, chat_template, prompt_ids, logits, greedy."""
    ok: bool | None
    """True passed, False failed, None not applicable (e.g. greedy generation of a value model)."""
    detail: str
    """What was compared, with the numbers."""
    value: float | None = None
    """The measured figure where there is one (logits: max |dlogit|)."""

    def line(self) -> str:
        word = {True: "ok", False: "FAILED", None: "n/a"}[self.ok]
        return f"check {self.name}: {word} - {self.detail}"


# ---------------------------------------------------------------------------------------------------------------------
# The tokenizer an export packs (torch-free)


def _load(directory: Path, what: str):
    from align_pipeline.data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(directory)
    except (ValueError, OSError, KeyError) as exc:
        raise ExportRefused(f"{what} {directory} is not a readable tokenizer directory ({exc})") from None


def recorded_tokenizer(checkpoint: str | os.PathLike, meta: dict[str, Any]) -> tuple[Path | None, str | None]:
    """(path, fingerprint) of the tokenizer ``meta.json`` records (a relative path is the checkpoint's own);
    (None, None) when it records none."""
    entry = meta.get("tokenizer") or {}
    if not isinstance(entry, dict) or not entry.get("path"):
        return None, (entry.get("fingerprint") if isinstance(entry, dict) else None)
    path = Path(entry["path"])
    return (path if path.is_absolute() else Path(checkpoint) / path), entry.get("fingerprint")


def export_tokenizer(checkpoint: str | os.PathLike, meta: dict[str, Any], given: str | os.PathLike | None = None):
    """The tokenizer (a :class:`~align_pipeline.data.tokenizer.TextTokenizer`) an export of ``checkpoint`` packs, or
    None when the checkpoint records none and none is given. ``given`` (``--tokenizer``) must have the recorded
    fingerprint; without it, the checkpoint's own copy (``<checkpoint>/tokenizer``) or the recorded path, which
    must still hold the recorded fingerprint. Raises :class:`ExportRefused` (one line, both fingerprints and paths)."""
    checkpoint = Path(checkpoint)
    path, fingerprint = recorded_tokenizer(checkpoint, meta)
    recorded = f"{checkpoint / 'meta.json'} records tokenizer {fingerprint or '(no fingerprint)'} ({path or 'no path'})"
    if given is not None:
        tok = _load(Path(given), "--tokenizer")
        if fingerprint is not None and tok.fingerprint != fingerprint:
            raise ExportRefused(f"{recorded}; --tokenizer {given} is tokenizer {tok.fingerprint}: export with the "
                                f"checkpoint's own tokenizer (leave out --tokenizer) or a directory holding {fingerprint}")
    else:
        own = checkpoint / OWN_TOKENIZER
        candidates = [own] if own.is_dir() else []
        candidates += [path] if path is not None else []
        if not candidates:
            return None
        for directory in candidates:
            if not directory.is_dir():
                continue
            tok = _load(directory, "tokenizer")
            if fingerprint is None or tok.fingerprint == fingerprint:
                break
        else:
            found = [d for d in candidates if d.is_dir()]
            if not found:
                raise ExportRefused(f"{recorded}, which is gone: export with --tokenizer DIR holding tokenizer "
                                    f"{fingerprint or 'the one it was trained with'}")
            actual = _load(found[-1], "tokenizer").fingerprint
            raise ExportRefused(f"{recorded}, but {found[-1]} now holds tokenizer {actual} (rewritten by another "
                                f"data_prep run or env?): export with --tokenizer DIR holding tokenizer {fingerprint}")
    rows = int(meta["vocab_size"])
    if tok.vocab_size > rows:
        raise ExportRefused(f"tokenizer {tok.fingerprint} ({given or path}) has {tok.vocab_size} tokens but "
                            f"{checkpoint} has only {rows} embedding rows: not the tokenizer it was trained with")
    return tok


# ---------------------------------------------------------------------------------------------------------------------
# --check


def write_result(hf_dir: str | os.PathLike, status: str, checks: list[Check]) -> None:
    """``align_export_check.json`` in the export (what the model registry reads)."""
    blob = {"status": status, "checks": [asdict(c) for c in checks]}
    (Path(hf_dir) / CHECK_FILE).write_text(json.dumps(blob, indent=2) + "\n")


def read_status(hf_dir: str | os.PathLike) -> str | None:
    """``status`` of the export's ``align_export_check.json`` (None when it has none or it is unreadable)."""
    try:
        status = json.loads((Path(hf_dir) / CHECK_FILE).read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None
    return status if status in ("passed", "failed", "skipped") else None


def _embedding_rows(hf_dir: Path) -> int | None:
    """Rows of ``model.embed_tokens.weight`` read from the safetensors headers (not from config.json)."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    for name in files:
        with safe_open(str(hf_dir / name), framework="pt") as f:
            if "model.embed_tokens.weight" in f.keys():  # noqa: SIM118 - safe_open has no __contains__
                return int(f.get_slice("model.embed_tokens.weight").get_shape()[0])
    return None


def _messages(template) -> list[dict[str, str]]:
    """:data:`CONVERSATION`, without its system turn when the template refuses one."""
    try:
        template.render(CONVERSATION)
        return CONVERSATION
    except Exception:  # noqa: BLE001 - a template may raise_exception() on a system turn; try without it
        return CONVERSATION[1:]


def _our_side(checkpoint: Path, meta: dict[str, Any], prompt: list[int] | None, tok, max_new_tokens: int, seed: int,
              our_side: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Our logits on fixed random ids and our greedy continuation of ``prompt``, from ``our_side`` (a request of
    :mod:`align_pipeline.train.jobs.logits`)."""
    import numpy as np

    from align_pipeline.config.base import from_dict
    from align_pipeline.config.common import ModelConfig

    model_cfg = from_dict(ModelConfig, meta["model"], "meta.json model")
    length = min(16, model_cfg.seq_length)
    tokens = np.random.default_rng(seed).integers(0, int(meta["vocab_size"]), size=(2, length)).tolist()
    request: dict[str, Any] = {"checkpoint": str(checkpoint), "tokens": tokens}
    if prompt is not None:
        request["generate"] = {"prompt": prompt, "max_new_tokens": max_new_tokens, "eos_id": list(tok.stop_ids),
                               "pad_id": tok.pad_id}
    return {"tokens": tokens, **our_side(request)}


def check_export(checkpoint: str | os.PathLike, hf_dir: str | os.PathLike, tolerance: float,
                 our_side: Callable[[dict[str, Any]], dict[str, Any]], max_new_tokens: int = 12,
                 seed: int = 0) -> list[Check]:
    """Every check of the export ``hf_dir`` of ``checkpoint`` (see the module docstring). ``our_side(request)``:
    our outputs for a request of :mod:`align_pipeline.train.jobs.logits` (``{"checkpoint", "tokens", "generate"?}``
    -> ``{"logits", "generated"?}``): the export job computes them in its own process, the command in a one-rank
    job (:func:`align_pipeline.launch.model_jobs.checkpoint_outputs`), whose failure it raises."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from align_pipeline.data.formats import checkpoint_meta
    from align_pipeline.data.tokenize import renderer_for

    checkpoint, hf_dir = Path(checkpoint), Path(hf_dir)
    meta = checkpoint_meta(checkpoint)
    head = meta.get("head", "lm")
    checks: list[Check] = []
    _, fingerprint = recorded_tokenizer(checkpoint, meta)
    has_hf_tokenizer = (hf_dir / "tokenizer.json").is_file() or (hf_dir / "tokenizer_config.json").is_file()

    # the packed tokenizer ("ours" from here on) and its fingerprint
    ours = None
    packed = hf_dir / PACKED_TOKENIZER
    if packed.is_dir():
        try:
            ours = _load(packed, "the packed tokenizer")
        except ExportRefused as exc:
            checks.append(Check("fingerprint", False, str(exc)))
    if ours is None and not checks:
        try:  # an export made before tokenizers were packed: the checkpoint's own, verified
            ours = export_tokenizer(checkpoint, meta)
        except ExportRefused as exc:
            checks.append(Check("fingerprint", False, str(exc)))
    hf_tok = None
    if has_hf_tokenizer:
        try:
            hf_tok = AutoTokenizer.from_pretrained(str(hf_dir))
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
            checks.append(Check("special_tokens", False, f"transformers cannot load the tokenizer of {hf_dir}: "
                                f"{type(exc).__name__}: {exc}"))
    config = AutoConfig.from_pretrained(str(hf_dir))
    rows = _embedding_rows(hf_dir)

    # vocab
    if hf_tok is None and ours is None:
        checks.append(Check("vocab", None if fingerprint is None else False,
                            "the export packs no tokenizer" + ("" if fingerprint is None else
                                                               f" (the checkpoint was trained with {fingerprint})")))
    else:
        n = len(hf_tok) if hf_tok is not None else ours.vocab_size
        ok = rows is not None and n <= rows and config.vocab_size == rows
        checks.append(Check("vocab", ok, f"tokenizer {n} tokens (added included) <= {rows} embedding rows "
                            f"(config.json vocab_size {config.vocab_size})"))
    if ours is not None:
        # fingerprint: ours is the checkpoint's, and transformers loads the same vocabulary from the export
        same_fp = fingerprint is None or ours.fingerprint == fingerprint
        hf_vocab = hf_tok.get_vocab() if hf_tok is not None else None
        our_vocab = ours.tokenizer.get_vocab(with_added_tokens=True)
        same_vocab = hf_vocab == our_vocab
        detail = (f"packed tokenizer {ours.fingerprint}, checkpoint's {fingerprint or '(not recorded)'}; "
                  f"AutoTokenizer's vocabulary ({len(hf_vocab or {})} entries) "
                  + ("is the packed one's" if same_vocab else f"differs from the packed one's ({len(our_vocab)})"))
        checks.append(Check("fingerprint", same_fp and same_vocab, detail))
    if ours is None or hf_tok is None:
        if ours is not None and not has_hf_tokenizer:
            checks.append(Check("special_tokens", False, f"{hf_dir} has no tokenizer files transformers loads"))
        prompt = None
    else:
        # special tokens and generation_config.json's eos ids
        theirs_ids = (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id)
        our_ids = (ours.bos_id, ours.eos_id, ours.pad_id)
        gen_file = hf_dir / "generation_config.json"
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
        gen_eos = set(gen_eos if isinstance(gen_eos, list) else [gen_eos]) - {None}
        ok = theirs_ids == our_ids and gen_eos == set(ours.stop_ids)
        checks.append(Check("special_tokens", ok, f"bos/eos/pad ids {theirs_ids} vs ours {our_ids}; "
                            f"generation_config eos {sorted(gen_eos)} vs our stop ids {sorted(ours.stop_ids)}"))
        # chat template
        template = ours.chat_template
        if template is None:
            checks.append(Check("chat_template", not hf_tok.chat_template,
                                "none, as the checkpoint's" if not hf_tok.chat_template else
                                "the export has a chat template, the checkpoint's tokenizer none"))
        else:
            messages = _messages(template)
            same_source = hf_tok.chat_template == template.source
            try:
                rendered = hf_tok.apply_chat_template(messages, tokenize=False)
            except Exception as exc:  # noqa: BLE001
                rendered = f"<{type(exc).__name__}: {exc}>"
            same_text = rendered == template.render(messages)
            checks.append(Check("chat_template", same_source and same_text,
                                f"template string {'equal' if same_source else 'DIFFERS'}; a {len(messages)}-turn "
                                f"conversation renders {'the same' if same_text else 'DIFFERENTLY'}"))
        # a real prompt, as data_prep renders prompts, tokenized both ways
        renderer = renderer_for(ours)
        prompt = renderer.prompt(PROMPTS[0])
        if template is None:
            theirs_prompt = hf_tok(PROMPTS[0])["input_ids"]
        else:
            text = hf_tok.apply_chat_template(_messages_for_prompt(PROMPTS[0]), tokenize=False,
                                              add_generation_prompt=True)
            theirs_prompt = hf_tok(text, add_special_tokens=not text.startswith(hf_tok.bos_token or "\0"))["input_ids"]
        checks.append(Check("prompt_ids", theirs_prompt == prompt,
                            f"{PROMPTS[0]!r} -> {len(prompt)} ids; AutoTokenizer "
                            + ("the same" if theirs_prompt == prompt else f"{theirs_prompt} vs ours {prompt}")))
        if head != "lm" or max(prompt, default=0) >= int(meta["vocab_size"]):
            prompt = None

    # ours (Megatron) vs theirs (transformers): logits on random ids, then greedy generation
    result = _our_side(checkpoint, meta, prompt, ours, max_new_tokens, seed, our_side)
    ids = torch.tensor(result["tokens"])
    model, theirs = None, None
    try:
        from align_pipeline.model.hf import hf_outputs, load_hf

        with torch.no_grad():
            model = load_hf(hf_dir, head)
            theirs = hf_outputs(model, head, ids)
    except Exception as exc:  # noqa: BLE001 - the export failing on ids of the real vocabulary is the finding
        checks.append(Check("logits", False, f"transformers fails on ids < {meta['vocab_size']}: "
                            f"{type(exc).__name__}: {exc}"))
    ours_logits = torch.tensor(result["logits"], dtype=torch.float32)
    if theirs is None:
        pass
    elif tuple(theirs.shape) != tuple(ours_logits.shape):
        checks.append(Check("logits", False, f"output shapes differ: HF {tuple(theirs.shape)} vs ours "
                            f"{tuple(ours_logits.shape)}"))
    else:
        diff = float((theirs - ours_logits).abs().max())
        checks.append(Check("logits", diff <= tolerance, f"max |dlogit| = {diff:.3g} (tolerance {tolerance:g}) on "
                            f"{ids.shape[0]}x{ids.shape[1]} random ids", diff))
    if head != "lm":
        checks.append(Check("greedy", None, "a value model does not generate"))
    elif prompt is None:
        checks.append(Check("greedy", False, "no prompt the checkpoint's vocabulary can encode (see above)"))
    elif model is None:
        checks.append(Check("greedy", False, "transformers cannot load the export (see logits)"))
    else:
        try:
            checks.append(_greedy(model, prompt, result["generated"], ours, max_new_tokens, tolerance,
                                  str(config.dtype) in ("float32", "torch.float32")))
        except Exception as exc:  # noqa: BLE001 - generate failing (an IndexError) is the finding
            checks.append(Check("greedy", False, f"transformers' generate fails: {type(exc).__name__}: {exc}"))
    return checks


def _messages_for_prompt(prompt: str) -> list[dict[str, str]]:
    from align_pipeline.data.chat import prompt_messages

    return prompt_messages(prompt)


def _greedy(model, prompt: list[int], ours: list[int], tok, max_new_tokens: int, tolerance: float,
            exact: bool) -> Check:
    """``model.generate`` (greedy, our stop ids) from ``prompt`` vs our tokens. A bfloat16/float16 export may part
    where our token's logit is within ``tolerance`` of the export's best (a near-tie its rounding decides)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=list(tok.stop_ids), pad_token_id=tok.pad_id)
    theirs = out[0, len(prompt):].tolist()
    stop = next((j + 1 for j, t in enumerate(theirs) if t in tok.stop_ids), None)
    theirs = theirs[: stop or len(theirs)]
    shown = f"{len(ours)} new tokens from {len(prompt)} prompt ids"
    if theirs == ours:
        return Check("greedy", True, f"transformers' generate equals ours token for token ({shown}: {ours})")
    k = next((j for j, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
    if not exact and k < len(ours):  # teacher-force ours: a near-tie at the first difference?
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ours[: k + 1]])).logits[0, len(prompt) + k - 1]
        gap = float(logits.max() - logits[ours[k]])
        if gap <= tolerance:
            return Check("greedy", True, f"equal up to a near-tie at new token {k} (logit gap {gap:.3g} <= "
                         f"{tolerance:g} in this dtype); {shown}")
    return Check("greedy", False, f"transformers' generate {theirs} vs ours {ours}: they part at new token {k}")
