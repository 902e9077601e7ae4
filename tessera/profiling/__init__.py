"""`tessera profile`: what a profiled run's steps spent their time on, against the plan.

- `training.py`: a training run's report (run_dir/profile, recorded by `tessera train --profile A:B`);
- `split.py`: one rank's step split into terms, the straggler;
- `planned.py`: the planner's prediction of the same terms (tessera/plan);
- `trace.py`: the ranks' intervals as one Chrome/Perfetto trace;
- `html_report.py`, `png.py`: the pictures (a timeline per rank and a waterfall of the step).
"""
