"""Starting a run: everything between a validated config and the running RL loop.

    from verity.launch.run import run_training
    summary = run_training(load_config(["trainer.total_steps=50"]))

:mod:`~verity.launch.run` (the order of work), :mod:`~verity.launch.run_dir` (the output folder:
locked, moved aside on a fresh start), :mod:`~verity.launch.pools` (the run's pool requests and
their plan on the cluster), :mod:`~verity.launch.roles` (every enabled role's worker group,
started where the plan put it), :mod:`~verity.launch.shared_storage` (other nodes see the output
folder), :mod:`~verity.launch.recovery` (checkpoint restored, the loop's hooks built),
:mod:`~verity.launch.outputs` (``summary.json``, ``metrics.jsonl``, ``curves.png``).

Nothing is imported here: the shared-storage check's marker task imports
:mod:`~verity.launch.shared_storage` on far nodes, where it must not pull in torch or Hydra.
"""
