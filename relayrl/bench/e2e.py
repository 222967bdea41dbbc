"""``relayrl bench e2e``: relayrl against TRL's ``GRPOTrainer``, side by side, on the same machine.

Each workload is one relayrl config (examples/digits.yaml plus overrides, its held-out eval and sample logs off:
``UNMEASURED``). relayrl runs it as a user would, ``relayrl up CONFIG --set ...`` in its own run directory, and
is read back from ``<run>/metrics.jsonl``; TRL runs the same model directory, JSONL data, batch shape, sampling and loss
settings, taken from the same resolved config (``relayrl.bench.trl_runner``, its own process). The
systems alternate within one invocation: per round every relayrl variant, then TRL.

Workloads:
- ``gen-heavy``: tiny Qwen2 (hidden 256, 4 layers), 16 prompts x 16 samples of exactly 48 tokens
  (relayrl ``rollout.ignore_eos``, TRL ``min_new_tokens``; checked from the measured lengths), 1 rollout
  worker, 1 trainer rank, no dynamic sampling, 2 optimizer steps per batch; relayrl at
  ``max_staleness`` 0 (groups streamed to the trainer, and whole batches) and 1 (old logprobs of the stale
  batches the trainer's, and the engine's: ``algorithm.old_logprobs=rollout``); on two or more cores also with
  the trainer and the worker pinned to disjoint halves of them (``trainer.cpus``/``rollout.cpus``: ``k0-split``,
  ``k1-rollout-split``), as on two machines; and PPO with a learned critic at K = 0 (``k0-gae``: GAE, the critic's
  forward and updates), against GRPO's whole-batch K = 0 run of the same round (``critic_vs_grpo``). Same number of
  steps for every system.
- ``demo``: examples/digits.yaml as it is (relayrl's default demo config); TRL gets the samples the
  relayrl run of the same round generated.
- ``real`` (not run by default): a real pretrained model, examples/addition-smollm2.yaml as it is
  (builtin:smollm2-135m-instruct: Llama, 30 layers, a 49,152-token vocabulary; 8 prompts x 8 samples, responses
  ended by EOS or ``max_tokens``, one optimizer step per batch), ``--steps`` steps; relayrl with its defaults
  (``default``) and at K = 1 (``k1``; ``k1-rollout`` with the engine's logprobs as old logprobs); TRL in each of
  its precisions and generation modes (float32 or ``bf16=True``, ``generate`` or continuous batching: ``trl``,
  ``trl-bf16``, ``trl-cb``, ``trl-cb-bf16``), the fastest of them the baseline. relayrl's ``logprob_mismatch``
  (|trainer - engine| logprob per response token) is reported per run.
- ``long-tail`` (not run by default): a model whose responses have geometric lengths with mean ~48 tokens,
  capped at 256 (``relayrl.models.tiny.write_long_tail_model``: near-uniform next-token distribution over 48
  tokens, EOS one of them), 16 prompts x 16 samples, a negligible lr (1e-7) so the lengths do not drift; relayrl
  with its defaults (K = 0, whole batches, ``trainer.padding_free`` auto), the same K = 0 batches streamed to the
  trainer (``k0-stream``: ``trainer.stream=on``) and at K = 1 with in-flight weight updates
  (``rollout.partial=keep_kv``, the engine's old logprobs), each but k0-stream also pinned to disjoint halves of
  the cores (``k0-split``, ``k1-keep-kv-split``) as gen-heavy's split variants are; TRL in both of its generation
  modes, ``generate`` (system ``trl``) and ``use_transformers_continuous_batching`` (``trl-cb``). Ratios are against
  the faster TRL mode (``trl_baseline``); each system's measured mean response length is reported.

Per run (s/step and rates over the steady steps, after ``--warmup``): s/step = wall time between the
ends of the last warm-up step and the last step over the steady steps; samples/s, tokens/s (samples x
mean response length); mean generation / training seconds per step; reward curve; wall time from launch
and samples to the first step whose trailing ``--target-window``-step mean reward reaches ``--target``
(else the best such mean); for relayrl the CPU seconds of each role (from /proc) per steady step and the
control plane's share of a step = controller CPU seconds / steady wall seconds.
``step_vs_longer_phase`` = s/step / max(generation s, training s), each phase as measured in that run:
1.0 when a step costs only its longer phase (generation and training fully overlapped), about 2 when
they alternate with equal lengths. Per workload: medians
over rounds per system, relayrl/TRL ratios, ``overlap``: each K = 1 variant's s/step against the phases of
the K = 0 variant that ran them alone on the same cores, and ``stream_vs_whole``: the whole-batch K = 0 run's
s/step over the streamed one's of the same round (``--no-trl`` runs relayrl's variants alone).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from relayrl.bench.cpu import CpuSampler
from relayrl.bench.record import machine_record, run_sides, trl_side
from relayrl.config import RelayConfig, load_config
from relayrl.models.assets import prepare_assets
from relayrl.ops.args import OneLineParser, existing_dir
from relayrl.runtime.cpus import format_cpu_list
from relayrl.runtime.procs import kill_tree
from relayrl.trainer.metrics import read_metrics

# Off in every relayrl run: the held-out evals and sample logs of the example configs, which TRL's side does not do
UNMEASURED = ["eval=null", "samples=null"]
DEMO_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"
REAL_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "addition-smollm2.yaml"
WORKLOADS = ("gen-heavy", "demo", "long-tail", "real")
DEFAULT_WORKLOADS = ("gen-heavy", "demo")
# system -> (use_transformers_continuous_batching, bf16): TRL's generation modes and precisions
TRL_MODES = {"trl": (False, False), "trl-cb": (True, False), "trl-bf16": (False, True), "trl-cb-bf16": (True, True)}


@dataclass(frozen=True)
class Workload:
    """One relayrl config and the relayrl variants run on it; TRL runs what the config says."""

    name: str
    overrides: list[str]  # applied to ``config`` for every system
    variants: dict[str, list[str]]  # relayrl variant name -> its extra overrides
    samples_budget: bool  # TRL gets the samples the round's relayrl run generated (else the same steps)
    trl_systems: tuple[str, ...] = ("trl",)  # TRL_MODES run each round
    config: Path = DEMO_CONFIG  # the relayrl config the overrides apply to


@dataclass
class Run:
    """One system's run in one round: its per-step records and what was measured around them."""

    workload: str
    system: str  # "relayrl-<variant>" or "trl"
    round: int
    launched: float  # epoch seconds
    wall_s: float
    returncode: int
    records: list[dict]
    log: Path
    cpu: CpuSampler | None = None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="relayrl bench e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help=f"comma-separated, of {WORKLOADS}")
    parser.add_argument(
        "--variants", default=None, help="comma-separated relayrl variants to run (default: each workload's all)"
    )
    parser.add_argument(
        "--trl-systems", default=None, help=f"comma-separated, of {list(TRL_MODES)} (default: each workload's)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every system once, alternating")
    parser.add_argument("--steps", type=int, default=12, help="trainer steps of the gen-heavy workload")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of s/step and rates")
    parser.add_argument("--target", type=float, default=0.9, help="target trailing mean reward")
    parser.add_argument("--target-window", type=int, default=10, help="steps in the trailing mean")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override, relayrl+TRL")
    parser.add_argument(
        "--quick", action="store_true", help="1 round, 3 steps, tiny sizes, 1 worker and 1 rank: checks that it runs"
    )
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per run")
    parser.add_argument(
        "--workdir", type=existing_dir, help="models, data, run dirs and logs (default: a new temp dir)"
    )
    parser.add_argument("--json", action="store_true", help="print the JSON result to stdout (else a table)")
    parser.add_argument("--no-trl", action="store_true", help="relayrl's variants only: no TRL system runs")
    args = parser.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.workloads:
        parser.error(f"--workloads: unknown {unknown} (choose from {list(WORKLOADS)})")
    args.variants = None if args.variants is None else [v.strip() for v in args.variants.split(",") if v.strip()]
    args.trl_systems = (
        None if args.trl_systems is None else tuple(v.strip() for v in args.trl_systems.split(",") if v.strip())
    )
    if args.trl_systems is not None and (not args.trl_systems or set(args.trl_systems) - set(TRL_MODES)):
        parser.error(f"--trl-systems: expected some of {list(TRL_MODES)}, got {args.trl_systems}")
    if args.variants == []:
        parser.error("--variants: empty (name at least one relayrl variant, or leave the flag out)")
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 3, 1
    if args.rounds < 1 or args.steps <= args.warmup or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --steps greater than --warmup (>= 0)")
    return args


