"""The `hypafilter` command: every module of this package that defines `register(subparsers)` adds its commands.

Command modules import the layer they drive inside their run functions, so that `hypafilter --help` and `lint`
do not load numpy, FastAPI, the emulator or the synthesis tool chain.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from hypafilter import __version__
from hypafilter.errors import HypafilterError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hypafilter", description="Hybrid FPGA + netfilter firewall (HyPaFilter+).")
    parser.add_argument("--version", action="version", version=f"hypafilter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except HypafilterError as e:
        print(f"hypafilter: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`hypafilter lint P | head`): stop quietly, as a Unix filter does. stdout is pointed
        # at /dev/null so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
