"""The terms of the training objective: the token loss normalised over the global batch (loss.py),
knowledge distillation from a frozen teacher (distill_loss.py, teacher.py) and hidden-state
matching (hidden_match.py).
"""
