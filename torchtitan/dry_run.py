"""Dry run of a job for N ranks in one CPU process: per-rank parameter, gradient and optimizer bytes,
pipeline stages and every validation error, without any device.

    python -m torchtitan.dry_run --world-size 512 [--ranks 0,64] [--device-type H100-80GB [--memory-headroom 0.1]] \
        --job.config_file recipe.toml [--section.key value ...]

--device-type adds the GPU's allocator and runtime overheads to the memory estimate, prints under each rank's
estimate the interval where published peaks lay beside such estimates (the planner's; flagged when its upper
end passes the device's memory) and reports a rank that would not fit as an error (the device table:
torchtitan/planning/hardware.py); --memory-headroom keeps that fraction of its memory free, as the planner's
option does.

Exits 1 when the job has a validation error, 2 on a bad command line. See docs/planning.md.
"""

import sys

from torchtitan.config import ConfigError
from torchtitan.protocols.train_spec import config_manager

USAGE = ("usage: python -m torchtitan.dry_run --world-size N [--ranks R,R,...] [--device-type NAME "
         "[--memory-headroom FRACTION]] [job options, see --help]")


def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    if flag in argv:
        i = argv.index(flag)
        if i + 1 >= len(argv):
            raise ConfigError(f"{flag} needs a value")
        return argv[i + 1], argv[:i] + argv[i + 2 :]
    return None, argv


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{config_manager().help_text()}")
        return 0
    try:
        world, argv = _take(argv, "--world-size")
        ranks, argv = _take(argv, "--ranks")
        device_type, argv = _take(argv, "--device-type")
        headroom, argv = _take(argv, "--memory-headroom")
        if headroom is not None and device_type is None:
            raise ConfigError("--memory-headroom is a share of a device's memory: add --device-type")
        if world is None or not world.isdigit() or int(world) < 1:
            raise ConfigError(f"--world-size must be a positive integer (got {world}); {USAGE}")
        if ranks is not None and not all(r.strip().isdigit() for r in ranks.split(",")):
            raise ConfigError(f"--ranks must be comma-separated rank numbers (got {ranks!r})")
        cfg = config_manager().parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from torchtitan.planning.dry_run import dry_run, format_report
    from torchtitan.planning.hardware import get_device, memory_limit

    try:
        device = get_device(device_type) if device_type else None
        memory_headroom = float(headroom or 0.0)
        if device is not None:
            memory_limit(device, memory_headroom)
    except ValueError as e:
        message = str(e) if headroom is None or "headroom" in str(e) else f"--memory-headroom must be a number: {e}"
        print(f"error: {message}", file=sys.stderr)
        return 2
    report = dry_run(cfg, int(world), None if ranks is None else [int(r) for r in ranks.split(",")], device,
                     memory_headroom)
    print(format_report(report))
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
