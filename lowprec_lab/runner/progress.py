"""An ablation's one progress display: an overall line (runs done of the total, elapsed time, an estimate of the time
left) and one bar per worker (its run's recipe and seed, steps done, loss, tokens/s), each on its own terminal line,
with every line the ablation prints (a run's result, a worker's warning) above them.

The bars are drawn by the ablation's process alone (``rich.progress``). A worker process draws nothing: its training
loop reports each step (``lowprec.train.meter.step_bar``) and its Python-level stdout/stderr lines through a pipe of
its own (``WorkerChannel``), which a thread of the ablation drains. Two processes each redrawing a tqdm bar with
``\\r`` on one terminal overwrote each other's line, and a run's result line landed after a stale bar.

Live only when asked (``train.progress``) and stderr is a terminal: in a CI log or a pipe nothing is drawn (as
before), and each run's result line says how far the ablation is instead (``tally``).
"""

from __future__ import annotations

import io
import logging
import re
import sys
import threading
import time
from contextlib import contextmanager
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TaskID, TextColumn
from rich.text import Text

from lowprec.train.meter import StepReport, install_step_reporter, reporting_steps

#: Control characters other than tab: a line from a worker or the store is shown as text, never as a terminal
#: command (an escape sequence in a recipe name or a failure reason must not move the cursor or recolour the screen).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character (newlines and escape sequences included) replaced by a space."""
    return _CONTROL.sub(" ", text)


