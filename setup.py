"""Build script: package metadata lives in pyproject.toml; this file adds the C++ extensions.

Each native library registers its pybind11 extension in ``native_extensions()``; a checkout
without a given ``csrc/`` directory simply builds without that extension.
"""
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent


def native_extensions():
    from pybind11.setup_helpers import Pybind11Extension

    extensions = []
    shm_src = ROOT / "megatron" / "shm_tensor_rdma" / "csrc"
    if shm_src.is_dir():
        sources = sorted(str(p.relative_to(ROOT)) for p in shm_src.glob("*.cpp"))
        if sources:
            extensions.append(
                Pybind11Extension(
                    "megatron.shm_tensor_rdma._C",
                    sources,
                    cxx_std=17,
                    extra_compile_args=["-O2"],
                    libraries=["rt", "pthread"],
                )
            )
    return extensions


if __name__ == "__main__":
    from pybind11.setup_helpers import build_ext

    setup(ext_modules=native_extensions(), cmdclass={"build_ext": build_ext})
