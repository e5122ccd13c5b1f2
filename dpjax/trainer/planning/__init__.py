"""The config resolved once, before any compute, into a typed `plan.RunPlan`: σ and everything
else that enters ε (`privacy_resolution`), the typed blocks the loop reads (`plan_blocks`), the
privacy fingerprint, N, `init_from` and the physical batch size."""
