"""TRL's dataset formats (relayrl/data/trl_formats.py) on the tiny ChatML tokenizer: detection from the columns,
rendering that agrees with TRL's own data_utils text for text, the loss masks, and one-line refusals naming the row
and the column."""

from __future__ import annotations

import json

import pytest
from trl.data_utils import apply_chat_template, extract_prompt

from relayrl.data.trl_formats import (
    LANGUAGE_MODELING,
    PREFERENCE,
    PROMPT_COMPLETION,
    UNPAIRED_PREFERENCE,
    DataFormatError,
    detect_format,
    load_format,
    render_preferences,
    render_sft,
    render_unpaired,
)
from relayrl.models.tiny_chat import build_chat_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def decode(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def kept(tok, ids: list[int], mask: list[int]) -> str:
    """The text of the masked-in tokens, runs joined by '|'."""
    runs, run = [], []
    for token, bit in zip(ids, mask):
        if bit:
            run.append(token)
        elif run:
            runs, run = [*runs, run], []
    runs += [run] if run else []
    return "|".join(decode(tok, r) for r in runs)


# ---------------------------------------------------------------------------------------------- detection


@pytest.mark.parametrize(
    ("row", "kind", "conversational", "implicit"),
    [
        ({"text": "a b"}, LANGUAGE_MODELING, False, False),
        ({"messages": [user("hi"), assistant("yo")]}, LANGUAGE_MODELING, True, False),
        ({"prompt": "a", "completion": "b", "answer": "x"}, PROMPT_COMPLETION, False, False),
        ({"prompt": [user("a")], "chosen": [assistant("b")], "rejected": [assistant("c")]}, PREFERENCE, True, False),
        ({"chosen": "a b", "rejected": "a c"}, PREFERENCE, False, True),
        ({"prompt": "a", "completion": "b", "label": True}, UNPAIRED_PREFERENCE, False, False),
    ],
)
def test_the_columns_name_the_format(row: dict, kind: str, conversational: bool, implicit: bool) -> None:
    fmt = detect_format(list(row), row)
    assert (fmt.kind, fmt.conversational, fmt.implicit_prompt) == (kind, conversational, implicit)


def test_columns_of_no_format_are_refused_naming_them() -> None:
    with pytest.raises(DataFormatError, match=r"^columns \['chosen', 'prompt'\]: not a TRL dataset format \(one of: "):
        detect_format(["prompt", "chosen", "answer"], {"prompt": "a", "chosen": "b", "answer": "c"})
    with pytest.raises(DataFormatError, match=r"^column 'tools': per-row tools are not rendered"):
        detect_format(["messages", "tools"], {"messages": [user("a")], "tools": []})


# --------------------------------------------------------------------------------- rendering, as TRL's text


def test_plain_prompt_completion_appends_eos_and_masks_the_prompt(tok) -> None:
    rows = [{"prompt": "What is 2 + 3?", "completion": " 5"}, {"prompt": "Say 7:", "completion": " 7<|im_end|>"}]
    first, second = render_sft(rows, tok)
    assert first.input_ids == tok("What is 2 + 3? 5<|im_end|>")["input_ids"]
    assert kept(tok, first.input_ids, first.loss_mask) == " 5<|im_end|>"
    assert decode(tok, second.input_ids).count("<|im_end|>") == 1  # not appended twice
    everything = render_sft(rows, tok, completion_only_loss=False)[0]
    assert everything.loss_mask == [1] * len(first.input_ids)


def test_plain_text_is_trained_on_every_token(tok) -> None:
    (example,) = render_sft([{"text": "the sky is blue"}], tok)
    assert example.input_ids == tok("the sky is blue<|im_end|>")["input_ids"]
    assert example.loss_mask == [1] * len(example.input_ids)


def test_conversational_prompt_completion_agrees_with_trl(tok) -> None:
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, user("What is 2 + 3?")],
        "completion": [assistant("5")],
    }
    (example,) = render_sft([row], tok)
    trl_text = apply_chat_template(row, tok)  # TRL's prompt (with the generation prompt) and completion texts
    assert decode(tok, example.input_ids) == trl_text["prompt"] + trl_text["completion"]
    assert kept(tok, example.input_ids, example.loss_mask) == trl_text["completion"] == "5<|im_end|>\n"


