"""``relayrl eval CONFIG --checkpoint PATH``: the run's eval (its ``eval`` section) of one set of weights, without
training, as JSON.

``--checkpoint`` takes a trainer checkpoint (``runs/NAME/checkpoints/step_N``: converted to a Hugging Face
directory, labelled version N), an exported Hugging Face directory (``runs/NAME/final``, ``runs/NAME/best``), or a
LoRA adapter directory (merged onto ``model.path``). The weights are served by a rollout worker process this
command starts (``relayrl rollout serve``) and scored by the controller's evaluator (relayrl/controller/
evaluation.py): the same prompts, sampling and metrics as the in-run eval, so a greedy eval of step N reproduces
the run's eval of version N.
``--workers ADDR,...`` scores instead the version that running rollout workers hold now (a run's workers: its
current policy), which all must agree on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import grpc

from relayrl.config import ConfigError, RelayConfig, load_config


def checkpoint_kind(path: Path) -> str:
    """ "trainer" (a DCP checkpoint: its .metadata and trainer_state.json), "adapter" (a PEFT adapter), "hf" (a model
    directory, a Hugging Face ``Trainer`` checkpoint among them: it has a trainer_state.json of its own)."""
    if (path / "trainer_state.json").is_file() and (path / ".metadata").is_file():
        return "trainer"
    if (path / "adapter_config.json").is_file():
        return "adapter"
    if (path / "config.json").is_file():
        return "hf"
    raise ConfigError(
        f"--checkpoint: {path} is not a trainer checkpoint (.metadata, trainer_state.json), a Hugging Face model "
        "directory (config.json) or a LoRA adapter (adapter_config.json)"
    )


def hf_weights(cfg: RelayConfig, checkpoint: Path, workdir: Path) -> tuple[Path, int]:
    """A Hugging Face directory holding the checkpoint's weights, and the policy version they are (0 when the
    directory does not say)."""
    kind = checkpoint_kind(checkpoint)
    if kind == "hf":
        return checkpoint, _version_of(checkpoint)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    version = 0
    if kind == "adapter":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
        version = _version_of(checkpoint)
    else:
        if cfg.trainer.backend != "fsdp" or cfg.model.lora is not None:
            raise ConfigError(
                "--checkpoint: a trainer checkpoint is read for full-weight FSDP runs; give the run's exported "
                "directory instead (runs/NAME/final, or its adapter)"
            )
        import torch.distributed.checkpoint as dcp

        # the model's entries alone, read into its own tensors: the optimizer state (twice the model in AdamW's
        # float32 moments) and a critic stay on disk
        state = {"model": model.state_dict()}
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process, as meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
        model.load_state_dict(state["model"])
        version = json.loads((checkpoint / "trainer_state.json").read_text())["policy_version"]
    out = workdir / "model"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(cfg.model.path).save_pretrained(out)
    return out, version


def _version_of(directory: Path) -> int:
    """The version an export records (best/best.json), else 0."""
    marker = directory / "best.json"
    return json.loads(marker.read_text())["policy_version"] if marker.is_file() else 0


def evaluate(cfg: RelayConfig, workers: dict[str, str], worker_version: int, label: int) -> dict:
    """Every eval set scored on ``workers`` (id -> address) at ``worker_version``; the JSON report, each result and
    generation labelled with the policy version ``label`` (a worker this command started holds the checkpoint's
    weights as its version 0)."""
    from transformers import AutoTokenizer

    from relayrl.client.workers import WorkerRegistry
    from relayrl.controller.evaluation import Evaluator
    from relayrl.trainer.metrics import eval_record

    registry = WorkerRegistry(timeout_s=3600.0, max_in_flight=cfg.controller.worker_max_calls)
    for worker_id, address in workers.items():
        registry.register(worker_id, address, cfg.rollout.engine, worker_version)
    with tempfile.TemporaryDirectory() as state_dir:
        evaluator = Evaluator(cfg, registry, AutoTokenizer.from_pretrained(cfg.model.path), Path(state_dir))
        try:
            report: dict = {"policy_version": label, "results": {}, "generations": {}}
            for eval_set in evaluator.sets:
                measured = evaluator.measure(eval_set, worker_version, label=label)
                if measured is None:
                    raise RuntimeError(f"the eval of {eval_set.name} saw more than one policy version")
                result, samples = measured
                report["results"][eval_set.name] = eval_record(result)  # as the run's metrics.jsonl has it
                report["generations"][eval_set.name] = [
                    {**row, "samples": [{**s, "versions": [label]} for s in row["samples"]]} for row in samples
                ]
        finally:
            evaluator.stop()
    return report


def worker_versions(addresses: list[str]) -> dict[str, int]:
    """address -> the policy version the worker there reports (Stats)."""
    from relayrl.rpc.channels import open_channel
    from relayrl.v1 import rollout_pb2, rollout_pb2_grpc

    stats = rollout_pb2.StatsRequest()
    stubs = {a: rollout_pb2_grpc.RolloutServiceStub(open_channel(a)) for a in addresses}
    return {a: stub.Stats(stats, timeout=30).policy_version for a, stub in stubs.items()}


def cmd_eval(args: argparse.Namespace) -> int:
    from relayrl.models.assets import prepare_assets
    from relayrl.ops.preflight import check_eval

    cfg = load_config(args.config, args.set)
    if cfg.eval is None:
        raise ConfigError("eval: the config has no eval section (what to score and how)")
    if (args.checkpoint is None) == (args.workers is None):
        raise ConfigError("--checkpoint: give a checkpoint to score, or --workers to score what running workers hold")
    check_eval(cfg)  # on the sets as written: prepare_assets points a reasoning-gym: set at its generated file
    prepare_assets(cfg)
    if args.workers is not None:
        versions = worker_versions(args.workers.split(","))
        if len(set(versions.values())) != 1:
            raise ConfigError(f"--workers: they hold different policy versions {versions}: score one at a time")
        version = next(iter(versions.values()))
        report = evaluate(cfg, {f"worker-{i}": a for i, a in enumerate(versions)}, version, version)
    else:
        report = _evaluate_checkpoint(args, cfg, Path(args.checkpoint))
    text = json.dumps(report if args.generations else {k: v for k, v in report.items() if k != "generations"})
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def _evaluate_checkpoint(args: argparse.Namespace, cfg: RelayConfig, checkpoint: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="relayrl-eval-") as workdir:
        model_dir, version = hf_weights(cfg, checkpoint, Path(workdir))
        version = args.version if args.version is not None else version
        served = cfg.model_copy(deep=True)
        served.model.path = str(model_dir)
        address, worker = start_worker(args, model_dir, Path(workdir))
        try:
            import_evaluation()  # while the worker starts: seconds of imports each, on separate cores
            wait_for_worker(address, worker, Path(workdir))
            report = evaluate(served, {"eval-0": address}, 0, version)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
    report["checkpoint"] = str(checkpoint)
    return report


def import_evaluation() -> None:
    """The modules ``evaluate`` uses (transformers' tokenizers, the controller's evaluator)."""
    from transformers import AutoTokenizer  # noqa: F401

    from relayrl.controller.evaluation import Evaluator  # noqa: F401


def start_worker(args: argparse.Namespace, model_dir: Path, workdir: Path) -> tuple[str, subprocess.Popen]:
    """A rollout worker process (``relayrl rollout serve``, the run's own) serving ``model_dir`` started: the address
    it will serve on (``wait_for_worker``), and the process. Its log: ``workdir/rollout.log``."""
    from relayrl.runtime.ports import free_port

    address = f"127.0.0.1:{free_port()}"
    sets = [arg for s in [*args.set, f"model.path={model_dir}"] for arg in ("--set", s)]
    argv = [sys.executable, "-m", "relayrl.cli", "rollout", "serve", "--config", str(args.config), *sets]
    argv += ["--port", address.rpartition(":")[2], "--worker-id", "eval-0"]
    env = {k: v for k, v in os.environ.items() if k != "RELAYRL_CONTROLLER"}  # it registers with no controller
    log = (workdir / "rollout.log").open("w")
    return address, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for_worker(address: str, worker: subprocess.Popen, workdir: Path) -> None:
    """Until the worker ``start_worker`` started answers; RuntimeError with its log's tail if it exits first or
    takes over 600 s."""
    deadline = time.monotonic() + 600
    while True:
        try:
            worker_versions([address])
            return
        except grpc.RpcError:
            if worker.poll() is not None or time.monotonic() > deadline:
                worker.kill()
                tail = (workdir / "rollout.log").read_text()[-2000:]
                raise RuntimeError(f"the rollout worker did not start:\n{tail}") from None
            time.sleep(0.5)
