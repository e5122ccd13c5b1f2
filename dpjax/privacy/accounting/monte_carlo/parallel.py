"""Chunks of samples as independent random streams, run serially or in worker processes;
the sums do not depend on the number of workers (see the package docstring)."""

from __future__ import annotations

from concurrent import futures
import math
import multiprocessing
import os

import numpy as np

from dpjax.privacy.accounting.monte_carlo.sampling import LOG_SCALE_TRIVIAL
from dpjax.privacy.accounting.monte_carlo.sampling import Plan
from dpjax.privacy.accounting.monte_carlo.sampling import hockey_stick_sum
from dpjax.privacy.accounting.monte_carlo.validation import Seed

# CPU seconds a spawned worker spends importing numpy, scipy and dp_accounting before it draws.
WORKER_START_SECONDS = 4.0


def chunk_tasks(plan: Plan, seed: Seed, key: tuple[int, int], num_samples: int) -> list[tuple]:
  """(plan, stream, size) per chunk; chunk c draws from SeedSequence(seed, spawn_key=(*key, c)).

  key = (direction index, conditioning group index). No chunks for a trivial plan.
  """
  if plan.log_scale < LOG_SCALE_TRIVIAL:
    return []
  size = plan.chunk_size()
  return [
    (plan, np.random.SeedSequence(seed, spawn_key=(*key, c)), min(size, num_samples - start))
    for c, start in enumerate(range(0, num_samples, size))
  ]


def sample_chunk(
  plan: Plan, stream: np.random.SeedSequence, size: int
) -> tuple[np.ndarray, np.ndarray]:
  """(loss, weight) of one chunk (runs in a worker process)."""
  return plan.sample(np.random.default_rng(stream), size)


def sum_chunk(
  plan: Plan, stream: np.random.SeedSequence, size: int, epsilons: np.ndarray
) -> np.ndarray:
  """Σ_i f_i(ε_j) of one chunk (runs in a worker process)."""
  loss, weight = sample_chunk(plan, stream, size)
  return hockey_stick_sum(plan.direction, loss, weight, epsilons)


# In a worker process of `run`: the shared [front, back) bounds of the unclaimed tasks.
_worker_claims = None


def _init_worker(claims) -> None:
  global _worker_claims
  _worker_claims = claims


def _claim(claims, from_front: bool) -> int | None:
  """Claims the next unclaimed task index from one end of [front, back), or None if none."""
  with claims.get_lock():
    front, back = claims[0], claims[1]
    if front >= back:
      return None
    if from_front:
      claims[0] = front + 1
      return front
    claims[1] = back - 1
    return back - 1


def _drain(fn, tasks: list[tuple], from_front: bool = True, claims=None) -> dict[int, object]:
  """{index: fn(*task)} for the tasks this process claims, one at a time, until none is left."""
  claims = _worker_claims if claims is None else claims
  done = {}
  while (i := _claim(claims, from_front)) is not None:
    done[i] = fn(*tasks[i])
  return done


def run(fn, tasks: list[tuple], workers: int) -> list:
  """[fn(*task) for task in tasks], in order, by `workers` processes: this one and workers − 1.

  The others are spawned ('spawn': fork after JAX initialisation is unsafe) and claim tasks
  from the front of a shared counter, this process from the back, so none waits for another to
  start (each first imports dp_accounting) and a process that starts after the tasks are all
  claimed is not waited for.
  """
  if workers == 1 or len(tasks) <= 1:
    return [fn(*task) for task in tasks]
  context = multiprocessing.get_context('spawn')
  claims = context.Array('q', [0, len(tasks)])
  num_others = min(workers - 1, len(tasks) - 1)
  pool = futures.ProcessPoolExecutor(
    num_others, mp_context=context, initializer=_init_worker, initargs=(claims,)
  )
  try:
    others = {pool.submit(_drain, fn, tasks) for _ in range(num_others)}
    for future in others:  # a late process unpickles `claims` at start: keep it alive until then
      future.add_done_callback(lambda _, keep=claims: keep)
    done = _drain(fn, tasks, from_front=False, claims=claims)
    while len(done) < len(tasks) and others:  # wait only for processes that claimed tasks
      finished, others = futures.wait(others, return_when=futures.FIRST_COMPLETED)
      for future in finished:
        done.update(future.result())
    return [done[i] for i in range(len(tasks))]
  finally:
    with claims.get_lock():  # on an error here, the others stop after their current task
      claims[0] = claims[1]
    pool.shutdown(wait=False, cancel_futures=True)


def direction_rngs(seed: Seed, count: int = 1):
  """Independent generators per direction (and per conditioning level) from one seed (Poisson)."""
  remove, add = np.random.SeedSequence(seed).spawn(2)
  return (
    [np.random.default_rng(s) for s in remove.spawn(count)],
    [np.random.default_rng(s) for s in add.spawn(count)],
  )


def available_cores() -> int:
  """Cores this process may run on (`os.process_cpu_count`, Python ≥ 3.13, else the affinity)."""
  count = getattr(os, 'process_cpu_count', None)
  if count is not None:
    return max(1, count() or 1)
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # no affinity on this platform
    return max(1, os.cpu_count() or 1)


def default_workers(estimated_seconds: float) -> int:
  """Processes for work of `estimated_seconds` when the caller did not choose: the available
  cores, but only as many as the work keeps busy for at least WORKER_START_SECONDS each (a
  worker that starts after the chunks are claimed costs its imports and helps nothing)."""
  return max(1, min(available_cores(), math.floor(estimated_seconds / WORKER_START_SECONDS)))
