"""``relayrl bench preference`` makes its pairs from the model's own samples (relayrl/bench/preference.py
``preference_pairs``): per prompt a sample the verifier passed (chosen) against one it failed (rejected), never
two of one kind, no pair from a prompt whose samples all agree, at most ``per_prompt`` pairs (each distinct sample
used before one repeats, no pair twice); the length-only baselines the reward model is compared with; the rows are TRL's
conversational preference format, which relayrl's loader detects and renders for ``train dpo`` / ``train rm`` on
the tiny ChatML tokenizer."""

from __future__ import annotations

from relayrl.bench.preference import length_baselines, preference_pairs, write_jsonl
from relayrl.data.trl_formats import load_format, render_preferences
from relayrl.models.tiny_chat import build_chat_tokenizer


def generations(prompt: str, scored: list[tuple[str, float]]) -> dict:
    """One prompt's record as ``relayrl eval --generations`` writes it."""
    samples = [
        {"response": text, "reward": reward, "finish_reason": "stop", "versions": [0]} for text, reward in scored
    ]
    return {
        "kind": "eval",
        "eval": "train",
        "step": 0,
        "prompt_id": "eval/train/0",
        "prompt": prompt,
        "samples": samples,
    }


def test_pairs_are_a_passed_and_a_failed_sample_of_one_prompt_in_trl_conversational_format(tmp_path) -> None:
    rows = [
        generations(
            "What is 3 + 4?",
            [("3 + 4 = 7", 1.0), ("It is 8", 0.0), ("3 + 4 = 7", 1.0), ("7.", 1.0), ("The sum", 0.0), ("Hmm", 0.0)],
        ),
        generations("What is 1 + 1?", [("2", 1.0), ("1 + 1 = 2", 1.0)]),  # all passed: no pair
        generations("What is 5 + 2?", [("6", 0.0), ("8", 0.0)]),  # all failed: no pair
        generations("What is 2 + 2?", [("5", 0.0), ("4", 1.0), ("4", 1.0), ("5", 0.0)]),  # duplicates: one pair
    ]
    pairs = preference_pairs(rows, per_prompt=2)

    assert [(p["prompt"][0]["content"], p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs] == [
        ("What is 3 + 4?", "3 + 4 = 7", "It is 8"),
        ("What is 3 + 4?", "7.", "The sum"),
        ("What is 2 + 2?", "4", "5"),
    ]
    assert all(p["prompt"][0]["role"] == "user" and p["chosen"][0]["role"] == "assistant" for p in pairs)
    assert len(preference_pairs(rows, per_prompt=1)) == 2
    # more pairs than chosen samples: the chosen ones cycle against the rest of the rejected, then it stops
    more = [(p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in preference_pairs(rows[:1], per_prompt=9)]
    assert more == [("3 + 4 = 7", "It is 8"), ("7.", "The sum"), ("3 + 4 = 7", "Hmm")]

    path = tmp_path / "pairs.jsonl"
    write_jsonl(pairs, path)
    loaded, fmt = load_format(str(path))
    assert (fmt.kind, fmt.conversational) == ("preference", True)
    tokenizer = build_chat_tokenizer()
    (first, *_) = render_preferences(list(loaded), tokenizer)
    assert tokenizer.decode(first.chosen_ids).startswith("3 + 4 = 7")
    assert tokenizer.decode(first.rejected_ids).startswith("It is 8")
    assert "What is 3 + 4?" in tokenizer.decode(first.prompt_ids)


def test_length_baselines_score_pairs_by_response_length_alone() -> None:
    def pair(chosen: str, rejected: str) -> dict:
        return {
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }

    pairs = [pair("7", "It is 8"), pair("3 + 4 = 7", "no"), pair("4", "5"), pair("2", "So 1 + 1 is 3")]
    assert length_baselines(pairs) == {"shorter_wins": 0.5, "longer_wins": 0.25}
    words = length_baselines(pairs, lambda text: len(text.split()))  # "3 + 4 = 7" is 5 words to "no"'s 1
    assert words == {"shorter_wins": 0.5, "longer_wins": 0.25}
    assert length_baselines(pairs, lambda text: 1) == {"shorter_wins": 0.0, "longer_wins": 0.0}  # all ties
