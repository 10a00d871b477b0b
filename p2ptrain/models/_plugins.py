"""Builders from installed packages: the ``p2ptrain.models`` entry-point group.

The contract for a package author: an entry point in the group ``p2ptrain.models`` whose *name* is a
namespace (``mypkg``) and whose *object* is a :class:`~p2ptrain.models.Builder`, or a list or tuple
of them, each named ``namespace:model`` (``mypkg:tiny``). A task then names ``mypkg:tiny`` with
keyword arguments checked against the builder's ``Arg`` declarations, exactly as for a built-in.

Only code the machine has installed runs: entry points are read from the distributions on
``sys.path`` (a package installed in the venv, or local code put on the path), never fetched. They
are loaded lazily, once per process, on the first lookup of a name that is not built in (or on a
listing). A namespace whose module fails to import, or whose object breaks the contract, is logged
once and unavailable; it never stops the node. A plugin cannot replace a built-in: its names must
carry its namespace, and a name that is already built in is refused with the whole namespace.

p2ptrain's own optional builders (``torchvision:…``, :mod:`p2ptrain.models._torchvision`) go through
the same loader as :data:`BUNDLED` sources, so a source checkout needs no reinstall to have them.
"""

from __future__ import annotations

import importlib.metadata as metadata
import logging
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from p2ptrain.models._model_error import MissingBuilder as MissingBuilder
from p2ptrain.models._registry import REGISTRY, Arg, Builder, ModelError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "p2ptrain.models"
# What a node advertises of its builders (wire.Capabilities.builders carries the same bounds): at
# most MAX_BUILDERS names of MAX_NAME_LENGTH characters, so one namespace cannot flood a heartbeat.
MAX_BUILDERS = 64
MAX_NAME_LENGTH = 64
NAMESPACE = re.compile(r"[a-z][a-z0-9_]{0,23}")
BUILDER_NAME = re.compile(r"([a-z][a-z0-9_]{0,23}):[A-Za-z0-9][A-Za-z0-9_.-]{0,38}")
# p2ptrain's own sources of optional builders: namespace -> entry-point value, loaded like a plugin.
BUNDLED = {"torchvision": "p2ptrain.models._torchvision:BUILDERS"}
# What to install for a bundled namespace whose module is missing, and what to do when it imports
# but fails (PyPI's torchvision beside a torch it was not built for: "operator torchvision::nms does
# not exist").
INSTALL_HINTS = {"torchvision": "pip install torchvision"}
BROKEN_HINTS = {"torchvision": "install the torchvision release made for this torch"}


@dataclass(frozen=True)
class Origin:
    """Where a namespace's builders come from: the distribution and the entry point's value."""

    namespace: str
    dist: str  # "name version", or "p2ptrain (bundled)"
    value: str
    error: str | None = None  # why its builders are unavailable; None: loaded


def _check_builder(obj: Any, namespace: str) -> Builder:
    """``obj`` as a builder of ``namespace``, or ModelError saying how it breaks the contract."""
    if not isinstance(obj, Builder):
        raise ModelError(f"{type(obj).__name__} is not a p2ptrain.models.Builder")
    match = BUILDER_NAME.fullmatch(obj.name) if isinstance(obj.name, str) else None
    if match is None or match.group(1) != namespace:
        raise ModelError(f"builder name {obj.name!r} is not {namespace}:NAME (letters, digits, _ . -; at most "
                         f"{MAX_NAME_LENGTH} characters)")
    if obj.name in REGISTRY:
        raise ModelError(f"builder {obj.name!r} would replace a built-in")
    if not callable(obj.fn):
        raise ModelError(f"builder {obj.name!r}: fn is not callable")
    if obj.check is not None:  # the hf builder's own config check: a package's arguments are Arg-checked
        raise ModelError(f"builder {obj.name!r}: check is for built-in builders (declare its args)")
    if not isinstance(obj.args, Mapping) or not all(
        isinstance(k, str) and isinstance(a, Arg) and a.kind in (int, float, bool, list) for k, a in obj.args.items()
    ):
        raise ModelError(f"builder {obj.name!r}: args must map names to Arg(int|float|bool|list, ...)")
    return obj


def _builders_of(obj: Any, namespace: str) -> list[Builder]:
    """What an entry point's object provides, checked: one Builder or a list/tuple of them."""
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    if not 1 <= len(items) <= MAX_BUILDERS:
        raise ModelError(f"{len(items)} builders (1 to {MAX_BUILDERS} per namespace)")
    builders = [_check_builder(b, namespace) for b in items]
    if len({b.name for b in builders}) != len(builders):
        raise ModelError("two builders of one name")
    return builders


