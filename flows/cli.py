"""The `gristmill` command line.

    gristmill run configs/tiny.yaml                      # run (or reuse) the whole pipeline
    gristmill run configs/tiny.yaml sft.lr=3e-4          # dotted overrides; downstream stages re-run
    gristmill run configs/tiny.yaml --until pretrain     # stop after a stage
    gristmill run configs/tiny.yaml --dry-run            # resolved config + reuse/run per stage
    gristmill report [RUN]                               # report card of a past run (default: latest)
    gristmill compare RUN_A RUN_B                        # config, reuse and metric differences
    gristmill plan 125m                                  # Chinchilla tokens, FLOPs, GPU-hours, cost
    gristmill plan 1b --gpu-hours 500 --mfu 0.45 --price-per-gpu-hour 3
    gristmill evaluate MODEL_DIR --task hellaswag.jsonl --task arc_easy.jsonl --limit 500
    gristmill up [--print-env]                           # Prefect, MLflow and Ray servers on 127.0.0.1
    gristmill status | gristmill down                    # what `up` started: health; stop it
    gristmill serve configs/tiny.yaml                    # `pipeline` + `data-refresh` deployments, for the UI
    gristmill refresh configs/tiny.yaml                  # new inputs -> next corpus version, once
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from infra import env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gristmill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the pipeline, reusing every complete stage")
    _config_arguments(run, "YAML preset, e.g. configs/tiny.yaml")
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
    report = commands.add_parser("report", help="(re)write the report card of a past pipeline run")
    report.add_argument("run", nargs="?", help="MLflow run id or name of the pipeline run "
                                               "(default: the latest)")
    compare = commands.add_parser("compare", help="what changed between two pipeline runs: "
                                                  "config keys, stages reused vs computed, metrics")
    compare.add_argument("run_a", help="MLflow run id or name")
    compare.add_argument("run_b", help="MLflow run id or name")
    evaluate = commands.add_parser("evaluate", help="score a Hugging Face causal-LM directory on benchmark "
                                                    "files (README: Evaluation)")
    evaluate.add_argument("model_dir", type=Path, help="HF model directory (config, weights, tokenizer)")
    evaluate.add_argument("--task", action="append", required=True, metavar="FILE",
                          help="benchmark JSONL file; repeat for several")
    evaluate.add_argument("--format", help="force a format instead of recognising it from the fields: "
                                           "mc, hellaswag, mmlu, piqa, winogrande, lambada, gsm8k")
    evaluate.add_argument("--limit", type=int, help="score the first N items of each file (lm-eval's --limit)")
    evaluate.add_argument("--out", type=Path, default=Path("results.json"),
                          help="results JSON (default results.json); per-item rows go beside it "
                               "in NAME.items.jsonl")
    evaluate.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    evaluate.add_argument("--batch-size", type=int, default=16, help="requests per forward pass")
    evaluate.add_argument("--shots", type=int, default=5, help="GSM8K worked examples per prompt")
    evaluate.add_argument("--max-new-tokens", type=int, default=256, help="GSM8K generation budget")
    evaluate.add_argument("--samples", type=int, default=0,
                          help="GSM8K sampled answers per problem for pass@k (0: greedy only)")
    evaluate.add_argument("--include-flagged", action="store_true",
                          help="score MMLU-Redux items whose error_type is not 'ok' too")
    serve = commands.add_parser("serve", help="serve the `pipeline` and `data-refresh` deployments on the "
                                              "Prefect server (PREFECT_API_URL) to start runs from its UI")
    _config_arguments(serve, "YAML preset: the deployment's default parameters")
    serve.add_argument("--refresh-cron", metavar="CRON",
                       help="schedule of `data-refresh`, e.g. \"0 3 * * 1\" (default: refresh.cron)")
    refresh = commands.add_parser("refresh", help="collect what is new in collect.sources into the next "
                                                  "corpus version, once (README: Data refresh)")
    _config_arguments(refresh, "YAML preset")
    _add_stack_commands(commands)
    return parser


def _config_arguments(command: argparse.ArgumentParser, config_help: str) -> None:
    command.add_argument("config", type=Path, help=config_help)
    command.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")


def _add_stack_commands(commands) -> None:
    up = commands.add_parser("up", help="start a Prefect server, an MLflow server and a Ray head "
                                        "(README: Servers)")
    up.add_argument("--host", default="127.0.0.1",
                    help="interface to bind (default 127.0.0.1; another one exposes them to the network "
                         "and needs PREFECT_SERVER_API_AUTH_STRING and MLFLOW_AUTH_ADMIN_PASSWORD)")
    from infra.stack import Ports

    for name, default in vars(Ports()).items():
        up.add_argument(f"--{name.replace('_', '-')}-port", dest=f"{name}_port", type=int, default=default,
                        metavar="PORT", help=f"default {default}")
    up.add_argument("--print-env", action="store_true",
                    help="print only the export line on stdout: eval \"$(gristmill up --print-env)\"")
    up.add_argument("--timeout", type=float, default=180, help="seconds to wait for health (default 180)")
    commands.add_parser("status", help="what `gristmill up` started: running or not, pid, URL, health")
    commands.add_parser("down", help="stop everything `gristmill up` started")


def _stack(args: argparse.Namespace) -> int:
    home = env.configure()
    from infra import stack

    if args.command == "down":
        print(stack.format_states(stack.down(home)))
        return 0
    if args.command == "status":
        states = stack.status(home)
        print(stack.format_states(states))
        return 0 if all(s.state == "running" for s in states) else 3
    ports = stack.Ports(**{name: getattr(args, f"{name}_port") for name in vars(stack.Ports())})
    try:
        states = stack.up(home, args.host, ports, args.timeout)
    except (ValueError, FileNotFoundError) as error:
        print(f"gristmill: {error}", file=sys.stderr)
        return 2
    table = stack.format_states(states) + f"\nlogs: {stack.services_dir(home)}/<name>.log" + stack.auth_note()
    if args.print_env:
        print(table, file=sys.stderr)
        print(stack.exports(states))
    else:
        print(f"{table}\n\nto use them from a shell (or: eval \"$(gristmill up --print-env)\"):\n"
              f"{stack.exports(states)}")
    return 0 if all(s.state == "running" for s in states) else 1


def _evaluate(args: argparse.Namespace) -> int:
    from tasks.evaluate.engine import EvalOptions, evaluate_files, format_table

    if (args.limit is not None and args.limit < 1) or args.batch_size < 1 or args.samples < 0:
        print("gristmill: --limit and --batch-size must be >= 1, --samples >= 0", file=sys.stderr)
        return 2
    options = EvalOptions(batch_size=args.batch_size, shots=args.shots, max_new_tokens=args.max_new_tokens,
                          samples=args.samples, include_flagged=args.include_flagged)
    warn = lambda message: print(f"gristmill: {message}", file=sys.stderr)  # noqa: E731
    try:
        summary = evaluate_files(args.model_dir, args.task, args.out, fmt=args.format, limit=args.limit,
                                 device=args.device, options=options, warn=warn)
    except (ValueError, OSError) as error:  # EvalDataError is a ValueError naming the file
        print(f"gristmill: {error}", file=sys.stderr)
        return 2
    print(format_table(summary))
    print(f"results: {args.out} (per item: {args.out.with_name(args.out.stem + '.items.jsonl')})")
    return 0


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


def _serve(args: argparse.Namespace, extras: list[str]) -> int:
    env.configure()
    from flows.config import ConfigError, load_config
    from flows.serve import serve

    cron = [f"refresh.cron={json.dumps(args.refresh_cron)}"] if args.refresh_cron else []  # JSON: YAML-safe
    try:
        config = load_config(args.config, [*args.overrides, *extras, *cron])
        serve(config)
    except (ConfigError, ValueError) as error:
        print(f"gristmill: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _refresh(args: argparse.Namespace, extras: list[str]) -> int:
    home = env.configure()  # before prefect/mlflow are imported: they read it at import
    from flows.config import ConfigError, load_config

    try:
        config = load_config(args.config, [*args.overrides, *extras])
    except ConfigError as error:
        print(f"gristmill: {error}", file=sys.stderr)
        return 2
    from flows.refresh import data_refresh
    from infra.services import start_embedded_services

    try:
        start_embedded_services(home)
        outcome = data_refresh(config=config)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as error:  # a missing or empty source, named
        print(f"gristmill: {error}", file=sys.stderr)
        return 2
    print(outcome["reason"] if not outcome["published"] else
          f"corpus v{outcome['version']}: {outcome['collect_dir']}\n{outcome['reason']}")
    return 0


def _history(args: argparse.Namespace) -> int:
    home = env.configure()
    from flows import history

    try:
        if args.command == "compare":
            print(history.compare(home, args.run_a, args.run_b), end="")
            return 0
        md, html, missing = history.report(home, args.run)
    except LookupError as error:
        print(f"gristmill: {error.args[0]}", file=sys.stderr)
        return 2
    print(md.read_text(), end="")
    print(f"\nreport card: {md}\n             {html}")
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
    if unknown or (extras and args.command not in ("run", "serve", "refresh")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extras)}")
    if args.command == "plan":
        return _plan(args)
    if args.command == "evaluate":
        return _evaluate(args)
    if args.command == "serve":
        return _serve(args, extras)
    if args.command == "refresh":
        return _refresh(args, extras)
    if args.command in ("report", "compare"):
        return _history(args)
    if args.command in ("up", "status", "down"):
        return _stack(args)
    args.overrides = [*args.overrides, *extras]
    if not (args.in_process or args.dry_run):
        # The child plans and checks the config itself (a bad one: one line, exit 2, passed on), so
        # this process imports nothing that the child would import again.
        from infra.supervisor import supervise

        child_args = [*argv, "--in-process"]
        return supervise([sys.executable, "-m", "flows.cli", *child_args], warm_args=child_args)
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
    from core.files import DiskSpaceError
    from flows.pipeline import pipeline
    from infra.services import start_embedded_services
    from infra.supervisor import die_with_supervisor
    from infra.tracking import TrackingUnavailable, is_server, tracking_uri

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
    uri = tracking_uri(home)
    print(f"MLflow: {uri}" if is_server(uri) else f"MLflow: mlflow ui --backend-store-uri {uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
