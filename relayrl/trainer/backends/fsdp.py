"""FSDP2 backend: ``fully_shard`` per decoder layer and at the root, gloo on CPU / NCCL on CUDA.

With ``model.lora`` the policy is wrapped by PEFT (``relayrl.trainer.backends.lora``): only the adapter trains,
the optimizer and checkpoints hold only the adapter (the frozen base comes from ``model.path``), and weights are
gathered by kind: "base" (the frozen weights under their Hugging Face names, once) and "adapter" (every step).
Without it there is one kind, "full".

A world of one rank trains the plain module: there is nothing to shard, and FSDP's per-layer hooks,
parameter all-gathers and DTensor dispatch (copies and no-op collectives of one rank) would cost time and
change nothing. The math is the same (a one-rank gradient reduction
divides by 1); checkpoints are DCP's in both cases, so a run resumes on another world size.

Contract: every method is called by every rank (they hold collectives), except where noted.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from relayrl.algorithms.routing_replay import replaying
from relayrl.config import LoraConfig, ModelConfig, TrainerConfig
from relayrl.cores.threads import one_thread
from relayrl.runtime.attention import AUTO, load_with_attention, resolved
from relayrl.trainer.backends.checkpoint_state import write_trainer_state
from relayrl.trainer.backends.lora import (
    adapter_name,
    apply_lora,
    base_name,
    is_adapter,
    lora_spec,
    write_adapter,
    write_merged,
)
from relayrl.trainer.batch import right_padded
from relayrl.trainer.head import adopt_head_plan, head_plan, scored_logprobs
from relayrl.trainer.optim import adamw
from relayrl.trainer.packing import (
    PaddingFree,
    computed_positions,
    micro_batches,
    packed_logprobs,
    rope_unsupported,
    scatter,
)
from relayrl.trainer.precision import Precision
from relayrl.trainer.prefix import SharedPrefix, group_layouts, layout_unsupported, shared_prefix_logprobs

log = logging.getLogger(__name__)


def load_trained_model(
    path: str,
    precision: Precision,
    device: torch.device,
    *,
    lora: LoraConfig | None = None,
    gradient_checkpointing: bool = False,
    loader: Callable[..., torch.nn.Module] = AutoModelForCausalLM.from_pretrained,
    attn_implementation: str = AUTO,
) -> torch.nn.Module:
    """A model that trains: ``loader(path, dtype=float32)`` (wrapped by PEFT with ``lora``), float32 parameters
    whatever ``precision.compute`` is; in a world of more than one rank, fully_shard every decoder layer and the
    root under ``precision.fsdp_policy()``. One rank computes under ``precision.autocast`` instead (the caller's).
    Its attention: ``attn_implementation`` (``model.attn_implementation``, relayrl/runtime/attention.py), which
    ``precision.prepare`` may turn into float32 SDPA. A causal LM's fast paths are probed first, on the whole
    float32 module (``head.head_plan``, ``prefix.layout_unsupported``), on one thread (``one_thread``).
    ``gradient_checkpointing``: every decoder layer recomputes its forward in the backward pass (transformers'
    activation checkpointing, non-reentrant torch.utils.checkpoint)."""
    model = load_with_attention(loader, path, attn_implementation, dtype=precision.params).to(device)
    if device.type == "cpu":
        own_parameters(model)
    if model.get_output_embeddings() is not None:
        with one_thread():  # a few tokens each
            head_plan(model)
            layout_unsupported(model)
    precision.prepare(model, device)
    log.info("trainer model: %s attention (model.attn_implementation=%s)", resolved(model), attn_implementation)
    model.train(True)
    if gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if lora is not None:
        model = apply_lora(model, lora)
    if dist.get_world_size() > 1:  # one rank: nothing to shard (module docstring)
        shard(model, precision.fsdp_policy())
    return model


def own_parameters(model: torch.nn.Module) -> None:
    """Give every parameter memory of its own (tied ones stay one tensor). transformers keeps a checkpoint's tensors
    that are already in the dtype asked for as views of the safetensors file, which safetensors maps privately
    (``MAP_PRIVATE``): on a CPU, a float32 checkpoint's float32 parameters are pages of the file. The first write
    to each page (the first optimizer step) is then a copy-on-write fault, which must flush the page from every core
    the process's threads run on, and a change to the file under the run reaches the pages not yet written. One copy
    at load instead; on another device ``.to(device)`` has made one already."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


def load_frozen_model(
    path: str, dtype: torch.dtype, device: torch.device, attn_implementation: str = AUTO
) -> torch.nn.Module:
    """A model that never trains (the reference policy): from_pretrained in ``dtype`` with ``attn_implementation``,
    no gradients, sharded as ``load_trained_model`` does (its parameters already in ``dtype``: no policy)."""
    model = load_with_attention(AutoModelForCausalLM.from_pretrained, path, attn_implementation, dtype=dtype).to(device)
    model.train(False)
    model.requires_grad_(False)
    if dist.get_world_size() > 1:
        shard(model)
    return model


def shard(model: torch.nn.Module, policy=None) -> None:
    """fully_shard every decoder layer, then the root (the embeddings, final norm and head; PEFT's wrapper), under
    the MixedPrecisionPolicy ``policy`` (None: the parameters' own dtype)."""
    options = {} if policy is None else {"mp_policy": policy}
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in inner.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)


