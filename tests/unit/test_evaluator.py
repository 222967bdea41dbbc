"""The controller's eval bookkeeping without workers: which versions are due, the hold on a later update, an eval
deferred while the batch trained from its version generates, results that survive a restart (not run again), a
rewind that voids later ones, and the results in Status's rendering, the Prometheus gauges and the PNG's curves."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from relayrl.client.workers import WorkerRegistry
from relayrl.config import load_config
from relayrl.controller.evaluation import Evaluator, _line
from relayrl.controller.latency import LatencyHistogram
from relayrl.models.assets import prepare_assets
from relayrl.ops.render import eval_rows
from relayrl.services.metrics import ControllerCollector
from relayrl.trainer.metrics import eval_curves
from relayrl.v1 import common_pb2, controller_pb2

ROOT = Path(__file__).resolve().parents[2]


def evaluator(tmp_path: Path, tiny_model_dir: Path, *sets: str) -> Evaluator:
    from transformers import AutoTokenizer

    cfg = load_config(
        ROOT / "examples" / "digits.yaml",
        [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", "eval.sets.heldout.path=builtin:digits-heldout",
         "eval.every=2", "trainer.steps=7", *sets],
    )  # fmt: skip
    prepare_assets(cfg)  # builtin:digits-heldout, written into the run's assets
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    return Evaluator(cfg, WorkerRegistry(30.0), AutoTokenizer.from_pretrained(tiny_model_dir), state)


def result(version: int, value: float = 0.5) -> controller_pb2.EvalResult:
    return controller_pb2.EvalResult(name="heldout", policy_version=version, metrics={"mean@1": value}, prompts=10)


def test_due_versions_hold_and_requests(tmp_path: Path, tiny_model_dir: Path) -> None:
    ev = evaluator(tmp_path, tiny_model_dir)
    assert [v for v in range(8) if ev.due(v)] == [0, 2, 4, 6, 7]  # before, every 2, the last step (7)
    later = evaluator(tmp_path, tiny_model_dir, "eval.before_train=false", "eval.after_train=false")
    assert [v for v in range(8) if later.due(v)] == [2, 4, 6]
    assert len(ev.sets[0].records) == 10 and ev.sets[0].records[3].prompt_id == "eval/heldout/3"
    ev.request(1)  # not due
    ev.request(2)
    ev.request(2)  # already queued
    assert ev.pending == 1
    assert ev.hold(3, timeout_s=0.05) == 2  # the update to version 3 waits for the eval of version 2
    assert ev.hold(2, timeout_s=0) is None  # an update to the version being evaluated (a joiner's push) does not


def test_the_pass_threshold_and_the_maj_extractor_follow_controller_reward_fns(tmp_path, tiny_model_dir) -> None:
    """Weights summing below 1 (0.6 + 0.2): a right answer scores 0.8, full marks, and passes (the threshold was 1.0,
    so pass@k was 0); maj@n votes with exact_match's extractor (the demo's fn, prefix_match, has none)."""
    from transformers import AutoTokenizer

    fns = "controller.reward.fns={exact_match: 0.6, prefix_match: 0.2}"
    ev = evaluator(tmp_path, tiny_model_dir, fns, "eval.metrics=[mean, pass, maj]")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    groups = []
    for record in ev.sets[0].records[:2]:
        answer = tokenizer(str(ev.scoring.scorer.row_of(record.prompt_id)["answer"]))["input_ids"]
        groups.append(ev.scoring.score(record, [common_pb2.Completion(token_ids=answer)]))
    assert [g.scores for g in groups] == [[0.8], [0.8]]
    metrics = ev.scoring.result("heldout", 0, groups, failed=0, seconds=1.0).metrics
    assert (metrics["mean@1"], metrics["pass@1"], metrics["maj@1"]) == (0.8, 1.0, 1.0)
    graded = evaluator(tmp_path, tiny_model_dir, fns, "eval.metrics=[pass]", "eval.pass_threshold=0.9")
    assert graded.scoring.result("heldout", 0, groups, failed=0, seconds=1.0).metrics["pass@1"] == 0.0


def test_a_deferred_eval_waits_holding_the_next_update_then_runs(tmp_path: Path, tiny_model_dir: Path) -> None:
    """While ``defer(v)`` (the batch trained from v generates) the eval of v waits, and the update to v + 1 is
    held all along: the eval still scores exactly version v, after that batch instead of beside it."""
    generating = threading.Event()
    generating.set()
    ev = evaluator(tmp_path, tiny_model_dir)
    ev.defer = lambda version: generating.is_set()
    ran = []
    ev._run = lambda eval_set, version, epoch: ran.append(version)
    ev.start()
    try:
        ev.request(0)
        assert ev.hold(1, timeout_s=0.5) == 0 and ran == []  # waiting, and the update to version 1 with it
        generating.clear()
        assert ev.hold(1, timeout_s=60) is None and ran == [0]
    finally:
        ev.stop()


def test_results_survive_a_restart_and_a_rewind_voids_later_ones(tmp_path: Path, tiny_model_dir: Path) -> None:
    ev = evaluator(tmp_path, tiny_model_dir)
    with ev.path.open("a") as f:  # as _run records them
        f.writelines(_line(result(version)) for version in (0, 2, 4))
    restarted = evaluator(tmp_path, tiny_model_dir)
    assert [r.policy_version for r in restarted.list()] == [0, 2, 4]
    restarted.request(2)  # done before the restart: not run again
    restarted.request(6)  # not done (a kill cut it, or it never started): run
    assert list(restarted._queue) == [6]
    restarted.rewind(2)  # the run went back to step 2: versions 4 and 6 will be trained again
    assert [r.policy_version for r in restarted.list()] == [0, 2] and not restarted._queue
    assert [r.policy_version for r in evaluator(tmp_path, tiny_model_dir).list()] == [0, 2]


def test_results_reach_status_prometheus_and_the_png_curves() -> None:
    status = controller_pb2.StatusResponse(run_name="r", evals=[result(4, 0.9)])
    assert eval_rows(status) == [("eval heldout", "version 4: mean@1 0.900")]
    controller = SimpleNamespace(
        status=lambda: status,
        batches_ready=0,
        syncs=SimpleNamespace(count={}, seconds={}),
        dispatcher=SimpleNamespace(generate_seconds=LatencyHistogram()),
    )
    registry = CollectorRegistry()
    registry.register(ControllerCollector(controller))
    text = generate_latest(registry).decode()
    assert 'relayrl_eval{metric="mean@1",set="heldout"} 0.9' in text
    assert 'relayrl_eval_policy_version{set="heldout"} 4.0' in text
    lines = [{"eval": "heldout", "step": v, "mean@1": m, "pass@1": m} for v, m in ((4, 0.9), (0, 0.1))]
    assert eval_curves(lines) == {"heldout": ("mean@1", [0, 4], [0.1, 0.9])}
