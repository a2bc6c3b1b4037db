"""The tactic table (DESIGN §7): tuned kernel tactics and tier crossovers, shipped and agreed.

A *tactic* is the dict of launch choices an op's ``tactics=`` argument accepts (block sizes,
``num_warps``, stages, split factors: the keys belong to each op).  ``k3tail tune`` measures
them per

    key = (kernel, device name, SM "major.minor", Triton version, world size W, shape string)

and writes a JSON table.  Which table the package uses (:func:`load_table`), entry by entry, the
later winning:

1. the table it ships (``k3tail/tables/tactics.json``, package data);
2. the user table, where ``k3tail tune`` writes by default (:func:`user_table_path`:
   ``$XDG_CONFIG_HOME/k3tail/tactics.json``, else ``~/.config/k3tail/tactics.json``), if it exists;
3. ``$K3TAIL_TUNING_TABLE=/path/to/table.json``, if set.

A user or override table that is not a valid table raises (a typo must not silently fall back to
the defaults); a missing user table is simply absent, a missing override raises.

The tier crossovers (where the selector's thresholds should sit) are stored in the same
table under the pseudo-kernel :data:`CROSSOVER_KERNEL`, as a dict such as
``{"tail_fusion_max_tokens": 16, "lane_max_tokens": 512}``; :func:`crossovers` reads them.
A selector uses them as ``min(capacity, threshold)``: a threshold can only lower a tier's
ceiling, never raise it above what the vote allocated.

A lookup that misses logs ONE warning per key (``logging.getLogger("k3tail")``) naming the
key, and returns the caller's documented default.  A hit returns ``{**default, **tuned}``,
so a tactic key added to an op after the table was written still gets its default.

Ranks must agree: ranks that pick different kernels (different block sizes change the grid
and the slot layout) deadlock.  At init every rank calls :func:`agree_table` (or
:func:`agreed_tactics`), which hands every rank rank 0's table and rank 0's key fields, the
way the capability vote is agreed.

File format (``"format": "k3tail-tactics/1"``)::

    {"format": "k3tail-tactics/1",
     "meta": {"written_by": "k3tail tune", "date": ..., ...},
     "entries": [
        {"kernel": "LatentTail", "device": "NVIDIA H200", "sm": "9.0", "triton": "3.6.0",
         "world_size": 8, "shape": "H=7168,K=16,L=3584,dtype=bf16",
         "tactic": {"num_warps": 4, ...}, "us": 12.5, "info": {...}},
        ...]}
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, NamedTuple, Optional

log = logging.getLogger("k3tail")

FORMAT = "k3tail-tactics/1"
TABLE_ENV = "K3TAIL_TUNING_TABLE"
TABLE_DIR = Path(__file__).resolve().parent / "tables"
SHIPPED_TABLE = TABLE_DIR / "tactics.json"
USER_TABLE_NAME = Path("k3tail") / "tactics.json"
CROSSOVER_KERNEL = "K3MoETail.tiers"

# Threshold names the crossover entries may carry (TailCaps field names, DESIGN §2).
# ``large_m_min_tokens`` (the sharded large-M path's lower bound without the lane, written by
# ``k3tail tune`` where K3MoETail takes large_m) is taken as is, not as a min with a capacity.
CROSSOVER_FIELDS = ("tail_fusion_max_tokens", "cute_max_tokens", "lane_max_tokens",
                    "multimem_min_tokens", "multimem_max_tokens", "large_m_min_tokens")


class TableKey(NamedTuple):
    """The key of one table entry."""

    kernel: str
    device: str
    sm: str
    triton: str
    world_size: int
    shape: str

    def __str__(self) -> str:
        return (f"(kernel={self.kernel!r}, device={self.device!r}, sm={self.sm!r}, "
                f"triton={self.triton!r}, W={self.world_size}, shape={self.shape!r})")


def make_key(kernel: str, *, device_name: str, sm: str, triton: str, world_size: int, shape: str) -> TableKey:
    """Build (and validate) a :class:`TableKey`."""
    if not isinstance(kernel, str) or not kernel:
        raise ValueError(f"kernel must be a non-empty str, got {kernel!r}")
    if not isinstance(device_name, str) or not device_name:
        raise ValueError(f"device_name must be a non-empty str, got {device_name!r}")
    if not isinstance(sm, str) or not sm:
        raise ValueError(f"sm must be a str such as '9.0', got {sm!r}")
    if not isinstance(triton, str) or not triton:
        raise ValueError(f"triton must be a version str such as '3.6.0', got {triton!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(shape, str):
        raise ValueError(f"shape must be a str (see shape_string), got {shape!r}")
    return TableKey(kernel, device_name, sm, triton, int(world_size), shape)


_DTYPE_SHORT = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def shape_string(**dims: Any) -> str:
    """Canonical shape string: ``shape_string(H=7168, L=3584, K=16, dtype=torch.bfloat16)``
    -> ``"H=7168,K=16,L=3584,dtype=bf16"`` (keys sorted, torch dtypes shortened)."""
    parts = []
    for k in sorted(dims):
        v = dims[k]
        s = str(v)
        parts.append(f"{k}={_DTYPE_SHORT.get(s, s)}")
    return ",".join(parts)


def device_fields(device=None) -> Dict[str, str]:
    """``{"device_name", "sm", "triton"}`` for a torch device (None: the current CUDA device,
    or the CPU interpreter when there is no GPU).  On CPU: device_name "cpu", sm "interpreter"."""
    import torch
    import triton

    dev = None if device is None else torch.device(device)
    if (dev is None and torch.cuda.is_available()) or (dev is not None and dev.type == "cuda"):
        if dev is None or dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(dev)
        return {"device_name": torch.cuda.get_device_name(dev), "sm": f"{major}.{minor}",
                "triton": triton.__version__}
    return {"device_name": "cpu", "sm": "interpreter", "triton": triton.__version__}


# ---------------------------------------------------------------------------- table
@dataclass
class TacticTable:
    """In-memory tactic table: ``entries[key] = {"tactic": dict, "us": float|None, "info": dict}``."""

    entries: Dict[TableKey, Dict[str, Any]] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)
    source: str = ""  # where it was loaded from (for messages)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[TableKey]:
        return iter(self.entries)

    def __contains__(self, key) -> bool:
        return key in self.entries

    def put(self, key: TableKey, tactic: Mapping[str, Any], *, us: Optional[float] = None,
            info: Optional[Mapping[str, Any]] = None) -> None:
        """Insert or replace one entry (the tactic must be JSON-serializable)."""
        if not isinstance(key, TableKey):
            raise ValueError(f"key must be a TableKey (see make_key), got {type(key).__name__}")
        if not isinstance(tactic, Mapping):
            raise ValueError(f"tactic must be a dict, got {type(tactic).__name__}")
        rec = {"tactic": dict(tactic), "us": None if us is None else float(us), "info": dict(info or {})}
        json.dumps(rec)  # fail here, not at save time, on a non-serializable tactic
        self.entries[key] = rec

    def get(self, key: TableKey) -> Optional[Dict[str, Any]]:
        rec = self.entries.get(key)
        return None if rec is None else copy.deepcopy(rec)

    def update(self, other: "TacticTable") -> None:
        """Entries of ``other`` replace this table's entries of the same key."""
        self.entries.update(copy.deepcopy(other.entries))

    # -- JSON ---------------------------------------------------------------------------
    def to_json(self) -> Dict[str, Any]:
        rows = []
        for key in sorted(self.entries, key=lambda k: (k.kernel, k.device, k.sm, k.triton, k.world_size, k.shape)):
            rec = self.entries[key]
            rows.append({"kernel": key.kernel, "device": key.device, "sm": key.sm, "triton": key.triton,
                         "world_size": key.world_size, "shape": key.shape, **rec})
        return {"format": FORMAT, "meta": dict(self.meta), "entries": rows}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "") -> "TacticTable":
        where = source or "tactic table"
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"{where}: not a k3tail tactic table (format {got!r}, expected {FORMAT!r})")
        table = cls(meta=dict(data.get("meta") or {}), source=source)
        for i, row in enumerate(data.get("entries") or []):
            try:
                key = make_key(row["kernel"], device_name=row["device"], sm=row["sm"], triton=row["triton"],
                               world_size=row["world_size"], shape=row["shape"])
                table.put(key, row["tactic"], us=row.get("us"), info=row.get("info"))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: entry {i} is malformed ({e}): {row!r}") from e
        return table


