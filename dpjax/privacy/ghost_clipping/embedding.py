"""Norm rule of nn.Embed: the linear map of one-hot tokens, so a_s·a_s' = [tok_s = tok_s']."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from dpjax.privacy.ghost_clipping import mixed
from dpjax.privacy.ghost_clipping.mixed import HIGHEST
from dpjax.privacy.ghost_clipping.registry import register_norm_rule


def materialise(vocab: int, num_tokens: int) -> bool:
  """[n, V, D] one-hot products when V <= the token count T (cost T·V·D vs the ghost T²·D),
  unless `mixed.forced_form` says otherwise."""
  forced = mixed.forced_ghost()
  return vocab <= num_tokens if forced is None else not forced


def _embed_form(layer) -> str:
  vocab, tokens = layer.module.num_embeddings, math.prod(layer.in_aval.shape)
  return (
    f'{"materialised" if materialise(vocab, tokens) else "ghost"} '
    f'(T={tokens} tokens, V={vocab}, D={layer.module.features})'
  )


@register_norm_rule(nn.Embed, name='embed', params=({'embedding'}, {'embedding'}), form=_embed_form)
def embed_sq_norms(layer, theta: dict, a, d):
  """Materialised [n, V, D] when V <= the token count (kept for the sum), else the ghost form
  over tokens, with `mixed.with_allowance` for cancelling output gradients."""
  del theta
  n = a.shape[0]
  vocab = layer.module.num_embeddings
  tokens = a.reshape(n, -1)
  # jnp.take reads token -k as V - k; tokens out of range give NaN outputs,
  # so their rows are non-finite whatever we compute here. V = 1
  # broadcasts the one row to every token.
  tokens = jnp.where(tokens < 0, tokens + vocab, tokens) * (vocab > 1)
  d = d.reshape(n, tokens.shape[1], -1)
  if materialise(vocab, tokens.shape[1]):  # [n, V, D].
    g = jnp.einsum('nsv,nsd->nvd', jax.nn.one_hot(tokens, vocab), d, precision=HIGHEST)
    return jnp.sum(jnp.square(g), axis=(1, 2)), {'embedding': g}, None
  same = tokens[:, :, None] == tokens[:, None, :]
  gd = jnp.einsum('nsd,ntd->nst', d, d, precision=HIGHEST)
  sq = jnp.sum(jnp.where(same, gd, 0.0), axis=(1, 2))
  # The sum (the layer's vjp: a scatter-add) and this norm cancel where one token's output
  # gradients sum to ~0: the allowance of a linear map with one-hot inputs (‖a_s‖ = 1).
  return mixed.with_allowance(sq, jnp.sum(jnp.linalg.norm(d, axis=-1), axis=1)), None, None
