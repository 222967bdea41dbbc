"""The trainer process (``torchrun ... relayrl trainer run``): pull, train, publish, report, repeat.

Step s trains on the controller's batch s (trajectories of policy version >= s - 1 - K), then the
new weights become policy version s: rank 0 gathers them and broadcasts them to every rollout
worker, and reports the step. Only rank 0 talks to the controller and the workers.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from relayrl.algorithms.version_mix import version_mix
from relayrl.config import RelayConfig, TrainerConfig, correction_metrics_of, dump_config
from relayrl.cores.threads import GenerationFirst, torch_threads
from relayrl.episodes.stats import step_episode_metrics
from relayrl.errors import NOT_READY_DETAIL, PAUSED_DETAIL, rpc_error_text
from relayrl.rpc.channels import open_channel
from relayrl.rpc.retry import RETRYABLE, STOPPING, call_with_retry
from relayrl.runtime.files import atomic_write, free_space_text
from relayrl.runtime.gcfreeze import freeze_startup_heap
from relayrl.trainer.backends import create_backend
from relayrl.trainer.batch import to_train_batch
from relayrl.trainer.best import BestKeeper
from relayrl.trainer.evals import EvalMirror
from relayrl.trainer.metrics import MetricsWriter, plot_rewards, plot_training
from relayrl.trainer.on_demand import OnDemandSync
from relayrl.trainer.optim import create_state, fault_in_gradients
from relayrl.trainer.retention import complete_checkpoints, prune_checkpoints
from relayrl.trainer.samples import SamplesWriter, step_samples
from relayrl.trainer.schedule import lr_at, set_step_lrs
from relayrl.trainer.step import train_on_batch
from relayrl.trainer.stream import StreamedStep, read_ahead, read_stream, streams_said
from relayrl.trainer.sync import SyncResult, WeightPublisher
from relayrl.trainer.trackers import StepTrackers
from relayrl.trainer.world import init_world, world_backend
from relayrl.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (its trainer_state.json is written last)."""
    candidates = complete_checkpoints(run_dir / "checkpoints")
    return candidates[-1] if candidates else None


class RunDirNotShared(RuntimeError):
    """A trainer rank cannot read the checkpoint rank 0 resumes from."""


def agreed_checkpoint(run_dir: Path) -> Path | None:
    """Collective: the checkpoint every rank resumes from, rank 0's newest complete one (``latest_checkpoint``).

    Each rank choosing from its own view of the run dir would resume at different steps wherever the views
    differ (a pod's own disk; only rank 0 writes trainer_state.json). Every rank then checks it can read rank 0's
    choice; if any cannot, every rank raises RunDirNotShared naming them (none enters the load's collectives)."""
    rank = dist.get_rank()
    (chosen,) = broadcast_from_rank0(str(latest_checkpoint(run_dir) or "") if rank == 0 else None)
    if not chosen:
        return None
    checkpoint = Path(chosen)
    readable = [True]
    if dist.get_world_size() > 1:
        readable = [None] * dist.get_world_size()
        dist.all_gather_object(readable, (checkpoint / "trainer_state.json").is_file())
    blind = [r for r, ok in enumerate(readable) if not ok]
    if blind:
        raise RunDirNotShared(
            f"trainer ranks {blind} cannot read {checkpoint}, the newest complete checkpoint rank 0 resumes from: "
            "every trainer rank must see the same run directory (run.dir on a filesystem all trainer nodes share; "
            "on Kubernetes the relayrl-run claim, docs/deployment.md)"
        )
    return checkpoint


