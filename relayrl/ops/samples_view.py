"""``relayrl samples --run runs/NAME``: the latest readable samples of a run, training and eval, as text or JSON.

Training samples come from ``samples.jsonl`` (the ``samples`` section: prompts as the user wrote them, their
answers, each sample's response, reward, advantage, finish reason), eval generations from ``eval_samples.jsonl``
(each eval set's latest version); ``--rendered`` shows each prompt as the model saw it too (its chat template)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from relayrl.config import ConfigError

TRAIN_FILE, EVAL_FILE = "samples.jsonl", "eval_samples.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest(run_dir: Path, step: int | None = None) -> list[dict]:
    """The training records of ``step`` (None: the last step written), then each eval set's latest version."""
    train = read_jsonl(run_dir / TRAIN_FILE)
    wanted = step if step is not None else max((r["step"] for r in train), default=None)
    chosen = [r for r in train if r["step"] == wanted]
    evals = read_jsonl(run_dir / EVAL_FILE)
    newest = {}
    for r in evals:
        newest[r["eval"]] = max(newest.get(r["eval"], r["step"]), r["step"])
    return chosen + [r for r in evals if r["step"] == newest[r["eval"]]]


def render(records: list[dict], rendered: bool = False) -> str:
    """Readable text: a heading per step or eval, each prompt as the user wrote it (and its answer, where the record
    has one), then each sample with its numbers and response; ``rendered``: each prompt as the model saw it too
    (chat template and all)."""
    lines: list[str] = []
    heading = None
    for r in records:
        title = (
            f"== training step {r['step']}" if r["kind"] == "train" else f"== eval {r['eval']} at version {r['step']}"
        )
        if title != heading:
            lines += [""] if lines else []
            lines.append(title)
            heading = title
        lines.append(
            f"prompt {r['prompt_id']}: {r['prompt']!r}" + (f" (answer {r['answer']!r})" if "answer" in r else "")
        )
        if rendered and "rendered_prompt" in r:
            lines.append(f"  as the model saw it: {r['rendered_prompt']!r}")
        for i, s in enumerate(r["samples"]):
            numbers = [f"reward {s['reward']:.3f}"]
            if "advantage" in s:
                numbers.append(f"advantage {s['advantage']:+.3f}")
            numbers.append(s["finish_reason"])
            if "policy_version" in s:
                numbers.append(f"v{s['policy_version']}")
            lines.append(f"  [{i}] {'  '.join(numbers)}")
            lines.append(f"      {s['response']!r}")
            for turn in s.get("turns", []):
                lines.append(f"      {turn.get('role', '?')}: {str(turn.get('content', ''))!r}")
    return "\n".join(lines)


def cmd_samples(args: argparse.Namespace) -> int:
    run_dir = Path(args.run)
    if not (run_dir / TRAIN_FILE).exists() and not (run_dir / EVAL_FILE).exists():
        raise ConfigError(
            f"--run: {run_dir} has no {TRAIN_FILE} or {EVAL_FILE} (set the samples or eval section of its config)"
        )
    records = latest(run_dir, args.step)
    print(json.dumps(records, indent=1) if args.json else render(records, args.rendered))
    return 0
