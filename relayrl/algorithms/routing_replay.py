"""Mixture-of-experts routing replay: the experts an engine's router chose, recorded and replayed in a forward.

A top-k router (transformers' ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``) maps the
hidden states of a layer's N tokens to (router logits [N, E], routing weights [N, k], expert indices [N, k]) with

    p = softmax(logits)  (float32),   idx = topk(p, k),   w = p[idx]  (/ sum_k p[idx] where the router normalises)

``RoutingRecorder`` keeps ``idx`` of every router call (forward hooks on the routers, in layer order).
``replaying(model, routing)`` makes every router answer the given indices instead of its own top-k: the logits
are still computed from the hidden states and the weights are ``replayed_weights`` of them, so the router keeps
its gradient while the chosen experts are the recorded ones. With the indices the router would choose itself, a
replayed forward is the model's own forward, bit for bit.

Routing travels as ``[tokens, layers, k]`` indices: uint8 where a layer has at most 256 experts, else int16.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from relayrl.v1 import common_pb2

# the router classes whose forward is the one above (softmax, top-k, optional renormalisation), by class name
REPLAYABLE_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter")


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (modules whose class name ends in ``TopKRouter``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why routing replay cannot run on ``model`` (a dense model, or a router of another form); None: it can."""
    found = routers(model)
    if not found:
        return f"model_type {model.config.model_type!r} has no mixture-of-experts router (a dense model)"
    other = sorted({type(m).__name__ for m in found} - set(REPLAYABLE_ROUTERS))
    if other:
        return f"router {other[0]} is not one of {', '.join(REPLAYABLE_ROUTERS)}"
    return None


def routing_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(MoE layers, k, experts) of ``model``'s routers."""
    found = routers(model)
    return len(found), found[0].top_k, found[0].num_experts


def index_dtype(experts: int) -> torch.dtype:
    """The wire dtype of expert indices: uint8 up to 256 experts, else int16."""
    return torch.uint8 if experts <= 256 else torch.int16


def replayed_weights(logits: torch.Tensor, indices: torch.Tensor, normalize: bool) -> torch.Tensor:
    """w = softmax(logits)[indices] in float32, divided by its sum over k when ``normalize`` (the router's
    ``norm_topk_prob``; Mixtral always): logits [N, E], indices [N, k] -> [N, k]."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    return weights / weights.sum(dim=-1, keepdim=True) if normalize else weights


class RoutingRecorder:
    """Records the expert indices of every router call of ``model`` (forward hooks); ``take`` hands them out per
    forward. Used from the one thread that runs the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        layers, self.top_k, experts = routing_shape(model)
        self.layers, self.dtype = layers, index_dtype(experts)
        self._calls: list[torch.Tensor] = []
        self._hooks = [router.register_forward_hook(self._record) for router in routers(model)]

    def _record(self, module: torch.nn.Module, args: tuple, output: tuple) -> None:
        self._calls.append(output[2].to("cpu", self.dtype))

    def take(self, rows: int) -> torch.Tensor:
        """The indices of the last forward of ``rows`` rows: [rows, positions, layers, k] (what the routers saw as
        rows x positions tokens); forgets them."""
        calls, self._calls = self._calls, []
        if len(calls) != self.layers:
            raise RuntimeError(f"routing: {len(calls)} router calls recorded for a forward of {self.layers} layers")
        return torch.stack(calls, dim=1).reshape(rows, -1, self.layers, self.top_k)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


@contextmanager
def replaying(model: torch.nn.Module, routing: torch.Tensor) -> Iterator[None]:
    """Within the block, the routers of ``model``'s next forward answer ``routing`` [tokens, layers, k] (tokens in
    the order the routers see them: rows x positions, flattened) with ``replayed_weights`` of their own logits
    (module docstring). A token count other than the forward's is a ValueError naming ``routed_experts``."""
    found = routers(model)
    if routing.shape[1] != len(found):
        raise ValueError(f"routed_experts: {routing.shape[1]} layers for a model of {len(found)} MoE layers")

    def hook_for(layer: int, router: torch.nn.Module):
        normalize = bool(getattr(router, "norm_topk_prob", True))

        def replay(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
            logits, scores, _ = output
            if logits.shape[0] != routing.shape[0]:
                raise ValueError(f"routed_experts: {routing.shape[0]} tokens for a forward of {logits.shape[0]}")
            indices = routing[:, layer].to(logits.device, torch.long)
            return logits, replayed_weights(logits, indices, normalize).to(scores.dtype), indices

        return replay

    hooks = [router.register_forward_hook(hook_for(i, router)) for i, router in enumerate(found)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def to_message(routing: torch.Tensor) -> common_pb2.RoutedExperts:
    """``routing`` [tokens, layers, k] (uint8 or int16) as its wire message (row-major, little-endian)."""
    wide = routing.dtype != torch.uint8
    data = routing.contiguous().numpy().astype("<i2" if wide else "<u1").tobytes()
    return common_pb2.RoutedExperts(
        indices=data, layers=routing.shape[1], top_k=routing.shape[2], index_bytes=2 if wide else 1
    )


def from_message(message: common_pb2.RoutedExperts) -> torch.Tensor:
    """The inverse of ``to_message``: [tokens, layers, k] int64. A size that is not a whole number of tokens is a
    ValueError naming ``routed_experts``."""
    per_token = message.layers * message.top_k * message.index_bytes
    if message.index_bytes not in (1, 2) or per_token <= 0 or len(message.indices) % per_token:
        raise ValueError(
            f"routed_experts: {len(message.indices)} bytes is not a whole number of tokens of {message.layers} "
            f"layers x {message.top_k} experts x index_bytes {message.index_bytes}"
        )
    dtype = torch.uint8 if message.index_bytes == 1 else torch.int16
    return torch.frombuffer(bytearray(message.indices), dtype=dtype).reshape(-1, message.layers, message.top_k).long()


def routed_experts_problem(message: common_pb2.RoutedExperts, tokens: int) -> str | None:
    """Why ``message`` cannot be replayed on a sequence whose forward reads ``tokens`` routed tokens (the prompt and
    the response but its last token); None: it can."""
    try:
        routing = from_message(message)
    except ValueError as err:
        return str(err)
    if routing.shape[0] != tokens:
        return (
            f"routed_experts: {routing.shape[0]} tokens, expected {tokens} (the prompt and the response but its last)"
        )
    return None
