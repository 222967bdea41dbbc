"""megatron-core on CPU: the CUDA hard-codes on the paths a CPU run takes, replaced at run time.

Applied only when no CUDA device exists (``apply_cpu_compat``); on a GPU megatron-core runs as
shipped. Each replacement names the upstream file it stands in for (megatron-core 0.16.x); the test
``tests/unit/test_megatron_cpu.py`` fails loudly when an upgrade moves or fixes one of them.

The relayrl Megatron backend runs its own data-parallel gradient reduction and pipeline p2p
(``megatron_pipeline.py``), so Megatron's DDP buffers (``distributed/param_and_grad_buffer.py``)
and its pipeline schedules (``pipeline_parallel/schedules.py``, ``p2p_communication.py``) are not on
its path and need no replacement.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PatchSite:
    """One replaced attribute: ``owner.name`` in ``module`` (the upstream file) and the CUDA code it holds."""

    module: str
    owner: str | None  # a class name, or None for a module-level function
    name: str
    cuda_marker: str  # text of the original's source that makes it CUDA-only
    replacement: Callable


def _cpu_buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context: Callable | None = None):
    """GlobalMemoryBuffer.get_tensor allocates on ``torch.cuda.current_device()``: a fresh CPU tensor instead
    (its users overwrite it: ``baddbmm(beta=0)`` in the local attention)."""
    return torch.empty(tuple(tensor_shape), dtype=dtype)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """transformer/utils.py get_default_causal_mask builds on ``device="cuda"``: True above the diagonal = masked."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_rotary_get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.get_emb moves ``inv_freq`` to CUDA first: the same angles, left where they are.
    [s, 1, 1, dim]: halves (θ, θ) unless interleaved ((θ0, θ0, θ1, θ1, ...))."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    repeat = torch.repeat_interleave(freqs, 2, dim=-1) if self.rotary_interleaved else torch.cat((freqs, freqs), -1)
    return repeat[:, None, None, :]


class CPURNGStatesTracker:
    """tensor_parallel/random.py CudaRNGStatesTracker on the CPU generator: named RNG states, and ``fork``
    runs a block under one of them (dropout inside tensor-parallel regions), restoring the default after."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}

    def is_initialized(self) -> bool:
        return bool(self.states)

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def add(self, name: str, seed: int) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.states[name] = torch.get_rng_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states:
            raise RuntimeError(f"rng state {name} is not added")
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.states[name])
            try:
                yield
            finally:
                self.states[name] = torch.get_rng_state()


def _cpu_setup_embeddings_and_output_layer(self) -> None:
    """LanguageModule.setup_embeddings_and_output_layer moves the last stage's copy of tied embeddings to CUDA
    (``weight.data.cuda()``) before the all-reduce that makes it equal the first stage's: the same on CPU.
    Marks as upstream: ``is_embedding_or_output_parameter``; one stage: ``zero_out_wgrad``; several: the first
    stage's weight ``shared_embedding``, the last stage's copy zeroed, ``shared`` and ``shared_embedding``."""
    if getattr(self.config, "mtp_num_layers", 0):
        raise NotImplementedError("multi-token prediction is not supported by the megatron CPU path")
    if self.pre_process:
        self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
    if self.post_process and self.output_layer.weight is not None:
        self.output_layer.weight.is_embedding_or_output_parameter = True
    if not self.share_embeddings_and_output_weights:
        return
    weight = self.shared_embedding_or_output_weight()
    if self.config.pipeline_model_parallel_size == 1:
        weight.zero_out_wgrad = True
        return
    if self.pre_process and not self.post_process:
        weight.shared_embedding = True
    if self.post_process and not self.pre_process:
        weight.data.fill_(0)
        weight.shared = True
        weight.shared_embedding = True
    if self._is_in_embd_group():
        torch.distributed.all_reduce(weight.data, group=self.embd_group)


def _install_rng_tracker(*_args, **_kwargs) -> None:
    """tensor_parallel/random.py initialize_rng_tracker creates a CUDA tracker: the CPU one instead."""
    import megatron.core.tensor_parallel.random as random

    if not random._CUDA_RNG_STATE_TRACKER_INITIALIZED:
        random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


SITES = (
    PatchSite(
        "megatron.core.utils", "GlobalMemoryBuffer", "get_tensor", "torch.cuda.current_device()", _cpu_buffer_get_tensor
    ),
    PatchSite(
        "megatron.core.transformer.utils", None, "get_default_causal_mask", 'device="cuda"', _cpu_default_causal_mask
    ),
    # fused_softmax.py imported get_default_causal_mask by name: its own binding is replaced too.
    PatchSite(
        "megatron.core.fusions.fused_softmax",
        None,
        "get_default_causal_mask",
        'device="cuda"',
        _cpu_default_causal_mask,
    ),
    PatchSite(
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "RotaryEmbedding",
        "get_emb",
        "torch.cuda.current_device()",
        _cpu_rotary_get_emb,
    ),
    PatchSite(
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule",
        "setup_embeddings_and_output_layer",
        "weight.data.cuda()",
        _cpu_setup_embeddings_and_output_layer,
    ),
    PatchSite(
        "megatron.core.tensor_parallel.random",
        None,
        "initialize_rng_tracker",
        "CudaRNGStatesTracker",
        _install_rng_tracker,
    ),
)


def site_owner(site: PatchSite):
    """The module or class that holds ``site.name`` (ImportError / AttributeError when upstream moved it)."""
    owner = importlib.import_module(site.module)
    return getattr(owner, site.owner) if site.owner else owner


ORIGINALS: dict[PatchSite, Callable] = {}  # what each site held before apply_cpu_compat replaced it


def original(site: PatchSite) -> Callable:
    """The upstream callable at ``site`` (as shipped, even after the replacement)."""
    return ORIGINALS.get(site) or getattr(site_owner(site), site.name)


def apply_cpu_compat() -> bool:
    """Replace every site when no CUDA device exists; idempotent. Returns whether the replacements are on."""
    if torch.cuda.is_available():
        return False
    owners = [site_owner(site) for site in SITES]  # import every module first: one imported later would bind
    for site, owner in zip(SITES, owners, strict=True):  # (from ... import) a replacement, not the original
        if site not in ORIGINALS:
            ORIGINALS[site] = getattr(owner, site.name)
            setattr(owner, site.name, site.replacement)
    _install_rng_tracker()
    return True


def seed_model_parallel_rng(seed: int, tp_rank: int) -> None:
    """model_parallel_cuda_manual_seed on CPU: the tensor-parallel region's dropout stream differs per TP rank
    (seed + 2718 + tp_rank, as upstream), the default stream is ``seed`` everywhere."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)
