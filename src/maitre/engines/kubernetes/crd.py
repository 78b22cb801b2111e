"""Kubernetes: the ``MaitreJob`` custom resource, generated from the job manifest's model.

``deploy/kubernetes/base/maitrejob-crd.yaml`` is this module's output, never edited by hand (a
test checks that the committed file equals it), so the resource and ``maitre submit``'s manifest
never drift apart::

    python -m maitre.engines.kubernetes crd > deploy/kubernetes/base/maitrejob-crd.yaml
    kubectl get maitrejob bert-large -o yaml | python -m maitre.engines.kubernetes manifest - \\
        | maitre submit -

A MaitreJob's ``spec`` holds the manifest's fields (:class:`maitre.scheduling.spec.JobManifest`)
and its name is the resource's ``metadata.name``. The schema is pydantic's JSON schema of the
model made *structural*, as Kubernetes requires of a CRD: references inlined, ``null``
alternatives dropped (an absent field is the model's None), one type per node (where the model
takes several, the list form is kept over a string, and a string over a number: ``command`` is
a list of strings, as a container's is), no ``additionalProperties: false`` (the API server
prunes unknown fields and ``kubectl`` refuses them under its default strict field validation;
``manifest`` refuses them too) and descriptions on one line. Checks across fields
(``maxReplicas >= minReplicas``, ``priority`` or ``priorityClassName``, ...) stay maitre's:
``manifest`` runs :func:`~maitre.scheduling.spec.parse_manifest`, which names every problem.

``maitre operator`` (:mod:`maitre.engines.kubernetes.operator`) acts on MaitreJobs and writes
their ``status``, whose every field is declared here. The ``scale`` subresource maps ``kubectl
scale maitrejob J --replicas N`` onto ``spec.maxReplicas``, as ``maitre scale`` does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

GROUP = "maitre.dev"
VERSION = "v1alpha1"
KIND = "MaitreJob"
PLURAL = "maitrejobs"
API_VERSION = f"{GROUP}/{VERSION}"

_KEPT = (
    "type",
    "description",
    "default",
    "enum",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "minItems",
    "maxItems",
    "items",
    "properties",
    "required",
)
"""The JSON schema keys a CRD's structural schema takes from pydantic's (``title`` is the
field's name again; ``additionalProperties: false`` is refused by the API server)."""
_PREFERRED = ("array", "object", "string", "number", "integer", "boolean")
"""Where the model takes several types, the one the CRD keeps: the first of these."""
_WORDS = {
    "array": "a list",
    "object": "a mapping",
    "string": "a string",
    "number": "a number",
    "integer": "an integer",
    "boolean": "true or false",
}


class SchemaError(ValueError):
    """The model has a field that no structural schema can say."""


def _structural(node: dict[str, Any], defs: dict[str, Any], at: str) -> dict[str, Any]:
    if "$ref" in node:
        ref = node["$ref"].rsplit("/", 1)[-1]
        node = {**defs[ref], **{k: v for k, v in node.items() if k != "$ref"}}
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        resolved = [_structural(o, defs, at) for o in options]
        typed = [o for o in resolved if o.get("type") in _PREFERRED]
        if not typed:
            raise SchemaError(f"{at}: no type a CRD can hold among {node['anyOf']}")
        chosen = min(typed, key=lambda o: _PREFERRED.index(o["type"]))
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        node = {**chosen, **{k: v for k, v in rest.items() if k in _KEPT}}
        if len(typed) > 1 and "description" in node:  # say which form a MaitreJob takes
            node["description"] += f" In a MaitreJob: {_WORDS[chosen['type']]}."
    if node.get("default", 0) is None:
        node = {k: v for k, v in node.items() if k != "default"}
    if "type" not in node:
        raise SchemaError(f"{at}: no type ({node})")
    out: dict[str, Any] = {}
    for key in _KEPT:
        if key not in node:
            continue
        value = node[key]
        if key == "description":
            value = " ".join(str(value).split())
        elif key == "items":
            value = _structural(value, defs, f"{at}[]")
        elif key == "properties":
            value = {name: _structural(sub, defs, f"{at}.{name}") for name, sub in value.items()}
        out[key] = value
    return out


def spec_schema() -> dict[str, Any]:
    """The MaitreJob's ``spec``: :class:`JobManifest`'s fields but ``name``, structural."""
    from maitre.scheduling.spec import JobManifest

    schema = JobManifest.model_json_schema(by_alias=True, mode="validation")
    defs = schema.pop("$defs", {})
    spec = _structural(schema, defs, "spec")
    for own in ("name", "origin"):  # metadata.name; the operator writes the object's uid
        spec["properties"].pop(own)
    spec["required"] = [f for f in spec.get("required", []) if f != "name"]
    spec["description"] = "The job manifest's fields (maitre submit's), its name being the resource's metadata.name."
    return spec


def _status_schema() -> dict[str, Any]:
    """``status``: what the operator writes (:mod:`maitre.engines.kubernetes.operator`). Every
    field it writes is declared here: a real API server prunes the rest."""

    def field(kind: str, text: str) -> dict[str, Any]:
        return {"type": kind, "description": text}

    condition = {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": field("string", "Admitted, Running, Suspended, Completed, Failed or Invalid."),
            "status": field("string", "True, False or Unknown."),
            "reason": field("string", "One word, CamelCase."),
            "message": field("string", "What happened, in words."),
            "lastTransitionTime": field("string", "When status last changed (RFC 3339)."),
        },
    }
    return {
        "type": "object",
        "description": "The job as the coordinator last reported it, written by maitre's operator.",
        "properties": {
            "phase": field("string", "PENDING, RUNNING, SUSPENDED, COMPLETED, FAILED, CANCELLED, ..."),
            "replicas": field("integer", "Replicas training now."),
            "targetReplicas": field("integer", "Replicas the scheduler gives the job now."),
            "epoch": field("integer", "The membership epoch."),
            "step": field("integer", "The last committed step."),
            "failures": field("integer", "Failure events survived so far."),
            "restarts": field("integer", "elastic: restart: the gangs started again after another."),
            "lastCheckpointStep": field("integer", "The step of the last checkpoint written."),
            "pendingReplicas": field(
                "integer", "Replica pods the cluster's scheduler has not placed (with --replica-pods)."
            ),
            "message": field("string", "Why it waits or failed."),
            "jobId": field("string", "The coordinator's job (its name)."),
            "observedGeneration": field("integer", "The spec's generation the coordinator has."),
            "eventsSeen": field("integer", "The job's coordinator events turned into Kubernetes Events so far."),
            "conditions": {"type": "array", "description": "The job's conditions.", "items": condition},
        },
    }


