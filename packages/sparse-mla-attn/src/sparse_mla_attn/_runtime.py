"""Runtime helpers shared by every op: interpreter check, device queries, host-side integer helpers,
custom-op registration, the launch of compiled kernels through cached handles, and the registry of the
latest kernel launch per op (read by the benchmarks and the GPU tests).

Host cost: an op validates its inputs and makes its launch plan once per call signature
(:func:`call_signature`: shapes, strides, dtypes, devices and 16-byte alignment of its tensors, plus its
non-float arguments); later calls launch each kernel through the compiled handle kept in that plan
(:func:`launch`) and the decode reuses its scratch buffers (:func:`scratch`), so a repeated call does no
validation, no Triton argument binding and no device-to-host synchronisation."""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

F = TypeVar("F", bound=Callable[..., Any])

#: Entries kept per signature cache (validated launch plans) before it is cleared.
CACHE_LIMIT = 4096

#: Every launch's enable_fp_fusion: FMA as tuned and tested, independent of Triton's default (off in 3.10).
ENABLE_FP_FUSION = True


def _triton_interprets() -> bool:
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # Triton without knobs: the variable as Triton reads it
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Triton decides when a kernel is defined (at import) whether it is interpreted, so that decision is the one
# that counts for this package's kernels; a later change of TRITON_INTERPRET does not affect them.
_INTERPRETING = _triton_interprets()
#: Whether the kernels run under the interpreter, as a constant the kernels can read.
INTERPRETER = tl.constexpr(_INTERPRETING)


def interpreting() -> bool:
    """True when this package's kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` set when
    the package was imported, as Triton reads it)."""
    return _INTERPRETING


@triton.jit
def mask_and(block_mask, scalar):
    """``block_mask & scalar`` for a block mask and a scalar condition. The interpreter of Triton 3.9
    rejects that ``&`` as a load / store mask ("mask has unsupported dtype"), so it gets the same mask
    through ``tl.where``; compiled kernels keep the ``&``."""
    if INTERPRETER:
        return tl.where(scalar, block_mask, False)
    else:
        return block_mask & scalar


@triton.jit
def dot(a, b, acc=None):
    """``tl.dot(a, b, acc)``; under the interpreter, whose bf16 products are wrong (numpy has no bf16), the
    operands are multiplied in float32."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def online_softmax_update(s, m_i, l_i):
    """One block of the online softmax in base 2, on scores ``s`` [rows, cols] already scaled to base 2 and
    masked (``-inf``): returns the new row maxima, the factor ``alpha`` that rescales the earlier row sums and
    accumulator, the new row sums and P (float32). A row with no finite score yet keeps P = 0. Shared by
    the Triton and the Gluon (sm_90) kernels."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return m_new, alpha, l_i * alpha + tl.sum(p, 1), p


@triton.jit
def softmax_output_scale(m_i, l_i, SINK, offs, mask, ADD_SINK: tl.constexpr):
    """The end of an online softmax (base 2) over rows with maxima ``m_i`` and sums ``l_i``: returns the
    maxima with ``-inf`` as 0, whether a row saw any valid score, and the factor ``1 / (l + e^(sink - m))``
    that normalises its accumulator (0 for a row without a valid score); the sink (natural-log units, at
    ``SINK + offs``) only with ``ADD_SINK``. Shared by the Triton and the Gluon (sm_90) forward."""
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    denom = l_i
    if ADD_SINK:
        sink = tl.load(SINK + offs, mask=mask, other=0.0)
        denom = denom + tl.exp2(sink * 1.4426950408889634 - m_use)
    has_any = l_i > 0.0
    scale = tl.where(has_any, 1.0 / tl.where(has_any, denom, 1.0), 0.0)
    return m_use, has_any, scale


