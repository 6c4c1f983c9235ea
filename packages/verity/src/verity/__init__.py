"""verity: reinforcement-learning post-training of language models.

One Python controller drives a dataflow of model roles (actor, rollout,
reference, critic, reward), each running as a worker group on Ray.
"""

from verity.errors import RunError

__version__ = "0.1.0"

__all__ = ["RunError", "__version__"]