def test_assistant_only_loss_keeps_every_assistant_turn(tok) -> None:
    messages = [user("Guess my number."), assistant("4"), user("higher"), assistant("6"), user("correct")]
    (example,) = render_sft([{"messages": messages}], tok)
    assert decode(tok, example.input_ids) == tok.apply_chat_template(messages, tokenize=False)
    assert kept(tok, example.input_ids, example.loss_mask) == "4<|im_end|>\n|6<|im_end|>\n"
    (whole,) = render_sft([{"messages": messages}], tok, assistant_only_loss=False)
    assert whole.loss_mask == [1] * len(whole.input_ids)


def test_one_turn_messages_mask_as_its_prompt_completion_row(tok) -> None:
    prompt, completion = [user("What is 2 + 3?")], [assistant("5")]
    (messages,) = render_sft([{"messages": prompt + completion}], tok)
    (pair,) = render_sft([{"prompt": prompt, "completion": completion}], tok)
    assert messages == pair


@pytest.mark.parametrize("conversational", [False, True])
def test_preference_rows_agree_with_trl_and_the_implicit_prompt_with_the_explicit(tok, conversational: bool) -> None:
    if conversational:
        explicit = {"prompt": [user("Sky colour?")], "chosen": [assistant("blue")], "rejected": [assistant("green")]}
        implicit = {
            "chosen": explicit["prompt"] + explicit["chosen"],
            "rejected": explicit["prompt"] + explicit["rejected"],
        }
        trl_text = apply_chat_template(explicit, tok)
    else:
        explicit = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
        implicit = {"chosen": "The sky is blue.", "rejected": "The sky is green."}
        trl_text = {key: value + ("<|im_end|>" if key != "prompt" else "") for key, value in explicit.items()}
        assert extract_prompt(implicit) == explicit  # TRL's split of the implicit prompt is the explicit row
    (pair,) = render_preferences([{**explicit, "margin": 1.5}], tok)
    assert decode(tok, pair.prompt_ids) == trl_text["prompt"]
    assert decode(tok, pair.chosen_ids) == trl_text["chosen"]
    assert decode(tok, pair.rejected_ids) == trl_text["rejected"]
    assert pair.margin == 1.5
    (from_implicit,) = render_preferences([implicit], tok)
    assert from_implicit.prompt_ids == pair.prompt_ids and from_implicit.chosen_ids == pair.chosen_ids
    assert from_implicit.rejected_ids == pair.rejected_ids and from_implicit.margin is None


def test_unpaired_rows_keep_their_label(tok) -> None:
    rows = [
        {"prompt": [user("2 + 3?")], "completion": [assistant("5")], "label": True},
        {"prompt": [user("2 + 3?")], "completion": [assistant("6")], "label": False},
    ]
    good, bad = render_unpaired(rows, tok)
    assert (good.label, bad.label) == (True, False)
    assert good.prompt_ids == bad.prompt_ids
    assert decode(tok, good.completion_ids) == "5<|im_end|>\n"


def test_a_dataset_file_goes_through_relayrls_loader(tok, tmp_path) -> None:
    path = tmp_path / "prefs.jsonl"
    rows = [{"chosen": f"Q{i} A right", "rejected": f"Q{i} A wrong", "margin": i} for i in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded, fmt = load_format(str(path))
    assert (fmt.kind, fmt.implicit_prompt, fmt.conversational) == (PREFERENCE, True, False)
    pairs = render_preferences(loaded, tok)
    assert [decode(tok, p.prompt_ids) for p in pairs] == ["Q0 A", "Q1 A", "Q2 A"]
    assert [p.margin for p in pairs] == [0.0, 1.0, 2.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "Q", "completion": "A"}) + "\n" + json.dumps({"prompt": "Q", "completion": ""})
    )
    with pytest.raises(DataFormatError, match=r"^row 1, column 'completion': empty$"):
        render_sft(load_format(str(bad))[0], tok)


