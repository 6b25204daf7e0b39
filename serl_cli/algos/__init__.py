"""The algorithms' math: small pure functions over tensors (no model, no I/O).

core        -- group advantages, masked reductions, the PPO-clip surrogate, k3 KL, policy_loss
serl        -- SERL hindsight weights, lambda schedule, blending, placement (METHOD.md 5-6)
sdpo        -- self-distillation term on failed rollouts
gigpo       -- Group-in-Group step advantages (arXiv 2505.10978)
objectives  -- what each ``--algo`` optimizes: the registry joining this math to the learner
batch       -- the micro-batch every objective sees: stored turns as padded tensors
"""
