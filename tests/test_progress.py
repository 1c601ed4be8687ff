"""Progress where stderr is not a terminal (CI logs, nohup, `2>&1 | tee`): no bar is drawn, so long checkpoint
work writes a plain line at most every LILY_PROGRESS_EVERY seconds, and a closing one. The lines' timing is
driven by a fake clock, or by an interval of 0 (a line at each tensor) in the commands as a user runs them: no
test waits on the machine's speed."""

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from helpers_original import save_original
from lily.config import TINY
from tqdm import tqdm

from lily.progress import PlainProgress

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self):
        self.now = random.uniform(0, 1e6)

    def __call__(self):
        return self.now


class Lines:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def take(self) -> list[str]:
        out, self.text = self.text.splitlines(), ""
        return out


def size(n: int) -> str:
    return tqdm.format_sizeof(n, "B", 1024)


def test_a_line_each_interval_and_one_at_the_end():
    clock, out, every = Clock(), Lines(), random.uniform(1, 60)
    n = random.randrange(5, 50)
    sizes = [random.randrange(1, 10**9) for _ in range(n)]
    total = sum(sizes)
    show, start = PlainProgress("writing", every, stream=out, clock=clock), clock.now
    show(0, n, 0, total)
    clock.now += every * 0.99
    show(1, n, sizes[0], total)
    assert out.take() == []  # not yet an interval since the start
    clock.now += every * 0.02
    show(2, n, sum(sizes[:2]), total)
    (line,) = out.take()
    assert line.startswith("writing weights: ") and f"2/{n} tensors" in line
    assert f"{size(sum(sizes[:2]))} of {size(total)} ({100 * sum(sizes[:2]) / total:.0f}%)" in line
    clock.now += every * 0.5
    show(3, n, sum(sizes[:3]), total)
    assert out.take() == []  # the interval counts from the last line
    clock.now += every * 0.6
    show(n, n, total, total)
    (line,) = out.take()
    assert line == f"writing weights: done, {size(total)}, {n} tensors in {clock.now - start:.0f}s"


def test_work_shorter_than_the_interval_writes_nothing():
    clock, out, every = Clock(), Lines(), random.uniform(1, 60)
    show = PlainProgress("loading", every, stream=out, clock=clock)
    n = random.randrange(2, 9)
    for i in range(n + 1):
        show(i, n, i * 1000, n * 1000)
        clock.now += every / (n + 2)
    assert out.take() == []


def run_lily(args: list[str], every: str) -> subprocess.CompletedProcess:
    """`lily ARGS` as a user runs it, stderr a pipe (not a terminal)."""
    env = {**os.environ, "LILY_PROGRESS_EVERY": every,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "lily", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def progress_lines(stderr: str, what: str) -> tuple[list[str], list[str]]:
    lines = [x for x in stderr.splitlines() if x.startswith(f"{what} weights: ")]
    return [x for x in lines if "tensors, " in x], [x for x in lines if ": done, " in x]


def test_make_synthetic_writes_progress_lines_to_a_pipe(tmp_path):
    done = run_lily(["make-synthetic", "--preset", "tiny", "--seed", str(random.randrange(1000)),
                     str(tmp_path / "tiny")], every="0")
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr  # no bar
    steps, end = progress_lines(done.stderr, "writing")
    assert len(steps) >= 2 and len(end) == 1, done.stderr
    counts = [int(x.split(" tensors")[0].split()[-1].split("/")[0]) for x in steps]
    assert counts == sorted(counts)
    # a longer interval than the work takes: nothing but what the command prints itself
    quiet = run_lily(["make-synthetic", "--preset", "tiny", str(tmp_path / "again")], every="1e9")
    assert quiet.returncode == 0 and progress_lines(quiet.stderr, "writing") == ([], []), quiet.stderr


def test_convert_writes_progress_lines_to_a_pipe(tmp_path):
    src = save_original(tmp_path / "src", TINY, torch.Generator().manual_seed(random.randrange(2**31)),
                        causal_lm=True)
    done = run_lily(["convert", str(src), str(tmp_path / "out"), "--device", "cpu"], every="0")
    assert done.returncode == 0, done.stderr
    steps, end = progress_lines(done.stderr, "converting")
    assert len(steps) >= 2 and len(end) == 1, done.stderr
    assert "\r" not in done.stderr
