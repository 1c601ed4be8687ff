"""The `lily` command: serve | generate | make-synthetic | bench | check.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
modules are imported only when their subcommand runs, so `lily --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("lily.server.main", "run the OpenAI-compatible server"),
    "generate": ("lily.generate", "greedy generation from a prompt (text or token ids)"),
    "make-synthetic": ("lily.synthetic", "write a random-weight checkpoint in the exact MLX 4-bit format"),
    "bench": ("lily.bench.main", "the benchmark matrix (prefill and decode tok/s against context)"),
    "check": ("lily.check", "validate a checkpoint directory and print what it holds"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="lily", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    p = argparse.ArgumentParser(prog=f"lily {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(p)
    args = p.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
