"""Token-in/token-out over a real Qwen2.5 chat template (built locally): the trained ids are the sampled ids plus the
rendered deltas, token for token; the loss mask covers exactly the sampled tokens; a full re-render differs."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.env.examples.guess import GuessNumber
from relayrl.episodes.loop import DONE, EpisodeLimits, EpisodeLoop
from relayrl.episodes.render import ChatRenderer, TemplateError
from relayrl.models.tiny_chat import build_chat_tokenizer
from relayrl.v1 import common_pb2
from tests.unit.episode_testing import ScriptedPolicy, local_pool

# three turns of tool calls against GuessNumber with secret 5: one call, two parallel calls, the winning call
TURNS = [
    '<tool_call>\n{"name":"guess","arguments":{"number":4}}\n</tool_call>',
    'Two at once.<tool_call>{"name": "guess", "arguments": {"number": 7}}</tool_call>'
    '<tool_call>{"name": "guess", "arguments": {"number": 3}}</tool_call>',
    '<tool_call>\n{"name": "guess", "arguments": {"number": 5}}\n</tool_call>',
]
# what the template writes between the turns, by hand: the "\n" after the sampled <|im_end|>, the tool results
# grouped in one user turn, the next generation prompt
DELTAS = [
    "\n<|im_start|>user\n<tool_response>\nhigher\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "\n<|im_start|>user\n<tool_response>\nlower\n</tool_response>\n<tool_response>\nhigher\n</tool_response>"
    "<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


LIMITS = EpisodeLimits(4, 4096, 64)


def play(tokenizer, texts, *, task=None, limits=LIMITS, cut=frozenset(), env=GuessNumber):
    policy = ScriptedPolicy(tokenizer, texts, cut=cut)

    async def main():
        pool = local_pool(env)
        try:
            return await EpisodeLoop(tokenizer, policy, limits).run(pool, "s", task or {"secret": 5}, 7)
        finally:
            await pool.close()

    return asyncio.run(main()), policy


def test_trained_ids_are_sampled_ids_plus_rendered_deltas(tokenizer):
    episode, policy = play(tokenizer, TURNS)
    assert (episode.end, episode.reward, episode.turns) == (DONE, 1.0, 3)

    opening = [m for m in episode.messages if m["role"] in ("system", "user")][:2]
    assert episode.prompt_ids == tokenizer.apply_chat_template(
        opening, tools=episode.tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    deltas = [encode(tokenizer, text) for text in DELTAS]
    # every turn's prompt is the previous prompt + what was sampled + the delta: the engine continues the sequence
    assert policy.prompts[0] == episode.prompt_ids
    for k in range(2):
        assert policy.prompts[k + 1] == policy.prompts[k] + policy.sampled[k] + deltas[k]
    trained = episode.prompt_ids + episode.response_ids
    assert trained == policy.prompts[2] + policy.sampled[2]
    assert all(s[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") for s in policy.sampled)
    assert tokenizer.decode(deltas[0][:1]) == "\n"  # the newline after <|im_end|>: never sampled, mask 0

    s, d = policy.sampled, deltas
    mask = [1] * len(s[0]) + [0] * len(d[0]) + [1] * len(s[1]) + [0] * len(d[1]) + [1] * len(s[2])
    assert list(episode.mask) == mask
    sampled_at = [i for i, m in enumerate(mask) if m]
    assert [episode.response_ids[i] for i in sampled_at] == s[0] + s[1] + s[2]
    assert episode.logprobs == pytest.approx(
        [-0.1] * len(s[0]) + [0.0] * len(d[0]) + [-0.2] * len(s[1]) + [0.0] * len(d[1]) + [-0.3] * len(s[2])
    )
    assert episode.versions == [10] * len(s[0]) + [0] * len(d[0]) + [11] * len(s[1]) + [0] * len(d[1]) + [12] * len(
        s[2]
    )
    assert episode.observation_tokens == len(d[0]) + len(d[1])

    completion = episode.completion("p", 3)
    assert list(completion.token_ids) == episode.response_ids
    assert completion.loss_mask == bytes(mask)
    assert (completion.policy_version, completion.worker_id, completion.sample_index) == (10, "w0", 3)
    assert completion.finish_reason == common_pb2.FINISH_REASON_STOP


def test_a_full_re_render_differs_from_what_was_sampled(tokenizer):
    """Re-tokenizing the finished conversation (what verl #6501, slime #2288 and prime-rl #1352 trained on) gives
    other tokens: the template re-serialises the tool-call JSON the model wrote compactly, moves the content before
    the calls onto its own line and drops nothing the model said but rewrites how it said it."""
    episode, policy = play(tokenizer, TURNS)
    trained = episode.prompt_ids + episode.response_ids
    rerender = tokenizer.apply_chat_template(
        episode.messages[:-1], tools=episode.tools, tokenize=True, return_dict=False
    )  # the conversation up to the last assistant turn, as a re-tokenizing trainer would build it
    trained_text, rerender_text = tokenizer.decode(trained), tokenizer.decode(rerender)
    assert '{"name":"guess","arguments":{"number":4}}' in trained_text
    assert '{"name":"guess","arguments":{"number":4}}' not in rerender_text
    assert '{"name": "guess", "arguments": {"number": 4}}' in rerender_text
    assert "Two at once.<tool_call>" in trained_text and "Two at once.\n<tool_call>\n" in rerender_text
    first_diff = next(i for i, (a, b) in enumerate(zip(trained, rerender)) if a != b)
    assert len(episode.prompt_ids) <= first_diff < len(episode.prompt_ids) + len(policy.sampled[0])


def test_a_turn_cut_short_gets_the_templates_end_of_turn_with_mask_0(tokenizer):
    texts = ["I think it is", "5"]
    episode, policy = play(tokenizer, texts, cut={0}, task={"secret": 5, "tools": False})
    assert episode.end == DONE and episode.turns == 2
    delta = episode.response_ids[len(policy.sampled[0]) : len(episode.response_ids) - len(policy.sampled[1])]
    assert tokenizer.decode(delta).startswith("<|im_end|>\n<|im_start|>user\nSay a number")
    assert set(episode.mask[len(policy.sampled[0]) : len(policy.sampled[0]) + len(delta)]) == {0}


def test_closing_is_read_from_the_template(tokenizer):
    renderer = ChatRenderer(tokenizer)
    assert renderer.closing == "<|im_end|>\n" and renderer.end_of_turn == "<|im_end|>"
    assert renderer.closing_after("x<|im_end|>") == "\n"
    assert renderer.closing_after("x") == "<|im_end|>\n"


def test_a_template_that_rewrites_history_is_diffed_against_the_probe(tokenizer):
    """A Qwen3-like template drops the reasoning of every assistant turn but the last: render(conv) is then no prefix
    of render(conv + new), and the delta is the new messages' own rendering."""
    template = (
        "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
        "{%- else %}{{ m.content }}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    qwen3ish = build_chat_tokenizer()
    qwen3ish.chat_template = template
    renderer = ChatRenderer(qwen3ish)
    conversation = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "<think>hm</think>4"}]
    delta = renderer.delta_text(conversation, [{"role": "user", "content": "higher"}], "<think>hm</think>4<|im_end|>")
    assert delta == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"


def test_a_tokenizer_without_a_chat_template_is_refused(tokenizer):
    plain = build_chat_tokenizer()
    plain.chat_template = None
    with pytest.raises(TemplateError, match=r"model\.path: the tokenizer has no chat template"):
        ChatRenderer(plain)
