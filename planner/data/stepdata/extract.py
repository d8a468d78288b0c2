"""Rebuild this folder's CSVs from snapshots of the two public repositories they come from (run by hand, once),
and the H200 file from this project's own GPU runs.

    python planner/data/stepdata/extract.py BSC_GIT_DIR ARGONNE_GIT_DIR
    python planner/data/stepdata/extract.py qwen QWEN_GIT_DIR
    python planner/data/stepdata/extract.py ft FASTERTRANSFORMER_GIT_DIR
    python planner/data/stepdata/extract.py paddle PADDLENLP_PERF_README
    python planner/data/stepdata/extract.py own docs/bench/gpu

Each argument is a clone (or bare git directory) of the repository named in the CSV's header, at the commit named
there; for `paddle`, the one file the header names (that repository is too large to clone here). Only numbers read
from those files are written; the header says how each column was derived.
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
BSC_COMMIT = "a9186347e6146b4547ed25674b4e9034eb1e9abf"
ARGONNE_COMMIT = "4211f5d4e9bc0145ed541b6d372d5d8223b44235"
BSC_ROOT = "benchmarks/definitive_results/background"
BSC_MODELS = ("opt-1.3b", "opt-2.7b", "llama-2-7b", "llama-2-13b")
# vLLM rows on one NVIDIA GPU for the architectures sim/model.py understands (llama, mistral, qwen2, opt).
ARGONNE_MODELS = {"meta-llama/Llama-2-7b-hf": "llama-2-7b", "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
                  "mistralai/Mistral-7B-v0.1": "mistral-7b", "Qwen/Qwen2-7B": "qwen2-7b",
                  "Qwen/Qwen1.5-7B": "qwen1.5-7b", "huggyllama/llama-7b": "llama-7b", "facebook/opt-6.7b": "opt-6.7b"}
ARGONNE_GPUS = {"Nvidia A100 GPU": "A100-40GB", "Nvidia H100 GPU": "H100-80GB", "Nvidia GH200 GPU": "GH200"}
OWN_FILE = "own-vllm026-h200.csv"
QWEN_FILE = "qwen-vllm063-a100-80gb.csv"
QWEN_COMMIT = "010c37c33b13a1ac59944b349620e13404efe97d"
QWEN_DOC = "docs/source/benchmark/speed_benchmark.rst"
QWEN_OUTPUT = 2048  # "generating 2048 tokens" (the document's notes)
FT_FILE = "fastertransformer50-a100-80gb.csv"
FT_COMMIT = "a44c38134cefe17a81c269b6ec23d91cfe4e7216"  # tag release/v5.0_tag
FT_DOC = "docs/gpt_guide.md"
FT_MODELS = ("350M", "1.3B", "6.7B", "20B")  # the single-GPU tables ("#### Performance of GPT-<size>")
PADDLE_FILE = "paddlenlp-fastgen-v100-16gb.csv"
PADDLE_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "opt-125m", "opt-350m")  # the page's names are the configs'
PADDLE_BATCH, PADDLE_PROMPT, PADDLE_OUTPUT = 4, 1, 32  # "Batch Size: 4", "Max Length: 32"; gpt_perf.py's one bos token


def write_keeping_header(path: Path, rows: list[list[str]]) -> None:
    """Write `rows` to `path` under the comment lines (provenance, columns) the file already starts with."""
    header = [line for line in path.read_text().splitlines(keepends=True) if line.startswith("#")] \
        if path.exists() else []
    body = io.StringIO()
    csv.writer(body, lineterminator="\n").writerows(rows)
    path.write_text("".join(header) + body.getvalue())


def git_show(repo: Path, commit: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", str(repo), "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def git_ls(repo: Path, commit: str, path: str) -> list[str]:
    out = subprocess.run(["git", "--git-dir", str(repo), "ls-tree", "--name-only", f"{commit}", f"{path}/"],
                         check=True, capture_output=True, text=True).stdout
    return [line.rsplit("/", 1)[-1] for line in out.splitlines()]


def saturated_window(rows: list[dict[str, float]], cap: int) -> tuple[dict[str, float], dict[str, float],
                                                                     list[dict[str, float]]] | None:
    """The longest run of samples with a full batch, a non-empty queue and no preemption in between."""
    full = [r["num_requests_running"] >= cap and r["num_requests_waiting"] > 0 for r in rows]
    best: tuple[int, int] | None = None
    i = 0
    while i < len(rows):
        if not full[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(rows) and full[j + 1] and rows[j + 1]["num_preemptions_total"] == rows[i][
                "num_preemptions_total"]:
            j += 1
        if j > i and (best is None or j - i > best[1] - best[0]):
            best = (i, j)
        i = j + 1
    if best is None:
        return None
    return rows[best[0]], rows[best[1]], rows[best[0]:best[1] + 1]


def bsc_point(repo: Path, model: str, cap: int) -> list[str] | None:
    folder = f"{BSC_ROOT}/{model}/_{cap}_"
    names = git_ls(repo, BSC_COMMIT, folder)
    metrics = list(csv.DictReader(io.StringIO(git_show(repo, BSC_COMMIT, f"{folder}/metrics_engine_server_0.csv"))))
    rows = [{k: float(v) for k, v in r.items()} for r in metrics]
    for r in rows:
        r["t"] = r["time [s]"]
    window = saturated_window(rows, cap)
    if window is None:
        return None
    first, last, inside = window
    log = git_show(repo, BSC_COMMIT, f"{folder}/server_out_0.log")
    match = re.search(r"# GPU blocks: (\d+)", log)
    version = re.search(r"version (\S+)", log)
    result = json.loads(git_show(repo, BSC_COMMIT, f"{folder}/{next(n for n in names if n.endswith('.json'))}"))
    if match is None or version is None:
        raise ValueError(f"{folder}: no block count or version in server_out_0.log")

    def mean(key: str) -> float:
        return float(sum(r[key] for r in inside[1:]) / (len(inside) - 1))
    return [model, str(cap), match.group(1), version.group(1), f"{last['t'] - first['t']:.4f}",
            f"{last['model_forward_total_time'] - first['model_forward_total_time']:.4f}",
            f"{last['prompt_tokens_total'] - first['prompt_tokens_total']:.0f}",
            f"{last['generation_tokens_total'] - first['generation_tokens_total']:.0f}",
            f"{mean('num_requests_running'):.3f}", f"{mean('gpu_cache_usage_perc'):.5f}",
            f"{result['total_input_tokens'] / result['completed']:.2f}",
            f"{result['total_output_tokens'] / result['completed']:.2f}", f"{result['mean_tpot_ms']:.3f}"]


def write_bsc(repo: Path) -> None:
    out = [["model", "max_num_seqs", "num_gpu_blocks", "vllm_version", "window_s", "forward_s", "prompt_tokens",
            "generation_tokens", "mean_running", "mean_kv_usage", "mean_prompt_tokens", "mean_output_tokens",
            "mean_tpot_ms"]]
    skipped = []
    for model in BSC_MODELS:
        caps = sorted(int(n.strip("_")) for n in git_ls(repo, BSC_COMMIT, f"{BSC_ROOT}/{model}") if n.startswith("_"))
        for cap in caps:
            row = bsc_point(repo, model, cap)
            if row is None:
                skipped.append(f"{model}@{cap}")
            else:
                out.append(row)
    path = HERE / "bsc-vllm052-h100-64gb.csv"
    write_keeping_header(path, out)
    print(f"{path}: {len(out) - 1} rows; no saturated window without preemption: {', '.join(skipped)}")


def write_argonne(repo: Path) -> None:
    rows = csv.DictReader(io.StringIO(git_show(repo, ARGONNE_COMMIT, "Plots/All_results.csv")))
    out = [["gpu", "model", "hub_id", "io_len", "batch", "latency_s"]]
    for r in rows:
        if r["Framework"] == "vLLM" and r["Num of Hardware"] == "1" and r["Hardware"] in ARGONNE_GPUS \
                and r["Model"] in ARGONNE_MODELS:
            out.append([ARGONNE_GPUS[r["Hardware"]], ARGONNE_MODELS[r["Model"]], r["Model"],
                        r["Input Output Length"], r["Batch Size"], f"{float(r['Latency']):.6g}"])
    path = HERE / "argonne-vllm-e2e.csv"
    write_keeping_header(path, out)
    print(f"{path}: {len(out) - 1} rows")


def own_point(path: Path, root: Path) -> list[str]:
    """One closed-loop point of `planner profile` (a GPU run's frontier/point-*.json) as a row of OWN_FILE."""
    data = json.loads(path.read_text())
    context, point = data["context"], data["point"]
    args = context.get("vllm_args") or []
    api = args[args.index("--api-server-count") + 1] if "--api-server-count" in args else "1"
    workload = context["workload"]
    return [str(path.parent.parent.relative_to(root)), context["model"].removeprefix("synthetic:"), api,
            str(point["batch_size"]), str(workload["input_tokens"]), str(workload["output_tokens"]),
            f"{point['req_s']:.6g}", f"{point['ttft_ms']['mean']:.6g}", f"{point['e2e_ms']['mean']:.6g}",
            f"{point['tpot_ms']['mean']:.6g}"]


def write_own(root: Path) -> None:
    """Every H200 frontier point under `root` (docs/bench/gpu): `planner profile`'s closed loops."""
    points = sorted(p for p in root.rglob("frontier/point-*.json")
                    if "H200" in json.loads(p.read_text())["context"].get("gpu_name", ""))
    out = [["run", "model", "api_servers", "clients", "input_tokens", "output_tokens", "req_s", "ttft_mean_ms",
            "e2e_mean_ms", "tpot_mean_ms"]] + [own_point(p, root) for p in points]
    path = HERE / OWN_FILE
    write_keeping_header(path, out)
    print(f"{path}: {len(out) - 1} rows")


def qwen_rows(text: str) -> list[list[str]]:
    """The BF16 rows on one GPU at the default setting of each "- NB (vLLM)" grid table of Qwen's speed benchmark:
    [model, input length, speed]. A blank cell repeats the one above it (a spanning cell); rows with a note (another
    setting, another vLLM) are left out."""
    rows, section, model, length = [], False, "", ""
    for line in text.splitlines():
        if re.match(r"^-\s+\S+\s+\(", line):
            section, model, length = line.rstrip().endswith("(vLLM)"), "", ""
        elif section and line.startswith("|") and not line.startswith("| Model"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            model, length = cells[0] or model, cells[1] or length
            note = cells[5] if len(cells) > 5 else ""
            if cells[2] == "BF16" and cells[3] == "1" and not note:
                rows.append([model, length, cells[4]])
    return rows


def write_qwen(repo: Path) -> None:
    out = [["gpu", "model", "hub_id", "input_len", "output_len", "batch", "speed_tok_s"]]
    for hub, length, speed in qwen_rows(git_show(repo, QWEN_COMMIT, QWEN_DOC)):
        name = "qwen2.5-" + hub.removeprefix("Qwen2.5-").removesuffix("-Instruct").lower()
        out.append(["A100-80GB", name, f"Qwen/{hub}", length, str(QWEN_OUTPUT), "1", speed])
    path = HERE / QWEN_FILE
    write_keeping_header(path, out)
    print(f"{path}: {len(out) - 1} rows")


def ft_rows(text: str) -> list[list[str]]:
    """The rows of each "#### Performance of GPT-<size>" table of FasterTransformer's GPT guide for the sizes of
    FT_MODELS: [model, batch, input length, output length, latency ms on one GPU]. Every such table's fourth column
    is the one-GPU latency ("FT Latency (ms)", or for GPT-20B "Latency of single GPU (ms)"); blank separator rows
    and "OOM" cells are left out."""
    rows, model = [], ""
    for line in text.splitlines():
        heading = re.match(r"^####\s+Performance of GPT-(\S+)\s*$", line)
        if heading:
            model = f"gpt-{heading.group(1).lower()}" if heading.group(1) in FT_MODELS else ""
        elif line.startswith("####"):
            model = ""
        elif model and line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) > 3 and cells[0].isdigit() and re.fullmatch(r"[0-9.]+", cells[3]):
                rows.append([model, cells[0], cells[1], cells[2], cells[3]])
    return rows


def write_ft(repo: Path) -> None:
    out = [["gpu", "model", "batch", "input_len", "output_len", "latency_ms"]]
    out += [["A100-80GB", *row] for row in ft_rows(git_show(repo, FT_COMMIT, FT_DOC))]
    path = HERE / FT_FILE
    write_keeping_header(path, out)
    print(f"{path}: {len(out) - 1} rows")


def paddle_rows(text: str) -> list[list[str]]:
    """The FP16 greedy rows (top_k 1) of the GPT and OPT tables of PaddleNLP's FastGeneration performance page, under
    each of its two builds ("CUDA 10.1 ...", "CUDA 11.2 ..."): [build, model, latency ms]. A model's name is in its
    first row (the GPT tables' "(gpt2-medium)", the OPT tables' "opt-125m"); other tables (BART, CodeGen on another
    card, Pegasus) are left out."""
    rows, build, table, model = [], "", False, ""
    for line in text.splitlines():
        cuda = re.match(r"^(CUDA \d+\.\d+),", line)
        if cuda:
            build = cuda.group(1)
        elif line.startswith("**"):
            table = bool(re.match(r"^\*\*(GPT|OPT)\b", line))
        elif table and line.startswith("|"):
            named = re.search(r"\((gpt2[-a-z]*)\)|^\|\s*(opt-\d+m)\s*\|", line)
            model = (named.group(1) or named.group(2)) if named else model
            greedy = re.search(r"top_k\s*=\s*1\s*\|([^|]+)\|([^|]+)\|", line)
            if greedy and model in PADDLE_MODELS:
                rows.append([build, model, greedy.group(2).strip()])
    return rows


def write_paddle(readme: Path) -> None:
    out = [["gpu", "build", "model", "batch", "input_len", "output_len", "latency_ms"]]
    out += [["V100-16GB", build, model, str(PADDLE_BATCH), str(PADDLE_PROMPT), str(PADDLE_OUTPUT), ms]
            for build, model, ms in paddle_rows(readme.read_text())]
    path = HERE / PADDLE_FILE
    write_keeping_header(path, out)
    print(f"{path}: {len(out) - 1} rows")


if __name__ == "__main__":
    if sys.argv[1] == "paddle":
        write_paddle(Path(sys.argv[2]))
    elif sys.argv[1] == "ft":
        write_ft(Path(sys.argv[2]))
    elif sys.argv[1] == "own":
        write_own(Path(sys.argv[2]))
    elif sys.argv[1] == "qwen":
        write_qwen(Path(sys.argv[2]))
    else:
        write_bsc(Path(sys.argv[1]))
        write_argonne(Path(sys.argv[2]))