@triton.jit
def causal_max_k(q_pos, k_stride):
    """Largest KV index visible from query position ``q_pos >= 0`` under the causal rule:
    ``(q_pos + 1 - k_stride) / k_stride`` with C truncation, i.e. 0 while the numerator is negative
    (:func:`sparse_mla_attn._validate.causal_limit` on the host)."""
    return tl.maximum(q_pos + 1 - k_stride, 0) // k_stride


@triton.jit
def causal_hi(s_kv, q_pos, k_stride, CAUSAL: tl.constexpr):
    """Exclusive upper bound of the valid KV indices of the query at ``q_pos``: ``s_kv``, and with
    ``CAUSAL`` at most :func:`causal_max_k` ``+ 1``."""
    hi = s_kv
    if CAUSAL:
        hi = tl.minimum(hi, causal_max_k(q_pos, k_stride) + 1)
    return hi


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` costs a microsecond per call on the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``), for host integers."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def call_signature(*tensors: torch.Tensor | None) -> tuple[Any, ...]:
    """What validation and kernel specialisation depend on for these tensors: shape, strides, dtype,
    device and whether the data pointer is 16-byte aligned (``None`` stays ``None``)."""
    return tuple(
        [
            None if t is None else (t.shape, t.stride(), t.dtype, t.device, not t.data_ptr() % 16)
            for t in tensors
        ]
    )


def cached(cache: dict[Any, Any], key: Any, compute: Callable[[], Any]) -> Any:
    """``cache[key]``, computed by ``compute()`` on a miss (an exception is raised and not cached)."""
    value = cache.get(key)
    if value is None:
        value = compute()
        if len(cache) >= CACHE_LIMIT:
            cache.clear()
        cache[key] = value
    return value


@functools.lru_cache(maxsize=1)
def _driver() -> Any:
    from triton.runtime.driver import driver

    return driver.active


class LaunchContext(NamedTuple):
    """Where a call's kernels go, read once per call: the current CUDA device (as Triton's launches read
    it), its current stream (the raw handle) and whether that stream is capturing a CUDA graph."""

    device: int
    stream: Any
    capturing: bool


def launch_context(device: torch.device) -> LaunchContext | None:
    """The :class:`LaunchContext` of a call on tensors of ``device``; ``None`` off CUDA and under the
    interpreter."""
    if device.type != "cuda" or _INTERPRETING:
        return None
    driver = _driver()
    index = driver.get_current_device()
    return LaunchContext(index, driver.get_current_stream(index), torch.cuda.is_current_stream_capturing())


def launch(
    fn: Any, grid: tuple[int, ...], slots: dict[Any, Any] | None, name: Any, args: tuple[Any, ...],
    consts: dict[str, Any] | Callable[[], dict[str, Any]], ctx: LaunchContext | None = None,
) -> Any:  # fmt: skip
    """``fn[grid](*args, **consts, enable_fp_fusion=ENABLE_FP_FUSION)``, after its first launch through the
    compiled kernel kept in ``slots`` (``consts`` may be a function that returns them, called only where
    they are read: on Triton's launch path).

    ``slots`` belongs to a launch plan made for one call signature, and ``name`` names the launch within
    it: together they must determine everything Triton specialises the launch on (the dtype and 16-byte
    alignment of each tensor argument, the value class of each integer, the constexprs ``consts``), so the
    kernel compiled at the first launch serves every later one. The handle is kept per current device,
    as Triton keeps its kernels. ``slots=None`` (or the interpreter) always takes Triton's launch path.
    ``ctx``: the call's :func:`launch_context` (else read here). Returns the compiled kernel (``None``
    under the interpreter).
    """
    recording = getattr(_RECORDING, "records", None)
    if slots is None or _INTERPRETING:
        if recording is not None:
            recording.append(None)  # not replayable
        if callable(consts):
            consts = consts()
        return fn[grid](*args, **consts, enable_fp_fusion=ENABLE_FP_FUSION)
    # (No device query before the first compile: a CPU-only process may trace launches without a driver.)
    device = ctx.device if ctx is not None else _driver().get_current_device() if slots else None
    hit = slots.get((name, device)) if slots else None
    if hit is None:
        if recording is not None:
            recording.append(None)
        if callable(consts):
            consts = consts()
        kernel = fn[grid](*args, **consts, enable_fp_fusion=ENABLE_FP_FUSION)
        if kernel is not None and hasattr(kernel, "packed_metadata"):
            # The launcher takes every parameter in order: the positional ones, then the constexprs.
            tail = tuple(consts.get(p.name, p.default) for p in fn.params[len(args) :])
            slots[(name, _driver().get_current_device())] = (kernel, tail)
        return kernel
    kernel, tail = hit
    stream = ctx.stream if ctx is not None else _driver().get_current_stream(device)
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    # As Triton's own launch does: the launch hooks (profilers) see these launches too; without any, the
    # launcher gets None (no metadata built, no empty hook chain called).
    if no_launch_hooks():
        kernel.run(*grid3, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)
    else:
        hooks = triton.knobs.runtime
        enter = hooks.launch_enter_hook
        meta = kernel.launch_metadata(grid3, stream, *args, *tail)
        kernel.run(*grid3, stream, kernel.function, kernel.packed_metadata, meta, enter, hooks.launch_exit_hook,
                   *args, *tail)  # fmt: skip
    if recording is not None:
        recording.append((kernel, grid3, (*args, *tail)))
    return kernel


# This thread's list of launches while a call's launches are recorded (``records``; LaunchReplay).
_RECORDING = threading.local()


def no_launch_hooks() -> bool:
    """True when no Triton launch hook (a profiler's) is set, as ``None`` or an empty hook chain (Triton
    3.6 keeps chains): launches may then bypass Triton's launch path and its hook calls."""
    hooks = triton.knobs.runtime
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    return (enter is None or getattr(enter, "calls", None) == []) and (
        leave is None or getattr(leave, "calls", None) == []
    )


class LaunchReplay:
    """The kernel launches of one eager call, bound to its stream and replayed by later calls of the same
    launch plan on the same device, stream and thread: one generated function (``run``) passes each
    launch straight to the compiled kernel's C launcher with the recorded arguments, in which the call's
    own tensors (``per_call``, by position) become their data pointers and the scale argument the call's
    scale; every other tensor (scratch buffers reused by those calls) is kept alive here and passed as its
    recorded data pointer, and grids, stream, integers and constexprs are constants of the function (the
    launch registry's entry too: ``launch``). Made by :meth:`bind` from :func:`record_launches`."""

    __slots__ = ("keep", "run")

    def __init__(self, run: Callable[..., None], keep: list[torch.Tensor]) -> None:
        #: ``run(*data pointers of per_call, scale)``: the launches, in order.
        self.run = run
        self.keep = keep

    @classmethod
    def bind(
        cls, records: list[Any], per_call: tuple[torch.Tensor | None, ...], scale: float, stream: Any,
        launch: tuple[str, Launch] | None,
    ) -> LaunchReplay | None:  # fmt: skip
        """The replay of ``records`` (from :func:`record_launches`) on ``stream``, in which a float argument
        equal to ``scale`` (the recorded call's scale) becomes the later call's; ``None`` when two of
        ``per_call`` are one tensor (a later call could pass them apart), a launch got a view of one of
        them (its data pointer would not follow the later call's tensor) or two float arguments of one
        launch equal ``scale`` (which of them is the scale would be a guess)."""
        ids = [id(t) for t in per_call if t is not None]
        if len(set(ids)) != len(ids):
            return None
        storages = {t.untyped_storage().data_ptr() for t in per_call if t is not None}
        for _, _, args in records:
            if sum(type(a) is float and a == scale for a in args) > 1:
                return None
            for a in args:
                if (isinstance(a, torch.Tensor) and all(a is not t for t in per_call)
                        and a.untyped_storage().data_ptr() in storages):  # fmt: skip
                    return None
        consts: dict[str, Any] = {"_stream": stream}
        keep: list[torch.Tensor] = []
        lines = []
        for k, (kernel, grid3, args) in enumerate(records):
            call_args = []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    src = next((j for j, t in enumerate(per_call) if t is a), -1)
                    if src < 0:
                        keep.append(a)
                        call_args.append(str(a.data_ptr()))
                    else:
                        call_args.append(f"p{src}")
                elif type(a) is float and a == scale:
                    call_args.append("scale")
                elif a is None or type(a) in (int, bool):
                    call_args.append(repr(a))
                else:
                    consts[f"_c{k}_{i}"] = a
                    call_args.append(f"_c{k}_{i}")
            run, grid = kernel.run, ", ".join(str(int(g)) for g in grid3)
            consts[f"_f{k}"], consts[f"_m{k}"] = kernel.function, kernel.packed_metadata
            # Triton's CUDA launcher object: its C function directly, when it allocates no scratch itself
            # (and no sanitizer wraps the launch), in the argument order of the installed Triton.
            direct = (
                type(run).__name__ == "CudaLauncher"
                and getattr(run, "global_scratch_size", 1) == 0
                and getattr(run, "profile_scratch_size", 1) == 0
                and not getattr(run, "gsan_enabled", False)
            )
            args_list = ", ".join(call_args)
            if not direct:
                consts[f"_l{k}"] = run
                call = f"_l{k}({grid}, _stream, _f{k}, _m{k}, None, None, None, {args_list})"
            else:
                consts[f"_l{k}"] = run.launch
                consts[f"_coop{k}"], consts[f"_pdl{k}"] = run.launch_cooperative_grid, run.launch_pdl
                head = f"_l{k}({grid}, _stream, _f{k}, _coop{k}, _pdl{k}"
                if hasattr(run, "kernel_signature"):  # Triton 3.7 and later
                    consts[f"_a{k}"], consts[f"_s{k}"] = run.arg_annotations, run.kernel_signature
                    # (metadata, no launch metadata or hooks, no scratch, the arguments' annotations and
                    # signature, the arguments as one tuple)
                    call = f"{head}, _m{k}, None, None, None, None, None, _a{k}, _s{k}, ({args_list},))"
                else:  # Triton 3.6: no scratch, metadata, no launch metadata or hooks, the arguments
                    call = f"{head}, None, None, _m{k}, None, None, None, {args_list})"
            lines.append(f"    {call}")
        if launch is not None:  # each replay is the op's latest launch (record_launch)
            consts["_launches"], consts["_name"], consts["_launch"] = _LAUNCHES, *launch
            lines.append("    _launches[_name] = _launch")
        params = ", ".join(f"p{j}" for j in range(len(per_call)))
        source = f"def run({params}, scale):\n" + "\n".join(lines) + "\n"
        exec(compile(source, "<sparse_mla_attn launch replay>", "exec"), consts)
        return cls(consts["run"], keep)


def plan_replay(plan: Any, where: tuple[int, Any], sm_scale: float) -> LaunchReplay | None:
    """The replay a repeated eager call of the launch plan ``plan`` (``None``: none is made for its
    signature) takes on ``where`` (:func:`eager_stream`) in this thread: the launches the plan recorded
    there (``plan.replays``), if any, and ``sm_scale`` finite (else the op's checks run)."""
    if plan is None:
        return None
    replay: LaunchReplay | None = plan.replays.get((*where, threading.get_ident()))
    return replay if replay is not None and math.isfinite(sm_scale) else None


def eager_stream(t: torch.Tensor) -> tuple[int, Any] | None:
    """``(current device, its current raw stream)`` when a call on ``t`` may take a replayed eager launch
    (:class:`LaunchReplay`): ``t`` a CUDA tensor, nothing traced (``torch.compile``, dispatch modes), the
    current stream not capturing a CUDA graph and no launch hook set; else ``None``. Read straight from
    torch's C queries (CUDA is initialised once a CUDA tensor exists)."""
    if (
        not t.is_cuda
        or _INTERPRETING
        or torch.compiler.is_compiling()
        or _dispatch_modes()  # (the stack _current_dispatch_mode reads)
        or _is_capturing()
        or not no_launch_hooks()
    ):
        return None
    device = _current_device()
    return device, _current_raw_stream(device)


_current_device = (
    torch._C._cuda_getDevice if hasattr(torch._C, "_cuda_getDevice") else torch.cuda.current_device
)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
_current_raw_stream = getattr(
    torch._C, "_cuda_getCurrentRawStream", lambda device: torch.cuda.current_stream(device).cuda_stream
)


def record_launches(call: Callable[[], Any]) -> tuple[Any, list[Any] | None]:
    """``call()``, and the launches it made through cached handles (``None`` if one went through Triton's
    launch path, e.g. a first compile, or none was made)."""
    records: list[Any] = []
    outer = getattr(_RECORDING, "records", None)
    _RECORDING.records = records
    try:
        result = call()
    finally:
        _RECORDING.records = outer
    return result, (records if records and None not in records else None)


#: Replays kept per launch plan (one per device, stream and thread); all are dropped past this many.
REPLAY_LIMIT = 16


def keep_replay(
    replays: dict[Any, LaunchReplay],
    records: list[Any] | None,
    per_call: tuple[torch.Tensor | None, ...],
    scale: float,
    ctx: LaunchContext,
    name: str = "fwd",
) -> None:
    """Binds the launches ``records`` of one eager call (:func:`record_launches`) into a :class:`LaunchReplay`
    kept in a launch plan's ``replays`` for this device, stream and thread, unless one is kept already or
    the launches cannot be replayed. Each replay makes the call's latest launch under ``name``
    (:func:`record_launch`) the latest again."""
    key = (ctx.device, ctx.stream, threading.get_ident())
    if records is None or key in replays:
        return
    if len(replays) >= REPLAY_LIMIT:
        replays.clear()
    launch = last_launch(name)
    replay = LaunchReplay.bind(
        records, per_call, scale, ctx.stream, None if launch is None else (name, launch)
    )
    if replay is not None:
        replays[key] = replay


#: Scratch buffer sets kept for reuse (one per launch plan, stream and thread), the most recent ones.
SCRATCH_LIMIT = 32
_SCRATCH: dict[Any, tuple[Any, tuple[torch.Tensor, ...]]] = {}


def scratch(
    owner: object, ctx: LaunchContext | None, make: Callable[[], tuple[torch.Tensor, ...]]
) -> tuple[torch.Tensor, ...]:
    """Scratch buffers of the launch plan ``owner`` for a call whose :func:`launch_context` is ``ctx``,
    reused by its calls on one stream and thread (work queued on one stream runs in order, so a call's
    kernels are done with the buffers before the next call's start); up to ``SCRATCH_LIMIT`` sets are
    kept. Fresh ones (``make()``) off CUDA (``ctx`` is ``None``) and while a CUDA graph is captured, whose
    memory belongs to the graph."""
    if ctx is None or ctx.capturing:
        return make()
    key = (id(owner), ctx.stream, threading.get_ident())
    hit = _SCRATCH.get(key)
    if hit is not None and hit[0] is owner:
        return hit[1]
    if len(_SCRATCH) >= SCRATCH_LIMIT:
        del _SCRATCH[next(iter(_SCRATCH))]  # the oldest set
    buffers = make()
    _SCRATCH[key] = (owner, buffers)  # the owner stays alive with its entry, so its id is not reused
    return buffers


def check_kernel_device(t: torch.Tensor, what: str) -> None:
    """Raise ValueError unless ``t`` can feed a kernel: a CUDA tensor, or a CPU tensor under the interpreter."""
    if not (t.is_cuda or (interpreting() and t.device.type == "cpu")):
        raise ValueError(
            f"{what}: the Triton kernel needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
            f"got device {t.device}; use the sparse_mla_attn.reference functions on other devices"
        )


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (0 for any other device)."""
    return _num_sms(_device_index(device)) if device.type == "cuda" else 0


@functools.lru_cache(maxsize=16)
def _l2_bytes(device_index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0))


def l2_cache_bytes(device: torch.device) -> int:
    """L2 cache size of a CUDA device in bytes (0 for any other device)."""
    return _l2_bytes(_device_index(device)) if device.type == "cuda" else 0


@functools.lru_cache(maxsize=16)
def _capability(device_index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device_index))  # type: ignore[return-value]


def is_sm90(device: torch.device) -> bool:
    """True for a CUDA device of compute capability 9.0 (H100, H200)."""
    return device.type == "cuda" and _capability(_device_index(device)) == (9, 0)


class Launch(NamedTuple):
    """What the latest launch of an op ran: its compiled kernel (``None`` under the interpreter), the kernel
    family (``"gluon"`` or ``"triton"``), the split-K factor (forward and decode) and, with split-K, who
    merged the partials (``"last_program"`` or ``"kernel"``, as ``Config.split_merge``)."""

    kernel: Any
    backend: str = "triton"
    splits: int = 1
    merge: str | None = None


_LAUNCHES: dict[str, Launch] = {}


def record_launch(
    name: str, kernel: Any, *, backend: str = "triton", splits: int = 1, merge: str | None = None
) -> None:
    """Remember the latest launch of kernel ``name`` (e.g. ``"fwd"``, ``"attn_dist"``, ``"bwd.main"``)."""
    _LAUNCHES[name] = Launch(kernel, backend, splits, merge)


def last_launch(name: str) -> Launch | None:
    """The latest launch recorded under ``name`` in this process, if any."""
    return _LAUNCHES.get(name)


def launches() -> dict[str, Launch]:
    """All launches recorded in this process, by name."""
    return dict(_LAUNCHES)


def _runs_directly(args: tuple[Any, ...]) -> bool:
    """Whether an op call may skip the dispatcher: plain eager tensors, not traced, not recorded by
    autograd (the custom op has no autograd formula), no dispatch mode active."""
    # (is_compiling first: Dynamo cannot trace the dispatch-mode query.)
    if torch.compiler.is_compiling() or _current_dispatch_mode() is not None:
        return False
    grad = torch.is_grad_enabled()
    for a in args:
        if type(a) is torch.Tensor:
            if a.is_meta or (grad and a.requires_grad):
                return False
        elif isinstance(a, torch.Tensor):  # a subclass
            return False
    return True


def define_op(
    name: str,
    fake: Callable[..., Any],
    *,
    backward: Callable[..., Any] | None = None,
    setup_context: Callable[..., Any] | None = None,
) -> Callable[[F], F]:
    """Register the decorated function as the custom op ``sparse_mla_attn::<name>`` with its fake (meta)
    implementation ``fake`` (which receives the op's arguments and returns empty outputs) and, if given,
    its autograd formula (``backward`` and ``setup_context``, as ``torch.library.register_autograd``).

    Returns a function with the op's arguments that runs the implementation directly on plain eager
    tensors (the dispatcher would only forward the call to it) and goes through
    ``torch.ops.sparse_mla_attn.<name>`` everywhere else: under ``torch.compile``, fake or meta tensors,
    dispatch modes, and inputs that require grad."""

    def register(fn: F) -> F:
        op = torch.library.custom_op(f"sparse_mla_attn::{name}", mutates_args=())(fn)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        dispatched = getattr(torch.ops.sparse_mla_attn, name).default

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            return fn(*args) if _runs_directly(args) else dispatched(*args)

        return call  # type: ignore[return-value]

    return register
