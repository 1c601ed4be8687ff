"""`lily ...` with the backend behind a test's step gates (tests/helpers_gate.py):

    python tests/gated_serve.py HOST:PORT AUTHKEY_HEX serve --model DIR ...

Everything else is the real command: argument parsing, loading, the server, signal handling."""

import sys

import lily.engine
from helpers_gate import GatedBackend, remote_enter
from lily.cli import main


def run(argv: list[str]) -> int:
    enter = remote_enter(argv[0], argv[1])
    load = lily.engine.load_backend
    lily.engine.load_backend = lambda *a, **kw: GatedBackend(load(*a, **kw), enter)
    return main(argv[2:])


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
