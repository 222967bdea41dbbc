"""The documentation site builds strictly (a warning, a broken link or anchor, a page outside the nav fails),
and its configuration reference lists exactly the keys of RelayConfig, nested and optional sections included."""

from __future__ import annotations

import importlib.util
import re
import textwrap
import typing
from pathlib import Path

from pydantic import BaseModel

from relayrl.config import RelayConfig

ROOT = Path(__file__).resolve().parents[2]


def models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in models_in(arg)]


def model_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every dotted key of ``model``, descending into sections (``Model``, ``Model | None``, ``list[Model]``)."""
    keys = set()
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        keys.add(key)
        for sub in models_in(info.annotation):
            keys |= model_keys(sub, f"{key}.")
    return keys


def test_the_configuration_reference_lists_every_key_of_relay_config(site: Path) -> None:
    page = (site / "configuration" / "index.html").read_text()
    listed = re.findall(r'class="config-key" data-key="([^"]+)"', page)
    assert len(listed) == len(set(listed)), "a key is listed twice"
    expected = model_keys(RelayConfig)
    assert {"rollout.limits.max_n", "trainer.wandb.project", "environment.max_turns"} <= expected
    assert set(listed) == expected, f"missing {expected - set(listed)}, extra {set(listed) - expected}"


def test_the_performance_page_shows_the_committed_bench_results(site: Path) -> None:
    page = (site / "performance" / "index.html").read_text()
    for source in (
        "e2e.json",
        "e2e-tta.json",
        "e2e-tta-avx512bf16.json",
        "e2e-tta-amx.json",
        "e2e-tta-epyc-avx2.json",
        "weightsync.json",
        "weightsync_verify.json",
        "controller.json",
        "rollout.json",
    ):
        assert f"bench/results/{source}" in page


def test_the_libraries_page_shows_the_humaneval_figures_from_their_json(site: Path) -> None:
    page = (site / "libraries" / "index.html").read_text()
    assert "bench/results/humaneval-smollm2.json" in page and "pass@1 through <code>relayrl eval</code>" in page


def load_hook(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_field_added_with_a_comment_is_documented_without_touching_the_generator(tmp_path, monkeypatch) -> None:
    """The generator reads the comment above a field, its trailing comment and Field(description=...)."""
    (tmp_path / "newconfig.py").write_text(
        textwrap.dedent('''
        from typing import Literal
        from pydantic import BaseModel, Field

        class Inner(BaseModel):
            """A section of its own."""
            depth: int = Field(3, ge=1, le=9)  # how deep

        class Outer(BaseModel):
            # the comment block above
            # runs over two lines
            mode: Literal["a", "b"] = "a"
            inner: Inner | None = None  # optional section
            size: float = Field(1.5, gt=0, description="from the description")
            name: str  # required, no default
            items: list[Inner] = []  # a list of sections
        ''')
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    newconfig = importlib.import_module("newconfig")
    page = load_hook("config_reference").render(newconfig.Outer)
    rows = {m.group(1): line for line in page.splitlines() if (m := re.search(r'data-key="([^"]+)"', line))}
    assert set(rows) == {"mode", "inner", "inner.depth", "size", "name", "items", "items.depth"}
    assert set(rows) == model_keys(newconfig.Outer)
    assert "the comment block above runs over two lines" in rows["mode"] and "'a' &#124; 'b'" in rows["mode"]
    assert "optional section" in rows["inner"] and "or `null`" in rows["inner"]
    assert "how deep" in rows["inner.depth"] and "≥ `1`" in rows["inner.depth"] and "≤ `9`" in rows["inner.depth"]
    assert "from the description" in rows["size"] and "> `0`" in rows["size"]
    assert "**required**" in rows["name"] and "required, no default" in rows["name"]
    assert "A section of its own." in page and "Optional section" in page
