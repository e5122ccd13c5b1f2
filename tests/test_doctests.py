"""The examples in the module heads of the public tier run as written (doctest)."""

import doctest
import importlib

import pytest

PUBLIC_TIER = (
  'dpjax.privacy.samplers',
  'dpjax.privacy.batching',
  'dpjax.privacy.privacy_plan',
  'dpjax.privacy.step_batcher',
)


@pytest.mark.parametrize('name', PUBLIC_TIER)
def test_module_head_examples_run(name):
  module = importlib.import_module(name)
  assert '>>>' in module.__doc__
  result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
  assert result.attempted > 0 and result.failed == 0
