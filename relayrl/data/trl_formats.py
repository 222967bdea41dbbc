"""TRL's dataset formats for the offline stages (SFT, DPO/IPO/KTO, reward models): detected from the columns,
rendered with the model's chat template into token ids and a loss mask, bad rows refused in one line.

Formats (TRL's ``data_utils``; the columns decide, other columns are ignored):

=================================  ===============================================  ==========================
kind                               columns                                          rendered as
=================================  ===============================================  ==========================
language_modeling                  ``text`` (plain) or ``messages`` (conversational) ``SFTExample``
prompt_completion                  ``prompt``, ``completion``                       ``SFTExample``
preference                         ``prompt``, ``chosen``, ``rejected``             ``PreferenceExample``
preference, implicit prompt        ``chosen``, ``rejected``                         ``PreferenceExample``
unpaired_preference                ``prompt``, ``completion``, ``label`` (bool)     ``UnpairedExample``
=================================  ===============================================  ==========================

A dataset is conversational when its first row's format column holds a list of ``{"role", "content"}`` messages
(TRL's ``is_conversational``); every row must then be. A preference row may carry a numeric ``margin`` (the
Bradley–Terry margin, TRL's reward trainer reads the same column).

Rendering, as TRL's trainers tokenize:
- plain text: the tokenizer's own special tokens (``tokenizer(text)``), and the EOS token appended to ``text``,
  ``completion``, ``chosen`` and ``rejected`` where they do not end with it;
- conversational: the chat template's text tokenized without special tokens; a prompt is rendered with the
  generation prompt, a completion is what the template writes for prompt + completion after it;
- the completion starts where the tokenized prompt and the tokenized prompt + completion first differ (TRL's
  ``common_prefix_length``), so it is always a suffix of the whole sequence the model sees;
- implicit prompt: the common prefix of chosen and rejected is the prompt (messages for conversational rows,
  characters for plain ones, a space before the first difference going to the completions; TRL's ``extract_prompt``).

Loss masks (``SFTExample.loss_mask``, aligned to ``input_ids``; TRL's labels ≠ −100):
- ``completion_only_loss``: the prompt's tokens are masked (prompt-completion rows only);
- ``assistant_only_loss``: in conversational rows only the assistant turns' tokens count: for assistant turn i, the
  tokens after the template's rendering of turns < i with the generation prompt, through its rendering of turns ≤ i
  (the turn's content, its end-of-turn token and whatever the template writes after it, such as ChatML's ``\\n``).
  Any template works, with or without ``{% generation %}``, as long as each turn renders as a prefix of the whole
  conversation; a template that re-renders earlier turns (e.g. one that drops their reasoning) is refused.
- both: a token counts where both masks keep it; ``text`` rows are trained on every token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.config import DataConfig
from relayrl.data.dataset import load_rows
from relayrl.runtime.sequences import common_prefix_length

LANGUAGE_MODELING = "language_modeling"
PROMPT_COMPLETION = "prompt_completion"
PREFERENCE = "preference"
UNPAIRED_PREFERENCE = "unpaired_preference"

# TRL's column sets (data_utils.apply_chat_template's supported keys), each with its kind
FORMATS: dict[frozenset[str], str] = {
    frozenset({"text"}): LANGUAGE_MODELING,
    frozenset({"messages"}): LANGUAGE_MODELING,
    frozenset({"prompt", "completion"}): PROMPT_COMPLETION,
    frozenset({"prompt", "chosen", "rejected"}): PREFERENCE,
    frozenset({"chosen", "rejected"}): PREFERENCE,
    frozenset({"prompt", "completion", "label"}): UNPAIRED_PREFERENCE,
}
FORMAT_COLUMNS = frozenset().union(*FORMATS)
# TRL renders these per row; relayrl does not yet, and training on a conversation rendered without its tools
# would train on the wrong text
UNRENDERED_COLUMNS = ("tools", "chat_template_kwargs")
TEXT_COLUMNS = ("text", "messages", "prompt", "completion", "chosen", "rejected")  # rendered columns, in this order


class DataFormatError(ValueError):
    """A dataset that is no TRL format, or a row of it that cannot be rendered: one line naming the row and column."""


def row_error(index: int, column: str, problem: str) -> DataFormatError:
    return DataFormatError(f"row {index}, column {column!r}: {problem}")


@dataclass(frozen=True)
class DatasetFormat:
    """The format a dataset's columns name (``FORMATS``) and whether its rows are conversations."""

    kind: str
    columns: tuple[str, ...]  # the format's columns present, in TEXT_COLUMNS order then label
    conversational: bool

    @property
    def implicit_prompt(self) -> bool:
        """A preference dataset without a prompt column: the common prefix of chosen and rejected is the prompt."""
        return self.kind == PREFERENCE and "prompt" not in self.columns


