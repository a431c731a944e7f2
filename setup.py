"""The one compiled piece of repack, optional: everything else is in pyproject.toml.

``repack._hashes`` hashes many documents in one call (repack/_hashes.c). It is built when the
package is installed from source with a C compiler and Python's headers at hand; where it
cannot be (``optional=True``: setuptools warns and goes on), repack computes the very same
fingerprints in Python, more slowly (``repack doctor`` and ``repack --version`` say which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "repack._hashes",
            ["repack/_hashes.c"],
            include_dirs=["repack/_vendor/xxhash"],
            depends=["repack/_vendor/xxhash/xxhash.h"],
            optional=True,
        )
    ]
)
