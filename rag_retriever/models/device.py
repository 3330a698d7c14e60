"""Device and precision choice shared by the encoder, the reranker and the trainers.

`auto` means: CUDA with fp16 when a GPU is present; otherwise the CPU, with bf16 autocast when
the CPU has native bf16 instructions (AVX512-BF16 / AMX; emulated bf16 is slower than fp32),
else fp32. Explicit choices are honoured or refused with a clear error, never swapped silently.

For inference, a CUDA model holds its weights in the chosen half precision (`for_inference`):
autocast over fp32 weights would cast every weight again on every forward pass. On the CPU under
bf16 autocast only the linear layers hold bf16 weights, packed once for oneDNN
(`linear.bf16_linear_layers`): autocast would cast them to bf16 on every pass, and oneDNN reorder
them on every call (a 10-token query's encoding took 9.1 ms, 18.1 ms of CPU on 2 cores, with
both; without the casts 5.7 ms and 11.3 ms). The whole model in bf16 encoded
1.3-1.5x faster (137-170 vs 94-122 SQuAD chunks/s, 2 cores with AVX512-BF16), but layer norms and
the residual stream then run in bf16 too: SciFact's dense nDCG@10 fell 0.0018 and recall@10
0.0037, outside the README tables' +-0.0005 (README "GPU and CPU speed"). A model that is
trained next keeps fp32 weights (`half_weights=False`); training runs under autocast
(`Precision.autocast`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch

from rag_retriever.errors import ConfigError
from rag_retriever.models.attention import one_pass, use_cpu_attention
from rag_retriever.models.linear import bf16_linear_layers
from rag_retriever.settings import default_of


@dataclass(frozen=True)
class Precision:
    device: torch.device
    dtype: str  # "fp32" | "bf16" | "fp16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Autocast for the forward pass; a no-op in fp32."""
        if self.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.torch_dtype)

    def describe(self) -> str:
        return f"{self.device.type}/{self.dtype}"


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - older or unusual builds
        return False


def choose_precision(
    device: str = default_of("device"), dtype: str = default_of("dtype")
) -> Precision:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("RAG_DEVICE=cuda but torch sees no CUDA device; set RAG_DEVICE=cpu")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"RAG_DEVICE must be auto, cpu or cuda; got {device!r}")
    if dtype == "auto":
        if device == "cuda":
            dtype = "fp16"
        else:
            dtype = "bf16" if cpu_has_native_bf16() else "fp32"
    if dtype == "fp16" and device == "cpu":
        raise ConfigError("fp16 is only supported on CUDA; use RAG_DTYPE=bf16 or fp32 on the CPU")
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"RAG_DTYPE must be auto, fp32, bf16 or fp16; got {dtype!r}")
    return Precision(torch.device(device), dtype)


# Texts per encoder forward pass when RAG_EMBED_BATCH_SIZE=auto. CPU: 32 measured fastest on
# 2 cores (64 was slower: more padding per batch, no more parallelism to gain). CUDA: a batch of
# 32 leaves a large GPU mostly idle per launch; 256 short chunks of MiniLM take well under 1 GiB
# of activations, and an out-of-memory halves the batch anyway (encoder.py).
AUTO_BATCH_SIZE = {"cpu": 32, "cuda": 256}
# (question, chunk) pairs per cross-encoder forward pass when RAG_RERANK_BATCH_SIZE=auto. CPU: 32
# (DESIGN.md: batches of at least 32). CUDA: 100 pairs in one pass took 11.9 ms at p50 on an
# H200 against 21.0 ms in batches of 32 (README, "GPU and CPU speed").
AUTO_RERANK_BATCH_SIZE = {"cpu": 32, "cuda": 128}


def batch_size_for(
    device: torch.device, setting: int | str, auto: dict[str, int] = AUTO_BATCH_SIZE
) -> int:
    """A batch size: `setting` itself, or for `auto` the device's entry in `auto`."""
    if setting == "auto":
        return auto[device.type]
    if not isinstance(setting, int) or setting <= 0:
        raise ConfigError(f"batch size must be a positive integer or auto; got {setting!r}")
    return setting


