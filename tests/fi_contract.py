"""The real flashinfer-python, read without a GPU, for the CUTE_FINALIZE contract tests.

* :func:`obtain_wheel` gets the published wheel (``pip download --no-deps``: no CUDA, no build) into
  ``~/.cache/k3tail/flashinfer`` (``K3TAIL_CACHE`` moves it).  Default: the newest release; set
  ``K3TAIL_FLASHINFER_VERSION`` to pin one, or ``K3TAIL_FLASHINFER_WHEEL`` to a local wheel (offline CI).
* :class:`FlashinferSource` reads its files; :func:`real_signatures` extracts the signatures the
  adapter binds to with ``ast`` (nothing is imported).
* :func:`check_calls` checks recorded calls (from the fake) against those signatures and against the
  rules of ``_mnnvl_cutedsl_allreduce_fusion`` (call-time values equal to the compiled ones).
* :class:`RealLayer` assembles ``flashinfer.comm`` from the release's own Python files (``allreduce.py``,
  ``mnnvl_cutedsl_ar.py``, ``workspace_base.py``, ``mnnvl_cutedsl/{config,presets}.py``) with only the
  CUDA leaves stubbed: the CuTe kernels and their protocols (a world-of-one fp64 stand-in), the device
  queries (an emulated GPU, :class:`Machine`), torch.distributed (a :class:`FakeGroup`).  The
  adapter then runs through flashinfer's real argument checks, real profile resolution and real
  eligibility probe.

``python tests/fi_contract.py`` prints the real signatures (to update the fake by hand).
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

PKG = "flashinfer-python"
FILES = ("flashinfer/comm/allreduce.py", "flashinfer/comm/mnnvl_cutedsl_ar.py", "flashinfer/comm/trtllm_ar.py",
         "flashinfer/comm/__init__.py", "flashinfer/comm/workspace_base.py")
PUBLIC = ("create_allreduce_fusion_workspace", "allreduce_fusion", "is_mnnvl_cutedsl_supported")
WORKSPACE = "MNNVLCuteDSLAllReduceFusionWorkspace"


class Unavailable(Exception):
    """The wheel cannot be obtained here (no network, no pip): the tests skip with this reason."""


def cache_dir() -> Path:
    return Path(os.environ.get("K3TAIL_CACHE") or Path.home() / ".cache" / "k3tail") / "flashinfer"


def _wheel_version(p: Path) -> str:
    return p.name.split("-")[1]


def obtain_wheel() -> Path:
    """The flashinfer-python wheel to check against (see the module docstring).  Raises Unavailable."""
    explicit = os.environ.get("K3TAIL_FLASHINFER_WHEEL")
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise Unavailable(f"K3TAIL_FLASHINFER_WHEEL={explicit} is not a file")
        return p
    version = os.environ.get("K3TAIL_FLASHINFER_VERSION", "").strip()
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    req = PKG + (f"=={version}" if version else "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--timeout", "60", "--retries", "2", "-d", str(d), req]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        out, rc = r.stdout + r.stderr, r.returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        out, rc = f"{type(e).__name__}: {e}", -1
    if rc == 0:
        names = re.findall(r"(flashinfer_python-[^\s/]+?\.whl)", out)
        if names and (d / names[-1]).is_file():
            return d / names[-1]
    cached = sorted(d.glob("flashinfer_python-*.whl"), key=lambda p: _vkey(_wheel_version(p)))
    if version:
        cached = [p for p in cached if _wheel_version(p) == version]
    if rc != 0 and cached:
        # offline: the pinned release, or the newest one fetched before (the newest published may be newer)
        print(f"fi_contract: pip download failed (rc {rc}); using the cached {cached[-1].name}")
        return cached[-1]
    lines = [ln.strip() for ln in out.strip().splitlines() if "WARNING: Location" not in ln]
    errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-1:]
    raise Unavailable(f"cannot obtain {req} with `pip download --no-deps` (rc {rc}: {' | '.join(errors)[-300:]}); "
                      f"set K3TAIL_FLASHINFER_WHEEL=/path/to/flashinfer_python-*.whl to run offline")


def _vkey(v: str):
    try:
        from packaging.version import Version
        return (0, Version(v))
    except Exception:  # noqa: BLE001
        return (1, v)


class FlashinferSource:
    """The Python files of one flashinfer-python wheel (read from the zip; extracted on demand)."""

    def __init__(self, wheel: Path):
        self.wheel = Path(wheel)
        self.version = _wheel_version(self.wheel)
        with zipfile.ZipFile(self.wheel) as z:
            self.names = [n for n in z.namelist() if n.startswith("flashinfer/comm/") and n.endswith(".py")]
            missing = [f for f in FILES if f not in self.names]
            if missing:
                raise AssertionError(f"flashinfer-python {self.version} has no {missing}: the mnnvl-cutedsl "
                                     f"API moved; re-read the release and update cute_fallback/mnnvl.py")
            self._text = {n: z.read(n).decode() for n in self.names}

    def text(self, name: str) -> str:
        return self._text[name]

    def tree(self, name: str) -> ast.Module:
        return ast.parse(self.text(name))

    def extract(self) -> Path:
        """``<cache>/src/<version>/flashinfer/comm/...`` (the .py files only); returns the root."""
        root = cache_dir() / "src" / self.version
        for n, t in self._text.items():
            p = root / n
            if not p.is_file() or p.read_text() != t:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(t)
        return root


# ---------------------------------------------------------------------------------------- ast
class Expr:
    """A default that is not a literal (``torch.bfloat16``): equal to objects whose repr is its text."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text

    def __eq__(self, other):
        return self.text == (other.text if isinstance(other, Expr) else repr(other))

    def __hash__(self):
        return hash(self.text)


