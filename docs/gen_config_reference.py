"""Write the configuration reference (Markdown) from the config schema's field comments.

    python docs/gen_config_reference.py > /tmp/configuration.md

The site build calls :func:`render` (docs/mkdocs_hooks.py), so the page is never committed
and cannot drift: every key of :class:`verity.config.schema.VerityConfig` with its default
and the comment written beside it in the code — the same text ``verity config show``
prints (:func:`verity.config.describe.field_comments`) — plus the sections that the
recipe plug-ins installed in this environment add (``dapo:``, ``prime:``, ...).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

INTRO = """# Configuration reference

Every key of a run config, its default and what it means, generated from the comments
beside each field in the code (`packages/verity/src/verity/config/schema.py` and the
dataclasses it composes) when this site was built. `verity config show [SECTION]` prints
the same comments beside the values of *your* composed config (`--config FILE` and
overrides included), which is the one to trust for a given run: on the embedded model,
keys you leave unset take the toy world's `embedded-tiny` preset's settings (`verity.config.model_presets`;
`verity config show` marks them), and
the defaults below are those for a real checkpoint.

A config file is YAML starting with `defaults: [verity, _self_]`; overrides use Hydra's
grammar (`actor.optim.lr=1e-5`). Every key is checked before any worker starts: unknown
keys, keys this run would not read, bad values and batch arithmetic fail naming the key
([failures](failures.md)).
"""


def _escape(text: str) -> str:
    """Markdown table cell: code spans kept, elsewhere ``<``, ``>``, ``|`` and ``*`` escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part.replace("|", "\\|"))
        else:
            out.append(
                part.replace("&", "&amp;")
                .replace("<", "&lt;")
                .replace(">", "&gt;")
                .replace("|", "\\|")
                .replace("*", "\\*")
                .replace("_", "\\_")
            )
    return "".join(out)


def _value(value: Any) -> str:
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (int, float, str)):
        text = str(value) if not isinstance(value, str) or value else '""'
    else:
        text = json.dumps(value, default=str)
    return "`" + text.replace("|", "\\|") + "`" if "`" not in text else _escape(text)


def _rows(obj: Any, prefix: str) -> list[str]:
    from verity.config.describe import field_comments

    comments = field_comments(type(obj))
    rows: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        note = _escape(comments.get(f.name, ""))
        if dataclasses.is_dataclass(value):
            rows.append(f"| `{key}` | *(section)* | {note} |")
            rows.extend(_rows(value, key))
        else:
            rows.append(f"| `{key}` | {_value(value)} | {note} |")
    return rows


def _section(name: str, obj: Any, comment: str, provider: str | None) -> list[str]:
    lines = [f"## {name}", ""]
    if provider:
        lines += [f"Added by the plug-in `{provider}` (present when that package is installed).", ""]
    head = ["| key | default | meaning |", "|---|---|---|"]
    if not dataclasses.is_dataclass(obj):
        return [*lines, *head, f"| `{name}` | {_value(obj)} | {_escape(comment)} |", ""]
    if comment:
        lines += [_escape(comment), ""]
    return [*lines, *head, *_rows(obj, name), ""]


def render(plugin_prefix: str = "verity-recipe-") -> str:
    """The reference page; plug-in sections only from providers whose name starts with ``plugin_prefix``."""
    from verity.config.describe import field_comments
    from verity.config.schema import VerityConfig
    from verity.config.sections import CONFIG_SECTIONS
    from verity.plugins import load_plugins

    load_plugins()
    base = VerityConfig()
    comments = field_comments(VerityConfig)
    lines = [
        INTRO,
        "Sections: " + ", ".join(f"[`{f.name}`](#{f.name})" for f in dataclasses.fields(base)) + ".",
    ]
    plugin_specs = sorted(
        (spec for _, spec in CONFIG_SECTIONS.items() if (spec.provider or "").startswith(plugin_prefix)),
        key=lambda spec: spec.name,
    )
    if plugin_specs:
        lines[-1] += " Plug-in sections: " + ", ".join(f"[`{s.name}`](#{s.name})" for s in plugin_specs) + "."
    lines.append("")
    for f in dataclasses.fields(base):
        lines += _section(f.name, getattr(base, f.name), comments.get(f.name, ""), None)
    for spec in plugin_specs:
        lines += _section(spec.name, spec.cls(), "", spec.provider)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
