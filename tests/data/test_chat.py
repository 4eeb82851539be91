"""Chat templates: rendering equals transformers', the loss covers exactly the assistant turns (decoded back to their
text), prompts are rendered with the generation prompt the same way for training and generation, BOS per tokenizer."""

import json

import numpy as np
import pytest
from chat_tokenizers import make_chat_tokenizer_dir

from align_pipeline.data.schemas import DataValidationError, parse_jsonl_bytes
from align_pipeline.data.store import as_rows
from align_pipeline.data.tokenize import DataPrepConfig, encode
from align_pipeline.data.tokenizer import TokenizerConfig, load_tokenizer

CONVERSATION = {
    "system": "You are a helpful assistant.",
    "conversations": [
        {"from": "User", "value": "What is 12 + 30?"},
        {"from": "Assistant", "value": "The answer is 42."},
        {"from": "User", "value": "Reverse the word hello"},
        {"from": "Assistant", "value": "olleh"},
    ],
}
NO_SYSTEM = {"conversations": CONVERSATION["conversations"]}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}

def _rows(enc, tok, seq_length):
    """Every sample padded to seq_length (the rows a batch of them would hold)."""
    return as_rows(enc.arrays, seq_length, tok.pad_id)



@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    return {s: make_chat_tokenizer_dir(root / s, s) for s in ("chatml", "llama3", "mistral", "steerlm", "forgetful")}


def _raw(kind, records):
    blob = "".join(json.dumps(r) + "\n" for r in records).encode()
    return parse_jsonl_bytes(blob, kind, f"data/01_raw/{kind}.jsonl")


def _messages(record):
    out = [{"role": "system", "content": record["system"]}] if "system" in record else []
    return out + [{"role": t["from"].lower(), "content": t["value"]} for t in record["conversations"]]


@pytest.mark.parametrize("style", ["chatml", "llama3", "mistral"])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_rendering_equals_transformers(hf_dirs, style, generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_dirs[style]))
    tok = load_tokenizer(hf_dirs[style])
    record = NO_SYSTEM if style == "mistral" else CONVERSATION
    messages = _messages(record)[: -1 if generation_prompt else None]
    ours = tok.chat_template.render(messages, add_generation_prompt=generation_prompt)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


@pytest.mark.parametrize("style", ["chatml", "llama3", "mistral"])
def test_sft_loss_is_exactly_the_assistant_turns(hf_dirs, style):
    from transformers import AutoTokenizer

    tok = load_tokenizer(hf_dirs[style])
    hf = AutoTokenizer.from_pretrained(str(hf_dirs[style]))
    record = NO_SYSTEM if style == "mistral" else CONVERSATION
    a = _rows(encode(_raw("sft", [record]), tok, 128), tok, 128)
    L = int((a["input_ids"][0] != tok.pad_id).sum()) if tok.pad_id not in tok.stop_ids else None
    ids = a["input_ids"][0].tolist()
    # The sequence is the template's text, tokenized as transformers tokenizes it, with exactly one BOS where the
    # tokenizer has one (the Llama/Mistral templates write it; it is not added a second time).
    text = hf.apply_chat_template(_messages(record), tokenize=False)
    expected = hf(text, add_special_tokens=False)["input_ids"]
    assert ids[: len(expected)] == expected, (L, tok.decode(ids, skip_special_tokens=False))
    if tok.bos_id is not None:
        assert ids[0] == tok.bos_id and ids[1] != tok.bos_id
    else:
        assert style == "chatml"
    # The supervised labels decode to the assistant turns, each with its end-of-turn marker, and nothing else.
    supervised = a["labels"][0][a["loss_mask"][0] == 1]
    eot = END_OF_TURN[style]
    want = "".join(t["value"] + eot for t in record["conversations"] if t["from"] == "Assistant")
    assert tok.decode(supervised, skip_special_tokens=False) == want
    # ... and the end-of-turn token stops generation.
    assert tok.id_to_token(supervised[-1]) == eot and supervised[-1] in tok.stop_ids