def holds_half_weights(precision: Precision) -> bool:
    """Whether an inference model keeps its weights in `precision.dtype` (CUDA, fp16 or bf16)."""
    return precision.device.type == "cuda" and precision.dtype != "fp32"


def for_inference(
    model: torch.nn.Module, precision: Precision, *, half_weights: bool = True
) -> torch.nn.Module:
    """`model` on the precision's device, in eval mode, its weights in half precision where
    `holds_half_weights` (`half_weights=False`: left in fp32, for a model that is trained next);
    on the CPU with `grouped_attention` (attention.py), which only inference uses."""
    model = model.to(precision.device)
    if precision.device.type == "cpu":
        use_cpu_attention(model)
    if half_weights and holds_half_weights(precision):
        model = model.to(precision.torch_dtype)
    elif half_weights and precision.dtype == "bf16":
        # On the compute thread, where the passes will run: the cast's parallel kernels here
        # would give the loading thread an OpenMP team of its own, and every pass on the compute
        # thread then ran 1.6x slower (77 vs 124 SQuAD chunks/s on 2 cores; ComputeThread).
        COMPUTE.run(lambda: bf16_linear_layers(model))
    return model.eval()


@contextlib.contextmanager
def inference(precision: Precision, model: torch.nn.Module | None = None) -> Iterator[None]:
    """No gradients, and autocast unless all of `model`'s weights are already in the target
    dtype (some of them are, on the CPU: `bf16_linear_layers`)."""
    # on every pass: stops at the first weight of another dtype (a CPU model's embeddings)
    dtypes = iter(()) if model is None else (p.dtype for p in model.parameters())
    held = next(dtypes, None) == precision.torch_dtype and all(
        dtype == precision.torch_dtype for dtype in dtypes
    )
    cast = contextlib.nullcontext() if held else precision.autocast()
    with torch.inference_mode(), cast:
        yield


T = TypeVar("T")

# How long the compute thread waits for work before it ends (a later pass starts another).
COMPUTE_IDLE_S = 1.0
# Priorities of the compute thread's passes: the lower runs first.
URGENT = 0  # a query waits for it
BACKGROUND = 1  # passages being embedded for a write


