"""The offline wheelhouse: built from a local package index, split into parts, reassembled, installed with no
network into a fresh venv that reuses the system's packages (--system-site-packages).

The index is a folder of small wheels made here (no network in CI): `fakevllm` stands for vLLM; it requires
`alpha` (which requires `epsilon`, 300 KiB of incompressible bytes, so splitting cuts it into chunks), `mcp` (which
the text profile leaves out), a package the base interpreter really has installed (the "target's own", listed in
`--have` and so never downloaded), and one package behind a marker that is false on the target.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from importlib.metadata import distributions
from pathlib import Path

import pytest

from deploy.wheelhouse import (MIB, Target, WheelhouseError, assemble, is_stub, plan_requirements, read_have, split,
                               stub_wheel)

ROOT = Path(__file__).resolve().parent.parent
PY = f"{sys.version_info.major}.{sys.version_info.minor}"


def make_wheel(directory: Path, name: str, version: str, requires: list[str] = (),  # type: ignore[assignment]
               payload: bytes = b"") -> Path:
    """A pure-Python wheel with one module, `name.VERSION`, and an optional data file."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
             f"{info}/METADATA": ("Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n" +
                                  "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if payload:
        files[f"{name}/data.bin"] = payload
    digest = {n: base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode() for n, b in files.items()}
    record = "".join(f"{n},sha256={digest[n]},{len(b)}\n" for n, b in files.items()) + f"{info}/RECORD,,\n"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for n, b in files.items():
            wheel.writestr(n, b)
        wheel.writestr(f"{info}/RECORD", record)
    return path


def system_package() -> tuple[str, str]:
    """A distribution the base interpreter (what --system-site-packages exposes) has installed."""
    base_site = Path(sys.base_prefix) / "lib" / f"python{PY}" / "site-packages"
    found = sorted((d.metadata["Name"], d.version) for d in distributions(path=[str(base_site)])
                   if d.metadata["Name"] and d.metadata["Name"].lower() not in ("pip", "setuptools", "wheel"))
    if not found:
        pytest.fail(f"the base interpreter's site-packages ({base_site}) holds no package to stand for the "
                    "target's own; this test needs one")
    return found[0]


def offline_env(**extra: str) -> dict[str, str]:
    """No pip configuration, and an index nobody answers: anything pip tried to download would fail."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, tuple[str, str]]:
    """`scripts/wheelhouse.sh` against the local index, split into parts of 0.1 MiB."""
    tmp = tmp_path_factory.mktemp("wheelhouse")
    index = tmp / "index"
    index.mkdir()
    own, own_version = system_package()
    make_wheel(index, "fakevllm", "1.0", ["alpha>=1.0", f"{own}>={own_version}", "mcp>=1",
                                          'delta; python_version < "3"'])
    make_wheel(index, "alpha", "1.5", ["epsilon"])
    make_wheel(index, "alpha", "0.9")
    make_wheel(index, "epsilon", "2.0", payload=os.urandom(300 * 1024))
    make_wheel(index, "mcp", "1.0")
    (tmp / "freeze.txt").write_text(f"# the target's pip freeze\n{own}=={own_version}\n-e git+https://x#egg=y\n")
    out = tmp / "wh"
    result = subprocess.run(
        [str(ROOT / "scripts" / "wheelhouse.sh"), "--out", str(out), "--vllm", "fakevllm==1.0", "--have",
         str(tmp / "freeze.txt"), "--no-project", "--python-version", PY, "--pip-python", sys.executable,
         "--split-mib", "0.1"],
        env=offline_env(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index), PYTHON=sys.executable),
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, Path(f"{out}-parts"), (own, own_version)


def test_wheelhouse_holds_what_the_target_lacks(built: tuple[Path, Path, tuple[str, str]]) -> None:
    """vLLM (no deps) and its kept requirements with theirs; not the target's own, not the left-out, no stubs."""
    out, _, (own, own_version) = built
    names = sorted(p.name.split("-")[0] for p in out.glob("*.whl"))
    assert names == ["alpha", "epsilon", "fakevllm"]
    assert not any(is_stub(p) for p in out.glob("*.whl"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["provided_by_target"] == {own.lower().replace("_", "-"): own_version}
    assert list(manifest["left_out"]) == ["mcp"] and manifest["left_out"]["mcp"].startswith("cpu-proved")
    assert (out / "top.txt").read_text() == "fakevllm==1.0\n"
    assert "alpha>=1.0" in (out / "requirements.txt").read_text().splitlines()


def test_parts_are_at_most_the_limit_and_big_wheels_are_chunked(built: tuple[Path, Path, tuple[str, str]]) -> None:
    _, parts, _ = built
    folders = sorted(parts.glob("part-*"))
    assert len(folders) >= 3
    for folder in folders:
        assert sum(f.stat().st_size for f in folder.iterdir()) <= 0.1 * MIB
        assert (folder / "manifest.json").is_file()
    assert len(list(parts.glob("part-*/epsilon-2.0-py3-none-any.whl.chunk-*"))) >= 3


def test_assembly_detects_a_damaged_or_missing_part(built: tuple[Path, Path, tuple[str, str]],
                                                    tmp_path: Path) -> None:
    """A flipped byte in a chunk, or a missing part, is named; an intact copy assembles and verifies."""
    _, parts, _ = built
    copy = tmp_path / "parts"
    split(built[0], copy, 0.1)
    assert sorted(assemble(copy, tmp_path / "ok")["files"]) == sorted(p.name for p in built[0].glob("*.whl"))
    chunk = next(copy.glob("part-*/epsilon-*.chunk-001"))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(WheelhouseError, match="epsilon-2.0-py3-none-any.whl: SHA-256 differs"):
        assemble(copy, tmp_path / "bad")
    chunk.unlink()
    with pytest.raises(WheelhouseError, match=r"epsilon-2.0-py3-none-any.whl: chunks \[1\] missing"):
        assemble(copy, tmp_path / "bad2")


def test_install_offline_into_a_venv_that_reuses_the_system_packages(
        built: tuple[Path, Path, tuple[str, str]], tmp_path: Path) -> None:
    """`install.sh --wheelhouse PARTS --system-site-packages` with no index reachable: the parts are reassembled,
    the wheels installed, the target's own package taken from the system; a second run does nothing."""
    _, parts, (own, own_version) = built
    venv = tmp_path / "venv"
    env = offline_env(SMALLSERVE_VENV=str(venv), PYTHON=sys.executable)
    command = [str(ROOT / "scripts" / "install.sh"), "--wheelhouse", str(parts), "--system-site-packages"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    probe = ("import alpha, epsilon, fakevllm, importlib.metadata as m; "
             f"print(alpha.VERSION, fakevllm.VERSION, m.version({own!r}), m.distribution({own!r}).locate_file(''))")
    seen = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0, seen.stderr
    alpha, top, version, location = seen.stdout.split()
    assert (alpha, top, version) == ("1.5", "1.0", own_version)
    assert not location.startswith(str(venv))  # the system's copy, not one installed into the venv
    # This test's Python is itself a venv, like the GPU machines' python3: its site-packages are seen too.
    assert sys.prefix in (next(venv.glob("lib/python*/site-packages")) / "_parent_site.pth").read_text()
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "up to date" in again.stderr


def test_without_the_system_packages_the_offline_install_fails_clearly(
        built: tuple[Path, Path, tuple[str, str]], tmp_path: Path) -> None:
    """The target's own package is not in the wheelhouse: a venv that cannot see it cannot install offline."""
    _, parts, (own, _) = built
    env = offline_env(SMALLSERVE_VENV=str(tmp_path / "venv"), PYTHON=sys.executable)
    result = subprocess.run([str(ROOT / "scripts" / "install.sh"), "--wheelhouse", str(parts)], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and own.lower() in result.stderr.lower()


def test_pins_are_checked_against_the_target() -> None:
    """A requirement the target's version misses is a conflict naming both sides; torch's cannot be shipped over,
    another can (--ship); a local version label (+cu130) meets a plain pin; markers use the target's Python."""
    requires = ["torch==2.11.0", "aiohttp>=3.13.3", "six; python_version > '3.11'", "mcp", "fastapi[standard]<1"]
    target = Target("3.12")
    ok = plan_requirements("vllm==0.26.0", requires, target, {"torch": "2.11.0+cu130", "aiohttp": "3.14.0"}, "text")
    assert not ok.conflicts and ok.provided == {"torch": "2.11.0+cu130", "aiohttp": "3.14.0"}
    assert ok.requirements == ["torch==2.11.0", "aiohttp>=3.13.3", "six", "uvicorn", "jinja2", "fastapi<1"]
    assert ok.left_out == {"mcp": ok.left_out["mcp"]}
    bad = plan_requirements("vllm==0.26.0", requires, Target("3.11"), {"torch": "2.10.0", "aiohttp": "3.12.0"},
                            "full")
    assert [str(c) for c in bad.conflicts] == [
        "vllm==0.26.0 requires torch==2.11.0, the target has torch==2.10.0 (the target's CUDA stack cannot be "
        "replaced from a wheelhouse: use the vLLM release built for it)",
        "vllm==0.26.0 requires aiohttp>=3.13.3, the target has aiohttp==3.12.0 (ship a copy into the venv with "
        "--ship NAME)"]
    assert "six" not in bad.requirements and "mcp" in bad.requirements and "fastapi[standard]<1" in bad.requirements
    shipped = plan_requirements("vllm==0.26.0", ["aiohttp>=3.13.3"], target, {"aiohttp": "3.12.0"}, "text",
                                ship=["aiohttp"])
    assert not shipped.conflicts and shipped.requirements == ["aiohttp>=3.13.3"]


def test_freeze_parsing_and_stubs(tmp_path: Path) -> None:
    """Only name==version lines count; a stub wheel carries the target's first tag and the stub build number."""
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("Torch==2.11.0+cu130\nnvidia_ml_py==13.580.82\n-e ./x\npkg @ file:///x.whl\n# note\n")
    assert read_have(freeze) == {"torch": "2.11.0+cu130", "nvidia-ml-py": "13.580.82"}
    stub = stub_wheel(tmp_path, "torch", "2.11.0+cu130", Target("3.12"))
    assert stub.name == "torch-2.11.0+cu130-99999-cp312-cp312-manylinux_2_39_x86_64.whl" and is_stub(stub)
