"""``relayrl check-engine``: does an inference engine do what relayrl's training needs, on this machine?

One command for a machine with the engine installed (``--engine vllm|sglang|hf --model PATH``). In order:

1. samples: ``n`` samples per prompt at several temperatures, without a seed; at every temperature some
   prompt must get samples that differ (an engine that gives every seedless request one seed fails here);
2. log-probs: every sampled token's log-prob against a Hugging Face forward of the same model (the
   trainer's ``logprobs_from_logits``, at the sampling temperature); max |diff| must be within the tolerance;
3. weight update: perturbed weights through relayrl's own sync path (``WeightPublisher`` -> UpdateWeights over
   gRPC -> the rollout worker -> the engine, buckets over a real gloo (CPU) or NCCL (CUDA) group); the
   worker's checksum must equal the trainer's, greedy outputs must change, and the log-probs after the
   update must match a forward of the perturbed model;
4. with ``--lora``, the adapter path: a random rank-8 PEFT adapter on the (updated) model, synced as a LoRA run
   syncs it (``WeightPublisher``: the base weights, then the adapter's tensors alone) and loaded by the engine
   (``load_adapter``); the worker must report the adapter's version, greedy outputs must change, and the
   log-probs must match a forward of the PEFT model;
5. tokens/s of the sampling in 1.

Prints a table (or ``--json``). Exit status: 0 every check passed, 1 a check failed, 2 the engine cannot
start here (not installed, unsupported version: the message says what to install) or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import yaml

from relayrl.ops.args import OneLineParser, existing_dir
from relayrl.rollout.engine import EngineCompletion, InferenceEngine, create_engine
from relayrl.wire.sampling import SamplingParams

PROMPT_TEXTS = ("1 + 2 =", "The capital of France is", "def add(a, b):", "max of 3 4 is")
TEMPERATURES = (0.7, 1.0, 1.3)
# Default |engine - HF forward| tolerance per dtype: float32 kernels agree to rounding; half precision does not.
TOLERANCES = {"float32": 1e-3, "bfloat16": 0.15, "float16": 0.05}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    engine: str
    model: str
    device: str
    dtype: str
    tolerance: float
    checks: list[Check] = field(default_factory=list)
    max_logprob_diff: float = 0.0
    tokens_per_second: float = 0.0

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(ok), detail))

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok}, indent=2)

    def table(self) -> str:
        width = max(len(check.name) for check in self.checks)
        lines = [f"relayrl check-engine: {self.engine} on {self.device} ({self.dtype}), model {self.model}", ""]
        lines += [f"{c.name:<{width}}  {'pass' if c.ok else 'FAIL'}  {c.detail}" for c in self.checks]
        lines += [
            "",
            f"{'tokens/s':<{width}}        {self.tokens_per_second:.1f}",
            f"result: {'ok' if self.ok else 'FAILED'}",
        ]
        return "\n".join(lines)


def prompts_for(tokenizer: Any, max_model_len: int, max_tokens: int) -> list[list[int]]:
    """PROMPT_TEXTS as token ids (no special tokens), each cut to leave room for ``max_tokens``."""
    room = max(1, max_model_len - max_tokens)
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"][:room] for text in PROMPT_TEXTS]
    return [p for p in prompts if p] or [[0]]


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, prompt: Sequence[int], response: Sequence[int], temperature: float):
    """The trainer's log-probs of ``response``: one forward of prompt + response, log softmax(logits / T)."""
    from relayrl.algorithms.logprobs import logprobs_from_logits

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(response)], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logprobs_from_logits(logits, torch.tensor(list(response), device=device), temperature or 1.0).cpu()


def max_logprob_diff(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[EngineCompletion], temperature: float
) -> float:
    """max |engine log-prob - HF forward log-prob| over every token of ``completions``."""
    worst = 0.0
    for c in completions:
        if c.token_ids:
            expected = reference_logprobs(model, prompts[c.prompt_index], c.token_ids, temperature)
            worst = max(worst, (torch.tensor(c.logprobs) - expected).abs().max().item())
    return worst


