"""The trainer's messages name only what its user can set (tests/settable_names.py).

Every refusal case of tests/e2e/test_bad_inputs.py checks its own message with
`unsettable_names`; here the messages no case reaches are read from the source: every string of
a `raise`, or of a call to fail / warn / print / write, outside the privacy core (whose
messages are for library callers and name its arguments).
"""

import ast
import pathlib

import pytest

from dpjax.privacy import samplers
from dpjax.privacy.accounting import accountant as accountant_lib
from dpjax.privacy.accounting import step_pld
from dpjax.trainer.configuration import accounting_refusals
from tests.settable_names import unsettable_names

DPJAX = pathlib.Path(__file__).resolve().parents[2] / 'dpjax'
MESSAGE_CALLS = {'fail', 'warn', 'print', 'write'}


def _messages(path: pathlib.Path):
  """(line, the constant text of one raise or message call) in `path`."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Raise) and node.exc is not None:
      message = node.exc
    elif (
      isinstance(node, ast.Call)
      and getattr(node.func, 'attr', getattr(node.func, 'id', None)) in MESSAGE_CALLS
    ):
      message = node
    else:
      continue
    yield (
      node.lineno,
      ' '.join(
        n.value
        for n in ast.walk(message)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
      ),
    )


def test_messages_outside_the_privacy_core_name_only_declared_fields():
  """Passes on da06065 too: its wrong names were assembled at run time (a list of hints, the
  model block's "did you mean"), which test_bad_inputs' cases catch; this keeps the messages
  no case reaches honest (the next test shows what it flags)."""
  paths = [p for p in DPJAX.rglob('*.py') if p.relative_to(DPJAX).parts[0] != 'privacy']
  assert len(paths) > 40
  found = [
    f'{path.relative_to(DPJAX)}:{line}: {bad}'
    for path in sorted(paths)
    for line, text in _messages(path)
    if (bad := unsettable_names(text))
  ]
  assert found == []


def test_unsettable_names_finds_library_settings_and_fields_that_do_not_exist():
  assert unsettable_names('coarsen value_discretization_interval; or raise max_grid_points') == [
    'max_grid_points',
    'value_discretization_interval',
  ]
  assert unsettable_names('set privacy.noise_multipler or model.hidden_width') == [
    'privacy.noise_multipler',
    'model.hidden_width',
  ]
  assert (
    unsettable_names(
      'raise privacy.noise_multiplier (--config.privacy.delta, config.model.hidden_size, '
      'model.hidden_sizes); see audit.json, dpjax.privacy.accounting; Changed: '
      'sampler.num_examples, data.content_sha256; the privacy group'
    )
    == []
  )


def test_grid_refusal_with_one_fix_reads_as_a_sentence():
  """With k = 1 and a sampler without a hint, raising σ is the only fix: the message said
  'To fix: ; or raise σ (...)' after the merges (an empty list joined before '; or')."""
  acct = accountant_lib.Accountant(
    samplers.PoissonSampler(num_examples=10_000, batch_size=100),
    0.3,
    1e-6,
    max_batch_size=None,
    max_grid_points=1000,
  )
  with pytest.raises(step_pld.GridTooLargeError) as e:
    acct.epsilon(10)
  text = accounting_refusals.grid_too_large(e.value, acct, accounting_refusals.CONFIG_NAMES)
  assert text.endswith('To fix: raise σ (privacy.noise_multiplier = 0.3).'), text
  assert unsettable_names(text) == []
