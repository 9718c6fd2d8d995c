"""Validates stanch's CRDs and example resources, with the tools a cluster's CI uses.

Usage: validate.py CRD_DIR KUBERNETES_VERSION RESOURCE... [--invalid RESOURCE...]

1. Every CRD under CRD_DIR against Kubernetes' own schema for
   apiextensions.k8s.io/v1 CustomResourceDefinition (kubernetes-validate).
2. Every RESOURCE against the openAPIV3Schema of the CRD of its kind (jsonschema;
   OpenAPI's `nullable` read as JSON Schema's null type, `x-kubernetes-*` ignored, as
   the API server's own structural checks are not JSON Schema).
3. Every RESOURCE after --invalid must be refused by its CRD's schema (a file may
   hold several documents, each refused for its own reason).
Prints one line per file; exits 1 on the first problem, naming it.
"""

import copy
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml


def as_json_schema(node):
    """OpenAPI v3 as JSON Schema: `nullable: true` becomes a null type."""
    if isinstance(node, dict):
        out = {k: as_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
        if out.pop("nullable", False) and "type" in out:
            out["type"] = [out["type"], "null"]
            if "enum" in out:
                out["enum"] = out["enum"] + [None]
        return out
    if isinstance(node, list):
        return [as_json_schema(v) for v in node]
    return node


def main():
    args = sys.argv[3:]
    invalid = args[args.index("--invalid") + 1:] if "--invalid" in args else []
    resources = args[: args.index("--invalid")] if "--invalid" in args else args
    crd_dir, version = pathlib.Path(sys.argv[1]), sys.argv[2]
    schemas = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        try:
            kubernetes_validate.validate(crd, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            sys.exit(f"{path.name}: not a valid CustomResourceDefinition: {e.message} at {list(e.path)}")
        for v in crd["spec"]["versions"]:
            key = (crd["spec"]["group"] + "/" + v["name"], crd["spec"]["names"]["kind"])
            schemas[key] = as_json_schema(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
        print(f"{path.name}: a valid CustomResourceDefinition for Kubernetes {version}")
    for path in map(pathlib.Path, resources):
        resource = yaml.safe_load(path.read_text())
        key = (resource["apiVersion"], resource["kind"])
        if key not in schemas:
            sys.exit(f"{path.name}: no CRD for {key}")
        try:
            jsonschema.validate(resource, schemas[key])
        except jsonschema.ValidationError as e:
            sys.exit(f"{path.name}: {e.message} at {list(e.absolute_path)}")
        print(f"{path.name}: valid against its CRD")
    for path in map(pathlib.Path, invalid):
        for i, resource in enumerate(yaml.safe_load_all(path.read_text())):
            key = (resource["apiVersion"], resource["kind"])
            try:
                jsonschema.validate(resource, schemas[key])
            except jsonschema.ValidationError as e:
                print(f"{path.name}[{i}]: refused: {e.message}")
                continue
            sys.exit(f"{path.name}[{i}]: accepted, but its CRD must refuse it")


main()
