"""Chat-template deltas: the tokens of new messages, rendered against the conversation so far.

An episode's token sequence is built, never re-tokenized: prompt ids, then each turn's sampled ids as the engine
returned them, then the *delta* of the messages that answer the turn. For messages ``new`` after a conversation
``conv`` whose last message is the assistant's turn just sampled::

    delta_text = closing + render(conv + new, add_generation_prompt=True)[len(render(conv)):]
    delta_ids  = tokenize(delta_text) alone (no special tokens added)

``closing`` is what the template writes after an assistant message's content that the model did not sample:
the template's end of an assistant turn (Qwen: ``<|im_end|>\\n``) minus the end-of-turn token when the model
sampled it (then only ``\\n``: the newline verl #6501 lost at every assistant -> tool boundary). It is read
once from a probe conversation. Tokenizing the delta alone is exact where the delta starts after a special token
(every ChatML template: ``<|im_end|>`` ends each turn), and whatever it gives is what the next turn's prompt
holds, so the trained ids are the engine's ids either way.

When the template renders a conversation so that ``render(conv)`` is not a prefix of ``render(conv + new)``
(Qwen3 drops earlier turns' ``<think>`` blocks), the delta is taken the same way against a fixed probe
conversation instead: the messages' own rendering, independent of the history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PROBE_USER = {"role": "user", "content": "\x00probe-user\x00"}
PROBE_TEXT = "\x00probe-reply\x00"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot render an episode (no template, or no assistant turn found)."""


class ChatRenderer:
    """Renders an episode's prompt and deltas with ``tokenizer``'s chat template and the episode's ``tools``."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("model.path: the tokenizer has no chat template; episodes need one")
        self.tokenizer = tokenizer
        self.tools = list(tools) or None
        self.closing = self._closing()
        eos = tokenizer.eos_token
        # the end-of-turn text the model samples itself (Qwen: <|im_end|>, its EOS), when the closing starts with it
        self.end_of_turn = eos if eos and self.closing.startswith(eos) else ""

    def text(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """The opening conversation with the generation prompt: the episode's prompt ids."""
        return self.encode(self.text(messages, add_generation_prompt=True))

    def _closing(self) -> str:
        """The template's text after an assistant message's content (Qwen: ``<|im_end|>\\n``)."""
        rendered = self.text([PROBE_USER, {"role": "assistant", "content": PROBE_TEXT}])
        at = rendered.rfind(PROBE_TEXT)
        if at < 0:
            raise TemplateError("model.path: the chat template does not render an assistant message's content")
        return rendered[at + len(PROBE_TEXT) :]

    def closing_after(self, sampled_text: str) -> str:
        """What closes a turn whose sampled text (special tokens kept) is ``sampled_text``: ``closing`` minus the
        end-of-turn token when the model sampled it, the whole ``closing`` when it was cut short."""
        if self.end_of_turn and sampled_text.endswith(self.end_of_turn):
            return self.closing[len(self.end_of_turn) :]
        return self.closing

    def delta_text(self, conversation: Sequence[dict], new: Sequence[dict], sampled_text: str) -> str:
        """The text that follows the last sampled token: the closing of the assistant turn (the last message of
        ``conversation``), the ``new`` messages, the generation prompt (module docstring)."""
        before = self.text(conversation)
        after = self.text([*conversation, *new], add_generation_prompt=True)
        if not after.startswith(before):  # the template rewrites history: render against the probe instead
            probe = [PROBE_USER, {"role": "assistant", "content": PROBE_TEXT}]
            before = self.text(probe)
            after = self.text([*probe, *new], add_generation_prompt=True)
            if not after.startswith(before):
                raise TemplateError("model.path: the chat template renders no message as a suffix of the ones before")
        return self.closing_after(sampled_text) + after[len(before) :]

    def delta(self, conversation: Sequence[dict], new: Sequence[dict], sampled_text: str) -> list[int]:
        """``delta_text`` tokenized alone."""
        return self.encode(self.delta_text(conversation, new, sampled_text))
