"""deploy/: `kubectl kustomize` renders every overlay and the rendered objects have what a muond pod
needs (probes on the gRPC health service, the state volume, ports, Secrets, a non-root security
context, resources; a GPU; K shards; TLS with exec probes); every MUOND_* variable they set is a
daemon flag; the systemd unit passes `systemd-analyze verify`; the Dockerfiles' defaults are flags."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.ops

REPO_ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ["cpu", "gpu", "sharded", "tls"]


def render(overlay: str):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here (the machine image carries it; Debian has no package)")
    result = subprocess.run([kubectl, "kustomize", str(KUSTOMIZE / "overlays" / overlay)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(result.stdout)}


def daemon_flags():
    from conftest import _daemon_binary
    result = subprocess.run([str(_daemon_binary()), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    return set(re.findall(r"--([a-z][a-z0-9-]+)", result.stdout))


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_a_complete_statefulset(overlay):
    objects = render(overlay)
    service = objects[("Service", "muond")]
    assert service["spec"]["clusterIP"] == "None"  # headless: a stable name per daemon
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "metrics": 9464}

    sts = objects[("StatefulSet", "muond")]
    assert sts["spec"]["serviceName"] == "muond"
    selector = sts["spec"]["selector"]["matchLabels"]
    assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert selector.items() <= service["spec"]["selector"].items()
    pod = sts["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = env_of(container)

    # State directory on the volume claim.
    [claim] = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]]["mountPath"] == env["MUOND_STATE_DIR"] == "/var/lib/muond"
    assert claim["spec"]["resources"]["requests"]["storage"]
    assert env["MUOND_DURABILITY"] == "journal"
    # Tokens from a Secret.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tokens"]["secret"]["secretName"] == "muond-tokens"
    assert env["MUOND_AUTH_TOKEN_FILE"].startswith(mounts["tokens"]["mountPath"] + "/")
    # Ports and metrics.
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"grpc": 50051, "metrics": 9464}
    assert env["MUOND_LISTEN"].endswith(":50051") and env["MUOND_METRICS_LISTEN"].endswith(":9464")
    # Non-root, nothing writable but the volumes.
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    # Probes: native gRPC on the health service, or exec through muondctl when TLS is on.
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        spec = container[probe]
        if "MUOND_TLS_CERT" in env:
            command = spec["exec"]["command"]
            assert command[0] == "muondctl" and command[-1] == "health" and "--tls-ca-file" in command
            assert "grpc" not in spec
        else:
            assert spec["grpc"]["port"] == 50051 and "exec" not in spec
    # Every MUOND_* variable names a daemon flag (a typo would be silently ignored).
    flags = daemon_flags()
    for name in env:
        if name.startswith("MUOND_"):
            assert name[6:].lower().replace("_", "-") in flags, name


def test_overlay_specifics():
    gpu = render("gpu")[("StatefulSet", "muond")]["spec"]["template"]["spec"]
    [container] = gpu["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert env_of(container)["MUOND_BACKEND"] == "cuda" and container["image"].endswith("-cuda")
    assert env_of(container)["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"

    sharded = render("sharded")[("StatefulSet", "muond")]
    assert sharded["spec"]["replicas"] == 3 and sharded["spec"]["podManagementPolicy"] == "Parallel"
    anti = sharded["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"

    tls = render("tls")[("StatefulSet", "muond")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in tls["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "muond-tls"
    env = env_of(tls["containers"][0])
    assert env["MUOND_TLS_CERT"].startswith("/etc/muond/tls/") and env["MUOND_TLS_KEY"].startswith("/etc/muond/tls/")


def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    from conftest import _daemon_binary
    binary = str(_daemon_binary().resolve())
    unit = (REPO_ROOT / "deploy" / "systemd" / "muond.service").read_text()
    assert "DynamicUser=yes" in unit and "StateDirectory=muond" in unit and "ProtectSystem=strict" in unit
    assert "NoNewPrivileges=yes" in unit and "Environment=MUOND_STATE_DIR=/var/lib/muond" in unit
    (tmp_path / "muond.service").write_text(unit.replace("/usr/local/bin/muond", binary))
    dropins = tmp_path / "muond.service.d"
    dropins.mkdir()
    (dropins / "gpu.conf").write_text(
        (REPO_ROOT / "deploy" / "systemd" / "muond-gpu.conf").read_text().replace("/usr/local/bin/muond", binary))
    result = subprocess.run([analyze, "verify", str(tmp_path / "muond.service")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr
    # The unit configures the daemon through MUOND_<FLAG> variables only, each naming a daemon flag
    # (so /etc/default/muond can override any of them without a flag given twice).
    flags = daemon_flags()
    [command] = re.findall(r"^ExecStart=(.*)$", unit, re.MULTILINE)
    assert command == "/usr/local/bin/muond"
    text = unit + (REPO_ROOT / "deploy" / "systemd" / "muond-gpu.conf").read_text()
    variables = re.findall(r"\bMUOND_([A-Z_]+)=", text)
    assert {"LISTEN", "STATE_DIR", "DURABILITY", "METRICS_LISTEN", "BACKEND"} <= set(variables)
    for variable in variables:
        assert variable.lower().replace("_", "-") in flags, variable


def test_dockerfiles_set_only_daemon_flags():
    flags = daemon_flags()
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (REPO_ROOT / "docker" / name).read_text()
        assert "HEALTHCHECK" in text and "muondctl" in text and "USER 1000" in text
        for variable in re.findall(r"\bMUOND_([A-Z_]+)=", text):
            assert variable.lower().replace("_", "-") in flags, (name, variable)
    assert (REPO_ROOT / ".dockerignore").is_file()


def test_the_sharded_overlay_runs_a_sharded_session(start_daemon, tmp_path, monkeypatch):
    """Three daemons configured exactly as the sharded overlay's pods are (its MUOND_* environment;
    only addresses, paths and the thread count are this machine's) train one sharded session with a
    token, survive a kill -9 of one shard (journal durability from the manifest), and leave state
    directories that `muondctl state verify` accepts."""
    import muond
    from helpers import TinyNet, loss_of
    from test_ops_muondctl import ctl_json

    sts = render("sharded")[("StatefulSet", "muond")]
    replicas = sts["spec"]["replicas"]
    env = env_of(sts["spec"]["template"]["spec"]["containers"][0])
    tokens = tmp_path / "tokens"
    tokens.write_text("trainer:pod-token\n")
    tokens.chmod(0o600)
    local = {"MUOND_LISTEN": "127.0.0.1:0", "MUOND_METRICS_LISTEN": "127.0.0.1:0", "MUOND_THREADS": "1",
             "MUOND_AUTH_TOKEN_FILE": str(tokens)}

    def start(index, listen="127.0.0.1:0"):
        for name, value in {**env, **local, "MUOND_STATE_DIR": str(tmp_path / f"state-{index}")}.items():
            monkeypatch.setenv(name, value)
        return start_daemon(listen=listen, workdir=tmp_path / f"pod-{index}")

    pods = [start(i) for i in range(replicas)]
    endpoints = [p.endpoint for p in pods]
    model = TinyNet(seed=21)
    opt = muond.RemoteOptimizer(muond.default_param_groups(model), endpoints=endpoints, session="sharded-pods",
                                auth_token="pod-token", max_grad_norm=1.0)
    for step in range(1, 4):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    pods[1].kill()  # a node lost mid-run: its journal holds every acknowledged step
    pods[1] = start(1, listen=endpoints[1])  # the pod comes back under its stable name
    for step in range(4, 7):
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad()
    assert opt.last_step == 6
    for index, pod in enumerate(pods):
        shown = ctl_json("-e", pod.endpoint, "sessions", "show", "sharded-pods",
                         env={"MUOND_AUTH_TOKEN": "pod-token"})
        assert shown["last_step"] == 6 and shown["spec"]["shard"]["index"] == index
    opt.close(keep_session=True)
    for pod in pods:
        pod.stop()
    for index in range(replicas):
        assert ctl_json("state", "verify", tmp_path / f"state-{index}")["ok"] is True
