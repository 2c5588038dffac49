"""Downstream evaluation: lm-evaluation-harness tasks scored by the training ranks or on a checkpoint.

tasks.py reads task files, requests.py turns them into token windows as the harness does, scoring.py packs and
scores the windows and computes the harness's metrics, runner.py is the pass the trainer and the entry point
(`python -m torchtitan.eval CHECKPOINT`, __main__.py) run. docs/evaluation.md is the user's page.
"""
