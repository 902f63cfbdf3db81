"""The two backends behind Buffer's one protocol (docs/design.md §3): `torch` (the reference, plain
PyTorch collectives) and `cuda` (our kernels)."""