class FSDPBackend:
    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: TrainerConfig,
        *,
        with_reference: bool,
        weight_dtype: str = "auto",
        auto_class: Any = AutoModelForCausalLM,
    ) -> None:
        """``weight_dtype``: ``rollout.weight_dtype``, the dtype ``weight_specs`` reports (trainer/precision.py).
        ``auto_class``: what builds the trained model, ``from_pretrained(model.path)`` and ``from_config`` for the
        export (a causal LM; a reward model's one-label sequence classifier, relayrl/trainer/reward_trainer.py)."""
        self.auto_class = auto_class
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.precision = Precision.resolve(cfg, weight_dtype, self.device)
        self.model_path, self.lora_cfg = model_cfg.path, model_cfg.lora
        self.lora = lora_spec(model_cfg.lora) if model_cfg.lora is not None else None
        self.model = load_trained_model(
            model_cfg.path, self.precision, self.device, lora=model_cfg.lora,
            gradient_checkpointing=cfg.gradient_checkpointing, attn_implementation=model_cfg.attn_implementation,
            loader=auto_class.from_pretrained,
        )  # fmt: skip
        self.reference = (  # with LoRA too: the reference policy is the base model
            load_frozen_model(model_cfg.path, self.precision.reference, self.device, model_cfg.attn_implementation)
            if with_reference
            else None
        )
        if self.reference is not None:  # the float32 policy's probe, not the reference dtype's
            adopt_head_plan(self.reference, head_plan(self.model))
        self.optimizer = adamw(self.trainable, cfg)
        # Parameter names by kind (module docstring), each with the name the rollout engines know: parameters once
        # each (tied embeddings appear once).
        names = [name for name, _ in self.model.named_parameters()]
        if self.lora is None:
            self.kinds: dict[str, list[tuple[str, str]]] = {"full": [(name, name) for name in names]}
        else:
            self.kinds = {
                "base": [(base_name(name), name) for name in names if not is_adapter(name)],
                "adapter": [(adapter_name(name), name) for name in names if is_adapter(name)],
            }
        self.weight_names = [wire for wire, _ in self.kinds["base" if self.lora else "full"]]
        # LoRA: checkpoints hold the adapter only, so loading one leaves the frozen base weights as they are
        self._state_options = StateDictOptions(ignore_frozen_params=self.lora is not None, strict=self.lora is None)
        # Every rank is a data-parallel rank (the training step shards rows by these).
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        unpackable = rope_unsupported(self.model.config)
        self.padding_free = PaddingFree(
            cfg.padding_free, cfg.pack_token_budget, available=unpackable is None, reason=unpackable or ""
        )
        # the shared-prefix layout is probed on a causal LM's logits (a classifier's pooled output has no positions)
        causal = self.model.get_output_embeddings() is not None
        unsupported = layout_unsupported(self.model) if causal else "the model is not a causal LM"
        self.shared_prefix = SharedPrefix(
            cfg.shared_prefix, cfg.pack_token_budget, available=unsupported is None, reason=unsupported or ""
        )
        self.critic = None  # the value model (relayrl/trainer/backends/critic.py) under algorithm.advantage: gae

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        """The parameters that train: every one, or with LoRA the adapter's."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float,
        *,
        reference: bool = False,
        scored: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        routing: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position (logprob of the next token, entropy), both [B, L-1], at ``temperature``; only the positions
        ``scored`` [B, L-1] (the loss's; None: every valid one) go through the output head, the others are 0
        (relayrl/trainer/head.py).

        Rows of one ``groups`` id [B] (None: no groups) forward their common prefix once where
        ``trainer.shared_prefix`` decides so (relayrl/trainer/prefix.py); otherwise they go in length buckets
        (relayrl/trainer/packing.py) where ``trainer.padding_free`` decides so. Otherwise a
        right-padded batch (every row's mask ones then zeros, what ``to_train_batch`` builds) goes in without
        its mask: causal attention never looks right, so the valid positions come out bit for bit the same,
        and SDPA takes its causal kernel instead of a materialised mask (~9 % off a forward/backward).
        With several ranks, each rank's decision and count of packed forwards are agreed over all of them
        (FSDP's gathers run once per forward on every rank). Compute in ``precision.compute``; the results in
        float32.

        ``routing`` [B, L, layers, k] (routing replay, ``TrainBatch.routed_experts``): the policy's routers take
        these experts (``relayrl.algorithms.routing_replay.replaying``) in one padded forward of the rows, neither
        shared-prefix nor packed (their layouts would need the routing laid out alike); the reference model routes
        by itself."""
        valid = attention_mask[:, 1:].bool()
        scored = valid if scored is None else valid & scored.bool()
        model = self.reference if reference else self.model
        dtype = self.precision.reference if reference else self.precision.compute
        with self.precision.autocast(self.device):
            if routing is not None and not reference:
                self.padding_free.record(int(attention_mask.sum()), attention_mask.numel(), packed=False)
                with replaying(model, routing.flatten(0, 1)):
                    return self._padded_logprobs(model, input_ids, attention_mask, scored, temperature, dtype)
            return self._logprobs(model, input_ids, attention_mask, scored, temperature, dtype, groups)

    def _logprobs(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        scored: torch.Tensor,
        temperature: float,
        dtype: torch.dtype,
        groups: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, positions = int(attention_mask.sum()), attention_mask.numel()
        is_right_padded = right_padded(attention_mask)
        budget, lengths = self.padding_free.token_budget, attention_mask.sum(-1).tolist()
        layouts = group_layouts(input_ids, lengths, groups) if groups is not None and is_right_padded else None
        shared = sum(layout.length for layout in layouts) if layouts else tokens
        longest = max(layout.length for layout in layouts) if layouts else 0
        totals = self._agreed([tokens, positions, not is_right_padded, shared], dist.ReduceOp.SUM)
        longest = self._agreed([longest], dist.ReduceOp.MAX)[0]
        if not totals[2] and layouts is not None and self.shared_prefix.decide(totals[0], totals[3], longest):
            buckets = micro_batches([layout.length for layout in layouts], budget)
            forwards = self._agreed([len(buckets)], dist.ReduceOp.MAX)[0]
            computed = computed_positions(buckets, [layout.length for layout in layouts])
            self.padding_free.record(shared, computed, packed=True, row_tokens=tokens)
            return shared_prefix_logprobs(
                model, layouts, input_ids, scored, temperature, dtype, device=self.device, token_budget=budget,
                min_forwards=forwards,
            )  # fmt: skip
        if not totals[2] and self.padding_free.decide(totals[0], totals[1]):
            batches = micro_batches(lengths, budget)
            forwards = self._agreed([len(batches)], dist.ReduceOp.MAX)[0]
            self.padding_free.record(tokens, computed_positions(batches, lengths), packed=True)
            return packed_logprobs(
                model, input_ids, attention_mask, scored, temperature, dtype, device=self.device,
                token_budget=budget, min_forwards=forwards,
            )  # fmt: skip
        self.padding_free.record(tokens, positions, packed=False)
        return self._padded_logprobs(model, input_ids, attention_mask, scored, temperature, dtype)

    def _padded_logprobs(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        scored: torch.Tensor,
        temperature: float,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the padded rows (a right-padded batch without its mask: ``logprobs``)."""
        mask = None if right_padded(attention_mask) else attention_mask.to(self.device)
        rows, cols = scored.to(self.device).nonzero(as_tuple=True)
        picked = scored_logprobs(model, input_ids.to(self.device), mask, rows, cols, temperature, dtype)
        return tuple(scatter(values, (rows, cols), scored.shape) for values in picked)

    def _agreed(self, values: list[int], op: dist.ReduceOp) -> list[int]:
        """``values`` reduced by ``op`` over the ranks (collective); as they are with one rank."""
        if self.dp_size == 1:
            return values
        box = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(box, op=op)
        return box.tolist()

    def step(self, max_norm: float) -> float:
        """Clip the gradient norm, step, zero the gradients; returns the pre-clip norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def scale_grads(self, factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` (a streamed mini-batch's normaliser)."""
        for p in self.trainable:
            if p.grad is not None:
                p.grad.mul_(factor)

    def snapshot(self) -> tuple[list[torch.Tensor], dict]:
        """A copy of this rank's trained weights and optimizer state (a streamed step keeps one until it ends)."""
        return [p.detach().clone() for p in self.trainable], copy.deepcopy(self.optimizer.state_dict())

    def restore(self, snapshot: tuple[list[torch.Tensor], dict] | None) -> None:
        """Back to ``snapshot`` (None: keep the weights), gradients dropped: a streamed step whose stream broke."""
        if snapshot is not None:
            weights, optimizer = snapshot
            with torch.no_grad():
                for p, saved in zip(self.trainable, weights, strict=True):
                    p.copy_(saved)
            self.optimizer.load_state_dict(optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def weight_specs(self, kind: str = "full") -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(wire name, full shape, dtype) of every weight of ``kind`` (module docstring) the rollout engines load; the
        dtype is the engine's (``precision.engine``): ``gather_weights`` casts into it."""
        params = dict(self.model.named_parameters())
        return [(wire, tuple(params[name].shape), self.precision.engine) for wire, name in self._names(kind)]

    @torch.no_grad()
    def gather_weights(self, into: Mapping[str, torch.Tensor] | None, kind: str = "full") -> None:
        """Collective: each weight of ``kind`` is all-gathered in turn (one full tensor alive at a time) and rank 0
        copies it into ``into[wire name]`` (other ranks pass None), cast to its dtype: the gather writes where the
        sync reads."""
        params = dict(self.model.named_parameters())
        for wire, name in self._names(kind):
            param = params[name]
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if into is not None:
                into[wire].copy_(full)

    def _names(self, kind: str) -> list[tuple[str, str]]:
        if kind not in self.kinds:
            raise ValueError(f"kind: {kind!r} is not one of this backend's weight kinds {sorted(self.kinds)}")
        return self.kinds[kind]

    def save_checkpoint(self, directory: Path, trainer_state: dict) -> None:
        """Sharded model + optimizer with torch.distributed.checkpoint, then trainer_state.json (rank 0). With LoRA
        only the adapter and its optimizer state: the frozen base is ``model.path``."""
        dcp.save(self._checkpoint_state(), checkpoint_id=str(directory))
        write_trainer_state(directory, trainer_state)

    def _checkpoint_state(self) -> dict:
        """What a checkpoint holds: the policy's model and optimizer state, and the critic's (``critic``,
        ``critic_optim``) where one trains."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options)
        state = {"model": model_sd, "optim": optim_sd}
        if self.critic is not None:
            state["critic"], state["critic_optim"] = self.critic.state_dicts()
        return state

    def load_checkpoint(self, directory: Path) -> dict:
        state = self._checkpoint_state()
        dcp.load(state, checkpoint_id=str(directory))
        if self.critic is not None:
            self.critic.load_state_dicts(state["critic"], state["critic_optim"])
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._state_options,
        )
        return json.loads((directory / "trainer_state.json").read_text())

    def export_hf(self, directory: Path, tokenizer) -> None:
        """A Hugging Face model directory loadable with from_pretrained (rank 0 writes; collective). With LoRA:
        ``directory/adapter``, a PEFT adapter directory, and (``model.lora.export_merged``) ``directory/merged``,
        the base with the adapter merged in. A critic goes to ``directory/critic`` (a token-classification model)."""
        if self.critic is not None:
            self.critic.export_hf(directory / "critic", tokenizer)
        if self.lora is not None:
            self._export_adapter(directory, tokenizer)
            return
        model = self.full_model()
        if model is not None:
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
        dist.barrier()

    def full_model(self) -> torch.nn.Module | None:
        """Rank 0: the trained weights gathered into a plain ``auto_class`` model on the CPU; None on the other
        ranks (collective; without LoRA)."""
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() != 0:
            return None
        model = self.auto_class.from_config(self.model.config, dtype=next(iter(state.values())).dtype)
        model.load_state_dict(state)
        return model

    def _export_adapter(self, directory: Path, tokenizer) -> None:
        """``export_hf`` with LoRA: the adapter as PEFT saves it; the merged model from it, through PEFT."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(self.model, options=options)
        if dist.get_rank() == 0:
            names = {name: wire for wire, name in self.kinds["adapter"]}  # (a tied frozen weight may come along)
            adapter = {names[k]: v for k, v in state.items() if k in names}
            write_adapter(directory / "adapter", self.lora_cfg, self.model_path, adapter)
            tokenizer.save_pretrained(directory / "adapter")
            if self.lora_cfg.export_merged:
                write_merged(directory / "merged", self.model_path, directory / "adapter", self.model.dtype)
                tokenizer.save_pretrained(directory / "merged")
        dist.barrier()
