"""The cluster assets, checked offline: the KubeRay manifests against the RayCluster and RayJob v1
schemas (the parts of KubeRay's CRDs we rely on, written out here: no cluster, no network), no
volume shared between pods, `prefect.yaml`
with Prefect's own model and its entrypoint imported, the Accelerate configs with Accelerate's
own loader, and the Dockerfile's COPY sources against the repository."""
from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "infra" / "docker" / "Dockerfile"

_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_POD_TEMPLATE = {
    "type": "object", "required": ["spec"],
    "properties": {"spec": {
        "type": "object", "required": ["containers"],
        "properties": {"containers": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "image"],
            "properties": {"name": {"type": "string"}, "image": {"type": "string"},
                           "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                           "ports": {"type": "array", "items": {
                               "type": "object", "required": ["containerPort"],
                               "properties": {"containerPort": {"type": "integer"}}}}}}}}}},
}
_REPLICAS = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
# ray.io/v1 RayCluster as KubeRay's CRD (ray-operator/config/crd/bases/ray.io_rayclusters.yaml)
# declares it, reduced to what this manifest uses. rayStartParams is map[string]string (a YAML
# `true` or `0` is rejected by the API server), required before KubeRay 1.4, so required here.
RAYCLUSTER_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}}},
        "spec": {
            "type": "object", "required": ["headGroupSpec"],
            "properties": {
                "rayVersion": {"type": "string"},
                "headGroupSpec": {
                    "type": "object", "required": ["rayStartParams", "template"],
                    "properties": {"rayStartParams": _STRINGS, "template": _POD_TEMPLATE,
                                   "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}}},
                "workerGroupSpecs": {"type": "array", "items": {
                    "type": "object", "required": ["groupName", "rayStartParams", "template"],
                    "properties": {"groupName": {"type": "string"}, "rayStartParams": _STRINGS,
                                   "template": _POD_TEMPLATE, "replicas": _REPLICAS,
                                   "minReplicas": _REPLICAS, "maxReplicas": _REPLICAS}}},
            },
        },
    },
}
RAYJOB_V1 = {  # ray.io/v1 RayJob, reduced as above to what pipeline-job.yaml uses
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": RAYCLUSTER_V1["properties"]["metadata"],
        "spec": {
            "type": "object", "required": ["entrypoint"],
            "properties": {"entrypoint": {"type": "string"}, "clusterSelector": _STRINGS,
                           "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
                           "runtimeEnvYAML": {"type": "string"}, "submitterPodTemplate": _POD_TEMPLATE},
        },
    },
}
SCHEMAS = {"RayCluster": RAYCLUSTER_V1, "RayJob": RAYJOB_V1}
# Volumes a pod may have: its own disk. Anything another pod could also mount is a shared volume.
PRIVATE_VOLUMES = {"emptyDir", "secret", "configMap"}


def _manifests() -> dict[str, dict]:
    docs = [doc for name in ("raycluster.yaml", "pipeline-job.yaml")
            for doc in yaml.safe_load_all((REPO / "infra" / "k8s" / name).read_text())]
    return {doc["kind"]: doc for doc in docs}


def _pod_specs(manifests: dict[str, dict]) -> list[dict]:
    spec = manifests["RayCluster"]["spec"]
    return [g["template"]["spec"] for g in (spec["headGroupSpec"], *spec["workerGroupSpecs"])]


def _image_tags() -> set[str]:
    """The tags the Dockerfile's header says to build (gristmill:cpu, gristmill:cuda)."""
    return set(re.findall(r"-t (gristmill:\w+)", DOCKERFILE.read_text()))


def test_kubernetes_manifests_match_their_schema():
    manifests = _manifests()
    assert set(manifests) == set(SCHEMAS)
    for kind, doc in manifests.items():
        jsonschema.validate(doc, SCHEMAS[kind])


def test_raycluster_is_consistent_with_the_image():
    spec = _manifests()["RayCluster"]["spec"]
    assert spec["rayVersion"] == version("ray")  # KubeRay's contract: the image's Ray
    assert {c["image"] for p in _pod_specs(_manifests()) for c in p["containers"]} <= _image_tags()
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert spec["headGroupSpec"]["serviceType"] == "ClusterIP"  # not exposed outside the cluster


def test_no_pod_shares_a_volume_and_each_keeps_its_state_and_cache_on_its_own_disk():
    from gristmill.core.cache import MAX_GB_ENV

    for pod in _pod_specs(_manifests()):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for volume in volumes.values():
            assert set(volume) - {"name"} <= PRIVATE_VOLUMES, volume
        for container in pod["containers"]:
            environ = {e["name"]: e.get("value") for e in container["env"]}
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            for var in ("GRISTMILL_HOME", "GRISTMILL_CACHE"):
                assert "emptyDir" in volumes[mounts[environ[var]]], var
            limit = volumes[mounts[environ["GRISTMILL_CACHE"]]]["emptyDir"]["sizeLimit"]
            assert limit.endswith("Gi") and int(environ[MAX_GB_ENV]) < int(limit[:-2])  # evicts first


