"""The attention implementation a Hugging Face model loads with (``model.attn_implementation``), one choice for the
trainer's FSDP models and the hf engine, so both sides compute attention alike.

"auto" passes nothing: transformers picks the model's own default (``sdpa`` where the architecture supports it,
``eager`` where it does not: Gemma2 and gpt-oss, whose attention soft-caps its logits or adds sinks, which SDPA
cannot). Any other value ("eager", "sdpa", "flash_attention_2", ...) is passed as ``attn_implementation``; a model
that refuses it is a ValueError naming the key.
"""

from __future__ import annotations

from typing import Any

AUTO = "auto"
KEY = "model.attn_implementation"


def attention_kwargs(attn_implementation: str) -> dict[str, Any]:
    """``from_pretrained``'s keyword for ``attn_implementation``: none for "auto" (the model's default)."""
    return {} if attn_implementation == AUTO else {"attn_implementation": attn_implementation}


def load_with_attention(loader: Any, path: str, attn_implementation: str, **kwargs: Any) -> Any:
    """``loader(path, **kwargs)`` (a ``from_pretrained``) with ``attention_kwargs(attn_implementation)``; a model
    or machine that cannot run the implementation asked for is a ValueError naming ``model.attn_implementation``
    and transformers' reason (its first sentence: the rest is advice on calling from_pretrained)."""
    try:
        return loader(path, **kwargs, **attention_kwargs(attn_implementation))
    except (ValueError, ImportError) as exc:
        if attn_implementation == AUTO or "attention" not in str(exc).lower():
            raise
        reason = (str(exc).strip().splitlines() or [""])[0].split(". ")[0]
        raise ValueError(f"{KEY}={attn_implementation}: {reason}") from exc


def resolved(model: Any) -> str:
    """The attention implementation ``model`` computes with (what transformers resolved "auto" to)."""
    return str(getattr(model.config, "_attn_implementation", None))
