"""Recompute and print the empirical privacy audit of a finished run.

  python -m dpjax.audit --workdir <workdir>
  python -m dpjax.audit --workdir <workdir> --json

(<workdir>: a run trained with audit.num_canaries > 0, e.g. `python -m dpjax.train
--config configs/digits_mlp.py --workdir w --config.audit.num_canaries=200`.)

Reads the newest checkpoint (its ε claim and parameters) and the audit record
`audit.json` (the canaries: their seed, coins and directions; see
`dpjax.trainer.workdir.audit_record` for the layout). Prints the claimed ε (an upper
bound), the one-run audit's ε lower bound at its confidence (Steinke, Nasr &
Jagielski 2023), the largest lower bound the canary count allows, and, with
per-step records, the white-box effective σ. --json prints one JSON object:
epsilon, delta, bound, audit_epsilon_lower, confidence, num_canaries,
num_guesses, num_correct, max_audit_epsilon_lower, refutes_claim, score,
step, and white_box (when recorded).

The lower bound holds with probability ≥ confidence: an ε_lower above the
claimed ε means the implementation is broken (or the claim wrong). A small
ε_lower does NOT confirm the claim: one run with m canaries cannot show more
than `max_audit_epsilon_lower`, and honest DP-SGD runs audit far below their ε.
"""

from __future__ import annotations

if __name__ == '__main__':  # Ctrl-C or SIGTERM from here on, imports included: one line, exit.
  from dpjax.trainer.commands import interrupts  # pylint: disable=g-import-not-at-top

  interrupts.exit_on_signals('python -m dpjax.audit')

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from absl import flags

from dpjax.trainer.commands import cli


def _format(result: dict) -> str:
  eps = result['epsilon']
  rows = [
    ('step', str(result['step'])),
    (
      f'claimed ε (δ = {result["delta"]:g})',
      'none (non-private run)' if eps is None else f'{eps:.4f}  [{result["bound"]}]',
    ),
    (
      'audit ε lower bound',
      f'{result["audit_epsilon_lower"]:.4f}  [holds with probability >= {result["confidence"]}; '
      f'{result["num_correct"]}/{result["num_guesses"]} guesses correct, '
      f'{result["num_canaries"]} canaries, score {result["score"]}]',
    ),
    ('largest possible bound', f'{result["max_audit_epsilon_lower"]:.4f}  (all guesses correct)'),
  ]
  if 'white_box' in result:
    w = result['white_box']
    lo, hi = w['interval']
    rows.append(
      (
        'white-box effective σ',
        f'{w["effective"]:.4f}  (interval [{lo:.4f}, {hi:.4f}] at {w["confidence"]}; '
        f'configured {w["noise_multiplier"]:g}; {len(w["flagged_steps"])} steps fail '
        'the per-step χ² test)',
      )
    )
  verdict = []
  if result['refutes_claim']:
    verdict.append('the audit REFUTES the claimed ε: the implementation leaks more than it claims')
  if result.get('white_box', {}).get('flagged'):
    verdict.append(
      'the white-box test FLAGS the run: the noise or the canary contribution is '
      'not what σ and C say'
    )
  rows.append(
    (
      'verdict',
      '; '.join(verdict) if verdict else 'no violation detected (this does not prove the claim)',
    )
  )
  width = max(len(k) for k, _ in rows)
  return '\n'.join(f'{k:<{width}}  {v}' for k, v in rows)


PROG = 'python -m dpjax.audit'


def main(argv=None) -> int:
  fv = flags.FlagValues()
  flags.DEFINE_string('workdir', None, 'the run directory (required)', flag_values=fv)
  flags.DEFINE_boolean('json', False, 'print one JSON object', flag_values=fv)
  cli.parse_command(PROG, __doc__, fv, sys.argv[1:] if argv is None else argv)
  if not fv.workdir:
    cli.fail(PROG, '--workdir is required: the run directory to audit.')
  # Here: --help and a bad flag answer without the audit's imports (jax, orbax).
  from dpjax.trainer.workdir import audit_record as record  # pylint: disable=import-outside-toplevel

  try:
    result = record.audit_workdir(fv.workdir)
  except ValueError as e:
    cli.fail(PROG, e)
  print(json.dumps(result) if fv.json else _format(result))
  return 0


if __name__ == '__main__':
  sys.exit(main())