def clock(seconds: float) -> str:
    """``seconds`` as ``m:ss`` (``h:mm:ss`` from an hour on)."""
    s = max(0, round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class _Info(ProgressColumn):
    """The text after a bar: the worker's loss and tokens/s, or the overall line's times (computed at each redraw)."""

    def __init__(self, display: AblationProgress):
        super().__init__()
        self.display = display

    def render(self, task) -> Text:
        if task.id == self.display._overall:
            return Text(self.display.times())
        if task.total is None:  # the run's first step has not reported yet (building the model, compiling)
            return Text("starting")
        return Text(f"{task.completed:.0f}/{task.total:.0f} steps  {task.fields.get('info', '')}")


class AblationProgress:
    """The display of one ablation's runs. ``live``: draw the bars (on ``console``, stderr by default); otherwise
    every line goes to ``echo`` as it is and nothing else is written.

    Use as a context manager around the training. ``add_runs`` before each batch of runs, ``result`` for each run's
    outcome line, ``line`` for any other line; ``channel(slot)`` gives a worker process its end of a pipe
    (None when not live), ``in_process(slot)`` routes this process's own training loop to ``slot``'s bar.
    """

    def __init__(self, echo=print, live: bool = False, console: Console | None = None, auto: bool = False):
        self.echo, self.live, self.auto = echo, live, auto
        self.total = self.done = 0
        self._t0 = time.monotonic()
        self._lock = threading.RLock()
        self._fractions: dict[int, float] = {}  # slot -> share of its run in flight that is done
        self._tasks: dict[int, TaskID] = {}
        self._readers: dict[Connection, int] = {}  # our end of each worker's pipe -> its slot
        self._writers: list[Connection] = []
        self._stop = threading.Event()
        self._drain: threading.Thread | None = None
        self._overall: TaskID | None = None
        self.progress: Progress | None = None
        if live:
            console = console or Console(file=sys.stderr)
            # Lines printed to stdout go above the bars only when stdout is this terminal too; a redirected stdout
            # keeps its lines (``line``).
            self._stdout_here = console.is_terminal and sys.stdout.isatty()
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=24),
                _Info(self),
                console=console,
                transient=True,
                refresh_per_second=4,
                # What else this process writes to stdout (this terminal) or stderr goes above the bars too.
                redirect_stdout=self._stdout_here,
                redirect_stderr=True,
            )
            self._overall = self.progress.add_task("runs", total=0)

    # --- the parent's side ---------------------------------------------------------------------------------------

    def __enter__(self) -> AblationProgress:
        if self.progress is not None:
            self.progress.start()
            self._drain = threading.Thread(target=self._drain_loop, daemon=True, name="lowprec-progress")
            self._drain.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is None:
            return
        self._stop.set()
        if self._drain is not None:
            self._drain.join(2.0)
        self._drain_once(0)  # lines a worker wrote just before it exited
        self.progress.stop()

    def add_runs(self, n: int) -> None:
        """``n`` more runs to train (the first batch, or the runs a ``seeds=auto`` look adds)."""
        with self._lock:
            self.total += n
            if self.progress is not None:
                self.progress.update(self._overall, total=self.total)

    def times(self) -> str:
        """The overall line's text: runs done of the total, elapsed time and the time left, estimated from the
        share of the runs done so far (finished runs and the steps of those in flight)."""
        with self._lock:
            elapsed = time.monotonic() - self._t0
            share = self.done + sum(self._fractions.values())
            more = " (seeds=auto may add runs)" if self.auto else ""
            if share <= 0 or self.done >= self.total:
                left = "estimating time left" if self.done < self.total else "0:00 left"
            else:
                left = f"~{clock(elapsed * (self.total - share) / share)} left"
            return f"{self.done}/{self.total} runs done, {clock(elapsed)} elapsed, {left}{more}"

    def tally(self) -> str:
        """``[run k of N, elapsed, time left]``: the suffix of a run's result line."""
        return f"[{self.times()}]"

    def line(self, text: str) -> None:
        """Print ``text`` (a line of the ablation): above the bars when live and stdout is this terminal."""
        if self.progress is not None and self._stdout_here:
            self.progress.console.print(printable(text), markup=False, highlight=False, soft_wrap=True)
        else:
            self.echo(text)

    def result(self, text: str) -> None:
        """Count one run as done and print its result line ``text`` followed by the ``tally``."""
        with self._lock:
            self.done += 1
        self.line(f"{text}  {self.tally()}")
        if self.progress is not None:
            self.progress.update(self._overall, completed=self.done)

    def run_started(self, slot: int, recipe: str, seed: int) -> None:
        """``slot``'s worker began training ``recipe`` with ``seed``: its bar shows that run from step 0."""
        if self.progress is None:
            return
        with self._lock:
            desc = f"  worker {slot}: {recipe} seed {seed}"
            if slot not in self._tasks:
                self._tasks[slot] = self.progress.add_task(desc, total=None, info="")
            self.progress.update(self._tasks[slot], description=desc, completed=0, total=None, info="", visible=True)
            self._fractions[slot] = 0.0

    def step(self, slot: int, report: StepReport) -> None:
        """``slot``'s run reported its progress (``lowprec.train.meter.StepReport``)."""
        if self.progress is None or slot not in self._tasks:
            return
        with self._lock:
            task = self._tasks[slot]
            if report.closed:  # the run ended: its outcome line follows (``run_ended``); its bar goes
                self._fractions[slot] = 1.0
                self.progress.update(task, visible=False)
                return
            self._fractions[slot] = report.n / report.total if report.total else 0.0
            info = "  ".join(f"{k} {v}" for k, v in report.postfix)
            self.progress.update(task, completed=report.n, total=report.total, info=printable(info))

    def run_ended(self, slot: int) -> None:
        """``slot``'s run has its outcome, counted by ``result`` (its bar had no ``closed`` report if its process
        died)."""
        with self._lock:
            self._fractions.pop(slot, None)
            if self.progress is not None and slot in self._tasks:
                self.progress.update(self._tasks[slot], visible=False)

    @contextmanager
    def in_process(self, slot: int = 0):
        """Route this process's training loop (``step_bar``) to ``slot``'s bar for the body (runs trained here)."""
        if self.progress is None:
            yield
            return
        with reporting_steps(lambda r: self.step(slot, r)):
            yield

    def channel(self, slot: int) -> Connection | None:
        """A new pipe for ``slot``'s worker process: returns the end it writes to (pass it to the process when it is
        started, then ``started``); None when not live (the worker draws nothing and writes where it always did)."""
        if self.progress is None:
            return None
        reader, writer = Pipe(duplex=False)
        with self._lock:
            self._readers[reader] = slot
            self._writers.append(writer)
        return writer

    def started(self) -> None:
        """The worker processes given a ``channel`` are started (each holds its own copy of its end): close ours, so
        a worker's exit ends its pipe."""
        with self._lock:
            for w in self._writers:
                w.close()
            self._writers.clear()

    def _drain_loop(self) -> None:
        while not self._stop.is_set():
            self._drain_once(0.2)

    def _drain_once(self, timeout: float) -> None:
        with self._lock:
            readers = list(self._readers)
        if not readers:
            time.sleep(timeout)
            return
        for conn in wait_connections(readers, timeout=timeout):
            slot = self._readers.get(conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # its worker exited (or died mid-message): nothing more comes from it
                with self._lock:
                    self._readers.pop(conn, None)
                conn.close()
                continue
            try:
                self._handle(slot, msg)
            except Exception as e:  # a malformed message: shown, never the end of the display or of the ablation
                self.line(f"progress display: {type(e).__name__}: {e}")

    def _handle(self, slot: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            self.step(slot, msg[1])
        elif kind == "run":
            self.run_started(slot, msg[1], msg[2])
        elif kind == "text":
            stream, text = msg[1], msg[2]
            if stream == "stdout":
                self.line(text)
            else:  # the worker's stderr: this terminal (live means stderr is one)
                self.progress.console.print(printable(text), markup=False, highlight=False, soft_wrap=True)


# --- the worker's side ------------------------------------------------------------------------------------------


class WorkerChannel:
    """A worker process's end of its pipe to ``AblationProgress``: its training loop's steps, the run it starts and
    its Python-level stdout/stderr lines go there. A write that fails (the ablation's process is gone) is written
    to the worker's own stream instead, and everything after it too."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()
        self._broken = False
        self._streams: dict[str, object] = {}

    def send(self, msg: tuple) -> bool:
        """Send ``msg``; False when the pipe is broken (nothing more is sent)."""
        if self._broken:
            return False
        try:
            with self._lock:
                self.conn.send(msg)
            return True
        except (OSError, ValueError):
            self._broken = True
            return False

    def install(self) -> None:
        """Route this process's ``step_bar``, ``sys.stdout``/``sys.stderr`` and the logging handlers that write to
        them (MLflow's, set up when it was imported) through the pipe."""
        install_step_reporter(lambda r: self.send(("step", r)))
        self._streams = {"stdout": sys.stdout, "stderr": sys.stderr}
        writers = {id(s): _LineWriter(self, name, s) for name, s in self._streams.items()}
        sys.stdout, sys.stderr = writers[id(sys.stdout)], writers[id(sys.stderr)]
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for logger in loggers:
            for h in getattr(logger, "handlers", ()):  # a PlaceHolder has none
                if type(h) is logging.StreamHandler and id(h.stream) in writers:
                    h.setStream(writers[id(h.stream)])

    def run_started(self, recipe: str, seed: int) -> None:
        """Tell the display which run this worker trains now."""
        self.send(("run", recipe, seed))


class _LineWriter(io.TextIOBase):
    """A text stream that sends each complete line through a ``WorkerChannel`` (and to ``fallback`` when it cannot).
    Not a terminal (``isatty`` False: tqdm and rich in the worker draw nothing); ``fileno`` is the original stream's,
    so what writes to the file descriptor itself (a subprocess, C code) still reaches it."""

    def __init__(self, channel: WorkerChannel, name: str, fallback):
        super().__init__()
        self.channel, self.name, self.fallback = channel, name, fallback
        self._buf = ""

    @property
    def encoding(self) -> str:
        return getattr(self.fallback, "encoding", "utf-8")

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.fallback.fileno()

    def write(self, s: str) -> int:
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self._emit(line)
        return len(s)

    def _emit(self, line: str) -> None:
        if not self.channel.send(("text", self.name, line)):
            try:
                self.fallback.write(line + "\n")
                self.fallback.flush()
            except (OSError, ValueError):
                pass

    def flush(self) -> None:
        """A line still open stays buffered (a ``print`` writes its text and its newline separately)."""

    def close_line(self) -> None:
        """Send what is buffered without its newline (the process is exiting)."""
        if self._buf:
            line, self._buf = self._buf, ""
            self._emit(line)
