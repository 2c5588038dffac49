"""Planning a job before spending devices on it: dry runs on a fake process group, balanced pipeline
stages, a memory estimator and a layout planner. See docs/planning.md."""
