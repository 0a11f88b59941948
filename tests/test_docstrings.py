"""The examples in docstrings run and print what they say (milliseconds)."""

from __future__ import annotations

import doctest

import pytest

import finetune.data.packing
import finetune.parallel.engines


@pytest.mark.parametrize("module", [finetune.data.packing, finetune.parallel.engines], ids=lambda m: m.__name__)
def test_docstring_examples_hold(module):
    result = doctest.testmod(module)
    assert result.attempted >= 4 and result.failed == 0
