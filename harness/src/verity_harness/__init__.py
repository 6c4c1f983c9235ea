"""verity-harness: rerun recipes, hold them to the metrics they promise, publish leaderboards.

    verity-harness run grpo                      # the recipe's CPU config on this machine
    verity-harness run ppo --config gsm8k-qwen2.5-0.5b model.path=/models/qwen
    verity-harness compare RUN_A RUN_B           # result files, run directories or MLflow run ids
    verity-harness leaderboard                   # leaderboards/*.html from results and MLflow runs

A recipe is a package (``recipes/<name>``) holding ``configs/<config>.yaml`` and
``expected/<hardware>-<backend>.yaml``; see :mod:`verity_harness.recipes` and
:mod:`verity_harness.expected`.
"""

__version__ = "0.1.0"
