"""The supervised child of `gristmill run`, `serve` and `refresh` (infra/supervisor.py):

    python -m gristmill.flows.supervised COMMAND 'ARGUMENTS AS JSON'

The CLI (flows/cli.py) starts it in a session of its own with the command's parsed arguments;
it configures the process first (flows/entry.py), watches its supervisor, checks the config (a
bad one: one line on stderr, exit 2, passed on by the supervisor) and does the work.
`gristmill run --in-process` calls `run` here in the CLI's own process instead. A data gate that
trips where no one can be asked (flows/gates.py) ends `run` and `refresh` with one line naming it,
exit 3 (`GATE_EXIT`); a person's rejection with one line, exit 1. Inputs a stage finds unusable
when it reads them (core/stage.InputError: no source yielded a document, an unknown crawl) end
them with one line, exit 2, and Prefect's log of the failed task and flow keeps its lines but not
their traceback.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gristmill.core.object_store import ObjectStoreError
from gristmill.core.stage import InputError
from gristmill.infra import env
from gristmill.infra.services import EmbeddedServices

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State

    from gristmill.flows.config import PipelineConfig

GATE_EXIT = 3  # a data gate tripped: approve (--approve-gates) or loosen collect.gates
PREFECT_RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")  # where Prefect logs a run's exception


def _returned(value: dict[str, Any] | State) -> dict[str, Any]:
    """What a flow call returned. Prefect raises the error of a Failed state its flow returns, so
    a call that returns gives the flow's outputs."""
    if not isinstance(value, dict):
        raise TypeError(f"the flow returned {value!r}, not its outputs")
    return value


def _fail(error: object) -> int:
    print(f"gristmill: {error}", file=sys.stderr)
    return 2


def _load(config: str, overrides: list[str]) -> PipelineConfig:
    """The config file with its overrides applied (ConfigError names a bad key or value)."""
    from gristmill.flows.config import load_config

    return load_config(Path(config), overrides)


def _no_input_error_traceback(record: logging.LogRecord) -> bool:
    """A log filter: an InputError is the user's data, not a crash, and the one line this process
    prints says all of it, so Prefect's record of it keeps its line without the traceback."""
    if record.exc_info and isinstance(record.exc_info[1], InputError):
        record.exc_info = None
    return True


def _quiet_input_errors() -> None:
    """Prefect's logs of a failed task and flow without an InputError's traceback."""
    for name in PREFECT_RUN_LOGGERS:
        logging.getLogger(name).addFilter(_no_input_error_traceback)


def _gates(error: Exception) -> int:
    """The one line of a run stopped at the data gates; its exit code."""
    from gristmill.flows.gates import GatesStopped

    print(f"gristmill: {error}", file=sys.stderr)
    return GATE_EXIT if isinstance(error, GatesStopped) else 1


def run(config: str, overrides: list[str], until: str | None = None, approve_gates: bool = False) -> int:
    """Plan the run, start the embedded services a run needs and run the pipeline flow."""
    from gristmill.flows.config import ConfigError
    from gristmill.flows.dag import demo_corpus, open_store, plan, plan_problem

    home = env.gristmill_home()
    try:
        pipeline_config = _load(config, overrides)
        store = open_store(pipeline_config, home)
        # Planning digests every input (core.sources): a missing or empty source, an object store
        # without credentials, a host that does not answer are found here, before any service starts.
        planned = plan(pipeline_config, store, until)
    except (ConfigError, ValueError, FileNotFoundError, ObjectStoreError) as error:  # a bucket: one line
        return _fail(error)
    if problem := plan_problem(planned, store, home):
        return _fail(problem)
    if (demo := demo_corpus(planned)) and demo[1]:  # not the reference corpus: the run goes on
        print(f"gristmill: {demo[1]}", file=sys.stderr)
    services = EmbeddedServices(home)
    services.launch()  # Prefect's server boots beside the imports below (docs/benchmarks.md)
    return _run(pipeline_config, services, until, approve_gates)


def _run(pipeline_config: PipelineConfig, services: EmbeddedServices, until: str | None,
         approve_gates: bool) -> int:
    from gristmill.core.files import DiskSpaceError
    from gristmill.flows.gates import GatesRejected, GatesStopped
    from gristmill.flows.pipeline import pipeline
    from gristmill.infra.launch import LaunchFailed
    from gristmill.infra.tracking import TrackingUnavailable, is_server, tracking_uri

    _quiet_input_errors()
    try:
        services.ready()
        outputs = pipeline(config=pipeline_config, until=until, approve_gates=approve_gates)
    except KeyboardInterrupt:  # Ctrl-C relayed by the supervisor, which reports it in one line
        return 130
    except (GatesStopped, GatesRejected) as error:
        return _gates(error)
    except InputError as error:  # finished stages and a stage's finished work units are kept
        return _fail(error)
    # after the log's traceback, one line
    except (TrackingUnavailable, DiskSpaceError, LaunchFailed, ObjectStoreError) as error:
        cause = getattr(error, "cause", None) or error  # Ray wraps a worker's error; `cause` is it
        print(f"gristmill: {getattr(cause, 'strerror', None) or cause}", file=sys.stderr)
        return 1
    for stage, path in _returned(outputs).items():
        print(f"{stage:<9} {path}")
    uri = tracking_uri(services.home)
    print(f"MLflow: {uri}" if is_server(uri) else f"MLflow: mlflow ui --backend-store-uri {uri}")
    return 0


def serve(config: str, overrides: list[str]) -> int:
    """Serve the deployments (flows/serve.py) until stopped."""
    from gristmill.flows.config import ConfigError
    from gristmill.flows.serve import serve as serve_deployments

    try:
        serve_deployments(_load(config, overrides))
    except (ConfigError, ValueError) as error:
        return _fail(error)
    except KeyboardInterrupt:
        return 130
    return 0


def refresh(config: str, overrides: list[str], approve_gates: bool = False) -> int:
    """Collect what is new in collect.sources into the next corpus version, once (flows/refresh.py)."""
    from gristmill.flows.config import ConfigError

    try:
        pipeline_config = _load(config, overrides)
    except ConfigError as error:
        return _fail(error)
    services = EmbeddedServices(env.gristmill_home())
    services.launch()
    from gristmill.flows.gates import GatesRejected, GatesStopped
    from gristmill.flows.refresh import data_refresh

    _quiet_input_errors()
    try:
        services.ready()
        outcome = _returned(data_refresh(config=pipeline_config, approve_gates=approve_gates))
    except KeyboardInterrupt:
        return 130
    except (GatesStopped, GatesRejected) as error:
        return _gates(error)
    except (ValueError, FileNotFoundError, ObjectStoreError) as error:  # a missing or empty source, a bucket, named
        return _fail(error)
    print(outcome["reason"] if not outcome["published"] else
          f"corpus v{outcome['version']}: {outcome['collect_dir']}\n{outcome['reason']}")
    return 0


COMMANDS = {"run": run, "serve": serve, "refresh": refresh}


def main(argv: list[str]) -> int:
    """`COMMAND 'ARGUMENTS AS JSON'`, as flows/cli.py starts it."""
    from gristmill.infra.interrupt import catch_sigint
    from gristmill.infra.supervisor import die_with_supervisor

    command, arguments = argv
    die_with_supervisor()
    with catch_sigint():  # the supervisor relays Ctrl-C as SIGINT
        return COMMANDS[command](**json.loads(arguments))


if __name__ == "__main__":
    import gristmill.flows.entry  # noqa: F401  first: configures the process before the command imports anything

    sys.exit(main(sys.argv[1:]))