def workload(name: str, args: argparse.Namespace, workdir: Path) -> Workload:
    if name == "demo":
        quick = [f"trainer.steps={args.steps}", "rollout.workers=1", "trainer.nproc=1"] if args.quick else []
        return Workload("demo", [*quick, *args.set], {"default": []}, samples_budget=True)
    if name == "long-tail":
        return long_tail_workload(args, workdir)
    if name == "real":
        return real_workload(args)
    hidden, layers, tokens, prompts, n = (32, 2, 8, 4, 4) if args.quick else (256, 4, 48, 16, 16)
    overrides = [
        f"model.tiny_hidden_size={hidden}", f"model.tiny_layers={layers}",
        "rollout.workers=1", f"rollout.n={n}", f"rollout.max_tokens={tokens}", "rollout.ignore_eos=true",
        f"controller.prompts_per_gen_batch={prompts}", f"controller.train_batch_groups={prompts}",
        "controller.dynamic_sampling=false",
        "trainer.nproc=1", "trainer.lr=0.003", "trainer.mini_batches=2", f"trainer.steps={args.steps}",
        "trainer.checkpoint_every=0",
        "algorithm.loss_agg=token-mean", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
        *args.set,
    ]  # fmt: skip
    variants = {  # K = 0 with groups streamed to the trainer as they are kept, and with whole batches
        "k0-stream": ["controller.max_staleness=0", "trainer.stream=on"],
        "k0-whole": ["controller.max_staleness=0", "trainer.stream=off"],
        "k1": ["controller.max_staleness=1"],  # stale batches' old logprobs: the trainer's (decoupled PPO)
        "k1-rollout": ["controller.max_staleness=1", "algorithm.old_logprobs=rollout"],  # the engine's (bypass)
        # PPO with a learned critic (GAE): k0-whole plus the critic's forward and update (CRITIC_PAIRS)
        "k0-gae": ["controller.max_staleness=0", "trainer.stream=off", "algorithm.advantage=gae", "critic.lr=0.003"],
    }
    if (pinned := pinned_halves()) is not None:  # trainer and worker on disjoint cores: what overlap hides there
        variants["k0-split"] = ["controller.max_staleness=0", "trainer.stream=off", *pinned]
        variants["k1-rollout-split"] = ["controller.max_staleness=1", "algorithm.old_logprobs=rollout", *pinned]
    return Workload("gen-heavy", overrides, variants, samples_budget=False)


