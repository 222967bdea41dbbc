"""metrics.jsonl (one line per trainer step; the source of truth), the reward curve PNG and the training metrics PNG."""

from __future__ import annotations

import json
from pathlib import Path

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


class MetricsWriter:
    """Appends one JSON object per step; on resume, drops lines past the resumed step (no repeats)."""

    def __init__(self, path: Path, *, resume_step: int = 0) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(path) if r["step"] <= resume_step] if resume_step else []
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = path.open("a", buffering=1)

    def write(self, record: dict) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise KeyError(f"metrics record lacks {missing}")
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_rewards(metrics_path: Path, out_path: Path, title: str = "") -> Path | None:
    """reward_mean (and score_mean) per step, with a 10-step moving average; None without data."""
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
    ax.set_xlabel("trainer step (= policy version)")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.set_title(title or metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


# metrics.png's panels: (metrics.jsonl key, title); a key no step recorded is left out
TRAINING_PANELS = (
    ("loss", "policy loss"),
    ("kl", "KL to the reference (k-estimator)"),
    ("entropy", "token entropy"),
    ("response_len_mean", "mean response length (tokens)"),
    ("clip_frac", "clip fraction"),
    ("lr", "learning rate"),
)


def training_panels(records: list[dict]) -> list[tuple[str, str]]:
    """The TRAINING_PANELS some record holds, in order."""
    return [(key, name) for key, name in TRAINING_PANELS if any(key in r for r in records)]


def plot_training(metrics_path: Path, out_path: Path, title: str = "") -> Path | None:
    """One panel per TRAINING_PANELS key some step recorded, against the step; None without data."""
    records = read_metrics(metrics_path)
    panels = training_panels(records)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 3
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(11, 3.2 * rows), dpi=110, squeeze=False)
    for ax, (key, name) in zip(axes.flat, panels):
        points = [(r["step"], r[key]) for r in records if key in r]
        ax.plot(
            [p[0] for p in points], [p[1] for p in points], color="tab:blue", marker="." if len(points) < 30 else None
        )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title or metrics_path.parent.name)
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return out_path
