"""Faults of the numerics, caught while training rather than after it.

    step_guard.py      the spike guard: a loss or gradient norm far above its recent window is skipped or rolled back
    replica_check.py   the cross-replica check: data-parallel replicas must hold the same weights
    training_error.py  TrainingError: the one exception both raise, shown as one line by the launcher
"""
