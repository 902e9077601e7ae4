"""What the one training loop trains: the modes by name (registry.py), the interface a mode fills
(mode.py), the language model (lm.py), an EAGLE-3 draft head against a frozen target (eagle.py),
Direct Preference Optimization against the frozen initial weights (dpo.py) and Group Relative Policy
Optimization on the serving engine's rollouts (grpo.py).
A new objective or adapter scheme is a module here and a line in registry.py.
"""
