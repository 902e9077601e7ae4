"""The terms of the training objective: the token loss normalised over the global batch (loss.py),
knowledge distillation from a frozen teacher (distill_loss.py, teacher.py), hidden-state
matching (hidden_match.py), the DPO mode's loss on preference pairs (preference_loss.py), and GRPO's
pure parts: group advantages, the clipped policy-gradient loss, k3 KL, TIS weights (policy_gradient.py).
"""
