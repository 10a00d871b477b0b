"""``p2ptrain model builders``: the model builders a task may name on this machine.

Built-in builders, and those of installed packages (the ``p2ptrain.models`` entry-point group, and
p2ptrain's own ``torchvision:…``), each with where it comes from and the keyword arguments it takes;
then the packages whose builders are unavailable here, and why (what to install). A node advertises
the same names to its peers, and refuses a task whose builder it does not have.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any


def add_parser(msub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = msub.add_parser("builders", help="list the model builders a task may name here, and where they come from",
                             description=__doc__)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (builders: name, source, doc, args; unavailable: namespace, "
                             "source, error)")
    parser.set_defaults(func=cmd_builders)


def _bound(value: float) -> float | None:
    return None if math.isinf(value) else value


def cmd_builders(args: argparse.Namespace) -> int:
    from p2ptrain.models import PLUGINS, builders

    sources = {o.namespace: o.dist for o in PLUGINS.origins()}
    listed: list[dict[str, Any]] = []
    for name, builder in builders().items():
        source = sources[name.split(":", 1)[0]] if ":" in name else "built-in"
        kwargs = {k: {"type": a.kind.__name__, "default": a.default, "min": _bound(a.lo), "max": _bound(a.hi),
                      "doc": a.doc} for k, a in builder.args.items()}
        listed.append({"name": name, "source": source, "doc": builder.doc, "args": kwargs})
    unavailable = [{"namespace": o.namespace, "source": o.dist, "error": o.error}
                   for o in PLUGINS.origins() if o.error is not None]
    if args.json:
        print(json.dumps({"builders": listed, "unavailable": unavailable}))
        return 0
    width = max(len(b["name"]) for b in listed)
    for b in listed:
        print(f"{b['name']:<{width}}  {b['source']}: {b['doc']}")
        print(f"{'':<{width}}  args: " + (", ".join(f"{k}={v['default']}" for k, v in b["args"].items()) or "none"))
    for u in unavailable:
        print(f"{u['namespace'] + ':*':<{width}}  {u['source']}: unavailable: {u['error']}")
    return 0
