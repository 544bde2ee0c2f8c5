"""The container files: Dockerfiles (Docker's own parser), pins against pyproject.toml, the image
entrypoint, docker/run.sh's exact docker command, the image workflow, and shellcheck on every
shell script. No Docker engine needed."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"rocm": ROOT / "docker/Dockerfile.rocm", "cuda": ROOT / "docker/Dockerfile.cuda"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = sorted([*ROOT.glob("scripts/*.sh"), *ROOT.glob("docker/*.sh"), ROOT / ".ci/run"])
MINE = ["docker/run.sh", "docker/entrypoint.sh", "docker/install.sh", "scripts/check_host.sh",
        "scripts/start_ray.sh", "scripts/smoke.sh"]

# Instructions of the Dockerfile reference; the parser accepts any word, so unknown ones are ours to catch.
INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}


def _pin(requirements: list[str], name: str) -> str:
    """'ray==2.60.0' -> '2.60.0' for `name` in a list of requirement strings."""
    for req in requirements:
        m = re.fullmatch(rf"{re.escape(name)}==([\w.]+)", req.strip())
        if m:
            return m.group(1)
    raise AssertionError(f"no {name}==X pin in {requirements}")


def parse(text: str):
    dockerfile = pytest.importorskip("dockerfile", reason="the `dockerfile` package (requirements/cpu.lock) is missing")
    return dockerfile.parse_string(text)


def dockerfile_problems(text: str) -> list[str]:
    """What is wrong with a Dockerfile, as parsed by Docker's own (Go) parser; [] when nothing."""
    cmds = parse(text)
    problems = [f"line {c.start_line}: unknown instruction {c.cmd}" for c in cmds if c.cmd not in INSTRUCTIONS]
    args = {}
    for c in cmds:
        if c.cmd != "ARG":
            break
        name, _, default = c.value[0].partition("=")
        args[name] = default
    froms = [c for c in cmds if c.cmd == "FROM"]
    if not cmds or cmds[0].cmd not in ("FROM", "ARG") or not froms:
        problems.append("does not start with FROM (or ARGs then FROM)")
    for c in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), c.value[0])
        tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
        if not tag or tag == "latest" or "$" in image:
            problems.append(f"line {c.start_line}: base image {image!r} is not pinned to a tag")
    for c in cmds:
        if c.cmd in ("ENTRYPOINT", "CMD") and not c.json:
            problems.append(f"line {c.start_line}: {c.cmd} in shell form (signals would not reach the process)")
    return problems


def args_of(path: Path) -> dict[str, str]:
    out = {}
    for c in parse(path.read_text()):
        if c.cmd == "ARG" and "=" in c.value[0]:
            name, _, default = c.value[0].partition("=")
            out[name] = default
    return out


@pytest.mark.parametrize("platform", sorted(DOCKERFILES))
def test_dockerfile_parses_and_is_pinned(platform):
    assert dockerfile_problems(DOCKERFILES[platform].read_text()) == []


def test_dockerfile_check_catches_mistakes():
    bad = 'FROM rocm/vllm:latest\nRUNN pip install x\nFROM ubuntu\nENTRYPOINT run.sh\n'
    problems = dockerfile_problems(bad)
    assert any("unknown instruction RUNN" in p for p in problems)
    assert any("'rocm/vllm:latest' is not pinned" in p for p in problems)
    assert any("'ubuntu' is not pinned" in p for p in problems)
    assert any("ENTRYPOINT in shell form" in p for p in problems)
    with pytest.raises(Exception):  # the Go parser itself: an unterminated heredoc
        parse("FROM a:1\nRUN <<EOF\necho\n")


@pytest.mark.parametrize("platform", sorted(DOCKERFILES))
def test_env_defaults_one_per_line_with_a_why(platform):
    path = DOCKERFILES[platform]
    lines = path.read_text().splitlines()
    envs = [c for c in parse(path.read_text()) if c.cmd == "ENV"]
    assert envs
    for c in envs:
        assert len(c.value) == 2 and c.start_line == c.end_line, f"{path.name}:{c.start_line} sets more than one variable"
        above = lines[c.start_line - 2].strip()
        assert above.startswith("# ") and len(above) > 12, f"{path.name}:{c.start_line} {c.value[0]} has no comment saying why"


