"""llama.cpp's `llama-server` beside the chapters (bench): build it, convert
the embedded model for it, start it.

    make llama-server                       # = python -m bench.peers.llamacpp build (once)
    python -m bench.peers.llamacpp info           # what is built, where, from which commit
    python -m bench.peers.llamacpp serve --parallel 4 --port 8080   # by hand

`build` downloads the source package of `llama-cpp-python` from PyPI (it
vendors llama.cpp under `vendor/llama.cpp`), builds `llama-server` from it
with cmake (CPU only, `-DGGML_NATIVE=ON`, static, no web UI, nothing
fetched from the network) into `.llamacpp/build/bin/`, and converts the
embedded model (its safetensors copy, `common.loader.convert_embedded_model`)
to an f32 and a bf16 GGUF with the vendored `convert_hf_to_gguf.py` and
`gguf-py`. Every step is skipped when its result is there already.

`make bench PEERS=1` then starts `LlamaServer` on a free port with the f32
GGUF (the dtype of our float32 chapters; `--llamacpp-dtype bf16` for the
other), one parallel slot per client (`-np N`), a context of N x the
per-request context (`-c`), continuous batching (`-cb`), the KV cache in
the model's dtype (`-ctk`/`-ctv`), as many threads as torch uses, and loads
it through `/v1/chat/completions`, so that llama.cpp applies the chat
template the GGUF carries (the embedded model's own).

Left out: quantized GGUFs (on an AMX Xeon they crashed at load in this
build), GPU offload, speculative decoding, and every llama.cpp setting
beyond those above (its prompt cache, which reuses a slot's common prefix,
stays on, as llama.cpp ships it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench.loadtest import ROOT, ServerProcess
from common.net import free_port

LLAMA_CPP_PYTHON = "0.3.36"  # the PyPI source package that vendors llama.cpp
HOME = ROOT / ".llamacpp"  # ignored by git
SDIST_DIR = HOME / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
SOURCE = SDIST_DIR / "vendor" / "llama.cpp"
BUILD = HOME / "build"
BINARY = BUILD / "bin" / "llama-server"
MODELS = HOME / "models"
PYLIB = HOME / "pylib"  # sentencepiece, which the converter imports, outside .venv
BUILD_INFO = HOME / "build-info.json"
DTYPES = {"f32": "float32", "bf16": "bfloat16"}  # GGUF type -> torch's name
PROMPT_ROOM = 256  # tokens of context per slot beyond max_tokens (our prompts: < 100)
BUILD_COMMAND = "make llama-server"


def gguf_path(dtype: str) -> Path:
    return MODELS / f"smollm2-135m-instruct-{dtype}.gguf"


def _short(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def missing(dtype: str = "f32") -> str | None:
    """None when llama-server and the GGUF of `dtype` are there, else what
    to run (the bench puts it in the row)."""
    if not BINARY.exists():
        return (f"llama-server is not built ({_short(BINARY)} is missing): run "
                f"`{BUILD_COMMAND}` (llama.cpp from the llama-cpp-python "
                f"{LLAMA_CPP_PYTHON} source package; about 30 min on 2 cores)")
    if not gguf_path(dtype).exists():
        return f"{_short(gguf_path(dtype))} is missing: run `{BUILD_COMMAND}`"
    return None


def build_info() -> dict:
    try:
        return json.loads(BUILD_INFO.read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------- building
def _run(command: list[str], log: Path | None = None, **kwargs) -> None:
    print("+", " ".join(map(str, command)), flush=True)
    if log is None:
        subprocess.run(command, check=True, **kwargs)
        return
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False,
                              **kwargs)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise SystemExit(f"failed ({done.returncode}); the end of {log}:\n{tail}")


def _pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def download_source() -> None:
    """The sdist from PyPI, unpacked under .llamacpp/ (llama.cpp in vendor/)."""
    if (SOURCE / "CMakeLists.txt").exists():
        return
    HOME.mkdir(exist_ok=True)
    _run(_pip("download", "--quiet", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(HOME)))
    archive = HOME / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(HOME, filter="data")


def vendored_commit() -> str:
    """The llama.cpp commit the sdist vendors, from its CHANGELOG (the sdist
    has no git history): "update llama.cpp to ggml-org/llama.cpp@<commit>"."""
    text = (SDIST_DIR / "CHANGELOG.md").read_text()
    section = text.split(f"## [{LLAMA_CPP_PYTHON}]", 1)[-1].split("\n## [", 1)[0]
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    return found.group(1) if found else "unknown"


def build_tools() -> tuple[str, list[str]]:
    """(cmake, generator flags): the system's, else cmake and ninja from PyPI
    (into this Python's environment). A C++ compiler must be there."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise SystemExit("no C++ compiler: install one (Debian: apt-get install g++)")
    bin_dir = Path(sys.executable).parent
    cmake = shutil.which("cmake") or shutil.which("cmake", path=str(bin_dir))
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(bin_dir))
    if cmake is None or (ninja is None and shutil.which("make") is None):
        _run(_pip("install", "--quiet", "cmake", "ninja"))
        cmake = cmake or shutil.which("cmake", path=str(bin_dir))
        ninja = ninja or shutil.which("ninja", path=str(bin_dir))
    return cmake, (["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else [])


def cmake_flags(commit: str) -> list[str]:
    return ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
            # no web UI: the build would fetch it (npm or a download)
            "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
            # the sdist has no .git: name the build after the vendored commit
            f"-DLLAMA_BUILD_COMMIT={commit}", "-DLLAMA_BUILD_NUMBER=0"]


def write_build_info(flags: list[str], build_s: float | None) -> None:
    version = subprocess.run([str(BINARY), "--version"], capture_output=True, text=True,
                             check=False)
    lines = (version.stdout + version.stderr).strip().splitlines()
    BUILD_INFO.write_text(json.dumps({
        "llama_cpp_python": LLAMA_CPP_PYTHON, "llama_cpp_commit": vendored_commit(),
        "version": next((line for line in lines if line.startswith("version")), ""),
        "cmake_flags": flags, "build_s": None if build_s is None else round(build_s),
        "built": time.strftime("%Y-%m-%d %H:%M")}, indent=2) + "\n")


def build_server(jobs: int) -> None:
    flags = cmake_flags(vendored_commit())
    if BINARY.exists():
        if not BUILD_INFO.exists():
            write_build_info(flags, None)
        return
    cmake, generator = build_tools()
    start = time.perf_counter()
    _run([cmake, "-S", str(SOURCE), "-B", str(BUILD), *generator, *flags],
         HOME / "configure.log")
    print(f"building llama-server with {jobs} jobs (log: {HOME / 'build.log'}); "
          "on 2 cores this takes about half an hour", flush=True)
    _run([cmake, "--build", str(BUILD), "--target", "llama-server", "-j", str(jobs)],
         HOME / "build.log")
    write_build_info(flags, time.perf_counter() - start)


def convert(dtype: str) -> Path:
    """The embedded model as a GGUF of `dtype` (f32 or bf16), from its
    safetensors copy, with the converter and gguf-py that llama.cpp vendors."""
    target = gguf_path(dtype)
    if target.exists():
        return target
    from common.loader import convert_embedded_model
    hf_dir = convert_embedded_model()
    if not (PYLIB / "sentencepiece").exists():  # imported by the converter
        _run(_pip("install", "--quiet", "--no-deps", "--target", str(PYLIB),
                  "sentencepiece>=0.1.98,<0.3.0"))
    MODELS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(SOURCE / "gguf-py"), str(PYLIB)])}
    partial = target.with_suffix(".part")
    _run([sys.executable, str(SOURCE / "convert_hf_to_gguf.py"), str(hf_dir),
          "--outtype", dtype, "--outfile", str(partial)], HOME / f"convert-{dtype}.log",
         env=env)
    partial.rename(target)
    return target


