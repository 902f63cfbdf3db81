"""A handle built positionally (host time) checked field by field."""

import dataclasses

import torch


def check_fields(obj, want: dict, others: set) -> None:
    """`obj`'s dataclass fields are exactly `want`'s names and `others`; each of `want` holds its
    value (a tensor: that very object)."""
    assert {f.name for f in dataclasses.fields(obj)} == set(want) | others
    for name, value in want.items():
        got = getattr(obj, name)
        assert got is value or (not isinstance(value, torch.Tensor) and got == value), name
