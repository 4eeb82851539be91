"""Tiny HF tokenizer directories with chat templates in the styles of today's model families (made here with
`tokenizers` + `transformers`, never downloaded): ChatML (Qwen: no BOS), Llama 3 (BOS written by the template and
added by the post-processor, ``<|eot_id|>`` ends a turn), Mistral (``[INST]``, ``</s>`` ends a turn, roles must
alternate)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)
MISTRAL = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{%- else %}{{ m['content'] + eos_token }}{%- endif %}{%- endfor %}"
)
# SteerLM-style: an assistant turn's attribute label is rendered before its content.
STEERLM = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{%- if m['label'] is defined %}{{ '<label>' + m['label'] + '\n' }}{%- endif %}"
    "{{ m['content'] + '<|im_end|>' + '\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
# Drops the content of earlier assistant turns (as reasoning templates drop past thinking): not prefix-consistent.
FORGETFUL = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n<|im_end|>\n' }}{%- else %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

# ChatML with tools (Qwen 2.5-like): the tools' schemas in a system block, an assistant's tool calls as
# <tool_call>{json}</tool_call>, tool answers as "tool" turns.
CHATML_TOOLS = (
    "{%- if tools %}{{ '<|im_start|>system\n# Tools\n' }}{%- for t in tools %}{{ t | tojson + '\n' }}{%- endfor %}"
    "{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{%- if m['content'] %}{{ m['content'] }}"
    "{%- endif %}{%- if m['tool_calls'] is defined and m['tool_calls'] %}{%- for c in m['tool_calls'] %}"
    "{{ '<tool_call>' + {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson"
    " + '</tool_call>' }}{%- endfor %}{%- endif %}{{ '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

STYLES = {
    "chatml": {"template": CHATML, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
               "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "post_bos": False},
    "llama3": {"template": LLAMA3, "bos": "<|begin_of_text|>", "eos": "<|end_of_text|>", "pad": None,
               "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>"], "post_bos": True, "generation_eos": ["<|end_of_text|>", "<|eot_id|>"]},
    "mistral": {"template": MISTRAL, "bos": "<s>", "eos": "</s>", "pad": None,
                "specials": ["<unk>", "<s>", "</s>"], "post_bos": True},
    "steerlm": {"template": STEERLM, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
                "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "post_bos": False},
    "chatml_tools": {"template": CHATML_TOOLS, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
                     "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "post_bos": False},
    "forgetful": {"template": FORGETFUL, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
                  "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "post_bos": False},
}

CORPUS = [
    "You are a helpful assistant.",
    "What is 12 + 30? The answer is 42.",
    "Reverse the word hello: olleh. Solve: 3 * 4 = 12, so #### 12",
    "user assistant system \\boxed{7} quality:4,toxicity:0 Natalia sold 48 clips in April.",
    'tool <tool_call>{"name": "calculator", "arguments": {"expression": "12 + 30"}}</tool_call> # Tools',
]


def make_chat_tokenizer_dir(path: Path, style: str) -> Path:
    """An HF tokenizer directory (tokenizer.json, tokenizer_config.json with the chat template, special tokens map,
    generation_config.json) in ``style``; byte-level BPE trained on a small corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = STYLES[style]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["specials"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 4, trainer=trainer)
    if spec["post_bos"]:
        bos = spec["bos"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    kwargs = {"bos_token": spec["bos"], "eos_token": spec["eos"]}
    if spec["pad"]:
        kwargs["pad_token"] = spec["pad"]
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    fast.chat_template = spec["template"]
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    if "generation_eos" in spec:
        ids = [backend.token_to_id(t) for t in spec["generation_eos"]]
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return path
