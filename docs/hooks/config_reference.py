"""The configuration reference, generated from the pydantic models of ``relayrl/config.py`` into
``docs/configuration.md``, so that the repository's copy of the page lists every key, as the built site does.

``python docs/hooks/config_reference.py`` (``make config-docs``) rewrites the part of the page between the lines
``BEGIN`` and ``END``: one table per section of ``RelayConfig`` (nested and optional sections included), every key
with its type, default, constraints and comment; likewise ``SFTConfig`` (``relayrl train sft``) into
``docs/post-training.md`` between ``SFT_BEGIN`` and ``SFT_END``. As a build hook it refuses a page that is not
current, so a key added without regenerating fails ``make docs`` and ``tests/docs``.

The comment of a field is what its source says about it: the ``# ...`` comment block right above it, its trailing
``# ...`` comment and ``Field(description=...)``, read from the class's source with ``ast`` and ``tokenize``, so a
field added with a comment appears here without touching this file.
"""

from __future__ import annotations

import argparse
import ast
import enum
import html
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from functools import cache
from pathlib import Path

from mkdocs.exceptions import PluginError
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
COMMAND = "make config-docs"
BEGIN = f"<!-- config-reference: generated from relayrl/config.py by `{COMMAND}`; do not edit by hand -->"
END = "<!-- /config-reference -->"
# `relayrl train sft`'s config (SFTConfig), documented on the page of the offline stages
SFT_PAGE = ROOT / "docs" / "post-training.md"
SFT_BEGIN = f"<!-- config-reference of SFTConfig: generated from relayrl/config.py by `{COMMAND}`; do not edit -->"
SFT_END = "<!-- /config-reference of SFTConfig -->"
# `relayrl train dpo` and `train rm` take SFTConfig's sections (their data without SFT's two mask keys) and a loss
# section each, documented on the same page
DPO_BEGIN = f"<!-- config-reference of DPOConfig.loss: generated from relayrl/config.py by `{COMMAND}`; do not edit -->"
DPO_END = "<!-- /config-reference of DPOConfig.loss -->"
RM_BEGIN = f"<!-- config-reference of RMConfig.loss: generated from relayrl/config.py by `{COMMAND}`; do not edit -->"
RM_END = "<!-- /config-reference of RMConfig.loss -->"
# (begin, end, the model's name in relayrl/config.py, its sections' heading level, the key it sits under)
REGIONS = (
    (BEGIN, END, "RelayConfig", 2, ""),
    (SFT_BEGIN, SFT_END, "SFTConfig", 3, ""),
    (DPO_BEGIN, DPO_END, "PreferenceLossConfig", 4, "loss"),
    (RM_BEGIN, RM_END, "RewardLossConfig", 4, "loss"),
)
CONSTRAINTS = {
    "gt": ">",
    "ge": "≥",
    "lt": "<",
    "le": "≤",
    "multiple_of": "multiple of",
    "min_length": "min length",
    "max_length": "max length",
    "pattern": "matches",
}


def on_page_markdown(markdown: str, page, config, files) -> str:  # mkdocs hook
    if any(begin in markdown for begin, *_ in REGIONS) and markdown != current(markdown):
        raise PluginError(f"{page.file.src_path}: the configuration reference is not current: run `{COMMAND}`")
    return markdown


def current(text: str) -> str:
    """``text`` with each part between a ``REGIONS`` pair of lines rendered anew from this tree's model of it
    (``RelayConfig`` between ``BEGIN`` and ``END``); ValueError for a page with none."""
    sys.path.insert(0, str(ROOT))  # document this tree's relayrl, whichever one the venv installed
    import relayrl.config

    found = False
    for begin_line, end_line, root, level, prefix in REGIONS:
        head, begin, rest = text.partition(begin_line)
        _, end, tail = rest.partition(end_line)
        if begin and end:
            found = True
            text = f"{head}{begin}\n\n{render(getattr(relayrl.config, root), level, prefix)}\n{end}{tail}"
    if not found:
        raise ValueError(f"the page lacks the lines {BEGIN!r} and {END!r} between which the reference goes")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description="Rewrite the configuration references of the docs.")
    parser.parse_args()
    for page in (PAGE, SFT_PAGE):
        text = page.read_text()
        updated = current(text)
        page.write_text(updated)
        print(f"{page.relative_to(ROOT)}: {'rewritten' if updated != text else 'already current'}")


# -- reading the models ------------------------------------------------------------------------------------------


def sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel], bool]]:
    """(dotted path, model, optional) of ``model`` and of every section below it, depth first."""
    out = [(prefix, model, False)]
    for name, info in model.model_fields.items():
        for sub in sub_models(info.annotation):
            path = f"{prefix}.{name}" if prefix else name
            rows = sections(sub, path)
            rows[0] = (path, sub, allows_none(info.annotation))
            out += rows
    return out


def sub_models(annotation: object) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds values of (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``):
    their keys are listed under the field's key."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in sub_models(arg)]


def allows_none(annotation: object) -> bool:
    return type(None) in typing.get_args(annotation)


