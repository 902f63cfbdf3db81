"""DeepEP's Config (chunk sizes of its normal kernels) and its default tables. Our kernels size
their own buffers: a Config is accepted, checked as DeepEP checks it, and its `num_sms` is the
only field our calls read (a cached dispatch must use the count of the call that made its
handle). The size hints follow DeepEP's formulas, so callers that size a Buffer from them get
the numbers they expect (our Buffer does not need them)."""

from __future__ import annotations


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        nvl_send, nvl_recv = num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
        rdma_send, rdma_recv = num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens
        assert num_sms >= 0
        assert nvl_send > 0 and nvl_recv > 0 and nvl_send < nvl_recv
        assert rdma_send > 0 and rdma_recv > 0
        rdma_recv = _align_up(rdma_recv, rdma_send)
        assert rdma_send < rdma_recv and rdma_send <= rdma_recv // 2
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens = nvl_send, nvl_recv
        self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens = rdma_send, rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        assert num_ranks < 8 or num_ranks % 8 == 0
        assert num_ranks <= 8 or self.num_sms % 2 == 0
        C, nn, nr, r = self.num_sms // 2, min(num_ranks, 8), max(num_ranks // 8, 1), self.num_max_nvl_chunked_recv_tokens
        b = (C * nn * (2 * nr + 3) * 4 + C * nn * r * hidden_bytes + C * nn * r * 8 + C * nn * r * 128 * 8
             + C * nn * r * 128 * 4 + C * nn * r * 128 * 4)
        return _align_up(b, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= 8:
            return 0
        assert num_ranks % 8 == 0 and self.num_sms % 2 == 0
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
