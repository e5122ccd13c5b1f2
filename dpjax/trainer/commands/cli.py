"""What every dpjax command-line entry point shares: one-line errors, config files, pipes.

Conventions: a bad input (flag, config file, config field, workdir) prints one
line `<prog>: error: <message>` to stderr and exits with code 2 before any
compute; `--help` exits 0. Output piped into a reader that goes away
(`| head`) ends the command quietly.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Callable, NoReturn, Sequence

from absl import flags
import ml_collections

from dpjax import configs

USAGE_ERROR = 2


def fail(prog: str, message: object, code: int = USAGE_ERROR) -> NoReturn:
  """Prints `prog: error: message` as one line to stderr and exits with `code`."""
  text = ' '.join(str(message).split())  # One line, whatever the message holds.
  print(f'{prog}: error: {text}', file=sys.stderr, flush=True)
  sys.exit(code)


def resolve_config_spec(spec: str) -> str:
  """'path[:arg]' as given, or a packaged config's name ('digits_mlp[:arg]', `dpjax.configs`)
  as its file's path: configs load from any directory."""
  path, sep, arg = spec.partition(':')
  if not os.path.isfile(path) and configs.path_of(path):
    return configs.path_of(path) + sep + arg
  return spec


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file given as 'path', 'path:arg' or a packaged config's name.

  ValueError (one line naming the file) if the file is missing or does not load, get_config
  raises or returns something else than a ConfigDict, or `arg` changes nothing (a typo such as
  ':runlcoal' would otherwise run the full job).
  """
  path, _, arg = resolve_config_spec(spec).partition(':')
  if not os.path.isfile(path):
    raise ValueError(
      f'--config {spec!r}: no such file {path!r} (and no packaged config of that '
      f'name: {", ".join(configs.NAMES)}).'
    )
  module_spec = importlib.util.spec_from_file_location('_dpjax_config', path)
  if module_spec is None or module_spec.loader is None:
    raise ValueError(f'--config {spec!r}: cannot load {path!r} as a Python file.')
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ValueError(f'--config {spec!r}: syntax error at line {e.lineno}: {e.msg}.') from None
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
      f'--config {spec!r}: loading it raised {type(e).__name__}: {str(e).rstrip(".")}.'
    ) from None
  if not hasattr(module, 'get_config'):
    raise ValueError(f'--config {spec!r}: {path!r} defines no get_config().')

  def call(value):
    try:  # Without an argument, get_config() as ml_collections calls it: `def get_config():`.
      config = module.get_config() if value is None else module.get_config(value)
    except Exception as e:  # pylint: disable=broad-except
      shown = '' if value is None else repr(value)
      raise ValueError(
        f'--config {spec!r}: get_config({shown}) in {path!r} raised '
        f'{type(e).__name__}: {str(e).rstrip(".")}.'
      ) from None
    if not isinstance(config, ml_collections.ConfigDict):
      raise ValueError(
        f'--config {spec!r}: get_config() in {path!r} returned a '
        f'{type(config).__name__}, not an ml_collections.ConfigDict (start from '
        'dpjax.trainer.configuration.config_fields.default_config()).'
      )
    return config

  config = call(arg or None)
  try:
    baseline = call(None) if arg else None
  except ValueError:  # get_config needs its argument (e.g. configs/from_workdir.py).
    baseline = None
  if baseline is not None and config.to_dict() == baseline.to_dict():
    raise ValueError(
      f"--config {spec!r}: the argument {arg!r} changes nothing in {path!r}'s "
      'get_config (a typo, e.g. of runlocal?).'
    )
  return config


def flag_value(argv: Sequence[str], flag: str) -> str | None:
  """The value of `--flag=v` or `--flag v` in argv (the last one), or None."""
  argv, value = list(argv), None
  for i, arg in enumerate(argv):
    if arg.startswith(f'--{flag}='):
      value = arg.split('=', 1)[1]
    elif arg == f'--{flag}' and i + 1 < len(argv):
      value = argv[i + 1]
  return value


def config_override_error(argv: Sequence[str], flag: str = 'config') -> str | None:
  """A message for the first `--config.<path>=v` naming no field of the config file, if any."""
  spec = flag_value(argv, flag)
  if spec is None:
    return None
  try:
    base = load_config_file(spec)
  except ValueError as e:
    return str(e)
  # Here, not at the top: --help and flag errors answer without the fields' imports (jax).
  from dpjax.trainer.configuration import config_fields  # pylint: disable=import-outside-toplevel

  known = set(config_fields.field_paths(base))
  prefixes = {p.rsplit('.', i)[0] for p in known for i in range(1, p.count('.') + 1)}
  for arg in argv:
    if arg.startswith(f'--{flag}.'):
      path = arg[len(flag) + 3 :].split('=', 1)[0]
      if config_fields.removed_field_message(path):
        return f'--{flag}.{path}: ' + config_fields.removed_field_message(path)
      if path not in known and path not in prefixes:
        guess = config_fields.closest_field(path, config_fields.field_paths(base))
        hint = f' Did you mean --{flag}.{guess}?' if guess else ''
        return f'--{flag}.{path}: the config has no field {path!r}.{hint}'
  return None


def resolve_config_argv(argv: Sequence[str]) -> list[str]:
  """argv with `--config=name[:arg]` / `--config name[:arg]` of a packaged config as its path
  (absl's config flag reads the file by path)."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith('--config='):
      out[i] = '--config=' + resolve_config_spec(arg[len('--config=') :])
    elif arg == '--config' and i + 1 < len(out):
      out[i + 1] = resolve_config_spec(out[i + 1])
  return out


def parse_flags(prog: str, flag_values: flags.FlagValues, argv: list[str]) -> list[str]:
  """flag_values(argv) with flag errors (bad value, missing/broken config, a
  --config.<field> naming no field) turned into one line and exit 2."""
  argv = [argv[0]] + resolve_config_argv(argv[1:])
  try:
    rest = flag_values(argv)
    spec = flag_value(argv[1:], 'config')
    if spec is not None:
      load_config_file(spec)  # A missing or broken config file: one line now.
    return rest
  except ValueError as e:
    fail(prog, e)
  except flags.Error as e:
    problem = config_override_error(argv[1:])
    fail(prog, problem or f'{e}. See --help.')
  except Exception as e:  # pylint: disable=broad-except  # e.g. a config file that fails.
    fail(prog, config_override_error(argv[1:]) or f'{type(e).__name__}: {e}')


def usage(
  prog: str,
  doc: str,
  flag_values: flags.FlagValues,
  positional: Sequence[str] = (),
  names: Sequence[str] | None = None,
) -> str:
  """--help text: the command's docstring, then each flag (`names`, default all) with its help,
  choices and default."""
  lines = []
  for name in names if names is not None else flag_values:
    flag = flag_values[name]
    extra = ''  # absl's enum help already lists the choices.
    if flag.default not in (None, False) and not isinstance(
      flag.default, ml_collections.ConfigDict
    ):
      extra += f' (default {flag.default})'
    lines.append(f'  --{name}: {flag.help}{extra}')
  args = ''.join(f' <{p}>' for p in positional)
  return f'usage: {prog}{args} [--flag=value ...]\n\n{doc}\nflags:\n' + '\n'.join(lines)


def parse_command(
  prog: str,
  doc: str,
  flag_values: flags.FlagValues,
  argv: Sequence[str],
  positional: Sequence[str] = (),
) -> list[str]:
  """One convention for every dpjax command: absl flags in `flag_values`.

  `--help` prints `usage` and exits 0; a bad flag, config file or
  `--config.<field>` prints one line and exits 2 (`parse_flags`); exactly the
  arguments named in `positional` may follow. Returns them.
  """
  argv = list(argv)
  if any(a in ('-h', '--help', '--helpfull') for a in argv):
    print(usage(prog, doc, flag_values, positional))
    sys.exit(0)
  rest = parse_flags(prog, flag_values, [prog, *argv])[1:]
  if len(rest) != len(positional):
    want = ' '.join(f'<{p}>' for p in positional) or 'none'
    fail(prog, f'expected positional arguments: {want}; got {rest}. See --help.')
  return rest


def set_fields(config: ml_collections.ConfigDict, values: dict[str, Any]) -> None:
  """Sets each dotted field of `config` ('sampler.name') to its value, unless the value is None.

  How a command's own flags (--sampler, --delta, ...) override the fields of its --config.
  """
  for path, value in values.items():
    if value is not None:
      *parents, leaf = path.split('.')
      node = config
      for name in parents:
        node = node[name]
      node[leaf] = value


def flags_parser(prog: str) -> Callable[[list[str]], list[str]]:
  """An absl `flags_parser` (for `app.run`) of the global flags, with `parse_flags`' errors."""
  return lambda argv: parse_flags(prog, flags.FLAGS, argv)


def quiet_broken_pipe() -> None:
  """After a BrokenPipeError on stdout: point stdout at /dev/null so exit is quiet."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, sys.stdout.fileno())
  except (OSError, ValueError):
    pass
