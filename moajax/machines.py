"""Machine profiles: bandwidth, peak rates, on-chip memory, topology.

Profiles drive the default ONF (tile sizes that fit shared memory, grid vs loops) and the
cost model's roofline. ``configs/*.toml`` hold vendor data for the papers' machines
(``available()``, ``load(name)``). The machine this runs on is ``local()``: the profile named
by ``$MOAJAX_MACHINE``, else the one ``moajax measure`` measured and cached on this machine
(``cache_dir() / "local.toml"``; never committed, since it describes one machine), else a
generic CPU profile with this machine's topology and a notice that it is unmeasured.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import platform
import sys
import tomllib
from pathlib import Path

import numpy as np


# the tile tables a profile's ``gpu_tiles`` may add measured tilings to (``schedule._gpu_candidates``)
GPU_TILE_TABLES = ("tiles", "scatter", "scatter_walk")


@dataclasses.dataclass(frozen=True)
class Machine:
    name: str
    kind: str  # "cpu" | "gpu"
    memory_bandwidth_gb_s: float
    peak_tflops: dict
    description: str = ""
    arch: str = ""
    shared_memory_per_block: int = 0
    multiprocessors: int = 0
    cores: int = 1
    numa_domains: int = 1
    l2_cache_bytes: int = 0
    llc_bytes: int = 0
    launch_overhead_us: float = 0.0
    device_kinds: tuple = ()
    measured: dict = dataclasses.field(default_factory=dict)
    # "kernel n" → "threads x processes" with the best throughput (scripts/sweep_threads.py)
    threads_recommended: dict = dataclasses.field(default_factory=dict)
    # GPU: derive checks each kernel's tiling by compiling it (jaxlib's Triton and ptxas) and
    # steps down the tile table where it spills (``schedule.derive``); on for the GPU a process
    # runs on (``for_device``) and in ``moajax gpu-report``, off where a GPU is only a target
    spill_check: bool = False
    # the GPU path whose kernels the check compiles: "pallas" (the default backend) or
    # "triton" (the ONF's Triton source, implementation="triton"): the same tiling can spill
    # through one compiler and not the other
    gpu_path: str = "pallas"
    # CPU: the bytes of the score tile one step of a row loop holds (every batch-like program ×
    # rows × keys; ``schedule._cpu_cache_budget``); 0: derived from the last-level cache
    cpu_score_tile_bytes: int = 0
    # GPU: this profile's own tilings, measured on it, tried before the schedule's tables'
    # (``schedule._gpu_candidates``): "<table> <operand bytes> <held width>" → [[rows, keys,
    # warps, stages], …], table "tiles" (``GPU_TILES``), "scatter" (``GPU_SCATTER_TILES``) or
    # "scatter_walk" (the scatter schedule walking a long sum inside a short one: GQA's dK
    # and dV), e.g. the H200's "scatter 2 64" (bench/results/gpu_backward_sweep_h200.md)
    gpu_tiles: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.gpu_path not in ("pallas", "triton"):
            raise ValueError(f"Machine {self.name!r}: gpu_path must be 'pallas' or 'triton', got {self.gpu_path!r}")
        if not isinstance(self.cpu_score_tile_bytes, int) or self.cpu_score_tile_bytes < 0:
            raise ValueError(f"Machine {self.name!r}: cpu_score_tile_bytes must be a non-negative int, "
                             f"got {self.cpu_score_tile_bytes!r}")
        # a key the tables can ask for (``schedule._gpu_candidates``), written as they ask
        keys = {f"{t} {b} {w}" for t in GPU_TILE_TABLES for b in (1, 2, 4, 8) for w in (64, 128)}
        pow2 = lambda x: type(x) is int and x > 0 and x & (x - 1) == 0  # noqa: E731
        for key, tilings in self.gpu_tiles.items():
            if key not in keys:
                raise ValueError(f"Machine {self.name!r}: a gpu_tiles key is '<{'|'.join(GPU_TILE_TABLES)}> "
                                 f"<operand bytes: 1|2|4|8> <held width: 64|128>', got {key!r}")
            if not (isinstance(tilings, (list, tuple)) and tilings and all(
                    isinstance(t, (list, tuple)) and len(t) == 4 and all(pow2(x) for x in t[:3])
                    and type(t[3]) is int and t[3] >= 1 for t in tilings)):
                raise ValueError(f"Machine {self.name!r}: gpu_tiles[{key!r}] must be a list of [rows, keys, warps, "
                                 f"stages]: rows, keys and warps powers of two (Triton's blocks), stages ≥ 1; "
                                 f"got {tilings!r}")

    def tilings(self, table: str, item: int, held: int) -> list:
        """This profile's own (rows, keys, warps, stages) for one entry of a tile table."""
        return [tuple(t) for t in self.gpu_tiles.get(f"{table} {item} {held}", ())]

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def onchip_limit_bytes(self) -> int:
        """The most on-chip memory one program may use (GPU shared memory per block; 0 = none)."""
        return self.shared_memory_per_block if self.is_gpu else 0

    @property
    def bandwidth(self) -> float:
        """Main-memory bandwidth in bytes/s."""
        return self.memory_bandwidth_gb_s * 1e9

    def peak(self, dtype, tensor: bool = False) -> float:
        """Peak flop/s for arithmetic in ``dtype`` (``tensor``: matrix units, where there are any)."""
        name = np.dtype(dtype).name
        table = self.peak_tflops
        keys = []
        if tensor:
            keys.append("tf32_tensor" if name == "float32" else f"{name}_tensor")
        keys += [name, "float32"]
        for k in keys:
            if k in table:
                return float(table[k]) * 1e12
        raise KeyError(f"machine {self.name}: no peak rate for {name}")


