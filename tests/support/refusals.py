"""One loop for the test cases that check refusals: each call must raise a given exception whose
message contains a given text (the argument or reason it names)."""

from __future__ import annotations

from typing import Callable, Iterable, Tuple


def refusals(cases: Iterable[Tuple[str, Callable[[], object], type, str]], tag: str = "") -> list:
    """Each case (name, call, exception type, text): the failures as messages, [] when every call
    raised that exception naming its text."""
    errors = []
    for name, call, exc, text in cases:
        try:
            call()
            errors.append(f"{tag}{name}: did not raise {exc.__name__}")
        except exc as e:
            if text not in str(e):
                errors.append(f"{tag}{name}: {exc.__name__} without {text!r}: {e}")
    return errors


def derivative(layer: Callable, inputs: list, wanted: list, grad, how: str, order: int = 2):
    """A derivative of `layer` over the inputs v marked in `wanted` (the others need no grad):
    order 1, d/dv [(layer(v) * grad).sum() + (v ** 3).sum()]; order 2, d/dv of the sum of those
    first derivatives. The cubes are a part outside the layer that a derivative missing the
    layer's part still has. Taken by `torch.autograd.grad(..., inputs)` ("grad", which runs only
    the nodes between its outputs and its inputs) or by `.backward()` ("backward", every node
    that requires grad): the tensors (None where unused), or the exception it raised."""
    import torch

    lv = [t.detach().clone().requires_grad_(w) for t, w in zip(inputs, wanted)]
    ins = [t for t, w in zip(lv, wanted) if w]
    try:
        total = (layer(*lv) * grad).sum() + sum((t ** 3).sum() for t in ins)
        if order == 2:
            total = sum(g.sum() for g in torch.autograd.grad(total, ins, create_graph=True))
        if how == "grad":
            return list(torch.autograd.grad(total, ins, allow_unused=True))
        total.backward()
        return [t.grad for t in ins]
    except Exception as e:
        return e


def exact_or_refused(tag: str, got, want, texts: Iterable[str], tol: float = 1e-9) -> list:
    """`got` (tensors, or the exception a derivative raised) equals `want` (the exact derivative;
    None: there is none to compare with, so only the refusal passes) or is a RuntimeError whose message has every one of `texts`; anything else (another error, a
    GradcheckError, a wrong value) is reported."""
    import torch
    from torch.autograd.gradcheck import GradcheckError

    if isinstance(got, BaseException):
        if isinstance(got, GradcheckError) or not isinstance(got, RuntimeError):
            return [f"{tag}: {str(got)[:300]!r}"]
        missing = [t for t in texts if t not in str(got)]
        return [f"{tag}: {got!r} does not say {missing}"] if missing else []
    if want is None:
        return [f"{tag}: no derivative exists here without the call's part, but it raised nothing"]
    if isinstance(want, BaseException):
        return [f"{tag}: the exact reference raised {want!r}"]
    errors = []
    for i, (g, w) in enumerate(zip(got, want)):
        g = torch.zeros_like(w) if g is None else g
        w = torch.zeros_like(g) if w is None else w
        if g.shape != w.shape or not torch.allclose(g.double(), w.double(), rtol=tol, atol=tol):
            err = (g - w).abs().max().item() if g.shape == w.shape else f"shapes {tuple(g.shape)} {tuple(w.shape)}"
            errors.append(f"{tag}: input {i}'s derivative is neither refused nor exact (max error {err})")
    return errors