def perturbed(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """The model's weights plus noise of half their spread (at least 0.01), in place: the "trained" policy."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            scale = max(p.float().std().item() if p.numel() > 1 else 0.0, 0.02) * 0.5
            noise = torch.randn(p.shape, generator=generator) * scale
            p.add_(noise.to(device=p.device, dtype=p.dtype))
    return {name: p.detach() for name, p in model.named_parameters()}


def check_sampling(engine: InferenceEngine, model, prompts, report: Report, n: int, max_tokens: int) -> None:
    tokens, seconds, worst = 0, 0.0, 0.0
    for temperature in TEMPERATURES:
        params = SamplingParams(n=n, temperature=temperature, top_p=1.0, max_tokens=max_tokens)
        start = time.perf_counter()
        completions = list(engine.generate(prompts, params))
        seconds += time.perf_counter() - start
        tokens += sum(len(c.token_ids) for c in completions)
        samples: dict[int, set[tuple[int, ...]]] = {}
        for c in completions:
            samples.setdefault(c.prompt_index, set()).add(tuple(c.token_ids))
        varied = sum(len(s) > 1 for s in samples.values())
        report.add(f"samples differ (T={temperature})", varied > 0, f"{varied}/{len(prompts)} prompts, n={n}")
        worst = max(worst, max_logprob_diff(model, prompts, completions, temperature))
    report.max_logprob_diff = worst
    report.tokens_per_second = tokens / max(seconds, 1e-9)
    report.add(
        "log-probs vs HF forward", worst <= report.tolerance, f"max |diff| {worst:.2e} (tolerance {report.tolerance})"
    )


def check_weight_update(engine: InferenceEngine, model, prompts, report: Report, max_tokens: int) -> None:
    """One update through WeightPublisher -> gRPC -> RolloutWorker -> engine; checksum, changed outputs, parity."""
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    before = sorted(engine.generate(prompts, greedy), key=lambda c: c.prompt_index)
    weights = perturbed(model)
    with _served_worker(engine, report.device) as (worker, publisher):
        arena = publisher.arena_for([(name, tuple(t.shape), t.dtype) for name, t in weights.items()])
        arena.load(weights.items())
        result = publisher.publish(1, arena)
        loaded = worker.stats(with_checksum=True)
    ok = result.synced == [worker.worker_id] and loaded.weights_checksum == result.checksum
    detail = (
        f"version {loaded.policy_version}, checksum {loaded.weights_checksum[:12]} vs trainer {result.checksum[:12]}"
    )
    report.add("weight update (gRPC + broadcast)", ok, detail + (f"; failed: {result.failed}" if result.failed else ""))
    after = sorted(engine.generate(prompts, greedy), key=lambda c: c.prompt_index)
    changed = sum(_differ(a, b, report.tolerance) for a, b in zip(after, before, strict=True))
    report.add("outputs changed by the update", changed > 0, f"{changed}/{len(prompts)} greedy outputs differ")
    worst = max_logprob_diff(model, prompts, after, 0.0)
    report.max_logprob_diff = max(report.max_logprob_diff, worst)
    report.add("log-probs after the update", worst <= report.tolerance, f"max |diff| {worst:.2e}")


def _differ(a: EngineCompletion, b: EngineCompletion, tolerance: float) -> bool:
    """Other tokens, or the same tokens with log-probs further apart than ``tolerance``."""
    if a.token_ids != b.token_ids:
        return True
    return bool(a.logprobs) and (torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item() > tolerance


def check_adapter_update(engine: InferenceEngine, model, prompts, report: Report, max_tokens: int) -> None:
    """Base + adapter through WeightPublisher -> gRPC -> RolloutWorker -> engine.load_adapter; the worker's version,
    changed outputs, parity with the PEFT model's forward."""
    from relayrl.config import LoraConfig
    from relayrl.trainer.backends.lora import adapter_name, apply_lora, base_name, is_adapter, lora_spec

    cfg = LoraConfig()
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    before = sorted(engine.generate(prompts, greedy), key=lambda c: c.prompt_index)
    adapted = apply_lora(model, cfg)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # PEFT starts B at zero (the base model): a random adapter instead
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=generator).to(p) * 0.5)
    named = list(adapted.named_parameters())
    base = {base_name(n): p.detach() for n, p in named if not is_adapter(n)}
    adapter = {adapter_name(n): p.detach() for n, p in named if is_adapter(n)}
    with _served_worker(engine, report.device, lora=lora_spec(cfg)) as (worker, publisher):
        publisher.arena_for([(n, tuple(t.shape), t.dtype) for n, t in base.items()], "base").load(base.items())
        arena = publisher.arena_for([(n, tuple(t.shape), t.dtype) for n, t in adapter.items()], "adapter")
        arena.load(adapter.items())
        result = publisher.publish(2, arena, kind="adapter")
    ok = result.synced == [worker.worker_id] and worker.reported_version == 2
    sizes = f"{arena.manifest.total_bytes} adapter bytes, {result.nbytes} with the base"
    report.add("adapter sync (gRPC + broadcast)", ok, sizes + (f"; failed: {result.failed}" if result.failed else ""))
    after = sorted(engine.generate(prompts, greedy), key=lambda c: c.prompt_index)
    changed = sum(_differ(a, b, report.tolerance) for a, b in zip(after, before, strict=True))
    report.add("outputs changed by the adapter", changed > 0, f"{changed}/{len(prompts)} greedy outputs differ")
    worst = max_logprob_diff(adapted, prompts, after, 0.0)
    report.max_logprob_diff = max(report.max_logprob_diff, worst)
    report.add("log-probs with the adapter", worst <= report.tolerance, f"max |diff| {worst:.2e} vs the PEFT model")


