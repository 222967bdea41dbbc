"""A tiny Qwen2-style causal LM and a word-level tokenizer, built locally (there is no model hub here).

Both are saved with ``save_pretrained`` so every other part of relayrl loads them through the same
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` code a real model uses.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS, UNK = "<pad>", "<|endoftext|>", "<unk>"
WORDS = [str(d) for d in range(10)] + ["+", "-", "*", "=", "?", "max", "min", "sum", "of", "is"]


def build_tokenizer(chat_template: str | None = None, *, filler_words: int = 0) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over digits, a few operators and words (and ``filler_words`` more: w0, w1, ...);
    whitespace splits words."""
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *WORDS, *(f"w{i}" for i in range(filler_words))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 64,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 (GQA, RoPE, RMSNorm, SwiGLU) sized by the arguments."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def write_tiny_model(path: str | Path, *, seed: int = 0, chat_template: str | None = None, **sizes: int) -> Path:
    """Build tokenizer + model and save both as a Hugging Face model directory; returns the path."""
    path = Path(path)
    tokenizer = build_tokenizer(chat_template)
    model = build_model(tokenizer, seed=seed, **sizes)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_long_tail_model(
    path: str | Path, *, mean_length: int = 48, hidden_size: int = 256, layers: int = 4, seed: int = 0
) -> Path:
    """A model whose sampled responses have geometric lengths with mean ~``mean_length`` tokens (EOS included).

    The vocabulary is padded with filler words to ``mean_length`` tokens and the final norm's weight scaled by
    1e-2, so the next-token distribution is near uniform: EOS comes with probability ~1 / ``mean_length`` at every
    step, whatever the context, and a small learning rate leaves it so. RoPE positions reach 512 (prompt + 256).
    """
    tokenizer = build_tokenizer(filler_words=mean_length - 3 - len(WORDS))
    model = build_model(tokenizer, hidden_size=hidden_size, layers=layers, max_positions=512, seed=seed)
    with torch.no_grad():
        model.model.norm.weight.mul_(1e-2)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
