"""The demo's text: the running interpreter's standard library, split into pieces. The
pieces are the most frequent words, numbers and runs of spaces of the training text, up to
VOCAB_SIZE with every printable character, which spells whatever else there is: a language
model's vocabulary is thousands of tokens, and its logits are then a large share of a
training step's memory (one character a token, 98 logits a token, hid that)."""
from __future__ import annotations  # "X | None" hints on Python 3.9 too; none evaluated at import

import collections
import glob
import os
import re
import string
import sysconfig

import torch

CHARS = [c for c in string.printable if c not in "\x0b\x0c"]   # 98 characters
VOCAB_SIZE = 4096
_PIECE = re.compile(r"[A-Za-z_]+|[0-9]+| +|.", re.S)
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3",
              "turtledemo", "__pycache__", "ensurepip", "venv"}


class Vocab:
    """Pieces of text by id: the printable characters first, then longer pieces."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces
        self.index = {p: i for i, p in enumerate(pieces)}

    @classmethod
    def of(cls, text: str, size: int = VOCAB_SIZE) -> "Vocab":
        """The characters and the ``size - len(CHARS)`` most frequent longer pieces of
        ``text`` (ties in the order of the pieces)."""
        counts = collections.Counter(p for p in _PIECE.findall(text) if len(p) > 1)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls(CHARS + [p for p, _ in ranked[:size - len(CHARS)]])

    def encode(self, text: str) -> torch.Tensor:
        unknown, ids = self.index["?"], []
        for p in _PIECE.findall(text):
            i = self.index.get(p)
            if i is not None:
                ids.append(i)
            else:
                ids.extend(self.index.get(c, unknown) for c in p)
        return torch.tensor(ids, dtype=torch.int16)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def stdlib_files() -> tuple[str, list[str]]:
    """The standard library's .py files (top level and one package level down), sorted."""
    lib = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(lib, "*.py")) + glob.glob(os.path.join(lib, "*", "*.py"))
    keep = [f for f in files
            if os.path.basename(os.path.dirname(f)) not in _SKIP_DIRS or os.path.dirname(f) == lib]
    return lib, sorted(keep)


def load_text(max_chars: int = 1_500_000, vocab_size: int = VOCAB_SIZE
              ) -> tuple[torch.Tensor, torch.Tensor, Vocab, str]:
    """(train ids, val ids, the vocabulary, description): every tenth file goes to
    validation; the vocabulary is the training text's (``vocab_size=len(CHARS)``: one
    character a token)."""
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
    train_text, val_text = "\n".join(train), "\n".join(val)
    vocab = Vocab.of(train_text, vocab_size)
    tr, va = vocab.encode(train_text), vocab.encode(val_text)
    return tr, va, vocab, (f"{len(train) + len(val)} files of {lib} ({len(train_text):,} train / "
                           f"{len(val_text):,} val chars; {len(tr):,} / {len(va):,} tokens of a "
                           f"vocabulary of {len(vocab.pieces):,})")
