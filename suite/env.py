"""Environment fingerprint stored with every sweep (hardware, drivers, package versions, git)."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import torch

PACKAGES = ("torch", "numpy", "pandas", "pyarrow", "matplotlib", "hydra-core", "omegaconf",
            "mlflow", "flash-attn", "flash_attn_3", "yunchang", "ring-flash-attn", "transformers")


def _run(cmd: list[str], timeout: float = 10.0) -> Optional[str]:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_label(device: str) -> str:
    """Short label for the trial identity: the GPU name, or the CPU model."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu:{cpu_model()}"


def git_info() -> dict:
    root = Path(__file__).resolve().parents[1]
    commit = _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    return {"commit": commit, "dirty": bool(dirty) if commit else None}


# The environment variables a fingerprint records: named ones that change how a trial runs, never a
# prefix. Prefixes recorded whatever a site puts under them (tokens, passwords in URIs such as
# MLFLOW_TRACKING_URI=https://user:password@host, which the tracker records itself, redacted).
RECORDED_ENV_VARS = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES",
    "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING",
    "PYTORCH_CUDA_ALLOC_CONF", "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_AVOID_RECORD_STREAMS", "TORCH_NCCL_HIGH_PRIORITY",
    "NCCL_ALGO", "NCCL_PROTO", "NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_IB_HCA", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE", "NCCL_NET_GDR_LEVEL", "NCCL_SOCKET_IFNAME", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS",
    "NCCL_BUFFSIZE", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE", "NCCL_CROSS_NIC", "NCCL_TOPO_FILE",
    "SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_JOB_PARTITION",
})


def fingerprint(device: str) -> dict:
    """Everything needed to interpret a number later. Cheap (< 1 s), best effort."""
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    env = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": device,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": versions,
        "git": git_info(),
        "env_vars": {k: os.environ[k] for k in sorted(os.environ) if k in RECORDED_ENV_VARS},
    }
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cudnn"] = torch.backends.cudnn.version()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - not every build has NCCL
            env["nccl"] = None
        env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["topology"] = _run(["nvidia-smi", "topo", "-m"])
    return env


def tags(env: dict) -> dict[str, str]:
    """The fingerprint flattened into MLflow tags."""
    t = {"hostname": env["hostname"], "cpu": env["cpu"], "torch": env["torch"], "python": env["python"],
         "device": env["device"], "git_commit": str(env["git"]["commit"]), "git_dirty": str(env["git"]["dirty"])}
    for pkg, ver in env["packages"].items():
        if ver:
            t[f"pkg.{pkg}"] = ver
    for k in ("gpus", "nccl", "driver", "torch_cuda"):
        if env.get(k):
            t[k] = str(env[k])
    return t
