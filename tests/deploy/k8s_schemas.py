"""Kubernetes schema checks for deploy/kubernetes, offline.

Core kinds go against the official OpenAPI schemas bundled in kubernetes-validate, strict (an
unknown or misspelt field is an error, as with `kubectl apply --validate=strict`), for the oldest
and the newest Kubernetes release in `VERSIONS`. A PyTorchJob goes against the Kubeflow training
operator's API models (kubeflow-training: field names, types, required fields) and the rules of
its admission webhook, its metadata and pod templates against the core schemas. A kustomization
is rendered as `kubectl apply -k` would (resources plus ConfigMap/Secret generators) and the
result checked like any other object.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import kubernetes_validate
import yaml
from kubeflow.training import models as kubeflow_models
from kubeflow.training.constants import constants as kubeflow

VERSIONS = ("1.29", "1.37")
PRIMITIVES: dict[str, type | tuple[type, ...]] = {
    "str": str,
    "int": int,
    "bool": bool,
    "float": (int, float),
    "object": object,
    "Quantity": (str, int, float),
}
# Core types inside a PyTorchJob, checked by the core schemas as a part of a PodTemplate.
CORE_WRAPPERS = {
    "V1ObjectMeta": lambda value: {"apiVersion": "v1", "kind": "PodTemplate", "metadata": value},
    "V1PodTemplateSpec": lambda value: {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "template"},
        "template": value,
    },
}
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "generatorOptions", "configMapGenerator", "secretGenerator"}


class ManifestError(ValueError):
    """What is wrong with a manifest, and where (kind/name: field path: message)."""


def validate(doc: dict[str, Any]) -> None:
    """Raise ManifestError unless `doc` is a valid object of a known kind."""
    where = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    if doc.get("kind") == kubeflow.PYTORCHJOB_KIND:
        return _validate_pytorchjob(doc, where)
    _validate_core(doc, where)


def _validate_core(doc: dict[str, Any], where: str) -> None:
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(part) for part in exc.absolute_path) or "(top)"
            raise ManifestError(f"{where}: {path}: {exc.message} (Kubernetes {version})") from None
        except kubernetes_validate.SchemaNotFoundError as exc:
            raise ManifestError(f"{where}: {exc.message}") from None


def _validate_pytorchjob(doc: dict[str, Any], where: str) -> None:
    if doc.get("apiVersion") != kubeflow.API_VERSION:
        raise ManifestError(
            f"{where}: apiVersion {doc.get('apiVersion')!r}; the operator serves {kubeflow.API_VERSION}"
        )
    core: list[tuple[str, dict[str, Any]]] = []
    _check(doc, kubeflow.PYTORCHJOB_MODEL, "", where, core)
    _webhook_rules(doc, where)
    for type_name, value in core:
        _validate_core(CORE_WRAPPERS[type_name](value), f"{where} ({type_name})")


def _check(value: Any, type_name: str, path: str, where: str, core: list) -> None:
    """`value` against the SDK's type `type_name`; core types are collected for the core schemas."""
    if match := re.fullmatch(r"list\[(.+)\]", type_name):
        _expect(value, list, path, where, type_name)
        for i, item in enumerate(value):
            _check(item, match[1], f"{path}[{i}]", where, core)
    elif match := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        _expect(value, dict, path, where, type_name)
        for key, item in value.items():
            _check(item, match[1], f"{path}.{key}".lstrip("."), where, core)
    elif type_name in PRIMITIVES:
        if isinstance(value, bool) and type_name != "bool" or not isinstance(value, PRIMITIVES[type_name]):
            raise ManifestError(f"{where}: {path}: {value!r} is not {type_name}")
    elif type_name in CORE_WRAPPERS:
        core.append((type_name, value))
    elif model := getattr(kubeflow_models, type_name, None):
        _expect(value, dict, path, where, type_name)
        fields = {json_name: name for name, json_name in model.attribute_map.items()}
        for key, item in value.items():
            at = f"{path}.{key}".lstrip(".")
            if key not in fields:
                raise ManifestError(f"{where}: {at}: unknown field (known: {', '.join(sorted(fields))})")
            _check(item, model.openapi_types[fields[key]], at, where, core)
        try:  # the models' setters refuse a required field left out
            model(**{name: value.get(json_name) for json_name, name in fields.items()})
        except ValueError as exc:
            raise ManifestError(f"{where}: {path or '(top)'}: {exc}") from None
    else:
        raise ManifestError(f"{where}: {path}: no check for type {type_name}; extend tests/deploy/k8s_schemas.py")


