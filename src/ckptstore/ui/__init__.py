"""The catalog browser (``ckpt ui``) and the static HTML report (``ckpt report --html FILE``).

Read-only, server-rendered HTML (Jinja2 templates shipped in this package) with inline SVG
plots and lineage graphs: no JavaScript and no external resources. The live app needs
FastAPI and uvicorn (``pip install 'ckptstore[ui]'``); the static report needs only Jinja2.
Import :mod:`ckptstore.ui.app` or :mod:`ckptstore.ui.report` for the entry points; this
package itself imports neither FastAPI nor the store.
"""

from __future__ import annotations

__all__: list[str] = []
