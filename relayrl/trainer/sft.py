"""``relayrl train sft``: supervised fine-tuning on the RL trainer's parts (DESIGN.md "Layout").

The rows are TRL's formats rendered with their loss masks (relayrl/data/trl_formats.py); the steps and packed rows
are planned from the examples' lengths (relayrl/trainer/sft_plan.py); each row is one forward of its examples back
to back with positions restarting at 0 and no attention mask (``pack_examples``: transformers then attends within
each example only), and its loss is ``sft_loss`` with the step's global trained-token count, so a step's gradient
is the token mean over the whole step however its examples are packed or shared between ranks. The model,
optimizer, precision, checkpoints and export are the FSDP backend's (relayrl/trainer/backends/fsdp.py), the lr
schedule and checkpoint/resume helpers the RL loop's (relayrl/trainer/schedule.py, relayrl/trainer/loop.py).

Files in the run directory: config.yaml, metrics.jsonl (one line per step: loss, token_accuracy, lr, grad_norm,
tokens, ...; eval_loss and eval_token_accuracy on evaluated steps, step 0 the model before training; with an
``eval`` section, the RL loop's eval lines of the same steps, relayrl/trainer/sft_eval.py), checkpoints/step_N, final
(the Hugging Face export) and metrics.png.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import datasets
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from pydantic import ValidationError
from transformers import AutoTokenizer

from relayrl.algorithms.sft_loss import SFTBatch, pack_examples, sft_loss, token_accuracy
from relayrl.config import ConfigError, SFTConfig, TrainerConfig, dump_config, flatten
from relayrl.cores.threads import available_cores
from relayrl.data.trl_formats import (
    LANGUAGE_MODELING,
    PROMPT_COMPLETION,
    DataFormatError,
    SFTExample,
    load_format,
    render_sft,
)
from relayrl.runtime.files import atomic_write
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.loop import ShutdownFlag, broadcast_from_rank0, resume_point, save_checkpoint
from relayrl.trainer.metrics import MetricsWriter, plot_training
from relayrl.trainer.schedule import lr_at, set_lr
from relayrl.trainer.sft_eval import score_checkpoint
from relayrl.trainer.sft_plan import pack_rows, plan_steps
from relayrl.trainer.world import init_world, world_backend

log = logging.getLogger(__name__)

# metrics.png's panels for an SFT run (trainer/metrics.py's plot_training): (metrics.jsonl key, title)
SFT_PANELS = (
    ("loss", "loss: training token mean NLL"),
    ("eval_loss", "eval_loss: held-out token mean NLL"),
    ("token_accuracy", "token_accuracy (training)"),
    ("eval_token_accuracy", "eval_token_accuracy (held-out)"),
    ("lr", "learning rate"),
    ("grad_norm", "grad_norm (before clipping)"),
)


# Keys a resumed run may change: how often it checkpoints and evaluates, its eval sets, what it exports, its threads
# and ranks (checkpoints load on any world size; the ranks share out the same rows, tests/unit/test_train_sft.py). Any
# other key may change the step plan or what a step computes, and a resume would no longer continue the run it names.
RESUME_SAFE_KEYS = (
    "trainer.checkpoint_every",
    "trainer.save_total_limit",
    "trainer.eval_every",
    "trainer.export_hf",
    "trainer.threads",
    "trainer.nproc",
    "eval",
)


def check_resume(cfg: SFTConfig) -> None:
    """ConfigError listing every key outside RESUME_SAFE_KEYS in which ``cfg`` differs from the run's saved
    config.yaml (none saved: nothing to compare)."""
    saved_path = cfg.run_dir / "config.yaml"
    if not saved_path.exists():
        return
    saved, now = flatten(yaml.safe_load(saved_path.read_text())), flatten(cfg.model_dump(mode="json"))
    safe = [f"{key}." for key in RESUME_SAFE_KEYS]
    differing = sorted(
        key
        for key in saved.keys() | now.keys()
        if saved.get(key) != now.get(key) and key not in RESUME_SAFE_KEYS and not key.startswith(tuple(safe))
    )
    if differing:
        shown = ", ".join(f"{key} ({saved.get(key)!r} in the run, {now.get(key)!r} now)" for key in differing)
        raise ConfigError(
            f"--resume: differs from {saved_path} in {shown}; a resumed run replays its saved config's steps (only "
            f"{', '.join(RESUME_SAFE_KEYS)} may change)"
        )


def load_examples(cfg: SFTConfig, tokenizer, path: str, split: str, key: str) -> list[SFTExample]:
    """The rows at ``path`` / ``split`` rendered with their loss masks; a bad dataset or row is a ConfigError of one
    line naming ``key``, the row and the column."""
    try:
        rows, fmt = load_format(path, split=split, subset=cfg.data.subset)
        if fmt.kind not in (LANGUAGE_MODELING, PROMPT_COMPLETION):
            raise DataFormatError(
                f"columns {list(fmt.columns)}: a {fmt.kind} dataset; train sft takes language-modeling (text or "
                "messages) or prompt-completion rows"
            )
        return render_sft(
            rows, tokenizer, completion_only_loss=cfg.data.completion_only_loss,
            assistant_only_loss=cfg.data.assistant_only_loss,
        )  # fmt: skip
    except (DataFormatError, FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{key} {path}: {err}") from None


def load_data(cfg: SFTConfig, tokenizer) -> tuple[list[SFTExample], list[SFTExample] | None]:
    """(training examples, held-out examples or None), every row checked (``load_examples``); datasets' progress
    bars off, so a refusal is the command's one line."""
    datasets.disable_progress_bars()
    examples = load_examples(cfg, tokenizer, cfg.data.path, cfg.data.split, "data.path")
    if cfg.data.heldout is None:
        return examples, None
    path, split = cfg.data.heldout
    return examples, load_examples(cfg, tokenizer, path, split, "data.eval_path" if cfg.data.eval_path else "data.path")


