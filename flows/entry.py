"""Importing this module configures the process: the one place a gristmill process is configured,
and every entry point imports it before anything else.

Prefect, MLflow, Ray and Hugging Face read their settings from the environment once, when they
are imported (Prefect's home and database, telemetry, offline mode, Ray's loopback switch), so
`gristmill.infra.env.configure()` runs here, at import, and the entry points import this module first:

- the `gristmill` console script, `gristmill.flows.cli:console` (and `python -m gristmill`);
- the supervised child of `gristmill run`, `serve` and `refresh`, `python -m gristmill.flows.supervised`;
- the deployment entrypoint of prefect.yaml, `flows/deployment.py:pipeline`. A Prefect worker's
  flow-run process has imported Prefect before it loads an entrypoint, so there Prefect's own
  settings are the worker's (which point it at PREFECT_API_URL); MLflow, Ray and Hugging Face
  are still configured before the flow's imports reach them.

It is a module of its own, not `flows/__init__.py`, because configuring changes the environment
every child process inherits (PREFECT_HOME under this GRISTMILL_HOME): a test, a notebook or a
script that imports gristmill's packages and then starts runs in other homes keeps its own
environment. Only a process that is gristmill configures itself. It imports nothing of gristmill
but infra.env, so any module may import it.
"""
from __future__ import annotations

from gristmill.infra import env

env.configure()
