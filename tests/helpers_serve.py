"""`lily serve` in a subprocess, for end-to-end tests.

    with serving(["--demo"], env={"LILY_CACHE_DIR": ...}) as (url, lines):   # lines: stderr up to "ready"
        httpx.get(url + "/health")

The server is started with --port 0; the context is entered when it prints the line that says it is
ready (no timing guess: the read blocks until the server writes), and its stderr is drained from then on.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def serving(args: list[str], env: dict | None = None):
    full_env = {**os.environ, **(env or {}),
                "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "lily", "serve", *args, "--port", "0"], cwd=ROOT, env=full_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "ready in" in line:
                break
        assert lines and "ready in" in lines[-1], "".join(lines)
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        yield lines[-1].split(" at ")[1].split()[0], lines
    finally:
        proc.terminate()
        proc.wait(30)
