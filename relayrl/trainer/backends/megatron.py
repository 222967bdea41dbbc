"""Megatron-core backend: a GPTModel with tensor (TP) and pipeline (PP) parallelism, data parallel (DP) on top.

World = TP x PP x DP ranks (megatron-core's parallel_state groups). Each rank holds its TP slice of
its PP stage's layers, loaded from the Hugging Face directory (``megatron_convert``). Gradients are
averaged over the DP group (tied embeddings also summed between the first and last stage), the norm
is clipped over the model-parallel group, and AdamW steps the local slices (elementwise, so the same
update as on full tensors). Contract: every method is called by every rank (they hold collectives).

Precision (relayrl/trainer/precision.py), as Megatron's mixed-precision optimizer: with bf16 compute the model's
parameters are bf16 and the optimizer steps float32 main copies of them (loaded from the float32 Hugging Face
weights); each step the bf16 gradients become the main ones' float32 gradients, are reduced and clipped there,
and the updated main parameters are copied back. Weight sync, checkpoints and the export read the main ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from relayrl.config import MEGATRON_NO_PACKING, ModelConfig, TrainerConfig
from relayrl.trainer.backends.checkpoint_state import write_trainer_state
from relayrl.trainer.backends.megatron_convert import Unit, geometry, merge, shard, tied_output_unit, units
from relayrl.trainer.backends.megatron_cpu import apply_cpu_compat, seed_model_parallel_rng
from relayrl.trainer.backends.megatron_logprobs import vocab_parallel_logprobs
from relayrl.trainer.backends.megatron_model import build_gpt_model, check_supported, has_qkv_bias
from relayrl.trainer.backends.megatron_pipeline import run_stage, share_from_last_stage
from relayrl.trainer.optim import adamw
from relayrl.trainer.packing import PaddingFree
from relayrl.trainer.precision import Precision


def check_right_padded(attention_mask: torch.Tensor) -> None:
    """The causal mask alone is exact for right-padded rows (real tokens never see padding); refuse others."""
    if not torch.equal(attention_mask.cummin(dim=1).values, attention_mask):
        raise ValueError("attention_mask: the megatron backend needs right-padded rows (ones, then zeros)")


class MegatronBackend:
    lora = None  # LoRA trains on the FSDP backend only (config.py refuses model.lora with megatron)

    def __init__(
        self, model_cfg: ModelConfig, cfg: TrainerConfig, *, with_reference: bool, weight_dtype: str = "auto"
    ) -> None:
        """``weight_dtype``: ``rollout.weight_dtype``, the dtype ``weight_specs`` reports (trainer/precision.py)."""
        from megatron.core import parallel_state as ps

        self.tp, self.pp = cfg.megatron.tensor_parallel, cfg.megatron.pipeline_parallel
        if dist.get_world_size() % (self.tp * self.pp):
            raise ValueError(
                f"trainer.nproc: {dist.get_world_size()} ranks are not a multiple of "
                f"tensor_parallel x pipeline_parallel = {self.tp * self.pp}"
            )
        apply_cpu_compat()
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        seed_model_parallel_rng(0, self.tp_rank)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.precision = Precision.resolve(cfg, weight_dtype, self.device)
        hf_model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=Precision.params)
        self.hf_config = hf_model.config
        check_supported(self.hf_config, self.tp)
        hf_params = dict(hf_model.named_parameters())
        # Names the rollout engines know, in Hugging Face order (tied embeddings appear once): FSDP's manifest.
        self.weight_names = list(hf_params)
        self._specs = [(name, tuple(p.shape), p.dtype) for name, p in hf_params.items()]  # float32: the main ones
        self.geo = geometry(self.hf_config, self.tp)
        self.units = units(self.hf_config, self.pp, qkv_bias=has_qkv_bias(self.hf_config))
        load = [*self.units, *filter(None, [tied_output_unit(self.hf_config, self.pp)])]
        self.model = self._build(hf_params, load, self.precision.compute, trainable=True)
        self.reference = (
            self._build(hf_params, load, self.precision.reference, trainable=False) if with_reference else None
        )
        self.critic = None  # no value model here: the config refuses algorithm.advantage gae on megatron
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.main = self._main_params(hf_params, load)
        del hf_model, hf_params
        self.optimizer = adamw(self.main, cfg)
        self.padding_free = PaddingFree(cfg.padding_free, cfg.pack_token_budget, available=False,
                                        reason=MEGATRON_NO_PACKING)  # fmt: skip

    def _main_params(self, hf_params: Mapping[str, torch.Tensor], load: list[Unit]) -> list[torch.Tensor]:
        """The float32 parameters the optimizer steps, one per ``self.params`` (module docstring): the trained ones
        themselves at float32 compute, else float32 copies cut from the Hugging Face weights."""
        if not self.precision.mixed:
            return self.params
        full = {unit.local_name: unit for unit in load if unit.stage == self.pp_rank}
        main = []
        for name, param in self.model.named_parameters():
            if name in full:
                value = shard(full[name], hf_params, self.tp_rank, self.tp, self.geo).to(self.device, Precision.params)
            else:
                value = param.detach().to(Precision.params)
            main.append(torch.nn.Parameter(value.clone(), requires_grad=True))
        return main

    @property
    def _main_by_name(self) -> dict[str, torch.Tensor]:
        return dict(zip((name for name, _ in self.model.named_parameters()), self.main, strict=True))

    def _build(self, hf_params: Mapping[str, torch.Tensor], load: list[Unit], dtype: torch.dtype, *, trainable: bool):
        model = build_gpt_model(
            self.hf_config, tp=self.tp, pp=self.pp, pp_rank=self.pp_rank,
            padded_vocab=self.geo.padded_vocab, dtype=dtype,
        )  # fmt: skip
        local = dict(model.named_parameters())
        with torch.no_grad():
            for unit in load:
                if unit.stage == self.pp_rank:
                    local[unit.local_name].copy_(shard(unit, hf_params, self.tp_rank, self.tp, self.geo))
        model.to(self.device).train(trainable)
        model.requires_grad_(trainable)
        return model

    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        temperature: float,
        *,
        reference: bool = False,
        scored: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position (logprob of the next token, entropy), both [B, L-1], at ``temperature``, on every rank.
        ``scored`` and ``groups`` are the FSDP backend's hints (the positions the loss reads, the rows that share a
        prompt); the output layer here scores every position and each row forwards its own prompt."""
        check_right_padded(attention_mask)
        tokens = int(attention_mask.sum())
        self.padding_free.decide(tokens, attention_mask.numel())  # never packs; logs why once
        self.padding_free.record(tokens, attention_mask.numel(), packed=False)
        model = self.reference if reference else self.model
        ids = input_ids.to(self.device)
        batch, length = ids.shape
        positions = torch.arange(length, device=self.device).expand(batch, length)
        dtype = self.precision.reference if reference else self.precision.compute
        output = run_stage(model, ids, positions, self.hf_config.hidden_size, dtype)
        results = None
        if self.pp_rank == self.pp - 1:
            results = vocab_parallel_logprobs(output[:, :-1], ids[:, 1:], temperature, self.geo.vocab)
        return share_from_last_stage(output, results, (batch, length - 1))

    def _main_grads(self) -> None:
        """Each main parameter's float32 gradient from its trained parameter's (zeros where none came)."""
        for param, main in zip(self.params, self.main, strict=True):
            if main is param:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            else:
                main.grad = torch.zeros_like(main) if param.grad is None else param.grad.to(main.dtype)
                param.grad = None

    def _reduce_grads(self) -> None:
        """DP: average every (float32 main) gradient over the data-parallel group. Tied embeddings across stages:
        sum the two copies' gradients (first and last stage), so both copies take the same step."""
        from megatron.core import parallel_state as ps

        grads = [m.grad for m in self.main]
        if self.dp_size > 1:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            flat /= self.dp_size
            for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)
        if self.pp > 1 and self.hf_config.tie_word_embeddings and ps.is_rank_in_embedding_group():
            shared = self.model.shared_embedding_or_output_weight()
            main = self.main[next(i for i, p in enumerate(self.params) if p is shared)]
            dist.all_reduce(main.grad, group=ps.get_embedding_group())

    def _grad_norm(self) -> torch.Tensor:
        """Global L2 norm: each weight counted once (not TP duplicates, not the tied copy), summed over TP x PP."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for param, main in zip(self.params, self.main, strict=True):
            if not getattr(param, "shared", False) and param_is_not_tensor_parallel_duplicate(param):
                squares += main.grad.float().pow(2).sum()
        dist.all_reduce(squares, group=ps.get_model_parallel_group())
        return squares.sqrt()

    def step(self, max_norm: float) -> float:
        """Float32 main gradients, reduced, their global norm clipped, a step on the main parameters (copied back
        into the trained ones when those are bf16), gradients zeroed; returns the pre-clip norm."""
        self._main_grads()
        self._reduce_grads()
        norm = self._grad_norm()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule
        for main in self.main:
            main.grad.mul_(coef.to(main.grad.dtype))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.precision.mixed:
            with torch.no_grad():
                for param, main in zip(self.params, self.main, strict=True):
                    param.copy_(main)
                    param.grad = None
        return float(norm)

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, full shape, dtype) of every weight the rollout engines load, in ``weight_names`` order; the dtype
        is the engine's (``precision.engine``): ``gather_weights`` casts into it."""
        return [(name, shape, self.precision.engine) for name, shape, _ in self._specs]

    @torch.no_grad()
    def gather_weights(self, into: Mapping[str, torch.Tensor] | None) -> None:
        """Collective: unit by unit, the owning stage's TP ranks all-gather their pieces (DP rank 0 only), its
        TP rank 0 rebuilds the full HF tensors (of the float32 main parameters) and sends them to global rank 0,
        which copies them into ``into[name]`` (other ranks pass None), cast to its dtype: the gather writes where
        the sync reads."""
        from megatron.core import parallel_state as ps

        if self.dp_rank != 0:
            return
        local = self._main_by_name
        tp_group = ps.get_tensor_model_parallel_group()
        rank = dist.get_rank()
        for unit in self.units:
            full = None
            if unit.stage == self.pp_rank:
                piece = local[unit.local_name].detach().contiguous()
                pieces = [torch.empty_like(piece) for _ in range(self.tp)]
                dist.all_gather(pieces, piece, group=tp_group)
                full = merge(unit, pieces, self.geo) if self.tp_rank == 0 else None
            owner = self._stage_rank0(unit.stage)
            if rank == 0:
                for name in unit.hf_names:
                    tensor = full[name] if owner == 0 else self._recv_like(name, owner)
                    if into is not None:
                        into[name].copy_(tensor)
            elif full is not None:
                for name in unit.hf_names:
                    dist.send(full[name].contiguous(), dst=0)

    def _stage_rank0(self, stage: int) -> int:
        """Global rank of TP rank 0, DP rank 0 of pipeline ``stage`` (rank 0's pipeline group)."""
        from megatron.core import parallel_state as ps

        return dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[stage] if self.pp > 1 else 0

    def _recv_like(self, name: str, src: int) -> torch.Tensor:
        _, shape, dtype = next(spec for spec in self._specs if spec[0] == name)
        tensor = torch.empty(shape, dtype=dtype, device=self.device)  # NCCL sends between devices
        dist.recv(tensor, src=src)
        return tensor

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """Collective: the full Hugging Face state on rank 0 (None elsewhere)."""
        state = (
            {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in self._specs}
            if dist.get_rank() == 0
            else None
        )
        self.gather_weights(state)
        return state

    def _shard_file(self, directory: Path) -> Path:
        return directory / f"mp_rank_{self.tp_rank:02d}_{self.pp_rank:03d}.pt"

    def save_checkpoint(self, directory: Path, trainer_state: dict) -> None:
        """One file per model-parallel rank (DP rank 0 writes: replicas are equal): model + optimizer state,
        and the layout (TP, PP), then trainer_state.json (rank 0)."""
        directory.mkdir(parents=True, exist_ok=True)
        if self.dp_rank == 0:
            payload = {
                "model": self.model.state_dict(),
                "main": [main.detach() for main in self.main] if self.precision.mixed else None,
                "optim": self.optimizer.state_dict(),
                "layout": {"tensor_parallel": self.tp, "pipeline_parallel": self.pp},
            }
            tmp = self._shard_file(directory).with_suffix(".tmp")
            torch.save(payload, tmp)
            tmp.replace(self._shard_file(directory))
        write_trainer_state(directory, trainer_state)

    def load_checkpoint(self, directory: Path) -> dict:
        path = self._shard_file(directory)
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no shard for TP rank {self.tp_rank}, PP rank {self.pp_rank} "
                f"(a checkpoint resumes with the tensor_parallel and pipeline_parallel it was saved with)"
            )
        payload = torch.load(path, map_location=self.device, weights_only=False)
        layout = {"tensor_parallel": self.tp, "pipeline_parallel": self.pp}
        if payload["layout"] != layout:
            raise ValueError(f"{directory}: saved with {payload['layout']}, this run is {layout}")
        self.model.load_state_dict(payload["model"])
        # the float32 values: the saved main parameters, or (saved at float32 compute) the model's own
        saved = payload.get("main") or [payload["model"][name] for name, _ in self.model.named_parameters()]
        with torch.no_grad():
            for main, value in zip(self.main, saved, strict=True):
                main.copy_(value)
        self.optimizer.load_state_dict(payload["optim"])
        return json.loads((directory / "trainer_state.json").read_text())

    def export_hf(self, directory: Path, tokenizer) -> None:
        """A Hugging Face model directory loadable with from_pretrained (rank 0 writes; collective)."""
        state = self.full_state()
        if state is not None:
            model = AutoModelForCausalLM.from_config(self.hf_config, dtype=Precision.params)
            params = dict(model.named_parameters())
            with torch.no_grad():
                for name in self.weight_names:
                    params[name].copy_(state[name])
            model.save_pretrained(directory)
            tokenizer.save_pretrained(directory)
        dist.barrier()