def save_table(table: TacticTable, path) -> Path:
    """Write ``table`` as JSON to ``path`` (atomically: a temporary file, then rename)."""
    if not isinstance(table, TacticTable):
        raise ValueError(f"table must be a TacticTable, got {type(table).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(table.to_json(), indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def read_table(path) -> TacticTable:
    """Read one table file (no merging, no environment)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    return TacticTable.from_json(data, source=str(path))


def user_table_path() -> Path:
    """The user's tactic table: ``$XDG_CONFIG_HOME/k3tail/tactics.json`` (an absolute
    ``XDG_CONFIG_HOME``), else ``~/.config/k3tail/tactics.json``.  ``k3tail tune`` writes there by
    default; :func:`load_table` reads it (if it exists) over the shipped table."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    if not base or not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / USER_TABLE_NAME


def load_table(path=None) -> TacticTable:
    """The table the package uses.

    ``path`` given: exactly that file.  Otherwise the shipped table (package data, empty if
    absent), overlaid entry by entry with the user table (:func:`user_table_path`, if it exists),
    then with the file named by ``$K3TAIL_TUNING_TABLE`` if set (a malformed user table, or a
    missing or malformed override, raises: a typo must not silently fall back to defaults).
    """
    if path is not None:
        return read_table(path)
    override = os.environ.get(TABLE_ENV, "")
    user = user_table_path()
    sig = (_mtime(SHIPPED_TABLE), str(user), _mtime(user), override, _mtime(override) if override else None)
    with _cache_lock:
        hit = _cache.get(sig)
    if hit is not None:  # one read per process, not one per layer (files unchanged)
        return copy.deepcopy(hit)
    table = _load_uncached(user if sig[2] is not None else None, override)
    with _cache_lock:
        _cache.clear()
        _cache[sig] = copy.deepcopy(table)
    return table