def _default(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return Expr(ast.unparse(node))


def ast_signature(fn: ast.FunctionDef, *, drop_self: bool = False) -> inspect.Signature:
    """The signature of ``fn`` from its source: names, kinds and defaults (annotations dropped)."""
    P = inspect.Parameter
    a = fn.args
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    params = [P(arg.arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                default=P.empty if d is None else _default(d)) for i, (arg, d) in enumerate(zip(pos, defaults))]
    if drop_self:
        params = params[1:]
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    params += [P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else _default(d))
               for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _find(tree: ast.Module, name: str, method: Optional[str] = None) -> ast.FunctionDef:
    for node in tree.body:
        if method is None and isinstance(node, ast.FunctionDef) and node.name == name:
            return node
        if method is not None and isinstance(node, ast.ClassDef) and node.name == name:
            for m in node.body:
                if isinstance(m, ast.FunctionDef) and m.name == method:
                    return m
    raise AssertionError(f"no {name}{'.' + method if method else ''} at the top level")


def real_signatures(src: FlashinferSource) -> Dict[str, inspect.Signature]:
    ar = src.tree("flashinfer/comm/allreduce.py")
    sigs = {}
    for name in PUBLIC:
        try:
            sigs[name] = ast_signature(_find(ar, name))
        except AssertionError as e:
            raise AssertionError(f"flashinfer-python {src.version}: flashinfer/comm/allreduce.py: {e}") from None
    cu = src.tree("flashinfer/comm/mnnvl_cutedsl_ar.py")
    sigs[WORKSPACE] = ast_signature(_find(cu, WORKSPACE, "__init__"), drop_self=True)
    sigs["_mnnvl_cutedsl_allreduce_fusion"] = ast_signature(_find(cu, "_mnnvl_cutedsl_allreduce_fusion"))
    return sigs


def exported_from_comm(src: FlashinferSource) -> set:
    """Names ``flashinfer/comm/__init__.py`` binds (what ``flashinfer.comm.X`` offers)."""
    names = set()
    for node in ast.walk(src.tree("flashinfer/comm/__init__.py")):
        if isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


def real_class(src: FlashinferSource, path: str, name: str):
    """Execute one class statement of the release (a constants class such as AllReduceFusionPattern)."""
    tree = src.tree(path)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        raise AssertionError(f"flashinfer-python {src.version}: {path} has no class {name}")
    ns: dict = {}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), ns)  # noqa: S102 - release source
    return ns[name]


