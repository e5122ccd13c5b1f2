"""List a workdir's checkpoints with their step, ε, kind of bound and integrity.

  python -m dpjax.checkpoints <workdir> [--json] [--verify]

The checkpoints themselves (saving, exact resume, the manifest) are
`dpjax.trainer.workdir.checkpoints` and `dpjax.trainer.workdir.manifest`.
"""

from __future__ import annotations

if __name__ == '__main__':  # Ctrl-C or SIGTERM from here on, imports included: one line, exit.
  from dpjax.trainer.commands import interrupts  # pylint: disable=g-import-not-at-top

  interrupts.exit_on_signals('python -m dpjax.checkpoints')

import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import os
import sys
import types

from absl import flags

from dpjax.trainer.commands import cli
from dpjax.trainer.workdir import manifest


def integrity(workdir: str, step: int) -> str:
  from dpjax.trainer.workdir import checkpoints as store  # pylint: disable=import-outside-toplevel

  try:
    path = os.path.join(store.checkpoint_dir(workdir), str(step))
    return 'ok' if manifest.verify_checkpoint(path) else 'unverified (no manifest)'
  except manifest.CheckpointCorruptError as e:
    return f'CORRUPT: {e}'


def listing(rows: list[dict], workdir: str, verify: bool) -> list[str]:
  """The table `main` prints: one line per checkpoint."""
  lines = [
    f'{"step":>8}  {"epsilon":>10}  {"delta":>8}  {"bound":<24}  {"accountant":<28}  sampler'
    + ('  integrity' if verify else '')
  ]
  for row in rows:
    if 'error' in row:
      lines.append(
        f'{row["step"]:>8}  {row["error"]}'
        + (f'  {integrity(workdir, row["step"])}' if verify else '')
      )
      continue
    privacy = row.get('privacy') or {}
    eps, delta = privacy.get('epsilon'), privacy.get('delta')
    if eps is None:  # Non-private run (privacy.enabled = False): no guarantee at all.
      eps_text, delta_text, bound = '∞', '-', 'non-private, ε = ∞'
    else:
      eps_text = f'{eps:.4f}'
      delta_text = f'{delta:.1e}' if isinstance(delta, (int, float)) else str(delta)
      bound = str(privacy.get('bound'))
    lines.append(
      f'{row["step"]:>8}  {eps_text:>10}  {delta_text:>8}  {bound:<24}  '
      f'{str(privacy.get("accountant")):<28}  {(row.get("sampler") or {}).get("name")}'
      + (f'  {integrity(workdir, row["step"])}' if verify else '')
    )
  return lines


def main(argv: list[str] | None = None) -> int:
  """python -m dpjax.checkpoints <workdir> [--json] [--verify] (`dpjax.trainer.commands.cli` conventions)."""
  prog = 'python -m dpjax.checkpoints'
  fv = flags.FlagValues()
  flags.DEFINE_boolean('json', False, 'print the metadata as JSON lines', flag_values=fv)
  flags.DEFINE_boolean(
    'verify', False, "check each checkpoint's files against its SHA-256 manifest", flag_values=fv
  )
  doc = (
    "List a workdir's checkpoints with their step, ε and kind of bound.\n\n  "
    + prog
    + ' <workdir> [--json] [--verify]\n'
  )
  (workdir,) = cli.parse_command(
    prog, doc, fv, sys.argv[1:] if argv is None else argv, positional=('workdir',)
  )
  args = types.SimpleNamespace(workdir=workdir, json=fv.json, verify=fv.verify)
  if not os.path.exists(args.workdir):
    print(f'{prog}: error: workdir {args.workdir} does not exist.', file=sys.stderr)
    return 2
  if not os.path.isdir(args.workdir):
    print(f'{prog}: error: workdir {args.workdir} is not a directory.', file=sys.stderr)
    return 2
  # Here: --help and a bad flag answer without the checkpoints' imports (jax, orbax).
  from dpjax.trainer.workdir import checkpoints as store  # pylint: disable=import-outside-toplevel

  rows = store.read_metadata(args.workdir)
  if not rows:
    print(f'No checkpoints in {store.checkpoint_dir(args.workdir)}.', file=sys.stderr)
    return 1
  lines = (
    [json.dumps(row) for row in rows] if args.json else listing(rows, args.workdir, args.verify)
  )
  try:
    for line in lines:
      print(line)
    sys.stdout.flush()
  except BrokenPipeError:  # `| head`: the reader left; stop quietly, as Unix tools do.
    # Python flushes stdout again at exit; point it at /dev/null so that flush cannot fail.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + 13  # 128 + SIGPIPE, like a tool killed by it.
  return 0


if __name__ == '__main__':
  sys.exit(main())