class _Plan:
    """The controller's GetWeightSyncPlan for one worker (the publisher's only question to the controller)."""

    def __init__(self, worker_id: str, address: str) -> None:
        self.worker = (worker_id, address)

    def GetWeightSyncPlan(self, request, timeout: float | None = None):
        from relayrl.v1 import controller_pb2

        worker_id, address = self.worker
        return controller_pb2.WeightSyncPlan(
            workers=[controller_pb2.WorkerEndpoint(worker_id=worker_id, address=address)]
        )


class _served_worker:
    """The engine behind a RolloutWorker served over gRPC on localhost, and a WeightPublisher aimed at it."""

    def __init__(self, engine: InferenceEngine, device: str, lora=None) -> None:
        from relayrl.config import RelayConfig
        from relayrl.rollout.worker import RolloutWorker
        from relayrl.rpc.server import GrpcServer
        from relayrl.services.rollout_server import RolloutServicer
        from relayrl.trainer.sync import WeightPublisher
        from relayrl.v1 import rollout_pb2, rollout_pb2_grpc
        from relayrl.wire.sampling import GenerationLimits

        backend = "nccl" if device.startswith("cuda") else "gloo"
        cfg = RelayConfig.model_validate(
            {
                "model": {"path": "check-engine"},
                "data": {"path": "check-engine"},
                # the full fingerprint: the worker's Stats checksum (of its live weights) is compared with it
                "weight_sync": {"backend": backend, "bucket_mib": 64, "timeout_s": 120, "verify": "fingerprint"},
            }
        )
        self.server = GrpcServer("127.0.0.1:0", security=cfg.security)
        self.worker = RolloutWorker(engine, "check-engine", mode="pause", limits=GenerationLimits())
        self.server.add(
            rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
            RolloutServicer(self.worker, cfg),
            rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
        )
        plan = _Plan(self.worker.worker_id, f"127.0.0.1:{self.server.port}")
        self.publisher = WeightPublisher(cfg.weight_sync, plan, weights_dir="", lora=lora)

    def __enter__(self):
        self.server.start()
        return self.worker, self.publisher

    def __exit__(self, *exc: object) -> None:
        self.publisher.close()
        if self.worker.group is not None:
            self.worker.group.close()
        self.server.stop(grace_s=1)


def start_engine(engine_name: str, model_path: str, *, device: str, dtype: str, options: dict[str, Any]):
    """The engine under test (``device`` goes to the hf engine; vLLM and SGLang place themselves)."""
    options = dict(options)
    if engine_name == "hf":
        options.setdefault("device", device)
    return create_engine(engine_name, model_path=model_path, dtype=dtype, seed=0, **options)


