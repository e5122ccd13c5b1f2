"""Fixtures of the ghost-clipping tests."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """Matmuls in float32 on every backend (GPUs default to TF32): these tests
  compare with float64 or float32 references at float32 tolerances."""
  with jax.default_matmul_precision('highest'):
    yield