@dataclass(frozen=True)
class SFTExample:
    """A language-modeling or prompt-completion row: the sequence and which of its tokens the loss reads."""

    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class PreferenceExample:
    """A preference pair: the shared prompt and each completion's tokens (the sequences are prompt + completion);
    ``margin`` is the row's margin column, None without one."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float | None = None


@dataclass(frozen=True)
class UnpairedExample:
    """An unpaired preference row (KTO): the prompt, the completion, and whether it is desirable."""

    prompt_ids: list[int]
    completion_ids: list[int]
    label: bool


def is_messages(value: Any) -> bool:
    """TRL's ``is_conversational`` test of one value: a non-empty list whose first item is a dict with a role."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping) and "role" in value[0]


def detect_format(columns: Sequence[str], first_row: Mapping[str, Any]) -> DatasetFormat:
    """The format of a dataset with these columns, conversational as its first row is; DataFormatError naming the
    columns when they are no TRL format."""
    for column in UNRENDERED_COLUMNS:
        if column in columns:
            raise DataFormatError(
                f"column {column!r}: per-row {column} are not rendered by relayrl yet; drop the column"
            )
    present = frozenset(columns) & FORMAT_COLUMNS
    kind = FORMATS.get(present)
    if kind is None:
        known = " | ".join("+".join(sorted(names)) for names in FORMATS)
        raise DataFormatError(
            f"columns {sorted(present) or sorted(columns)}: not a TRL dataset format (one of: {known})"
        )
    ordered = tuple(name for name in (*TEXT_COLUMNS, "label") if name in present)
    first_text = next(name for name in ordered if name != "label")
    return DatasetFormat(kind, ordered, conversational=is_messages(first_row.get(first_text)))


def load_format(path: str, *, split: str = "train", subset: str | None = None) -> tuple[Any, DatasetFormat]:
    """The rows of a dataset (relayrl's loader: JSONL/JSON/parquet/CSV, a ``save_to_disk`` directory, a hub id) and
    their format."""
    rows = load_rows(DataConfig(path=path, split=split, subset=subset))
    if len(rows) == 0:
        raise DataFormatError(f"{path}: no rows")
    return rows, detect_format(rows.column_names, rows[0])