def test_vllm_variables_exist_in_vllm():
    """A renamed or misspelt VLLM_* variable is silently ignored by vLLM: check the names against
    the installed vLLM's envs.py (read as text; importing vLLM takes seconds)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    envs_py = Path(next(iter(spec.submodule_search_locations))) / "envs.py"
    known = set(re.findall(r'^\s+"(VLLM_\w+)":', envs_py.read_text(), re.M))
    assert len(known) > 100, envs_py
    for path in DOCKERFILES.values():
        names = [c.value[0] for c in parse(path.read_text()) if c.cmd == "ENV" and c.value[0].startswith("VLLM_")]
        assert names and set(names) <= known, f"{path.name}: unknown to vLLM: {sorted(set(names) - known)}"
    rocm = {c.value[0]: c.value[1] for c in parse(DOCKERFILES["rocm"].read_text()) if c.cmd == "ENV"}
    assert rocm["VLLM_ROCM_USE_AITER"] == "1"
    assert rocm["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1"


def test_pins_agree_with_pyproject():
    project = PYPROJECT["project"]
    deps, extras = project["dependencies"], project["optional-dependencies"]
    want = {
        "COLOCATE_RL_VERSION": project["version"],
        "MEGATRON_CORE_VERSION": _pin(extras["rocm"], "megatron-core"),
        "RAY_VERSION": _pin(deps, "ray"),
        "OMEGACONF_VERSION": _pin(deps, "omegaconf"),
    }
    assert _pin(extras["gpu"], "megatron-core") == want["MEGATRON_CORE_VERSION"]
    for platform, path in DOCKERFILES.items():
        args = args_of(path)
        assert {k: args.get(k) for k in want} == want, path.name
    # CUDA: the base image is the vLLM release pinned in the `gpu` extra.
    assert args_of(DOCKERFILES["cuda"])["BASE_IMAGE"] == f"vllm/vllm-openai:v{_pin(extras['gpu'], 'vllm')}"
    # ROCm: vLLM comes only from the rocm/vllm image; the ARG names the version its tag carries.
    rocm = args_of(DOCKERFILES["rocm"])
    assert rocm["BASE_IMAGE"].startswith("rocm/vllm:")
    assert rocm["BASE_IMAGE"].endswith(f"_vllm_{rocm['ROCM_VLLM_VERSION']}")
    assert not any(re.match(r"vllm\b", r) for r in extras["rocm"])
    # The install script reads the ARGs (and so fails the build if a pin does not take).
    install = (ROOT / "docker/install.sh").read_text()
    for name in ("MEGATRON_CORE_VERSION", "RAY_VERSION", "OMEGACONF_VERSION"):
        assert f"${{{name}}}" in install


def test_nothing_depends_on_pypi_aiter():
    """AITER ships inside the rocm/vllm image; PyPI's `aiter` is an unrelated package."""
    reqs = list(PYPROJECT["project"]["dependencies"])
    for group in PYPROJECT["project"]["optional-dependencies"].values():
        reqs += group
    reqs += (ROOT / "requirements/cpu.lock").read_text().split()
    names = {re.split(r"[\s=<>!~\[;]", r, maxsplit=1)[0].lower() for r in reqs if r and not r.startswith("#")}
    assert "aiter" not in names
    assert not re.search(r"pip[^\n]*install[^\n]*\baiter\b", (ROOT / "docker/install.sh").read_text())


# ------------------------------------------------------------------------ docker/run.sh --dry-run


def dry_run(*args: str, env: dict | None = None) -> tuple[list[list[str]], subprocess.CompletedProcess]:
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("HF_TOKEN", "WANDB_API_KEY", "COLOCATE_RL_IMAGE", "COLOCATE_RL_RAY_TOKEN_FILE")}
    full_env.update(env or {})
    proc = subprocess.run(["bash", str(ROOT / "docker/run.sh"), "--dry-run", *args], capture_output=True,
                          text=True, env=full_env, cwd=ROOT, timeout=30)
    return [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()], proc


def _mounts(run: list[str]) -> dict[str, str]:
    """-v SRC:DST pairs of a docker run command, DST -> SRC."""
    return {v.split(":")[1]: v.split(":")[0] for flag, v in zip(run, run[1:]) if flag == "-v"}


def _after_image(run: list[str], image: str) -> list[str]:
    return run[run.index(image) + 1:]


