"""Finding a model's repeated blocks, and the modules ``policy.exclude`` names."""

from __future__ import annotations

import fnmatch

from torch import nn

from ..errors import ConfigError

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _children(mod: nn.Module) -> list[nn.Module]:
    return list(mod.values()) if isinstance(mod, nn.ModuleDict) else list(mod)


def find_layers(model: nn.Module, path: str | None = None) -> tuple[str, list[nn.Module]] | None:
    """The model's repeated blocks: the largest ModuleList, Sequential or ModuleDict whose
    children share one class (a ModuleDict's in insertion order, the order of its forward).

    Args:
        model: the model.
        path: a dotted path (``"transformer.h"``) that names the container instead.

    Returns:
        (path, blocks), or None when the model has no such container.
    """
    if path is not None:
        return path, _named(model, path)
    best: tuple[str, list[nn.Module]] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, _CONTAINERS) and len(mod) >= 2:
            blocks = _children(mod)
            if len({type(m) for m in blocks}) == 1 and (best is None or len(blocks) > len(best[1])):
                best = (name, blocks)
    return best


def _named(model: nn.Module, path: str) -> list[nn.Module]:
    try:
        mod = model.get_submodule(path)
    except AttributeError as e:
        raise ConfigError(f"policy.layers = {path!r}: the model has no submodule {path!r}") from e
    if not isinstance(mod, _CONTAINERS) or len(mod) == 0:
        raise ConfigError(
            f"policy.layers = {path!r} is a {type(mod).__name__}, not a non-empty ModuleList, Sequential or ModuleDict"
        )
    return _children(mod)


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
    """Every stack of repeated blocks, in the order the model lists them: the largest found
    by :func:`find_layers` and the others not inside one of them with at least half as many
    blocks (an encoder and a decoder, not a pair of output heads); or the containers named.
    """
    if paths is not None:
        return [(p, _named(model, p)) for p in ((paths,) if isinstance(paths, str) else paths)]
    found: list[tuple[str, list[nn.Module]]] = []
    for name, mod in model.named_modules():
        if any(name.startswith(f"{p}.") for p, _ in found):
            continue  # inside a stack already found (a block's experts, say)
        if isinstance(mod, _CONTAINERS) and len(mod) >= 2:
            blocks = _children(mod)
            if len({type(m) for m in blocks}) == 1:
                found.append((name, blocks))
    if not found:
        return []
    most = max(len(b) for _, b in found)
    return [(n, b) for n, b in found if 2 * len(b) >= most]
