"""ARCHITECTURE.md stays true to the tree: it names every package under ampc/, every C folder
under csrc/, and every Python module in its package's entry (a new file gets a line there)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "ARCHITECTURE.md").read_text()


def entries():
    """{first name of a "- `name`" entry: its text}, a continued line joined to its entry."""
    found, name = {}, None
    for line in PAGE.splitlines():
        m = re.match(r"- `([^`]+)`", line)
        if m:
            name = m.group(1)
            found[name] = found.get(name, "") + line
        elif name and line.startswith("  "):
            found[name] += line
        else:
            name = None
    return found


def packages():
    return sorted(p.parent for p in (ROOT / "ampc").glob("*/__init__.py"))


def test_every_package_has_an_entry():
    missing = [p.name for p in packages() if f"{p.name}/" not in entries()]
    assert not missing, f"ARCHITECTURE.md has no '- `name/`' entry for {missing}"


def test_every_c_folder_is_named():
    folders = sorted(d.relative_to(ROOT / "csrc").as_posix() for d in (ROOT / "csrc").rglob("*")
                     if d.is_dir() and any(f.is_file() for f in d.iterdir()))
    missing = [f for f in folders if f"`{f}/`" not in PAGE and f"csrc/{f}/" not in PAGE]
    assert folders and not missing, f"ARCHITECTURE.md does not name csrc/{missing}"


def test_every_module_is_named_in_its_package_entry():
    missing = [f"ampc/{f.name}" for f in (ROOT / "ampc").glob("*.py")
               if f.name != "__init__.py" and f"`{f.name}`" not in PAGE]
    found = entries()
    for package in packages():
        text = found.get(f"{package.name}/", "")
        missing += [f"ampc/{package.name}/{f.name}" for f in sorted(package.glob("*.py"))
                    if f.name != "__init__.py" and f.name not in text]
    assert not missing, f"ARCHITECTURE.md does not name {missing} (in its package's entry)"


def test_no_package_reaches_into_another_package_s_private_modules():
    """A package takes from another only what that one's entry exports: an import of another
    package's private module (``from ..memory._report import ...``) is a reach past its door.
    The top-level private modules (``ampc/_walk.py``, ``ampc/_numerics/``) are shared helpers
    for all and stay open."""
    reach = re.compile(r"^\s*from\s+(\.{2,})([a-z]\w*)\.(_\w+)\s+import", re.M)
    found = []
    for package in packages():
        for f in sorted(package.rglob("*.py")):
            for m in reach.finditer(f.read_text()):
                if m.group(1) == ".." and m.group(2) != package.name:
                    found.append(f"{f.relative_to(ROOT)}: {m.group(0).strip()}")
    assert not found, "private reaches across packages:\n" + "\n".join(found)
