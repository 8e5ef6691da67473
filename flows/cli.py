"""The `gristmill` command line: one function per command, the parser below.

    gristmill run configs/tiny.yaml                      # run (or reuse) the whole pipeline
    gristmill run configs/tiny.yaml sft.lr=3e-4          # dotted overrides; downstream stages re-run
    gristmill run configs/tiny.yaml --until pretrain     # stop after a stage
    gristmill run configs/tiny.yaml --dry-run            # resolved config + reuse/run per stage
    gristmill run configs/tiny.yaml --approve-gates      # go on past a tripped data gate (collect.gates)
    gristmill report [RUN]                               # report card of a past run (default: latest)
    gristmill compare RUN_A RUN_B                        # config, reuse and metric differences
    gristmill plan 125m                                  # Chinchilla tokens, FLOPs, GPU-hours, cost
    gristmill plan 1b --gpu-hours 500 --mfu 0.45 --price-per-gpu-hour 3
    gristmill evaluate MODEL_DIR --task hellaswag.jsonl --task arc_easy.jsonl --limit 500
    gristmill up [--print-env]                           # Prefect, MLflow and Ray servers on 127.0.0.1
    gristmill status | gristmill down                    # what `up` started: health; stop it
    gristmill serve configs/tiny.yaml                    # `pipeline` + `data-refresh` deployments, for the UI
    gristmill refresh configs/tiny.yaml                  # new inputs -> next corpus version, once
    gristmill verify [--stage STAGE] [--repair]          # re-hash committed artifacts against manifests

Guides: docs/operations.md (runs, servers, data refresh), docs/evaluation.md, docs/cluster.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gristmill.core.object_store import ObjectStoreError
from gristmill.infra import env

if TYPE_CHECKING:
    pass

# What `run` prints when a signal stopped it.
RESUME_NOTE = "finished stages and checkpoints are kept, run the same command again to resume"


def _fail(message: object) -> int:
    """Report a user's mistake in one line; the command's exit code."""
    print(f"gristmill: {message}", file=sys.stderr)
    return 2


# --- commands ---------------------------------------------------------------------------------
# `run`, `serve` and `refresh` run supervised (infra/supervisor.py): their work is done by the
# child `python -m gristmill.flows.supervised`, which checks the config itself, so this process imports
# nothing the child would import again.

def _supervised(command: str, arguments: dict, stopped_note: str = "") -> int:
    from gristmill.infra.supervisor import supervise

    return supervise([sys.executable, "-m", "gristmill.flows.supervised", command, json.dumps(arguments)],
                     stopped_note=stopped_note)


def _run(args: argparse.Namespace) -> int:
    if args.dry_run:
        return _dry_run(args)
    arguments = {"config": str(args.config), "overrides": args.overrides, "until": args.until,
                 "approve_gates": args.approve_gates}
    if args.in_process:
        from gristmill.flows import supervised
        from gristmill.infra.interrupt import catch_sigint

        with catch_sigint():
            return supervised.run(**arguments)
    return _supervised("run", arguments, RESUME_NOTE)


def _dry_run(args: argparse.Namespace) -> int:
    """The resolved config and, per stage, whether it would be reused or run: planning only."""
    import yaml

    from gristmill.flows.config import ConfigError, load_config
    from gristmill.flows.dag import demo_corpus, open_store, plan, plan_problem
    from gristmill.flows.launch import per_node_command
    from gristmill.tasks.collect.read.demo_crawl import DEMO_SOURCE

    artifacts = env.artifacts_root(env.home_path())
    try:
        config = load_config(args.config, args.overrides)
        store = open_store(config, env.home_path())  # planning reads the store: a missing one stays missing
        planned = plan(config, store, args.until)
    except (ConfigError, ValueError, FileNotFoundError, ObjectStoreError) as error:  # a bucket: one line
        return _fail(error)
    problem = plan_problem(planned, store, env.home_path())  # as the run would, before any output
    # a stage on several nodes without Ray cannot run from here: its per-node commands below are
    # the answer, so the plan is printed before the problem; any other problem is the output
    by_hand = [s for s in planned if not s.complete and s.launch is not None
               and s.launch.backend == "accelerate" and s.launch.nodes > 1]
    if problem and not by_hand:
        return _fail(problem)
    if not args.explain:
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    if demo := demo_corpus(planned):  # before the plan, whose rows scripts read up to the end
        digest, difference = demo
        print(f"\n# {DEMO_SOURCE} (collect): {digest}")
        if difference:
            print(f"gristmill: {difference}", file=sys.stderr)
    print(f"\n# plan (artifacts under {artifacts})")
    for stage in planned:
        print(f"{stage.spec.name:<9} {stage.key}  {'reuse' if stage.complete else 'run'}")
    if args.explain:
        from gristmill.flows.explain import explain, format_reasons

        print("\n# why each stage that runs does: what differs from the nearest artifact in the store")
        print(format_reasons(explain(planned, store)), end="")
    for stage in planned:
        launch = stage.launch
        if not stage.complete and launch is not None and launch.backend == "accelerate":
            print(f"\n# {stage.spec.name}-{stage.key} without Ray, on {launch.nodes} node(s) that share "
                  f"GRISTMILL_HOME: on each, NODE_RANK 0..{launch.nodes - 1}, HEAD_IP the address of node 0\n"
                  f"{per_node_command(stage, str(args.config), args.overrides, launch.nodes)}")
    return _fail(problem) if problem else 0


def _serve(args: argparse.Namespace) -> int:
    cron = [f"refresh.cron={json.dumps(args.refresh_cron)}"] if args.refresh_cron else []  # JSON: YAML-safe
    return _supervised("serve", {"config": str(args.config), "overrides": [*args.overrides, *cron]})


def _refresh(args: argparse.Namespace) -> int:
    return _supervised("refresh", {"config": str(args.config), "overrides": args.overrides,
                                   "approve_gates": args.approve_gates})


def _report(args: argparse.Namespace) -> int:
    from gristmill.flows import history

    try:
        md, html, _ = history.report(env.gristmill_home(), args.run)
    except LookupError as error:
        return _fail(error.args[0])
    print(md.read_text(), end="")
    print(f"\nreport card: {md}\n             {html}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from gristmill.flows import history

    try:
        print(history.compare(env.gristmill_home(), args.run_a, args.run_b), end="")
    except LookupError as error:
        return _fail(error.args[0])
    return 0


def _verify(args: argparse.Namespace) -> int:
    from gristmill.flows.stages import STAGE_NAMES, contracts
    from gristmill.flows.verify import StoreNotWritable, verify
    from gristmill.infra.artifacts import home_store

    if args.stage is not None and args.stage not in STAGE_NAMES:
        return _fail(f"--stage {args.stage!r} is not a stage; choose one of {', '.join(STAGE_NAMES)}")
    store = home_store(env.home_path(), contracts=contracts())
    if not store.root.is_dir():
        return _fail(f"no artifact store at {store.root}: point GRISTMILL_HOME at the home of your runs")
    try:
        return verify(store, args.stage, args.repair)
    except StoreNotWritable as error:
        return _fail(error)


def _plan(args: argparse.Namespace) -> int:
    from gristmill.model.plan import format_plan, plan
    from gristmill.model.presets import preset

    given = {"vocab_size": args.vocab_size, "tokens": args.tokens, "gpu_hours": args.gpu_hours,
             "price_per_gpu_hour": args.price_per_gpu_hour, "mfu": args.mfu,
             "peak_tflops": args.gpu_peak_tflops}
    try:
        result = plan(preset(args.preset), **{k: v for k, v in given.items() if v is not None})
    except ValueError as error:
        return _fail(error)
    print(format_plan(args.preset, result))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from gristmill.tasks.evaluate.engine import EvalOptions, evaluate_files, format_table

    if (args.limit is not None and args.limit < 1) or args.batch_size < 1 or args.samples < 0:
        return _fail("--limit and --batch-size must be >= 1, --samples >= 0")
    options = EvalOptions(batch_size=args.batch_size, shots=args.shots, max_new_tokens=args.max_new_tokens,
                          samples=args.samples, include_flagged=args.include_flagged)
    delimiters = {}
    for item in args.delimiter:
        name, sep, text = item.partition("=")
        if not sep or not name:
            return _fail(f"--delimiter {item!r}: expected TASK=TEXT")
        try:  # JSON string escapes, so a shell can pass \n; strict=False lets a real newline through
            delimiters[name] = json.loads(f'"{text}"', strict=False)
        except json.JSONDecodeError:
            return _fail(f"--delimiter {item!r}: TEXT is not a JSON string body (escape \\ and \")")
    try:
        summary = evaluate_files(args.model_dir, args.task, args.out, fmt=args.format, limit=args.limit,
                                 delimiters=delimiters, device=args.device, options=options,
                                 warn=lambda message: print(f"gristmill: {message}", file=sys.stderr))
    except (ValueError, OSError) as error:  # EvalDataError is a ValueError naming the file
        return _fail(error)
    print(format_table(summary))
    print(f"results: {args.out} (per item: {args.out.with_name(args.out.stem + '.items.jsonl')})")
    return 0


def _up(args: argparse.Namespace) -> int:
    from gristmill.infra import stack

    home = env.gristmill_home()
    ports = stack.Ports(**{name: getattr(args, f"{name}_port") for name in vars(stack.Ports())})
    try:
        states = stack.up(home, args.host, ports, args.timeout, artifacts=args.artifacts_destination)
    except (ValueError, FileNotFoundError) as error:
        return _fail(error)
    table = stack.format_states(states) + f"\nlogs: {stack.services_dir(home)}/<name>.log" + stack.auth_note()
    if args.print_env:
        print(table, file=sys.stderr)
        print(stack.exports(states))
    else:
        print(f"{table}\n\nto use them from a shell (or: eval \"$(gristmill up --print-env)\"):\n"
              f"{stack.exports(states)}")
    return 0 if all(s.state == "running" for s in states) else 1


def _status(args: argparse.Namespace) -> int:
    from gristmill.infra import stack

    states = stack.status(env.gristmill_home())
    print(stack.format_states(states))
    return 0 if all(s.state == "running" for s in states) else 3


def _down(args: argparse.Namespace) -> int:
    from gristmill.infra import stack

    print(stack.format_states(stack.down(env.gristmill_home())))
    return 0


# --- the parser -------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gristmill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = _command(commands, _run, "run", "run the pipeline, reusing every complete stage")
    _config_arguments(run, "YAML preset, e.g. configs/tiny.yaml")
    run.add_argument("--until", metavar="STAGE", help="run the DAG up to and including STAGE")
    run.add_argument("--dry-run", action="store_true",
                     help="print the resolved config and which stages would be reused or run")
    run.add_argument("--explain", action="store_true",
                     help="with --dry-run: for each stage that would run, what differs from the nearest "
                          "artifact of that stage in the store (config keys, upstream, code version, inputs)")
    _approve_gates_argument(run)
    run.add_argument("--in-process", action="store_true",
                     help="run the pipeline in this process instead of a supervised child "
                          "(for debuggers; Ctrl-C then stops only as fast as Prefect and Ray allow)")
    _add_plan(commands)
    report = _command(commands, _report, "report", "(re)write the report card of a past pipeline run")
    report.add_argument("run", nargs="?", help="MLflow run id or name of the pipeline run "
                                               "(default: the latest)")
    compare = _command(commands, _compare, "compare", "what changed between two pipeline runs: "
                                                      "config keys, stages reused vs computed, metrics")
    compare.add_argument("run_a", help="MLflow run id or name")
    compare.add_argument("run_b", help="MLflow run id or name")
    _add_evaluate(commands)
    serve = _command(commands, _serve, "serve", "serve the `pipeline` and `data-refresh` deployments "
                                                "on the Prefect server (PREFECT_API_URL) to start runs "
                                                "from its UI")
    _config_arguments(serve, "YAML preset: the deployment's default parameters")
    serve.add_argument("--refresh-cron", metavar="CRON",
                       help="schedule of `data-refresh`, e.g. \"0 3 * * 1\" (default: refresh.cron)")
    refresh = _command(commands, _refresh, "refresh", "collect what is new in collect.sources into the "
                                                      "next corpus version, once (docs/operations.md#data-refresh)")
    _config_arguments(refresh, "YAML preset")
    _approve_gates_argument(refresh)
    verify = _command(commands, _verify, "verify", "account for every entry of the artifact store and "
                                                   "re-hash every committed artifact against its manifest")
    verify.add_argument("--stage", help="only this stage's artifacts")
    verify.add_argument("--repair", action="store_true",
                        help="set each damaged artifact, and the ones computed from it, and each unknown "
                             "entry aside (<name>.corrupt-<time>), so the next run recomputes them; seal "
                             "the manifests of artifacts committed before manifests were sealed")
    _add_stack(commands)
    return parser


def _command(commands, func, name: str, summary: str) -> argparse.ArgumentParser:
    """The subcommand `name`, which runs `func(args)`; `summary` heads its --help too."""
    command = commands.add_parser(name, help=summary, description=summary)
    command.set_defaults(func=func)
    return command


def _config_arguments(command: argparse.ArgumentParser, config_help: str) -> None:
    command.add_argument("config", type=Path, help=config_help)
    # A `*` positional without a default counts as required in argparse's usage errors.
    command.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                         help="dotted config overrides")


def _approve_gates_argument(command: argparse.ArgumentParser) -> None:
    command.add_argument("--approve-gates", action="store_true",
                         help="go on when a data gate trips (collect.gates: what collect removed) instead of "
                              "stopping with exit 3; recorded as an approval (docs/operations.md#data-gates)")


def _add_plan(commands) -> None:
    plan = _command(commands, _plan, "plan", "compute budget of a model preset (Chinchilla tokens, "
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


def _add_evaluate(commands) -> None:
    evaluate = _command(commands, _evaluate, "evaluate", "score a Hugging Face causal-LM directory on "
                                                         "benchmark files (docs/evaluation.md)")
    evaluate.add_argument("model_dir", type=Path, help="HF model directory (config, weights, tokenizer)")
    evaluate.add_argument("--task", action="append", required=True, metavar="FILE",
                          help="benchmark JSONL file; repeat for several")
    evaluate.add_argument("--format", help="force a format instead of recognising it from the fields: "
                                           "mc, hellaswag, mmlu, piqa, winogrande, lambada, gsm8k")
    evaluate.add_argument("--limit", type=int,
                          help="score the first N items of each file (lm-eval's --limit)")
    evaluate.add_argument("--delimiter", action="append", default=[], metavar="TASK=TEXT",
                          help="text between query and choice for the llm-foundry multiple-choice file "
                               "of that task name (JSON escapes: copa_part1='\\nAnswer: '); default: "
                               "its task's (docs/evaluation.md#formats); repeat for several")
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


def _add_stack(commands) -> None:
    from gristmill.infra.stack import Ports

    up = _command(commands, _up, "up", "start a Prefect server, an MLflow server and a Ray head "
                                       "(docs/operations.md#servers-gristmill-up)")
    up.add_argument("--host", default="127.0.0.1",
                    help="interface to bind (default 127.0.0.1; another one exposes them to the network "
                         "and needs PREFECT_SERVER_API_AUTH_STRING and MLFLOW_AUTH_ADMIN_PASSWORD)")
    for name, default in vars(Ports()).items():
        up.add_argument(f"--{name.replace('_', '-')}-port", dest=f"{name}_port", type=int, default=default,
                        metavar="PORT", help=f"default {default}")
    up.add_argument("--print-env", action="store_true",
                    help="print only the export line on stdout: eval \"$(gristmill up --print-env)\"")
    up.add_argument("--artifacts-destination", metavar="URI",
                    help="where MLflow keeps artifacts and logged models (default: the mlflow-artifacts prefix "
                         "of GRISTMILL_STORE's bucket when that is s3://, else $GRISTMILL_HOME/mlruns)")
    up.add_argument("--timeout", type=float, default=180, help="seconds to wait for health (default 180)")
    _command(commands, _status, "status", "what `gristmill up` started: running or not, pid, URL, health")
    _command(commands, _down, "down", "stop everything `gristmill up` started")


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the command line) and run its command; the exit code."""
    parser = _parser()
    # Overrides may come after options too (`run CONFIG --until pretrain a.b=1`): argparse leaves
    # those as extras, taken as overrides when they look like key=value.
    args, extras = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    unknown = [item for item in extras if "=" not in item or item.startswith("-")]
    if unknown or (extras and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extras)}")
    if extras:
        args.overrides = [*args.overrides, *extras]
    return args.func(args)


def console() -> int:
    """The `gristmill` console script (and `python -m gristmill`): the process is configured
    first (flows/entry.py), then the command line runs. `main` alone leaves the environment as
    it is (a test calls it in its own process). `verify` and `run --dry-run` only read a home and
    import nothing that needs configuring: they run as they are, so a home that does not exist
    (the wrong working directory) is not created."""
    if not _reads_only(sys.argv[1:]):
        try:
            import gristmill.flows.entry  # noqa: F401
        except env.HomeError as error:  # GRISTMILL_HOME a file, or read-only
            return _fail(error)
    return main()


def _reads_only(argv: list[str]) -> bool:
    return bool(argv) and (argv[0] == "verify" or (argv[0] == "run" and "--dry-run" in argv))


if __name__ == "__main__":
    sys.exit(console())
