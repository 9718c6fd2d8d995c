// Validates Prometheus Operator resources (a JSON array, the file named first) with
// the validators published as @kubernetes-models/prometheus-operator (generated from
// the operator's CRDs): one line each, "<Kind> <name>: valid" or ": refused: why".
// Exits 1 on a kind it has no validator for.
// NODE_PATH names the node_modules folder holding the package.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const base = join(process.env.NODE_PATH, "@kubernetes-models/prometheus-operator/monitoring.coreos.com");
const resources = JSON.parse(readFileSync(process.argv[2], "utf8"));
for (const r of resources) {
  const version = r.apiVersion.split("/")[1];
  const mod = await import(pathToFileURL(join(base, version, "index.js")).href);
  const Model = mod[r.kind];
  if (!Model) {
    console.log(`${r.kind} ${r.metadata.name}: no validator`);
    process.exit(1);
  }
  try {
    new Model(r).validate();
    console.log(`${r.kind} ${r.metadata.name}: valid`);
  } catch (e) {
    console.log(`${r.kind} ${r.metadata.name}: refused: ${e.message}`);
  }
}
