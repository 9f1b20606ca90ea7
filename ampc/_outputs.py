"""Writing a report out: a right-aligned text table, numbers formatted or a dash, and the
files (STEM.txt, STEM.json and, with matplotlib, STEM.png) that validate's and the demo's
reports both write. matplotlib is optional: without it no picture is drawn."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Right-aligned columns under a header, separated by ' | '."""
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value, spec=".4f", none="-"):
    if value is None:
        return none
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


NO_MATPLOTLIB = "matplotlib is not installed: no picture (pip install matplotlib)"


def write_outputs(out_dir, stem, text, data, draw):
    """Writes STEM.txt, STEM.json and, with matplotlib, STEM.png (``draw(plt, path)``).
    Returns {"txt": path, "json": path, "png": path or None}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{stem}.{k}") for k in ("txt", "json", "png")}
    with open(paths["txt"], "w") as f:
        f.write(text + "\n")
    with open(paths["json"], "w") as f:
        json.dump(data, f, indent=1, default=_json_default)
    plt = pyplot()
    if plt is None:
        paths["png"] = None
    else:
        draw(plt, paths["png"])
    return paths


def _json_default(value):
    if isinstance(value, float):
        return str(value)
    return repr(value)