def type_name(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(
            repr(a) if not isinstance(a, enum.Enum) else repr(a.value) for a in typing.get_args(annotation)
        )
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def default_text(info: FieldInfo) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "**required**"
    value = info.default_factory() if info.default_factory is not None else info.default
    return "its defaults" if isinstance(value, BaseModel) else f"`{yaml_text(value)}`"


def yaml_text(value: object) -> str:
    """A default as it is written in the YAML file: null, true, 1e-06, [0.9, 0.999], auto."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, enum.Enum):
        value = value.value
    return json.dumps(value) if not isinstance(value, str) else value


def constraints(info: FieldInfo) -> str:
    found = []
    for meta in info.metadata:
        for attr, sign in CONSTRAINTS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} `{value}`")
    return ", ".join(found)


@cache
def class_source(cls: type) -> tuple[ast.ClassDef, list[str], dict[int, str]] | None:
    """The class's ast node, its module's lines and the ``# comment`` on each line (line number -> text)."""
    try:
        path = Path(inspect.getsourcefile(cls) or "")
        source = path.read_text()
    except (OSError, TypeError):
        return None
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node, source.splitlines(), comments
    return None


def field_comment(model: type[BaseModel], name: str) -> str:
    """The comment block above the field, its trailing comment and its description, joined."""
    info = model.model_fields[name]
    parts = []
    for cls in model.__mro__:
        found = class_source(cls) if "__annotations__" in vars(cls) and name in vars(cls)["__annotations__"] else None
        if found is None:
            continue
        node, lines, comments = found
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                above, line = [], stmt.lineno - 1
                while line >= 1 and lines[line - 1].strip().startswith("#"):
                    above.insert(0, comments[line])
                    line -= 1
                parts += above
                parts += [
                    comments[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in comments
                ]
        break
    if info.description:
        parts.append(info.description)
    return " ".join(p for p in parts if p and p != "fmt: skip")


def class_doc(model: type[BaseModel]) -> str:
    doc = inspect.getdoc(model) if "__doc__" in vars(model) and model.__doc__ else ""
    return doc or ""


# -- rendering ---------------------------------------------------------------------------------------------------


def cell(text: str) -> str:
    """Table-safe: no newline, no bare pipe (Markdown's column separator)."""
    return text.replace("\n", " ").replace("|", "\\|")


def prose(text: str) -> str:
    """Source text shown as written: ``<`` ``>`` ``&`` outside `code` spans escaped, so that ``<run dir>`` is not
    taken for an HTML tag and dropped (inside a code span Markdown escapes them itself)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else html.escape(part, quote=False) for part in parts)


def code_cell(text: str) -> str:
    return f"<code>{html.escape(text, quote=False)}</code>".replace("|", "&#124;")


def render(root: type[BaseModel], level: int = 2, prefix: str = "") -> str:
    """One table per section of ``root`` (its keys under ``prefix``), each under a heading of ``level``."""
    out = []
    for path, model, optional in sections(root, prefix):
        out.append(f"{'#' * level} {f'`{path}`' if path else 'Top level'}\n")
        doc = class_doc(model)
        if doc:
            out.append(prose(doc.replace("``", "`")) + "\n")
        if optional:
            out.append(f"Optional section: absent (`null`) unless the config has `{path}:`.\n")
        out.append("| key | type | default | constraints | description |")
        out.append("|---|---|---|---|---|")
        for name, info in model.model_fields.items():
            key = f"{path}.{name}" if path else name
            nested = sub_models(info.annotation)
            key_id = "" if nested else f' id="{anchor(key)}"'  # a section's anchor is its heading
            key_cell = f'<span class="config-key" data-key="{key}"{key_id}></span>`{key}`'
            type_text = code_cell(type_name(info.annotation))
            comment = field_comment(model, name)
            if nested:
                link = f"(#{heading_anchor(key)})"
                type_text = f"[section]{link}" + (" or `null`" if allows_none(info.annotation) else "")
                if not (isinstance(info.annotation, type) or allows_none(info.annotation)):
                    type_text = f"{typing.get_origin(info.annotation).__name__} of [sections]{link}"
                comment = comment or class_doc(nested[0]).split("\n\n")[0].replace("``", "`")
            out.append(
                f"| {key_cell} | {type_text} "
                f"| {cell(default_text(info))} | {cell(constraints(info))} | {cell(prose(comment))} |"
            )
        out.append("")
    return "\n".join(out)


def anchor(key: str) -> str:
    """A key's own anchor: ``#rollout.limits.max_n``."""
    return re.sub(r"[^a-z0-9_.-]", "-", key.lower())


def heading_anchor(path: str) -> str:
    """The anchor both MkDocs and GitHub give the heading `` `rollout.limits` ``: ``#rolloutlimits`` (lower case,
    punctuation other than ``-`` and ``_`` dropped), so a section link works on the site and in the repository."""
    return re.sub(r"[^\w\- ]", "", path.lower()).replace(" ", "-")


if __name__ == "__main__":
    main()
