"""Per-example gradient norms without per-example gradients (ghost clipping).

A layer z = a·W + b applied at S positions of one example (input a_i: S×m,
output gradient δ_i = ∂loss_i/∂z_i: S×c) has the per-example gradient
g_i = a_iᵀ δ_i, hence

  ‖g_i‖² = Σ_{s,s'} (a_s·a_s')(δ_s·δ_s')   (ghost form, cost S²(m + c))
         = ‖a_iᵀ δ_i‖²_F                    (materialised, cost S·m·c)

and ‖∂b‖² = ‖Σ_s δ_s‖². With S = 1 the ghost form is ‖a_i‖²·‖δ_i‖²
(Goodfellow 2015). Li et al. 2022 use the ghost form for sequences; Bu et al.
2022 ("mixed ghost clipping") pick, per layer and statically from its shapes,
whichever of the two is cheaper. A convolution is the same with a = the input
patches (one row per output position; never formed: the input is visited
one kernel offset at a time); an embedding with a = one-hot tokens,
so a_s·a_s' = [tok_s = tok_s']. Norm layers (LayerNorm, GroupNorm, RMSNorm)
have a few parameters per channel: their per-example gradients are
materialised by a vmapped vjp of the layer itself. A weight-standardised conv
(e.g. `dpjax.models.layers.WSConv`, which registers `conv.ws_conv_sq_norms`)
uses W' = T(kernel, gain); the norm of T's vjp applied to the per-example
gradient w.r.t. W' has a closed form per output channel (see
`conv.ws_conv_sq_norms`), again ghost or materialised.

A LoRA-adapted Dense / DenseGeneral (W' = W + s·A·B, `dpjax.privacy.lora`) is two
linear maps of rank r: its rule (`lora`) weighs A and B, never the frozen W.

Capture: `flax.linen.intercept_methods` sees every call of a covered layer (for
Flax NNX layers, `nnx_layers` reports each call with its linen twin, so the same
rules and proof apply),
records its input, and adds a zero perturbation to its output; the gradient of
Σ_i loss_i w.r.t. the perturbations is δ_i for every example at once, since
examples do not interact (one backward pass through the activations, no weight
gradients). The clipped sum Σ_i f_i·g_i (f_i = w_i·min(1, C/‖g_i‖)) is then
book-kept layer by layer from the same (a, δ) (Bu et al. 2023): the vjp of the
layer w.r.t. its parameters at cotangents (f_i·δ_i)_i, i.e. the layer's usual
weight-gradient computation (for Dense the matmul aᵀ(f·δ)), with no second
pass through the network; it keeps every covered layer's input and output
gradient until then (about twice the activations). Rows with f_i = 0 or
non-finite values have their a and δ zeroed first, so 0·NaN cannot reach the
sum.

Coverage is proved at trace time, never assumed: every parameter leaf must be
read by exactly one call of a covered layer, and a dependency analysis of the
jaxpr (with each covered call's input and output replaced by fresh variables)
must show that (1) the call's output depends on exactly that layer's
parameters and (2) the loss depends on no covered parameter except through
covered outputs (tied weights, weight decay inside the loss, `Embed.attend`,
or shared layers make a parameter uncovered). Parameters declared directly in
a module that calls other modules (e.g. a transformer's positional embedding)
get one copy per example, so their per-example gradients are exact
(materialised, memory n × size). Any other parameter is uncovered;
`Coverage.complete` is False and callers must use per-example gradients.

References:
  Goodfellow 2015, "Efficient Per-Example Gradient Computations" (arXiv
    1510.01799).
  Li, Tramèr, Liang & Hashimoto 2022, "Large Language Models Can Be Strong
    Differentially Private Learners" (ICLR): ghost clipping.
  Bu, Mao & Xu 2022, "Scalable and Efficient Training of Large Convolutional
    Neural Networks with Differential Privacy" (NeurIPS): mixed ghost clipping.
  Bu, Wang, Zha & Karypis 2023, "Differentially Private Optimization on Large
    Model at Small Cost" (ICML): book-keeping.
"""

# The rules register themselves on import (one module per layer family).
from dpjax.privacy.ghost_clipping import conv
from dpjax.privacy.ghost_clipping import dense
from dpjax.privacy.ghost_clipping import embedding
from dpjax.privacy.ghost_clipping import form_timing
from dpjax.privacy.ghost_clipping import lora
from dpjax.privacy.ghost_clipping import normalization
from dpjax.privacy.ghost_clipping import whole_step
from dpjax.privacy.ghost_clipping.backward import ghost_pass
from dpjax.privacy.ghost_clipping.backward import GhostPass
from dpjax.privacy.ghost_clipping.backward import per_example_sq_norms
from dpjax.privacy.ghost_clipping.coverage import analyse_coverage
from dpjax.privacy.ghost_clipping.coverage import Coverage
from dpjax.privacy.ghost_clipping.coverage import Layer
from dpjax.privacy.ghost_clipping.coverage import LossFn
from dpjax.privacy.ghost_clipping.registry import NormRule
from dpjax.privacy.ghost_clipping.registry import register_norm_rule
from dpjax.privacy.ghost_clipping.registry import rule_for
from dpjax.privacy.ghost_clipping.registry import RULES