@pytest.mark.parametrize("style", ["chatml", "llama3", "mistral"])
def test_prompts_render_like_training_with_the_generation_prompt(hf_dirs, style):
    from transformers import AutoTokenizer

    tok = load_tokenizer(hf_dirs[style])
    hf = AutoTokenizer.from_pretrained(str(hf_dirs[style]))
    prompt = "What is 12 + 30?"
    recs = [{"prompt": prompt, "answer": "42", "category": "math"}]
    (rec,) = encode(_raw("prompts", recs), tok, 64).records
    text = hf.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    assert rec["prompt_ids"] == hf(text, add_special_tokens=False)["input_ids"]
    assert rec["category"] == "math" and rec["prompt"] == prompt and rec["answer"] == "42"  # fields kept
    # A preference pair's response starts right where the generation prompt ends (same rendering as generation).
    pair = {"prompt": prompt, "chosen_response": "The answer is 42.", "rejected_response": "41"}
    p = _rows(encode(_raw("preference", [pair]), tok, 64), tok, 64)
    n = len(rec["prompt_ids"])
    assert p["chosen_input_ids"][0, :n].tolist() == rec["prompt_ids"]
    first_loss = int(np.argmax(p["chosen_loss_mask"][0]))
    assert first_loss == n - 1  # label n-1 = token n = the first response token


def test_use_chat_template_false_keeps_the_plain_layout(hf_dirs):
    tok = load_tokenizer(hf_dirs["llama3"])
    config = DataPrepConfig(tokenizer=TokenizerConfig(use_chat_template=False))
    (rec,) = encode(_raw("prompts", [{"prompt": "What is 12 + 30?"}]), tok, 64, config).records
    assert rec["prompt_ids"] == [tok.bos_id] + tok.encode("What is 12 + 30?")


def test_qwen_style_has_no_bos_and_eos_is_never_bos(hf_dirs, tmp_path):
    tok = load_tokenizer(hf_dirs["chatml"])
    assert tok.bos_id is None and tok.start_ids() == [] and not tok.add_bos
    # Qwen's config.json names bos_token_id = <|endoftext|> while tokenizer_config says bos_token: null
    cfg = json.loads((hf_dirs["chatml"] / "tokenizer_config.json").read_text())
    assert cfg.get("bos_token") is None
    saved = tmp_path / "saved"
    tok.save(saved)
    again = load_tokenizer(saved)
    assert (again.bos_id, again.stop_ids, again.fingerprint) == (None, tok.stop_ids, tok.fingerprint)
    assert again.chat_template is not None and again.chat_template.source == tok.chat_template.source


def test_llama3_stop_ids_include_end_of_turn(hf_dirs):
    tok = load_tokenizer(hf_dirs["llama3"])
    eot = tok.tokenizer.token_to_id("<|eot_id|>")
    assert tok.eos_id == tok.tokenizer.token_to_id("<|end_of_text|>") and eot in tok.stop_ids and tok.add_bos


def test_steerlm_labels_are_kept(hf_dirs):
    tok = load_tokenizer(hf_dirs["steerlm"])
    record = {"conversations": [{"from": "User", "value": "What is 12 + 30?"},
                                {"from": "Assistant", "value": "42", "label": "quality:4,toxicity:0"}]}
    a = _rows(encode(_raw("sft", [record]), tok, 96), tok, 96)
    text = tok.decode(a["input_ids"][0], skip_special_tokens=False)
    assert "<label>quality:4,toxicity:0\n42<|im_end|>" in text
    # The label conditions the turn: it is part of the rendered assistant turn, so its tokens are trained on too in
    # this template; the plain layout (no template) puts it before the turn as context with no loss.
    plain = load_tokenizer(hf_dirs["steerlm"])
    plain_config = DataPrepConfig(tokenizer=TokenizerConfig(use_chat_template=False))
    supervised = _rows(encode(_raw("sft", [record]), plain, 96, plain_config), plain, 96)
    sup = supervised["labels"][0][supervised["loss_mask"][0] == 1]
    assert plain.decode(sup, skip_special_tokens=False) == "42" + plain.id_to_token(plain.eos_id)
    assert "quality:4,toxicity:0\n42" in plain.decode(supervised["input_ids"][0], skip_special_tokens=False)


