"""Shared test setup: 8 simulated CPU devices, markers, kernel mode (interpret on CPU, compiled on GPU)."""
import faulthandler
import importlib.util
import os

# Before jax is imported. On a CPU-only install the suite is bound by compiling, not running: XLA generates CPU code
# with LLVM's cheap passes only (a fifth less compile time; every test here passes either way). The product and the
# benchmarks keep XLA's defaults, and so do the GPU tests.
_CHEAP_CODEGEN = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8"
                      + ("" if importlib.util.find_spec("jax_cuda13_plugin") else " " + _CHEAP_CODEGEN))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)
# fp32 references are compared at 1e-5..1e-4: keep XLA's f32 matmuls exact on GPU (no TF32)
jax.config.update("jax_default_matmul_precision", "highest")

# Compiles dominate the CPU suite; reuse them across runs on the same machine (keyed by jax version and HLO).
jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("KDTREE_XLA_CACHE", os.path.expanduser("~/.cache/kdtree-jax/xla")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

ON_GPU = jax.default_backend() == "gpu"


def pytest_addoption(parser):
    parser.addoption(
        "--kernel-mode",
        choices=("auto", "interpret", "compiled"),
        default=os.environ.get("KERNEL_MODE", "auto"),
        help="Pallas kernels: auto = compiled on GPU, interpret on CPU",
    )


def pytest_collection_modifyitems(config, items):
    torch_ok = _has_torch()
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(pytest.mark.skip(reason="no GPU backend"))
        if "multidevice" in item.keywords and jax.device_count() < 8:
            item.add_marker(pytest.mark.skip(reason="needs 8 devices"))
        if "torch" in item.keywords and not torch_ok:
            item.add_marker(pytest.mark.skip(reason="torch/transformers not installed"))


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture
def interpret(request) -> bool:
    """True: run Pallas kernels in interpret mode; False: compiled (Triton backend, GPU only)."""
    mode = request.config.getoption("--kernel-mode")
    if mode == "auto":
        mode = "compiled" if ON_GPU else "interpret"
    if mode == "compiled" and not ON_GPU:
        pytest.skip("compiled Pallas needs a GPU")
    return mode == "interpret"


@pytest.fixture
def rng(request):
    """Fresh random data every run; the seed is printed on failure, and KDTREE_TEST_SEED=<seed> replays it."""
    import numpy as np

    replay = os.environ.get("KDTREE_TEST_SEED")
    seed = int(replay) if replay else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """Dump every thread's stack to the run's own stderr a second before a test's timeout: pytest-timeout's thread
    method ends an xdist worker, and its own dump goes to that worker's captured output, which dies with it."""
    marker = item.get_closest_marker("timeout")
    timeout = float(marker.args[0] if marker and marker.args else item.config.getini("timeout") or 0)
    capman = item.config.pluginmanager.getplugin("capturemanager")
    capture = getattr(capman, "_global_capturing", None)
    fd = getattr(getattr(capture, "err", None), "targetfd_save", None)
    if timeout > 1 and isinstance(fd, int):
        faulthandler.dump_traceback_later(timeout - 1, file=fd)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
