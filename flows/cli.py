"""The `gristmill` command line.

    gristmill run configs/tiny.yaml                      # run (or reuse) the whole pipeline
    gristmill run configs/tiny.yaml sft.lr=3e-4          # dotted overrides; downstream stages re-run
    gristmill run configs/tiny.yaml --until pretrain     # stop after a stage
    gristmill run configs/tiny.yaml --dry-run            # resolved config + reuse/run per stage
    gristmill plan 125m                                  # Chinchilla tokens, FLOPs, GPU-hours, cost
    gristmill plan 1b --gpu-hours 500 --mfu 0.45 --price-per-gpu-hour 3
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from infra import env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gristmill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the pipeline, reusing every complete stage")
    run.add_argument("config", type=Path, help="YAML preset, e.g. configs/tiny.yaml")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    run.add_argument("--until", metavar="STAGE", help="run the DAG up to and including STAGE")
    run.add_argument("--dry-run", action="store_true",
                     help="print the resolved config and which stages would be reused or run")
    run.add_argument("--in-process", action="store_true",
                     help="run the pipeline in this process instead of a supervised child "
                          "(for debuggers; Ctrl-C then stops only as fast as Prefect and Ray allow)")
    plan = commands.add_parser("plan", help="compute budget of a model preset (Chinchilla tokens, "
                                            "FLOPs, GPU-hours, cost)")
    plan.add_argument("preset", help="model preset: tiny, 125m, 1b, 7b")
    budget = plan.add_mutually_exclusive_group()
    budget.add_argument("--tokens", type=float, help="training tokens (default: 20 per parameter)")
    budget.add_argument("--gpu-hours", type=float, help="compute budget in GPU-hours, converted to tokens")
    plan.add_argument("--price-per-gpu-hour", type=float, help="USD per GPU-hour (default 2.5)")
    plan.add_argument("--mfu", type=float, help="model FLOPs utilisation (default 0.4)")
    plan.add_argument("--gpu-peak-tflops", type=float,
                      help="peak dense bf16 TFLOP/s of one GPU (default 989: H100/H200 SXM)")
    plan.add_argument("--vocab-size", type=int, help="vocabulary size (default 32000)")
    return parser


def _plan(args: argparse.Namespace) -> int:
    from model.plan import format_plan, plan
    from model.presets import preset

    given = {"vocab_size": args.vocab_size, "tokens": args.tokens, "gpu_hours": args.gpu_hours,
             "price_per_gpu_hour": args.price_per_gpu_hour, "mfu": args.mfu, "peak_tflops": args.gpu_peak_tflops}
    try:
        result = plan(preset(args.preset), **{k: v for k, v in given.items() if v is not None})
    except ValueError as error:
        print(f"gristmill: {error}", file=sys.stderr)
        return 2
    print(format_plan(args.preset, result))
    return 0


def _dry_run(config, planned: list, home: Path) -> None:
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    print(f"\n# plan (artifacts under {env.artifacts_root(home)})")
    for stage in planned:
        print(f"{stage.spec.name:<9} {stage.key}  {'reuse' if stage.complete else 'run'}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    # Overrides may come after options too (`run CONFIG --until pretrain a.b=1`): argparse leaves
    # those as extras, which are taken as overrides when they look like key=value.
    args, extras = parser.parse_known_args(argv)
    unknown = [item for item in extras if "=" not in item or item.startswith("-")]
    if unknown or (extras and args.command != "run"):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extras)}")
    if args.command == "plan":
        return _plan(args)
    args.overrides = [*args.overrides, *extras]
    home = env.configure()  # before prefect/mlflow/ray are imported: they read it at import
    from flows.config import ConfigError, load_config
    from flows.dag import plan
    from infra.artifacts import ArtifactStore

    try:
        config = load_config(args.config, args.overrides)
        # Planning digests every input (core.sources): a missing or empty source is found here,
        # before any service starts.
        planned = plan(config, ArtifactStore(env.artifacts_root(home)), args.until)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"gristmill: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        _dry_run(config, planned, home)
        return 0
    if not args.in_process:
        from infra.supervisor import supervise

        return supervise([sys.executable, "-m", "flows.cli", *argv, "--in-process"])
    from core.files import DiskSpaceError
    from flows.pipeline import pipeline
    from infra.services import start_embedded_services
    from infra.supervisor import die_with_supervisor
    from infra.tracking import TrackingUnavailable, tracking_uri

    die_with_supervisor()

    try:
        start_embedded_services(home)
        outputs = pipeline(config=config, until=args.until)
    except KeyboardInterrupt:  # Ctrl-C relayed by the supervisor, which reports it in one line
        return 130
    except (TrackingUnavailable, DiskSpaceError) as error:  # after the log's traceback, one line
        cause = getattr(error, "cause", None) or error  # Ray wraps a worker's error; `cause` is it
        print(f"gristmill: {getattr(cause, 'strerror', None) or cause}", file=sys.stderr)
        return 1
    for stage, path in outputs.items():
        print(f"{stage:<9} {path}")
    print(f"MLflow: mlflow ui --backend-store-uri {tracking_uri(home)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
