"""The offloader's parts see it only through their protocols in owner.py: each protocol is
exactly what its part uses, a live Offloader has all of it, and no part imports offloader.py."""

from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path
from typing import Protocol

import pytest
from torch import nn

import ssdtier
from ssdtier.offload import owner

from .test_attach import offload_config

OFFLOAD = Path(owner.__file__).parent
PARTS = {
    "entry.py": owner.EntryOwner,
    "cuda.py": owner.CudaOwner,
    "cpu.py": owner.CpuOwner,
    "readahead.py": owner.ReadAheadOwner,
    "recompute.py": owner.RecomputeOwner,
    "forward.py": owner.ForwardOwner,
    "adaptive.py": owner.AdaptiveOwner,
}
# Files that reach a part's owner through the part (``self.ad.off``): their uses count as its.
WITH = {"adaptive.py": ("watch.py",)}
PROTOCOLS = {
    name: cls
    for name, cls in vars(owner).items()
    if inspect.isclass(cls) and cls.__module__ == owner.__name__ and Protocol in cls.__mro__
}


def members(proto: type) -> dict[str, object]:
    """A protocol's members (its own and its bases' in owner.py): name -> what declares it
    (None for an attribute)."""
    out: dict[str, object] = {}
    for cls in reversed(proto.__mro__):
        if cls.__module__ != owner.__name__:
            continue
        out.update(dict.fromkeys(vars(cls).get("__annotations__", {})))
        out.update(
            (name, v)
            for name, v in vars(cls).items()
            if not name.startswith("__") and isinstance(v, (types.FunctionType, staticmethod, property))
        )
    return out


def _annotation(arg: ast.arg) -> str | None:
    return ast.unparse(arg.annotation).strip("'\"") if arg.annotation is not None else None


def owner_uses(tree: ast.Module) -> set[str]:
    """The names a part reads, sets or calls on its owner: ``<x>.off.<name>`` (or any field
    the owner was stored in), and ``<alias>.<name>`` for local names bound to it (parameters
    annotated with a protocol, ``off = self.off``)."""
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    fields = {"off"}
    aliases: dict[ast.AST, set[str]] = {}
    for fn in funcs:
        a = fn.args
        aliases[fn] = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if _annotation(x) in PROTOCOLS}

    def is_owner(node: ast.AST, names: set[str]) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr in fields
        return isinstance(node, ast.Name) and node.id in names

    grew = True
    while grew:  # to a fixed point: an alias or field may be bound from another
        grew = False
        for fn in funcs:
            names = aliases[fn]
            for node in ast.walk(fn):
                if not isinstance(node, ast.Assign):
                    continue
                for target in node.targets:
                    pairs = [(target, node.value)]
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs = list(zip(target.elts, node.value.elts, strict=False))
                    for t, v in pairs:
                        if not is_owner(v, names):
                            continue
                        if isinstance(t, ast.Name) and t.id not in names:
                            names.add(t.id)
                            grew = True
                        elif isinstance(t, ast.Attribute) and t.attr not in fields:
                            fields.add(t.attr)
                            grew = True
    return {
        node.attr
        for fn in funcs
        for node in ast.walk(fn)
        if isinstance(node, ast.Attribute) and is_owner(node.value, aliases[fn])
    }


@pytest.mark.parametrize("part", sorted(PARTS))
def test_each_part_uses_exactly_its_protocol(part):
    proto = PARTS[part]
    tree = ast.parse((OFFLOAD / part).read_text())
    named = {_annotation(x) for x in ast.walk(tree) if isinstance(x, ast.arg)} & set(PROTOCOLS)
    assert named == {proto.__name__}, f"{part} names its owner {named or 'with no protocol'}"
    used, declared = owner_uses(tree), set(members(proto))
    for other in WITH.get(part, ()):
        used |= owner_uses(ast.parse((OFFLOAD / other).read_text()))
    assert not used - declared, f"{part} uses {sorted(used - declared)} of its owner, not in {proto.__name__}"
    assert not declared - used, f"{proto.__name__} declares {sorted(declared - used)}, which {part} does not use"


def test_a_live_offloader_has_every_protocol_member(store_dir):
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
    with ssdtier.attach(model, offload_config(store_dir)) as off:
        for name, proto in PROTOCOLS.items():
            for member, decl in members(proto).items():
                assert hasattr(off, member), f"Offloader has no {member} ({name})"
                if isinstance(decl, (types.FunctionType, staticmethod)):
                    assert callable(getattr(off, member)), f"Offloader.{member} is not callable ({name})"


def _imports_offloader(node: ast.AST) -> bool:
    target = "ssdtier.offload.offloader"
    if isinstance(node, ast.Import):
        return any(a.name == target or a.name.startswith(target + ".") for a in node.names)
    if not isinstance(node, ast.ImportFrom):
        return False
    full = node.module or ""
    if node.level:  # relative to the package ssdtier.offload
        base = ["ssdtier", "offload"][: 3 - node.level]
        full = ".".join(base + ([full] if full else []))
    if full == target or full.startswith(target + "."):
        return True
    return any(f"{full}.{a.name}" == target for a in node.names)


def test_no_part_imports_the_offloader():
    parts = [p for p in sorted(OFFLOAD.glob("*.py")) if p.name not in ("offloader.py", "__init__.py")]
    assert {p.name for p in parts} >= set(PARTS) | {"owner.py", *(f for fs in WITH.values() for f in fs)}
    bad = [p.name for p in parts if any(_imports_offloader(n) for n in ast.walk(ast.parse(p.read_text())))]
    assert not bad, f"these import offloader.py: {bad}"


@pytest.mark.parametrize(
    ("line", "imports"),
    [
        ("from .offloader import Offloader", True),
        ("from . import offloader", True),
        ("from ..offload.offloader import attach", True),
        ("from ssdtier.offload import offloader", True),
        ("import ssdtier.offload.offloader", True),
        ("from .owner import CpuOwner", False),
        ("from ..store import ByteStore", False),
    ],
)
def test_the_import_scan_sees_every_spelling(line, imports):
    assert _imports_offloader(ast.parse(line).body[0]) is imports