def config_dirs() -> list[Path]:
    """Where profiles are looked up: $MOAJAX_CONFIGS, the source checkout, the install prefix."""
    out = []
    env = os.environ.get("MOAJAX_CONFIGS")
    if env:
        out.append(Path(env))
    out.append(Path(__file__).resolve().parent.parent / "configs")
    out.append(Path(sys.prefix) / "share" / "moajax" / "configs")
    return [d for d in out if d.is_dir()]


def _from_toml(path: Path) -> Machine:
    data = tomllib.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(Machine)}
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"{path}: unknown profile keys {sorted(unknown)}")
    data["device_kinds"] = tuple(data.get("device_kinds", ()))
    return Machine(**data)


@functools.lru_cache(maxsize=None)
def available() -> dict:
    """All profiles by name (earlier config directories win)."""
    out: dict = {}
    for d in reversed(config_dirs()):
        for p in sorted(d.glob("*.toml")):
            m = _from_toml(p)
            out[m.name] = m
    return out


# The shared memory one block may opt into, in bytes, by CUDA compute capability (the CUDA C
# Programming Guide's technical specifications): what an unlisted GPU's tilings must fit.
SHARED_MEMORY_BY_CAPABILITY = {"8.0": 166912, "8.6": 101376, "8.7": 166912, "8.9": 101376, "9.0": 232448}
_GENERIC_GPU_PREFIX = "generic-gpu-"


def capability_arch(cc: str) -> str:
    """"8.9" → "sm_89" (9.0 → "sm_90a", the arch Hopper kernels are compiled for)."""
    return "sm_" + cc.replace(".", "") + ("a" if cc == "9.0" else "")


def arch_capability(arch: str) -> str | None:
    """The inverse of ``capability_arch`` over the capabilities moajax knows ("sm_89" → "8.9"),
    else None."""
    return {capability_arch(c): c for c in SHARED_MEMORY_BY_CAPABILITY}.get(arch)


