"""A step trained while its batch is still being generated (``trainer.stream``; the controller's StreamBatch).

The result is ``train_on_batch`` on the whole batch up to float rounding: the same ordered groups, the same
mini-batch partition (the batch's ``minibatch_groups``: the plan for ``train_batch_groups``, see
relayrl/algorithms/partition.py), per-group advantages, the same clip and grad clip. Mini-batch k's rows are
forwarded and backwarded as their groups arrive, in chunks of whole groups (a quarter of the mini-batch or
more, CHUNKS_PER_MINIBATCH, and every group that arrived while the previous chunk trained: ``read_ahead``; at
least one row per data-parallel rank, since ``rollout.n`` >= the ranks: every rank makes the same collective
calls), with un-normalised loss sums (``agg_loss`` with UNIT_COUNTS). Once its
last group is in, the accumulated gradient is divided by the mini-batch's ``agg_denominator`` (its global
token/sequence counts, known then) and the optimizer steps, while the rest of the batch is still generating.

Old logprobs: after mini-batch 1's optimizer step the step's starting weights are gone, so every streamed
group must carry the engine's logprobs of exactly those weights (version s - 1 from a worker whose load was
verified). The controller sends a streamed step's prompts to those workers only; a group that is not exact
raises here (never a silently inexact update).

A stream that breaks (controller restart) voids its parts: ``discard`` puts back the weights and optimizer
state the step started from (a snapshot taken before its first optimizer step: one copy of this rank's shard
of both, held until the step ends) and drops the accumulated gradient; the caller pulls the step again, so no
part of a step is ever trained twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import grpc
import torch

from relayrl.algorithms import compute_advantages
from relayrl.algorithms.aggregation import UNIT_COUNTS, agg_denominator
from relayrl.algorithms.partition import minibatch_groups, split_sizes
from relayrl.config import AlgorithmConfig, RelayConfig, TrainerConfig, stream_blockers
from relayrl.errors import PAUSED_DETAIL, rpc_error_text
from relayrl.rpc.retry import RETRYABLE
from relayrl.trainer.batch import to_train_batch
from relayrl.trainer.correction import kept_row_tokens
from relayrl.trainer.step import (
    StepMetrics,
    backward_rows,
    gradient_rows,
    log_zero_advantage,
    loss_mask,
    minibatch_counts,
    shard_rows,
    zero_advantage_blocker,
)
from relayrl.v1 import controller_pb2

log = logging.getLogger(__name__)
# A mini-batch is trained in chunks of at least 1/CHUNKS_PER_MINIBATCH of its groups: one forward per arriving
# group costs more than the whole mini-batch's forward (small matmuls), a quarter of it about the same.
CHUNKS_PER_MINIBATCH = 4
# how a stream cut by its controller's death ends (the connection drops mid-response)
BROKEN = RETRYABLE | {grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def streams_said(cfg: RelayConfig) -> bool:
    """Whether the trainer's steps stream (``RelayConfig.streams``); ``trainer.stream: auto`` that does not says
    why in the log (the blockers of ``stream_blockers``)."""
    if cfg.trainer.stream == "auto" and (blockers := stream_blockers(cfg)):
        log.info("trainer.stream: auto trains whole batches: streaming needs %s", "; ".join(blockers))
    return cfg.streams


class StreamedStep:
    """Feed the step's samples in batch order with ``add``, then ``finish`` with the batch header."""

    def __init__(
        self,
        backend,
        alg: AlgorithmConfig,
        tcfg: TrainerConfig,
        *,
        target_groups: int,
        version: int,
        verified: frozenset[str],
        pad_id: int,
        norm_len: int,
    ) -> None:
        self.backend, self.alg, self.tcfg = backend, alg, tcfg
        self.target_groups = target_groups
        self.version, self.verified, self.pad_id, self.norm_len = version, verified, pad_id, norm_len
        self.samples: list[controller_pb2.Sample] = []
        self.group_start: list[int] = []  # row of each group's first sample
        self.metrics = StepMetrics()
        self.temperature = 1.0
        self.k = 0  # the mini-batch being accumulated
        self.first_group = 0  # its first group
        self.done = 0  # its groups trained so far
        self.row_tokens: list[torch.Tensor] = []  # its rows' loss tokens, chunk by chunk
        self._advantages: list[torch.Tensor] = []  # each trained chunk's, per sample
        self._start = None  # the weights and optimizer state before the step's first optimizer step

    @property
    def groups(self) -> int:
        return len(self.group_start)

    @property
    def sample_advantages(self) -> torch.Tensor:
        """[samples trained] float32: each sample's advantage as its chunk trained it, in batch order."""
        return torch.cat(self._advantages) if self._advantages else torch.zeros(0)

    def add(self, samples: Sequence[controller_pb2.Sample], temperature: float) -> None:
        """Samples of whole groups, next in batch order; trains what is complete enough."""
        self.temperature = temperature or 1.0
        for sample in samples:
            if sample.group == self.groups:
                self.group_start.append(len(self.samples))
            elif sample.group != self.groups - 1:
                raise RuntimeError(f"stream: sample of group {sample.group} after group {self.groups - 1}")
            self.samples.append(sample)
        self._train(split_sizes(self.target_groups, self.tcfg.mini_batches), final=False)

    def finish(self, header: controller_pb2.Batch) -> dict[str, float]:
        """The last part: trains the rest (a partial batch's last, smaller mini-batch) and returns the metrics."""
        kept = header.stats.groups_kept
        if kept != self.groups:
            raise RuntimeError(f"stream: the batch holds {kept} groups, {self.groups} arrived")
        sizes = minibatch_groups(kept, self.tcfg.mini_batches, target=self.target_groups)
        if list(header.minibatch_groups) != sizes:
            raise RuntimeError(f"stream: mini-batches {list(header.minibatch_groups)} are not the plan {sizes}")
        self._train(sizes, final=True)
        self.metrics.engine_old = [True] * len(sizes)
        return self.metrics.finish(self.backend, self.alg)

    def discard(self) -> None:
        """Void what was received (the stream broke): the step's starting weights and optimizer state back."""
        self.backend.restore(self._start)
        self._start = None

    def _train(self, sizes: list[int], *, final: bool) -> None:
        """Backward the arrived groups of the current mini-batch (once they are a chunk: CHUNKS_PER_MINIBATCH of
        it, or its last ones); step each mini-batch that is complete."""
        while self.k < len(sizes) and self.first_group < self.groups:
            last = self.first_group + sizes[self.k]  # one past its last group
            complete = self.groups >= last
            upto = min(last, self.groups)  # one past its last group that arrived
            first = self.first_group + self.done  # its first group not yet trained
            if upto > first and (complete or upto - first >= max(1, sizes[self.k] // CHUNKS_PER_MINIBATCH)):
                end = self.group_start[upto] if upto < self.groups else len(self.samples)
                self._backward(self.group_start[first], end)
                self.done = upto - self.first_group
            if not complete:
                return
            counts = minibatch_counts(torch.cat(self.row_tokens), self.alg, self.norm_len)
            divisor = agg_denominator(self.alg.loss_agg, **counts)
            self.backend.scale_grads(1.0 / divisor)
            if self._start is None and self.k == 0:
                self._start = self.backend.snapshot()
            self.metrics.close_minibatch(self.backend.step(self.tcfg.grad_clip), divisor)
            self.k, self.first_group, self.done, self.row_tokens = self.k + 1, last, 0, []
        if final and self.k != len(sizes):
            raise RuntimeError(f"stream: {self.k} of {len(sizes)} mini-batches trained at the end of the batch")

    def _backward(self, start: int, end: int) -> None:
        backend, alg = self.backend, self.alg
        samples = self.samples[start:end]
        chunk = to_train_batch(samples, self.pad_id, version=self.version, verified_workers=self.verified)
        if not bool(chunk.exact_rollout.all()):
            bad = samples[int((~chunk.exact_rollout).nonzero()[0])]
            raise RuntimeError(
                f"stream: sample of prompt {bad.prompt_id} (worker {bad.worker_id}, version {bad.policy_version}) was "
                f"not generated by the verified weights of version {self.version}; a streamed step needs them"
            )
        if len(chunk) < backend.dp_size:
            raise RuntimeError(f"stream: a chunk of {len(chunk)} rows for {backend.dp_size} data-parallel ranks")
        advantages = compute_advantages(alg.advantage, chunk.rewards, chunk.group_ids, norm_by_std=alg.norm_by_std)
        self._advantages.append(advantages.float())
        mask = loss_mask(chunk, alg.overlong_filter)
        rows = torch.arange(len(chunk))
        blocker = zero_advantage_blocker(alg, self.tcfg, critic=False)  # a streamed step has no critic
        log_zero_advantage(blocker)
        trained = rows if blocker else gradient_rows(rows, advantages, backend.dp_size)
        self.metrics.add_rows(len(rows), len(trained))
        shard = shard_rows(trained, backend.dp_rank, backend.dp_size)
        ref = None
        if alg.kl_coef > 0:
            with torch.no_grad():
                ref = backend.logprobs(
                    chunk.input_ids[shard],
                    chunk.attention_mask[shard],
                    self.temperature,
                    reference=True,
                    scored=mask[shard],
                    groups=chunk.group_ids[shard],
                )[0]
        old = chunk.rollout_logprobs[shard].to(backend.device)
        logprob, pieces, pg = backward_rows(
            backend, chunk, shard, advantages=advantages, mask=mask, old=old, ref=ref, alg=alg, counts=UNIT_COUNTS,
            temperature=self.temperature, engine_old=True,
        )  # fmt: skip
        self.metrics.add(pieces, pg)
        self.metrics.correction.add_applied(pieces)
        if self.k == 0:  # trainer logprobs at the step's starting weights
            self.metrics.add_mismatch(logprob, chunk.rollout_logprobs[shard], pieces["response_mask"])
        rejects = alg.correction.rejects  # the divisor counts the kept tokens alone
        self.row_tokens.append(kept_row_tokens(pieces["mask"], shard, len(chunk), backend) if rejects else mask.sum(-1))


def read_ahead(items: Iterator[tuple[str, bytes]], on_last: Callable[[], None]) -> Iterator[tuple[str, bytes]]:
    """``items`` (read_stream's) read by a thread of their own, so a part that arrives while a chunk trains is
    read at once; ``on_last`` runs the moment the last one ("end", "broken", "stop": generation is over) or an
    error is read, not once the caller has trained what came before it. Errors reach the caller in order.

    The parts read while the caller was busy come as one: their BatchPart bytes concatenated, which protobuf
    parses as one message with their samples in order (repeated fields append). So a trainer that fell behind
    generation trains what has arrived in one chunk per mini-batch, as a whole batch would, not part by part."""
    box: queue.SimpleQueue = queue.SimpleQueue()

    def pump() -> None:
        try:
            for item in items:
                if item[0] != "part":
                    on_last()
                box.put(item)
        except BaseException as err:  # handed to the caller, raised there
            on_last()
            box.put(err)

    threading.Thread(target=pump, name="batch-stream", daemon=True).start()
    held = None
    while True:
        item, held = held or box.get(), None
        if isinstance(item, BaseException):
            raise item
        if item[0] == "part":
            parts = [item[1]]
            while held is None and not box.empty():
                more = box.get()
                if isinstance(more, tuple) and more[0] == "part":
                    parts.append(more[1])
                else:
                    held = more
            item = ("part", b"".join(parts))
        yield item
        if item[0] != "part":
            return


def read_stream(stub, step: int, deadline_s: float, call_timeout_s: float, stop) -> Iterator[tuple[str, bytes]]:
    """Rank 0: StreamBatch(step) as ("part", BatchPart bytes) items and a last ("end", BatchPart bytes); or
    ("broken", why) when the stream breaks after its first part (pull again), or ("stop", b"") when a shutdown
    was requested before one arrived. Waits (retrying) up to ``deadline_s`` for the first part; a paused run
    is not a stall."""
    request = controller_pb2.PullBatchRequest(step=step, timeout_s=2)
    deadline = time.monotonic() + deadline_s
    while not stop.requested:
        received = 0
        try:
            for part in stub.StreamBatch(request, timeout=call_timeout_s):
                received += 1
                yield ("end" if part.HasField("batch") else "part"), part.SerializeToString()
                if part.HasField("batch"):
                    return
            raise RuntimeError(f"StreamBatch(step={step}) ended without its last part")
        except grpc.RpcError as err:
            if received and err.code() in BROKEN:
                yield "broken", rpc_error_text(err)
                return
            if err.code() not in RETRYABLE:
                raise RuntimeError(f"StreamBatch(step={step}) failed: {rpc_error_text(err)}") from None
            if (err.details() or "").startswith(PAUSED_DETAIL):
                deadline = time.monotonic() + deadline_s
            if time.monotonic() > deadline:
                raise TimeoutError(f"no batch for step {step} within {deadline_s:.0f}s") from None
            time.sleep(0.2)
    yield "stop", b""
