"""Loaded at interpreter start (Python imports `sitecustomize` from its path) by
`scripts/deepep_tests.py --cpu`: DeepEP's test files, written for CUDA, run on CPU processes, so
the DeepEP API layer of megatron_ep.deep_ep and the torch backend under it can be checked before a
GPU run (the kernels are not exercised). Acts only with MEGATRON_EP_CUDA_AS_CPU=1:

  * every `device=` naming CUDA, `Tensor.cuda()` and `Tensor.to("cuda")` give the CPU
    (torch.overrides.TorchFunctionMode, entered for the process's main thread);
  * torch.set_default_device("cuda") sets the CPU; torch.cuda's set_device, synchronize,
    current_device and device_count answer as for one idle device;
  * collectives of FP8 tensors move their bytes (gloo has no FP8 types);
  * Tensor.record_stream does nothing (no streams).
"""

import importlib.util
import os


def _envs():
    """megatron_ep/core/envs.py by its path (standard library only: this runs before anything else)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "megatron_ep",
                        "core", "envs.py")
    spec = importlib.util.spec_from_file_location("_megatron_ep_envs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


envs = _envs()
if envs.flag("MEGATRON_EP_CUDA_AS_CPU"):
    import torch
    from torch.overrides import TorchFunctionMode

    _FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n))
    _COLLECTIVES = {"all_to_all_single", "all_gather_into_tensor", "all_gather", "broadcast", "all_to_all"}

    def _cpu(device):
        if isinstance(device, str) and device.startswith("cuda"):
            return "cpu"
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.device("cpu")
        if isinstance(device, int) and not isinstance(device, bool):  # a CUDA ordinal
            return "cpu"
        return device

    def _bytes(t):
        if isinstance(t, torch.Tensor) and t.dtype in _FP8:
            return t.view(torch.uint8)
        if isinstance(t, (list, tuple)):
            return type(t)(_bytes(v) for v in t)
        return t

    class CudaAsCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            name = getattr(func, "__name__", "")
            if name == "cuda":
                return args[0]
            if name == "record_stream":
                return None
            if name == "to":
                args = tuple(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
            if name in _COLLECTIVES:
                args = tuple(_bytes(a) for a in args)
            return func(*args, **kwargs)

    _set_default_device = torch.set_default_device
    torch.set_default_device = lambda device: _set_default_device(_cpu(device))
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    CudaAsCpu().__enter__()
