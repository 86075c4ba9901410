"""Two processes x 4 CPU devices = one global 8-device mesh: the sharded forward gives both processes the same
logits and greedy tokens as one process on one device. Also the env parsing of `initialize_from_env`.

The workers are this file run as a script (`python tests/test_multiprocess.py worker OUT SEED`); the coordinator
address and process ids come in through the KDTREE_* environment variables, as on a real cluster.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from kdtree_jax.parallel.distributed import DistributedConfigError, settings_from_env

N_PROCESSES, DEVICES_PER_PROCESS = 2, 4
MESH = (1, 2, 4)  # expert axis spans both processes; tensor pairs stay inside one
TIMEOUT_S = 240
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_settings_from_env():
    env = {"KDTREE_COORDINATOR_ADDRESS": "10.0.0.1:1234", "KDTREE_NUM_PROCESSES": "4", "KDTREE_PROCESS_ID": "3",
           "KDTREE_LOCAL_DEVICE_IDS": "0,1"}
    assert settings_from_env(env=env) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                                          "process_id": 3, "local_device_ids": [0, 1]}
    assert settings_from_env(env={}) is None  # single process: initialize_from_env is a no-op
    assert settings_from_env(process_id=1, env=env)["process_id"] == 1  # arguments win over the environment
    bad = [({**env, "KDTREE_PROCESS_ID": "4"}, "outside 0..3"),
           ({"KDTREE_NUM_PROCESSES": "2", "KDTREE_PROCESS_ID": "0"}, "KDTREE_COORDINATOR_ADDRESS"),
           ({**env, "KDTREE_NUM_PROCESSES": "two"}, "KDTREE_NUM_PROCESSES='two'"),
           ({**env, "KDTREE_COORDINATOR_ADDRESS": "nohost"}, "host:port"),
           ({**env, "KDTREE_LOCAL_DEVICE_IDS": "0,x"}, "comma-separated")]
    for e, why in bad:
        with pytest.raises(DistributedConfigError, match=why):
            settings_from_env(env=e)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.heavy
@pytest.mark.multidevice
def test_two_processes_match_one(rng, tmp_path):
    from test_sharding import CFG, make_inputs, run_forward

    from kdtree_jax.checkpoint.weights import init_random

    seed = int(rng.integers(1 << 30))
    port = _free_port()
    procs = []
    for pid in range(N_PROCESSES):
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
               "KDTREE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "KDTREE_NUM_PROCESSES": str(N_PROCESSES),
               "KDTREE_PROCESS_ID": str(pid), "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, os.path.abspath(__file__), "worker", str(tmp_path / f"out{pid}.npz"), str(seed)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for pid, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"worker {pid} failed:\n{log[-4000:]}"

    pre0, ver0 = run_forward(init_random(CFG, seed, moe_impl="dense"), make_inputs(np.random.default_rng(seed)))
    for pid in range(N_PROCESSES):
        out = np.load(tmp_path / f"out{pid}.npz")
        assert out["process_count"] == N_PROCESSES and out["device_count"] == N_PROCESSES * DEVICES_PER_PROCESS
        for name, want in (("prefill", pre0), ("verify", ver0)):
            err = np.max(np.abs(out[name] - want)) / np.max(np.abs(want))
            assert err < 1e-5, f"process {pid} {name} logits: relative error {err:.2e}"
            np.testing.assert_array_equal(out[name].argmax(-1), want.argmax(-1))
    first = np.load(tmp_path / "out0.npz")
    np.testing.assert_array_equal(np.load(tmp_path / "out1.npz")["verify"], first["verify"])


def _worker(out_path: str, seed: int) -> None:
    """One process of the group: join, build the same model, run the sharded forward on the global mesh."""
    from kdtree_jax.parallel.distributed import initialize_from_env

    assert initialize_from_env(timeout_s=TIMEOUT_S), "KDTREE_* environment not set"
    import jax
    from test_sharding import CFG, make_inputs, run_forward

    from kdtree_jax.checkpoint.weights import init_random
    from kdtree_jax.parallel import sharding as sh

    mesh = sh.make_mesh(MESH)
    model = sh.shard_model(init_random(CFG, seed, moe_impl="dense"), mesh)
    pre, ver = run_forward(model, make_inputs(np.random.default_rng(seed)), mesh)
    np.savez(out_path, prefill=pre, verify=ver, process_count=jax.process_count(), device_count=jax.device_count())
    jax.distributed.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        sys.exit(f"usage: {sys.argv[0]} worker OUT.npz SEED")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _worker(sys.argv[2], int(sys.argv[3]))