def crd() -> dict[str, Any]:
    """The ``MaitreJob`` CustomResourceDefinition (apiextensions.k8s.io/v1)."""

    def column(name: str, kind: str, path: str) -> dict[str, str]:
        return {"name": name, "type": kind, "jsonPath": path}

    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/name": "maitre"}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["mj"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An elastic training job of maitre's: it grows and shrinks "
                            "in place between minReplicas and maxReplicas.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": _status_schema(),
                            },
                        }
                    },
                    "subresources": {
                        "status": {},
                        "scale": {"specReplicasPath": ".spec.maxReplicas", "statusReplicasPath": ".status.replicas"},
                    },
                    "additionalPrinterColumns": [
                        column("Queue", "string", ".spec.queue"),
                        column("Min", "integer", ".spec.minReplicas"),
                        column("Max", "integer", ".spec.maxReplicas"),
                        column("Replicas", "integer", ".status.replicas"),
                        column("Phase", "string", ".status.phase"),
                        column("Step", "integer", ".status.step"),
                        column("Age", "date", ".metadata.creationTimestamp"),
                    ],
                }
            ],
        },
    }


def crd_yaml() -> str:
    import yaml

    head = (
        "# Generated by `python -m maitre.engines.kubernetes crd` from maitre's job manifest "
        "model\n# (src/maitre/scheduling/spec.py): do not edit; tests/test_kubernetes.py "
        "checks it.\n"
    )
    return head + yaml.safe_dump(crd(), sort_keys=False, width=100)


def manifest_of(resource: Any) -> dict[str, Any]:
    """A MaitreJob (a mapping, as ``kubectl get -o yaml`` prints it) as a job manifest for
    ``maitre submit``; the manifest's own checks (:func:`parse_manifest`) still apply."""
    from maitre.scheduling.spec import ManifestError

    if not isinstance(resource, dict):
        raise ManifestError([f"a MaitreJob is a mapping, got {type(resource).__name__}"])
    problems = []
    if resource.get("apiVersion") != API_VERSION or resource.get("kind") != KIND:
        problems.append(
            f"not a {KIND} of {API_VERSION}: apiVersion {resource.get('apiVersion')!r}, kind {resource.get('kind')!r}"
        )
    meta, spec = resource.get("metadata"), resource.get("spec")
    name = meta.get("name") if isinstance(meta, dict) else None
    if not isinstance(name, str):
        problems.append("metadata.name is required")
    if not isinstance(spec, dict):
        problems.append("spec is required (a mapping of the manifest's fields)")
    elif "name" in spec:
        problems.append("spec.name: the job's name is metadata.name")
    if problems:
        raise ManifestError(problems)
    return {"name": name, **spec}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maitre.engines.kubernetes", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("crd", help="print the MaitreJob CustomResourceDefinition (YAML)")
    to = sub.add_parser(
        "manifest", help="print a MaitreJob (YAML file, or - for stdin) as a job manifest for maitre submit, checked"
    )
    to.add_argument("file")
    args = parser.parse_args(argv)
    if args.what == "crd":
        sys.stdout.write(crd_yaml())
        return 0
    import yaml

    from maitre.scheduling.spec import ManifestError, parse_manifest

    try:
        text = sys.stdin.read() if args.file == "-" else open(args.file).read()
        manifest = manifest_of(yaml.safe_load(text))
        parse_manifest(manifest)
    except (OSError, yaml.YAMLError) as exc:
        print(f"maitre: error: cannot read {args.file}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except ManifestError as exc:
        print(f"maitre: error: {args.file}: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump(manifest, sort_keys=False, width=100))
    return 0


if __name__ == "__main__":
    sys.exit(main())
