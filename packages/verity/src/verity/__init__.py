"""verity: reinforcement-learning post-training of language models.

One Python controller drives a dataflow of model roles (actor, rollout,
reference, critic, reward), each running as a worker group on Ray.
"""

__version__ = "0.1.0"