def build(jobs: int = 2) -> None:
    download_source()
    build_server(jobs)
    for dtype in DTYPES:
        print(f"GGUF {dtype}: {convert(dtype)}", flush=True)
    info()


def info() -> None:
    state = build_info()
    print(f"llama-server: {BINARY if BINARY.exists() else 'not built (' + BUILD_COMMAND + ')'}")
    if state:
        took = "" if state["build_s"] is None else f" in {state['build_s'] / 60:.0f} min"
        print(f"  llama.cpp {state['llama_cpp_commit']} (llama-cpp-python "
              f"{state['llama_cpp_python']}; {state['version']}), built {state['built']}{took}")
    for dtype in DTYPES:
        path = gguf_path(dtype)
        size = f"{path.stat().st_size / 2**20:.0f} MiB" if path.exists() else "missing"
        print(f"  GGUF {dtype}: {path} ({size})")


# ---------------------------------------------------------------- serving
def describe(dtype: str, parallel: int, ctx_per_slot: int, threads: int) -> str:
    """The row's note: which build, which file, which settings."""
    state = build_info()
    commit = state.get("llama_cpp_commit", "unknown commit")
    return (f"llama.cpp llama-server {commit} (llama-cpp-python "
            f"{state.get('llama_cpp_python', LLAMA_CPP_PYTHON)} sdist), {dtype} GGUF, "
            f"KV {dtype}, -np {parallel} -c {parallel * ctx_per_slot} -cb -t {threads}, "
            "its chat template")


