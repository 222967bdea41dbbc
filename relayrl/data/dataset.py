"""Prompt source for the controller: a Hugging Face dataset, templated and tokenized, read through a
resumable epoch-shuffled cursor."""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow.compute

from relayrl.config import DataConfig
from relayrl.data.fast_tokens import encode_texts
from relayrl.data.formats import FILE_BUILDERS
from relayrl.data.prompts import NO_TEMPLATE_FOR_SYSTEM, fit_prompt, template_fields

# Rendered rows kept for later epochs, up to this many prompt tokens (16 MB of int32 ids, plus the texts): all of
# a 20k-prompt set at 200 tokens a prompt, so every draw after its first epoch skips the read and the tokenizer.
RENDERED_CACHE_TOKENS = 4_000_000


@dataclass(frozen=True)
class PromptRecord:
    prompt_id: str  # "<epoch>:<row>": unique per draw, stable across restarts
    text: str
    token_ids: list[int]
    answer: str
    tokens_cut: int = 0  # tokens cut from the prompt's start (data.long_prompts truncate_left)
    too_long: str = ""  # why the prompt is not generated (data.long_prompts filter); "": it is


def load_rows(cfg: DataConfig) -> datasets.Dataset:
    """Local JSONL/JSON/parquet/CSV file, a `save_to_disk` directory, or a hub dataset id."""
    path = Path(cfg.path)
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(f"data.path: unsupported file type {path.suffix!r} (use {sorted(FILE_BUILDERS)})")
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    if path.is_dir() and (path / "dataset_info.json").exists():
        return datasets.load_from_disk(str(path))
    return datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)


def first_null(rows: datasets.Dataset, column: str) -> int | None:
    """The index of the first row whose ``column`` is null (a JSON row without it reads as null), or None."""
    values = rows.data.column(column)
    if values.null_count == 0:
        return None
    return pyarrow.compute.index(pyarrow.compute.is_null(values), True).as_py()


def _uses_template(tokenizer: Any, mode: str) -> bool:
    return mode == "always" or (mode == "auto" and bool(getattr(tokenizer, "chat_template", None)))


def render_prompt(tokenizer: Any, text: str, mode: str, system: str | None = None) -> list[int]:
    """Token ids of the prompt: the chat template (``system`` as a system turn, then the text as a user turn, then
    the generation prompt) when ``mode`` is "always", or "auto" and the tokenizer has one; else the raw text."""
    if _uses_template(tokenizer, mode):
        system_turn = [{"role": "system", "content": system}] if system is not None else []
        ids = tokenizer.apply_chat_template(
            [*system_turn, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return encode_texts(tokenizer, [text])[0]


def render_prompts(tokenizer: Any, texts: list[str], mode: str, system: str | None = None) -> list[list[int]]:
    """``render_prompt`` of each text; raw texts are encoded by ``encode_texts``."""
    if _uses_template(tokenizer, mode):
        return [render_prompt(tokenizer, text, mode, system) for text in texts]
    return encode_texts(tokenizer, texts)


class PromptDataset:
    """Rows of (prompt, answer) drawn in a per-epoch shuffled order; ``cursor`` counts draws."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, seed: int = 0) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seed = seed
        self.rows = load_rows(cfg)
        for key in (cfg.prompt_key, cfg.answer_key):
            if key not in self.rows.column_names:
                field = "data.prompt_key" if key == cfg.prompt_key else "data.answer_key"
                raise ValueError(f"{field}: column {key!r} not in the dataset (columns: {self.rows.column_names})")
        if len(self.rows) == 0:
            raise ValueError(f"data.path: {cfg.path} has no rows")
        if cfg.system_prompt is not None and not _uses_template(tokenizer, cfg.chat_template):
            raise ValueError(NO_TEMPLATE_FOR_SYSTEM)
        self.fields = template_fields(cfg.prompt_template) if cfg.prompt_template is not None else [cfg.prompt_key]
        unknown = [name for name in self.fields if name not in self.rows.column_names]
        if unknown or not self.fields:
            raise ValueError(
                f"data.prompt_template: reads {unknown or 'no column'}, not a column of the dataset "
                f"(columns: {self.rows.column_names}; write {{column}})"
            )
        for column in dict.fromkeys([*self.fields, cfg.answer_key]):
            if (row := first_null(self.rows, column)) is not None:
                field = "data.answer_key" if column == cfg.answer_key else "data.prompt_key"
                raise ValueError(
                    f"{field}: row {row + 1} of {cfg.path} has no {column!r} (missing or null; every row needs one)"
                )
        self._order_cache: tuple[int, list[int]] | None = None
        self._rendered: dict[int, tuple[str, array, str]] = {}  # row -> (text, token ids, answer)
        self._rendered_tokens = 0

    def __len__(self) -> int:
        return len(self.rows)

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = list(range(len(self.rows)))
            if self.cfg.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def row(self, prompt_id: str) -> dict[str, Any]:
        """Every column of the row a prompt id ("<epoch>:<row>") was drawn from."""
        return self.rows[int(prompt_id.rpartition(":")[2])]

    def record(self, draw: int) -> PromptRecord:
        """The prompt of the ``draw``-th draw (0-based, across epochs)."""
        return self.records(draw, 1)[0]

    def records(self, start: int, count: int) -> list[PromptRecord]:
        """The prompts of draws ``start`` .. ``start + count - 1``: rows rendered before come from the cache, the
        others take one read of the rows and one tokenizer call."""
        draws = [divmod(draw, len(self.rows)) for draw in range(start, start + count)]
        row_indices = [self._order(epoch)[position] for epoch, position in draws]
        rendered = self._render(row_indices)
        records = []
        for (epoch, _), row in zip(draws, row_indices):
            text, ids, answer = rendered[row]
            ids, cut, too_long = fit_prompt(list(ids), self.cfg)
            records.append(PromptRecord(f"{epoch}:{row}", text, ids, answer, tokens_cut=cut, too_long=too_long))
        return records

    def _texts(self, rows: dict[str, list]) -> list[str]:
        """The user turn of each row: ``data.prompt_template`` filled from its columns, else its prompt column."""
        template = self.cfg.prompt_template
        if template is None:
            return [str(text) for text in rows[self.cfg.prompt_key]]
        columns = [rows[name] for name in self.fields]
        return [template.format(**dict(zip(self.fields, values))) for values in zip(*columns)]

    def _render(self, row_indices: list[int]) -> dict[int, tuple[str, array | list[int], str]]:
        """(text, token ids, answer) of each row; rows not in the cache are read and rendered, then cached while
        the cache holds fewer than RENDERED_CACHE_TOKENS tokens."""
        rendered: dict[int, tuple[str, array | list[int], str]] = {}
        missing = []
        for row in dict.fromkeys(row_indices):
            cached = self._rendered.get(row)
            if cached is None:
                missing.append(row)
            else:
                rendered[row] = cached
        if missing:
            rows = self.rows[missing]  # {column: [values]}
            texts = self._texts(rows)
            token_ids = render_prompts(self.tokenizer, texts, self.cfg.chat_template, self.cfg.system_prompt)
            answers = [str(answer) for answer in rows[self.cfg.answer_key]]
            for row, text, ids, answer in zip(missing, texts, token_ids, answers, strict=True):
                rendered[row] = (text, ids, answer)
                if self._rendered_tokens < RENDERED_CACHE_TOKENS:
                    self._rendered[row] = (text, array("i", ids), answer)
                    self._rendered_tokens += len(ids)
        return rendered