def pattern_constants(cls) -> Dict[str, int]:
    return {k: v for k, v in vars(cls).items() if k.startswith("k") and isinstance(v, int)}


def signature_diff(real: inspect.Signature, mine: inspect.Signature, what: str) -> List[str]:
    """Differences in parameter names, order, kinds and defaults (annotations are not compared)."""
    r, m = list(real.parameters.values()), list(mine.parameters.values())
    probs = []
    if [p.name for p in r] != [p.name for p in m]:
        probs.append(f"{what}: parameters {[p.name for p in m]} != real {[p.name for p in r]}")
    for rp in r:
        mp = mine.parameters.get(rp.name)
        if mp is None:
            continue
        if mp.kind != rp.kind:
            probs.append(f"{what}: {rp.name} is {mp.kind.name}, real {rp.kind.name}")
        if (rp.default is rp.empty) != (mp.default is mp.empty) or (
                rp.default is not rp.empty and not rp.default == mp.default):
            probs.append(f"{what}: {rp.name} default {mp.default!r} != real {rp.default!r}")
    return probs


# ------------------------------------------------------------------------------ call contract
def compiled_options(create_call, sigs) -> dict:
    """What the real create_allreduce_fusion_workspace compiles for a recorded call: the explicit
    (non-None) keyword-only options, else the workspace constructor's defaults."""
    _, args, kw = create_call
    bound = sigs["create_allreduce_fusion_workspace"].bind(*args, **kw)
    bound.apply_defaults()
    ws_sig = sigs[WORKSPACE]
    out = {}
    for name, p in ws_sig.parameters.items():
        if p.kind is p.KEYWORD_ONLY:
            v = bound.arguments.get(name)
            out[name] = v if v is not None else p.default
    for name in ("world_size", "rank", "max_token_num", "hidden_dim", "dtype"):
        out[name] = bound.arguments[name]
    return out


def check_calls(calls, sigs, *, pattern: int, version: str) -> List[str]:
    """Problems with recorded ``(name, args, kwargs)`` calls (empty = the contract holds).

    Binding: every call binds to the real signature.  Construction: backend mnnvl-cutedsl, the group
    and every keyword-only static option of the real create function passed explicitly.  Probe: asked
    with the values the workspace is compiled with.  Call: the rules of the release's
    ``_mnnvl_cutedsl_allreduce_fusion`` against the compiled options."""
    fi = f"flashinfer-python {version}"
    probs, compiled, probes = [], None, []
    for i, (name, args, kw) in enumerate(calls):
        where = f"call {i} {name}"
        if name not in sigs:
            probs.append(f"{where}: not a function the contract knows")
            continue
        try:
            bound = sigs[name].bind(*args, **kw)
        except TypeError as e:
            probs.append(f"{where}: does not bind to the {fi} signature: {e}")
            continue
        bound.apply_defaults()
        a = bound.arguments
        if name == "create_allreduce_fusion_workspace":
            if a["backend"] != "mnnvl-cutedsl":
                probs.append(f"{where}: backend {a['backend']!r} != 'mnnvl-cutedsl'")
            kwonly = [p for p, v in sigs[name].parameters.items() if v.kind is v.KEYWORD_ONLY]
            missing = [p for p in kwonly if p not in kw]
            if missing:
                probs.append(f"{where}: static options not passed explicitly (the {fi} default would be "
                             f"compiled in): {missing}")
            if "group" not in kw:
                probs.append(f"{where}: group not passed (the workspace would rendezvous over WORLD)")
            for p in ("gpus_per_node", "comm_backend"):
                if a.get(p) is not None:
                    probs.append(f"{where}: {p} passed; backend='mnnvl-cutedsl' rejects it")
            if a.get("force_oneshot_support"):
                probs.append(f"{where}: force_oneshot_support passed; backend='mnnvl-cutedsl' rejects it")
            compiled = compiled_options((name, args, kw), sigs)
            for pa in probes:  # the probe must have been asked about this very workspace
                probs += _probe_vs_compiled(pa, compiled, sigs, where)
        elif name == "is_mnnvl_cutedsl_supported":
            probes.append(dict(a))
        elif name == "allreduce_fusion":
            if compiled is None:
                probs.append(f"{where}: no workspace was created before it")
                continue
            probs += _call_vs_compiled(a, compiled, pattern, where)
        elif name == WORKSPACE:
            pass  # built by create_allreduce_fusion_workspace (checked there)
    if not any(c[0] == "create_allreduce_fusion_workspace" for c in calls):
        probs.append("no create_allreduce_fusion_workspace call was recorded")
    return probs


