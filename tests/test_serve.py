"""`gristmill serve`: the `pipeline` deployment on a real Prefect server (`gristmill up`'s stack,
the `served` fixture) and its typed parameter form, as the UI draws it. Runs started from the UI,
and Retry, are tests/test_serve_browser.py's."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_the_served_deployment_has_a_typed_form(served):
    deployment = served.deployment
    assert deployment["name"] == "pipeline" and deployment["parameters"]["config"]["name"] == "tiny"
    schema = deployment["parameter_openapi_schema"]
    assert set(schema["properties"]) == {"config", "until", "overrides"}
    config_form = schema["definitions"]["PipelineConfig"]["properties"]
    assert config_form["sft"]["description"] == "Supervised fine-tuning on conversations."
    pretrain = schema["definitions"][config_form["pretrain"]["$ref"].split("/")[-1]]["properties"]
    assert pretrain["max_steps"]["type"] == "integer" and pretrain["max_steps"]["description"]
    # the served defaults are the config file with the command line's overrides (FAST)
    assert deployment["parameters"]["config"]["pretrain"]["max_steps"] == 60


def test_data_refresh_is_served_on_its_schedule(served):
    from serve_helpers import api, wait

    refresh = wait(lambda: next(iter(api(served.api, "/deployments/filter", {
        "deployments": {"name": {"any_": ["data-refresh"]}}})), None), 60, "the data-refresh deployment")
    # the served config's refresh.cron (default); `--refresh-cron` is tests/test_refresh.py's
    assert [s["schedule"]["cron"] for s in refresh["schedules"] if s["active"]] == ["0 3 * * 1"]
