"""Shared fixtures: Hydra composition from conf/, result folders per test and a data cache per session."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Triton kernels (models/_favor_triton.py) run on the CPU through Triton's interpreter where there is no GPU. Triton
# reads this when first imported, and torch imports it, so it is set before anything imports torch.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hydra import compose, initialize_config_dir

import lra.config  # registers the config schema with Hydra's ConfigStore

lra.config.register_model_configs()  # model=<name> composes from the constructors (conf/model/*.yaml take them)

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "lra" / "conf"
SHARED_DATA = ROOT.parent / "shared" / "data"


def compose_cfg(overrides: list[str], config_name: str = "config"):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name, overrides=overrides)


def started(args: list[str], **kwargs) -> subprocess.Popen:
    """A command started with its output captured as text, for ``finish_all``."""
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def finish_all(*procs: subprocess.Popen, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Wait for commands started side by side; each one's outcome as ``subprocess.run`` returns it. A command that
    starts Python and imports torch spends seconds on one core, so on CI's two cores two independent ones side by
    side take about the time of one. Any still running when one times out is killed."""
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def in_background(commands: Callable[..., object]):
    """Gives the decorated test ``commands``: a function of a fresh folder, the environment to run them in (this
    process's as the session's first test began) and the test's parameters, returning what the test checks. They run
    in the background from the session's first test on (``background_commands``); the test waits for them through the
    ``ran_in_background`` fixture. They may start processes and write files, nothing more: Hydra's composition, torch's
    settings and what tests monkeypatch are this process's, shared with the tests running meanwhile."""
    def register(test):
        test.background_commands = commands
        return test
    return register


def compiles_for_hopper(script: str, doc: str):
    """A test that runs ``script`` (it compiles a module's Triton kernels for sm_90 and prints "compiled") in a
    process without Triton's interpreter, in the background; skipped on a GPU, where the module's tests compile and
    run the kernels themselves. The interpreter runs what the GPU compiler may refuse."""
    @pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above compile and run the kernels")
    @in_background(lambda folder, environ: subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={k: v for k, v in environ.items() if k != "TRITON_INTERPRET"}))
    def test(ran_in_background):
        proc, _ = ran_in_background()
        assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]

    test.__doc__ = doc
    return test


def commands_of(item: pytest.Item) -> Callable[..., object] | None:
    """The commands ``in_background`` gave a test, or None."""
    return getattr(getattr(item, "function", None), "background_commands", None)


def skipped_by_a_mark(item: pytest.Item) -> bool:
    """A ``skip`` mark, or a ``skipif`` whose condition is a plain True: the test will not run (no commands for it)."""
    return any(mark.name == "skip" or (mark.name == "skipif" and True in mark.args) for mark in item.iter_markers())


def yield_to_the_tests() -> None:
    """A lower CPU priority for this thread (on Linux a thread's own) and the processes it starts (they inherit it):
    background commands take the cores the tests leave idle rather than slowing them (a test computing on two threads
    waits at every op for the thread a background process keeps off its core: test_model_etc.py took 15 s, not 6).
    Nice 10, a tenth of a test's share where both want a core, not 19: with a second test suite on the machine, 19
    starved the installed console script's smoke command past its 600 s timeout."""
    if hasattr(os, "nice"):  # not on Windows
        os.nice(10)


@pytest.fixture(scope="session", autouse=True)
def background_commands(request, tmp_path_factory) -> dict:
    """The commands (``in_background``) of the session's selected tests, started at its first test on a thread of
    their own, one test's after another in the tests' order, each in a folder of its own: {node id: (future, folder)}.
    Such a command starts Python and imports torch, seconds on one core, and most tests compute on one core: run in
    turn, the commands left one of CI's two cores idle most of the time. The environment is read here, before any
    test monkeypatches this process's."""
    items = [item for item in request.session.items if commands_of(item) and not skipped_by_a_mark(item)]
    if not items:
        yield {}
        return
    environ = dict(os.environ)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-commands", initializer=yield_to_the_tests)
    try:
        started = {}
        for item in items:
            folder = tmp_path_factory.mktemp("background")
            params = item.callspec.params if hasattr(item, "callspec") else {}
            started[item.nodeid] = (pool.submit(commands_of(item), folder, environ, **params), folder)
        yield started
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a session stopped early (-x) waits for the running one only


@pytest.fixture
def ran_in_background(request, background_commands) -> Callable[[], tuple[object, Path]]:
    """For a test given commands by ``in_background``: waits for them and returns (what they returned, their
    folder). Called in the test, so that a command that fails fails the test."""
    future, folder = background_commands[request.node.nodeid]
    return lambda: (future.result(), folder)


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """One data cache for the whole session, for tests that need data but test neither generation nor the cache:
    each ListOps slice and Pathfinder image set is generated once, not once per test (160 Pathfinder images take
    seconds). Tests of generation or of the cache itself give a cold ``data.cache_dir`` of their own."""
    return tmp_path_factory.mktemp("shared_cache")


@pytest.fixture
def smoke_cfg(tmp_path, shared_cache):
    """Compose a smoke config writing runs and rows only under tmp_path, its data in the session's shared cache;
    pass extra overrides (a later ``data.cache_dir=...`` gives a test a cold cache of its own)."""

    def make(*overrides: str):
        return compose_cfg([
            "experiment=smoke", f"run_dir={tmp_path / 'run'}", f"results.dir={tmp_path / 'results'}",
            f"data.cache_dir={shared_cache}", *overrides,
        ])

    return make


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests need CUDA: without it they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (a GPU test); run `python -m pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """torch refuses FlexAttention's backward on the CPU (``_validate_device``), although the eager implementation
    that runs there (the math reference behind the higher-order op) differentiates q, k, v and a score_mod's
    captured tensors. The check is lifted here, so that a flex path's gradients meet its reference path's."""
    import warnings

    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        yield


def lightest_config(configs):
    """The Triton config that asks least of the GPU: fewest pipeline stages, then warps, then the smallest blocks."""
    return min(configs, key=lambda c: (c.num_stages, c.num_warps, sum(v for v in c.kwargs.values() if type(v) is int)))


def tune_lightest_config_only(monkeypatch):
    """Every autotuned Triton kernel (Triton's ``Autotuner`` and its subclasses, fla's among them) compiles and runs
    the lightest of its configs alone, where autotuning compiles and times each of them."""
    try:
        from triton.runtime import autotuner
    except ImportError:  # no Triton, no autotuned kernels
        return
    prune = autotuner.Autotuner.prune_configs

    def prune_to_the_lightest(self, kwargs):
        return [lightest_config(prune(self, kwargs))]

    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", prune_to_the_lightest)


@pytest.fixture(autouse=True)
def one_triton_config_in_gpu_tests(request, monkeypatch):
    """GPU tests check kernels' numbers, never their speed: each autotuned kernel runs its lightest config alone
    (``tune_lightest_config_only``), where autotuning fla's chunked scans compiles up to 48 configs a kernel (minutes
    per test on a cold cache). A kernel's math is the same under each of its configs; the tiling is what they change."""
    if request.node.get_closest_marker("gpu") is not None:
        tune_lightest_config_only(monkeypatch)
