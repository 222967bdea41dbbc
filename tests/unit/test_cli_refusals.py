"""What `relayrl` refuses before it starts anything, as a user meets it: exit code 2 and one stderr line that
names the key or flag; no run directory and nothing built left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from relayrl.config import dump_config, load_config

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "digits.yaml"


def relayrl(*argv: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run ``relayrl ARGV``; asserts exit code 2 and exactly one line on stderr, and returns that line."""
    done = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:], done.stdout[-1000:])
    return lines[0]


def saved_run(tmp_path: Path, *sets: str) -> Path:
    """A stopped run of the demo config: its run directory with the saved config and 3 steps of metrics."""
    cfg = load_config(DEMO, [f"run.dir={tmp_path / 'runs'}", "run.name=try", *sets])
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text(dump_config(cfg))
    (cfg.run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in (1, 2, 3)))
    return cfg.run_dir


def test_resume_with_a_forgotten_set_is_refused_naming_the_key(tmp_path: Path) -> None:
    run_dir = saved_run(tmp_path, "trainer.steps=2000")
    saved = (run_dir / "config.yaml").read_text()
    base = ["up", str(DEMO), "--set", f"run.dir={tmp_path / 'runs'}", "--set", "run.name=try", "--resume"]
    line = relayrl(*base)
    assert "trainer.steps (2000 in the run, 200 now)" in line and "--resume" in line
    # a key that is not safe to change is refused even when set explicitly; every differing key is listed
    line = relayrl(*base, "--set", "trainer.lr=0.1", "--set", "rollout.n=8", "--set", "trainer.steps=2000")
    differing = line.split(" in ", 1)[1].split("; ")[0]
    assert "trainer.lr (0.002 in the run, 0.1 now)" in differing and "rollout.n (16 in the run, 8 now)" in differing
    assert "trainer.steps" not in differing
    # a safe key set explicitly passes this check; fewer steps than trained is refused
    assert relayrl(*base, "--set", "trainer.steps=2").startswith("relayrl: config error: trainer.steps: 2, and ")
    assert (run_dir / "config.yaml").read_text() == saved and not (run_dir / "resume.log").exists()


def test_resume_of_a_run_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    line = relayrl("up", str(DEMO), "--set", f"run.dir={tmp_path / 'runs'}", "--set", "run.name=nope", "--resume")
    assert "--resume: no run at" in line and "nope" in line
    assert not (tmp_path / "runs").exists()


def test_a_safe_change_on_resume_is_recorded_in_the_run(tmp_path: Path) -> None:
    from relayrl.ops.resume import record_changes, resume_config

    run_dir = saved_run(tmp_path, "trainer.steps=20", "controller.port=43210")  # the port its start chose
    sets = [f"run.dir={tmp_path / 'runs'}", "run.name=try", "trainer.steps=30", "controller.port=0"]
    cfg, changes = resume_config(DEMO, sets)
    assert changes == ["trainer.steps: 20 -> 30"] and cfg.controller.port == 43210  # its address stays
    record_changes(cfg, changes)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["steps"] == 30
    assert (run_dir / "resume.log").read_text().strip().endswith("resumed; trainer.steps: 20 -> 30")


def test_the_removed_build_if_missing_keys_name_their_replacement(tmp_path: Path) -> None:
    for key, replacement in [
        ("model.build_tiny_if_missing", "model.path: builtin:tiny-qwen2"),
        ("data.generate_digits_if_missing", "data.path: builtin:digits"),
    ]:
        line = relayrl("up", str(DEMO), "--set", f"run.dir={tmp_path / 'runs'}", "--set", f"{key}=true")
        assert line.startswith(f"relayrl: config error: {key}: removed; write {replacement}")
    assert not (tmp_path / "runs").exists()


def test_a_mistyped_data_path_in_a_copy_of_the_demo_builds_nothing(tmp_path: Path) -> None:
    raw = yaml.safe_load(DEMO.read_text())
    raw["run"]["dir"] = str(tmp_path / "runs")
    for path, expected in [("builtin:digit", "data.path: unknown built-in 'builtin:digit'")]:
        raw["data"]["path"] = path
        config = tmp_path / "mine.yaml"
        config.write_text(yaml.safe_dump(raw))
        assert expected in relayrl("up", str(config), cwd=tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.yaml"]  # no run directory, no data, no model
