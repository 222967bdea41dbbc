"""Kubernetes deployment: render every overlay of deploy/k8s offline, validate, check the promises.

Rendering uses ``kubectl kustomize`` (or a standalone ``kustomize build``); validation uses
kubernetes-validate in strict mode (unknown fields are errors) against the newest Kubernetes version
it ships schemas for and against 1.32. No cluster is needed.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate  # the dev extra: a missing or broken install fails here, not skips
import pytest
import yaml

from relayrl import config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["cpu-demo", "gpu-vllm", "gpu-megatron"]
VERSIONS = sorted({kubernetes_validate.latest_version(), "1.32.0"})
LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/component", "app.kubernetes.io/part-of")
CONFIG_MOUNT = "/etc/relayrl"
CONFIG_PATH = "/etc/relayrl/config.yaml"
ROLLOUT_PORT, CONTROLLER_PORT = 50052, 50051


def _renderer() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    cmd = _renderer()
    if cmd is None:
        pytest.skip("neither kubectl nor kustomize is installed (apt-get install kubectl)")
    res = subprocess.run([*cmd, str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"{' '.join(cmd)} {overlay} failed:\n{res.stderr}"
    return tuple(d for d in yaml.safe_load_all(res.stdout) if d)


def one(docs, kind: str, name_prefix: str = "relayrl-") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    names = [d["metadata"]["name"] for d in found]
    assert len(found) == 1, f"expected one {kind} named {name_prefix}*, found {names}"
    return found[0]


def by_name(docs, kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def volume_for_mount(workload: dict, mount_path: str) -> dict:
    c = container(workload)
    mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == mount_path]
    assert mounts, f"{workload['metadata']['name']}: nothing mounted at {mount_path}"
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    return volumes[mounts[0]["name"]]


def selects(service: dict, workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def arg_after(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def run_config(docs) -> dict:
    cm = one(docs, "ConfigMap", "relayrl-config-")
    return yaml.safe_load(cm["data"]["config.yaml"])


def workloads(docs) -> dict[str, dict]:
    return {
        "controller": one(docs, "Deployment"),
        "rollout": one(docs, "StatefulSet"),
        "trainer": one(docs, "Job"),
    }


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strict(overlay: str, version: str):
    assert_valid(render(overlay), version)


def assert_valid(docs, version: str) -> None:
    assert docs
    errors = []
    for d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {err.path}: {err.message}")
    assert not errors, "\n".join(errors)


def test_base_renders():
    cmd = _renderer()
    if cmd is None:
        pytest.skip("neither kubectl nor kustomize is installed")
    res = subprocess.run([*cmd, str(K8S / "base")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_labelled(overlay: str):
    for d in render(overlay):
        labels = d["metadata"].get("labels", {})
        missing = [k for k in LABELS if k not in labels]
        assert not missing, f"{d['kind']}/{d['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/part-of"] == "relayrl"
        assert labels["app.kubernetes.io/instance"] == overlay
    for role, w in workloads(render(overlay)).items():
        tmpl = w["spec"]["template"]["metadata"]["labels"]
        assert tmpl["app.kubernetes.io/component"] == role
        assert all(k in tmpl for k in LABELS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollout_statefulset_and_headless_service(overlay: str):
    docs = render(overlay)
    sts = one(docs, "StatefulSet")
    svc = by_name(docs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert selects(svc, sts)
    assert ROLLOUT_PORT in [p["port"] for p in svc["spec"]["ports"]]

    c = container(sts)
    assert {"name": "grpc", "containerPort": ROLLOUT_PORT} in c["ports"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == ROLLOUT_PORT, probe
    args = c["args"]
    assert args[:2] == ["rollout", "serve"]
    assert arg_after(args, "--config") == CONFIG_PATH
    assert arg_after(args, "--port") == str(ROLLOUT_PORT)
    assert arg_after(args, "--host") == "0.0.0.0"  # kubelet probes and peers dial the pod IP
    # stable per-pod DNS name through the headless service
    headless = svc["metadata"]["name"]
    assert arg_after(args, "--advertise") == f"$(POD_NAME).{headless}.$(POD_NAMESPACE).svc:{ROLLOUT_PORT}"
    env = env_of(c)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert arg_after(args, "--controller") == "$(RELAYRL_CONTROLLER)"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_dev_shm_is_memory_emptydir(overlay: str):
    docs = render(overlay)
    for role in ("rollout", "trainer"):
        vol = volume_for_mount(workloads(docs)[role], "/dev/shm")
        assert vol["emptyDir"]["medium"] == "Memory", role
        assert "sizeLimit" in vol["emptyDir"], role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_and_scrape_annotations(overlay: str):
    docs = render(overlay)
    for role, w in workloads(docs).items():
        c = container(w)
        assert c["resources"]["requests"] and c["resources"]["limits"], role
    for role in ("controller", "rollout"):
        w = workloads(docs)[role]
        ann = w["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        c = container(w)
        metrics_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
        assert ann["prometheus.io/port"] == str(metrics_port)
        assert arg_after(c["args"], "--metrics-port") == str(metrics_port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trainer_indexed_job_with_rank0_rendezvous(overlay: str):
    docs = render(overlay)
    job = one(docs, "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    ps = pod_spec(job)
    svc = by_name(docs, "Service", ps["subdomain"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert selects(svc, job)

    c = container(job)
    env = env_of(c)
    nnodes = int(env["NNODES"]["value"])
    assert spec["completions"] == spec["parallelism"] == nnodes
    rank_ref = env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank_ref == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # Indexed Job pods are named <job>-<index> and live under the subdomain: rank 0 is pod 0
    master = f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert env["MASTER_ADDR"]["value"] == master
    assert c["command"] == ["relayrl", "trainer", "launch"]  # torchrun under the SIGTERM-forwarding supervisor
    args = c["args"]
    assert arg_after(args, "--nnodes") == "$(NNODES)"
    assert arg_after(args, "--node-rank") == "$(NODE_RANK)"
    assert arg_after(args, "--master-addr") == "$(MASTER_ADDR)"
    assert arg_after(args, "--master-port") == "29500"
    i = args.index("-m")
    assert args[i + 1 : i + 4] == ["relayrl.cli", "trainer", "run"]
    assert arg_after(args, "--config") == CONFIG_PATH
    assert arg_after(args, "--controller") == "$(RELAYRL_CONTROLLER)"
    # the init container waits for rank 0's DNS record
    init = pod_spec(job)["initContainers"][0]
    assert env_of(init)["MASTER_ADDR"]["value"] == master
    # the config's weight-sync master is trainer rank 0 too, and the world size matches the Job
    cfg = run_config(docs)
    assert cfg["weight_sync"]["master_address"] == master
    assert cfg["trainer"]["nproc"] == nnodes * int(env["NPROC_PER_NODE"]["value"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_role_is_restarted_and_rejoins(overlay: str):
    """Kubernetes is the supervisor here: controller and workers restart always (probes on grpc.health.v1 catch
    a hung one), a dead trainer rank or container is restarted within a budget and resumes from its checkpoint."""
    docs = render(overlay)
    w = workloads(docs)
    for role, port in (("controller", CONTROLLER_PORT), ("rollout", ROLLOUT_PORT)):
        assert pod_spec(w[role]).get("restartPolicy", "Always") == "Always", role
        assert container(w[role])["livenessProbe"]["grpc"]["port"] == port, role
        assert container(w[role])["readinessProbe"]["grpc"]["port"] == port, role
    # a restarted controller container finds its ledger and cursor in a volume, not in its own filesystem
    state_dir = arg_after(container(w["controller"])["args"], "--state-dir")
    assert volume_for_mount(w["controller"], state_dir)
    # a restarted worker pod keeps its name and DNS and re-registers by heartbeat (--controller)
    assert w["rollout"]["spec"]["podManagementPolicy"] == "Parallel"
    job = w["trainer"]
    assert pod_spec(job)["restartPolicy"] == "OnFailure"
    assert job["spec"]["backoffLimit"] >= 1
    args = container(job)["args"]
    assert int(arg_after(args, "--max-restarts")) >= 1
    assert args.index("--max-restarts") < args.index("-m")  # torchrun's flag, not the trainer's
    assert "--resume" in args[args.index("-m") :]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_controller_deployment_service_and_addresses(overlay: str):
    docs = render(overlay)
    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1
    svc = by_name(docs, "Service", "relayrl-controller")
    assert svc["spec"].get("clusterIP") != "None"
    assert selects(svc, dep)
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": CONTROLLER_PORT, "metrics": 9090}
    c = container(dep)
    assert c["args"][:2] == ["controller", "serve"]
    assert arg_after(c["args"], "--port") == str(CONTROLLER_PORT)
    state_dir = arg_after(c["args"], "--state-dir")
    volume_for_mount(dep, state_dir)  # the state dir is a volume (emptyDir or PVC), not the container's layer
    assert c["readinessProbe"]["grpc"]["port"] == CONTROLLER_PORT
    for role in ("rollout", "trainer"):
        env = env_of(container(workloads(docs)[role]))
        assert env["RELAYRL_CONTROLLER"]["value"] == f"{svc['metadata']['name']}:{CONTROLLER_PORT}"
    for role, w in workloads(docs).items():
        token = env_of(container(w))["RELAYRL_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token["optional"] is True, role
    assert run_config(docs)["controller"]["host"] == "0.0.0.0"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configmap_generated_and_mounted(overlay: str):
    docs = render(overlay)
    cm = one(docs, "ConfigMap", "relayrl-config-")
    assert cm["metadata"]["name"] != "relayrl-config", "expected kustomize's hash suffix"
    cfg = run_config(docs)
    sections = {"run", "model", "data", "rollout", "controller", "trainer", "weight_sync", "algorithm"}
    assert set(cfg) == sections
    for role, w in workloads(docs).items():
        vol = volume_for_mount(w, CONFIG_MOUNT)
        assert vol["configMap"]["name"] == cm["metadata"]["name"], role
        assert arg_after(container(w)["args"], "--config") == CONFIG_PATH, role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_parses_with_relayrl_schema(overlay: str, tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(one(render(overlay), "ConfigMap", "relayrl-config-")["data"]["config.yaml"])
    config.load_config(path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_controller_may_scale_rollout(overlay: str):
    docs = render(overlay)
    dep, sts = one(docs, "Deployment"), one(docs, "StatefulSet")
    sa = pod_spec(dep)["serviceAccountName"]
    by_name(docs, "ServiceAccount", sa)
    binding = one(docs, "RoleBinding")
    subject = {"kind": "ServiceAccount", "name": sa, "namespace": dep["metadata"]["namespace"]}
    assert subject in binding["subjects"]
    role = by_name(docs, "Role", binding["roleRef"]["name"])
    assert binding["roleRef"]["kind"] == "Role"
    scale_rules = [r for r in role["rules"] if "statefulsets/scale" in r["resources"]]
    assert scale_rules
    rule = scale_rules[0]
    assert rule["apiGroups"] == ["apps"]
    assert "patch" in rule["verbs"]
    assert rule["resourceNames"] == [sts["metadata"]["name"]]
    # the other workloads get no API credentials
    for w in (sts, one(docs, "Job")):
        assert pod_spec(w)["automountServiceAccountToken"] is False


def test_cpu_demo_sizes():
    docs = render("cpu-demo")
    w = workloads(docs)
    assert w["rollout"]["spec"]["replicas"] == 2
    assert w["trainer"]["spec"]["completions"] == 2
    for role, wl in w.items():
        c = container(wl)
        assert c["image"] == "ghcr.io/relayrl/relayrl:0.1.0"
        for section in ("requests", "limits"):
            assert "nvidia.com/gpu" not in c["resources"][section], role
        cpu = c["resources"]["requests"]["cpu"]
        assert cpu.endswith("m") and int(cpu[:-1]) <= 500, f"{role}: cpu request {cpu} is not small"
    cfg = run_config(docs)
    assert cfg["rollout"]["engine"] == "hf"
    assert cfg["weight_sync"]["backend"] == "gloo"


def test_gpu_vllm_requests_gpus():
    docs = render("gpu-vllm")
    w = workloads(docs)
    assert w["rollout"]["spec"]["replicas"] == 4
    for role in ("rollout", "trainer"):
        c = container(w[role])
        assert c["image"] == "ghcr.io/relayrl/relayrl:0.1.0-cuda"
        gpus = c["resources"]["limits"]["nvidia.com/gpu"]
        assert int(gpus) >= 1, role
        env = env_of(c)
        assert env["NCCL_SOCKET_IFNAME"]["value"] and env["GLOO_SOCKET_IFNAME"]["value"], role
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod_spec(w[role]).get("tolerations", [])), role
    trainer = container(w["trainer"])
    assert env_of(trainer)["NPROC_PER_NODE"]["value"] == trainer["resources"]["limits"]["nvidia.com/gpu"]
    cfg = run_config(docs)
    assert cfg["rollout"]["engine"] == "vllm"
    assert cfg["model"]["path"].startswith("Qwen/Qwen2.5-")
    assert cfg["weight_sync"]["backend"] == "nccl"
    # the controller's state survives restarts here
    assert "persistentVolumeClaim" in volume_for_mount(w["controller"], "/var/lib/relayrl/controller")


def test_gpu_megatron_trains_with_megatron_on_every_gpu():
    docs = render("gpu-megatron")
    w = workloads(docs)
    trainer = container(w["trainer"])
    assert trainer["image"] == "ghcr.io/relayrl/relayrl:0.1.0-cuda"
    env = env_of(trainer)
    world = int(env["NNODES"]["value"]) * int(env["NPROC_PER_NODE"]["value"])
    assert env["NPROC_PER_NODE"]["value"] == trainer["resources"]["limits"]["nvidia.com/gpu"]
    cfg = run_config(docs)
    layout = cfg["trainer"]["megatron"]
    assert cfg["trainer"]["backend"] == "megatron"
    assert cfg["trainer"]["nproc"] == world  # = TP x PP x DP
    assert world % (layout["tensor_parallel"] * layout["pipeline_parallel"]) == 0
    assert w["trainer"]["metadata"]["labels"]["app.kubernetes.io/instance"] == "gpu-megatron"


def mount_covering(workload: dict, path: str) -> tuple[str, dict]:
    """The volume mounted deepest above ``path`` (what the container sees there): (its mount path, the volume)."""
    mounts = [m for m in container(workload).get("volumeMounts", []) if (path + "/").startswith(m["mountPath"] + "/")]
    assert mounts, f"{workload['metadata']['name']}: nothing mounted above {path}"
    deepest = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    return deepest["mountPath"], volumes[deepest["name"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_trainer_ranks_and_controller_share_one_run_dir_claim(overlay: str):
    """Every trainer pod (one template for all the Job's pods) and the controller see the config's run.dir on the
    same ReadWriteMany claim: checkpoints (<run.dir>/<name>/checkpoints, written by every rank, trainer_state.json
    by rank 0) and final/ live there, so a restarted pod resumes from what rank 0 chose and the export outlives
    the pods."""
    docs = render(overlay)
    w = workloads(docs)
    pods = w["trainer"]["spec"]["completions"] + w["rollout"]["spec"]["replicas"] + w["controller"]["spec"]["replicas"]
    assert pods > 1  # every overlay is a multi-pod deployment: the run dir must be shared
    run_dir = run_config(docs)["run"]["dir"]
    claims = {}
    for role in ("trainer", "controller"):
        mount_path, volume = mount_covering(w[role], run_dir)
        assert "persistentVolumeClaim" in volume, f"{overlay} {role}: {run_dir} is on {volume} (one disk per pod)"
        claims[role] = (mount_path, volume["persistentVolumeClaim"]["claimName"])
    assert claims["trainer"] == claims["controller"], claims
    claim = by_name(docs, "PersistentVolumeClaim", claims["trainer"][1])
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], claim["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_has_a_build_recipe_with_what_the_config_needs(overlay: str):
    """Each image an overlay runs is built by a Dockerfile in the repository (its header's ``docker build ... -t
    IMAGE``) that installs the extras the overlay's config needs (the engine, the Megatron backend)."""
    docs = render(overlay)
    cfg = run_config(docs)
    needed = {cfg["rollout"]["engine"]} - {"hf"} | ({"megatron"} if cfg["trainer"]["backend"] == "megatron" else set())
    recipes = {path: path.read_text() for path in REPO.glob("Dockerfile*")}
    for w in workloads(docs).values():
        for c in [*pod_spec(w)["containers"], *pod_spec(w).get("initContainers", [])]:
            built = [path for path, text in recipes.items() if f"-t {c['image']} ." in text]
            assert len(built) == 1, f"{overlay}: no single recipe builds {c['image']} ({[p.name for p in built]})"
            text = recipes[built[0]]
            for name, default in re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE):
                text = text.replace(f"${{{name}}}", default)
            extras = {e for group in re.findall(r"\.\[([\w,]+)\]", text) for e in group.split(",")}
            assert needed <= extras, f"{built[0].name} lacks the extras {needed - extras} that {overlay} needs"


