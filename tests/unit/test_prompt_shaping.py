"""data.system_prompt, data.prompt_template, data.max_prompt_tokens / long_prompts (relayrl/data/dataset.py): what a
drawn prompt's tokens are, and what the controller does with one that is too long."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from relayrl.config import ConfigError, DataConfig, parse_config
from relayrl.data.dataset import PromptDataset
from relayrl.models.tiny_chat import build_chat_tokenizer

ROWS = [
    {"question": "What is 2 + 2?", "unit": "apples", "answer": "4"},
    {"question": "x " * 40, "unit": "", "answer": "1"},
]


@pytest.fixture(scope="module")
def tokenizer():
    """A ChatML tokenizer built here (Qwen2.5's template, a few hundred tokens): nothing read from disk, no skip."""
    return build_chat_tokenizer()


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def dataset(rows: Path, tokenizer, **data) -> PromptDataset:
    cfg = DataConfig(path=str(rows), prompt_key="question", shuffle=False, **data)
    return PromptDataset(cfg, tokenizer)


def chat(tokenizer, *turns: tuple[str, str]) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in turns], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_system_prompt_and_template_make_the_turns(rows, tokenizer) -> None:
    template = "{question} Count {unit}."
    got = dataset(rows, tokenizer, system_prompt="Answer in one word.", prompt_template=template).record(0)
    assert got.text == "What is 2 + 2? Count apples."  # what the reward function reads as the prompt
    assert got.token_ids == chat(tokenizer, ("system", "Answer in one word."), ("user", got.text))
    assert dataset(rows, tokenizer).record(0).token_ids == chat(tokenizer, ("user", ROWS[0]["question"]))


def test_a_long_prompt_is_cut_from_the_left_or_filtered(rows, tokenizer) -> None:
    full = dataset(rows, tokenizer).records(0, 2)
    limit = len(full[0].token_ids)  # row 0 fits exactly, row 1 does not
    assert len(full[1].token_ids) > limit
    cut = dataset(rows, tokenizer, max_prompt_tokens=limit, long_prompts="truncate_left").records(0, 2)
    assert cut[0] == full[0]
    assert cut[1].token_ids == full[1].token_ids[-limit:]  # the end, with the generation prompt, is kept
    assert cut[1].tokens_cut == len(full[1].token_ids) - limit and not cut[1].too_long
    kept = dataset(rows, tokenizer, max_prompt_tokens=limit).records(0, 2)  # filter, the default
    assert kept[1].token_ids == full[1].token_ids and kept[1].tokens_cut == 0
    assert kept[1].too_long == f"prompt too long: {len(full[1].token_ids)} tokens > data.max_prompt_tokens {limit}"
    assert not kept[0].too_long


def test_bad_prompt_settings_are_refused_naming_the_key(rows, tokenizer, tiny_model_dir) -> None:
    with pytest.raises(ValueError, match=r"^data\.prompt_template: reads \['colour'\]"):
        dataset(rows, tokenizer, prompt_template="{question} in {colour}")
    raw = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw.chat_template = None
    with pytest.raises(ValueError, match=r"^data\.system_prompt: .*the tokenizer has none"):
        dataset(rows, raw, system_prompt="Be brief.")
    with pytest.raises(ConfigError, match=r"data\.system_prompt: .*chat_template is never"):
        parse_config(
            {"model": {"path": "m"}, "data": {"path": "d.jsonl", "system_prompt": "x", "chat_template": "never"}}
        )


def test_a_row_without_its_answer_or_prompt_is_refused_at_load_naming_the_row(tmp_path, tiny_model_dir) -> None:
    """A row whose answer (or prompt) is missing or null would train as the text "None": the dataset refuses it,
    in any file type (here parquet, which `relayrl check` does not read row by row)."""
    import datasets

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([ROWS[0], {**ROWS[1], "answer": None}]).to_parquet(str(path))
    with pytest.raises(ValueError, match=rf"^data\.answer_key: row 2 of {path} has no 'answer' \(missing or null"):
        dataset(path, tokenizer)
    datasets.Dataset.from_list([{**ROWS[0], "question": None}, ROWS[1]]).to_parquet(str(path))
    with pytest.raises(ValueError, match=r"^data\.prompt_key: row 1 of .* has no 'question'"):
        dataset(path, tokenizer)
