"""metrics.jsonl (the source of truth), the reward curve PNG and the training metrics PNG.

metrics.jsonl holds two kinds of line: one per trainer step (``REQUIRED_KEYS``), and one per held-out eval of a set
at a policy version (``EVAL_KEYS``: ``eval`` names the set, ``step`` is the version it measured)."""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.runtime.files import atomic_write

REQUIRED_KEYS = (
    "step",
    "policy_version",
    "reward_mean",
    "rollout_version_min",
    "groups_kept",
    "groups_filtered",
    "gen_batches",
    "response_len_mean",
    "clip_frac",
    "kl",
    "entropy",
    "sync_seconds",
    "step_seconds",
    "samples_per_second",
)

EVAL_COLORS = ("tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
EVAL_KEYS = ("eval", "step", "policy_version", "prompts", "prompts_failed")


class MetricsWriter:
    """Appends one JSON object per step; on resume, drops lines past the resumed step (no repeats). ``required``: the
    keys every step line must hold (an RL run's ``REQUIRED_KEYS``)."""

    def __init__(self, path: Path, *, resume_step: int = 0, required: tuple[str, ...] = REQUIRED_KEYS) -> None:
        self.path, self.required = path, required
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_records(path) if r["step"] <= resume_step] if resume_step else []
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in kept))  # a crash keeps the old lines whole
        self._file = path.open("a", buffering=1)

    def write(self, record: dict) -> None:
        missing = [k for k in self.required if k not in record]
        if missing:
            raise KeyError(f"metrics record lacks {missing}")
        self._file.write(json.dumps(record) + "\n")

    def write_eval(self, record: dict) -> None:
        missing = [k for k in EVAL_KEYS if k not in record]
        if missing:
            raise KeyError(f"eval record lacks {missing}")
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def eval_record(result) -> dict:
    """A controller EvalResult as a metrics.jsonl eval line: the set, the version measured, its metrics."""
    return {
        "eval": result.name,
        "step": result.policy_version,
        "policy_version": result.policy_version,
        "prompts": result.prompts,
        "prompts_failed": result.prompts_failed,
        **dict(sorted(result.metrics.items())),
        "eval_seconds": result.seconds,
        "time": result.unix_time,
    }


def read_records(path: Path) -> list[dict]:
    """Every complete line of metrics.jsonl: step and eval records, in order. A last line without its newline is
    one the trainer is still writing (its readers run beside it: ``relayrl up``'s progress, the benches) or one a
    crash cut short: it is left out, for the next read."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def read_metrics(path: Path) -> list[dict]:
    """The step records of metrics.jsonl."""
    return [r for r in read_records(path) if "eval" not in r]


def read_evals(path: Path) -> list[dict]:
    """The eval records of metrics.jsonl (``eval``: the set, ``step``: the policy version measured)."""
    return [r for r in read_records(path) if "eval" in r]


def plot_rewards(metrics_path: Path, out_path: Path, title: str = "") -> Path | None:
    """reward_mean (and score_mean) per step, with a 10-step moving average, and each held-out set's mean@n by
    the policy version it measured; None without data."""
    records = read_metrics(metrics_path)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    window = 10
    smooth = [
        sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
        for i in range(len(rewards))
    ]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, rewards, color="tab:blue", alpha=0.35, label="reward_mean")
    ax.plot(steps, smooth, color="tab:blue", label=f"reward_mean ({window}-step mean)")
    if all("score_mean" in r for r in records) and any(r["score_mean"] != r["reward_mean"] for r in records):
        ax.plot(
            steps, [r["score_mean"] for r in records], color="tab:green", alpha=0.6, label="score_mean (task reward)"
        )
    for color, (name, (key, xs, ys)) in zip(EVAL_COLORS, eval_curves(read_evals(metrics_path)).items()):
        ax.plot(xs, ys, color=color, marker="o", label=f"held-out {name}: {key} (eval)")
    ax.set_xlabel("trainer step (= policy version)")
    ax.set_ylabel("mean reward (rollouts; held-out evals)")
    ax.set_title(title or metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.12, top=0.92)  # fixed: tight_layout draws every label twice
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


# metrics.png's panels: (metrics.jsonl key, title); a key no step recorded is left out, and ref_kl without a reference
# model (algorithm.kl_coef 0: it is 0 at every step). Each title names the key it plots.
TRAINING_PANELS = (
    ("loss", "policy loss"),
    ("ref_kl", "ref_kl: KL to the reference (k-estimator)"),
    ("ppo_kl", "ppo_kl: KL(old ‖ new) of the update"),
    ("distill/reverse_kl", "distill/reverse_kl: KL(student ‖ teacher) per token"),
    ("entropy", "token entropy"),
    ("response_len_mean", "mean response length (tokens)"),
    ("clip_frac", "clip fraction"),
    ("lr", "learning rate"),
)


def training_panels(
    records: list[dict], reference: bool = True, panels: tuple[tuple[str, str], ...] = TRAINING_PANELS
) -> list[tuple[str, str]]:
    """The ``panels`` some record holds, in order; ``reference``: the run has a reference model (else ref_kl
    is left out)."""
    return [(key, name) for key, name in panels if any(key in r for r in records) and (reference or key != "ref_kl")]


def plot_training(
    metrics_path: Path,
    out_path: Path,
    title: str = "",
    reference: bool = True,
    panels: tuple[tuple[str, str], ...] = TRAINING_PANELS,
    evals: bool = False,
) -> Path | None:
    """One panel per ``panels`` key (an RL run's TRAINING_PANELS) some step recorded, against the step, and with
    ``evals`` one per eval set (its ``eval_curves`` curve); None without data. ``reference``: the run has a
    reference model (``algorithm.kl_coef`` > 0)."""
    records = read_metrics(metrics_path)
    series = {key: [(r["step"], r[key]) for r in records if key in r] for key, _ in panels}
    panels = training_panels(records, reference, panels)
    for name, (key, xs, ys) in (eval_curves(read_evals(metrics_path)) if evals else {}).items():
        series[f"eval/{name}/{key}"] = list(zip(xs, ys))
        panels.append((f"eval/{name}/{key}", f"eval/{name}/{key} (held-out, rollout workers)"))
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 3
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(11, 3.2 * rows), dpi=110, squeeze=False)
    for ax, (key, name) in zip(axes.flat, panels):
        points = series[key]
        ax.plot(
            [p[0] for p in points], [p[1] for p in points], color="tab:blue", marker="." if len(points) < 30 else None
        )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    height = 3.2 * rows  # margins fixed in inches: tight_layout would draw every label twice to measure it
    fig.suptitle(title or metrics_path.parent.name, y=1 - 0.25 / height)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.5 / height, top=1 - 0.9 / height, wspace=0.3, hspace=0.6)
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def eval_curves(evals: list[dict]) -> dict[str, tuple[str, list[int], list[float]]]:
    """Set -> (its mean@n key, else its first pass@k, versions, values), in version order: the curves plotted beside
    the reward."""
    curves: dict[str, tuple[str, list[int], list[float]]] = {}
    for record in sorted(evals, key=lambda r: r["step"]):
        key = next((k for k in record if k.startswith("mean@")), None) or next(
            (k for k in record if k.startswith("pass@")), None
        )
        if key is None:
            continue
        _, xs, ys = curves.setdefault(record["eval"], (key, [], []))
        xs.append(record["step"])
        ys.append(record[key])
    return curves
