"""Triton kernels of pyprune: ``kernels/`` at the top of the repository (beside ``csrc/``), installed as
``pyprune.ops.kernels`` (setup.py ``package_dir``); one module per family.

Each module exposes launchers that take validated, contiguous tensors and return torch tensors;
:mod:`pyprune.ops` is the only caller. Import this package only after deciding on
``TRITON_INTERPRET`` (Triton reads it when a kernel is defined).
"""
