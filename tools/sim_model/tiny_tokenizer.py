"""A real byte-level BPE tokenizer for the tiny GLM, trained locally with the `tokenizers` library.

GLM-family special tokens and a GLM-style chat template (honouring `enable_thinking`) make chat
requests, reasoning parsing and stop tokens behave as they do with the real model.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import TRAINING_TEXT

# GLM-4.x special tokens (names as in the real tokenizer); kept at the top of the id range as GLM does.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)

# Thinking on: the prompt ends in "<think>" and the model writes its reasoning first. Thinking off: the
# prompt closes an empty think block so the reply is plain content (what the benchmark and canary use).
CHAT_TEMPLATE = """\
[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions. Available tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
{%- endif -%}
{%- for message in messages -%}
{%- set content = message.content if message.content is string else '' -%}
{%- if message.role == 'system' -%}
<|system|>
{{ content }}
{%- elif message.role == 'user' -%}
<|user|>
{{ content }}
{%- elif message.role == 'assistant' -%}
<|assistant|>
{%- if message.reasoning_content is defined and message.reasoning_content -%}
<think>{{ message.reasoning_content }}</think>
{%- else -%}
<think></think>
{%- endif -%}
{{ content }}
{%- if message.tool_calls is defined and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
<tool_call>{{ fn.name }}
{%- set args = fn.arguments if fn.arguments is mapping else {} -%}
{%- for key, value in args.items() -%}
<arg_key>{{ key }}</arg_key><arg_value>{{ value if value is string else value | tojson }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- endif -%}
{%- elif message.role == 'tool' -%}
<|observation|>
<tool_response>{{ content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>
{%- if enable_thinking is defined and not enable_thinking -%}
<think></think>
{%- else -%}
<think>
{%- endif -%}
{%- endif -%}
"""


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE over TRAINING_TEXT with the special tokens appended last (ids at the top)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Training is deterministic for a fixed text; repeating the text weights whole words over bytes.
    tokenizer.train_from_iterator([TRAINING_TEXT] * 4, trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    ids = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise RuntimeError(f"special tokens not in vocabulary: {missing}")
    return {name: int(i) for name, i in ids.items()}


def tokenizer_config(max_length: int) -> dict[str, object]:
    """tokenizer_config.json: transformers and vLLM take the template and eos/pad from here."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "padding_side": "left",
        "remove_space": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, outdir: Path, max_length: int) -> None:
    tokenizer.save(str(outdir / "tokenizer.json"))
    (outdir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(max_length), indent=2) + "\n")
