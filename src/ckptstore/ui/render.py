"""Jinja2 rendering shared by the live app and the static report.

Templates and the stylesheet ship inside the package (``ckptstore/ui/templates``,
``ckptstore/ui/static``). The CSS is inlined into every page so a saved page or the static
report needs nothing else. Autoescaping is on: run names, tags and metric names come from
users and must never become markup.
"""

# ruff: noqa: E402  (the optional imports follow the check that names their extra)
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from ckptstore.extras import require

# Before the imports below, so that without the 'ui' extra the error names it.
require("jinja2", "HTML pages (ckpt ui, ckpt report)")

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from ckptstore.numeric import human_bytes, rounded
from ckptstore.ui.views import Links

__all__ = ["PACKAGE_DIR", "environment", "render"]

PACKAGE_DIR = Path(__file__).resolve().parent


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.0f} MB/s"


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


@functools.cache
def environment() -> Environment:
    """The template environment (created once per process)."""
    env = Environment(
        loader=FileSystemLoader(str(PACKAGE_DIR / "templates")),
        autoescape=select_autoescape(["html"], default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["bytes"] = human_bytes
    env.filters["when"] = _when
    env.filters["rate"] = _rate
    env.filters["tojson_pretty"] = _json
    env.filters["num"] = rounded
    env.globals["css"] = Markup((PACKAGE_DIR / "static" / "style.css").read_text("utf-8"))
    return env


def render(template: str, links: Links, **context: Any) -> str:
    """Render one template.

    Args:
        template: Template file name under ``templates/``.
        links: How pages link to each other.
        **context: Template variables (``page``, ``title``...).

    Returns:
        The HTML text.
    """
    return environment().get_template(template).render(links=links, **context)
