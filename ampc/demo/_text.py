"""The demo's text: the running interpreter's standard library, one character a token."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import glob
import os
import string
import sysconfig

import torch

VOCAB = [c for c in string.printable if c not in "\x0b\x0c"]   # 98 characters
_INDEX = {c: i for i, c in enumerate(VOCAB)}
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3",
              "turtledemo", "__pycache__", "ensurepip", "venv"}


def stdlib_files() -> tuple[str, list[str]]:
    """The standard library's .py files (top level and one package level down), sorted."""
    lib = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(lib, "*.py")) + glob.glob(os.path.join(lib, "*", "*.py"))
    keep = [f for f in files
            if os.path.basename(os.path.dirname(f)) not in _SKIP_DIRS or os.path.dirname(f) == lib]
    return lib, sorted(keep)


def encode(text: str) -> torch.Tensor:
    unknown = _INDEX["?"]
    return torch.tensor([_INDEX.get(c, unknown) for c in text], dtype=torch.uint8)


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def load_text(max_chars: int = 1_500_000) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train ids, val ids, description): every tenth file goes to validation."""
    lib, files = stdlib_files()
    train, val, n = [], [], 0
    for i, path in enumerate(files):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        (val if i % 10 == 9 else train).append(text)
        n += len(text)
        if n >= max_chars:
            break
    if not train or not val:
        raise SystemExit(f"ampc.demo: found too little Python source in {lib} "
                         f"({len(files)} files); this demo reads the standard library's .py files")
    tr, va = encode("\n".join(train)), encode("\n".join(val))
    return tr, va, f"{len(train) + len(val)} files of {lib} ({len(tr):,} train / {len(va):,} val chars)"