def resume_point(backend, run_dir: Path, cfg: TrainerConfig) -> tuple[int, int]:
    """Collective: load the agreed checkpoint (``agreed_checkpoint``) on every rank; (step, dataset cursor), or
    (0, 0) when there is none. The lr schedule continues from the checkpoint's step (a pure function of it,
    relayrl/trainer/schedule.py); a checkpoint whose recorded lr the schedule no longer gives (``trainer.steps``
    changed on resume, moving a decay's end) is said so."""
    checkpoint = agreed_checkpoint(run_dir)
    if checkpoint is None:
        return 0, 0
    state = backend.load_checkpoint(checkpoint)
    log.info("resumed from %s at step %d (dataset cursor %d)", checkpoint, state["step"], state["data_cursor"])
    if "lr" in state and not math.isclose(state["lr"], lr_at(state["step"], cfg), rel_tol=1e-9):
        log.warning(
            "the lr schedule changed since step %d was checkpointed (its lr %.3g, now %.3g): the new one goes on",
            state["step"], state["lr"], lr_at(state["step"], cfg),
        )  # fmt: skip
    if backend.critic is not None:  # what was loaded, to compare with what was saved (state_digest)
        log.info("critic state resumed: sha256 %s", backend.critic.digest())
    return state["step"], state["data_cursor"]


