"""Distillation's teacher shares the student's tokenizer or the controller refuses to start, naming
algorithm.teacher and where the vocabularies differ; a teacher whose files are not here is not compared."""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from relayrl.config import ConfigError, load_config
from relayrl.controller.core import Controller
from relayrl.data.vocab import check_teacher_vocab, vocab_mismatch
from relayrl.models.tiny import build_tokenizer
from relayrl.models.tiny_chat import build_chat_tokenizer


def distill_config(make_config, teacher: str):
    scorers = {"teacher": {"kind": "teacher", "model": teacher, "servers": ["127.0.0.1:1"]}}
    return load_config(
        make_config(scorers=scorers, algorithm={"advantage": "distill", "teacher": "teacher"}),
    )


def test_vocab_mismatch_names_the_sizes_or_the_first_token_whose_id_differs() -> None:
    tiny = build_tokenizer()
    assert vocab_mismatch(tiny, build_tokenizer(chat_template="{{ messages }}")) is None  # a template is no vocabulary
    chat = build_chat_tokenizer()
    assert vocab_mismatch(tiny, chat) == (
        f"the student's vocabulary has {len(tiny.get_vocab())} tokens, the teacher's {len(chat.get_vocab())}"
    )
    swapped = build_tokenizer()
    vocab = tiny.get_vocab()
    first, second = sorted(vocab, key=vocab.get)[-2:]  # the two last ids swapped: same size, two ids differ
    theirs = {**vocab, first: vocab[second], second: vocab[first]}
    swapped.get_vocab = lambda: theirs
    token = min(first, second)
    assert (
        vocab_mismatch(tiny, swapped)
        == f"token {token!r} is id {vocab[token]} to the student, {theirs[token]} to the teacher"
    )


def test_the_controller_refuses_a_teacher_with_another_tokenizer_at_start(make_config, tmp_path) -> None:
    other = tmp_path / "chat-teacher"
    build_chat_tokenizer().save_pretrained(other)
    cfg = distill_config(make_config, str(other))
    with pytest.raises(ConfigError, match=re.escape(f"algorithm.teacher: scorer teacher's model {other} tokenizes")):
        Controller(cfg, state_dir=tmp_path / "state")


def test_a_teacher_with_the_students_tokenizer_or_not_here_starts(make_config, tmp_path, tiny_model_dir) -> None:
    for teacher in (str(tiny_model_dir), "org/teacher-on-the-scorers-machine"):
        ctl = Controller(distill_config(make_config, teacher), state_dir=tmp_path / "state")
        assert ctl.scorer.teacher.name == "teacher"  # built, not started: nothing to stop
    same = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_teacher_vocab(same, "teacher", str(tiny_model_dir))