_cache: Dict[tuple, TacticTable] = {}
_cache_lock = threading.Lock()


def _mtime(path) -> Optional[tuple]:
    try:
        st = os.stat(path)
        return (st.st_mtime_ns, st.st_size)
    except OSError:
        return None


def _load_uncached(user: Optional[Path], override: str) -> TacticTable:
    table = TacticTable(source=str(SHIPPED_TABLE))
    if SHIPPED_TABLE.is_file():
        table = read_table(SHIPPED_TABLE)
    if user is not None:
        try:
            mine = read_table(user)
        except FileNotFoundError:  # removed since the stat: absent
            mine = None
        except ValueError as e:
            raise ValueError(f"the user tactic table {user} (k3tail.tuning.user_table_path) is not a valid "
                             f"table: {e}; fix it, or remove it to use the shipped table") from e
        if mine is not None:
            table.update(mine)
            table.meta = {**table.meta, "user": str(user)}
            table.source = f"{table.source} + {user}"
    if override:
        try:
            extra = read_table(override)
        except FileNotFoundError:
            raise FileNotFoundError(f"{TABLE_ENV}={override}: no such tactic table") from None
        table.update(extra)
        table.meta = {**table.meta, "override": override}
        table.source = f"{table.source} + {override}"
    return table


# --------------------------------------------------------------------------- lookup
_warned: set = set()
_warned_lock = threading.Lock()


def _warn_once(key: TableKey, what: str, default: Mapping[str, Any]) -> None:
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("k3tail tactic table has no %s for %s; using the default %s "
                "(run `k3tail tune` on this machine to measure one)", what, key, dict(default))


def reset_warnings() -> None:
    """Forget which misses were already reported (for tests)."""
    with _warned_lock:
        _warned.clear()


def lookup(table: TacticTable, kernel: str, *, device_name: str, sm: str, triton: str, world_size: int,
           shape: str, default: Mapping[str, Any]) -> Dict[str, Any]:
    """The tactic for ``kernel`` at this key: ``{**default, **tuned}`` on a hit; ``dict(default)``
    on a miss, after logging one warning per key (the first miss of each key in this process)."""
    if not isinstance(default, Mapping):
        raise ValueError(f"default must be a dict (the documented default tactic), got {type(default).__name__}")
    key = make_key(kernel, device_name=device_name, sm=sm, triton=triton, world_size=world_size, shape=shape)
    rec = table.entries.get(key) if table is not None else None
    if rec is None:
        _warn_once(key, "tactic", default)
        return dict(default)
    return {**default, **copy.deepcopy(rec["tactic"])}