def test_template_errors_name_file_and_line(hf_dirs):
    mistral = load_tokenizer(hf_dirs["mistral"])
    with pytest.raises(DataValidationError, match=r"sft\.jsonl line 2: field \"conversations\": .*must alternate"):
        encode(_raw("sft", [NO_SYSTEM, CONVERSATION]), mistral, 128)  # a system turn breaks the alternation
    forgetful = load_tokenizer(hf_dirs["forgetful"])
    encode(_raw("sft", [{"input": "q", "output": "a"}]), forgetful, 64)  # one turn is fine
    with pytest.raises(DataValidationError, match=r"line 1: .*renders assistant turn 1 differently"):
        encode(_raw("sft", [NO_SYSTEM]), forgetful, 128)


BROKEN = "{%- for m in messages %}\n{{ m['content'] }}\n{{ m['role'] | shout }}\n{%- endfor %}"  # line 3: no filter


def _copy_without_template(src, dst):
    import shutil

    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst, config


def test_template_that_does_not_compile_names_its_source_and_line(hf_dirs, tmp_path, monkeypatch):
    from align_pipeline.config.base import ConfigError, from_dict
    from align_pipeline.data.chat import ChatTemplateError
    from align_pipeline.data.tokenizer import load_hf_tokenizer

    monkeypatch.chdir(tmp_path)
    # chat_template.jinja (what transformers writes today)
    jinja, _ = _copy_without_template(hf_dirs["chatml"], tmp_path / "jinja")
    (jinja / "chat_template.jinja").write_text(BROKEN)
    with pytest.raises(ChatTemplateError) as excinfo:
        load_tokenizer(jinja)
    assert str(excinfo.value) == "chat template in jinja/chat_template.jinja: line 3: No filter named 'shout'."
    # tokenizer_config.json's chat_template: a string, or a list of named templates
    config_dir, config = _copy_without_template(hf_dirs["chatml"], tmp_path / "config")
    (config_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% if %}"}))
    with pytest.raises(ChatTemplateError, match=r'^chat template in config/tokenizer_config\.json \("chat_template"\): '
                       r"line 1: Expected an expression, got 'end of statement block'$"):  # fmt: skip
        load_hf_tokenizer(config_dir)
    named = [{"name": "default", "template": BROKEN}, {"name": "tool_use", "template": "{{ messages }}"}]
    (config_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    with pytest.raises(ChatTemplateError, match=r'tokenizer_config\.json \("chat_template", "default"\): line 3: '):
        load_hf_tokenizer(config_dir)
    # chat_template.json (processors)
    (config_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (config_dir / "chat_template.json").write_text(json.dumps({"chat_template": BROKEN}))
    with pytest.raises(ChatTemplateError, match=r'^chat template in config/chat_template\.json \("chat_template"\): line 3'):
        load_hf_tokenizer(config_dir)
    # data_prep.tokenizer.chat_template: refused when the parameters are validated, naming the key
    (tmp_path / "mine.jinja").write_text(BROKEN)
    with pytest.raises(ConfigError) as excinfo:
        from_dict(TokenizerConfig, {"chat_template": "mine.jinja"}, "params:data_prep.tokenizer")
    assert str(excinfo.value) == ("chat template in mine.jinja (params:data_prep.tokenizer.chat_template): line 3: "
                                  "No filter named 'shout'.")  # fmt: skip


def test_rendering_errors_name_the_template_line_and_the_record(hf_dirs, tmp_path, monkeypatch):
    from align_pipeline.data.tokenizer import with_chat_template

    monkeypatch.chdir(tmp_path)
    (tmp_path / "strict.jinja").write_text(
        "{%- for m in messages %}\n{{ m['content'] }}\n"
        "{%- if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}\n"
        "{{ m['missing']['deeper'] }}{%- endfor %}"
    )
    tok = with_chat_template(load_tokenizer(hf_dirs["chatml"]), "strict.jinja")
    with pytest.raises(DataValidationError) as excinfo:
        encode(_raw("sft", [CONVERSATION]), tok, 128)
    assert str(excinfo.value) == ('data/01_raw/sft.jsonl line 1: field "conversations": chat template in strict.jinja: '
                                  "line 3: no system turns")  # fmt: skip
    with pytest.raises(DataValidationError) as excinfo:
        encode(_raw("sft", [NO_SYSTEM]), tok, 128)
    assert str(excinfo.value).endswith("chat template in strict.jinja: line 4: 'dict object' has no attribute 'missing'")