class Renderer:
    """Renders rows of one format with one tokenizer (module docstring); every check names the row and column."""

    def __init__(self, tokenizer: Any, fmt: DatasetFormat) -> None:
        if fmt.conversational and not getattr(tokenizer, "chat_template", None):
            raise DataFormatError(
                f"column {fmt.columns[0]!r}: conversational rows need a chat template, and the tokenizer has none"
            )
        if not fmt.conversational and tokenizer.eos_token is None:
            raise DataFormatError(
                f"column {fmt.columns[0]!r}: plain rows get the EOS token appended; the tokenizer has none"
            )
        self.tokenizer = tokenizer
        self.fmt = fmt

    # ------------------------------------------------------------------------------------- checks

    def value(self, row: Mapping[str, Any], index: int, column: str) -> Any:
        """The row's value of a text column, checked to be what the format needs: a non-empty string (plain) or a
        non-empty list of messages with string roles and contents (conversational)."""
        value = row.get(column)
        if value is None:
            raise row_error(index, column, "missing (null)")
        if self.fmt.conversational:
            if not isinstance(value, list) or not value:
                raise row_error(index, column, f"expected a non-empty list of messages, got {_kind(value)}")
            for turn, message in enumerate(value):
                if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                    raise row_error(index, column, f"message {turn}: expected a dict with a string 'role'")
                if not isinstance(message.get("content"), str):
                    raise row_error(
                        index,
                        column,
                        f"message {turn}: expected a string 'content', got {_kind(message.get('content'))}",
                    )
            return [dict(message) for message in value]
        if not isinstance(value, str):
            raise row_error(index, column, f"expected a string like row 0, got {_kind(value)}")
        if not value.strip() and column != "prompt":
            raise row_error(index, column, "empty")
        return value

    # ----------------------------------------------------------------------------------- tokenizing

    def encode(self, text: str) -> list[int]:
        """Plain text with the tokenizer's special tokens, as ``tokenizer(text)``."""
        return list(self.tokenizer(text)["input_ids"])

    def chat(self, messages: list[dict], *, generation_prompt: bool) -> list[int]:
        """The chat template's text of ``messages``, tokenized without special tokens (the template writes them)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def with_eos(self, text: str) -> str:
        eos = self.tokenizer.eos_token
        return text if text.endswith(eos) else text + eos

    def prompt_and_whole(self, prompt: Any, completion: Any) -> tuple[list[int], list[int]]:
        """(prompt ids, prompt + completion ids) of one prompt and one completion, as the format renders them."""
        if self.fmt.conversational:
            return self.chat(prompt, generation_prompt=True), self.chat(prompt + completion, generation_prompt=False)
        return self.encode(prompt), self.encode(prompt + self.with_eos(completion))

    def completion_start(self, index: int, column: str, prompt_ids: list[int], whole: list[int]) -> int:
        start = common_prefix_length(prompt_ids, whole)
        if start == len(whole):
            raise row_error(index, column, "renders to no tokens after the prompt")
        return start

    def assistant_mask(self, index: int, column: str, messages: list[dict], ids: list[int]) -> list[int]:
        """1 on the tokens of every assistant turn of ``messages`` (rendered as ``ids``), 0 elsewhere."""
        mask = [0] * len(ids)
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if turn == 0:
                raise row_error(index, column, "message 0 is an assistant turn: nothing before it to prompt it")
            through = self.chat(messages[: turn + 1], generation_prompt=False)
            if ids[: len(through)] != through:
                raise row_error(
                    index,
                    column,
                    f"the chat template renders message {turn} differently once later messages follow; "
                    "assistant_only_loss needs every turn rendered as a prefix of the conversation",
                )
            start = common_prefix_length(self.chat(messages[:turn], generation_prompt=True), ids)
            mask[start : len(through)] = [1] * (len(through) - start)
        if not any(mask):
            raise row_error(index, column, "no assistant tokens: assistant_only_loss leaves nothing to train on")
        return mask

    # ------------------------------------------------------------------------------------ the kinds

    def sft(
        self, row: Mapping[str, Any], index: int, *, completion_only_loss: bool, assistant_only_loss: bool
    ) -> SFTExample:
        """A language-modeling or prompt-completion row, with its loss mask (module docstring)."""
        fmt = self.fmt
        if fmt.kind == LANGUAGE_MODELING:
            column = fmt.columns[0]
            value = self.value(row, index, column)
            if not fmt.conversational:
                ids = self.encode(self.with_eos(value))
                return SFTExample(ids, [1] * len(ids))
            ids = self.chat(value, generation_prompt=False)
            mask = self.assistant_mask(index, column, value, ids) if assistant_only_loss else [1] * len(ids)
            return SFTExample(ids, mask)
        if fmt.kind != PROMPT_COMPLETION:
            raise DataFormatError(f"columns {list(fmt.columns)}: a {fmt.kind} dataset, not one to fine-tune on (SFT)")
        prompt, completion = self.value(row, index, "prompt"), self.value(row, index, "completion")
        prompt_ids, ids = self.prompt_and_whole(prompt, completion)
        start = self.completion_start(index, "completion", prompt_ids, ids)
        mask = [0] * start + [1] * (len(ids) - start) if completion_only_loss else [1] * len(ids)
        if assistant_only_loss and fmt.conversational:
            assistant = self.assistant_mask(index, "completion", prompt + completion, ids)
            mask = [a & b for a, b in zip(mask, assistant)]
            if not any(mask):
                raise row_error(
                    index, "completion", "no assistant tokens: assistant_only_loss leaves nothing to train on"
                )
        return SFTExample(ids, mask)

    def preference(self, row: Mapping[str, Any], index: int) -> PreferenceExample:
        """A preference row (explicit or implicit prompt) as prompt, chosen and rejected token ids."""
        if self.fmt.kind != PREFERENCE:
            raise DataFormatError(f"columns {list(self.fmt.columns)}: a {self.fmt.kind} dataset, not a preference one")
        chosen, rejected = self.value(row, index, "chosen"), self.value(row, index, "rejected")
        if chosen == rejected:
            raise row_error(index, "rejected", "the same as 'chosen': the pair prefers nothing")
        if self.fmt.implicit_prompt:
            prompt, chosen, rejected = self.split_implicit_prompt(index, chosen, rejected)
        else:
            prompt = self.value(row, index, "prompt")
        prompt_ids, chosen_whole = self.prompt_and_whole(prompt, chosen)
        _, rejected_whole = self.prompt_and_whole(prompt, rejected)
        start = min(
            self.completion_start(index, "chosen", prompt_ids, chosen_whole),
            self.completion_start(index, "rejected", prompt_ids, rejected_whole),
        )
        if chosen_whole == rejected_whole:
            raise row_error(index, "rejected", "renders to the same tokens as 'chosen': the pair prefers nothing")
        return PreferenceExample(
            prompt_ids=chosen_whole[:start],
            chosen_ids=chosen_whole[start:],
            rejected_ids=rejected_whole[start:],
            margin=self.margin(row, index),
        )

    def split_implicit_prompt(self, index: int, chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
        """(prompt, chosen rest, rejected rest): the common prefix of chosen and rejected, in messages or characters
        (a space before the first difference goes to the completions, as TRL's ``extract_prompt``)."""
        start = common_prefix_length(chosen, rejected)
        if not self.fmt.conversational and start and chosen[start - 1] == " ":
            start -= 1
        if start == 0:
            raise row_error(index, "chosen", "no common prefix with 'rejected' to take as the prompt (implicit prompt)")
        for column, value in (("chosen", chosen), ("rejected", rejected)):
            if len(value) == start:
                raise row_error(index, column, "empty completion after the prompt it shares with the other column")
        return chosen[:start], chosen[start:], rejected[start:]

    def margin(self, row: Mapping[str, Any], index: int) -> float | None:
        value = row.get("margin")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise row_error(index, "margin", f"expected a number, got {_kind(value)}")
        return float(value)

    def unpaired(self, row: Mapping[str, Any], index: int) -> UnpairedExample:
        """An unpaired preference row (KTO) as prompt and completion token ids and its label."""
        if self.fmt.kind != UNPAIRED_PREFERENCE:
            raise DataFormatError(f"columns {list(self.fmt.columns)}: a {self.fmt.kind} dataset, not an unpaired one")
        label = row.get("label")
        if not isinstance(label, bool):
            raise row_error(index, "label", f"expected true or false (desirable or not), got {_kind(label)}")
        prompt, completion = self.value(row, index, "prompt"), self.value(row, index, "completion")
        prompt_ids, ids = self.prompt_and_whole(prompt, completion)
        start = self.completion_start(index, "completion", prompt_ids, ids)
        return UnpairedExample(ids[:start], ids[start:], label)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def render_sft(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    completion_only_loss: bool = True,
    assistant_only_loss: bool = True,
) -> list[SFTExample]:
    """Every row of a language-modeling or prompt-completion dataset as token ids and a loss mask.

    relayrl's defaults train on the completion's assistant tokens only (TRL's: ``completion_only_loss`` on for
    prompt-completion rows, ``assistant_only_loss`` off)."""
    renderer = Renderer(tokenizer, _format_of(rows))
    return [
        renderer.sft(row, i, completion_only_loss=completion_only_loss, assistant_only_loss=assistant_only_loss)
        for i, row in enumerate(rows)
    ]


def render_preferences(rows: Sequence[Mapping[str, Any]], tokenizer: Any) -> list[PreferenceExample]:
    """Every row of a preference dataset (explicit or implicit prompt) as prompt, chosen and rejected token ids."""
    renderer = Renderer(tokenizer, _format_of(rows))
    return [renderer.preference(row, i) for i, row in enumerate(rows)]


def render_unpaired(rows: Sequence[Mapping[str, Any]], tokenizer: Any) -> list[UnpairedExample]:
    """Every row of an unpaired preference dataset as prompt and completion token ids and a label."""
    renderer = Renderer(tokenizer, _format_of(rows))
    return [renderer.unpaired(row, i) for i, row in enumerate(rows)]


def _format_of(rows: Sequence[Mapping[str, Any]]) -> DatasetFormat:
    if len(rows) == 0:
        raise DataFormatError("rows: the dataset has no rows")
    columns = rows.column_names if hasattr(rows, "column_names") else list(rows[0])
    return detect_format(columns, rows[0])
