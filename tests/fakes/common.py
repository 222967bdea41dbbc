"""What both fakes share: the model their fake workers hold, thread-parallel fake RPCs, teacher-forced logprobs."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from relayrl.trainer.algorithms.logprobs import logprobs_from_logits


class FakeEngineModel:
    """The model inside a fake engine process: ``load_weights`` as vLLM's and SGLang's models have it (an
    iterable of (name, tensor) in Hugging Face names; an unknown name raises KeyError, as their
    ``params_dict[name]`` does). Unlike the real engines it keeps Hugging Face names and the full, unsharded
    tensors. Fake ranks share one instance; loads are serialised."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._params = dict(module.named_parameters(remove_duplicate=False))
        self._lock = threading.Lock()
        self.loaded_names: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        with self._lock, torch.no_grad():
            for name, tensor in weights:
                self._params[name].copy_(tensor)
                loaded.add(name)
                self.loaded_names.append(name)
        return loaded

    def named_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters()


def run_on_ranks(ranks: int, call: Callable[[int], Any]) -> list[Any]:
    """``call(rank)`` for every rank at once (threads stand in for the engine's processes); results in rank
    order. Collectives between the ranks work because they run concurrently, as in the real engine."""
    with ThreadPoolExecutor(max_workers=ranks) as pool:
        futures = [pool.submit(call, rank) for rank in range(ranks)]
        return [f.result() for f in futures]


@torch.no_grad()
def teacher_forced_logits(module: torch.nn.Module, prompt: Sequence[int], response: Sequence[int]) -> torch.Tensor:
    """Logits [len(response), V] (float32) that predicted each response token, from one full forward."""
    ids = torch.tensor([list(prompt) + list(response)])
    return module(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()


def vllm_top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's top-p masking (``apply_top_k_top_p_pytorch``): sort ascending, mask the tokens whose cumulative
    probability is <= 1 - top_p (never the most likely one) with -inf."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    mask = cumulative <= 1 - top_p
    mask[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / temperature)[token] per position."""
    return logprobs_from_logits(logits, torch.tensor(list(tokens)), temperature).tolist()