def server_command(dtype: str, port: int, parallel: int, ctx_per_slot: int,
                   threads: int) -> list[str]:
    return [str(BINARY), "-m", str(gguf_path(dtype)), "--host", "127.0.0.1",
            "--port", str(port), "-np", str(parallel), "-c", str(parallel * ctx_per_slot),
            "-cb", "-t", str(threads), "-ctk", dtype, "-ctv", dtype, "--jinja",
            "--alias", f"smollm2-135m-instruct-{dtype}"]


class LlamaServer(ServerProcess):
    """llama-server on the embedded model's GGUF, ready when /health is 200
    (it answers 503 while it loads the model)."""

    def __init__(self, dtype: str, port: int, parallel: int, max_tokens: int,
                 log_path: Path, threads: int | None = None, startup_timeout: float = 300.0):
        problem = missing(dtype)
        if problem:
            raise RuntimeError(problem)
        self.ctx_per_slot = max_tokens + PROMPT_ROOM
        self.threads = threads or os.cpu_count() or 1
        self.note = describe(dtype, parallel, self.ctx_per_slot, self.threads)
        command = server_command(dtype, port, parallel, self.ctx_per_slot, self.threads)
        super().__init__("llama-server", command, port, log_path, startup_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download, build llama-server, convert the GGUFs")
    b.add_argument("-j", "--jobs", type=int, default=2)
    sub.add_parser("info", help="what is built, where")
    s = sub.add_parser("serve", help="run llama-server on the embedded model (Ctrl-C stops)")
    s.add_argument("--dtype", choices=list(DTYPES), default="f32")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--parallel", type=int, default=4, help="slots (-np)")
    s.add_argument("--max-tokens", type=int, default=512, help="per request, sizes -c")
    args = parser.parse_args(argv)
    if args.command == "build":
        build(args.jobs)
    elif args.command == "info":
        info()
    else:
        log = Path(f"/tmp/llama-server-{args.port}.log")
        with LlamaServer(args.dtype, args.port or free_port(), args.parallel,
                         args.max_tokens, log) as server:
            print(f"{server.note}\nlistening on {server.url} (log: {log}); Ctrl-C stops it")
            try:
                server.process.wait()
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
