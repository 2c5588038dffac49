"""The error a run raises when it cannot go on for a reason the user can act on (a NaN loss, a guard's event
limit, replicas that disagree). Defined here, below the trainer and its components, so that every layer that
raises it can; torchtitan/errors.py lists it among the user errors."""


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. the loss became NaN); the message says where and why."""
