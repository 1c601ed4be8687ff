"""lily.kernels.host_math against Triton's own cdiv and next_power_of_2, which the launchers used before."""

import random

import triton

from lily.kernels.host_math import cdiv, next_power_of_2


def test_cdiv_and_next_power_of_2_match_triton():
    values = [0, 1, 2, 3, 63, 64, 65, 1023, 1024, 1025, 248_320] + [random.randrange(1, 1 << 40) for _ in range(200)]
    for n in values:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 7, 64, 1024, random.randrange(1, 5000)):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
