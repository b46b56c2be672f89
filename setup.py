"""Builds megatron_fsdp._C: CPU kernels always, CUDA kernels when a CUDA torch and nvcc exist."""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cuda_build_possible() -> bool:
    if os.environ.get("MEGATRON_FSDP_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def _sources(with_cuda: bool) -> list[str]:
    patterns = ["csrc/module.cpp", "csrc/ops.cpp", "csrc/common/*.cpp", "csrc/cpu/*.cpp"]
    if with_cuda:
        patterns.append("csrc/cuda/*.cu")
    found: list[str] = []
    for pattern in patterns:
        found.extend(sorted(glob.glob(os.path.join(ROOT, pattern))))
    return [os.path.relpath(path, ROOT) for path in found]


def _extension():
    with_cuda = _cuda_build_possible()
    # OpenMP: at::parallel_for in the host kernels is an `omp parallel` region compiled into this
    # library; without -fopenmp it runs on one thread. It binds to the libgomp torch loaded.
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
    link_flags = ["-fopenmp"]
    if with_cuda:
        nvcc_flags = ["-O3", "-std=c++17", "-lineinfo"]
        return CUDAExtension(
            "megatron_fsdp._C",
            _sources(True),
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags,
        )
    return CppExtension(
        "megatron_fsdp._C",
        _sources(False),
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
