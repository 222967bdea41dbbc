"""``data.path: reasoning-gym:<task>``: a task of the reasoning-gym library (the ``tasks`` extra) as a data set.

Its rows are generated once per run into ``<run dir>/assets`` by ``reasoning_gym.create_dataset(task, size=, seed=,
**config)`` (``data.reasoning_gym``), so they are a function of the config and the run's prompts draw from them like
any JSONL file's, resumable by cursor. Each row is ``prompt`` (the entry's question, the user turn, as the library's
own examples send it after ``SYSTEM_PROMPTS[...]`` as the system turn), ``answer`` (its reference answer, as text)
and ``reasoning_gym`` (JSON of the task, its config and the whole entry: what ``score_answer`` reads).

``score`` is ``controller.reward.fn: reasoning_gym``: the last ``<answer>...</answer>`` of the response (the
library's ``extract_answer``, the format its system prompts ask for) scored by the task's own
``dataset.score_answer(answer, entry)``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from relayrl.config import REASONING_GYM, DataConfig, ReasoningGymConfig
from relayrl.runtime.files import atomic_write
from relayrl.runtime.reasoning_gym import ENTRY_COLUMN, library_dataset, missing_extra

log = logging.getLogger(__name__)


def task_of(path: str) -> str:
    """``reasoning-gym:basic_arithmetic`` -> ``basic_arithmetic``."""
    return path.removeprefix(REASONING_GYM)


def settings(data: DataConfig) -> ReasoningGymConfig:
    """The data section's ``reasoning_gym`` settings (its defaults when the section is absent)."""
    return data.reasoning_gym or ReasoningGymConfig()


def library_config(gen: ReasoningGymConfig) -> dict[str, Any]:
    """The keyword arguments of ``reasoning_gym.create_dataset``: the task's config with size and seed."""
    return {**gen.config, "size": gen.size, "seed": gen.seed}


def system_prompt(gen: ReasoningGymConfig) -> str | None:
    """The library's system prompt ``gen.system_prompt`` names (None: none); ValueError for an unknown name."""
    if gen.system_prompt is None:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if gen.system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"system_prompt: {gen.system_prompt!r} is not one of {sorted(SYSTEM_PROMPTS)}")
    return SYSTEM_PROMPTS[gen.system_prompt]


def check(data: DataConfig) -> None:
    """The start-up check of a ``reasoning-gym:`` section: the extra installed, the task known, its config and
    system prompt accepted. ValueError whose message names the key under the section."""
    gen = settings(data)
    if reason := missing_extra():
        raise ValueError(f"path: {data.path} {reason}")
    try:
        library_dataset(task_of(data.path), library_config(gen))
    except ValueError as err:
        raise ValueError(f"path: {data.path}: {err}") from None
    try:
        system_prompt(gen)
    except ValueError as err:
        raise ValueError(f"reasoning_gym.{err}") from None
    if gen.system_prompt is not None and data.system_prompt is None and data.chat_template == "never":
        raise ValueError(
            "reasoning_gym.system_prompt: a system turn needs the chat template (chat_template is never): set it to "
            "null and ask for the answer format in prompt_template"
        )


def asset_name(data: DataConfig) -> str:
    """The asset file's name: the task and a digest of its library config (same config, same file)."""
    config = json.dumps(library_config(settings(data)), sort_keys=True, default=str)
    digest = hashlib.sha256(f"{data.path}\n{config}".encode()).hexdigest()[:12]
    return f"reasoning-gym-{task_of(data.path)}-{digest}.jsonl"


def write_rows(data: DataConfig, path: Path, *, held_out_from: set[str] = frozenset()) -> int:
    """Generate the task's rows into ``path`` (JSONL, written atomically), leaving out every row whose question is
    in ``held_out_from`` (the training set's, for an eval set of the same task); returns how many were left out."""
    task, config = task_of(data.path), library_config(settings(data))
    dataset = library_dataset(task, config)
    lines, dropped = [], 0
    for entry in dataset:
        if entry["question"] in held_out_from:
            dropped += 1
            continue
        answer = "" if entry["answer"] is None else str(entry["answer"])
        payload = json.dumps({"task": task, "config": config, "entry": entry}, default=str)
        lines.append(json.dumps({"prompt": entry["question"], "answer": answer, ENTRY_COLUMN: payload}) + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, "".join(lines))
    return dropped


def questions(path: Path) -> set[str]:
    """The questions (``prompt`` column) of a file ``write_rows`` wrote."""
    with path.open(encoding="utf-8") as rows:
        return {json.loads(line)["prompt"] for line in rows if line.strip()}
