"""The compiled pieces of repack, optional: everything else is in pyproject.toml.

``repack.read._hashes`` hashes many documents in one call (repack/read/_hashes.c);
``repack.model._blending`` builds Megatron's blending index without its samples x datasets loop
(repack/model/_blending.c).
They are built when the package is installed from source with a C compiler and Python's
headers at hand; where they cannot be (``optional=True``: setuptools warns and goes on), repack
computes the very same fingerprints and indices in Python and numpy, more slowly (``repack
--version`` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "repack.read._hashes",
            ["repack/read/_hashes.c"],
            include_dirs=["repack/_vendor/xxhash"],
            depends=["repack/_vendor/xxhash/xxhash.h"],
            optional=True,
        ),
        Extension(
            "repack.model._blending",
            ["repack/model/_blending.c"],
            # Megatron's x86-64 helper rounds the product and the difference apart: no fused
            # multiply-add, which GCC would otherwise form where the target has one
            extra_compile_args=["-ffp-contract=off"],
            optional=True,
        ),
    ]
)
