"""DeepEP's Config (chunk sizes of its normal kernels) and its default tables. A Config is
accepted and checked as DeepEP checks it; of its fields our kernels take num_sms (the call's SM
budget, as Buffer.set_num_sms's count for calls without a Config; 0: our default rule) and size
their own buffers, so the chunk sizes have no effect. The size hints follow DeepEP's formulas, so
callers that size a Buffer from them get the numbers they expect (our Buffer does not need them)."""

from __future__ import annotations

import numbers
import operator
from typing import Optional

INT_MAX = 2 ** 31 - 1  # DeepEP keeps these counts in C++ ints
BUFFER_ALIGNMENT = 128  # DeepEP's NUM_BUFFER_ALIGNMENT_BYTES
NVL_PEERS = 8  # DeepEP's NUM_MAX_NVL_PEERS: ranks per node


class InvalidArgument(ValueError, AssertionError):
    """An argument DeepEP asserts on, refused by name at the call: a ValueError naming the
    argument, its value and the allowed range, and an AssertionError too, as DeepEP's `assert`
    raised one, so code that catches those still catches it."""


def check_int(name: str, value, low: int, high: Optional[int] = INT_MAX, rule: str = "") -> int:
    """`value` as an int (anything with __index__ but a bool) in low..high (high None: no upper
    bound); TypeError or InvalidArgument naming `name`, the value and the range (`rule`: what
    else it must be, for the message)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise InvalidArgument(f"{name}={value} is outside its range: it must be {bound}{rule}")
    return value


def flag(name: str, value) -> bool:
    """A flag as DeepEP's bindings take it (pybind11's bool in its converting mode): a bool, None
    (False), a number by its truth value (its own tests pass 0 and 1) or a numpy bool; anything
    else, a string among them, is a TypeError naming `name`."""
    if value is True or value is False:
        return value
    if value is None:
        return False
    if isinstance(value, numbers.Number) or hasattr(type(value), "__index__") or type(value).__module__ == "numpy":
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_num_ranks(name: str, num_ranks) -> int:
    """DeepEP's group sizes: fewer than 8 ranks (one node), or whole nodes of 8."""
    num_ranks = check_int(name, num_ranks, 1)
    if not (num_ranks < NVL_PEERS or num_ranks % NVL_PEERS == 0):
        raise InvalidArgument(f"{name}={num_ranks} is not a DeepEP group size: it must be below {NVL_PEERS} (one "
                              f"node) or a multiple of {NVL_PEERS} (whole nodes)")
    return num_ranks


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class Config:
    """DeepEP's Config, with DeepEP's rules on its values (csrc/config.hpp), each refused by name."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        num_sms = check_int("num_sms", num_sms, 0)
        nvl_send = check_int("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens, 1)
        nvl_recv = check_int("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens, nvl_send + 1,
                             rule=f" (above num_max_nvl_chunked_send_tokens={nvl_send})")
        rdma_send = check_int("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens, 1)
        rdma_recv = check_int("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens, 1)
        aligned = _align_up(rdma_recv, rdma_send)  # DeepEP rounds it up to whole send chunks
        if not (rdma_send < aligned and rdma_send <= aligned // 2):
            raise InvalidArgument(
                f"num_max_rdma_chunked_recv_tokens={rdma_recv} (rounded up to {aligned}, whole chunks of "
                f"num_max_rdma_chunked_send_tokens={rdma_send}) must hold at least two send chunks: "
                f"num_max_rdma_chunked_send_tokens <= {aligned // 2}, or a receive size >= {2 * rdma_send}")
        rdma_recv = aligned
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens = nvl_send, nvl_recv
        self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens = rdma_send, rdma_recv

    def _hint_args(self, hidden_bytes, num_ranks) -> tuple:
        hidden_bytes, num_ranks = check_int("hidden_bytes", hidden_bytes, 0, None), check_num_ranks("num_ranks", num_ranks)
        if num_ranks > NVL_PEERS and self.num_sms % 2:
            raise InvalidArgument(f"num_ranks={num_ranks}: past {NVL_PEERS} ranks the Config's num_sms must be even "
                                  f"(channels of two SMs), it is {self.num_sms}")
        return hidden_bytes, num_ranks

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        hidden_bytes, num_ranks = self._hint_args(hidden_bytes, num_ranks)
        C, nn, nr, r = self.num_sms // 2, min(num_ranks, 8), max(num_ranks // 8, 1), self.num_max_nvl_chunked_recv_tokens
        b = (C * nn * (2 * nr + 3) * 4 + C * nn * r * hidden_bytes + C * nn * r * 8 + C * nn * r * 128 * 8
             + C * nn * r * 128 * 4 + C * nn * r * 128 * 4)
        return _align_up(b, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        hidden_bytes, num_ranks = self._hint_args(hidden_bytes, num_ranks)
        if num_ranks <= 8:
            return 0
        C, nr, r = self.num_sms // 2, num_ranks // 8, self.num_max_rdma_chunked_recv_tokens
        b = (C * nr * (8 * 2 + 2) * 2 * 4 + C * nr * r * hidden_bytes * 2 + C * nr * r * 8 * 2 + C * nr * r * 128 * 8 * 2
             + C * nr * r * 128 * 4 * 2 + C * nr * r * 128 * 4 * 2 + C * nr * r * 16 * 2)
        return _align_up(b, 128)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")


# DeepEP's default chunk sizes by group size: (nvl_send, nvl_recv, rdma_send, rdma_recv)
DISPATCH_CONFIGS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
COMBINE_CONFIGS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                   24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                   96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}