def test_the_pipeline_job_runs_on_the_cluster_through_the_bucket():
    from gristmill.flows.config import load_config

    manifests = _manifests()
    job = manifests["RayJob"]["spec"]
    assert job["clusterSelector"] == {"ray.io/cluster": manifests["RayCluster"]["metadata"]["name"]}
    command = job["entrypoint"].split("&&")[-1].split()
    assert command[:2] == ["gristmill", "run"]
    config = load_config(REPO / command[2], command[3:])  # the overrides are valid keys and values
    assert config.pretrain.launch.backend == config.sft.launch.backend == "ray"
    assert config.pretrain.launch.nodes >= 2
    assert all(source.startswith("s3://") for source in config.collect.sources)


@pytest.mark.parametrize("mistake", ["int_start_param", "no_group_name", "v1alpha1"])
def test_the_schema_rejects_common_mistakes(mistake):
    doc = _manifests()["RayCluster"]
    if mistake == "int_start_param":
        doc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    elif mistake == "no_group_name":
        del doc["spec"]["workerGroupSpecs"][0]["groupName"]
    else:
        doc["apiVersion"] = "ray.io/v1alpha1"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, RAYCLUSTER_V1)


def test_prefect_yaml_deploys_the_real_pipeline_flow():
    from prefect.cli.deploy._models import DeploymentConfig, PrefectYamlModel
    from prefect.flows import load_flow_from_entrypoint

    raw = yaml.safe_load((REPO / "prefect.yaml").read_text())
    model = PrefectYamlModel.model_validate(raw)  # Prefect's own model of the file
    for entry in raw["deployments"]:  # that model ignores unknown keys; a typo would vanish
        assert set(entry) <= set(DeploymentConfig.model_fields), set(entry) - set(DeploymentConfig.model_fields)
    assert {d.name for d in model.deployments} >= {"pipeline"}
    from gristmill.flows.pipeline import pipeline

    for deployment in model.deployments:
        flow = load_flow_from_entrypoint(str(REPO / deployment.entrypoint))
        assert flow.name == pipeline.name == "pipeline"
        assert flow.fn.__code__.co_filename == pipeline.fn.__code__.co_filename
        assert set(deployment.parameters) <= set(flow.parameters.properties)
    cluster_docs = (REPO / "docs" / "cluster.md").read_text()
    for deployment in model.deployments:  # each pool is created where a reader will look
        assert f"prefect work-pool create {deployment.work_pool.name}" in cluster_docs


def test_accelerate_configs_load_with_accelerate():
    from accelerate.commands.config.config_args import (
        ClusterConfig,
        load_config_from_file,
    )

    configs = {p.stem: load_config_from_file(str(p)) for p in sorted((REPO / "infra" / "accelerate").glob("*.yaml"))}
    assert {"ddp_cpu", "ddp_gpu", "fsdp_gpu", "multinode", "multinode_fsdp"} <= set(configs)
    for name, config in configs.items():
        assert isinstance(config, ClusterConfig), name
        assert config.num_processes % config.num_machines == 0, name  # the same GPU count per machine
        if config.num_machines > 1:
            assert config.main_process_ip and config.main_process_port, name
    assert configs["multinode_fsdp"].fsdp_config == configs["fsdp_gpu"].fsdp_config


def _copy_sources(dockerfile: str) -> list[str]:
    sources = []
    for line in dockerfile.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


def test_dockerfile_copies_what_exists_installs_the_readmes_torch_then_the_lock():
    text = DOCKERFILE.read_text()
    sources = _copy_sources(text)
    assert {"pyproject.toml", "uv.lock", "gristmill", "core", "flows", "infra", "tasks", "model",
            "configs"} <= set(sources)
    assert [s for s in sources if not (REPO / s).exists()] == []
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert not ignored & set(sources)  # excluded from the context, COPY would fail
    pin = re.search(r"pip install (?:-q )?(torch==[\d.]+) uv", (REPO / "README.md").read_text()).group(1)
    assert f"pip install {pin};" in text  # CPU: the README's exact install
    assert re.search(rf"pip install {re.escape(pin)} --index-url \"\$CUDA_INDEX\"", text)  # CUDA
    assert "uv export --locked" in text and "uv pip install --system --no-deps ." in text
    assert _image_tags() == {"gristmill:cpu", "gristmill:cuda"}


def test_the_store_manifest_sets_what_the_store_reads_and_the_ray_pods_take_it():
    from gristmill.infra.artifacts import STORE_ENV
    from gristmill.infra.remote_store import RemoteStore

    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "infra" / "k8s" / "store-s3.yaml").read_text())}
    config, secret = docs["ConfigMap"], docs["Secret"]
    assert RemoteStore(config["data"][STORE_ENV]).url.startswith("s3://")  # a URL the store accepts
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for pod in _pod_specs(_manifests()):
        for container in pod["containers"]:
            refs = {kind: ref["name"] for entry in container["envFrom"] for kind, ref in entry.items()}
            assert not any(ref.get("optional") for entry in container["envFrom"] for ref in entry.values())
            assert refs == {"configMapRef": config["metadata"]["name"], "secretRef": secret["metadata"]["name"]}