def test_every_example_a_deploy_file_names_exists():
    named = {
        (path.relative_to(REPO), m)
        for path in (REPO / "deploy").rglob("*")
        if path.is_file()
        for m in re.findall(r"examples/[\w./-]*\w", path.read_text())
    }
    assert named, "the deploy files name no example: the pattern is out of date"
    missing = sorted((str(path), example) for path, example in named if not (REPO / example).exists())
    assert not missing, missing


@pytest.mark.parametrize("version", VERSIONS)
def test_the_reward_overlay_serves_the_scorer_its_config_calls(version: str):
    """cpu-reward = cpu-demo + the reward component (docs/reward-models.md): a StatefulSet of `relayrl reward serve`
    behind a headless Service with gRPC probes on its port; pod 0 is the config's scorer address, as it advertises
    itself, and every pod joins the controller's list when it serves; the config names the scorer in
    controller.reward.fns and starts no replica itself; the reward model is read from the run-dir claim."""
    docs = render("cpu-reward")
    assert_valid(docs, version)
    reward, service = by_name(docs, "StatefulSet", "relayrl-reward"), by_name(docs, "Service", "relayrl-reward")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert selects(service, reward) and not selects(service, by_name(docs, "StatefulSet", "relayrl-rollout"))
    c = container(reward)
    assert c["args"][:2] == ["reward", "serve"] and arg_after(c["args"], "--host") == "0.0.0.0"
    name, port = arg_after(c["args"], "--name"), int(arg_after(c["args"], "--port"))
    assert all(c[probe]["grpc"]["port"] == port for probe in ("startupProbe", "readinessProbe", "livenessProbe"))
    cfg = config.parse_config(run_config(docs))
    scorer = cfg.scorers[name]
    assert scorer.replicas == 0 and f"scorer:{name}" in cfg.controller.reward.fns
    advertised = arg_after(c["args"], "--advertise")  # every pod joins the controller's list when it serves
    assert advertised == f"$(POD_NAME).relayrl-reward.$(POD_NAMESPACE).svc:{port}"
    assert arg_after(c["args"], "--controller") == "$(RELAYRL_CONTROLLER)"
    assert env_of(c)["RELAYRL_CONTROLLER"]["value"] == f"relayrl-controller:{CONTROLLER_PORT}"
    namespace = reward["metadata"]["namespace"]
    assert scorer.servers == [f"relayrl-reward-0.relayrl-reward.{namespace}.svc:{port}"]  # pod 0, as it advertises
    assert volume_for_mount(reward, "/var/lib/relayrl/runs")["persistentVolumeClaim"]["claimName"] == "relayrl-run"
    assert scorer.model.startswith("/var/lib/relayrl/runs/")
