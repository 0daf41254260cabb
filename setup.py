"""Build script: package metadata lives in pyproject.toml; this file adds the C++ extensions.

Each native library registers its pybind11 extension in ``native_extensions()``; a checkout
without a given ``csrc/`` directory simply builds without that extension.
"""
import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent


def _verbs_headers_present() -> bool:
    """The verbs transport is built when <infiniband/verbs.h> exists (libibverbs-dev);
    SHM_TENSOR_RDMA_VERBS=0/1 forces it off/on."""
    forced = os.environ.get("SHM_TENSOR_RDMA_VERBS")
    if forced is not None:
        return forced == "1"
    include_dirs = ["/usr/include", "/usr/local/include"]
    for var in ("CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH"):
        include_dirs += [d for d in os.environ.get(var, "").split(os.pathsep) if d]
    return any((Path(d) / "infiniband" / "verbs.h").is_file() for d in include_dirs)


def native_extensions():
    from pybind11.setup_helpers import Pybind11Extension

    extensions = []
    shm_src = ROOT / "megatron" / "shm_tensor_rdma" / "csrc"
    if shm_src.is_dir():
        # One source set for every transport; verbs code is compiled in only with its headers.
        sources = sorted(str(p.relative_to(ROOT)) for p in shm_src.glob("*.cpp"))
        if sources:
            macros, libraries = [], ["rt", "pthread"]
            if _verbs_headers_present():
                macros.append(("STRDMA_HAVE_VERBS", "1"))
                libraries.append("ibverbs")
            extensions.append(
                Pybind11Extension(
                    "megatron.shm_tensor_rdma._C",
                    sources,
                    cxx_std=17,
                    extra_compile_args=["-O2", "-Wall", "-Wno-unused-parameter"],
                    define_macros=macros,
                    libraries=libraries,
                    depends=sorted(str(p.relative_to(ROOT)) for p in shm_src.glob("*.h")),
                )
            )
    return extensions


if __name__ == "__main__":
    from pybind11.setup_helpers import build_ext

    setup(ext_modules=native_extensions(), cmdclass={"build_ext": build_ext})
