"""On-policy distillation reads the teacher's log-probs of the student's sampled token ids: the two tokenizers must
map every token to the same id, or the teacher scores other tokens than the student sampled and the run trains on
noise. ``check_teacher_vocab`` refuses such a run when the controller starts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from relayrl.config import ConfigError

log = logging.getLogger(__name__)


def vocab_mismatch(student: Any, teacher: Any) -> str | None:
    """Where two tokenizers' vocabularies (token -> id, added tokens included) differ, in words; None: they agree."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours == theirs:
        return None
    if len(ours) != len(theirs):
        return f"the student's vocabulary has {len(ours)} tokens, the teacher's {len(theirs)}"
    token = min(t for t in ours if ours[t] != theirs.get(t))
    return f"token {token!r} is id {ours[token]} to the student, {theirs.get(token)} to the teacher"


def check_teacher_vocab(student_tokenizer: Any, name: str, model: str) -> None:
    """ConfigError naming ``algorithm.teacher`` when the tokenizer of the teacher's model directory (``model``,
    ``scorers.<name>.model``, loaded as the scorer loads it) disagrees with the student's. A model that is no
    directory here (a hub id, or files on the scorer's machine only) is not compared, and the log says so."""
    if not Path(model).is_dir():
        log.info("algorithm.teacher: %s is no directory here: the teacher's vocabulary is not compared", model)
        return
    from transformers import AutoTokenizer

    why = vocab_mismatch(student_tokenizer, AutoTokenizer.from_pretrained(model))
    if why is not None:
        raise ConfigError(
            f"algorithm.teacher: scorer {name}'s model {model} tokenizes differently from model.path ({why}); "
            f"a teacher scores the student's token ids, so the two must share one tokenizer"
        )
