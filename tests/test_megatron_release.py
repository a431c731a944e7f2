"""The Megatron-Core release under test is the one CI meant to test.

CI runs the ``megatron``-marked tests once per supported release, each installed in a folder of
its own and put first on ``PYTHONPATH`` (``.ci/run``). Should that folder not take precedence,
every run would silently test the same release; ``REPACK_TEST_MEGATRON_VERSION`` names the
release each run expects, and this test fails on any other.
"""

from __future__ import annotations

import os

import megatron.core
import pytest

from repack.megatron import MEGATRON_VERSION

pytestmark = pytest.mark.megatron

EXPECTED = os.environ.get("REPACK_TEST_MEGATRON_VERSION")


def public(version: str) -> str:
    """The release without its local part: megatron-core 0.18 appends ``+`` and the commit of
    the git work tree it is installed in (``.ci/run`` installs it under the clone's ``.venv``)."""
    return version.split("+", 1)[0]


def test_the_expected_release_is_imported() -> None:
    if EXPECTED is None:
        pytest.skip("REPACK_TEST_MEGATRON_VERSION is not set: any release will do")
    assert public(megatron.core.__version__) == EXPECTED, megatron.core.__file__
    assert public(MEGATRON_VERSION) == EXPECTED
