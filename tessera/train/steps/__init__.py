"""The step engines: one global batch into gradients and statistics, whatever the layout
(step_engine.py: the protocol and what the engines share; single_process_step.py, parallel_step.py,
pipeline_step.py), the statistics they gather (step_stats.py), bf16 compute copies of the weights
(compute_weights.py) and fp16 loss scaling (loss_scaler.py).
"""
