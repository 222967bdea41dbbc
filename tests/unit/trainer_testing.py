"""Helpers shared by the trainer tests (test_train_step.py, test_stream_step.py, test_fsdp_backend.py,
test_packing.py, test_prefix.py, test_combinations.py, test_families.py)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relayrl.algorithms.partition import minibatch_groups
from relayrl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from relayrl.runtime.forkserver import run_forked_command
from relayrl.runtime.ports import free_port
from relayrl.runtime.procs import exit_now
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.batch import TrainBatch, to_train_batch
from relayrl.trainer.step import train_on_batch
from relayrl.v1 import common_pb2, controller_pb2

# Ranks, and ``relayrl train`` commands (``ForkedCommand``), are forked from multiprocessing's fork server, which
# imported torch, transformers and the trainer once: a spawned rank (mp.spawn) or a fresh ``python -m relayrl.cli``
# imported them again, seconds of a core each. Each is still its own process, forked from one with no thread but its
# main one, never from the test's (its gloo, gRPC and OpenMP threads). A session has one fork server, started by its
# first user (a test here, relayrl bench weightsync's receivers, the fake vLLM's engine core), not before: a run of
# other tests pays nothing for it. Its preload list is read when it starts, and those users set their own at run
# time: each list is added to the ones named before (``_preload_too``), so whichever starts it, it imports every list.
PRELOAD = [
    "torch", "transformers", "transformers.models.qwen2.modeling_qwen2", "relayrl.trainer.backends.fsdp",
    "relayrl.trainer.step", "relayrl.weightsync", "relayrl.bench.weightsync",
    "relayrl.cli", "relayrl.trainer.sft", "relayrl.trainer.preference", "relayrl.trainer.reward_trainer",
]  # fmt: skip
_set_preload = forkserver.set_forkserver_preload  # what every context's set_forkserver_preload calls


def _preload_too(modules_names: list[str]) -> None:
    _set_preload(list(dict.fromkeys([*forkserver._forkserver._preload_modules, *modules_names])))


forkserver.set_forkserver_preload = _preload_too
mp.get_context("forkserver").set_forkserver_preload(PRELOAD)


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """``mp.spawn(fn, args, nprocs)`` with the ranks forked from the fork server: ``fn(rank, *args)`` in each, and a
    rank that fails raises here as with mp.spawn."""
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def _run_command(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """A ``ForkedCommand`` child: its stdout and stderr into the files ``out`` and ``err``, then ``relayrl ARGV`` as
    ``python -m relayrl.cli`` runs it with environment ``env`` (``run_forked_command``; its exit code the child's)."""
    for path, fd in ((out, 1), (err, 2)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    run_forked_command(argv, env)


class ForkedCommand:
    """``python -m relayrl.cli ARGV`` with environment ``env``, forked from the fork server (torch, transformers and
    the trainer imported already), not a fresh interpreter that imports them: what the tests use of ``subprocess.Popen``
    (``pid``, ``poll``, ``wait``, ``send_signal``), and its output (``stdout_text``, ``stderr_text``)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self._files = tempfile.TemporaryDirectory(prefix="relayrl-command-")
        self._out, self._err = (Path(self._files.name) / name for name in ("stdout", "stderr"))
        self.process = mp.get_context("forkserver").Process(
            target=_run_command, args=(argv, env, str(self._out), str(self._err)), daemon=True
        )  # daemon: one a failed test left running gets SIGTERM when pytest exits, which would wait for it otherwise
        self.process.start()
        self.pid = self.process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"relayrl {self.process.pid}", timeout)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def stdout_text(self) -> str:
        return self._out.read_text(errors="replace") if self._out.exists() else ""

    def stderr_text(self) -> str:
        return self._err.read_text(errors="replace") if self._err.exists() else ""


@pytest.fixture(scope="module", autouse=True)
def one_rank_world() -> Iterator[None]:
    """A one-rank gloo world on a free loopback port for the importing module's tests (FSDP's collectives need
    one): ``from trainer_testing import one_rank_world`` turns it on."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def full_weights(backend) -> dict[str, torch.Tensor]:
    """Every weight, whole, as the float32 parameters hold it, through the backend's own gather (collective: every
    rank calls it)."""
    into = {name: torch.empty(shape, dtype=torch.float32) for name, shape, _ in backend.weight_specs()}
    backend.gather_weights(into)
    return into


def rollout_batch(backend, groups: int = 4, n: int = 4, seed: int = 0) -> TrainBatch:
    """Random prompts and responses whose rollout logprobs are the backend's own at its current weights."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt_len, response_len = groups * n, 5, 7
    input_ids = torch.randint(2, 20, (rows, prompt_len + response_len), generator=g)
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.zeros(rows, prompt_len + response_len - 1)
    response_mask[:, prompt_len - 1 :] = 1.0
    with torch.no_grad():
        rollout = backend.logprobs(input_ids, attention_mask, 1.0)[0] * response_mask
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        token_versions=torch.where(response_mask.bool(), 0, -1),
        rollout_logprobs=rollout,
        teacher_logprobs=torch.zeros_like(rollout),
        rewards=torch.rand(rows, generator=g),
        scores=torch.zeros(rows),
        group_ids=torch.arange(groups).repeat_interleave(n),
        truncated=torch.zeros(rows, dtype=torch.bool),
        versions=torch.zeros(rows, dtype=torch.long),
        exact_rollout=torch.ones(rows, dtype=torch.bool),
    )


def batch_message(
    backend, groups: int, seed: int, *, n: int, target: int, pad: int = 0, version: int = 0
) -> controller_pb2.Batch:
    """A controller Batch of ``groups`` groups of ``n`` samples with varied prompt/response lengths, generated by
    policy ``version`` on worker w0; rollout logprobs are the backend's own at its current weights, mini-batches
    the controller's plan of 2 for ``target`` groups."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for gi in range(groups):
        prompt = torch.randint(2, 20, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            response = torch.randint(2, 20, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
            samples.append(
                controller_pb2.Sample(
                    prompt_id=f"p{gi}",
                    group=gi,
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    rollout_logprobs=[0.0] * len(response),
                    reward=float(torch.rand(1, generator=g) > 0.5) + gi / 10,
                    finish_reason=common_pb2.FINISH_REASON_STOP,
                    policy_version=version,
                    worker_id="w0",
                )
            )
    padded = to_train_batch(samples, pad)
    with torch.no_grad():
        logprobs = backend.logprobs(padded.input_ids, padded.attention_mask, 1.0)[0]
    for i, sample in enumerate(samples):
        start = len(sample.prompt_token_ids) - 1
        sample.rollout_logprobs[:] = logprobs[i, start : start + len(sample.response_token_ids)].tolist()
    header = controller_pb2.BatchStats(groups_kept=groups)
    sizes = minibatch_groups(groups, 2, target=target)
    return controller_pb2.Batch(batch_id="b", step=version + 1, samples=samples, stats=header, minibatch_groups=sizes)


def stream_source(batch: controller_pb2.Batch, chunks: list[int], broken: int):
    """What read_stream yields on rank 0: the groups in ``chunks``, then the header; with ``broken``: a
    first stream that breaks after that many groups, then the whole stream again."""
    calls = iter([[broken, "break"], [*chunks, "end"]] if broken else [[*chunks, "end"]])

    def parts():
        first = 0
        for item in next(calls):
            if item == "break":
                yield "broken", "UNAVAILABLE: Socket closed"
                return
            if item == "end":
                header = controller_pb2.Batch()
                header.CopyFrom(batch)
                del header.samples[:]
                yield "end", controller_pb2.BatchPart(batch=header, streamed=True).SerializeToString()
                return
            group = [s for s in batch.samples if first <= s.group < first + item]
            first += item
            yield "part", controller_pb2.BatchPart(samples=group, streamed=True, temperature=1.0).SerializeToString()

    return parts


def grpo_batch(groups: int = 4, n: int = 4, seed: int = 0):
    """Groups of ``n`` rows, one ~12-token prompt each, responses of geometric length (mean ~6, cap 20); the
    first group's responses all begin with the same two tokens, the last group holds one row."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group in range(groups):
        prompt = torch.randint(3, 20, (10 + group,), generator=g).tolist()
        for _ in range(1 if group == groups - 1 else n):
            length = 1
            while length < 20 and float(torch.rand(1, generator=g)) > 1 / 6:
                length += 1
            response = torch.randint(3, 20, (length + 2,), generator=g).tolist()
            if group == 0:
                response[:2] = [5, 7]
            samples.append(
                controller_pb2.Sample(
                    prompt_id=f"p{group}", group=group, prompt_token_ids=prompt, response_token_ids=response,
                    rollout_logprobs=[-1.0] * len(response), reward=float(torch.rand(1, generator=g)),
                    finish_reason=common_pb2.FINISH_REASON_STOP,
                )
            )  # fmt: skip
    return to_train_batch(samples, pad_token_id=0)


class GradsBackend(FSDPBackend):
    """The FSDP backend, keeping each optimizer step's gradients."""

    def step(self, max_norm: float) -> float:
        self.grads = [*getattr(self, "grads", []), [p.grad.clone() for p in self.model.parameters()]]
        return super().step(max_norm)


def trained_once(
    model_dir: str, tcfg: TrainerConfig, batch: TrainBatch, alg: AlgorithmConfig, norm_len: int
) -> tuple[GradsBackend, dict, dict]:
    """One step on ``batch`` from the model's saved weights (seed 0): the backend, its metrics, the weights before."""
    torch.manual_seed(0)
    backend = GradsBackend(ModelConfig(path=model_dir), tcfg, with_reference=False)
    before = full_weights(backend)
    metrics = train_on_batch(backend, batch, alg, tcfg, temperature=1.0, norm_len=norm_len)
    return backend, metrics, before


def update_gaps(base: tuple[GradsBackend, dict, dict], other: tuple[GradsBackend, dict, dict]) -> dict:
    """Two ``trained_once`` results from the same weights: the largest gradient and weight gaps, how far ``base``'s
    weights moved, and the loss gap."""
    (a, a_metrics, before), (b, b_metrics, _) = base, other
    w_a, w_b = full_weights(a), full_weights(b)
    return {
        "grads": max(float((x - y).abs().max()) for ga, gb in zip(a.grads, b.grads) for x, y in zip(ga, gb)),
        "weights": max(float((w_a[k] - w_b[k]).abs().max()) for k in w_a),
        "moved": max(float((w_a[k] - before[k]).abs().max()) for k in w_a),
        "loss": abs(a_metrics["loss"] - b_metrics["loss"]),
    }


def on_ranks_case(rank: int, world: int, port: int, fn: Callable[..., dict], args: tuple, out: str) -> None:
    """A ``spawn_ranks`` target: ``fn(*args)`` on a gloo world of ``world`` ranks (one torch thread each); rank 0
    writes its result to ``out`` as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(*args)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_now(0)