def test_run_rocm_command(tmp_path):
    recipe = ["recipes/dsv4_flash_grpo.py", "preset=amd-3node", "rollout.n=16", "data.train=/data/x y.jsonl"]
    cmds, proc = dry_run("--rocm", "--data", str(tmp_path / "d"), "--checkpoints", str(tmp_path / "c"),
                         "--hf-cache", str(tmp_path / "hf"), *recipe, env={"HF_TOKEN": "secret-value"})
    assert proc.returncode == 0, proc.stderr
    version = PYPROJECT["project"]["version"]
    image = f"ghcr.io/colocate-rl/colocate-rl:{version}-rocm"
    assert cmds[0] == ["docker", "pull", image]
    run = cmds[1]
    assert run[:2] == ["docker", "run"]
    opts = run[:run.index(image)]
    for flag in ["--device=/dev/kfd", "--device=/dev/dri", "--ipc=host", "--network=host",
                 "--ulimit", "nofile=1048576:1048576", "memlock=-1:-1", "seccomp=unconfined"]:
        assert flag in opts, flag
    assert opts[opts.index("--group-add") + 1] == "video"
    assert opts[opts.index("--security-opt") + 1] == "seccomp=unconfined"
    assert any(o.startswith("--shm-size=") for o in opts)
    assert "--gpus" not in opts
    mounts = _mounts(opts)
    assert mounts["/data"] == str(tmp_path / "d")
    assert mounts["/workspace/colocate_rl/runs"] == str(tmp_path / "c")
    assert mounts["/root/.cache/huggingface"] == str(tmp_path / "hf")
    # The token goes by name (docker copies it from the host), never by value.
    assert opts[opts.index("HF_TOKEN") - 1] == "-e" and "secret-value" not in proc.stdout
    assert _after_image(run, image) == recipe  # passed through unchanged, spaces included


def test_run_cuda_command(tmp_path):
    cmds, proc = dry_run("--cuda", "--no-pull", "--image", "my/img:1", "--name", "crl", "--env", "NCCL_DEBUG=INFO",
                         "--", "scripts/smoke.sh", "--steps", "2", env={"HOME": str(tmp_path), "HF_HOME": ""})
    assert proc.returncode == 0, proc.stderr
    assert len(cmds) == 1  # --no-pull: no docker pull
    run = cmds[0]
    opts = run[:run.index("my/img:1")]
    assert opts[opts.index("--gpus") + 1] == "all"
    assert not any("/dev/kfd" in o or "seccomp" in o for o in opts)
    assert "--ipc=host" in opts and "nofile=1048576:1048576" in opts
    assert opts[opts.index("--name") + 1] == "crl"
    assert opts[opts.index("NCCL_DEBUG=INFO") - 1] == "-e"
    mounts = _mounts(opts)
    assert mounts["/data"] == str(ROOT / "data") and mounts["/workspace/colocate_rl/runs"] == str(ROOT / "runs")
    assert mounts["/root/.cache/huggingface"] == str(tmp_path / ".cache/huggingface")
    assert _after_image(run, "my/img:1") == ["scripts/smoke.sh", "--steps", "2"]


def test_run_image_name_and_errors():
    cmds, proc = dry_run("--cuda", "recipes/qwen3_grpo.py", env={"COLOCATE_RL_IMAGE": "registry.example/team/crl"})
    assert cmds[0][-1] == f"registry.example/team/crl:{PYPROJECT['project']['version']}-cuda"
    _, proc = dry_run("--rocm", "--bogus")
    assert proc.returncode == 2 and "unknown option --bogus" in proc.stderr
    _, proc = dry_run(env={"COLOCATE_RL_PLATFORM": "tpu"})
    assert proc.returncode == 2 and "tpu" in proc.stderr


RAY_SECRET = "/run/secrets/colocate_rl_ray_token"


def test_run_passes_the_ray_token_by_file_only(tmp_path):
    token = tmp_path / "ray_token"
    token.write_text("5e" * 32)
    token.chmod(0o600)
    cmds, proc = dry_run("--cuda", "--no-pull", "--image", "my/img:1", "--ray-token-file", str(token),
                         "scripts/start_ray.sh", "head", "--block")
    assert proc.returncode == 0, proc.stderr
    (run,) = cmds
    opts = run[:run.index("my/img:1")]
    # Mounted read-only; the container learns its path, never its text.
    assert opts[opts.index(f"{token}:{RAY_SECRET}:ro") - 1] == "-v"
    assert opts[opts.index(f"COLOCATE_RL_RAY_TOKEN_FILE={RAY_SECRET}") - 1] == "-e"
    assert "5e" * 32 not in proc.stdout + proc.stderr
    assert _after_image(run, "my/img:1") == ["scripts/start_ray.sh", "head", "--block"]
    cmds, _ = dry_run("--cuda", "--no-pull", "x.py", env={"COLOCATE_RL_RAY_TOKEN_FILE": str(token)})
    assert _mounts(cmds[0])[RAY_SECRET] == str(token)
    cmds, _ = dry_run("--cuda", "--no-pull", "x.py")
    assert RAY_SECRET not in _mounts(cmds[0]) and "COLOCATE_RL_RAY_TOKEN_FILE" not in " ".join(cmds[0])


