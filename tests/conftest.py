"""Test setup: with no GPU, Triton kernels run in the interpreter (set before triton is imported).

Only tests marked `gpu` may skip (and not even they with LILY_REQUIRE_GPU=1, as scripts/gpu_tests.sh
runs them): the test extras are installed wherever the suite runs, so a skip anywhere else (a missing
oracle, a module that failed to import, a random input a test could not use) fails the run instead of
passing it quietly.

Random inputs are fresh each run but reproducible: the run has one seed (printed in the header; set
LILY_TEST_SEED to repeat it), and each test seeds `random`, numpy and torch from it and its own name
before its fixtures are made, so a failing test's report names the seed that repeats it."""

import os
import random
import zlib

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

MAY_SKIP = () if os.environ.get("LILY_REQUIRE_GPU") == "1" else ("gpu",)
RUN_SEED = int(os.environ.get("LILY_TEST_SEED") or random.SystemRandom().randrange(2**32))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; the only tests allowed to skip")


def pytest_report_header(config):
    return f"random seed {RUN_SEED} (LILY_TEST_SEED={RUN_SEED} repeats it)"


def seed_of(nodeid: str) -> int:
    return zlib.crc32(f"{RUN_SEED}:{nodeid}".encode())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    seed = seed_of(item.nodeid)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    item.user_properties.append(("random_seed", seed))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and not any(item.get_closest_marker(m) for m in MAY_SKIP):
        report.outcome = "failed"
        report.longrepr = f"skipped ({_skip_reason(report)}), but only tests marked gpu may skip, and only without a GPU"
    if report.failed:
        report.sections.append(("random seed", f"this test seeded random, numpy and torch with {seed_of(item.nodeid)}; "
                                               f"LILY_TEST_SEED={RUN_SEED} repeats the run"))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.skipped:  # a whole module skipped (pytest.importorskip, pytest.skip at module level)
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped ({_skip_reason(report)}), but only tests marked gpu may skip"
    return report