def _probe_vs_compiled(p: dict, c: dict, sigs, where: str) -> List[str]:
    if (p["tp_size"], p["hidden_dim"]) != (c["world_size"], c["hidden_dim"]):
        return []  # a probe about another shape
    probs = []
    for k, v in (("dtype", c["dtype"]), ("max_token_num", c["max_token_num"])):
        if p[k] != v:
            probs.append(f"{where}: the probe was asked {k}={p[k]!r}, the workspace compiles {v!r}")
    shared = [n for n, q in sigs["is_mnnvl_cutedsl_supported"].parameters.items()
              if q.kind is q.KEYWORD_ONLY and n in c and n != "max_token_num"]
    for n in shared:
        if not p[n] == c[n]:
            probs.append(f"{where}: the probe was asked {n}={p[n]!r}, the workspace compiles {c[n]!r}")
    return probs


def _call_vs_compiled(a: dict, c: dict, pattern: int, where: str) -> List[str]:
    """The checks of ``_mnnvl_cutedsl_allreduce_fusion`` (finalize pattern, bf16 output)."""
    probs = []

    def need(ok, text):
        if not ok:
            probs.append(f"{where}: {text}")

    need(a["pattern"] == pattern, f"pattern {a['pattern']!r} != kMoEFinalizeARResidualRMSNorm ({pattern})")
    for n in ("output", "layout_code", "use_oneshot", "block_quant_group_size", "moe_reduction_scale_input",
              "moe_reduction_active_experts_token_input", "moe_reduction_token_input",
              "moe_reduction_device_num_experts", "quant_out", "scale_out", "scale_factor"):
        need(a.get(n) is None, f"{n} passed; the mnnvl-cutedsl finalize with bf16 output rejects it")
    need(not a["fp32_acc"], "fp32_acc=True; MNNVL CuTe DSL does not support it")
    need(a["moe_finalize_backend"] == "trtllm", "moe_finalize_backend set; it needs a TRT-LLM workspace")
    need(a["rms_eps"] == c["rms_eps"], f"rms_eps {a['rms_eps']!r} != compiled {c['rms_eps']!r}")
    need(a["weight_bias"] == c["weight_bias"], f"weight_bias {a['weight_bias']!r} != compiled {c['weight_bias']!r}")
    need((a["rms_gamma"] is not None) == bool(c["apply_rms_norm"]),
         f"rms_gamma {'missing' if a['rms_gamma'] is None else 'passed'} with apply_rms_norm={c['apply_rms_norm']}")
    need((a["residual_in"] is not None) == bool(c["add_residual"]),
         f"residual_in {'missing' if a['residual_in'] is None else 'passed'} with add_residual={c['add_residual']}")
    need(a["residual_out"] is None or c["write_residual_output"],
         "residual_out passed with write_residual_output=False")
    need((a["shared_expert_output"] is not None) == bool(c["include_shared_expert"]),
         f"shared_expert_output {'missing' if a['shared_expert_output'] is None else 'passed'} with "
         f"include_shared_expert={c['include_shared_expert']}")
    idx, w, x = a["expanded_idx_to_permuted_idx"], a["expert_scale_factor"], a["input"]
    if idx is None or w is None:
        probs.append(f"{where}: expanded_idx_to_permuted_idx and expert_scale_factor are required")
        return probs
    m, K, H = idx.shape[0], c["top_k"], c["hidden_dim"]
    need(1 <= m <= c["max_token_num"], f"{m} tokens outside the workspace capacity 1..{c['max_token_num']}")
    need(idx.dtype == torch.int32 and tuple(idx.shape) == (m, K),
         f"expanded_idx_to_permuted_idx {idx.dtype} {tuple(idx.shape)} != int32 ({m}, {K}) (compiled top_k)")
    need(w.dtype == torch.bfloat16 and tuple(w.shape) == (m, K),
         f"expert_scale_factor {w.dtype} {tuple(w.shape)} != bfloat16 ({m}, {K}) (compiled top_k)")
    need(x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == H,
         f"input {x.dtype} {tuple(x.shape)} != bfloat16 (*, {H}) (compiled hidden_dim)")
    for n in ("norm_out", "residual_out", "residual_in", "shared_expert_output"):
        t = a.get(n)
        if t is not None:
            need(t.dtype == torch.bfloat16 and tuple(t.shape) == (m, H), f"{n} {t.dtype} {tuple(t.shape)} != "
                 f"bfloat16 ({m}, {H})")
    g = a["rms_gamma"]
    if g is not None:
        need(g.dtype == torch.bfloat16 and tuple(g.shape) == (H,), f"rms_gamma {g.dtype} {tuple(g.shape)} != "
             f"bfloat16 ({H},)")
    for n in ("input", "expert_scale_factor", "expanded_idx_to_permuted_idx", "norm_out", "rms_gamma"):
        t = a.get(n)
        if t is not None:
            need(t.is_contiguous(), f"{n} is not contiguous")
    return probs


