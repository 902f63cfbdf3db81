"""Build of megatron_ep, its protocol module `megatron_ep._protocol`, its CUDA extension
`megatron_ep._C` and its NVSHMEM extension `megatron_ep._C_nvshmem` (the internode and low-latency paths).

`_protocol` (csrc/protocol/module.cpp: plain C++ and pybind11, no CUDA, no torch) exports the
region layout and call protocol that the kernels use; it is always built, since both backends
read their call signature from it.

The extension is built whenever a CUDA build of torch and nvcc are present (no GPU needed:
TORCH_CUDA_ARCH_LIST defaults to 9.0). Switches (environment; 1/true/yes/on or 0/false/no/off, as every
switch of megatron_ep: megatron_ep/core/envs.py parses them, another value is an error):
    MEGATRON_EP_SKIP_CUDA=1          build the pure-Python package only (wins over
                                     MEGATRON_EP_REQUIRE_EXTENSION)
    MEGATRON_EP_REQUIRE_EXTENSION=1  fail, saying why, when the extension cannot be built (instead of a
                                     pure-Python install that pip reports only with -v); CI sets it
    MEGATRON_EP_PTXAS_VERBOSE=1      pass -Xptxas -v (register / shared-memory / spill report)
    MEGATRON_EP_DEBUG=1              -G -O0 device code (for cuda-gdb / sanitizer line info)
    MAX_JOBS=N                       parallel compile jobs (ninja)
    MEGATRON_EP_BUILD_ONLY=a,b       only these extensions (e.g. _protocol,_C), see below
(Each was read as MEP_* before; the old name still works, with a notice.)
`_C_nvshmem` (the NVSHMEM paths: csrc/nvshmem/, csrc/internode/, csrc/low_latency/) is built beside `_C` when
the pip package nvidia-nvshmem-cu13 is installed (torch's CUDA 13 builds depend on it), with
relocatable device code and a device link against NVSHMEM's static device library; without
NVSHMEM it is skipped with a printed reason (MEGATRON_EP_REQUIRE_EXTENSION=1 makes that an error too).
Kernel sources (.cu) never include torch headers: they take raw pointers, so they compile in
seconds; the one translation unit that includes torch is the binding (csrc/intranode/binding.cpp).
"""

import glob
import importlib.util
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_envs():
    """megatron_ep/core/envs.py by its path (standard library only; the package is not built yet): the
    switches above take the values the library's do (1/true/yes/on, 0/false/no/off, unset)."""
    spec = importlib.util.spec_from_file_location("_mep_build_envs", os.path.join(ROOT, "megatron_ep", "core", "envs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(name):
    """The switch `name`; a value that is neither on nor off ends the build in one line."""
    try:
        return _load_envs().flag(name)
    except ValueError as e:
        raise SystemExit(f"megatron_ep: {e}") from None


def _without_extension(reason):
    """No extension: an error when the user asked for one, else a note (pip shows it with -v)."""
    if _flag("MEGATRON_EP_REQUIRE_EXTENSION"):
        raise SystemExit(f"megatron_ep: MEGATRON_EP_REQUIRE_EXTENSION is on but the CUDA extension cannot be built: {reason}")
    print(f"megatron_ep: {reason}; building without the CUDA extension (MEGATRON_EP_REQUIRE_EXTENSION=1 makes this an error)")
    return [], {}


def _cuda_extensions():
    if _flag("MEGATRON_EP_SKIP_CUDA"):
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
    debug = _flag("MEGATRON_EP_DEBUG")
    nvcc = [
        "-std=c++17",
        "-gencode=arch=compute_90,code=sm_90",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        "-O0" if debug else "-O3",
    ]
    if debug:
        nvcc.append("-G")
    if _flag("MEGATRON_EP_PTXAS_VERBOSE"):
        nvcc.append("-Xptxas=-v")
    sources = _sources("ipc", "intranode")
    math_headers = _math_library_headers(CUDA_HOME)

    ext = CUDAExtension(
        name="megatron_ep._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")] + math_headers,
        extra_compile_args={"cxx": ["-O3", "-std=c++20"], "nvcc": nvcc},  # torch >= 2.12 headers need C++20
    )
    return [ext] + _low_latency_extension(CUDAExtension, nvcc, math_headers), \
        {"build_ext": BuildExtension.with_options(use_ninja=True)}


