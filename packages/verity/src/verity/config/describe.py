"""Show a run config as commented YAML: every key, its value and the comment that explains it.

The explanations are the comments written beside (or just above) each field in the
dataclasses (:mod:`verity.config.schema`, the algorithm and engine configs, plug-in
sections), so the help a user reads is the text the code's authors maintain, and it
cannot drift from the defaults: the values shown are those of the composed config.

    print(describe_config(load_config(["actor.optim.lr=1e-5"]), section="actor"))
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import re
import tokenize
from functools import cache
from typing import Any

__all__ = ["describe_config", "field_comments"]

_FIELD = re.compile(r"^\s+([A-Za-z_]\w*)\s*:")


@cache
def field_comments(cls: type) -> dict[str, str]:
    """``{field name: comment}`` from the source of the dataclass ``cls`` (and its bases).

    A field's comment is its trailing ``# ...``, or the comment lines just above it, or
    its entry in the class docstring's ``Attributes:`` section. Fields without any are
    left out.
    """
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        found.update(_docstring_attributes(klass.__doc__ or ""))
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue  # built at run time (no source): no comments
        found.update(_comments_in(source))
    return found


def _docstring_attributes(doc: str) -> dict[str, str]:
    """``name: text`` entries of a Google-style ``Attributes:`` section (``a / b: text`` names both)."""
    lines = inspect.cleandoc(doc).splitlines()
    if "Attributes:" not in [line.strip() for line in lines]:
        return {}
    start = [line.strip() for line in lines].index("Attributes:") + 1
    entries: list[tuple[list[str], list[str]]] = []
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            break  # the next section
        entry = re.match(r"^\s{2,6}([\w /]+):\s*(.*)$", line)
        if entry and not line.startswith(" " * 8):
            names = [n.strip() for n in entry.group(1).split("/") if n.strip()]
            entries.append((names, [entry.group(2).strip()]))
        elif entries and line.strip():
            entries[-1][1].append(line.strip())
    return {name: " ".join(text) for names, text in entries for name in names}


def _comments_in(source: str) -> dict[str, str]:
    trailing: dict[int, str] = {}
    standalone: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            line = tok.start[0]
            before = source.splitlines()[line - 1][: tok.start[1]]
            (standalone if not before.strip() else trailing)[line] = text
    out: dict[str, str] = {}
    for number, line in enumerate(source.splitlines(), start=1):
        match = _FIELD.match(line)
        if not match or line.strip().startswith(("def ", "class ", "#")):
            continue
        if number in trailing:
            out[match.group(1)] = trailing[number]
            continue
        above, k = [], number - 1
        while k in standalone:
            above.insert(0, standalone[k])
            k -= 1
        if above:
            out[match.group(1)] = " ".join(above)
    return out


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value) if (not value or re.search(r"[:#\[\]{},&*!|>'\"%@`\s]", value)) else value
    return json.dumps(value, default=str)


def _lines(obj: Any, indent: int, prefix: str = "", marks: dict[str, str] | None = None) -> list[str]:
    """``obj``'s keys as commented YAML; ``marks``: dotted key -> a note put before its comment."""
    comments = field_comments(type(obj))
    out: list[str] = []
    pad = "  " * indent
    marks = marks or {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        note = comments.get(f.name)
        if dataclasses.is_dataclass(value):
            if note:
                out.append(f"{pad}# {note}")
            out.append(f"{pad}{f.name}:")
            out.extend(_lines(value, indent + 1, f"{prefix}{f.name}.", marks))
        else:
            text = f"{pad}{f.name}: {_scalar(value)}"
            mark = marks.get(prefix + f.name)
            note = f"[{mark}] {note}" if mark and note else mark or note
            out.append(f"{text}  # {note}" if note else text)
    return out


def describe_config(cfg: Any, section: str | None = None) -> str:
    """The config (or one dotted ``section`` of it, e.g. ``actor.optim``) as commented YAML.

    A key that a model preset set (:mod:`verity.config.model_presets`) says so in its comment
    (``[preset embedded-tiny]``); when the part shown holds such a key, a first line names the
    preset and every key it set.
    """
    from verity.config.model_presets import preset_layer

    layer = preset_layer(cfg)
    marks = {key: f"preset {layer.name}" for key in layer.applied} if layer is not None else {}
    shown = f"{section}." if section else ""
    held = any(key == section or key.startswith(shown) for key in marks)
    header = [f"# {layer.describe()}"] if layer is not None and (held or not section) else []
    node, name = cfg, None
    if section:
        for part in section.split("."):
            if not dataclasses.is_dataclass(node) or not hasattr(node, part):
                known = (
                    ", ".join(f.name for f in dataclasses.fields(node))
                    if dataclasses.is_dataclass(node)
                    else ""
                )
                raise KeyError(f"no config key {section!r}" + (f"; keys here: {known}" if known else ""))
            node, name = getattr(node, part), part
    if not dataclasses.is_dataclass(node):
        mark = marks.get(section or "")
        return f"{section}: {_scalar(node)}" + (f"  # [{mark}]" if mark else "")
    if name is None:
        return "\n".join([*header, *_lines(node, 0, "", marks)])
    return "\n".join([*header, f"{section}:", *_lines(node, 1, f"{section}.", marks)])
