"""Integer arithmetic for the launchers' host code (grids, block sizes).

triton.cdiv and triton.next_power_of_2 are constexpr functions, callable inside kernels too, and a host call
goes through Triton's constexpr wrapper: ~3-4 us each, and a 256-token prefill makes ~1,400 of them. These
are the same functions in plain Python (~0.1 us)."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as triton.next_power_of_2)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()
