"""Build script for pyprune.

Pure Python + Triton everywhere; native extensions from ``csrc/``:

* ``pyprune._C`` (C++/OpenMP CPU kernels) is built wherever torch is importable at build time.
* ``pyprune._C_cuda`` (CUDA kernels) is built only where CUDA is usable, or when
  ``PYPRUNE_BUILD_CUDA=1`` forces it.

Build without isolation (``pip install --no-build-isolation -e .``) so the extensions are compiled
against the torch that is already installed; an isolated build would pull a CUDA torch wheel.
"""
import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _native_extensions():
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("pyprune: torch is not importable at build time; installing without native kernels "
              "(install torch first and use --no-build-isolation to get them)", file=sys.stderr)
        return [], {}
    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
    cpu_sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    extensions = [CppExtension(
        "pyprune._C", cpu_sources,
        # -fno-math-errno: std::sqrt need not set errno, so loops calling it vectorise.
        # -g0 overrides Python's default -g: no debug info, ~18% less compile time (a build is
        # part of every CI run) and a .so ~40x smaller (seen: topk_mask.o 17.3 MB -> 0.45 MB)
        extra_compile_args={"cxx": ["-O3", "-fno-math-errno", "-g0"] + openmp},
        extra_link_args=openmp,
    )]
    force_cuda = os.environ.get("PYPRUNE_BUILD_CUDA", "") == "1"
    if force_cuda or (torch.cuda.is_available() and torch.version.cuda is not None):
        cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        cuda_sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        extensions.append(CUDAExtension(
            "pyprune._C_cuda", cuda_sources,
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
        ))
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _native_extensions()

# major versions pinned: mkdocs.yml and docs/hooks/ use the APIs of these
DOCS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10", "mkdocstrings[python]>=1.0,<2",
        "mkdocstrings-python>=2.0,<3"]

setup(
    name="pyprune",
    version="0.1.0",
    description="Triton and CUDA kernels for pruning large language models, and the methods built on them",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # the Triton kernels sit at the top level (kernels/) beside csrc/ and install as pyprune.ops.kernels
    packages=find_packages(include=["pyprune", "pyprune.*"]) + ["pyprune.ops.kernels"],
    package_dir={"pyprune.ops.kernels": "kernels"},
    package_data={"pyprune.nn": ["dispatch_table.json"],
                  "pyprune.inputs": ["corpora/*.txt", "corpora/*.md", "corpora/*.xz", "corpora/*/*.xz"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[
        "torch>=2.4",
        "triton>=3.0",
        "transformers>=4.45",
        "datasets>=2.18",
        "ninja",
        "pybind11",
        "numpy",
        "tqdm",
        "pyyaml>=5.1",  # recipes (pyprune.recipes)
        "gguf",
        "accelerate",
        "peft>=0.21",  # LoRA recovery (pyprune.runtime.recovery); tested with 0.21.2
    ],
    extras_require={
        # zero-shot accuracy (pyprune.evaluation.zeroshot, --tasks) and comparison figures (pyprune compare)
        "eval": ["lm-eval>=0.4.13,<0.5", "matplotlib>=3.8"],
        # the docs site (mkdocs.yml; tests/test_docs.py builds it, so "test" carries the same packages)
        "docs": DOCS,
        # import-linter checks the layers contract of pyproject.toml; grimp (its graph) finds import cycles
        "test": ["pytest>=7", "pytest-xdist>=3.5", "pytest-benchmark", "hypothesis", "lm-eval>=0.4.13,<0.5", "matplotlib>=3.8",
                 "import-linter>=2.10,<3", "grimp>=3.5,<4", *DOCS],
    },
    entry_points={"console_scripts": ["pyprune=pyprune.cli:main"]},
)
