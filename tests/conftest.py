"""Test setup: with no GPU, Triton kernels run in the interpreter (set before triton is imported).

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

RUN_SEED = int(os.environ.get("LILY_TEST_SEED") or random.SystemRandom().randrange(2**32))


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        report.sections.append(("random seed", f"this test seeded random, numpy and torch with {seed_of(item.nodeid)}; "
                                               f"LILY_TEST_SEED={RUN_SEED} repeats the run"))
    return report
