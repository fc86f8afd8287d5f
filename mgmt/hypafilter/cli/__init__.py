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

# The command each module of this package registers (its `register(sub)`). A command line names one, and main()
# imports that module alone: the others' imports (numpy, the analysis, scapy) cost about 0.4 s of CPU per process,
# and the tests and services start the CLI hundreds of times. tests/unit/test_cli.py checks the table against what
# the modules register.
COMMANDS = {
    "analyze": "analyze",
    "bench": "bench",
    "compile": "compile",
    "dashboard": "dashboard",
    "deploy": "deploy",
    "update": "deploy",
    "undeploy": "deploy",
    "status": "deploy",
    "flowsync": "flowsync",
    "fuzz": "fuzz",
    "import-classbench": "import_classbench",
    "lab": "lab",
    "lint": "lint",
    "optimize": "optimize",
    "policysync": "policysync",
    "synth": "synth",
    "verify": "verify",
}


def command_modules() -> list[str]:
    """Every module of this package that registers commands."""
    return [m.name for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name) if m.name != "common"]


def build_parser(modules: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser with the commands of `modules` (default: every module: `hypafilter --help` lists them all)."""
    parser = argparse.ArgumentParser(prog="hypafilter", description="Hybrid FPGA + netfilter firewall (HyPaFilter+).")
    parser.add_argument("--version", action="version", version=f"hypafilter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in command_modules() if modules is None else modules:
        module = importlib.import_module(f"{__name__}.{name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def _parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the command `argv` names (its module alone), or the whole parser when it names none it knows
    (top-level help and errors list every command)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    module = COMMANDS.get(first) if first is not None and argv and argv[0] == first else None
    return build_parser([module] if module else None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser_for(argv).parse_args(argv)
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
