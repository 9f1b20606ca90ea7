"""python -m ampc.memory on a tiny GPT-2-shaped model: the table, the picture, recomputation."""
import json

import pytest

pytest.importorskip("transformers")
from ampc.memory.__main__ import main   # noqa: E402

TINY = ["--width", "64", "--layers", "2", "--vocab", "256", "--context", "16", "--batch", "2"]


def test_table_and_picture(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "m.png"
    main(TINY + ["--png", str(png), "--top", "3"])
    out = capsys.readouterr().out
    assert "GPT-2-shaped" in out and "saved activations by module" in out and "(" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_recompute_and_json(capsys):
    main(TINY + ["--json"])
    plain = json.loads(capsys.readouterr().out)
    main(TINY + ["--json", "--optimizer", "lean", "--recompute", "transformer.h.*.mlp"])
    lean = json.loads(capsys.readouterr().out)
    assert lean["recomputed"] == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    mlp = lambda r: sum(b for k, b in r["saved"].items() if ".mlp" in k)   # noqa: E731
    assert mlp(lean) < mlp(plain) / 2
    # 8-bit moments: about a quarter of torch's fp32 ones
    assert lean["parts"]["optimizer state"] < plain["parts"]["optimizer state"] / 3
