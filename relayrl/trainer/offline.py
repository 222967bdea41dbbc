"""The offline stages' one loop (``relayrl train sft | dpo | rm``) on the RL trainer's parts (DESIGN.md "Layout").

A stage (``OfflineStage``: relayrl/trainer/sft.py, preference.py, reward_trainer.py) says what one packed row of
its examples computes: the row's share of the step's loss and a few float64 sums its metrics are made of. This
module does the rest, the same for every stage: the world and threads, the FSDP backend (relayrl/trainer/backends/
fsdp.py: model, optimizer, precision, checkpoints), the step plan and the packed rows (relayrl/trainer/sft_plan.py:
a pure function of the examples' lengths and the config, so a resumed run replays the same steps), the lr schedule,
held-out evaluation, checkpoints and exact resume, the export, metrics.jsonl, the progress lines and metrics.png.

A step's loss is Σ_rows (row loss) with every row's loss divided by the step's ``normaliser`` (every rank's:
trained tokens for SFT, pairs for DPO and reward models), so the gradient is the same however the step's examples
pack into rows or share out between ranks. Rank r forwards rows r, r + ranks, ...; a rank with fewer rows makes
idle forwards (FSDP's collectives run in each).

Files in the run directory: config.yaml, metrics.jsonl (one line per step; ``eval_<metric>`` on evaluated steps,
step 0 the model before training; with an ``eval`` section, the RL loop's eval lines of the same steps,
relayrl/trainer/sft_eval.py), checkpoints/step_N, final (the export) and metrics.png.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import datasets
import torch
import torch.distributed as dist
import yaml
from pydantic import BaseModel, ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.config import ConfigError, TrainerConfig, dump_config, flatten
from relayrl.cores.threads import available_cores
from relayrl.data.trl_formats import DataFormatError, DatasetFormat, load_format
from relayrl.runtime.files import atomic_write
from relayrl.trainer.backends.fsdp import FSDPBackend
from relayrl.trainer.loop import ShutdownFlag, broadcast_from_rank0, resume_point, save_checkpoint
from relayrl.trainer.metrics import MetricsWriter, plot_training
from relayrl.trainer.schedule import lr_at, set_lr
from relayrl.trainer.sft_eval import score_checkpoint
from relayrl.trainer.sft_plan import pack_rows, plan_steps
from relayrl.trainer.world import init_world, world_backend

log = logging.getLogger(__name__)

Example = TypeVar("Example")

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


class OfflineStage(Generic[Example]):
    """What one stage adds to the loop (module docstring). Subclasses set the class attributes and
    ``row_forward``; the others have defaults."""

    name: str  # the command's verb: "sft", "dpo", "rm"
    panels: tuple[tuple[str, str], ...]  # metrics.png's (metrics.jsonl key, title)
    shown: tuple[str, ...]  # the metrics a progress line shows (and the held-out ones, as eval_<metric>)
    sums: int  # how many float64 sums ``row_forward`` returns
    auto_class: Any = AutoModelForCausalLM  # the transformers class the backend builds the model with
    with_reference: bool = False  # the backend holds a frozen reference policy

    def arrange(self, examples: list) -> list[Example]:
        """The rendered examples as the stage forwards them (pure: before planning, on every rank)."""
        return examples

    def length(self, example: Example) -> int:
        """The tokens ``example`` forwards: what the step plan's budget and the packed rows count."""
        raise NotImplementedError

    def normaliser(self, examples: Sequence[Example], indices: Sequence[int]) -> float:
        """N of a step over ``indices`` (module docstring)."""
        raise NotImplementedError

    def prepare(
        self, backend: FSDPBackend, examples: list[Example], heldout: list[Example] | None
    ) -> tuple[list, list | None]:
        """(training, held-out) examples as ``row_forward`` takes them; called once on every rank before any
        checkpoint loads, the backend's weights still ``model.path``'s (collective)."""
        return examples, heldout

    def begin_step(self, backend: FSDPBackend, examples: Sequence[Example], rows: list[list[int]]) -> None:
        """Called on every rank before a step's (or an evaluation's) rows, with all of them (collective)."""

    def row_forward(
        self, backend: FSDPBackend, examples: Sequence[Example], row: Sequence[int], normaliser: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the row's share of the step's loss, [``sums``] float64 on the CPU) of the packed row ``row``."""
        raise NotImplementedError

    def idle_forward(self, backend: FSDPBackend) -> torch.Tensor:
        """A one-token forward whose output counts times zero: a rank with fewer rows than another makes as many
        forward and backward calls (FSDP's collectives run in each)."""
        one = torch.zeros(1, 1, dtype=torch.long, device=backend.device)
        with backend.precision.autocast(backend.device):
            return 0.0 * backend.model(input_ids=one, use_cache=False).logits.float().sum()

    def metrics(self, sums: list[float]) -> dict[str, float]:
        """The step's (or the held-out set's) metrics from its sums added over the ranks."""
        raise NotImplementedError

    def export(self, backend: FSDPBackend, directory, tokenizer) -> None:
        """Write the trained model to ``directory`` (collective)."""
        backend.export_hf(directory, tokenizer)


def load_split(cfg: BaseModel, path: str, split: str, key: str, render: Callable[[Any, DatasetFormat], list]) -> list:
    """``render(rows, format)`` of the rows at ``path`` / ``split``; a bad dataset or row is a ConfigError of one
    line naming ``key``, the row and the column."""
    try:
        rows, fmt = load_format(path, split=split, subset=cfg.data.subset)
        return render(rows, fmt)
    except (DataFormatError, FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{key} {path}: {err}") from None


def load_splits(cfg: BaseModel, render: Callable[[Any, DatasetFormat], list]) -> tuple[list, list | None]:
    """(training examples, held-out examples or None) of ``cfg.data``, every row checked (``load_split``);
    datasets' progress bars off, so a refusal is the command's one line."""
    datasets.disable_progress_bars()
    examples = load_split(cfg, cfg.data.path, cfg.data.split, "data.path", render)
    if cfg.data.heldout is None:
        return examples, None
    path, split = cfg.data.heldout
    key = "data.eval_path" if cfg.data.eval_path else "data.path"
    return examples, load_split(cfg, path, split, key, render)


def check_resume(cfg: BaseModel) -> None:
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


def trainer_config(cfg: BaseModel, steps: int) -> TrainerConfig:
    """The RL trainer's config of the run (``OfflineTrainerConfig.as_trainer``); a ConfigError naming the key."""
    try:
        return cfg.trainer.as_trainer(steps)
    except ValidationError as err:
        problem = err.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"{problem} (the run has {steps} steps)") from None


def reduced(sums: torch.Tensor, backend: FSDPBackend) -> torch.Tensor:
    """``sums`` added over the ranks (collective; as they are with one rank)."""
    if backend.dp_size > 1:
        dist.all_reduce(sums)
    return sums


def idle_rows(backend: FSDPBackend, rows: Sequence, mine: Sequence) -> int:
    """How many idle forwards this rank owes: the most rows a rank forwards, less its own."""
    return -(-len(rows) // backend.dp_size) - len(mine)


def train_step(
    stage: OfflineStage, backend: FSDPBackend, examples: Sequence, rows: list[list[int]], grad_clip: float
) -> dict[str, float]:
    """One optimizer step over ``rows`` (packed rows of example indices): each backward adds its row's loss / N
    times the ranks where FSDP averages the gradients over them; then clip and step."""
    normaliser = max(1.0, stage.normaliser(examples, [i for row in rows for i in row]))
    stage.begin_step(backend, examples, rows)
    mine = rows[backend.dp_rank :: backend.dp_size]
    sums = torch.zeros(stage.sums, dtype=torch.float64)
    for row in mine:
        loss, row_sums = stage.row_forward(backend, examples, row, normaliser)
        (loss * backend.dp_size).backward()
        sums += row_sums
    for _ in range(idle_rows(backend, rows, mine)):
        stage.idle_forward(backend).backward()
    record = stage.metrics(reduced(sums, backend).tolist())
    record["grad_norm"] = backend.step(grad_clip)
    return record


@torch.no_grad()
def evaluate(stage: OfflineStage, backend: FSDPBackend, examples: Sequence, pack_tokens: int) -> dict[str, float]:
    """The stage's metrics over every example of ``examples``, named ``eval_<metric>`` (collective)."""
    rows = pack_rows([stage.length(example) for example in examples], range(len(examples)), pack_tokens)
    mine = rows[backend.dp_rank :: backend.dp_size]
    sums = torch.zeros(stage.sums, dtype=torch.float64)
    backend.model.train(False)
    stage.begin_step(backend, examples, rows)
    for row in mine:
        sums += stage.row_forward(backend, examples, row, 1.0)[1]
    for _ in range(idle_rows(backend, rows, mine)):
        stage.idle_forward(backend)
    backend.model.train(True)
    return {f"eval_{key}": value for key, value in stage.metrics(reduced(sums, backend).tolist()).items()}


def shown(stage: OfflineStage, record: dict, prefix: str = "") -> str:
    return " ".join(f"{key} {record[prefix + key]:.4f}" for key in stage.shown if prefix + key in record)


def progress_line(stage: OfflineStage, step: int, steps: int, record: dict) -> str:
    line = (
        f"step {step}/{steps} epoch {record['epoch'] + 1} {shown(stage, record)} lr {record['lr']:.3g} "
        f"grad_norm {record['grad_norm']:.3f} {record['tokens_per_second']:.0f} tok/s"
    )
    if any(key.startswith("eval_") for key in record):
        line += f" | held-out {shown(stage, record, 'eval_')}"
    return line


def start_world(threads: int | str) -> int:
    """Join the process group (gloo on CPU, NCCL on CUDA), pick this rank's device and threads; the rank."""
    cuda = torch.cuda.is_available()
    init_world(world_backend(cuda))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(threads if threads != "auto" else max(1, available_cores() // dist.get_world_size()))
    return dist.get_rank()


def run_offline(
    cfg: BaseModel,
    stage: OfflineStage,
    load_data: Callable[[BaseModel, Any], tuple[list, list | None]],
    *,
    resume: bool,
    data: tuple[list, list | None] | None = None,
) -> int:
    """Train ``stage`` (every rank calls it; rank 0 writes the run's files); ``data``: ``load_data(cfg,
    tokenizer)``'s, where the caller has loaded it. Returns the exit code."""
    rank = start_world(cfg.trainer.threads)
    run_dir = cfg.run_dir
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    examples, heldout = data if data is not None else load_data(cfg, tokenizer)
    examples, heldout = stage.arrange(examples), stage.arrange(heldout) if heldout is not None else None
    lengths = [stage.length(example) for example in examples]
    plan = plan_steps(
        lengths, batch_tokens=cfg.trainer.batch_tokens, epochs=cfg.trainer.epochs, steps=cfg.trainer.steps,
        seed=cfg.run.seed, shuffle=cfg.data.shuffle,
    )  # fmt: skip
    trainer_cfg = trainer_config(cfg, len(plan))
    torch.manual_seed(cfg.run.seed)  # a head the checkpoint does not hold (a reward model's score) starts the same
    backend = FSDPBackend(cfg.model, trainer_cfg, with_reference=stage.with_reference, auto_class=stage.auto_class)
    examples, heldout = stage.prepare(backend, examples, heldout)
    start, _ = resume_point(backend, run_dir, trainer_cfg) if resume else (0, 0)
    writer = None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "config.yaml", dump_config(cfg))
        writer = MetricsWriter(run_dir / "metrics.jsonl", resume_step=start, required=("step",))
        print(
            f"relayrl train {stage.name}: {len(examples)} examples, {sum(lengths)} tokens, {len(plan)} steps "
            f"({cfg.trainer.batch_tokens} tokens a step, rows of {cfg.trainer.pack_tokens}), "
            f"{'resuming after step ' + str(start) if start else 'from ' + cfg.model.path} -> {run_dir}",
            flush=True,
        )
    if heldout is not None and start == 0:
        before = evaluate(stage, backend, heldout, cfg.trainer.pack_tokens)
        if writer is not None:
            writer.write({"step": 0, **before})
            print(f"step 0 held-out {shown(stage, before, 'eval_')}", flush=True)
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
        record = {"step": step, "epoch": epoch, **train_step(stage, backend, examples, rows, cfg.trainer.grad_clip)}
        seconds = time.perf_counter() - began
        tokens = sum(lengths[i] for i in indices)
        record.update(lr=lr, tokens=tokens, examples=len(indices), rows=len(rows), step_seconds=seconds)
        record["tokens_per_second"] = tokens / seconds
        every = cfg.trainer.eval_every
        evaluating = (every and step % every == 0) or step == len(plan)
        if heldout is not None and evaluating:
            record.update(evaluate(stage, backend, heldout, cfg.trainer.pack_tokens))
        if writer is not None:
            writer.write(record)
            print(progress_line(stage, step, len(plan), record), flush=True)
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
        stage.export(backend, run_dir / "final", tokenizer)
    if writer is not None:
        writer.close()
        title = f"{cfg.run.name}: {stage.name.upper()}"
        plot_training(run_dir / "metrics.jsonl", run_dir / "metrics.png", title, panels=stage.panels, evals=True)
        print(f"relayrl train {stage.name}: done, {run_dir / 'final'} and {run_dir / 'metrics.png'}", flush=True)
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