def _installed(path: list[str] | None) -> Iterator[tuple[str, metadata.EntryPoint, str]]:
    """(namespace, entry point, distribution) for p2ptrain's bundled sources, then the entry points
    in the group of every distribution on ``path`` (None: ``sys.path``), in a stable order
    (distribution name, entry point)."""
    for namespace, value in BUNDLED.items():
        yield namespace, metadata.EntryPoint(namespace, value, ENTRY_POINT_GROUP), "p2ptrain (bundled)"
    found = []
    dists = metadata.distributions() if path is None else metadata.distributions(path=path)
    for dist in dists:
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP:
                found.append((ep.name, ep, f"{dist.metadata['Name']} {dist.version}"))
    yield from sorted(found, key=lambda item: (item[2], item[0], item[1].value))


class Plugins:
    """The builders of installed packages, loaded once on first use (thread-safe: a node asks from
    its worker threads). ``path``: where to look for distributions (None: ``sys.path``; a test or
    a tool may name a folder of its own; modules are imported from ``sys.path`` either way)."""

    def __init__(self, path: list[str] | None = None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._builders: dict[str, Builder] | None = None
        self._origins: dict[str, Origin] = {}

    def _load(self) -> dict[str, Builder]:
        with self._lock:
            if self._builders is None:
                self._builders = {}
                for namespace, ep, dist in _installed(self._path):
                    self._load_one(namespace, ep, dist)
            return self._builders

    def _load_one(self, namespace: str, ep: metadata.EntryPoint, dist: str) -> None:
        assert self._builders is not None
        origin = Origin(namespace, dist, ep.value)
        if namespace in self._origins:
            other = self._origins[namespace].dist
            logger.warning("model builders %r from %s ignored: namespace already provided by %s", namespace, dist, other)
            return
        try:
            if not NAMESPACE.fullmatch(namespace):
                raise ModelError(f"entry point name {namespace!r} is not a namespace (a-z, 0-9, _; at most 24)")
            builders = _builders_of(ep.load(), namespace)
        except ModuleNotFoundError as exc:
            # A missing optional dependency (torchvision on a node without it): expected, so DEBUG: a
            # node that never trains such a model is not told at every start; a task naming one of
            # its builders gets this reason as its one-line refusal (get: MissingBuilder).
            hint = INSTALL_HINTS.get(namespace) or (f"pip install {exc.name}" if exc.name else "")
            self._origins[namespace] = Origin(namespace, dist, ep.value, f"{hint} ({exc})" if hint else str(exc))
            logger.debug("model builders %r from %s unavailable: %s", namespace, dist, self._origins[namespace].error)
            return
        except Exception as exc:  # a broken plugin is logged and unavailable, never a crash
            error = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            if namespace in BROKEN_HINTS:
                error += f" ({BROKEN_HINTS[namespace]})"
            self._origins[namespace] = Origin(namespace, dist, ep.value, error)
            logger.warning("model builders %r from %s (%s) unavailable: %s", namespace, dist, ep.value, error)
            return
        self._origins[namespace] = origin
        for b in builders:
            self._builders[b.name] = b

    def get(self, name: str) -> Builder:
        """The builder called ``name``; MissingBuilder saying why this node has none, or ModelError
        for a name no package could provide (not ``NAMESPACE:NAME``)."""
        builders = self._load()
        if name in builders:
            return builders[name]
        namespace = name.split(":", 1)[0]
        origin = self._origins.get(namespace) if ":" in name else None
        if origin is not None and origin.error is not None:
            raise MissingBuilder(name, f"no builder {name!r} on this node: {origin.error}")
        if origin is not None:
            known = ", ".join(sorted(n for n in builders if n.startswith(namespace + ":")))
            raise MissingBuilder(name, f"no builder {name!r} on this node: {origin.dist} has no such builder "
                                       f"(it has: {known})")
        if ":" in name:
            raise MissingBuilder(name, f"no builder {name!r} on this node: no installed package provides "
                                       f"builders '{namespace}:...'")
        # No package can provide a name without a namespace: a typo, not a builder missing here.
        raise ModelError(f"model.name: unknown model {name!r} (known: {', '.join(sorted(REGISTRY))}; installed "
                         "packages add NAMESPACE:NAME builders)")

    def available(self) -> dict[str, Builder]:
        """Every loaded plugin builder by name."""
        return dict(self._load())

    def origins(self) -> list[Origin]:
        """Every namespace found, loaded or not, in load order."""
        self._load()
        return list(self._origins.values())


PLUGINS = Plugins()
"""The process's plugin builders (from the installed distributions)."""
