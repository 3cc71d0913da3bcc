"""Run every benchmark (or those named on the command line) and print their results as Markdown."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import benchmarks


def main(names: list[str]) -> int:
    modules = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_"))
    chosen = [m for m in modules if not names or m.removeprefix("bench_") in names]
    if not chosen:
        print(f"no benchmark matches {names}; known: {', '.join(m.removeprefix('bench_') for m in modules)}")
        return 2
    for name in chosen:
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"## {name.removeprefix('bench_')}: {module.__doc__.strip().splitlines()[0]}\n")
        print(module.run())
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
