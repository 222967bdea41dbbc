"""``relayrl up --resume runs/NAME`` (or ``relayrl up CONFIG --resume``): continue a stopped run exactly as its
saved config says.

The resumed run's config is ``<run dir>/config.yaml``, the one it was started with: ``--resume RUN_DIR`` reads it
alone (plus ``--set``); ``CONFIG --resume`` checks the config given now (the file plus ``--set``) against it. Either
must agree with it on every key, except:

- keys in ``RESUME_SAFE_KEYS`` changed by an explicit ``--set``: applied, written into the saved config
  and logged, one line each, in ``<run dir>/resume.log``. The same change coming from the file alone is
  refused: it is exactly what a forgotten ``--set`` looks like. ``trainer.steps`` is safe only while the lr of
  every step still to train stays what it was (a constant schedule; a decay or ``warmup_ratio`` spans the steps,
  so a new count reshapes the lr of each remaining step): otherwise it needs ``--allow-change trainer.steps``;
- any other key changed by an explicit ``--set`` and named by ``--allow-change KEY`` (an lr lowered after the run
  diverged): applied and logged the same way, marked as allowed;
- ``controller.port: 0`` ("any free port"): the run keeps the port it recorded, so its address stays;
- the ``environment.servers`` addresses ``relayrl up`` appended for ``environment.serve``, and the
  ``scorers.<name>.servers`` addresses it appended for each scorer's ``replicas`` (it starts them anew).

Any other difference is refused, every differing key listed. A run directory without a saved config is no
run to resume; a run whose ``trainer.steps`` are all trained has nothing left to train.
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from relayrl.config import (
    ConfigError,
    RelayConfig,
    TrainerConfig,
    dump_config,
    flatten,
    load_config,
    parse_config,
)
from relayrl.runtime.files import atomic_write
from relayrl.trainer.metrics import read_metrics
from relayrl.trainer.schedule import lr_at

# Keys that may change when a run resumes (by an explicit --set): how long it trains, what it logs and where it
# reports, how its processes are kept alive; none changes what a step computes or how the data is drawn.
RESUME_SAFE_KEYS = (
    "trainer.steps",
    "trainer.checkpoint_every",
    "trainer.save_total_limit",
    "trainer.tensorboard",
    "trainer.wandb",
    "trainer.pull_timeout_s",
    "rollout.workers",
    "controller.host",
    "controller.port",
    "controller.worker_timeout_s",
    "controller.generate_timeout_s",
    "controller.shutdown_grace_s",
    "supervisor.max_restarts",
    "supervisor.backoff_s",
    "supervisor.backoff_max_s",
)
LOG_FILE = "resume.log"


def _under(key: str, section: str) -> bool:
    """``key`` is ``section`` or lies inside it, or ``section`` lies inside ``key`` (a leaf that became one)."""
    return key == section or key.startswith(section + ".") or section.startswith(key + ".")


def _set_keys(overrides: list[str]) -> list[str]:
    return [assignment.split("=", 1)[0].strip() for assignment in overrides]


def lr_reshaped(saved: TrainerConfig, steps: int, trained: int) -> str | None:
    """The first step still to train (``trained + 1`` .. ``steps``) whose lr changes when the saved run's
    ``trainer.steps`` becomes ``steps``, everything else kept (``lr_at``, which holds a decay's floor past the
    saved run's last step), as ``"step S trains at lr NEW instead of OLD"``; None when every one keeps its lr."""
    moved = saved.model_copy(update={"steps": steps})
    for step in range(trained + 1, steps + 1):
        old, new = lr_at(step, saved), lr_at(step, moved)
        if old != new:
            return f"step {step} trains at lr {new:.3g} instead of {old:.3g}"
    return None


def read_saved(run_dir: Path) -> RelayConfig:
    """The run's saved config; ConfigError naming ``--resume`` when there is no run to resume."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume: no run at {run_dir} (no {saved.name}); start it without --resume")
    return parse_config(yaml.safe_load(saved.read_text()) or {})


def resume_run(run_dir: Path, overrides: list[str], allowed: list[str] = ()) -> tuple[RelayConfig, list[str]]:
    """``--resume RUN_DIR``: ``resume_config`` of the run's saved config, where the run now is."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume: no run at {run_dir} (no {saved.name}); start it without --resume")
    where = [f"run.dir={run_dir.parent}", f"run.name={run_dir.name}"]
    return resume_config(saved, [*where, *overrides], allowed, from_saved=True)


def drop_launched_addresses(cfg: RelayConfig) -> None:
    """Remove from ``cfg`` the addresses ``relayrl up`` appended for the servers it started (``environment.serve``'s
    replicas, each scorer's ``replicas``): it starts them anew, on new ports."""
    if cfg.environment is not None and cfg.environment.serve:
        cfg.environment.servers = cfg.environment.servers[: -cfg.environment.replicas]
    for scorer in cfg.scorers.values():
        if scorer.replicas:
            scorer.servers = scorer.servers[: -scorer.replicas]


def resume_config(
    path: str | Path, overrides: list[str], allowed: list[str] = (), *, from_saved: bool = False
) -> tuple[RelayConfig, list[str]]:
    """The config to resume with and the changes it applies (``key: old -> new``); ConfigError listing every key
    that differs from the saved config and may not. ``allowed``: keys outside RESUME_SAFE_KEYS that an explicit
    ``--set`` may change too (``--allow-change``); ``from_saved``: ``path`` is the saved config itself, read where
    the run is now (its ``run.dir``/``run.name`` set by ``overrides``)."""
    given = load_config(path, overrides)
    saved = read_saved(given.run_dir)
    if from_saved:
        saved.run.dir, saved.run.name = given.run.dir, given.run.name  # the run is where it is now
    if given.controller.port == 0:
        given.controller.port = saved.controller.port
    for cfg in (saved, given) if from_saved else (saved,):
        drop_launched_addresses(cfg)
    old, new = flatten(saved.model_dump(mode="json")), flatten(given.model_dump(mode="json"))
    differing = sorted(key for key in old.keys() | new.keys() if old.get(key, None) != new.get(key, None))
    for key in allowed:
        if not any(_under(changed, key) for changed in differing):
            raise ConfigError(f"--allow-change {key}: the resume does not change it (give --set {key}=VALUE)")
    explicit = _set_keys(overrides)

    def may_change(key: str) -> bool:
        return any(_under(key, s) for s in explicit) and any(_under(key, k) for k in (*RESUME_SAFE_KEYS, *allowed))

    refused = [key for key in differing if not may_change(key)]
    trained = max((r["step"] for r in read_metrics(given.run_dir / "metrics.jsonl")), default=0)
    reshaped = lr_reshaped(saved.trainer, given.trainer.steps, trained) if "trainer.steps" in differing else None
    if reshaped and not refused and "trainer.steps" not in allowed:
        raise ConfigError(
            f"trainer.steps: {saved.trainer.steps} -> {given.trainer.steps} reshapes the lr of the steps still to "
            f"train (trainer.lr_schedule {saved.trainer.lr_schedule!r}, trainer.warmup_ratio "
            f"{saved.trainer.warmup_ratio} are spread over trainer.steps): {reshaped}; add --allow-change "
            "trainer.steps to accept it"
        )
    if refused:
        shown = ", ".join(f"{key} ({old.get(key)!r} in the run, {new.get(key)!r} now)" for key in refused)
        raise ConfigError(
            f"--resume: differs from {given.run_dir / 'config.yaml'} in {shown}; a resumed run keeps its saved "
            "config (the keys safe to change on resume, docs/operating.md, change by an explicit --set; any other "
            "by --set and --allow-change KEY)"
        )
    if given.trainer.steps <= trained:
        raise ConfigError(
            f"trainer.steps: {given.trainer.steps}, and the run has trained {trained} steps; "
            f"--set trainer.steps=N (N > {trained}) to train on"
        )
    unsafe = [key for key in differing if not any(_under(key, safe) for safe in RESUME_SAFE_KEYS)]
    if reshaped:
        unsafe.append("trainer.steps")
    return given, [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}" + (" (--allow-change)" if key in unsafe else "")
        for key in differing
    ]


def record_changes(cfg: RelayConfig, changes: list[str]) -> None:
    """Write the resumed config over the saved one and log ``changes`` in ``<run dir>/resume.log``."""
    atomic_write(cfg.run_dir / "config.yaml", dump_config(cfg))  # a crash keeps the saved config whole
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with (cfg.run_dir / LOG_FILE).open("a") as log:
        log.write(f"{stamp} resumed" + "".join(f"; {change}" for change in changes) + "\n")