def run_check(
    engine: InferenceEngine,
    model_path: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    tolerance: float | None = None,
    n: int = 4,
    max_tokens: int = 16,
    lora: bool = False,
) -> Report:
    """Every check above on ``engine`` (serving ``model_path``; the adapter path with ``lora``); closes the
    engine."""
    from transformers import AutoModelForCausalLM

    from relayrl.rollout.hf import DTYPES

    report = Report(engine.name, model_path, device, dtype, TOLERANCES[dtype] if tolerance is None else tolerance)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype]).to(device).eval()
        prompts = prompts_for(engine.tokenizer, engine.max_model_len, max_tokens)
        check_sampling(engine, model, prompts, report, n, max_tokens)
        check_weight_update(engine, model, prompts, report, max_tokens)
        if lora:
            check_adapter_update(engine, model, prompts, report, max_tokens)
    finally:
        engine.close()
    return report


# What vLLM and SGLang need set to serve relayrl's adapters: LoRA on, the rank, and two adapters at once (the
# version serving and the previous one, which requests in flight finish on). vllm/config/lora.py: LoRAConfig;
# sglang/srt/arg_groups/fields/: enable_lora, max_lora_rank, max_loras_per_batch.
LORA_OPTIONS = {
    "vllm": {"enable_lora": True, "max_lora_rank": "rank", "max_loras": 2},
    "sglang": {"enable_lora": True, "max_lora_rank": "rank", "max_loras_per_batch": 2},
}


def lora_engine_options(engine: str, options: dict[str, Any], rank: int | None = None) -> dict[str, Any]:
    """``options`` with what ``engine`` needs to load relayrl's adapters of ``rank`` (``model.lora.rank``'s
    default when None) filled in; ValueError naming an option set against it (LoRA off, a rank below ``rank``,
    room for fewer than two adapters). The hf engine needs none."""
    if rank is None:
        from relayrl.config import LoraConfig

        rank = LoraConfig().rank
    out = dict(options)
    for key, needed in LORA_OPTIONS.get(engine, {}).items():
        needed = rank if needed == "rank" else needed
        if key not in out:
            out[key] = needed
        elif needed is True and out[key] is not True:
            raise ValueError(f"--option {key}: the {engine} engine serves adapters only with {key}=true")
        elif needed is not True and not (isinstance(out[key], int) and out[key] >= needed):
            raise ValueError(f"--option {key}: must be at least {needed} for relayrl's adapters, got {out[key]!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="relayrl check-engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, choices=["hf", "vllm", "sglang"])
    parser.add_argument("--model", type=existing_dir, required=True, help="Hugging Face model directory")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the HF reference and the hf engine)")
    parser.add_argument("--dtype", default="float32", choices=sorted(TOLERANCES))
    parser.add_argument("--tolerance", type=float, default=None, help="max |log-prob diff| (default by dtype)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (>= 2)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="engine option (YAML value)")
    parser.add_argument("--lora", action="store_true", help="also check the LoRA adapter path (sync and load)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def parse_options(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs, values read as YAML (``tensor_parallel_size=2``, ``enforce_eager=true``)."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option: expected KEY=VALUE, got {item!r}")
        options[key] = yaml.safe_load(value)
    return options


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.n < 2:
        parser.error("--n: at least 2 samples per prompt are needed to see them differ")
    if args.tolerance is not None and not args.tolerance >= 0:
        parser.error("--tolerance: must be >= 0")
    try:
        options = parse_options(args.option)
        if args.lora:
            options = lora_engine_options(args.engine, options)
        engine = start_engine(args.engine, args.model, device=args.device, dtype=args.dtype, options=options)
    except (ImportError, ValueError, OSError) as err:  # not installed, unsupported version, bad option or path
        print(f"relayrl check-engine: cannot start the {args.engine} engine: {err}", file=sys.stderr)
        return 2
    report = run_check(
        engine,
        args.model,
        device=args.device,
        dtype=args.dtype,
        tolerance=args.tolerance,
        n=args.n,
        max_tokens=args.max_tokens,
        lora=args.lora,
    )
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else 1
