"""scripts/serve.sh without a server (DRY_RUN=1 prints the command): on CPU it bounds SGLang's KV
pool unless the caller did (or offloading sizes it), and says so."""

import os
import shlex
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "serve.sh"


def dry_run(*flags: str, **env: str) -> tuple[list[str], str]:
    """(the command serve.sh would exec, its stderr); the environment it sets is checked here."""
    base = {k: v for k, v in os.environ.items() if k not in ("NOSA_OFFLOAD", "MAX_TOTAL_TOKENS")}
    result = subprocess.run(["bash", str(SCRIPT), "/ckpt", *flags], capture_output=True, text=True, check=True,
                            env={**base, "DRY_RUN": "1", "PY": "/bin/true", **env})
    *environment, command = result.stdout.splitlines()
    assert environment == (["SGLANG_USE_CPU_ENGINE=1"] if env.get("DEVICE") == "cpu" else [])
    return shlex.split(command), result.stderr


def flag_value(command: list[str], flag: str) -> list[str]:
    return [command[i + 1] for i, arg in enumerate(command) if arg == flag]


def test_cpu_bounds_the_pool_by_default():
    command, said = dry_run("--dtype", "float32", DEVICE="cpu")
    assert command[:3] == ["/bin/true", "-m", "sglang.launch_server"]
    assert flag_value(command, "--max-total-tokens") == ["65536"]
    assert flag_value(command, "--attention-backend") == ["nosa"] and flag_value(command, "--device") == ["cpu"]
    assert command[-2:] == ["--dtype", "float32"]  # the caller's flags come last, unchanged
    assert "--max-total-tokens 65536" in said and "MAX_TOTAL_TOKENS=N" in said


def test_cpu_bound_follows_the_environment():
    command, said = dry_run(DEVICE="cpu", MAX_TOTAL_TOKENS="4096")
    assert flag_value(command, "--max-total-tokens") == ["4096"] and "4096" in said


@pytest.mark.parametrize("flags", [("--max-total-tokens", "2048"), ("--max-total-tokens=2048",)])
def test_cpu_keeps_the_callers_bound(flags):
    command, said = dry_run(*flags, DEVICE="cpu")
    assert command[-len(flags):] == list(flags)
    assert flag_value(command, "--max-total-tokens") == ([] if len(flags) == 1 else ["2048"]) and said == ""


@pytest.mark.parametrize("offload", ["1", "on", "TRUE"])
def test_offloading_leaves_the_pool_to_the_host_tokens(offload):
    command, said = dry_run(DEVICE="cpu", NOSA_OFFLOAD=offload)
    assert flag_value(command, "--max-total-tokens") == [] and said == ""


def test_cuda_adds_no_bound():
    command, said = dry_run(DEVICE="cuda")
    assert flag_value(command, "--max-total-tokens") == [] and flag_value(command, "--device") == ["cuda"]
    assert said == ""
