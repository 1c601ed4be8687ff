"""The `lily` command: serve | generate | convert | make-synthetic | bench | check.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
modules are imported only when their subcommand runs, so `lily --help` stays fast.

A problem the user can cause (a bad path, a busy port, a checkpoint lily cannot run, a full disk, a GPU
too small) ends the command with one line, `lily <command>: error: <what is wrong>`, and exit status 2;
only a bug in lily shows a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys

from lily import __version__

SUBCOMMANDS = {
    "serve": ("lily.server.main", "run the OpenAI-compatible server"),
    "generate": ("lily.generate", "greedy generation from a prompt (text or token ids)"),
    "convert": ("lily.convert", "quantise Qwen's original bf16 or FP8 release to an MLX 4-bit checkpoint"),
    "make-synthetic": ("lily.synthetic", "write a random-weight checkpoint in the exact MLX 4-bit format"),
    "bench": ("lily.bench.main", "the benchmark matrix (prefill and decode tok/s against context)"),
    "check": ("lily.check", "validate a checkpoint directory and print what it holds"),
}


class UserError(Exception):
    """Something the user can fix (an argument, a path, the machine): reported as one line, no traceback."""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, plus each option's default at the end of its help, unless the help already
    names it or there is none worth showing (None, False, an empty list)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == argparse.SUPPRESS
                or default == [] or not action.option_strings):
            return text
        return f"{text} (default: {'none' if default == '' else '%(default)s'})"


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def _user_error_types() -> tuple[type, ...]:
    """The exception types that mean "the input or the machine is wrong", not "lily has a bug". Each
    module's own error type counts only once that module is loaded (it is, if it raised)."""
    types: list[type] = [UserError, OSError]
    for module, name in (("lily.checkpoint", "CheckpointError"), ("lily.config", "ConfigError"),
                         ("lily.tokenizer", "TokenizerError"), ("lily.generate", "UsageError"),
                         ("lily.engine", "DeviceError"),
                         ("torch", "OutOfMemoryError")):
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


def error_line(e: BaseException) -> str:
    """One line for a user-caused error: an OSError as 'path: reason', anything else its first line."""
    if isinstance(e, OSError) and e.strerror:
        where = e.filename if e.filename is not None else ""
        return f"{where}: {e.strerror}" if where else e.strerror
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    if type(e).__name__ == "OutOfMemoryError":
        return f"out of GPU memory ({first.split('. ')[0]}); try a smaller --max-seq or a larger GPU"
    return first


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone (`lily check DIR | head -1`: the write end of a pipe with no reader polls
    as an error); if so, stdout is pointed at /dev/null so the interpreter's last flush has nowhere to fail."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        closed = any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
        if closed:
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        return closed
    except (OSError, ValueError, AttributeError):  # no real stdout (captured), or no poll on this platform
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser("lily", __doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lily {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        if not argv:
            parser.print_help()
            return 2
        parser.parse_args(argv)  # --help, --version, or a usage error naming the unknown command
        return 0
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    p = make_parser(f"lily {name}", SUBCOMMANDS[name][1])
    module.add_arguments(p)
    args = p.parse_args(argv[1:])
    try:
        status = int(module.run(args) or 0)
        sys.stdout.flush()  # here, where a reader gone early is caught, not in the interpreter's exit
        return status
    except KeyboardInterrupt:
        print(f"\nlily {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            return 128 + 13  # quietly, with the status a shell gives a command a closed pipe ended (SIGPIPE)
        if not isinstance(e, _user_error_types()):
            raise
        print(f"lily {name}: error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
