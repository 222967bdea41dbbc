"""A tiny Qwen2 chat model built locally: a byte-level BPE tokenizer with Qwen2.5's special tokens, pre-tokenizer
and chat template (tools included), and a randomly initialised Qwen2 from ``relayrl.models.tiny.build_model``.

What agentic episodes need from a real chat model is all here: ``<|im_start|>``/``<|im_end|>`` turns, the
``\\n`` the template writes after ``<|im_end|>`` (never sampled), ``<tool_call>`` / ``</tool_call>`` as single added
tokens, tool results grouped into one user turn of ``<tool_response>`` blocks, and digits split one per token.
The BPE merges are trained on a small corpus of chat text, so the vocabulary stays a few hundred tokens.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from relayrl.models.tiny import build_model

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# Qwen2's pre-tokenizer pattern: words, single digits, punctuation runs, newlines, spaces
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_SYSTEM = "You are a helpful assistant."

# Qwen2.5-Instruct's chat template (tools in the system turn, Hermes <tool_call> JSON, tool results grouped in one
# user turn), with a shorter default system prompt.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- '" + DEFAULT_SYSTEM + "' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided '
    'with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Text the BPE merges are learnt from: the chat markup, tool-call JSON and the guessing game's words.
CORPUS = [
    DEFAULT_SYSTEM,
    "# Tools You may call one or more functions to assist with the user query.",
    "You are provided with function signatures within <tools></tools> XML tags:",
    "For each function call, return a json object with function name and arguments within XML tags:",
    '{"type": "function", "function": {"name": "guess", "description": "Guess the number", '
    '"parameters": {"type": "object", "properties": {"number": {"type": "integer", "minimum": 1}}, '
    '"required": ["number"]}}}',
    '{"name": "guess", "arguments": {"number": 4}}',
    "<tool_response> higher lower correct </tool_response>",
    "Find the number. Call guess, or just say a number. Guess my number between 1 and 8.",
    "Say a number from 1 to 8. unknown tool: use guess. number must be an integer from 1 to 8",
    "system user assistant tool",
]


def build_chat_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Qwen2's pre-tokenizer, ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (EOS) as
    special tokens, ``<tool_call>``/``</tool_call>`` as plain added tokens, and Qwen2.5's chat template."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=ENDOFTEXT, eos_token=IM_END)
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tok.add_tokens([TOOL_CALL, TOOL_CALL_END])  # Qwen2.5: added tokens, not special (kept by skip_special_tokens)
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    return tok


# builtin:tiny-chat: its size, and the pretraining on the guessing game's format (relayrl/models/chat_pretrain.py)
CHAT_MODEL_SIZES = {"hidden_size": 64, "layers": 2, "heads": 4, "kv_heads": 2, "max_positions": 512}
PRETRAIN = {"count": 256, "high": 4, "number_share": 0.25, "max_turns": 4, "steps": 80, "batch_size": 16, "lr": 3e-3}


def write_tiny_chat_model(path: str | Path, *, seed: int = 0, pretrain: bool = True) -> Path:
    """Build the chat tokenizer and a Qwen2 of ``CHAT_MODEL_SIZES``, pretrained (``pretrain``) on the guessing
    game's format as ``PRETRAIN`` says; save both as a Hugging Face model directory; returns the path."""
    from relayrl.models.chat_pretrain import guess_transcripts
    from relayrl.models.chat_pretrain import pretrain as pretrain_model

    path = Path(path)
    tokenizer = build_chat_tokenizer()
    model = build_model(tokenizer, seed=seed, **CHAT_MODEL_SIZES)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    if pretrain:
        p = PRETRAIN
        examples = guess_transcripts(
            tokenizer, count=p["count"], seed=seed, high=p["high"], number_share=p["number_share"],
            max_turns=p["max_turns"],
        )  # fmt: skip
        pretrain_model(
            model, examples, pad_id=tokenizer.pad_token_id, steps=p["steps"], batch_size=p["batch_size"],
            lr=p["lr"], seed=seed,
        )  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
