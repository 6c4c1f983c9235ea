"""Held-out evaluation: what ``verity train`` validates with and what ``verity eval`` reports.

:mod:`~verity.evaluation.validation` (the one held-out path through the actor's workers:
one-response accuracy, avg@k, pass@k, maj@k, named ``val/...``), :mod:`~verity.evaluation.held_out`
(``verity eval``: a model and files, evaluated in this process through the same metrics),
:mod:`~verity.evaluation.greedy` (greedy accuracy of an in-process model on rows, scored by
their synthetic task: the SFT warm-start's check).
"""
