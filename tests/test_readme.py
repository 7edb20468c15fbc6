"""The README's examples run as written (each ```python block, in a fresh interpreter).

A user's first contact with the library is copying one of them: a renamed argument or a missing import
there is a bug as real as one in the ops. The distributed block runs on 2 gloo ranks (as under torchrun),
with the tensors and the DDP model it assumes defined right after its init_process_group line, and its
results checked against the single-process ops.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
LOCAL = [b for b in BLOCKS if "init_process_group" not in b]
DISTRIBUTED = [b for b in BLOCKS if "init_process_group" in b]

# What the distributed block takes as given (a DDP model, the full q/k/v on every rank), defined after
# its init_process_group line; and checks of what it computed, after it.
DIST_PRELUDE = """
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
q_full, k_full, v_full = (torch.randn(1, 2, 64, 16, dtype=torch.float64) for _ in range(3))
"""
DIST_EPILOGUE = """
import pykernels
ref = pykernels.flash_attention(q_full, k_full, v_full, causal=True)
torch.testing.assert_close(full, ref)
model(torch.randn(4, 8)).sum().backward()  # the comm hook averages the gradients across ranks
g = model.module.weight.grad.clone()
gathered = [torch.empty_like(g) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, g)
for other in gathered:
    torch.testing.assert_close(other, g)
# DDP's reducer holds the group: alive at exit, gloo's workers may still be freeing a finished Work when
# the interpreter finalizes, and the process aborts (torch's, with or without our ops; collectives
# releases its own hold on destroyed groups, see collectives/_group_state.py)
del model
dist.destroy_process_group()
print("README-OK")
"""


def _run(code: str, env=None):
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _env(cache_dir, **extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYKERNELS_CACHE_DIR"] = str(cache_dir)  # the autotuning example writes a cache: not the user's
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_readme_has_examples():
    assert len(LOCAL) >= 2 and len(DISTRIBUTED) == 1


@pytest.mark.parametrize("i", range(len(LOCAL)))
def test_readme_example_runs(i, tmp_path):
    proc = _run(LOCAL[i] + "\nprint('README-OK')\n", env=_env(tmp_path))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "README-OK" in out, f"README example {i} failed:\n{out[-4000:]}"


@pytest.mark.distributed
def test_readme_distributed_example_runs_on_two_ranks(tmp_path):
    lines = DISTRIBUTED[0].splitlines()
    at = next(j for j, line in enumerate(lines) if "init_process_group" in line) + 1
    code = "\n".join(lines[:at]) + "\n" + DIST_PRELUDE + "\n".join(lines[at:]) + "\n" + DIST_EPILOGUE
    code = textwrap.dedent(code)
    for attempt in range(2):
        procs, outs = _run_two_ranks(code, tmp_path)
        # the free port found below may be taken before rank 0 binds it (another process, or rank 1's own
        # connection attempts): a rare clash, retried once on a fresh port
        if attempt == 0 and any("address already in use" in out.lower() or "eaddrinuse" in out.lower()
                                for out in outs):
            continue
        break
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and "README-OK" in out, f"rank {r} of the README's distributed example:\n{out[-4000:]}"


def _run_two_ranks(code: str, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [_run(code, env=_env(tmp_path, RANK=r, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outs