class ShutdownFlag:
    """Set by SIGTERM/SIGINT; rank 0 acts on it between steps (the step in progress completes)."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        log.warning("%s: finishing the current step, then checkpointing and exiting", signal.Signals(signum).name)
        self.requested = True
        STOPPING.set()


def wait_level(details: str, waited_s: float, deadline_s: float) -> int:
    """How loud a wait for a batch is: INFO while the controller says it is not ready yet (being generated) and
    the wait is within the first half of ``deadline_s``; WARNING otherwise (a stall, or no controller)."""
    normal = details.startswith(NOT_READY_DETAIL) and waited_s < deadline_s / 2
    return logging.INFO if normal else logging.WARNING


def pull_or_stop(stub, step: int, deadline_s: float, stop: ShutdownFlag, warn_every_s: float = 30.0) -> bytes:
    """The serialized batch for ``step``, or b"" once a shutdown was requested. While it waits, a line every
    ``warn_every_s`` says why (a wait is never silent), at ``wait_level``."""
    request = controller_pb2.PullBatchRequest(step=step, timeout_s=2)
    started = time.monotonic()
    deadline = started + deadline_s
    warn_at = time.monotonic() + warn_every_s
    while not stop.requested:
        try:
            return stub.PullBatch(request, timeout=30).SerializeToString()
        except grpc.RpcError as err:
            if err.code() not in RETRYABLE:
                raise RuntimeError(f"PullBatch(step={step}) failed: {rpc_error_text(err)}") from None
            if (err.details() or "").startswith(PAUSED_DETAIL):  # an operator's pause is not a stall
                deadline = time.monotonic() + deadline_s
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"no batch for step {step} within {deadline_s:.0f}s") from None
            if now > warn_at:
                log.log(
                    wait_level(err.details() or "", now - started, deadline_s),
                    "no batch for step %d yet (%s: %s); waiting up to %.0fs more",
                    step, err.code().name, err.details(), deadline - now,
                )  # fmt: skip
                warn_at = now + warn_every_s
            time.sleep(0.2)
    return b""


def save_checkpoint(backend, run_dir: Path, step: int, cursor: int, cfg: TrainerConfig) -> None:
    """Collective: the checkpoint of ``step`` (its trainer_state.json records the lr schedule's state, the step's
    lr), then rank 0 prunes older ones beyond ``trainer.save_total_limit`` (relayrl/trainer/retention.py)."""
    directory = run_dir / "checkpoints" / f"step_{step}"
    state = {"step": step, "policy_version": step, "data_cursor": cursor, "lr": lr_at(step, cfg)}
    try:
        backend.save_checkpoint(directory, state)
    except Exception as err:  # torch says "unexpected pos A vs B" of a short write: give what a full disk explains
        lines = [line for line in str(err).splitlines() if line.strip()]  # a CheckpointException: each rank's trace
        cause = lines[-1].strip() if lines else type(err).__name__
        free = free_space_text(directory) or "free space unknown"
        raise RuntimeError(f"checkpoint of step {step} into {directory} failed ({free} there): {cause}") from err
    if dist.get_rank() == 0:
        prune_checkpoints(directory.parent, cfg.save_total_limit)


def publish_weights(backend, syncer: OnDemandSync | None, version: int) -> SyncResult | None:
    """Collective: every rank gathers the weights (with LoRA: the adapter's); rank 0 (the one with a syncer)
    gathers them into the publisher's arena and publishes ``version`` (its SyncResult; None on other ranks)."""
    if backend.lora is not None:
        gather = partial(backend.gather_weights, kind="adapter")
        if syncer is None:
            gather(None)
            return None
        return syncer.publish(version, backend.weight_specs("adapter"), gather, kind="adapter")
    if syncer is None:
        backend.gather_weights(None)
        return None
    return syncer.publish(version, backend.weight_specs(), backend.gather_weights)


def stage_base(backend, syncer: OnDemandSync | None) -> None:
    """Collective, LoRA runs: every rank gathers the frozen base weights, once; rank 0 keeps them for the
    workers that lack them (``WeightPublisher``)."""
    gather = partial(backend.gather_weights, kind="base")
    if syncer is None:
        gather(None)
    else:
        syncer.stage_base(backend.weight_specs("base"), gather)


def broadcast_from_rank0(*values: object) -> list:
    """Rank 0's values on every rank (the trainer's own world group). One rank has them already, so a world of
    one rank skips the pickling collective."""
    box = list(values)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box


def run_backend(cfg: RelayConfig):
    """The run's training backend (collective): ``trainer.backend``'s policy (``model.lora``'s adapter), the frozen
    reference where ``algorithm.kl_coef`` > 0, and the critic under ``algorithm.advantage: gae``."""
    critic = cfg.critic if cfg.algorithm.advantage == "gae" else None
    return create_backend(
        cfg.model, cfg.trainer, with_reference=cfg.algorithm.kl_coef > 0, critic=critic,
        weight_dtype=cfg.rollout.weight_dtype,
    )  # fmt: skip


def train_whole(
    backend,
    cfg: RelayConfig,
    step: int,
    batch_msg: controller_pb2.Batch,
    pad_id: int,
    verified: frozenset[str],
    on_advantages: Callable[[torch.Tensor], object] | None = None,
) -> dict[str, float]:
    """Step ``step`` on a whole batch (every rank): its train metrics; ``on_advantages`` as ``train_on_batch``'s."""
    batch = to_train_batch(batch_msg, pad_id, version=step - 1, verified_workers=verified)
    return train_on_batch(
        backend, batch, cfg.algorithm, cfg.trainer, temperature=batch_msg.temperature or 1.0,
        norm_len=cfg.max_response_tokens, minibatch_groups=batch_msg.minibatch_groups,
        critic_cfg=cfg.critic, critic_only=step <= cfg.critic.warmup_steps, on_advantages=on_advantages,
    )  # fmt: skip


def train_streamed(
    backend,
    cfg: RelayConfig,
    step: int,
    parts,
    verified: frozenset[str],
    pad_id: int,
    priority: GenerationFirst | None = None,
    on_advantages: Callable[[torch.Tensor], object] | None = None,
):
    """One step from StreamBatch parts (``parts()``: rank 0's fresh read_stream, None elsewhere; rank 0
    broadcasts each item, so every rank trains the same parts in the same order). Returns (the batch, the
    train metrics), or (None, {}) when a shutdown was requested. A broken stream is pulled again.
    ``priority`` (rank 0's): lowered while the stream is open, back the moment its last part is read.
    ``on_advantages``: called with the batch's advantages per sample, as ``train_on_batch``'s."""
    rank0 = parts is not None
    priority = priority or GenerationFirst()
    try:
        while True:
            if rank0:
                priority.generating()
            source = read_ahead(parts(), priority.generated) if rank0 else None
            streamed = StreamedStep(
                backend, cfg.algorithm, cfg.trainer, target_groups=cfg.controller.train_batch_groups,
                version=step - 1, verified=verified, pad_id=pad_id, norm_len=cfg.max_response_tokens,
            )  # fmt: skip
            whole: list[controller_pb2.Sample] = []  # parts of a batch sent whole (not streamed)
            waited = 0.0
            began = time.perf_counter()
            while True:
                before = time.perf_counter()
                kind, payload = broadcast_from_rank0(*(next(source) if rank0 else (None, None)))
                waited += time.perf_counter() - before
                if kind == "stop":
                    return None, {}
                if kind == "broken":
                    log.warning(
                        "the batch stream of step %d broke (%s): its parts are void; pulling again", step, payload
                    )
                    streamed.discard()
                    break
                part = controller_pb2.BatchPart.FromString(payload)
                if kind == "part":
                    if part.streamed:
                        streamed.add(part.samples, part.temperature)
                    else:
                        whole.extend(part.samples)
                    continue
                batch_msg = part.batch
                if part.streamed:
                    batch_msg.samples.extend(streamed.samples)
                    train = streamed.finish(batch_msg)
                    if on_advantages is not None:
                        on_advantages(streamed.sample_advantages)
                else:
                    batch_msg.samples.extend(whole)
                    train = train_whole(backend, cfg, step, batch_msg, pad_id, verified, on_advantages)
                train["streamed"] = float(part.streamed)
                train["train_wait_seconds"] = waited
                train["train_seconds"] = time.perf_counter() - began - waited  # compute only
                return batch_msg, train
    finally:  # an error mid-step too: the session's own nice back
        if rank0:
            priority.generated()


def export_candidate(backend, keeper: BestKeeper | None, version: int, tokenizer) -> None:
    """Collective, with ``eval.best``: the weights of an evaluated version, exported for the keeper before the
    version is reported (its eval starts then)."""
    if keeper is not None and (path := keeper.candidate(version)) is not None:
        backend.export_hf(path, tokenizer)


def step_record(step: int, batch: controller_pb2.Batch, train: dict, sync, step_seconds: float) -> dict:
    stats = batch.stats
    return {
        "step": step,
        "policy_version": step,
        "reward_mean": stats.reward_mean,
        "score_mean": stats.score_mean,
        "rollout_version_min": stats.rollout_version_min,
        "rollout_version_max": stats.rollout_version_max,
        "groups_kept": stats.groups_kept,
        "groups_filtered": stats.groups_filtered,
        "groups_stale": stats.groups_stale,
        "groups_failed": stats.groups_failed,
        "samples_aborted": stats.samples_aborted,
        "prompts_too_long": stats.prompts_too_long,
        "prompts_truncated": stats.prompts_truncated,
        "gen_batches": stats.gen_batches,
        "response_len_mean": stats.response_len_mean,
        "samples_trained": len(batch.samples),
        "samples_generated": stats.samples_generated,
        "generation_seconds": stats.generation_seconds,
        **version_mix(batch.samples, step - 1),  # the step trains from version step - 1
        **train,
        "sync_seconds": sync.seconds,
        "sync_plan_wait_seconds": sync.plan_wait_seconds,
        "sync_bytes": sync.nbytes,
        "weights_checksum": sync.checksum,
        "workers_synced": len(sync.synced),
        "step_seconds": step_seconds,
        "samples_per_second": stats.samples_generated / step_seconds if step_seconds > 0 else 0.0,
        "rollout_workers": sorted({s.worker_id for s in batch.samples}),
        "data_cursor_start": stats.cursor_start,
        "data_cursor_end": stats.cursor_end,
        **step_episode_metrics(stats),
        **{f"rewards/{name}": mean for name, mean in sorted(stats.reward_means.items())},
        **{f"scorer/{key}": value for key, value in sorted(stats.scorer_metrics.items())},
        "time": time.time(),
    }


def local_ranks(priority: GenerationFirst) -> GenerationFirst:
    """Collective: rank 0's ``priority`` over the autogroups of every rank on its host (torchrun starts each rank
    in a session of its own), the others' nothing: rank 0 reads the stream, so it knows when generation ends."""
    here = (socket.gethostname(), os.getpid())
    ranks = [here]
    if dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, here)
    if dist.get_rank() != 0:
        return GenerationFirst()
    return priority.for_ranks([pid for host, pid in ranks if host == here[0]])