def trained_tokens(example: SFTExample) -> int:
    """The targets the loss reads in ``example``: its mask past the first token (nothing predicts the first)."""
    return sum(example.loss_mask[1:])


def row_batch(examples: Sequence[SFTExample], indices: Sequence[int]) -> SFTBatch:
    return pack_examples([(examples[i].input_ids, examples[i].loss_mask) for i in indices])


def row_forward(backend: FSDPBackend, batch: SFTBatch, num_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row's share of the step's loss, [NLL sum, correct argmax tokens, trained tokens] float64) of one packed
    row: no attention mask, positions restarting per example (``SFTBatch``)."""
    device = backend.device
    with backend.precision.autocast(device):
        logits = backend.model(
            input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device), use_cache=False
        ).logits
    logits = logits[:, :-1].float()
    targets, mask = batch.input_ids[:, 1:].to(device), batch.target_mask.to(device)
    logprob = -F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    loss = sft_loss(logprob, mask, num_tokens=num_tokens)
    with torch.no_grad():
        trained = mask.sum()
        sums = torch.stack([-(logprob * mask).sum(), token_accuracy(logits, targets, mask) * trained, trained])
    return loss, sums.double().cpu()


def idle_forward(backend: FSDPBackend) -> torch.Tensor:
    """A one-token forward whose output counts times zero: a rank with fewer rows than another makes as many
    forward and backward calls (FSDP's collectives run in each)."""
    one = torch.zeros(1, 1, dtype=torch.long, device=backend.device)
    with backend.precision.autocast(backend.device):
        return 0.0 * backend.model(input_ids=one, use_cache=False).logits.float().sum()


def reduced(sums: torch.Tensor, backend: FSDPBackend) -> torch.Tensor:
    """``sums`` added over the ranks (collective; as they are with one rank)."""
    if backend.dp_size > 1:
        dist.all_reduce(sums)
    return sums


def train_step(
    backend: FSDPBackend, examples: Sequence[SFTExample], rows: list[list[int]], grad_clip: float
) -> dict[str, float]:
    """One optimizer step over ``rows`` (packed rows of example indices): rank r forwards rows r, r + ranks, ...,
    each backward adds its examples' NLL / N (N: the step's trained tokens, every rank's), times the ranks where
    FSDP averages the gradients over them; then clip and step."""
    num_tokens = max(1, sum(trained_tokens(examples[i]) for row in rows for i in row))
    mine = rows[backend.dp_rank :: backend.dp_size]
    sums = torch.zeros(3, dtype=torch.float64)
    for row in mine:
        loss, row_sums = row_forward(backend, row_batch(examples, row), num_tokens)
        (loss * backend.dp_size).backward()
        sums += row_sums
    for _ in range(-(-len(rows) // backend.dp_size) - len(mine)):
        idle_forward(backend).backward()
    nll, correct, trained = reduced(sums, backend).tolist()
    grad_norm = backend.step(grad_clip)
    return {"loss": nll / max(trained, 1), "token_accuracy": correct / max(trained, 1), "grad_norm": grad_norm}


@torch.no_grad()
def evaluate(backend: FSDPBackend, examples: Sequence[SFTExample], pack_tokens: int) -> dict[str, float]:
    """Held-out loss and token accuracy: token means over every trained token of ``examples`` (collective)."""
    lengths = [len(example.input_ids) for example in examples]
    rows = pack_rows(lengths, range(len(examples)), pack_tokens)
    sums = torch.zeros(3, dtype=torch.float64)
    backend.model.train(False)
    for row in rows[backend.dp_rank :: backend.dp_size]:
        sums += row_forward(backend, row_batch(examples, row), 1.0)[1]
    for _ in range(-(-len(rows) // backend.dp_size) - len(rows[backend.dp_rank :: backend.dp_size])):
        idle_forward(backend)
    backend.model.train(True)
    nll, correct, trained = reduced(sums, backend).tolist()
    return {"eval_loss": nll / max(trained, 1), "eval_token_accuracy": correct / max(trained, 1)}


def trainer_config(cfg: SFTConfig, steps: int) -> TrainerConfig:
    """The RL trainer's config of the run (``SFTTrainerConfig.as_trainer``); a ConfigError naming the key."""
    try:
        return cfg.trainer.as_trainer(steps)
    except ValidationError as err:
        problem = err.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{problem} (the run has {steps} steps)") from None


def progress_line(step: int, steps: int, record: dict) -> str:
    line = (
        f"step {step}/{steps} epoch {record['epoch'] + 1} loss {record['loss']:.4f} "
        f"token_accuracy {record['token_accuracy']:.3f} lr {record['lr']:.3g} grad_norm {record['grad_norm']:.3f} "
        f"{record['tokens_per_second']:.0f} tok/s"
    )
    if "eval_loss" in record:
        line += f" | held-out loss {record['eval_loss']:.4f} token_accuracy {record['eval_token_accuracy']:.3f}"
    return line


def run_sft(
    cfg: SFTConfig, *, resume: bool, data: tuple[list[SFTExample], list[SFTExample] | None] | None = None
) -> int:
    """Train (every rank calls it; rank 0 writes the run's files); ``data``: ``load_data``'s, where the caller has
    loaded it. Returns the exit code."""
    cuda = torch.cuda.is_available()
    init_world(world_backend(cuda))
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    threads = cfg.trainer.threads
    torch.set_num_threads(threads if threads != "auto" else max(1, available_cores() // dist.get_world_size()))
    run_dir = cfg.run_dir
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    examples, heldout = data if data is not None else load_data(cfg, tokenizer)
    lengths = [len(example.input_ids) for example in examples]
    plan = plan_steps(
        lengths, batch_tokens=cfg.trainer.batch_tokens, epochs=cfg.trainer.epochs, steps=cfg.trainer.steps,
        seed=cfg.run.seed, shuffle=cfg.data.shuffle,
    )  # fmt: skip
    trainer_cfg = trainer_config(cfg, len(plan))
    backend = FSDPBackend(cfg.model, trainer_cfg, with_reference=False)
    start, _ = resume_point(backend, run_dir, trainer_cfg) if resume else (0, 0)
    writer = None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "config.yaml", dump_config(cfg))
        writer = MetricsWriter(run_dir / "metrics.jsonl", resume_step=start, required=("step",))
        print(
            f"relayrl train sft: {len(examples)} examples, {sum(lengths)} tokens, {len(plan)} steps "
            f"({cfg.trainer.batch_tokens} tokens a step, rows of {cfg.trainer.pack_tokens}), "
            f"{'resuming after step ' + str(start) if start else 'from ' + cfg.model.path} -> {run_dir}",
            flush=True,
        )
    if heldout is not None and start == 0:
        before = evaluate(backend, heldout, cfg.trainer.pack_tokens)
        if writer is not None:
            writer.write({"step": 0, **before})
            print(f"step 0 held-out loss {before['eval_loss']:.4f} token_accuracy {before['eval_token_accuracy']:.3f}")
    if cfg.eval is not None and start == 0:
        write_evals(writer, score_checkpoint(cfg, backend, tokenizer, 0))

    stop = ShutdownFlag()
    saved = start
    for step in range(start + 1, len(plan) + 1):
        began = time.perf_counter()
        torch.manual_seed(cfg.run.seed + step)  # dropout, if any, draws the same on a resume
        lr = lr_at(step, trainer_cfg)
        set_lr(backend.optimizer, lr)
        epoch, indices = plan[step - 1]
        rows = pack_rows(lengths, indices, cfg.trainer.pack_tokens)
        record = {"step": step, "epoch": epoch, **train_step(backend, examples, rows, cfg.trainer.grad_clip)}
        seconds = time.perf_counter() - began
        tokens = sum(lengths[i] for i in indices)
        record.update(lr=lr, tokens=tokens, examples=len(indices), rows=len(rows), step_seconds=seconds)
        record["tokens_per_second"] = tokens / seconds
        every = cfg.trainer.eval_every
        evaluating = (every and step % every == 0) or step == len(plan)
        if heldout is not None and evaluating:
            record.update(evaluate(backend, heldout, cfg.trainer.pack_tokens))
        if writer is not None:
            writer.write(record)
            print(progress_line(step, len(plan), record), flush=True)
        if cfg.eval is not None and evaluating:
            write_evals(writer, score_checkpoint(cfg, backend, tokenizer, step))
        every = cfg.trainer.checkpoint_every
        if (every and step % every == 0) or step == len(plan):
            save_checkpoint(backend, run_dir, step, step, trainer_cfg)
            saved = step
        (stopping,) = broadcast_from_rank0(stop.requested)
        if stopping and step < len(plan):
            if saved != step:
                save_checkpoint(backend, run_dir, step, step, trainer_cfg)
            log.info("stopped after step %d, checkpointed: --resume continues", step)
            return finish(writer)

    if cfg.trainer.export_hf:
        backend.export_hf(run_dir / "final", tokenizer)
    if writer is not None:
        writer.close()
        plot_training(
            run_dir / "metrics.jsonl", run_dir / "metrics.png", f"{cfg.run.name}: SFT", panels=SFT_PANELS, evals=True
        )
        print(f"relayrl train sft: done, {run_dir / 'final'} and {run_dir / 'metrics.png'}", flush=True)
    return finish(None)


def write_evals(writer: MetricsWriter | None, records: list[dict]) -> None:
    """The eval sets' lines into metrics.jsonl (rank 0), each with a progress line."""
    if writer is None:
        return
    for record in records:
        writer.write_eval(record)
        scores = " ".join(f"{k} {v:.3f}" for k, v in record.items() if k.startswith(("mean@", "pass@")))
        print(f"step {record['step']} eval {record['eval']}: {scores}", flush=True)


def finish(writer: MetricsWriter | None) -> int:
    """Close the metrics and leave the process group together (collective); 0."""
    if writer is not None:
        writer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0
