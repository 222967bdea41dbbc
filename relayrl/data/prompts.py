"""How a dataset row becomes a prompt, without the datasets library (the start-up checks read it too): the columns a
``data.prompt_template`` reads, and a rendered prompt under ``data.max_prompt_tokens``."""

from __future__ import annotations

import string

from relayrl.config import DataConfig

NO_TEMPLATE_FOR_SYSTEM = "data.system_prompt: a system turn needs a chat template, and the tokenizer has none"


def template_fields(template: str) -> list[str]:
    """The column names a ``data.prompt_template`` reads (its ``{name}`` fields)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def fit_prompt(ids: list[int], cfg: DataConfig) -> tuple[list[int], int, str]:
    """(token ids, tokens cut, why it is not generated) of a rendered prompt under ``data.max_prompt_tokens``."""
    limit = cfg.max_prompt_tokens
    if limit is None or len(ids) <= limit:
        return ids, 0, ""
    if cfg.long_prompts == "truncate_left":
        return ids[-limit:], len(ids) - limit, ""
    return ids, 0, f"prompt too long: {len(ids)} tokens > data.max_prompt_tokens {limit}"
