"""What each layer saves for backward, as terms the planner sums (`tessera.plan.activations`): attention and MLP
layers (activation_terms.py, saved_terms.py), the recomputation policies' (recompute_terms.py), and a recurrent
mixer's chunked form (recurrent_terms.py)."""
