"""The examples in docstrings run and print what they say (milliseconds)."""

from __future__ import annotations

import doctest

import pytest

import finetune.engines
import finetune.packing


@pytest.mark.parametrize("module", [finetune.packing, finetune.engines], ids=lambda m: m.__name__)
def test_docstring_examples_hold(module):
    result = doctest.testmod(module)
    assert result.attempted >= 4 and result.failed == 0
