"""How this process's OpenMP threads wait between parallel regions.

Every kernel of a step (ours, ATen's, inductor's) runs in an OpenMP parallel region, and a
step has hundreds of them. libgomp's default has an idle thread spin ~300k iterations at the
end of each region before it sleeps. On a quiet machine that wins a few microseconds per
region; on a busy one the spinning threads take the very core the descheduled thread of the
same region is waiting for, and steps stall for scheduler time slices (measured with
``mlafx bench busy-machine --policy ...``: README, "Busy machines").

libgomp reads its policy once, when it is loaded (the first ``import torch``), so
``apply_engine_policy`` runs at the top of ``mlafx/__init__.py``: for the variables the user
has not set it puts the engine's values into the environment, loads torch, and takes them
out again, so the policy holds for this process (and for the tensor-parallel workers, which
import mlafx themselves) and not for processes the user starts. A process that imported
torch before mlafx keeps libgomp's default; ``status()`` says so.
"""

from __future__ import annotations

import os
import sys

# Chosen by measurement (README, "Busy machines"): spin ~3000 iterations (tens of
# microseconds: the gap between two regions of a step), then sleep. PASSIVE (sleep at once)
# kept as much on a busy machine but cost ~40% of quiet batch-1 decode (a futex wake-up per
# region); libgomp's 300000 keeps the quiet speed and loses the busy one.
ENGINE_POLICY = {"GOMP_SPINCOUNT": "3000"}

POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

_status = "not applied"


def apply_engine_policy() -> str:
    """Set ENGINE_POLICY for this process's OpenMP runtime if it is not loaded yet; returns
    and records what happened (see ``status``)."""
    global _status
    if "torch" in sys.modules:
        _status = "libgomp's default (torch was imported before mlafx)"
        return _status
    # a user who set either variable chose a policy: keep it whole
    chosen = {} if any(k in os.environ for k in POLICY_VARIABLES) else dict(ENGINE_POLICY)
    os.environ.update(chosen)
    try:
        import torch  # noqa: F401  (loads libgomp, which reads the environment now)
    finally:
        for key in chosen:
            os.environ.pop(key, None)
    ours = " ".join(f"{k}={v}" for k, v in chosen.items())
    users = " ".join(f"{k}={os.environ[k]}" for k in POLICY_VARIABLES if k in os.environ)
    _status = ", ".join(
        part for part in (ours and f"mlafx's {ours}", users and f"the user's {users}") if part
    )
    return _status


def status() -> str:
    """The OpenMP waiting policy in force, in words (for logs and hints)."""
    return _status