def crossovers(table: TacticTable, *, device_name: str, sm: str, triton: str, world_size: int,
               shape: str, warn: bool = True, loopback: Optional[bool] = None) -> Dict[str, int]:
    """The measured tier thresholds for this key (TailCaps field names -> int), or ``{}`` when the
    table has none (logged once per key if ``warn``).  Apply them as ``min(capacity, value)``.

    ``loopback``: the kind of world asking.  Thresholds measured in loopback (``info.loopback``:
    W ranks time-share one GPU, the spinning Lamport kernels get half its SMs) do not carry over to
    W processes on W GPUs, nor the other way round: a world of the other kind gets ``{}`` and runs
    with its capacities (entries that do not say how they were measured apply to both)."""
    key = make_key(CROSSOVER_KERNEL, device_name=device_name, sm=sm, triton=triton,
                   world_size=world_size, shape=shape)
    rec = table.entries.get(key) if table is not None else None
    if rec is None:
        if warn:
            _warn_once(key, "tier crossovers", {"(selector thresholds)": "capacities"})
        return {}
    measured = (rec.get("info") or {}).get("loopback")
    if loopback is not None and measured is not None and bool(measured) != bool(loopback):
        return {}
    return {k: int(v) for k, v in rec["tactic"].items() if k in CROSSOVER_FIELDS and v is not None}


# ------------------------------------------------------------------------ agreement
def agree_table(comm, table: TacticTable) -> TacticTable:
    """Every rank returns rank 0's table (``comm.broadcast_object``), like the vote (DESIGN §4).

    ``comm`` is a :class:`k3tail.runtime.workspace.Comm` or anything ``k3tail.runtime.workspace.comm_for``
    accepts (a process group, None for the default group, a LoopbackWorld group).
    Collective: every rank of the group must call it at the same point.
    """
    from k3tail.runtime.comm import comm_for

    c = comm_for(comm)
    agreed = c.broadcast_object(table if c.rank == 0 else None, src=0)
    if not isinstance(agreed, TacticTable):
        raise ValueError(f"rank 0 sent a {type(agreed).__name__}, not a TacticTable")
    if c.rank != 0:
        agreed = copy.deepcopy(agreed)  # loopback ranks share objects: never alias rank 0's
        if table is not None and table.to_json()["entries"] != agreed.to_json()["entries"]:
            log.info("k3tail: rank %d's tactic table (%s) differs from rank 0's (%s); using rank 0's",
                     c.rank, table.source or "?", agreed.source or "?")
    return agreed


class Tactics:
    """An agreed table plus rank 0's key fields: every rank's :meth:`get` answers the same.

    Build it with :func:`agreed_tactics` at op construction (outside CUDA-graph capture).
    """

    def __init__(self, table: TacticTable, fields: Mapping[str, str], world_size: int):
        self.table, self.fields, self.world_size = table, dict(fields), int(world_size)

    def get(self, kernel: str, *, shape: str, default: Mapping[str, Any]) -> Dict[str, Any]:
        return lookup(self.table, kernel, world_size=self.world_size, shape=shape, default=default, **self.fields)

    def crossovers(self, *, shape: str, warn: bool = True, loopback: Optional[bool] = None) -> Dict[str, int]:
        return crossovers(self.table, world_size=self.world_size, shape=shape, warn=warn, loopback=loopback,
                          **self.fields)


def agreed_tactics(group=None, *, device=None, table: Optional[TacticTable] = None,
                   fields: Optional[Mapping[str, str]] = None) -> Tactics:
    """Load the local table (unless ``table`` is given) and this rank's key fields (unless
    ``fields`` is given: ``device_fields(device)``), then agree both on rank 0's.  Collective.

    Agreeing the key fields too matters on mixed machines: a rank whose device name differs
    would otherwise look up a different key and pick a different kernel.
    """
    from k3tail.runtime.comm import comm_for

    c = comm_for(group)
    local = (table if table is not None else load_table(),
             dict(fields) if fields is not None else device_fields(device))
    agreed_table, fields = c.broadcast_object(local if c.rank == 0 else None, src=0)
    if c.rank != 0:
        agreed_table, fields = copy.deepcopy(agreed_table), dict(fields)
    return Tactics(agreed_table, fields, c.world_size)
