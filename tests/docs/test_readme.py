"""The README is a front page: short, every relative link resolves, its minimal config is a valid config, and
every figure in its numbers table links to a committed bench result."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from relayrl.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_readme_is_a_front_page() -> None:
    assert len(README.splitlines()) <= 250


def test_every_relative_link_of_the_readme_resolves() -> None:
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if "://" not in t]
    assert local, "no links found"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"links to missing files: {missing}"


def test_the_minimal_config_of_the_readme_is_valid() -> None:
    block = re.search(r"A minimal config.*?```yaml\n(.*?)```", README, re.S)
    assert block, "no minimal config block"
    cfg = parse_config(yaml.safe_load(block.group(1)))
    assert cfg.model.path and cfg.data.path


def test_every_figure_in_the_numbers_table_links_to_a_bench_result() -> None:
    section = README.split("## Current numbers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert rows
    for row in rows:
        result = row.split(" | ")[1]
        assert re.search(r"\[[^\]]*\d[^\]]*\]\(bench/results/", result), f"a result without a linked figure: {row}"
        unlinked = re.sub(r"\[[^\]]*\]\([^)]*\)", "", result)
        assert not re.search(r"\d", unlinked), f"a figure not linked to its JSON: {row}"


def json_value(path: str, keys: str) -> object:
    """The value at ``keys`` (dot-separated; list indices as numbers) in the JSON file ``path``."""
    value = json.loads((ROOT / path).read_text())
    for key in keys.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def test_every_linked_figure_is_what_its_json_holds() -> None:
    """A README figure links to its JSON with the key as the fragment: bench/results/X.json#a.b.c."""
    links = re.findall(r"\[([^\]]*)\]\((bench/results/[^)#]+\.json)(?:#([^)]*))?\)", README)
    assert links
    for text, path, keys in links:
        if text == Path(path).name:
            continue  # the file itself
        assert keys, f"[{text}]({path}) names no key of the JSON"
        value = json_value(path, keys)
        figure = re.search(r"\d[\d,]*(\.\d+)?", text)
        if figure:
            shown = figure.group(0).replace(",", "")
            decimals = len(shown.partition(".")[2])
            assert round(float(value), decimals) == float(shown), f"[{text}]: {path}#{keys} holds {value}"
