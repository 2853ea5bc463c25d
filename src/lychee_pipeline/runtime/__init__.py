"""The runtime under training and evaluation, Kedro-free: launching a typed job as `accelerate launch`
processes (launcher.py), the processes' signals, locks and process-group stop (processes.py), the watchdog over
the ranks' heartbeats (watchdog.py, heartbeat.py), the launcher's progress display (progress.py) and one-line
parameter errors (errors.py). It imports nothing from training, evaluation or the pipelines."""
