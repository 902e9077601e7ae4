"""The run around the loop: where a process sits in the job (layout.py), the run directory and its
checkpoints (directory.py, train_checkpoint.py, rng_state.py), what a step logs and where
(metric_record.py, metrics_writer.py, throughput.py, comm_metrics.py, rank_timing.py, console.py),
the loss-spike rule, the stop signal, and benchmark tasks at each evaluation.
"""
