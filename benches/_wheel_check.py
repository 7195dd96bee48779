"""Whether the installed ssdtier is this tree's, its Python files byte for byte: a wheel left
from an older commit would spend a GPU session on old code (gpu_session.sh's install)."""

from __future__ import annotations

import sys
from pathlib import Path


def differing(tree: Path, installed: Path) -> list[str]:
    """The tree's Python files that the installed package lacks or has otherwise."""
    out = []
    for p in sorted(tree.rglob("*.py")):
        rel = p.relative_to(tree)
        q = installed / rel
        if not q.is_file() or q.read_bytes() != p.read_bytes():
            out.append(str(rel))
    return out


def main() -> int:
    import ssdtier

    tree = Path(__file__).resolve().parents[1] / "python" / "ssdtier"
    installed = Path(ssdtier.__file__).resolve().parent
    bad = differing(tree, installed)
    if bad:
        print(
            f"the installed ssdtier ({installed}) is not this tree's: {len(bad)} files differ "
            f"({', '.join(bad[:8])}); build the wheel again and carry it",
            file=sys.stderr,
        )
        return 1
    print(f"the installed ssdtier is this tree's ({installed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
