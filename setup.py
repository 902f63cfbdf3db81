"""Build of megatron_ep, its protocol module `megatron_ep._protocol` and its CUDA extension
`megatron_ep._C`.

`_protocol` (csrc/protocol_module.cpp: plain C++ and pybind11, no CUDA, no torch) exports the
region layout and call protocol that the kernels use; it is always built, since both backends
read their call signature from it.

The extension is built whenever a CUDA build of torch and nvcc are present (no GPU needed:
TORCH_CUDA_ARCH_LIST defaults to 9.0). Switches (environment):
    MEP_SKIP_CUDA=1        build the pure-Python package only (wins over MEP_REQUIRE_EXTENSION)
    MEP_REQUIRE_EXTENSION=1  fail, saying why, when the extension cannot be built (instead of a
                           pure-Python install that pip reports only with -v); CI sets it
    MEP_PTXAS_VERBOSE=1    pass -Xptxas -v (register / shared-memory / spill report)
    MEP_DEBUG=1            -G -O0 device code (for cuda-gdb / sanitizer line info)
    MAX_JOBS=N             parallel compile jobs (ninja)
Kernel sources (.cu) never include torch headers: they take raw pointers, so they compile in
seconds; the one translation unit that includes torch is the binding (csrc/bindings.cpp).
"""

import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _without_extension(reason):
    """No extension: an error when the user asked for one, else a note (pip shows it with -v)."""
    if os.environ.get("MEP_REQUIRE_EXTENSION", "0") == "1":
        raise SystemExit(f"megatron_ep: MEP_REQUIRE_EXTENSION=1 but the CUDA extension cannot be built: {reason}")
    print(f"megatron_ep: {reason}; building without the CUDA extension (MEP_REQUIRE_EXTENSION=1 makes this an error)")
    return [], {}


def _cuda_extensions():
    if os.environ.get("MEP_SKIP_CUDA", "0") == "1":
        return [], {}
    if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"  # torch would otherwise guess /usr/local
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return _without_extension("torch is not importable at build time (pip builds in an isolated environment "
                                  "without it: pip install --no-build-isolation ...)")
    if torch.version.cuda is None:
        return _without_extension(f"torch {torch.__version__} is a CPU-only build (the extension needs a CUDA build)")
    if CUDA_HOME is None:
        return _without_extension("no nvcc found (set CUDA_HOME to the CUDA toolkit, e.g. /usr/local/cuda)")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    debug = os.environ.get("MEP_DEBUG", "0") == "1"
    nvcc = [
        "-std=c++17",
        "-gencode=arch=compute_90,code=sm_90",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        "-O0" if debug else "-O3",
    ]
    if debug:
        nvcc.append("-G")
    if os.environ.get("MEP_PTXAS_VERBOSE", "0") == "1":
        nvcc.append("-Xptxas=-v")
    sources = ["csrc/bindings.cpp", "csrc/region.cpp", "csrc/pool.cpp"] + sorted(glob.glob("csrc/kernels/*.cu"))

    ext = CUDAExtension(
        name="megatron_ep._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++20"], "nvcc": nvcc},  # torch >= 2.12 headers need C++20
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


def _protocol_extension():
    from setuptools import Extension

    try:
        import pybind11
    except ImportError as exc:  # pragma: no cover - pybind11 is a build requirement
        raise RuntimeError("megatron_ep needs pybind11 to build its _protocol module (pip install pybind11)") from exc
    return Extension(
        "megatron_ep._protocol",
        sources=["csrc/protocol_module.cpp"],
        include_dirs=[os.path.join(ROOT, "csrc"), pybind11.get_include()],
        extra_compile_args=["-O2", "-std=c++17"],
        language="c++",
    )


ext_modules, cmdclass = _cuda_extensions()
ext_modules = [_protocol_extension()] + ext_modules

setup(
    name="megatron_ep",
    version="0.1.0",
    description="Expert-parallel MoE dispatch/combine kernels with a Megatron-core flex-dispatcher plugin",
    packages=find_packages(include=["megatron_ep", "megatron_ep.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"megatron": ["megatron-core>=0.16"], "test": ["pytest>=8"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