def test_run_creates_a_missing_ray_token_privately(tmp_path):
    """Past --dry-run, with a `docker` on PATH that only records its arguments (no engine here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" >> "$DOCKER_ARGS"\n')
    (bin_dir / "docker").chmod(0o755)
    token, args = tmp_path / "keys/ray_token", tmp_path / "docker_args"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", DOCKER_ARGS=str(args))

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "docker/run.sh"), "--cuda", "--no-pull", "--image", "my/img:1",
                               "--data", str(tmp_path / "d"), "--checkpoints", str(tmp_path / "c"), "--hf-cache",
                               str(tmp_path / "hf"), "--ray-token-file", str(token), "x.py"],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)

    proc = run()
    assert proc.returncode == 0, proc.stderr
    assert "new Ray token written" in proc.stderr
    assert oct(token.stat().st_mode & 0o777) == "0o600"
    text = token.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", text)
    assert f"{token}:{RAY_SECRET}:ro" in args.read_text().splitlines()
    assert text not in args.read_text() + proc.stdout + proc.stderr
    proc = run()  # the next node's command on this host: the same token
    assert proc.returncode == 0 and "new Ray token" not in proc.stderr and token.read_text() == text
    token.chmod(0o640)
    proc = run()
    assert proc.returncode == 2 and f"chmod 600 {token}" in proc.stderr


def test_workflow_builds_what_run_sh_pulls():
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load((ROOT / ".github/workflows/images.yml").read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as True
    assert on["push"]["tags"] == ["v*"]
    job = wf["jobs"]["build"]
    platforms = job["strategy"]["matrix"]["platform"]
    assert sorted(platforms) == sorted(DOCKERFILES)
    build = next(s for s in job["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action"))
    assert build["with"]["file"] == "docker/Dockerfile.${{ matrix.platform }}"
    assert build["with"]["push"] is True
    tags = build["with"]["tags"].splitlines()
    # The same <version>-<platform> tag that docker/run.sh pulls by default.
    assert "${{ steps.meta.outputs.image }}:${{ steps.meta.outputs.version }}-${{ matrix.platform }}" in tags
    check = next(s for s in job["steps"] if s.get("id") == "meta")["run"]
    assert "pyproject.toml" in check and "GITHUB_REF_NAME" in check


# ------------------------------------------------------------------------ docker/entrypoint.sh


def entrypoint_env(**env) -> tuple[dict, subprocess.CompletedProcess]:
    base = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES")}
    proc = subprocess.run(["bash", str(ROOT / "docker/entrypoint.sh"), "env"], capture_output=True, text=True,
                          env={**base, **env}, timeout=30)
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line), proc


def test_entrypoint_makes_visible_devices_agree(tmp_path):
    got, _ = entrypoint_env(ROCR_VISIBLE_DEVICES="4,5,6")  # Slurm on AMD: indices within the ROCr set
    assert got["HIP_VISIBLE_DEVICES"] == got["CUDA_VISIBLE_DEVICES"] == "0,1,2"
    got, _ = entrypoint_env(HIP_VISIBLE_DEVICES="2,3")
    assert got["CUDA_VISIBLE_DEVICES"] == "2,3"
    _, proc = entrypoint_env(HIP_VISIBLE_DEVICES="0", CUDA_VISIBLE_DEVICES="1")
    assert proc.returncode == 2 and "differ" in proc.stderr
    script = tmp_path / "hello.py"
    script.write_text("import sys; print('py', sys.argv[1:])\n")
    proc = subprocess.run(["bash", str(ROOT / "docker/entrypoint.sh"), str(script), "a=1"], capture_output=True,
                          text=True, timeout=30)
    assert proc.stdout.strip() == "py ['a=1']"


# ------------------------------------------------------------------------ shellcheck


def _shellcheck(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (scripts/setup_env.sh installs it with apt-get when root)")
    return subprocess.run(["shellcheck", "--shell=bash", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck_every_script(script):
    # Warnings and errors; info-level notes misfire on idioms such as setup_env.sh's
    # `return 0 2>/dev/null || exit 0` (a script that is both sourced and run).
    proc = _shellcheck("--severity=warning", str(script))
    assert proc.returncode == 0, proc.stdout


def test_shellcheck_container_scripts_fully_clean():
    proc = _shellcheck("--severity=style", *(str(ROOT / s) for s in MINE))
    assert proc.returncode == 0, proc.stdout


def test_shellcheck_catches_a_bug(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nrm -rf $1/\ncd $dir\n')
    proc = _shellcheck("--severity=warning", str(bad))
    assert proc.returncode != 0 and "SC2164" in proc.stdout