def run_trainer(
    cfg: RelayConfig, controller_address: str, *, resume: bool = False, priority: GenerationFirst | None = None
) -> int:
    """``priority``: how a streaming rank yields the cores to generation (relayrl/cores/threads.py)."""
    init_world(world_backend(torch.cuda.is_available()))
    rank = dist.get_rank()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(torch_threads(cfg, "trainer"))
    torch.manual_seed(cfg.run.seed)
    run_dir = cfg.run_dir
    mark = time.perf_counter()
    backend = run_backend(cfg)
    startup = {"model": time.perf_counter() - mark}  # the start-up's phases, seconds (logged before step 1)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)

    start_step, cursor = resume_point(backend, run_dir, cfg.trainer) if resume else (0, 0)

    stub = publisher = writer = syncer = trackers = evals = samples = None
    keeper = BestKeeper(run_dir, cfg.eval, cfg.trainer.steps) if cfg.eval is not None and cfg.eval.best else None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "config.yaml").exists():  # `relayrl up` saved it (builtin: paths unresolved, for --resume)
            atomic_write(run_dir / "config.yaml", dump_config(cfg))
        stub = controller_pb2_grpc.ControllerServiceStub(open_channel(controller_address))
        weights_dir = str(Path(cfg.weight_sync.path or run_dir / "weights"))
        publisher = WeightPublisher(cfg.weight_sync, stub, weights_dir, lora=backend.lora)
        writer = MetricsWriter(run_dir / "metrics.jsonl", resume_step=start_step)
        trackers = StepTrackers.from_config(cfg)
        evals = EvalMirror(stub, writer, trackers, keeper) if cfg.eval is not None else None
        if cfg.samples is not None:
            samples = SamplesWriter(run_dir / "samples.jsonl", cfg.samples, resume_step=start_step)
        syncer = OnDemandSync(publisher, stub, cfg.weight_sync.on_demand_interval_s)  # operator syncs, joiners
        syncer.start()

    # The starting weights go to every worker first (base weights, or the checkpoint's when workers run newer,
    # lost ones): each worker's load is verified, so the first step may use the engines' logprobs.
    if backend.lora is not None:
        stage_base(backend, syncer)
    mark = time.perf_counter()
    sync = publish_weights(backend, syncer, start_step)
    startup["starting weights to the workers"] = time.perf_counter() - mark
    export_candidate(backend, keeper, start_step, tokenizer)
    # Step 1's memory, before the workers may start on batch 1 (in pause mode the report below lets them): the
    # optimizer's state, made now rather than on step 1's hot path, and the pages step 1's gradients will take.
    # Beside batch 1's generation, these page faults slowed it by more than they took (docs/performance.md).
    mark = time.perf_counter()
    for optimizer in [backend.optimizer] + ([backend.critic.optimizer] if backend.critic is not None else []):
        create_state(optimizer)
        fault_in_gradients(optimizer)
    startup["optimizer state and gradient pages"] = time.perf_counter() - mark
    log.info("trainer rank %d start-up: %s", rank, ", ".join(f"{k} {v:.2f}s" for k, v in startup.items()))
    if resume and rank == 0:  # a resumed run rewinds the controller to its checkpoint (none: start over)
        rewind = controller_pb2.RewindRequest(step=start_step, cursor=cursor, synced_worker_ids=sync.synced)
        call_with_retry(partial(stub.Rewind, rewind, timeout=60), what="Rewind", deadline_s=600)
    elif rank == 0:  # the workers whose load of the starting weights was verified: a streamed step 1 uses them
        initial = controller_pb2.ReportWeightSyncRequest(
            policy_version=start_step, seconds=sync.seconds, synced_worker_ids=sync.synced, reason="initial"
        )
        call_with_retry(partial(stub.ReportWeightSync, initial, timeout=60), what="ReportWeightSync", deadline_s=600)
    streaming = streams_said(cfg)
    if cfg.algorithm.routing_replay:
        log.info(
            "algorithm.routing_replay: the policy's forwards go padded, without trainer.shared_prefix or "
            "trainer.padding_free (their layouts would need the engine's routing laid out alike)"
        )
    priority = local_ranks(priority or GenerationFirst()) if streaming else None
    stream_timeout_s = cfg.trainer.pull_timeout_s + cfg.controller.generate_timeout_s * cfg.controller.max_gen_batches

    stop = ShutdownFlag()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    saved_step, stopped = start_step, False
    freeze_startup_heap(f"trainer rank {rank}")  # model, optimizer, channels: alive until the end (gcfreeze.py)
    for step in range(start_step + 1, cfg.trainer.steps + 1):
        began = time.perf_counter()
        lr = set_step_lrs(backend, step, cfg)
        # workers whose load of the step's starting weights was verified (none when weight_sync.verify is off)
        verified = sync.synced if rank == 0 and cfg.weight_sync.verify != "off" else []
        (verified,) = broadcast_from_rank0(frozenset(verified))
        advantages: list[torch.Tensor] = []  # the step's, per sample (the samples log's)
        if streaming:
            parts = partial(read_stream, stub, step, cfg.trainer.pull_timeout_s, stream_timeout_s, stop)
            batch_msg, train = train_streamed(
                backend, cfg, step, parts if rank == 0 else None, verified, pad_id, priority, advantages.append
            )
        else:
            payload = pull_or_stop(stub, step, cfg.trainer.pull_timeout_s, stop) if rank == 0 else None
            (payload,) = broadcast_from_rank0(payload)
            batch_msg = controller_pb2.Batch.FromString(payload) if payload else None
            if batch_msg is not None:
                pulled = time.perf_counter()
                train = train_whole(backend, cfg, step, batch_msg, pad_id, verified, advantages.append)
                done = time.perf_counter()  # train_seconds: batch in hand to trained, without pull and sync
                train.update(streamed=0.0, train_wait_seconds=pulled - began, train_seconds=done - pulled)
        if batch_msg is None:  # rank 0 was asked to stop (SIGTERM): keep what is done, leave cleanly
            log.info("stopping before step %d", step)
            stopped = True
            break
        sync = publish_weights(backend, syncer, step)
        export_candidate(backend, keeper, step, tokenizer)
        if rank == 0:
            step_seconds = time.perf_counter() - began
            record = step_record(step, batch_msg, {**train, "lr": lr}, sync, step_seconds)
            report = controller_pb2.ReportStepRequest(
                step=step,
                batch_id=batch_msg.batch_id,
                policy_version=step,
                sync_seconds=sync.seconds,
                step_seconds=step_seconds,
                metrics=correction_metrics_of(record),  # relayrl status shows them
                synced_worker_ids=sync.synced,
            )
            call_with_retry(partial(stub.ReportStep, report, timeout=60), what="ReportStep", deadline_s=600)
            writer.write(record)
            trackers.log(record)
            if evals is not None:
                evals.poll(step)
            if samples is not None and samples.due(step):
                readable = step_samples(batch_msg, step, tokenizer, advantages[-1].tolist(), cfg.samples)
                samples.write(readable)
                trackers.log_samples(readable, step)
            log.info(
                "step %d reward %.3f clip %.3f kl %.4f sync %.2fs step %.2fs",
                step, record["reward_mean"], record["clip_frac"], record["kl"], sync.seconds, step_seconds,
            )  # fmt: skip
        every = cfg.trainer.checkpoint_every
        if (every and step % every == 0) or step == cfg.trainer.steps:
            save_checkpoint(backend, run_dir, step, batch_msg.stats.cursor_end, cfg.trainer)
            saved_step = step
        last_cursor = batch_msg.stats.cursor_end

    if stopped:
        if saved_step != step - 1 and step - 1 > start_step:
            save_checkpoint(backend, run_dir, step - 1, last_cursor, cfg.trainer)
        if rank == 0:
            writer.close()
            trackers.close()
            syncer.stop()
            publisher.close()
        dist.barrier()  # no rank tears the group down while a peer is still in it (an abort at exit)
        dist.destroy_process_group()
        return 0
    if cfg.trainer.export_hf:
        backend.export_hf(run_dir / "final", tokenizer)
    if rank == 0:
        if evals is not None:  # the last version's eval: in the run's files before the PNG is drawn
            evals.drain(cfg.trainer.steps, cfg.controller.generate_timeout_s)
        if keeper is not None:
            keeper.close()
        writer.close()
        trackers.close()
        plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png", title=f"{cfg.run.name}: reward per step")
        plot_training(
            run_dir / "metrics.jsonl", run_dir / "metrics.png", f"{cfg.run.name}: training metrics",
            reference=cfg.algorithm.kl_coef > 0,
        )  # fmt: skip
        syncer.stop()
        publisher.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0
