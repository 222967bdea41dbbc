"""The RL loop's held-out sets on ``relayrl train sft``'s checkpoints (its ``eval`` section, SFTEvalConfig).

At an evaluated step the trainer exports its weights (``export_hf``, collective) to ``<run dir>/eval_weights`` and
rank 0 runs ``relayrl eval CONFIG --checkpoint <that directory> --version STEP`` of the section's RL config (with
``model.path`` set to the SFT run's): the command a user runs, which serves the weights on a rollout worker process
and scores every eval set through the controller's evaluator (relayrl/ops/evaluate.py). Its results are the RL
run's eval lines (``eval``, ``step``, ``mean@1``, ``pass@1``, ...), written to the SFT run's metrics.jsonl as
``relayrl up`` writes them. The command's output goes to ``<run dir>/eval.log``; the export is removed after.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch.distributed as dist

from relayrl.config import ConfigError, RelayConfig, SFTConfig, load_config
from relayrl.trainer.backends.fsdp import FSDPBackend


def eval_overrides(cfg: SFTConfig) -> list[str]:
    """The RL config's overrides: the section's own, then model.path = the SFT run's (the weights it starts from)."""
    assert cfg.eval is not None
    return [*cfg.eval.set, f"model.path={cfg.model.path}"]


def load_eval_config(cfg: SFTConfig) -> RelayConfig:
    """The RL config the checkpoints are scored under; a ConfigError naming ``eval.config`` when it does not load or
    has no eval section."""
    assert cfg.eval is not None
    try:
        rl_cfg = load_config(cfg.eval.config, eval_overrides(cfg))
    except ConfigError as err:
        raise ConfigError(f"eval.config {cfg.eval.config}: {err}") from None
    if rl_cfg.eval is None:
        raise ConfigError(f"eval.config {cfg.eval.config}: the config has no eval section (the sets to score)")
    return rl_cfg


def exported_weights(directory: Path) -> Path:
    """What ``relayrl eval --checkpoint`` reads of an export: the merged model or the adapter of a LoRA run, else the
    directory itself."""
    for part in ("merged", "adapter"):
        if (directory / part).is_dir():
            return directory / part
    return directory


def score_checkpoint(cfg: SFTConfig, backend: FSDPBackend, tokenizer, step: int) -> list[dict]:
    """Each eval set's record (``eval_record``'s line, step = ``step``) for the weights the backend holds now, on rank
    0; [] on the other ranks (collective). A failed eval is a RuntimeError with the command's output tail."""
    assert cfg.eval is not None
    directory = cfg.run_dir / "eval_weights"
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    backend.export_hf(directory, tokenizer)
    records: list[dict] = []
    if dist.get_rank() == 0:
        report = cfg.run_dir / "eval_report.json"
        argv = [sys.executable, "-m", "relayrl.cli", "eval", cfg.eval.config, "--checkpoint"]
        argv += [str(exported_weights(directory)), "--version", str(step), "--out", str(report)]
        argv += [arg for override in eval_overrides(cfg) for arg in ("--set", override)]
        log_path = cfg.run_dir / "eval.log"
        with log_path.open("a") as log:
            log.write(f"step {step}: {' '.join(argv)}\n")
            log.flush()
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False)
        shutil.rmtree(directory, ignore_errors=True)
        if done.returncode != 0:
            tail = log_path.read_text()[-3000:]
            raise RuntimeError(f"relayrl eval of step {step} exited {done.returncode} ({log_path}):\n{tail}")
        records = list(json.loads(report.read_text())["results"].values())
        report.unlink()
    dist.barrier()
    return records