def _math_library_headers(cuda_home):
    """torch's CUDA event header (the one-crossing calls record the caller's torch.cuda.Event) pulls
    in the CUDA math libraries' headers; a toolkit without them (nvcc alone) finds them in the pip
    packages torch's CUDA build brings (nvidia/cu13/include)."""
    if os.path.exists(os.path.join(cuda_home, "include", "cusparse.h")):
        return []
    try:
        import nvidia.cu13 as cu
    except ImportError:
        return []
    return [inc for inc in (os.path.join(root, "include") for root in cu.__path__)
            if os.path.exists(os.path.join(inc, "cusparse.h"))]


def _sources(*folders):
    """Every .cpp and .cu file of these csrc/ folders (one folder per layer or path: csrc/README)."""
    return sorted(f for d in folders for ext in ("cpp", "cu") for f in glob.glob(f"csrc/{d}/*.{ext}"))


def nvshmem_home():
    """(include dir, lib dir) of the pip package nvidia-nvshmem-cu13, or a reason it is unusable."""
    try:
        import nvidia.nvshmem as nv
    except ImportError:
        return None, "the pip package nvidia-nvshmem-cu13 is not installed (pip install nvidia-nvshmem-cu13)"
    root = list(nv.__path__)[0]
    inc, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    need = [os.path.join(inc, "nvshmem.h"), os.path.join(lib, "libnvshmem_host.so.3"), os.path.join(lib, "libnvshmem_device.a")]
    missing = [p for p in need if not os.path.exists(p)]
    if missing:
        return None, f"nvidia-nvshmem-cu13 at {root} lacks {', '.join(missing)}"
    return (inc, lib), ""


def _low_latency_extension(CUDAExtension, nvcc, math_headers):
    found, why = nvshmem_home()
    if found is None:
        if _flag("MEGATRON_EP_REQUIRE_EXTENSION"):
            raise SystemExit(f"megatron_ep: MEGATRON_EP_REQUIRE_EXTENSION is on but _C_nvshmem cannot be built: {why}")
        print(f"megatron_ep: {why}; building without the NVSHMEM extension _C_nvshmem (internode and low-latency paths)")
        return []
    inc, lib = found
    # NVSHMEM's headers use the half operators torch's default flags hide; its device functions
    # need relocatable device code and a device link with its static device library (torch's
    # dlink=True would add -dlto, which fails with it).
    ll_nvcc = [f for f in nvcc] + ["-rdc=true", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                                   "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]
    return [CUDAExtension(
        name="megatron_ep._C_nvshmem",
        sources=_sources("nvshmem", "internode", "low_latency"),
        # (math_headers: its internode entries include the intranode ones' torch headers, composed.h)
        include_dirs=[os.path.join(ROOT, "csrc"), inc] + math_headers,
        extra_compile_args={"cxx": ["-O3", "-std=c++20"], "nvcc": ll_nvcc,
                            "nvcc_dlink": ["-dlink", "-gencode=arch=compute_90,code=sm_90", f"-L{lib}", "-lnvshmem_device"]},
        extra_link_args=[f"-L{lib}", "-l:libnvshmem_host.so.3", "-l:libnvshmem_device.a", f"-Wl,-rpath,{lib}"],
    )]


def _protocol_extension():
    from setuptools import Extension

    try:
        import pybind11
    except ImportError as exc:  # pragma: no cover - pybind11 is a build requirement
        raise RuntimeError("megatron_ep needs pybind11 to build its _protocol module (pip install pybind11)") from exc
    return Extension(
        "megatron_ep._protocol",
        sources=["csrc/protocol/module.cpp"],
        include_dirs=[os.path.join(ROOT, "csrc"), pybind11.get_include()],
        extra_compile_args=["-O2", "-std=c++17"],
        language="c++",
    )


ext_modules, cmdclass = _cuda_extensions()
ext_modules = [_protocol_extension()] + ext_modules
# MEGATRON_EP_BUILD_ONLY=_protocol,_C (names after "megatron_ep."): build only these. Two builds of
# disjoint sets can then run at once, each with its own --build-temp (torch's ninja build
# writes one build.ninja per build directory, so setuptools' own -j would mix them up).
_build_only = _load_envs().text("MEGATRON_EP_BUILD_ONLY", "")
if _build_only:
    _only = {n.strip() for n in _build_only.split(",") if n.strip()}
    ext_modules = [e for e in ext_modules if e.name.split(".")[-1] in _only]

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
