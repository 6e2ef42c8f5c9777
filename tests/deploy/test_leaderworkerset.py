"""deploy/k8s/multinode: pipeline stages on separate nodes as a LeaderWorkerSet, without a cluster.

Rendered with kustomize like the other manifests; the LeaderWorkerSet is a custom resource (no
schema in kubernetes-validate), so each of its pod templates is validated as a Pod against the
Kubernetes schemas (strict), and the group's wiring is checked: the leader's launcher arguments
(parsed by the launcher's own parser) build an EngineConfig with as many pipeline stages as the
group has pods, meeting its ranks through torchrun's variables; the workers run our rank process
with the rank LeaderWorkerSet gives them, at the leader's rendezvous port, on the same image and
checkpoint path."""

from __future__ import annotations

import pytest

from splitfuse.config import EngineConfig
from test_manifests import K8S, _launcher_args, _render, _validate

MULTINODE = K8S / "multinode"


@pytest.fixture(scope="module")
def lws() -> dict:
    objs = _render(MULTINODE)
    assert [o["kind"] for o in objs] == ["LeaderWorkerSet"]
    obj = objs[0]
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    return obj


def _template(lws: dict, which: str) -> dict:
    return lws["spec"]["leaderWorkerTemplate"][which]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("which", ["leaderTemplate", "workerTemplate"])
def test_pod_templates_match_the_kubernetes_schemas(lws, which):
    template = _template(lws, which)
    _validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"splitfuse-{which.lower()}"},
               "spec": template["spec"]})


def test_the_leader_is_rank_0_of_as_many_stages_as_pods(lws):
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert size >= 2
    [leader] = _template(lws, "leaderTemplate")["spec"]["containers"]
    args = _launcher_args(leader)
    params = dict(p.split("=", 1) for p in args.param)
    config = EngineConfig.from_strings({k: v for k, v in params.items() if k in EngineConfig.field_names()}
                                       | {"model": args.model})
    assert config.pipeline_parallel_size * config.tensor_parallel_size == size
    assert config.tensor_parallel_launch == "env"
    env = _env(leader)
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "$(LWS_GROUP_SIZE)"
    assert env["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)"
    assert int(env["MASTER_PORT"]) in {p["containerPort"] for p in leader["ports"]}


def test_workers_run_one_rank_each_at_the_leaders_rendezvous(lws):
    [leader] = _template(lws, "leaderTemplate")["spec"]["containers"]
    worker_spec = _template(lws, "workerTemplate")["spec"]
    [worker] = worker_spec["containers"]
    assert worker["command"] == ["python3", "-m", "splitfuse.parallel.worker"]
    env, leader_env = _env(worker), _env(leader)
    assert env["RANK"] == "$(LWS_WORKER_INDEX)"  # 1 .. size-1; the leader is 0
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        assert env[name] == leader_env[name], name
    assert worker["image"] == leader["image"]
    # The checkpoint at the same path on every node, from one claim every node can mount.
    model_path = _launcher_args(leader).model.rsplit("/", 1)[0]
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts["models"] == model_path
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for spec in (worker_spec, _template(lws, "leaderTemplate")["spec"]) for v in spec["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {"models": "splitfuse-models-shared"}
