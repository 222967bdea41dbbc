"""Text <-> token ids through a fast tokenizer's Rust backend, with transformers' own results.

The controller encodes every drawn prompt and decodes every generated response. transformers' ``__call__`` and
``decode`` wrap one backend call each in Python (argument checks, truncation and padding set-up, BatchEncoding
conversion), which costs the controller several times the backend's ``encode`` of the same text. Where the
wrapper adds nothing to the result, these call the backend directly, one text at a time in this thread: the
batched backend calls hand a few short texts to the tokenizers' rayon pool and wait for it, which costs more
than a loop over them.
Anything else (a slow tokenizer, a subclass that overrides the step, a backend configured to truncate or pad,
a clean-up pass) goes through transformers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers.tokenization_utils_tokenizers import TokenizersBackend


def backend_encodes(tokenizer: Any) -> bool:
    """``tokenizer(text, add_special_tokens=True)["input_ids"]`` equals the backend's ``encode(text).ids``:
    TokenizersBackend's ``_encode_plus`` (transformers/tokenization_utils_tokenizers.py) resets truncation and
    padding on the backend to the call's (none), sets ``encode_special_tokens`` to ``split_special_tokens``, then
    returns ``encode_batch``'s ids; so the backend must have neither, and agree on special tokens."""
    if not isinstance(tokenizer, TokenizersBackend):
        return False
    if type(tokenizer)._encode_plus is not TokenizersBackend._encode_plus:
        return False
    backend = tokenizer.backend_tokenizer
    return (
        backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)
    )


def backend_decodes(tokenizer: Any) -> bool:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` equals the backend's ``decode``: TokenizersBackend's
    ``_decode`` returns the backend's text, then runs the clean-up pass only if ``clean_up_tokenization_spaces``."""
    return (
        isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer)._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
    )


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=True)["input_ids"]``."""
    if backend_encodes(tokenizer):
        backend = tokenizer.backend_tokenizer
        return [backend.encode(text, add_special_tokens=True).ids for text in texts]
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]


def decode_sequences(tokenizer: Any, sequences: Sequence[Sequence[int]]) -> list[str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)`` of each sequence."""
    if backend_decodes(tokenizer):
        backend = tokenizer.backend_tokenizer
        return [backend.decode(list(ids), skip_special_tokens=True) for ids in sequences]
    return [tokenizer.decode(list(ids), skip_special_tokens=True) for ids in sequences]