# -------------------------------------------------------------------------------------------- refusals


CHAT = {"prompt": [user("q")], "completion": [assistant("a")]}


@pytest.mark.parametrize(
    ("rows", "render", "message"),
    [
        ([{"prompt": "q", "completion": "a"}, {"prompt": "q", "completion": None}], render_sft,
         "row 1, column 'completion': missing (null)"),
        ([{"prompt": "q", "completion": "a"}, {"prompt": "q", "completion": 3}], render_sft,
         "row 1, column 'completion': expected a string like row 0, got int"),
        ([CHAT, {"prompt": [user("q")], "completion": "a"}], render_sft,
         "row 1, column 'completion': expected a non-empty list of messages, got str"),
        ([CHAT, {"prompt": [user("q")], "completion": []}], render_sft,
         "row 1, column 'completion': expected a non-empty list of messages, got list"),
        ([CHAT, {"prompt": [{"content": "q"}], "completion": [assistant("a")]}], render_sft,
         "row 1, column 'prompt': message 0: expected a dict with a string 'role'"),
        ([{"messages": [user("q"), assistant("a")]}, {"messages": [user("q"), user("r")]}], render_sft,
         "row 1, column 'messages': no assistant tokens: assistant_only_loss leaves nothing to train on"),
        ([{"messages": [assistant("a"), user("q")]}], render_sft,
         "row 0, column 'messages': message 0 is an assistant turn: nothing before it to prompt it"),
        ([{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "a", "rejected": "a"}],
         render_preferences, "row 1, column 'rejected': the same as 'chosen': the pair prefers nothing"),
        ([{"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}], render_preferences,
         "row 0, column 'margin': expected a number, got str"),
        ([{"chosen": "abc", "rejected": "xyz"}], render_preferences,
         "row 0, column 'chosen': no common prefix with 'rejected' to take as the prompt (implicit prompt)"),
        ([{"chosen": "Q A", "rejected": "Q A B"}], render_preferences,
         "row 0, column 'chosen': empty completion after the prompt it shares with the other column"),
        ([{"prompt": "q", "completion": "a", "label": True}, {"prompt": "q", "completion": "a", "label": "yes"}],
         render_unpaired, "row 1, column 'label': expected true or false (desirable or not), got str"),
        ([{"prompt": "q", "completion": "a"}], render_preferences,
         "columns ['prompt', 'completion']: a prompt_completion dataset, not a preference one"),
    ],
)  # fmt: skip
def test_bad_rows_are_refused_in_one_line_naming_row_and_column(tok, rows, render, message: str) -> None:
    with pytest.raises(DataFormatError) as error:
        render(rows, tok)
    assert str(error.value) == message


def test_a_template_that_rerenders_earlier_turns_is_refused(tok) -> None:
    """A template that drops earlier assistant turns' content (as reasoning templates drop earlier thinking): the
    turn's tokens are not where the whole conversation has them, and the mask would be wrong."""
    forgetful = build_chat_tokenizer()
    forgetful.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}...{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rows = [{"messages": [user("a"), assistant("b"), user("c"), assistant("d")]}]
    with pytest.raises(DataFormatError, match=r"^row 0, column 'messages': the chat template renders message 1 "):
        render_sft(rows, forgetful)
    assert render_sft(rows, forgetful, assistant_only_loss=False)[0].loss_mask.count(0) == 0


def test_conversational_rows_need_a_chat_template() -> None:
    plain = build_chat_tokenizer()
    plain.chat_template = None
    with pytest.raises(DataFormatError, match=r"^column 'prompt': conversational rows need a chat template"):
        render_sft([CHAT], plain)