def generic_gpu(cc: str, multiprocessors: int = 0, kind: str = "") -> Machine:
    """An unlisted CUDA GPU of compute capability ``cc``: the default GPU profile's rates and
    bandwidth (guesses, as the generic CPU's are) with its own arch, shared memory per block
    and multiprocessors, so that its tilings fit it. Named ``generic-gpu-<arch>``: ``load``
    rebuilds it from the name (an ONF's target)."""
    if cc not in SHARED_MEMORY_BY_CAPABILITY:
        raise ValueError(f"no shared-memory figure for compute capability {cc!r}; known: "
                         f"{sorted(SHARED_MEMORY_BY_CAPABILITY)} (add a profile to configs/ for this GPU)")
    base = load(GENERIC_GPU_NAME)
    arch = capability_arch(cc)
    return dataclasses.replace(
        base, name=_GENERIC_GPU_PREFIX + arch, arch=arch, shared_memory_per_block=SHARED_MEMORY_BY_CAPABILITY[cc],
        multiprocessors=multiprocessors or base.multiprocessors, device_kinds=(kind,) if kind else (),
        gpu_tiles={},  # (tilings measured on the base profile's GPU are not this one's)
        description=f"unlisted GPU{' ' + kind if kind else ''} (compute capability {cc}; rates and bandwidth "
                    f"of {base.name}, guessed)")


def load(name: str) -> Machine:
    """The profile called ``name`` (configs/*.toml); "local" is this machine (``local()``);
    ``generic-gpu-sm_XY`` an unlisted GPU of that arch (``generic_gpu``)."""
    if name == "local":
        return local()
    if name.startswith(_GENERIC_GPU_PREFIX):
        cc = arch_capability(name[len(_GENERIC_GPU_PREFIX):])
        if cc is not None:
            return generic_gpu(cc)
    profs = available()
    if name not in profs:
        raise ValueError(f"no machine profile {name!r}; profiles are {sorted(profs)} (configs/*.toml) or 'local'")
    return profs[name]


# ----------------------------------------------------------------------------- this machine


def _sysfs_cache_bytes(level: int) -> int:
    """Size of cpu0's unified or data cache at ``level`` in bytes (0 when sysfs does not say)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for idx in sorted(base.glob("index*")):
        try:
            if int((idx / "level").read_text()) != level:
                continue
            if (idx / "type").read_text().strip() not in ("Unified", "Data"):
                continue
            s = (idx / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(s[-1:], 1)
        return int(s.rstrip("KMG")) * mult
    return 0


def _cpuinfo(field: str) -> str | None:
    """The first ``field`` of /proc/cpuinfo (its value), or None (no such file or field)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def vector_isa() -> str:
    """The CPU's widest vector ISA by its /proc/cpuinfo flags: "AVX-512", "AVX2" or "" (a cloud
    VM's "AMD EPYC" was an AVX2 part on 2026-12-04 and an AVX-512 one on 2026-12-07, 2.4× its
    GEMM rate: attention_grad_cpu_epyc_avx2.md, attention_grad_cpu_epyc_avx512.md)."""
    flags = set((_cpuinfo("flags") or "").split())
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""


# The last-level cache one usable core counts on at most. Server parts share 1.5–6 MiB of L3 a
# core; a few (AMD's frequency-optimised and stacked-cache SKUs) have 32–48 MiB a core, whose
# tiles this caps below their cache (smaller, not wrong). sysfs in a virtual machine reports its
# host's whole L3 as shared by the guest's few vCPUs (491,520 KiB for 2 on a cloud Xeon:
# test_machines), and CPU tiles sized by that budget hold a whole sequence's rows (no row loop,
# so no masked tile skipped) where a core's share keeps 512.
LLC_PER_CORE_MAX = 16 * 2**20


