"""Run every benchmark (or those named on the command line) and print their results as Markdown."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from types import ModuleType

import benchmarks


def _modules() -> dict[str, str]:
    """Each benchmark's name (`detection`) and its module's (`bench_detection`)."""
    found = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_"))
    return {module.removeprefix("bench_"): module for module in found}


def _summary(module: ModuleType) -> str:
    """What a benchmark measures: the first line of its module's docstring."""
    return module.__doc__.strip().splitlines()[0]


def _parser(modules: dict[str, str]) -> argparse.ArgumentParser:
    """Its --help names every benchmark with what it measures, imported for their docstrings."""
    width = max(map(len, modules))
    listing = "\n".join(
        f"  {name:<{width}}  {_summary(importlib.import_module(f'benchmarks.{module}'))}"
        for name, module in modules.items()
    )
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        epilog=f"benchmarks:\n{listing}\n\n`make bench` runs them all; "
        "`python -m benchmarks detection soak` runs those two.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    return parser


def main(argv: list[str]) -> int:
    modules = _modules()
    names = _parser(modules).parse_args(argv).names
    chosen = [name for name in modules if not names or name in names]
    if not chosen:
        print(f"no benchmark matches {names}; known: {', '.join(modules)}")
        return 2
    for name in chosen:
        module = importlib.import_module(f"benchmarks.{modules[name]}")
        print(f"## {name}: {_summary(module)}\n")
        print(module.run())
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
