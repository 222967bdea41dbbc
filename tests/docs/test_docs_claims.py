"""Statements of the documentation that can be checked mechanically, checked: the configuration page shows each
key's comment as its source writes it, every SDK method the docs name exists, and every CLI exit code the docs
state is one a named test asserts."""

from __future__ import annotations

import html
import importlib.util
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from mkdocs.exceptions import PluginError

from relayrl.client import AsyncRelayClient, RelayClient
from relayrl.config import RelayConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def load_hook(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RowText(HTMLParser):
    """The visible text of each table row that holds a config key (``data-key``), by key."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, str] = {}
        self._row: list[str] | None = None
        self._key: str | None = None

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "tr":
            self._row, self._key = [], None
        elif tag == "span" and ("class", "config-key") in attrs:
            self._key = dict(attrs)["data-key"]

    def handle_endtag(self, tag) -> None:
        if tag == "tr" and self._row is not None and self._key is not None:
            self.rows[self._key] = " ".join("".join(self._row).split())
        if tag == "tr":
            self._row = None

    def handle_data(self, data) -> None:
        if self._row is not None:
            self._row.append(data)


def plain(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def test_the_configuration_page_shows_every_comment_as_its_source_writes_it(site: Path) -> None:
    """Nothing in a comment is taken for HTML and dropped (``<run dir>`` was), and no comment speaks of its place in
    the source ("checked below" was)."""
    hook = load_hook("config_reference")
    parser = RowText()
    parser.feed((site / "configuration" / "index.html").read_text())
    checked, tagged = 0, []
    for path, model, _ in hook.sections(RelayConfig):
        for name in model.model_fields:
            key = f"{path}.{name}" if path else name
            comment = plain(hook.field_comment(model, name))
            assert not re.search(r"\b(below|above)\b", comment), (key, comment)
            if comment:
                assert comment in parser.rows[key], (key, comment, parser.rows[key])
                checked += 1
                tagged += re.findall(r"<[a-z][a-z ]*>", comment)
    assert checked > 100 and "<run dir>" in tagged  # what an HTML parser would take for a tag is among them


def test_the_committed_configuration_page_is_current_with_relay_config() -> None:
    """The repository's docs/configuration.md lists every key as relayrl/config.py declares it now: a key added or
    changed without `make config-docs` fails here."""
    hook = load_hook("config_reference")
    text = hook.PAGE.read_text()
    assert text == hook.current(text), f"docs/configuration.md is not current: run `{hook.COMMAND}`"
    assert set(re.findall(r'class="config-key" data-key="([^"]+)"', text)) >= {"rollout.limits.max_n", "eval.every"}


def test_the_train_sft_reference_is_current_and_lists_every_key_of_sft_config() -> None:
    """docs/post-training.md's `relayrl train sft` keys are generated from SFTConfig like the run's reference."""
    from relayrl.config import SFTConfig

    hook = load_hook("config_reference")
    text = hook.SFT_PAGE.read_text()
    assert text == hook.current(text), f"docs/post-training.md is not current: run `{hook.COMMAND}`"
    listed = re.findall(r'class="config-key" data-key="([^"]+)"', text)
    expected = {
        f"{section}.{key}"
        for section in ("run", "data", "trainer")
        for key in SFTConfig.model_fields[section].annotation.model_fields
    }
    assert expected <= set(listed) and "trainer.batch_tokens" in listed and "trainer.stream" not in listed


def test_a_stale_configuration_page_fails_the_docs_build_naming_the_command() -> None:
    hook = load_hook("config_reference")
    stale = f"# Configuration reference\n\n{hook.BEGIN}\n| `run.name` | ... |\n{hook.END}\n"
    page = type("Page", (), {"file": type("File", (), {"src_path": "configuration.md"})})
    refusal = r"configuration\.md: the configuration reference is not current: run `make config-docs`"
    with pytest.raises(PluginError, match=refusal):
        hook.on_page_markdown(stale, page, None, None)
    assert hook.on_page_markdown(hook.current(stale), page, None, None) == hook.current(stale)


def test_every_sdk_method_the_docs_name_exists_on_both_clients() -> None:
    named = {m.group(1) for page in PAGES for m in re.finditer(r"\bclient\.(\w+)\(", page.read_text())}
    named |= {"pause", "unpause", "drain", "status", "submit"}  # the operator commands of the same name
    for name in sorted(named):
        assert callable(getattr(RelayClient, name, None)), f"RelayClient.{name}: named by the docs"
        assert callable(getattr(AsyncRelayClient, name, None)), f"AsyncRelayClient.{name}: named by the docs"
    public = {n for n in vars(RelayClient) if not n.startswith("_")}
    assert public == {n for n in vars(AsyncRelayClient) if not n.startswith("_")}  # "the same methods"


EXIT_CODE = re.compile(r"\bexit(?:s|ed|ing)?(?: with)?(?: code| status)? (\d+)\b", re.IGNORECASE)
# (page, a fragment of the statement's line, the code) -> the test that asserts it ("path::name substring");
# reliability.md's rows name their own test (their last column), read from the row
EXIT_CLAIMS = {
    ("configuration.md", "A bad config exits with status 2", "2"): "tests/unit/test_cli_refusals.py::yaml_syntax",
    ("engines.md", "Exit 0 pass, 1 a check failed, 2", "0"): "tests/unit/test_check_engine.py::passes_for_the_hf",
    ("environments.md", "exit code 2", "2"): "tests/integration/test_env_serve.py::bad_environment_name",
    ("operating.md", "Exit code 0: done; 1:", "0"): "tests/integration/test_operate_service.py::test_",
    ("operating.md", "exits 130 (128 + SIGINT", "130"): "tests/unit/test_cli_refusals.py::ctrl_c",
    ("operating.md", "SIGTERM (what an orchestrator sends) exits 0", "0"): "tests/integration/test_faults.py::sigterm",
    ("operating.md", "one line naming the key, exit 2", "2"): "tests/unit/test_cli_refusals.py::each_bad_start_up",
    ("operating.md", "the resume is refused (exit 2)", "2"): "tests/unit/test_cli_refusals.py::forgotten_set",
    ("operating.md", "Ctrl-C (exit 0)", "0"): "tests/integration/test_operate_scaling.py::drain_under_up",
    ("operating.md", "refused with exit code 3", "3"): "tests/integration/test_run_lock.py::second_up_is",
    ("operating.md", "`relayrl up` exits 2 naming the filesystem", "2"): "tests/unit/test_runlock.py::without_flock",
    ("post-training.md", "row and column, with exit status 2", "2"): "tests/unit/test_train_sft.py::bad_data_and",
    ("post-training.md", "row and the column (exit 2", "2"): "tests/unit/test_train_preference.py::bad_preference",
    ("post-training.md", "checkpoints it and exits 0", "0"): "tests/unit/test_train_sft.py::stopped_by_sigterm",
    ("post-training.md", "a run stopped by SIGTERM (exit 0", "0"): "tests/unit/test_train_sft.py::stopped_by_sigterm",
    ("quickstart.md", "naming the flag, exit 2", "2"): "tests/unit/test_cli_refusals.py::every_subcommand_refuses",
    ("rewards.md", "`relayrl up` exits 1", "1"): "tests/integration/test_reward_failures.py::raising_reward",
    ("reliability.md", "the role then exits with code 137", "137"): "tests/unit/test_faults.py::ledger_write_point",
}
NOT_CLAIMS = {("operating.md", "rollout-0 exited with code 1: OSError")}  # an example message, quoted


def exit_statements() -> list[tuple[str, str, str]]:
    """(page, line, code) of every statement of an exit code in the docs."""
    return [
        (page.name, line, m.group(1))
        for page in PAGES
        for line in page.read_text().splitlines()
        for m in EXIT_CODE.finditer(line)
    ]


def has_test(target: str) -> bool:
    """``path::fragment``: the test file exists and defines a test function whose name holds ``fragment``."""
    path, _, fragment = target.partition("::")
    source = (ROOT / path).read_text() if (ROOT / path).is_file() else ""
    return any(fragment in name for name in re.findall(r"^def (test\w+)", source, re.MULTILINE))


def row_test(line: str) -> str | None:
    """A reliability.md row's own test: the first ``pytest FILE -k WORD`` (or ``pytest FILE``) of its last column."""
    last = line.rstrip().rstrip("|").rsplit("|", 1)[-1]
    m = re.search(r"`pytest (tests/\S+\.py)(?: -k (\w+))?", last)
    return f"{m.group(1)}::{m.group(2) or 'test_'}" if m else None


def test_every_exit_code_the_docs_state_is_asserted_by_a_named_test() -> None:
    unmapped, missing = [], []
    for page, line, code in exit_statements():
        if any(page == p and fragment in line for p, fragment in NOT_CLAIMS):
            continue
        if page == "reliability.md" and (target := row_test(line)) is not None:
            targets = [target]
        else:
            targets = [t for (p, fragment, c), t in EXIT_CLAIMS.items() if p == page and fragment in line and c == code]
        if not targets:
            unmapped.append(f"{page}: exit {code}: {html.unescape(line.strip())[:160]}")
        missing += [t for t in targets if not has_test(t)]
    assert not unmapped, "exit codes stated in the docs with no test named in EXIT_CLAIMS:\n" + "\n".join(unmapped)
    assert not missing, f"tests named for the docs' exit codes that do not exist: {missing}"
