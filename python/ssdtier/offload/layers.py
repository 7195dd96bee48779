"""Finding a model's repeated blocks, and the modules ``policy.exclude`` names."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from ..errors import ConfigError

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def kind(m: nn.Module) -> type:
    """A block's class; a block compiled on its own (``torch.compile(block)``) is its module's."""
    return type(m._orig_mod) if type(m).__name__ == "OptimizedModule" else type(m)  # (Dynamo not imported)


def _children(mod: nn.Module) -> list[nn.Module]:
    return list(mod.values()) if isinstance(mod, nn.ModuleDict) else list(mod)


def _run(mod: nn.Module, loose: bool = False) -> list[nn.Module]:
    """The module's repeated blocks, if it holds some: a container's children when they share
    one class; with ``loose``, also another module's largest group (two or more) of same-class
    children that have children of their own, as blocks registered one by one (``add_module``
    over a plain list) are."""
    if isinstance(mod, _CONTAINERS):
        kids = _children(mod)
        # One module listed again (weights shared, as ALBERT's) is one block called again.
        return kids if len(kids) >= 2 and len({kind(m) for m in kids}) == 1 and _distinct(kids) else []
    if not loose:
        return []
    groups: dict[type, list[nn.Module]] = {}
    for kid in mod.children():
        if next(kid.children(), None) is not None and not isinstance(kid, _CONTAINERS):
            groups.setdefault(kind(kid), []).append(kid)
    best = max(groups.values(), key=len, default=[])
    return best if len(best) >= 2 else []


def _distinct(blocks: list[nn.Module]) -> bool:
    return len({id(b) for b in blocks}) == len(blocks)


def _flat(blocks: list[nn.Module]) -> list[nn.Module]:
    """Stages of blocks (a Sequential of Sequentials): the blocks inside them, in order."""
    if all(isinstance(b, _CONTAINERS) and _run(b) for b in blocks):
        return [x for b in blocks for x in _flat(_run(b))]
    return blocks


@dataclass(frozen=True)
class Stacks:
    """The stacks of repeated blocks found (path, blocks), in the model's order, and the ones
    left out for being less than half the largest."""

    found: list[tuple[str, list[nn.Module]]]
    left_out: list[tuple[str, list[nn.Module]]]


def find_layers(model: nn.Module, path: str | None = None) -> tuple[str, list[nn.Module]] | None:
    """The model's largest stack of repeated blocks (see :func:`find_stacks`).

    Args:
        model: the model.
        path: a dotted path (``"transformer.h"``) that names the module holding them instead.

    Returns:
        (path, blocks), or None when the model has no such stack.
    """
    if path is not None:
        return path, _named(model, path)
    found = search(model).found
    return max(found, key=lambda s: len(s[1]), default=None)


def _named(model: nn.Module, path: str) -> list[nn.Module]:
    try:
        mod = model.get_submodule(path)
    except AttributeError as e:
        raise ConfigError(f"policy.layers = {path!r}: the model has no submodule {path!r}") from e
    blocks = _run(mod, loose=True) or (_children(mod) if isinstance(mod, _CONTAINERS) else [])
    if not blocks:
        raise ConfigError(
            f"policy.layers = {path!r} is a {type(mod).__name__} with no repeated blocks: name a ModuleList, "
            "Sequential or ModuleDict, or a module holding two or more blocks of one class"
        )
    return _flat(blocks)


def search(model: nn.Module) -> Stacks:
    """Every stack of repeated blocks not inside another, in the model's order: containers
    (ModuleList, Sequential, ModuleDict) whose children share a class (an encoder's and a
    decoder's both; stages of blocks as their blocks); where the model has none, same-class
    blocks registered one by one on a module. Stacks with less than half the largest one's
    blocks (a pair of output heads) are left out."""
    for loose in (False, True):
        stacks: list[tuple[str, list[nn.Module]]] = []
        inside: set[int] = set()  # modules within a stack found
        for name, mod in model.named_modules():
            if id(mod) in inside:
                continue
            blocks = _run(mod, loose)
            if not blocks or not any(True for b in blocks for _ in b.parameters()):
                continue
            stacks.append((name, _flat(blocks)))
            for b in blocks:
                inside.update(id(m) for m in b.modules())
        if stacks:
            break
    most = max((len(b) for _, b in stacks), default=0)
    return Stacks([s for s in stacks if 2 * len(s[1]) >= most], [s for s in stacks if 2 * len(s[1]) < most])


def excluded_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[nn.Module]:
    """The modules that ``policy.exclude`` names (by qualified name or glob pattern)."""
    if not patterns:
        return []
    names = dict(model.named_modules(remove_duplicate=False))
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        raise ConfigError(
            f"policy.exclude: {', '.join(map(repr, unmatched))} names no module of the "
            f"{type(model).__name__} (qualified names such as {next(iter(n for n in names if n), '?')!r})"
        )
    found = {id(m): m for n, m in names.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    return list(found.values())


def find_stacks(model: nn.Module, paths: str | tuple[str, ...] | None = None) -> list[tuple[str, list[nn.Module]]]:
    """Every stack of repeated blocks, in the order the model lists them (:func:`search`), or
    the ones ``paths`` names."""
    if paths is None:
        return search(model).found
    stacks = [(p, _named(model, p)) for p in ((paths,) if isinstance(paths, str) else paths)]
    if not _distinct([b for _, bs in stacks for b in bs]):
        raise ConfigError(
            f"policy.layers = {list(p for p, _ in stacks)!r} names one module more than once (listed again, "
            "or in two stacks): ssdtier tells blocks apart by module, so each must be a module of its own"
        )
    return stacks