def long_tail_workload(args: argparse.Namespace, workdir: Path) -> Workload:
    """The long-tail workload (module docstring); its model is built by ``prepare_workload``."""
    hidden, layers, tokens, prompts, n = (32, 2, 32, 4, 4) if args.quick else (256, 4, 256, 16, 16)
    overrides = [
        f"model.path={workdir / 'assets' / f'long-tail-model-h{hidden}-l{layers}'}",
        f"model.tiny_hidden_size={hidden}", f"model.tiny_layers={layers}",
        "rollout.workers=1", f"rollout.n={n}", f"rollout.max_tokens={tokens}", "rollout.ignore_eos=false",
        f"controller.prompts_per_gen_batch={prompts}", f"controller.train_batch_groups={prompts}",
        "controller.dynamic_sampling=false",
        "trainer.nproc=1", "trainer.lr=1e-7", "trainer.mini_batches=2", f"trainer.steps={args.steps}",
        "trainer.checkpoint_every=0",
        "algorithm.loss_agg=token-mean", "algorithm.clip_low=0.2", "algorithm.clip_high=0.28",
        *args.set,
    ]  # fmt: skip
    in_flight = ["controller.max_staleness=1", "rollout.partial=keep_kv", "algorithm.old_logprobs=rollout"]
    # default: K = 0, whole batches, trainer.padding_free auto; k0-stream: the same batches streamed to the trainer
    variants = {"default": [], "k0-stream": ["trainer.stream=on"], "k1-keep-kv": in_flight}
    if (pinned := pinned_halves()) is not None:  # the phases alone and overlapped on disjoint cores
        variants["k0-split"] = ["trainer.stream=off", *pinned]
        variants["k1-keep-kv-split"] = [*in_flight, *pinned]
    return Workload("long-tail", overrides, variants, samples_budget=False, trl_systems=("trl", "trl-cb"))


def real_workload(args: argparse.Namespace) -> Workload:
    """The real-model workload (module docstring): examples/addition-smollm2.yaml."""
    quick = ["rollout.max_tokens=4", "rollout.n=2", "controller.prompts_per_gen_batch=2"] if args.quick else []
    quick += ["controller.train_batch_groups=2"] if args.quick else []
    overrides = [f"trainer.steps={args.steps}", "trainer.checkpoint_every=0", *quick, *args.set]
    variants = {  # K = 1's stale batches take the trainer's old logprobs (k1) or the engine's (k1-rollout)
        "default": [],
        "k1": ["controller.max_staleness=1"],
        "k1-rollout": ["controller.max_staleness=1", "algorithm.old_logprobs=rollout"],
    }
    return Workload("real", overrides, variants, samples_budget=False, trl_systems=tuple(TRL_MODES), config=REAL_CONFIG)


def select_variants(loads: list[Workload], names: list[str] | None) -> list[Workload]:
    """Each workload with only its relayrl variants in ``names`` (None: all); a name that is no variant of any
    workload, or a workload left with none, is refused naming ``--variants``."""
    if names is None:
        return loads
    known = {variant for wl in loads for variant in wl.variants}
    if unknown := [name for name in names if name not in known]:
        raise SystemExit(f"relayrl bench e2e: --variants: unknown {unknown} (these workloads have {sorted(known)})")
    out = []
    for wl in loads:
        variants = {name: sets for name, sets in wl.variants.items() if name in names}
        if not variants:
            raise SystemExit(f"relayrl bench e2e: --variants: none of {wl.name}'s ({sorted(wl.variants)})")
        out.append(replace(wl, variants=variants))
    return out


def prepare_workload(wl: Workload, cfg: RelayConfig) -> None:
    """Build what the workload's config names and relayrl would not build itself (the long-tail model)."""
    if wl.name == "long-tail" and not (Path(cfg.model.path) / "config.json").exists():
        from relayrl.models.tiny import write_long_tail_model

        write_long_tail_model(cfg.model.path, hidden_size=cfg.model.tiny_hidden_size, layers=cfg.model.tiny_layers)