def _expect(value: Any, kind: type, path: str, where: str, type_name: str) -> None:
    if not isinstance(value, kind):
        raise ManifestError(f"{where}: {path}: {value!r} is not {type_name}")


def _webhook_rules(doc: dict[str, Any], where: str) -> None:
    """What the training operator's admission webhook refuses (pkg/webhooks/pytorch, v1.9)."""
    name, spec = (doc.get("metadata") or {}).get("name", ""), doc.get("spec")
    if not spec:
        raise ManifestError(f"{where}: spec: required")
    if not DNS_1035_LABEL.fullmatch(name) or len(name) > 63:
        raise ManifestError(f"{where}: metadata.name: must be a DNS-1035 label (a-z, 0-9, '-', 63 at most)")
    replicas = spec["pytorchReplicaSpecs"]
    roles = (kubeflow.REPLICA_TYPE_MASTER, kubeflow.REPLICA_TYPE_WORKER)
    if "elasticPolicy" in spec:
        if kubeflow.REPLICA_TYPE_WORKER not in replicas:
            raise ManifestError(f"{where}: spec.pytorchReplicaSpecs: a Worker is needed with an elasticPolicy")
        if "nProcPerNode" in spec["elasticPolicy"] and "nprocPerNode" in spec:
            raise ManifestError(f"{where}: spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    for role, replica in replicas.items():
        at = f"{where}: spec.pytorchReplicaSpecs.{role}"
        if role not in roles:
            raise ManifestError(f"{at}: unsupported replica type (choose from {', '.join(roles)})")
        containers = replica["template"].get("spec", {}).get("containers", [])
        if not any(c.get("name") == kubeflow.PYTORCHJOB_CONTAINER for c in containers):
            raise ManifestError(f"{at}: needs a container named {kubeflow.PYTORCHJOB_CONTAINER!r}")
        if any(not c.get("image") for c in containers):
            raise ManifestError(f"{at}: every container needs an image")
        count = replica.get("replicas")
        if role == kubeflow.REPLICA_TYPE_MASTER and count != 1:
            raise ManifestError(f"{at}.replicas: must be 1")
        if count is not None and count < 1:
            raise ManifestError(f"{at}.replicas: must be at least 1")


def render_kustomization(directory: Path, inputs: Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k directory` sends, with the generators' files read from `inputs`
    (what a user puts beside kustomization.yaml). Knows only the fields deploy/ uses."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if unknown := set(spec) - KUSTOMIZATION_KEYS:
        raise ManifestError(f"{directory}/kustomization.yaml: {sorted(unknown)}: not rendered by this test; extend it")
    if spec.get("generatorOptions") != {"disableNameSuffixHash": True}:
        raise ManifestError(
            f"{directory}/kustomization.yaml: generated names would get a hash suffix that "
            "the manifests' references do not carry; keep generatorOptions.disableNameSuffixHash"
        )
    objects = [
        doc for resource in spec["resources"] for doc in yaml.safe_load_all((directory / resource).read_text()) if doc
    ]
    client = k8s.ApiClient()
    for generator in spec.get("configMapGenerator", []):
        data = {key: path.read_text() for key, path in _generator_files(generator, inputs)}
        objects.append(
            client.sanitize_for_serialization(
                k8s.V1ConfigMap(
                    api_version="v1", kind="ConfigMap", metadata=k8s.V1ObjectMeta(name=generator["name"]), data=data
                )
            )
        )
    for generator in spec.get("secretGenerator", []):
        data = {key: base64.b64encode(path.read_bytes()).decode() for key, path in _generator_files(generator, inputs)}
        objects.append(
            client.sanitize_for_serialization(
                k8s.V1Secret(
                    api_version="v1",
                    kind="Secret",
                    type="Opaque",
                    metadata=k8s.V1ObjectMeta(name=generator["name"]),
                    data=data,
                )
            )
        )
    return objects


def _generator_files(generator: dict[str, Any], inputs: Path) -> list[tuple[str, Path]]:
    """kustomize's `files:` entries: `key=path`, or `path` keyed by its file name."""
    if unknown := set(generator) - {"name", "files"}:
        raise ManifestError(f"generator {generator.get('name')}: {sorted(unknown)}: not rendered by this test")
    pairs = []
    for entry in generator["files"]:
        key, _, path = entry.rpartition("=")
        pairs.append((key or Path(path).name, inputs / path))
    return pairs