# ------------------------------------------------------------------- the real Python layer
class FakeGroup:
    """A process-group stand-in: what flashinfer asks of ``group`` (size, rank)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def __repr__(self):
        return f"FakeGroup(rank={self._rank}, size={self._size})"


@dataclass
class Machine:
    """The emulated device: compute capability (None: no CUDA), multicast, the default group."""
    capability: Optional[Tuple[int, int]] = (10, 0)
    multicast: bool = True
    world: object = field(default_factory=lambda: FakeGroup(0, 8))


class _Tuning:
    enable_pdl = True  # the presets' compiled PDL mode (a stub: the real ones mostly enable PDL)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<stub preset {self.name}>"


class _Module(types.ModuleType):
    """A stub module: explicit attributes; unknown ones are placeholder classes (lenient) or errors."""

    def __init__(self, name, attrs=None, *, lenient=True, getattr_fn=None, path=None):
        super().__init__(name)
        self.__dict__.update(attrs or {})
        self._lenient, self._getattr_fn = lenient, getattr_fn
        if path is not None:
            self.__path__ = [str(path)] if path else []

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if self._getattr_fn is not None:
            return self._getattr_fn(self.__name__, attr)
        if not self._lenient:
            raise AttributeError(f"{self.__name__}.{attr} (not stubbed by tests/fi_contract.py)")

        def _unavailable(*a, **k):
            raise RuntimeError(f"{self.__name__}.{attr} is stubbed in the contract test (CUDA-only)")
        cls = type(attr, (), {"__init__": _unavailable, "__call__": _unavailable})
        setattr(self, attr, cls)
        return cls


def _flashinfer_api(func=None, *, trace=None):
    return func if func is not None else (lambda f: f)


class RealLayer:
    """``flashinfer.comm`` of one release, from its own Python files, CUDA leaves stubbed (see module
    docstring).  A context manager: installs the modules under ``flashinfer*`` in ``sys.modules`` and
    restores whatever was there on exit.  ``launches`` records the stub kernel launches,
    ``protocols`` the protocol objects the real workspace constructor built."""

    def __init__(self, src: FlashinferSource, machine: Optional[Machine] = None):
        self.src, self.machine = src, machine or Machine()
        self.launches: List[dict] = []
        self.protocols: List[object] = []
        self._classes: dict = {}
        self._presets: dict = {}

    # stub kernels -----------------------------------------------------------------------
    def _kernel_attr(self, modname, attr):
        letter = {"kernel_ll": "LL", "kernel_bt": "BT", "kernel_ht": "HT"}[modname.split(".")[3]]
        if attr == f"{letter}Protocol":
            return self._protocol_class(letter)
        if re.fullmatch(rf"{letter}(Finalize|AllReduce|Collective)Tuning", attr):
            return self._classes.setdefault(attr, type(attr, (_Tuning,), {}))
        m = re.match(rf"{letter}_(FINALIZE|ALL_REDUCE)_", attr)
        if m:
            cls = self._kernel_attr(modname, f"{letter}{'Finalize' if m.group(1) == 'FINALIZE' else 'AllReduce'}Tuning")
            return self._presets.setdefault(attr, cls(attr))
        raise AttributeError(f"{modname}.{attr}: not a preset, tuning or protocol name the contract stub knows; "
                             f"flashinfer {self.src.version} changed its kernel modules")

    def _protocol_class(self, letter):
        layer = self

        class _Protocol:
            def __init__(self, **kw):
                self.letter, self.kw, self.state = letter, kw, None
                self.finalize_kernels = {t: self._finalize for t in kw["finalize_tunings"]}
                self.all_reduce_kernels = {t: self._unavailable for t in kw["all_reduce_tunings"]}
                layer.protocols.append(self)

            def _unavailable(self, *a, **k):
                raise RuntimeError("the contract stub implements the finalize path only")

            def _finalize(self, routed_output, expert_weights, permuted_indices, shared_output, residual_source,
                          gamma, m, *, state, norm_output=None, residual_output=None, norm_output_bf16=None,
                          output_scale=None):
                """World of one, fp64: finalize (+ shared, + residual), RMSNorm with the compiled options."""
                kw = self.kw
                layer.launches.append(dict(protocol=letter, m=m, routed_output=routed_output,
                                           expert_weights=expert_weights, permuted_indices=permuted_indices,
                                           shared_output=shared_output, residual_source=residual_source,
                                           gamma=gamma, norm_output=norm_output, residual_output=residual_output))
                H = kw["hidden_size"]
                x, idx = routed_output.double(), permuted_indices[:m].long()
                w = expert_weights[:m].double() * kw["routed_scaling_factor"]
                s = torch.zeros(m, H, dtype=torch.float64)
                for k in range(idx.shape[1]):
                    ok = idx[:, k] >= 0
                    s[ok] += w[ok, k:k + 1] * x[idx[ok, k]]
                if kw["include_shared_expert"]:
                    s += shared_output[:m].double()
                if kw["add_residual"]:
                    s += residual_source[:m].double()
                if kw["write_residual_output"]:
                    if residual_output is None:
                        residual_output = torch.empty(m, H, dtype=torch.bfloat16)
                    residual_output.copy_(s)
                if norm_output is None:
                    norm_output = torch.empty(m, H, dtype=torch.bfloat16)
                if kw["apply_rms_norm"]:
                    norm_output.copy_(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + kw["rms_epsilon"])
                                      * (gamma.double() + kw["weight_bias"]))
                return norm_output, residual_output

        _Protocol.__name__ = f"{letter}Protocol"
        return self._classes.setdefault(f"{letter}Protocol", _Protocol)

    # install ----------------------------------------------------------------------------
    def __enter__(self):
        mach = self.machine
        self._saved = {k: v for k, v in sys.modules.items() if k == "flashinfer" or k.startswith("flashinfer.")}
        for k in self._saved:
            del sys.modules[k]
        self._dont_write = sys.dont_write_bytecode
        sys.dont_write_bytecode = True
        try:
            self._install(mach)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _install(self, mach):
        root = self.src.extract() / "flashinfer"

        def put(name, mod):
            sys.modules[name] = mod
            return mod

        put("flashinfer", _Module("flashinfer", {"__version__": self.src.version}, path=root))
        put("flashinfer.api_logging", _Module("flashinfer.api_logging", {"flashinfer_api": _flashinfer_api}))
        put("flashinfer.trace", _Module("flashinfer.trace", path=""))
        put("flashinfer.trace.templates", _Module("flashinfer.trace.templates", path=""))
        put("flashinfer.trace.templates.comm", _Module("flashinfer.trace.templates.comm"))
        put("flashinfer.utils", _Module("flashinfer.utils", {"is_confidential_compute": lambda: False}))
        self.comm = put("flashinfer.comm", _Module("flashinfer.comm", path=root / "comm", lenient=False))
        trt = "flashinfer/comm/trtllm_ar.py"
        put("flashinfer.comm.trtllm_ar", _Module("flashinfer.comm.trtllm_ar", {
            "AllReduceFusionPattern": real_class(self.src, trt, "AllReduceFusionPattern"),
            "QuantizationSFLayout": real_class(self.src, trt, "QuantizationSFLayout")}))
        put("flashinfer.comm.mnnvl", _Module("flashinfer.comm.mnnvl", {
            "is_multicast_supported": lambda index: mach.multicast}))
        for name in ("mapping", "trtllm_mnnvl_ar"):
            put(f"flashinfer.comm.{name}", _Module(f"flashinfer.comm.{name}"))
        for sub in ("kernel_ll", "kernel_bt", "kernel_ht"):
            for full in (f"flashinfer.comm.mnnvl_cutedsl.{sub}", f"flashinfer.comm.mnnvl_cutedsl.{sub}.protocol"):
                put(full, _Module(full, getattr_fn=self._kernel_attr, path="" if full.endswith(sub) else None))
        import importlib
        ar = importlib.import_module("flashinfer.comm.mnnvl_cutedsl_ar")
        self._emulate_device(ar, mach)
        self.cutedsl = ar
        self.allreduce = importlib.import_module("flashinfer.comm.allreduce")
        self.presets = importlib.import_module("flashinfer.comm.mnnvl_cutedsl.presets")
        exported = exported_from_comm(self.src)
        for name in ("create_allreduce_fusion_workspace", "allreduce_fusion", "is_mnnvl_cutedsl_supported",
                     "AllReduceFusionPattern"):
            if name not in exported:
                raise AssertionError(f"flashinfer-python {self.src.version}: flashinfer.comm does not export {name}")
            setattr(self.comm, name, getattr(self.allreduce, name))

    @staticmethod
    def _emulate_device(ar, mach):
        cuda = types.SimpleNamespace(
            is_available=lambda: mach.capability is not None, current_device=lambda: 0,
            get_device_capability=lambda device=None: tuple(mach.capability), synchronize=lambda device=None: None)

        class _Torch:  # torch with an emulated torch.cuda
            def __getattr__(self, name):
                return getattr(torch, name)
        tp = _Torch()
        tp.cuda = cuda
        groups = types.SimpleNamespace(WORLD=mach.world)
        ar.torch = tp
        ar.dist = types.SimpleNamespace(is_initialized=lambda: True, group=groups,
                                        get_world_size=lambda g=None: (g or mach.world).size(),
                                        get_rank=lambda g=None: (g or mach.world).rank(),
                                        barrier=lambda group=None: None)
        ar.symm_mem = types.SimpleNamespace(get_backend=lambda device: "NVSHMEM" if mach.capability else None)
        ar.is_multicast_supported = lambda index: mach.multicast
        real_check = ar._check_tensor

        def _check_tensor(tensor, name, **kw):  # the emulated GPU's memory is the host's
            dev = kw.get("device")
            if dev is not None and dev.type == "cuda" and tensor.device.type == "cpu":
                kw["device"] = tensor.device
            return real_check(tensor, name, **kw)
        ar._check_tensor = _check_tensor

    def __exit__(self, *exc):
        for k in [k for k in sys.modules if k == "flashinfer" or k.startswith("flashinfer.")]:
            del sys.modules[k]
        sys.modules.update(self._saved)
        sys.dont_write_bytecode = self._dont_write
        return False

    def profiles(self, config_name: str) -> dict:
        """``{(tp, hidden, top_k, dtype, compute capability): largest routed M or None}`` of a config."""
        cfg = getattr(self.presets, config_name)
        out = {}
        for p in cfg.profiles:
            bounds = [r.finite_upper_bound for r in (p.finalize_routes, p.all_reduce_routes)]
            finite = [b for b in bounds if b is not None]
            cc = tuple(p.compute_capability) if p.compute_capability is not None else None
            out[(p.tp_size, p.hidden_size, p.top_k, p.dtype, cc)] = min(finite) if finite else None
        return out


if __name__ == "__main__":
    s = FlashinferSource(obtain_wheel())
    print(f"flashinfer-python {s.version} ({s.wheel})")
    for k, v in real_signatures(s).items():
        print(f"\n{k}{v}")
