"""The job around the ranks: starting them and joining them into one process group (launch.py),
starting them again after a failure (restarts.py), what the launcher learns of each rank
(progress.py), the run's event log (events.py), and collectives that never complete turned into
errors that name the rank (collective_timeout.py).
"""
