"""GPU memory in /metrics (absent on the CPU) and the load test's "memory returns to idle" judgement."""

from __future__ import annotations

import random

from lily.server.metrics import Metrics, cuda_memory_bytes
from test_reliability_support import load_test

MIB = 2**20


def render(m: Metrics) -> str:
    return m.render(queue_depth=0, cache_hits=1, cache_misses=2, cache_entries=3, cache_bytes=random.randrange(1, 1 << 30))


def test_device_memory_gauges_only_where_cuda_is_in_use():
    import torch

    text = render(Metrics())
    if not torch.cuda.is_available():
        assert cuda_memory_bytes() is None and "lily_device_memory" not in text
        assert load_test.device_memory(load_test.parse_metrics(text)) is None
    m = Metrics()
    alloc, reserved = random.randrange(1 << 20, 1 << 34), random.randrange(1 << 34, 1 << 35)
    m.device_memory = lambda: {"allocated": alloc, "reserved": reserved}
    text = render(m)
    assert "# TYPE lily_device_memory_allocated_bytes gauge" in text
    parsed = load_test.parse_metrics(text)
    assert parsed["lily_device_memory_allocated_bytes"] == alloc
    assert parsed["lily_device_memory_reserved_bytes"] == reserved
    assert load_test.device_memory(parsed)["allocated"] == alloc


def gauges(allocated, cache, reserved=None, queued=0, running=0):
    return {"lily_device_memory_allocated_bytes": allocated, "lily_device_memory_reserved_bytes": reserved or allocated,
            "lily_prefix_cache_bytes": cache, "lily_queue_depth": queued, "lily_requests_running": running}


def test_memory_returns_to_idle_judgement():
    base = random.randrange(1 << 30, 1 << 33)
    cache = random.randrange(1 << 20, 1 << 28)
    idle = gauges(base, 0)
    # the prefix cache filled up during the load: that is not a leak
    report, problems = load_test.memory_report(idle, gauges(base + cache + MIB, cache))
    assert problems == [] and report["returned_to_idle"]
    assert report["device_allocated_after_mib"] > report["device_allocated_idle_mib"]
    # a state (or anything else) left allocated beyond the slack: reported
    leak = random.randrange(64, 4096) * MIB
    report, problems = load_test.memory_report(idle, gauges(base + cache + leak, cache), device_slack_mib=32)
    assert len(problems) == 1 and "GPU memory" in problems[0] and not report["returned_to_idle"]
    # host RSS the same way, and an engine still busy
    report, problems = load_test.memory_report(idle, gauges(base, 0, running=1), rss_idle=500 * MIB,
                                               rss_peak=900 * MIB, rss_after=600 * MIB, rss_slack_mib=64)
    assert any("RSS" in p for p in problems) and any("not idle" in p for p in problems)
    # no GPU gauges (a CPU server): only what is there is judged
    cpu = {"lily_queue_depth": 0, "lily_requests_running": 0}
    report, problems = load_test.memory_report(cpu, cpu, 100 * MIB, 120 * MIB, 110 * MIB)
    assert problems == [] and "device_allocated_idle_mib" not in report
    _, problems = load_test.memory_report(cpu, cpu, expect_device=True)   # a CUDA server must report it
    assert len(problems) == 1 and "no GPU memory" in problems[0]