def _usable_cores() -> int:
    """The cores this process may run on (its affinity: a container's, not its host's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def topology() -> dict:
    """This machine's topology from sysfs and /proc (no timing): the ``Machine`` fields
    ``cores``, ``numa_domains``, ``l2_cache_bytes``, ``llc_bytes`` (sysfs' L3, at most
    ``LLC_PER_CORE_MAX`` a usable core), ``arch``, plus ``cpu_model``."""
    cores = os.cpu_count() or 1
    return {
        "cores": cores,
        "numa_domains": len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1,
        "l2_cache_bytes": _sysfs_cache_bytes(2),
        "llc_bytes": min(_sysfs_cache_bytes(3), min(cores, _usable_cores()) * LLC_PER_CORE_MAX),
        "arch": platform.machine(),
        "cpu_model": cpu_model(),
    }


GENERIC_CPU = Machine("generic-cpu", "cpu", 20.0, {"float64": 0.05, "float32": 0.1}, description="unmeasured CPU")
GENERIC_GPU_NAME = "delta-a100"


def cache_dir() -> Path:
    """Where this machine's measured profile is cached: $MOAJAX_CACHE_DIR, else
    $XDG_CACHE_HOME/moajax, else ~/.cache/moajax."""
    env = os.environ.get("MOAJAX_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moajax"


_USING: contextvars.ContextVar = contextvars.ContextVar("moajax_machine_using", default=())


@contextlib.contextmanager
def using(machine):
    """Inside the block, ``local()`` is ``machine`` (a ``Machine``, or a profile name for
    ``load``): kernels called there are derived for it. Blocks nest. A function jitted inside
    keeps what it traced there: JAX traces once per shape, not once per profile.

        with moajax.machines.using(dataclasses.replace(machines.local(), cpu_score_tile_bytes=8 << 20)):
            out = moajax.dot_product_attention(q, k, v)"""
    m = load(machine) if isinstance(machine, str) else machine
    if not isinstance(m, Machine):
        raise TypeError(f"using: machine must be a Machine or a profile name, got {type(machine).__name__}")
    token = _USING.set(_USING.get() + (m,))
    try:
        yield m
    finally:
        _USING.reset(token)


def local() -> Machine:
    """This machine's profile: the innermost ``using`` block's, else the one named by
    $MOAJAX_MACHINE (any of ``available()``), else the measured profile cached at
    ``cache_dir() / "local.toml"`` (``moajax measure`` writes it), else ``GENERIC_CPU`` with
    this machine's topology, logging once that it is unmeasured.

    Read once per process; ``local.cache_clear()`` makes the next call look again."""
    stack = _USING.get()
    return stack[-1] if stack else _local()


@functools.lru_cache(maxsize=None)
def _local() -> Machine:
    name = os.environ.get("MOAJAX_MACHINE")
    if name:
        profs = available()
        if name not in profs:
            raise ValueError(f"MOAJAX_MACHINE={name!r} is not a machine profile; profiles are {sorted(profs)}")
        return profs[name]
    cached = cache_dir() / "local.toml"
    if cached.is_file():
        return _from_toml(cached)
    topo = topology()
    cpu_model = topo.pop("cpu_model")
    logging.getLogger("moajax").warning(
        "moajax: using a generic CPU profile (peak rates and bandwidth are guesses); "
        "`moajax measure` measures this machine and writes %s", cached)
    return dataclasses.replace(GENERIC_CPU, description=f"unmeasured CPU ({cpu_model}, {topo['cores']} cores)", **topo)


local.cache_clear = _local.cache_clear


def for_device(device=None) -> Machine:
    """The profile for a JAX device: a GPU matched by device kind, else an unlisted one by its
    compute capability (``generic_gpu``), its tilings spill-checked (``Machine.spill_check``);
    the local CPU otherwise."""
    if device is None:
        import jax

        device = jax.devices()[0]
    if device.platform == "gpu" or device.platform == "cuda":
        kind = getattr(device, "device_kind", "")
        for m in available().values():
            if m.is_gpu and any(k.lower() in kind.lower() for k in m.device_kinds):
                return dataclasses.replace(m, spill_check=True)
        # unlisted: its own arch and shared memory (the A100's 163 KB would not fit an L40S's
        # 99 KB), else the default GPU profile, with a warning
        cc = str(getattr(device, "compute_capability", "") or "")
        try:
            m = generic_gpu(cc, int(getattr(device, "core_count", 0) or 0), kind)
        except ValueError as e:
            logging.getLogger("moajax").warning("moajax: GPU %r has no profile: using %s's (%s)", kind,
                                                GENERIC_GPU_NAME, e)
            m = load(GENERIC_GPU_NAME)
        return dataclasses.replace(m, spill_check=True)
    return local()
