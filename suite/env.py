"""Environment fingerprint stored with every sweep (hardware, drivers, package versions, git)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, overload
from urllib.parse import urlsplit, urlunsplit

import torch

# the load line lives with the column names, where the reports (which import no torch) read it too
from suite.metrics import BUSY_LOAD_PER_CORE, busy_note  # noqa: F401 - re-exported

PACKAGES = (
    "torch",
    "numpy",
    "pandas",
    "pyarrow",
    "matplotlib",
    "hydra-core",
    "omegaconf",
    "mlflow",
    "flash-attn",
    "flash_attn_3",
    "yunchang",
    "ring-flash-attn",
    "transformers",
)


# Environment variables recorded with a run: those that change what a number means (threads, NCCL
# transport and algorithm choices, allocator and launch settings, the SLURM job). An allowlist, not
# prefixes: a prefix such as TORCH_ or CUDA_ also catches tokens and paths that hold secrets.
ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_BLOCKING_WAIT",
    "TORCH_DISTRIBUTED_DEBUG",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_DEBUG",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_SHM_DISABLE",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_SOCKET_IFNAME",
    "NCCL_NVLS_ENABLE",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_BUFFSIZE",
    "NCCL_CROSS_NIC",
    "SLURM_JOB_ID",
    "SLURM_JOB_NUM_NODES",
    "SLURM_JOB_PARTITION",
    "MLFLOW_TRACKING_URI",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "CUDA_MODULE_LOADING",
    "TORCH_NCCL_AVOID_RECORD_STREAMS",
    "TORCH_NCCL_HIGH_PRIORITY",
    "NCCL_IB_HCA",
    "NCCL_CUMEM_ENABLE",
    "NCCL_TOPO_FILE",
)
_URI_VARS = ("MLFLOW_TRACKING_URI",)


@overload
def redact_uri(uri: str) -> str: ...
@overload
def redact_uri(uri: None) -> None: ...
@overload
def redact_uri(uri: Optional[str]) -> Optional[str]: ...


def redact_uri(uri: Optional[str]) -> Optional[str]:
    """`uri` as it may be printed or stored: a URI with a network location (http, https,
    postgresql, ...) loses its user info (user:password@ becomes ***@), its path (a token travels
    there too: /api/<token>/; a non-empty one becomes /***), its query and its fragment; a local
    store (sqlite:///path, file:///path) keeps its path. Other strings pass unchanged.

    >>> redact_uri("https://alice:s3cret@mlflow.example.org:5000/x?token=1")
    'https://***@mlflow.example.org:5000/***'
    """
    if not uri or "://" not in uri:
        return uri
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable URI>"
    if not parts.netloc or parts.scheme.startswith(("sqlite", "file")):
        return uri  # a local store: its path is a file (and urlunsplit would drop sqlite:////path's authority)
    netloc = "***@" + parts.netloc.rsplit("@", 1)[1] if "@" in parts.netloc else parts.netloc
    path = "/***" if parts.path.strip("/") else parts.path
    return urlunsplit((parts.scheme, netloc, path, "", ""))


def uri_secrets(uri: Optional[str]) -> list[str]:
    """The pieces of `uri` that redact_uri hides (user info, path, query, fragment), longest first."""
    if not uri or "://" not in uri or redact_uri(uri) == uri:
        return []
    parts = urlsplit(uri)
    userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    whole = [userinfo, parts.path.strip("/"), parts.query, parts.fragment]
    # each password, path segment and query value alone too; short ones (a path's "x") would blot
    # out letters of every word, and are inside the whole pieces above anyway
    alone = userinfo.split(":") + parts.path.split("/") + [v for kv in parts.query.split("&") for v in kv.split("=")]
    return sorted({p for p in whole if p} | {p for p in alone if len(p) >= 4}, key=len, reverse=True)


_URI_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_text(text: str, uri: Optional[str] = None) -> str:
    """`text` (an error message, an override as typed) with every URI in it redacted (redact_uri),
    and every secret piece of `uri` replaced by *** wherever it appears (a library's message may
    repeat the path or query alone: "Max retries exceeded with url: /<token>/api/...")."""
    text = _URI_RE.sub(lambda m: redact_uri(m.group(0)) or "", text)
    for piece in uri_secrets(uri):
        text = text.replace(piece, "***")
    return text


def env_vars() -> dict[str, str]:
    """The allowlisted variables that are set, URIs redacted."""
    return {k: (redact_uri(os.environ[k]) if k in _URI_VARS else os.environ[k]) for k in ENV_VARS if k in os.environ}


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


def machine_load(at: str) -> dict:
    """How busy this machine is now, for environment.json's `load` list (one sample at the start of
    a sweep or resume, one at its end): the load averages (runnable processes over 1, 5 and 15
    minutes, to read against `cpu_count`), the CPU clock (MHz over the cores: a throttled or
    power-saving CPU shows here) and, with CUDA, each GPU's utilisation and SM clock. A busy
    machine makes timings noisy (a trial's slowest repeat far above its median). Best effort:
    what cannot be read is None."""
    sample: dict = {
        "at": at,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "loadavg": None,
        "cpu_mhz": None,
    }
    try:
        sample["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not Unix
        pass
    try:
        import psutil

        mhz = [f.current for f in psutil.cpu_freq(percpu=True) or [] if f.current]
    except Exception:  # noqa: BLE001 - psutil has no frequency on some platforms and containers
        mhz = []
    if mhz:
        sample["cpu_mhz"] = {"min": round(min(mhz)), "mean": round(sum(mhz) / len(mhz)), "max": round(max(mhz))}
    if torch.cuda.is_available():
        gpus = _run(["nvidia-smi", "--query-gpu=utilization.gpu,clocks.sm", "--format=csv,noheader,nounits"])
        sample["gpus"] = [_gpu_load(line) for line in gpus.splitlines()] if gpus else None
    return sample


def _gpu_load(line: str) -> dict:
    """One line of `nvidia-smi --query-gpu=utilization.gpu,clocks.sm` (nounits) as numbers."""
    fields = [f.strip() for f in line.split(",")]
    values = [float(f) if f.replace(".", "", 1).isdigit() else None for f in fields + [""] * (2 - len(fields))]
    return {"utilization_pct": values[0], "sm_mhz": values[1]}


def fingerprint(device: str) -> dict:
    """Everything needed to interpret a number later. Cheap (< 1 s), best effort."""
    versions: dict[str, Optional[str]] = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    env: dict[str, Any] = {
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
        "env_vars": env_vars(),
        "load": [machine_load("start")],
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
    """The fingerprint flattened into MLflow tags (whatever of it a run folder has: relog reads
    folders written by older versions, or with environment.json missing)."""
    git = env.get("git") or {}
    t = {k: str(env[k]) for k in ("hostname", "cpu", "torch", "python", "device") if env.get(k) is not None}
    t.update({f"git_{k}": str(git[k]) for k in ("commit", "dirty") if k in git})
    for pkg, ver in (env.get("packages") or {}).items():
        if ver:
            t[f"pkg.{pkg}"] = ver
    for k in ("gpus", "nccl", "driver", "torch_cuda"):
        if env.get(k):
            t[k] = str(env[k])
    return t
