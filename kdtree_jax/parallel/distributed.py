"""Multi-process (multi-host) start-up: `jax.distributed.initialize` wired from arguments or environment variables.

One process per host (or per GPU group) runs the same program; after `initialize_from_env()` `jax.devices()` lists
every process's devices, so `sharding.make_mesh` builds one global mesh and `sharding.shard_model` /
`restore_sharded` place each process's shards. Single-process runs call it too: with nothing configured it is a
no-op and returns False.

Environment (each may be overridden by the matching argument):
  KDTREE_COORDINATOR_ADDRESS  host:port of process 0's coordinator service, e.g. 10.0.0.1:1234
  KDTREE_NUM_PROCESSES        total number of processes
  KDTREE_PROCESS_ID           this process's index, 0 .. num_processes - 1
  KDTREE_LOCAL_DEVICE_IDS     optional comma-separated local device ids this process drives, e.g. 0,1,2,3
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import jax

ENV_COORDINATOR = "KDTREE_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "KDTREE_NUM_PROCESSES"
ENV_PROCESS_ID = "KDTREE_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "KDTREE_LOCAL_DEVICE_IDS"
CPU_COLLECTIVES = "gloo"  # cross-process collectives on the CPU backend (jax 0.11.2's default; set explicitly)
DEFAULT_TIMEOUT_S = 300  # jax.distributed.initialize's own default: how long to wait for every process


class DistributedConfigError(ValueError):
    """Missing, partial or inconsistent multi-process settings; the message names the variable or argument."""


def settings_from_env(coordinator_address: str | None = None, num_processes: int | None = None,
                      process_id: int | None = None, local_device_ids: Sequence[int] | None = None, *,
                      env: Mapping[str, str] | None = None) -> dict | None:
    """The `jax.distributed.initialize` keyword arguments, or None when nothing is configured (single process)."""
    env = os.environ if env is None else env
    coordinator_address = coordinator_address or env.get(ENV_COORDINATOR) or None
    num_processes = _int(num_processes, env, ENV_NUM_PROCESSES, "num_processes")
    process_id = _int(process_id, env, ENV_PROCESS_ID, "process_id")
    if local_device_ids is None and env.get(ENV_LOCAL_DEVICE_IDS):
        text = env[ENV_LOCAL_DEVICE_IDS]
        try:
            local_device_ids = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise DistributedConfigError(f"{ENV_LOCAL_DEVICE_IDS}={text!r}: expected comma-separated "
                                         "integers") from None
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if all(v is None for v in given.values()):
        if local_device_ids is not None:
            raise DistributedConfigError(f"local_device_ids ({ENV_LOCAL_DEVICE_IDS}) given without a coordinator")
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        names = {"coordinator_address": ENV_COORDINATOR, "num_processes": ENV_NUM_PROCESSES,
                 "process_id": ENV_PROCESS_ID}
        raise DistributedConfigError("multi-process start needs all of coordinator_address, num_processes, "
                                     f"process_id; missing: {', '.join(f'{m} ({names[m]})' for m in missing)}")
    if ":" not in coordinator_address:
        raise DistributedConfigError(f"coordinator_address {coordinator_address!r} must be host:port")
    if num_processes < 1:
        raise DistributedConfigError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise DistributedConfigError(f"process_id {process_id} is outside 0..{num_processes - 1}")
    out = dict(given)
    if local_device_ids is not None:
        out["local_device_ids"] = [int(i) for i in local_device_ids]
    return out


def initialize_from_env(coordinator_address: str | None = None, num_processes: int | None = None,
                        process_id: int | None = None, local_device_ids: Sequence[int] | None = None, *,
                        env: Mapping[str, str] | None = None, timeout_s: int = DEFAULT_TIMEOUT_S) -> bool:
    """Join the process group (blocks until all `num_processes` have joined). False: single process, no-op.

    Must run before anything touches a jax backend (creating arrays, jax.devices()).
    """
    settings = settings_from_env(coordinator_address, num_processes, process_id, local_device_ids, env=env)
    if settings is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    jax.distributed.initialize(**settings, initialization_timeout=timeout_s)
    return True


def _int(value: int | None, env: Mapping[str, str], var: str, name: str) -> int | None:
    if value is not None:
        return int(value)
    text = env.get(var)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise DistributedConfigError(f"{var}={text!r}: {name} must be an integer") from None