class ComputeThread:
    """One thread for every CPU forward pass of the process, whichever thread asks.

    PyTorch's CPU kernels run on OpenMP (libgomp), and each thread that runs them keeps its own
    team of worker threads for as long as it lives. Once the teams' threads outnumber the cores,
    libgomp stops spin-waiting between parallel regions in every team and sleeps instead, and each
    of the many small regions of a forward pass pays a wake-up: on 2 cores, a query's encoding
    took 18 ms instead of 9 ms for as long as a second long-lived thread (the HTTP service's
    write committer, which embeds the passages of each edit every few seconds) had run one
    (docs/benchmarks.md, "The brief under load"). With every pass on one thread there is one
    team. The trainers' entry points (`training_thread`) run the passes they ask for on their
    own thread instead, where their training steps run; the thread ends after COMPUTE_IDLE_S
    without work, so it does not outlive a burst. CUDA passes are not routed (the device, not
    OpenMP, runs them).

    Waiting passes run by priority, then in order: a query's pass (`URGENT`) goes before the
    queued batches of passages an edit is embedding (`BACKGROUND`), so on a busy service a
    query waits for at most the one batch already running, not for the whole edit."""

    def __init__(self, idle_s: float = COMPUTE_IDLE_S) -> None:
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._tasks: queue.PriorityQueue[tuple[int, int, Future[Any], Callable[[], Any]]] = (
            queue.PriorityQueue()
        )
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._local = threading.local()
        self._stopping = False
        self.started = 0  # threads started so far (tests read it)

    @contextlib.contextmanager
    def inline(self) -> Iterator[None]:
        """Within: the passes this thread asks for run here. For a trainer, whose own steps run
        on its thread anyway: its evaluations there too keep the process at one team."""
        depth = getattr(self._local, "inline", 0)
        self._local.inline = depth + 1
        try:
            yield
        finally:
            self._local.inline = depth

    def run(self, fn: Callable[[], T], priority: int = URGENT) -> T:
        """`fn()` on the compute thread (here, when called from it or within `inline`); its
        exception raised here."""
        inline = getattr(self._local, "inline", 0) > 0
        if inline or threading.current_thread() is self._thread:
            return fn()
        future: Future[T] = Future()
        with self._lock:
            if self._stopping:
                raise RuntimeError("the process is stopping: no forward pass is started")
            self._tasks.put((priority, next(self._order), future, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="rag-compute", daemon=True)
                self.started += 1
                self._thread.start()
        return future.result()

    def stop(self, timeout: float = 60.0) -> None:
        """Cancel the waiting passes, let the running one finish, end the thread (the process's
        exit: a forward pass still running while the interpreter tears down aborts the process,
        exit status 134, after a Ctrl-C or SIGTERM has ended the wait for it)."""
        with self._lock:
            self._stopping = True
            thread = self._thread
            while True:
                try:
                    _, _, future, _ = self._tasks.get_nowait()
                except queue.Empty:
                    break
                future.cancel()
            if thread is not None:  # wakes it now, not after COMPUTE_IDLE_S
                self._tasks.put((-1, next(self._order), Future(), _end_loop))
        if thread is not None:
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            try:
                _, _, future, fn = self._tasks.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:  # a caller puts its task and checks the thread under the lock
                    if self._tasks.empty():
                        self._thread = None
                        return
                continue
            if fn is _end_loop:
                with self._lock:
                    self._thread = None
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # raised again in the caller
                future.set_exception(exc)


def _end_loop() -> None:
    """The task `ComputeThread.stop` queues: the loop ends when it reaches it."""


COMPUTE = ComputeThread()
atexit.register(COMPUTE.stop)

P = ParamSpec("P")


def training_thread(fn: Callable[P, T]) -> Callable[P, T]:
    """`fn` with every forward pass it asks for run in its own thread (`ComputeThread.inline`):
    the trainers' entry points, whose training steps run there."""

    @functools.wraps(fn)
    def inline(*args: P.args, **kwargs: P.kwargs) -> T:
        with COMPUTE.inline():
            return fn(*args, **kwargs)

    return inline


# A CPU pass over at most this many tokens (rows x padded length) runs on one OpenMP thread.
# On 2 cores (all-MiniLM-L6-v2, bf16) a second thread made a 10-token query 5.4 instead of 6.8 ms
# but cost 10.7 ms of CPU instead of 6.8 (it spins between the pass's many small kernels); 8
# queries (152 tokens) 9.9 vs 13.1 ms for 19.7 vs 13.1 ms of CPU; 32 chunks (8,192 tokens) 441
# vs 760 ms for 878 vs 759 ms of CPU. A service's passes are mostly small ones, many at once.
SMALL_PASS_TOKENS = 256


@contextlib.contextmanager
def threads_for(tokens: int | None) -> Iterator[None]:
    """Within: one intra-op thread when `tokens` (a pass's size) is at most SMALL_PASS_TOKENS,
    else the process's setting; the setting is put back after."""
    threads = torch.get_num_threads()
    if tokens is None or tokens > SMALL_PASS_TOKENS or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def forward(
    precision: Precision,
    model: torch.nn.Module,
    fn: Callable[[], T],
    priority: int = URGENT,
    *,
    tokens: int | None = None,
) -> T:
    """`fn()` (a forward pass of `model`, over `tokens` padded tokens when known) under
    `inference(precision, model)`: on the CPU on the process's compute thread (`ComputeThread`,
    at `priority`; a small pass on one thread, `threads_for`), elsewhere in this thread."""

    if precision.device.type != "cpu":
        with inference(precision, model):
            return fn()

    def run() -> T:
        with inference(precision, model), threads_for(tokens), one_pass():
            return fn()

    return COMPUTE.run(run, priority)