def pinned_halves() -> list[str] | None:
    """Overrides that pin the trainer and the rollout worker to disjoint halves of this process's CPUs, as on two
    machines; None on one CPU."""
    halves = split_cpus(sorted(os.sched_getaffinity(0)))
    return None if halves is None else [f"trainer.cpus={halves[0]}", f"rollout.cpus={halves[1]}"]


def split_cpus(cpus: list[int]) -> tuple[str, str] | None:
    """(trainer, rollout) CPU lists: the first half of ``cpus`` (rounded up) and the rest; None for one CPU."""
    if len(cpus) < 2:
        return None
    half = -(-len(cpus) // 2)
    return format_cpu_list(cpus[:half]), format_cpu_list(cpus[half:])


def check_mirrorable(cfg: RelayConfig) -> None:
    """Refuse settings the TRL side cannot reproduce, naming the key."""
    alg = cfg.algorithm
    unsupported = {
        "algorithm.advantage": alg.advantage != "grpo",
        "algorithm.norm_by_std": not alg.norm_by_std,
        "algorithm.loss_agg": alg.loss_agg != "token-mean",
        "algorithm.kl_coef": alg.kl_coef > 0,
        "algorithm.entropy_coef": alg.entropy_coef != 0,
        "algorithm.tis_cap": alg.tis_cap is not None,
        "trainer.epochs": cfg.trainer.epochs != 1,
        "controller.reward.overlong_buffer": cfg.controller.reward.overlong_buffer > 0,
        "rollout.stop_token_ids": bool(cfg.rollout.stop_token_ids),
    }
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise SystemExit(f"relayrl bench e2e: TRL's GRPOTrainer cannot mirror {bad}; leave them at their defaults")
    if (cfg.controller.train_batch_groups * cfg.rollout.n) % cfg.trainer.mini_batches:
        raise SystemExit("trainer.mini_batches: must divide controller.train_batch_groups x rollout.n for TRL")


def equal_work(cfg: RelayConfig) -> bool:
    """Every response exactly ``rollout.max_tokens`` long: EOS never ends one."""
    return cfg.rollout.ignore_eos or cfg.rollout.min_tokens >= cfg.rollout.max_tokens


def trl_spec(
    cfg: RelayConfig, steps: int, threads: int, run_dir: Path, *, continuous_batching: bool = False, bf16: bool = False
) -> dict:
    """The trl_runner spec: the same model, data, batch shape, sampling and loss settings as ``cfg``; TRL generates
    with ``model.generate`` or (``continuous_batching``) transformers' continuous batching, and computes in
    float32 or (``bf16``) its mixed precision."""
    return {
        "continuous_batching": continuous_batching,
        "bf16": bf16,
        "model_path": cfg.model.path,
        "data_path": cfg.data.path,
        "prompt_key": cfg.data.prompt_key,
        "answer_key": cfg.data.answer_key,
        "chat_template": cfg.data.chat_template,
        "prompt_template": cfg.data.prompt_template,
        "system_prompt": cfg.data.system_prompt,
        "reward_fn": cfg.controller.reward.fn,
        "prompts_per_step": cfg.controller.train_batch_groups,
        "n": cfg.rollout.n,
        "max_tokens": cfg.rollout.max_tokens,
        "equal_work": equal_work(cfg),
        "temperature": cfg.rollout.temperature,
        "top_p": cfg.rollout.top_p,
        "lr": cfg.trainer.lr,
        "weight_decay": cfg.trainer.weight_decay,
        "betas": list(cfg.trainer.betas),
        "grad_clip": cfg.trainer.grad_clip,
        "clip_low": cfg.algorithm.clip_low,
        "clip_high": cfg.algorithm.clip_high,
        "mini_batches": cfg.trainer.mini_batches,
        "steps": steps,
        "seed": cfg.run.seed,
        "threads": threads,
        "output_dir": str(run_dir / "trl-output"),
        "metrics_path": str(run_dir / "metrics.jsonl"),
    }


def launch(argv: list[str], log: Path, env: dict[str, str], timeout_s: float, sample_cpu: bool):
    """Run ``argv`` to the end (killed past ``timeout_s``); returns (launched, wall_s, returncode, sampler)."""
    launched, began = time.time(), time.perf_counter()
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    sampler = CpuSampler(proc.pid).start() if sample_cpu else None
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        code = proc.wait()
        with log.open("a") as out:
            out.write(f"\n[bench e2e] killed after {timeout_s:.0f} s\n")
    finally:
        if sampler is not None:
            sampler.stop()
    return launched, time.perf_counter() - began, code, sampler


def run_relayrl(wl: Workload, variant: str, rnd: int, workdir: Path, args: argparse.Namespace) -> Run:
    name = f"{wl.name}-relayrl-{variant}-r{rnd}"
    sets = [*UNMEASURED, *wl.overrides, *wl.variants[variant], f"run.dir={workdir / 'runs'}", f"run.name={name}"]
    argv = [sys.executable, "-m", "relayrl.cli", "up", str(wl.config)]
    for item in sets:
        argv += ["--set", item]
    log = workdir / "logs" / f"{name}.log"
    launched, wall_s, code, cpu = launch(argv, log, {}, args.timeout_s, sample_cpu=True)
    records = read_metrics(workdir / "runs" / name / "metrics.jsonl")
    return Run(wl.name, f"relayrl-{variant}", rnd, launched, wall_s, code, records, log, cpu)


def run_trl(
    wl: Workload, cfg: RelayConfig, steps: int, rnd: int, workdir: Path, args: argparse.Namespace, system: str = "trl"
) -> Run:
    name = f"{wl.name}-{system}-r{rnd}"
    run_dir = workdir / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    continuous_batching, bf16 = TRL_MODES[system]
    spec = trl_spec(cfg, steps, args.trl_threads, run_dir, continuous_batching=continuous_batching, bf16=bf16)
    spec_path.write_text(json.dumps(spec, indent=1))
    argv = [sys.executable, "-m", "relayrl.bench.trl_runner", str(spec_path)]
    env = {"OMP_NUM_THREADS": str(args.trl_threads), "TOKENIZERS_PARALLELISM": "false"}
    log = workdir / "logs" / f"{name}.log"
    launched, wall_s, code, cpu = launch(argv, log, env, args.timeout_s, sample_cpu=True)
    return Run(wl.name, system, rnd, launched, wall_s, code, read_metrics(run_dir / "metrics.jsonl"), log, cpu)


def trailing_means(rewards: list[float], window: int) -> list[float]:
    """Mean of each step's last ``window`` rewards (fewer at the start)."""
    return [statistics.fmean(rewards[max(0, i + 1 - window) : i + 1]) for i in range(len(rewards))]


def reach_target(run: Run, target: float, window: int) -> dict:
    """Wall seconds from launch and samples generated up to the first step whose trailing ``window``-step
    mean reward is >= ``target`` (only steps with a full window count); else None and the best such mean."""
    rewards = [r["reward_mean"] for r in run.records]
    means = trailing_means(rewards, window)
    full = means[window - 1 :] if len(means) >= window else means[-1:]
    best = max(full, default=None)
    samples = 0
    for i, record in enumerate(run.records):
        samples += record["samples_generated"]
        if i + 1 >= window and means[i] >= target:
            return {"reached": True, "step": record["step"], "wall_s": record["time"] - run.launched,
                    "samples": samples, "best_mean": best}  # fmt: skip
    return {"reached": False, "step": None, "wall_s": None, "samples": None, "best_mean": best}


def summarize(run: Run, args: argparse.Namespace, max_tokens: int, expect_equal_work: bool) -> dict:
    """The run's figures over its steady steps (after ``args.warmup``)."""
    records = run.records
    out = {"system": run.system, "round": run.round, "returncode": run.returncode, "steps": len(records),
           "wall_s": run.wall_s, "log": str(run.log)}  # fmt: skip
    if run.returncode != 0 or len(records) <= args.warmup:
        out["error"] = f"run failed (exit {run.returncode}, {len(records)} steps); see {run.log}"
        return out
    steady = records[args.warmup :]
    start, end = records[args.warmup - 1]["time"] if args.warmup else run.launched, records[-1]["time"]
    wall = end - start
    samples = sum(r["samples_generated"] for r in steady)
    tokens = sum(r["samples_generated"] * r["response_len_mean"] for r in steady)
    out |= {
        "steady_steps": len(steady),
        "s_per_step": wall / len(steady),
        "samples_per_step": samples / len(steady),
        "samples_per_s": samples / wall,
        "tokens_per_s": tokens / wall,
        "generation_s": statistics.fmean(r["generation_seconds"] for r in steady),
        "train_s": statistics.fmean(r["train_seconds"] for r in steady) if "train_seconds" in steady[0] else None,
        "response_len_mean": tokens / samples if samples else 0.0,
        "reward_curve": [round(r["reward_mean"], 4) for r in records],
        "samples_total": sum(r["samples_generated"] for r in records),
        "target": reach_target(run, args.target, args.target_window),
    }
    if "step_seconds" in steady[0]:  # what a step costs as the machine was for most steps: a burst of other load
        out["step_s_median"] = statistics.median(r["step_seconds"] for r in steady)  # moves s_per_step, not this
    if "sync_seconds" in steady[0]:
        out["sync_s"] = statistics.fmean(r["sync_seconds"] for r in steady)
    if "critic_update_seconds" in steady[0]:  # a critic's forward at the starting weights and its updates
        out["critic_s"] = statistics.fmean(r["critic_values_seconds"] + r["critic_update_seconds"] for r in steady)
    if "logprob_mismatch" in steady[0]:  # mean |trainer - engine| logprob per response token, over the steady steps
        out["logprob_mismatch"] = statistics.fmean(r["logprob_mismatch"] for r in steady)
    if out["train_s"] is not None:  # 1.0: a step costs only its longer phase (perfect overlap); ~2: none
        out["step_vs_longer_phase"] = out["s_per_step"] / max(out["generation_s"], out["train_s"])
    if expect_equal_work:
        out["equal_work_held"] = all(abs(r["response_len_mean"] - max_tokens) < 1e-6 for r in records)
    if run.cpu is not None:
        cpu_wall, cpu = run.cpu.usage(start, end)
        if cpu_wall > 0:
            out["cpu_s_per_step"] = {role: sec / cpu_wall * out["s_per_step"] for role, sec in sorted(cpu.items())}
            out["cores_busy"] = sum(cpu.values()) / cpu_wall
            if "controller" in cpu:
                out["control_plane_share"] = cpu["controller"] / cpu_wall
    return out


MEDIAN_KEYS = ("s_per_step", "samples_per_step", "samples_per_s", "tokens_per_s", "generation_s", "train_s", "sync_s",
               "critic_s", "response_len_mean", "step_vs_longer_phase", "cores_busy",
               "control_plane_share", "logprob_mismatch")  # fmt: skip


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def aggregate(rows: list[dict]) -> dict:
    """Medians over rounds per system, time/samples to target, and each relayrl variant against TRL (with several
    TRL modes, the fastest by median samples/s: ``trl_baseline``; the keys still read ``<system>/trl``)."""
    systems: dict[str, dict] = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        ok = [r for r in rows if r["system"] == system and "error" not in r]
        reached = [r["target"] for r in ok if r["target"]["reached"]]
        bests = [r["target"]["best_mean"] for r in ok if r["target"]["best_mean"] is not None]
        entry = {key: median_of(ok, key) for key in MEDIAN_KEYS if median_of(ok, key) is not None}
        entry |= {
            "rounds_ok": len(ok),
            "rounds_failed": sum(1 for r in rows if r["system"] == system and "error" in r),
            "target_reached_rounds": len(reached),
            "wall_s_to_target": statistics.median(t["wall_s"] for t in reached) if reached else None,
            "samples_to_target": statistics.median(t["samples"] for t in reached) if reached else None,
            "best_trailing_mean": max(bests, default=None),
        }
        systems[system] = entry
    ratios = {}
    trl_systems = [name for name in systems if name in TRL_MODES]
    baseline = max(trl_systems, key=lambda name: systems[name].get("samples_per_s") or 0.0, default="trl")
    trl = systems.get(baseline, {})
    for system, entry in systems.items():
        if system in TRL_MODES or not trl:
            continue
        ratios[f"{system}/trl"] = {
            "samples_per_s": _ratio(entry.get("samples_per_s"), trl.get("samples_per_s")),
            "samples_per_s_by_round": paired_ratios(rows, system, "samples_per_s", baseline),
            "response_len_vs_trl": _ratio(entry.get("response_len_mean"), trl.get("response_len_mean")),
            "tokens_per_s": _ratio(entry.get("tokens_per_s"), trl.get("tokens_per_s")),
            "step_speedup": _ratio(trl.get("s_per_step"), entry.get("s_per_step"))
            if entry.get("samples_per_step") == trl.get("samples_per_step")
            else None,  # a step is comparable only when both generate the same samples per step
            "wall_to_target_speedup": _ratio(trl.get("wall_s_to_target"), entry.get("wall_s_to_target")),
        }
    return {
        "systems": systems, "trl_baseline": baseline, "relayrl_vs_trl": ratios, "overlap": overlap(rows),
        "critic_vs_grpo": critic_cost(rows), "stream_vs_whole": stream_vs_whole(rows),
    }  # fmt: skip


OVERLAP_PAIRS = {  # K = 1 variant -> the K = 0 variant whose phases ran alone on the same cores, same work
    "relayrl-k1-rollout": "relayrl-k0-whole",
    "relayrl-k1-rollout-split": "relayrl-k0-split",
    "relayrl-k1-keep-kv": "relayrl-default",  # long-tail: in-flight updates against K = 0's phases
    "relayrl-k1-keep-kv-split": "relayrl-k0-split",
}


def overlap(rows: list[dict]) -> dict:
    """Per K = 1 variant of ``OVERLAP_PAIRS``, over the rounds where both ran: ``step_vs_phases_alone`` = its
    s/step / max(generation s, training s) of the K = 0 run of the same round (phases that alternate there, so
    each ran alone on the cores both have), and ``speedup_vs_k0`` = K = 0 s/step / K = 1 s/step; medians."""
    out = {}
    for k1, k0 in OVERLAP_PAIRS.items():
        pairs = same_round_pairs(rows, k1, k0)
        if not pairs:
            continue
        vs_alone = [a["s_per_step"] / max(b["generation_s"], b["train_s"]) for a, b in pairs]
        speedups = [b["s_per_step"] / a["s_per_step"] for a, b in pairs]
        out[k1] = {
            "phases_alone_from": k0,
            "step_vs_phases_alone": statistics.median(vs_alone),
            "speedup_vs_k0": statistics.median(speedups),
            "rounds": len(pairs),
        }
    return out


CRITIC_PAIRS = {"relayrl-k0-gae": "relayrl-k0-whole"}  # PPO with a critic -> the same run with GRPO


def critic_cost(rows: list[dict]) -> dict:
    """Per variant of ``CRITIC_PAIRS``, over the rounds where both ran: medians of its s/step and train s over
    GRPO's (``step_ratio``, ``train_ratio``) and of the critic's seconds per step (its forward and updates)."""
    out = {}
    for ppo, grpo in CRITIC_PAIRS.items():
        pairs = same_round_pairs(rows, ppo, grpo)
        if not pairs:
            continue
        out[ppo] = {
            "vs": grpo,
            "step_ratio": statistics.median(a["s_per_step"] / b["s_per_step"] for a, b in pairs),
            "train_ratio": statistics.median(a["train_s"] / b["train_s"] for a, b in pairs),
            "critic_s_per_step": statistics.median(a["critic_s"] for a, _ in pairs),
            "rounds": len(pairs),
        }
    return out


# streamed K = 0 -> the whole-batch K = 0 variant of its workload (long-tail's default trains whole batches)
STREAM_PAIRS = {"relayrl-k0-stream": ("relayrl-k0-whole", "relayrl-default")}


def stream_vs_whole(rows: list[dict]) -> dict:
    """Per streamed variant of ``STREAM_PAIRS``, over the rounds where its whole-batch partner ran: the whole-batch
    run's s/step over the streamed run's, per round and their median (> 1: streaming faster); the same for their
    median steps (``step_s_median``), which a burst of other load on a shared machine moves less."""
    out = {}
    for streamed, partners in STREAM_PAIRS.items():
        for whole in partners:
            if pairs := same_round_pairs(rows, streamed, whole):
                by_round = [b["s_per_step"] / a["s_per_step"] for a, b in pairs]
                medians = [b["step_s_median"] / a["step_s_median"] for a, b in pairs if a.get("step_s_median")]
                out[streamed] = {
                    "vs": whole,
                    "speedup_by_round": by_round,
                    "speedup": statistics.median(by_round),
                    "median_step_speedup_by_round": medians,
                    "median_step_speedup": statistics.median(medians) if medians else None,
                    "rounds": len(pairs),
                }
                break
    return out


def paired_ratios(rows: list[dict], system: str, key: str, trl_system: str = "trl") -> list[float]:
    """``system``'s ``key`` over ``trl_system``'s in each round both ran. A round's runs are the nearest in time, so
    these ratios drift less than the ratio of medians, which may pair one system's fast minutes with the other's
    slow."""
    pairs = same_round_pairs(rows, system, trl_system)
    return [run[key] / trl[key] for run, trl in pairs if run.get(key) and trl.get(key)]


def same_round_pairs(rows: list[dict], system: str, partner: str) -> list[tuple[dict, dict]]:
    """(``system``'s run, ``partner``'s run) of each round in which both ran without an error, in round order."""
    ok = {(r["system"], r["round"]): r for r in rows if "error" not in r}
    return [(run, ok[(partner, rnd)]) for (name, rnd), run in ok.items() if name == system and (partner, rnd) in ok]


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def machine(args: argparse.Namespace, cfgs: dict[str, RelayConfig]) -> dict:
    """The fairness record (relayrl/bench/record.py; each run's sides filled in as it ends) and the torch threads of
    each side."""
    return machine_record({}) | {
        "torch_threads": {
            "trl": args.trl_threads,
            **{f"{n}.relayrl.trainer": c.trainer.threads for n, c in cfgs.items()},
            **{f"{n}.relayrl.rollout": c.rollout.threads for n, c in cfgs.items()},
        },
    }


def model_facts(cfg: RelayConfig) -> dict:
    """The model's path, width, depth and vocabulary: from its config.json where the directory exists (a real
    model), else the tiny model's sizes the config builds it with."""
    config = Path(cfg.model.path) / "config.json"
    if config.is_file():
        hf = json.loads(config.read_text())
        return {"path": cfg.model.path, "hidden_size": hf.get("hidden_size"), "layers": hf.get("num_hidden_layers"),
                "vocab_size": hf.get("vocab_size")}  # fmt: skip
    return {"path": cfg.model.path, "hidden_size": cfg.model.tiny_hidden_size, "layers": cfg.model.tiny_layers}


def settings(wl: Workload, cfg: RelayConfig, args: argparse.Namespace) -> dict:
    """What both systems share, and how each gets equal work."""
    tokens = cfg.rollout.max_tokens
    out = {
        "config": str(wl.config),
        "overrides": wl.overrides,
        "variants": wl.variants,
        "model": model_facts(cfg),
        "prompts_per_step": cfg.controller.train_batch_groups,
        "n": cfg.rollout.n,
        "max_tokens": tokens,
        "optimizer_steps_per_batch": cfg.trainer.mini_batches,
        "lr": cfg.trainer.lr,
        "clip": [cfg.algorithm.clip_low, cfg.algorithm.clip_high],
        "loss": f"relayrl algorithm.loss_agg={cfg.algorithm.loss_agg}, dual-clip clip_c={cfg.algorithm.clip_c} "
        "(active only where the ratio exceeds it); TRL loss_type=dapo, no dual clip",
        "reward_fn": cfg.controller.reward.fn,
        "dynamic_sampling": f"relayrl {cfg.controller.dynamic_sampling}; TRL none",
        "relayrl_processes": {"rollout_workers": cfg.rollout.workers, "trainer_ranks": cfg.trainer.nproc},
        "trl": "GRPOTrainer, use_cpu, float32 (the trl-*bf16 systems: bf16=True), no gradient checkpointing, beta 0, "
        "constant lr, steps_per_generation "
        f"{cfg.trainer.mini_batches}, {args.trl_threads} torch threads",
        "budget": "TRL: the samples the round's relayrl run generated" if wl.samples_budget else "same steps",
        "warmup_steps": args.warmup,
        "target": {"trailing_mean_reward": args.target, "window": args.target_window},
    }
    if equal_work(cfg):
        out["equal_work"] = {
            "relayrl": "rollout.ignore_eos=true (EOS masked in the sampler, vLLM semantics)",
            "trl": f"generation_kwargs.min_new_tokens={tokens} (transformers masks EOS until then)",
            "checked": f"every step's response_len_mean == {tokens} in both systems (equal_work_held per run)",
        }
    return out


def run_bench(args: argparse.Namespace) -> dict:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="relayrl-bench-e2e-"))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    loads = select_variants([workload(name, args, workdir) for name in args.workloads], args.variants)
    if args.trl_systems is not None:
        loads = [replace(wl, trl_systems=args.trl_systems) for wl in loads]
    assets = [f"run.dir={workdir / 'assets'}"]
    cfgs = {
        wl.name: load_config(wl.config, [*UNMEASURED, *wl.overrides, *assets, f"run.name={wl.name}"]) for wl in loads
    }
    for wl in loads:
        check_mirrorable(cfgs[wl.name])
        prepare_workload(wl, cfgs[wl.name])
        prepare_assets(cfgs[wl.name])  # built once here, before any system runs, which all name the built paths
        wl.overrides.extend([f"model.path={cfgs[wl.name].model.path}", f"data.path={cfgs[wl.name].data.path}"])
    result = {"bench": "e2e", "workdir": str(workdir), "machine": machine(args, cfgs), "workloads": {}}
    for wl in loads:
        cfg = cfgs[wl.name]
        rows = []
        for rnd in range(1, args.rounds + 1):
            relayrl_samples = []
            for variant in wl.variants:
                progress(f"{wl.name} round {rnd}/{args.rounds}: relayrl {variant}")
                run = run_relayrl(wl, variant, rnd, workdir, args)
                result["machine"]["resolved"][run.log.stem] = run_sides(workdir / "runs" / run.log.stem / "logs")
                relayrl_samples.append(sum(r["samples_generated"] for r in run.records))
                rows.append(summarize(run, args, cfg.rollout.max_tokens, equal_work(cfg)))
            per_step = cfg.controller.train_batch_groups * cfg.rollout.n
            steps = cfg.trainer.steps
            if wl.samples_budget and max(relayrl_samples) > 0:
                steps = math.ceil(max(relayrl_samples) / per_step)
            for system in () if args.no_trl else wl.trl_systems:
                progress(f"{wl.name} round {rnd}/{args.rounds}: {system} ({steps} steps)")
                run = run_trl(wl, cfg, steps, rnd, workdir, args, system)
                result["machine"]["resolved"][run.log.stem] = trl_side(run.log)
                rows.append(summarize(run, args, cfg.rollout.max_tokens, equal_work(cfg)))
        result["workloads"][wl.name] = {"settings": settings(wl, cfg, args), "runs": rows, **aggregate(rows)}
    result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    return result


def progress(message: str) -> None:
    print(f"[bench e2e] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def format_table(result: dict) -> str:
    lines = []
    for name, wl in result["workloads"].items():
        lines.append(f"{name}: system | s/step | samples/s | tokens/s | gen s | train s | to target s | vs TRL")
        for system, entry in wl["systems"].items():
            ratio = wl["relayrl_vs_trl"].get(f"{system}/trl", {}).get("samples_per_s")
            cells = [entry.get(k) for k in ("s_per_step", "samples_per_s", "tokens_per_s", "generation_s", "train_s")]
            cells += [entry.get("wall_s_to_target"), ratio]
            lines.append(f"  {system} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in cells))
    return "\n".join(lines)


def failed(result: dict) -> list[str]:
    """Runs that failed or did not do equal work."""
    bad = []
    for name, wl in result["workloads"].items():
        for row in wl["runs"]:
            if "error" in row or row.get("equal_work_held") is False:
                bad.append(f"{name}/{row['system']}/round {row['round']}: {row.get('error', 'unequal work')}")
    return bad


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_bench(args)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    problems = failed(result)
    for problem in problems:
        print(f"relayrl bench e2e: {problem}", file=sys.stderr)
    return 1 if problems else 0
