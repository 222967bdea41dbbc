"""Helpers shared by the tests of the external-engine adapters (test_engine_vllm.py, test_engine_sglang.py):
the trainer's view of the tiny model, a trainer-side sender, and the API surface recorded in docs/engines.md."""

from __future__ import annotations

import dataclasses
import inspect
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.algorithms.logprobs import logprobs_from_logits
from relayrl.models.tiny import write_tiny_model
from relayrl.rollout.engine import EngineCompletion
from relayrl.weightsync.checksum import weights_checksum
from relayrl.weightsync.group import WeightBroadcastGroup
from relayrl.weightsync.manifest import WeightManifest, build_manifest
from relayrl.weightsync.sender import WeightSender
from relayrl.wire.sampling import SamplingParams

DOCS = Path(__file__).resolve().parents[2] / "docs" / "engines.md"
PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13], [14]]  # different lengths
EOS = 1


def sharp_tiny_model(path: Path, **sizes: int) -> Path:
    """The tiny model (``sizes``: write_tiny_model's) with its matrices scaled x4, so that logits are far from
    uniform."""
    write_tiny_model(path, seed=0, **sizes)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.ndim == 2:
                weight.mul_(4.0)
    model.save_pretrained(path)
    return path


def load(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def new_weights(model_dir: Path, seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """Perturbed weights (as the trainer's named_parameters) and a model holding them (the trainer's view)."""
    model = load(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.5)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, model


@torch.no_grad()
def recompute(
    model: torch.nn.Module, prompt: Sequence[int], response: Sequence[int], temperature: float
) -> list[float]:
    """The trainer's logprobs: one full forward of prompt + response."""
    logits = model(input_ids=torch.tensor([list(prompt) + list(response)])).logits[0, len(prompt) - 1 : -1]
    return logprobs_from_logits(logits, torch.tensor(list(response)), temperature).tolist()


def by_key(completions: list[EngineCompletion]) -> dict[tuple[int, int], EngineCompletion]:
    keys = [(c.prompt_index, c.sample_index) for c in completions]
    assert len(keys) == len(set(keys)), "every sample is yielded exactly once"
    return dict(zip(keys, completions, strict=True))


def assert_trainer_logprobs(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], completions: dict, temperature: float
) -> None:
    """Every completion's logprobs equal the trainer's recompute within 1e-4."""
    for (p, _), c in completions.items():
        if c.token_ids:
            expected = recompute(model, prompts[p], c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)


def sync_manifest(weights: dict[str, torch.Tensor], version: int = 1, **kw: Any) -> WeightManifest:
    """The trainer's manifest for ``weights`` (small buckets, so that there are several), with its checksum."""
    specs = [(name, tuple(t.shape), t.dtype) for name, t in weights.items()]
    manifest = build_manifest(specs, version=version, bucket_bytes=4096, **kw)
    return dataclasses.replace(manifest, checksum=weights_checksum(weights.items()))


def send_in_background(group: WeightBroadcastGroup, manifest: WeightManifest, weights) -> Callable[[], None]:
    """Trainer rank 0 broadcasting in a thread; the returned join re-raises its failure."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            WeightSender("cpu").send(group, manifest, weights)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()

    def join() -> None:
        thread.join(timeout=60)
        assert not thread.is_alive() and not errors, errors

    return join


def documented(prefix: str) -> dict[str, set[str]]:
    """callable -> keyword names, from the "API surface relied on" table of docs/engines.md."""
    table = DOCS.read_text(encoding="utf-8").split("## API surface relied on", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w.]+)` \| ([^|]+) \|", table, flags=re.M)
    return {name: set(re.findall(r"`(\w+)`", cell)) for name, cell in rows if name.startswith(prefix)}


def accepted(obj: Any, extra: frozenset[str] = frozenset()) -> set[str]:
    """Keyword names ``obj`` takes: its parameters (or a TypedDict's keys), plus ``extra`` behind **kwargs."""
    if isinstance(obj, type) and issubclass(obj, dict):
        return set(obj.__annotations__)
    params = inspect.signature(obj).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
    return names | (extra if any(p.kind is p.VAR_KEYWORD for p in params) else set())


def record(monkeypatch: pytest.MonkeyPatch, owner: Any, attr: str, key: str, used: dict[str, set[str]]) -> None:
    """Wrap ``owner.attr`` so that the name of every argument it is called with is added to ``used[key]``."""
    original = getattr(owner, attr)
    if isinstance(original, type) and issubclass(original, dict):  # a TypedDict: keyword arguments only
        signature = inspect.Signature([inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    else:
        signature = inspect.signature(original)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        used.setdefault(key, set()).update(set(bound) - {"self", var_keyword} | set(bound.get(var_keyword, {})))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attr, wrapper)


def assert_concurrent_calls_exact(engine: Any, model_dir: Path, calls: int = 4) -> None:
    """``calls`` generate calls released together from their own threads: each gets exactly its samples, every
    response 16 tokens, with the trainer's logprobs. (Whether the engine batched them is engine-specific.)"""
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5, ignore_eos=True)
    barrier = threading.Barrier(calls)
    results: dict[int, list[EngineCompletion]] = {}

    def call(index: int) -> None:
        barrier.wait()
        results[index] = list(engine.generate(PROMPTS, params))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert sorted(results) == list(range(calls))
    reference = load(model_dir)
    for completions in results.values():
        keyed = by_key(completions)
        assert set(keyed) == {(p, s) for p in range(len(PROMPTS)) for s in range(params.n)}
        assert all(len(c.token_ids) == params.max_tokens for c in completions)
        assert_trainer_logprobs(reference, PROMPTS, keyed, 1.0)


def assert_continued_across_update(
    results: list[EngineCompletion], model_dir: Path, trained: Path, frozen_at: int
) -> None:
    """Rows frozen after ``frozen_at`` tokens and resumed on ``trained``: none restarted, the first ``frozen_at``
    tokens carry version 0 and the old model's logprobs, the rest version 1 and the new model's."""
    old = load(model_dir)
    for c in results:
        tail = len(c.token_ids) - frozen_at
        assert c.finish_reason == "length" and c.token_versions == [0] * frozen_at + [1] * tail
        prompt = PROMPTS[c.prompt_index]
        before, after = slice(None, frozen_at), slice(frozen_at, None)
        assert c.logprobs[before] == pytest.approx(recompute(old, prompt, c.token_ids, 1.0)[before], abs=1e-4)
        assert c.logprobs[after] == pytest.approx(recompute(trained, prompt, c.token_ids, 1.0)[after], abs=1e-4)


def assert_stop_string_ends_the_sample(engine: Any, model_dir: Path) -> None:
    """Stop strings (``SamplingParams.stop``) as vLLM applies them: with ``stop`` = (a string completed late, one
    completed at token ``cut`` of the greedy response), the sample ends at the first string completed, finish "stop",
    its token ids and logprobs the greedy ones up to and including the token that completed it."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=12)
    (free,) = engine.generate(PROMPTS[1:2], greedy)
    texts = [tokenizer.decode(free.token_ids[:k], skip_special_tokens=True) for k in range(len(free.token_ids) + 1)]
    text = texts[-1]
    change = next(i for i in range(1, len(text)) if text[i] != text[i - 1])
    early, late = text[change - 1 : change + 1], text[-2:]  # on the sharp tiny model: "02" and "22"
    cut = next(k for k, t in enumerate(texts) if early in t)
    assert 1 < cut < next(k for k, t in enumerate(texts) if late in t)  # the premise: early completes first
    (stopped,) = engine.generate(PROMPTS[1:2], dataclasses.replace(greedy, stop=(late, early)))
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:cut]
    assert stopped.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-6)
