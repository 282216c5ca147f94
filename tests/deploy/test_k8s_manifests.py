"""Every manifest under deploy/ is valid against the Kubernetes schemas (and the training
operator's, for the PyTorchJob), and what `kubectl apply -k` generates is what the pods mount.

The ConfigMap and Secret are rendered from a real job config and the real `megascale secret`
output; a manifest broken in any of the ways below fails the validator.
"""

from __future__ import annotations

import base64
import copy
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from megascale import cli
from megascale.config import default_config_path
from megascale.resilience.driver.roster import load_roster
from tests.deploy.k8s_schemas import ManifestError, render_kustomization, validate

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SOURCES = (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName"))  # volume kinds generated
KUSTOMIZATIONS = sorted(path.parent for path in DEPLOY.rglob("kustomization.yaml"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a user puts beside a kustomization.yaml: the job's config and a `megascale secret`."""
    directory = tmp_path_factory.mktemp("inputs")
    shutil.copy(default_config_path(), directory / "job.toml")
    assert cli.main(["secret", str(directory / "job-secret"), "--name", "megascale-driver"]) == 0
    return directory


@pytest.fixture(scope="module")
def rendered(inputs: Path) -> dict[Path, list[dict[str, Any]]]:
    return {directory: render_kustomization(directory, inputs) for directory in KUSTOMIZATIONS}


def load(relative: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / relative).read_text()) if doc]


def pod_templates(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if obj["kind"] in ("Deployment", "StatefulSet"):
        yield obj["spec"]["template"]
    elif obj["kind"] == "PyTorchJob":
        yield from (replica["template"] for replica in obj["spec"]["pytorchReplicaSpecs"].values())


def test_every_yaml_document_under_deploy_is_valid(rendered: dict[Path, list[dict[str, Any]]]) -> None:
    kinds = set()
    files = sorted(path for path in DEPLOY.rglob("*.y*ml") if path.name != "kustomization.yaml")
    for path in files:
        for doc in load(str(path.relative_to(DEPLOY))):
            validate(doc)
            kinds.add(doc["kind"])
    for objects in rendered.values():  # what `kubectl apply -k` sends, generated objects included
        for obj in objects:
            validate(obj)
            kinds.add(obj["kind"])
    assert kinds >= {
        "Service",
        "Deployment",
        "StatefulSet",
        "PersistentVolumeClaim",
        "NetworkPolicy",
        "PyTorchJob",
        "ConfigMap",
        "Secret",
    }, kinds
    applied = {
        directory / name
        for directory in KUSTOMIZATIONS
        for name in yaml.safe_load((directory / "kustomization.yaml").read_text())["resources"]
    }
    assert set(files) <= applied, f"not in any kustomization: {sorted(set(files) - applied)}"


def test_the_generated_config_and_secret_are_what_the_pods_mount(
    rendered: dict[Path, list[dict[str, Any]]], inputs: Path
) -> None:
    for directory, objects in rendered.items():
        data = {
            (obj["kind"], obj["metadata"]["name"]): obj["data"]
            for obj in objects
            if obj["kind"] in ("ConfigMap", "Secret")
        }
        for obj in objects:
            for template in pod_templates(obj):
                volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
                for volume in volumes.values():
                    for kind, source, name_key in SOURCES:
                        if source in volume:
                            keys = data.get((kind, volume[source][name_key]))
                            assert keys is not None, f"{directory.name}: {volume} names no generated {kind}"
                            assert {item["key"] for item in volume[source].get("items", [])} <= set(keys)
                for container in template["spec"]["containers"]:
                    command = container["command"]
                    if "--config" not in command:
                        continue
                    config = command[command.index("--config") + 1]  # the file on the generated ConfigMap
                    mount = next(m for m in container["volumeMounts"] if config.startswith(m["mountPath"] + "/"))
                    keys = data[("ConfigMap", volumes[mount["name"]]["configMap"]["name"])]
                    key = config[len(mount["mountPath"]) + 1 :]
                    assert key in keys, f"{directory.name}: --config {config}, but the ConfigMap holds {sorted(keys)}"
                    assert keys[key] == (inputs / "job.toml").read_text()
    driver = rendered[DEPLOY / "kubernetes"]
    secret = next(obj for obj in driver if obj["kind"] == "Secret")
    made = sorted(p.name for p in (inputs / "job-secret").iterdir())
    assert sorted(secret["data"]) == made == ["operator", "tls.crt", "tls.key", "token"]
    assert base64.b64decode(secret["data"]["token"]) == (inputs / "job-secret" / "token").read_bytes()
    executors = next(obj for obj in driver if obj["kind"] == "StatefulSet")
    mounted = next(v["secret"] for v in executors["spec"]["template"]["spec"]["volumes"] if "secret" in v)
    assert [item["key"] for item in mounted["items"]] == ["token", "tls.crt"]  # never the key or operator token


def test_the_drivers_roster_binds_each_executor_pod_to_its_own_name(
    rendered: dict[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The driver reads a roster listing every replica of the executors' StatefulSet, each bound
    to its DNS name under the headless Service (which publishes pods as they start)."""
    objects = rendered[DEPLOY / "kubernetes"]
    executors = next(obj for obj in objects if obj["kind"] == "StatefulSet")
    service = next(obj for obj in objects if obj["metadata"]["name"] == executors["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    driver = next(obj for obj in objects if obj["kind"] == "Deployment")["spec"]["template"]["spec"]
    command = driver["containers"][0]["command"]
    path = next(arg for arg in command if arg.startswith("--resilience.roster=file:")).split(":", 1)[1]
    mount = next(m for m in driver["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    source = next(v["configMap"]["name"] for v in driver["volumes"] if v["name"] == mount["name"])
    text = next(obj for obj in objects if obj["metadata"]["name"] == source)["data"][Path(path).name]
    (tmp_path / "roster").write_text(text)
    name, replicas = executors["metadata"]["name"], executors["spec"]["replicas"]
    domain = service["metadata"]["name"]
    assert load_roster(f"file:{tmp_path / 'roster'}").hosts == {
        f"{name}-{i}": f"{name}-{i}.{domain}" for i in range(replicas)
    }


def test_a_network_policy_admits_only_the_jobs_pods_to_every_pod(rendered: dict[Path, list[dict[str, Any]]]) -> None:
    for directory, objects in rendered.items():
        policies = [obj["spec"] for obj in objects if obj["kind"] == "NetworkPolicy"]
        templates = [t for obj in objects for t in pod_templates(obj)]
        assert templates
        for template in templates:
            labels = template["metadata"]["labels"].items()
            covering = [p for p in policies if p["podSelector"]["matchLabels"].items() <= labels]
            assert covering, f"{directory.name}: no NetworkPolicy selects pods labelled {dict(labels)}"
            for policy in covering:
                assert policy["policyTypes"] == ["Ingress"]
                peers = [peer for rule in policy["ingress"] for peer in rule["from"]]
                assert peers and all(peer == {"podSelector": policy["podSelector"]} for peer in peers), peers


def _doc(relative: str, kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(doc for doc in load(relative) if doc["kind"] == kind))


def _container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]


def _worker(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["pytorchReplicaSpecs"]["Worker"]


DRIVER, TORCHRUN = "kubernetes/megascale.yaml", "kubernetes/torchrun/pytorchjob.yaml"
BREAKAGES: list[tuple[str, str, str, Callable[[dict[str, Any]], Any], str]] = [
    (
        "misspelt field",
        DRIVER,
        "StatefulSet",
        lambda d: _container(d["spec"]["template"])["ports"][0].update(containerport=29500),
        r"containers\.0\.ports\.0: .*'containerport' was unexpected",
    ),
    (
        "string for an integer",
        DRIVER,
        "Deployment",
        lambda d: d["spec"].update(replicas="1"),
        r"spec\.replicas: '1' is not of type 'integer'",
    ),
    (
        "string for a list",
        DRIVER,
        "NetworkPolicy",
        lambda d: d["spec"].update(policyTypes="Ingress"),
        r"spec\.policyTypes: 'Ingress' is not of type 'array'",
    ),
    ("unknown kind", DRIVER, "Service", lambda d: d.update(kind="Servce"), "Couldn't find schema for kind Servce"),
    (
        "misspelt PyTorchJob field",
        TORCHRUN,
        "PyTorchJob",
        lambda d: d["spec"]["elasticPolicy"].update(rdzvBackends="c10d"),
        r": spec\.elasticPolicy\.rdzvBackends: unknown field",
    ),
    (
        "number for nprocPerNode",
        TORCHRUN,
        "PyTorchJob",
        lambda d: d["spec"].update(nprocPerNode=8),
        r": spec\.nprocPerNode: 8 is not str",
    ),
    (
        "no replica specs",
        TORCHRUN,
        "PyTorchJob",
        lambda d: d["spec"].pop("pytorchReplicaSpecs"),
        "pytorch_replica_specs`, must not be `None`",
    ),
    (
        "unsupported replica type",
        TORCHRUN,
        "PyTorchJob",
        lambda d: d["spec"]["pytorchReplicaSpecs"].update(Chief=_worker(d)),
        "Chief: unsupported replica type",
    ),
    (
        "no container named pytorch",
        TORCHRUN,
        "PyTorchJob",
        lambda d: _container(_worker(d)["template"]).update(name="trainer"),
        "needs a container named 'pytorch'",
    ),
    (
        "misspelt field in the pod template",
        TORCHRUN,
        "PyTorchJob",
        lambda d: _container(_worker(d)["template"])["resources"].update(limit={"cpu": 1}),
        r"V1PodTemplateSpec\): template\.spec\.containers\.0\.resources: .*'limit' was unexpected",
    ),
]


@pytest.mark.parametrize(
    ("what", "relative", "kind", "break_it", "expected"), BREAKAGES, ids=[case[0] for case in BREAKAGES]
)
def test_a_broken_manifest_fails_the_validator(
    what: str, relative: str, kind: str, break_it: Callable[[dict[str, Any]], Any], expected: str
) -> None:
    doc = _doc(relative, kind)
    validate(doc)  # the manifest as shipped passes; the same one broken does not
    break_it(doc)
    with pytest.raises(ManifestError, match=expected):
        validate(doc)
