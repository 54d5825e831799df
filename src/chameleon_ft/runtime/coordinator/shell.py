"""The coordinator: the shell around the control plane.

It runs in the ``chameleon train`` process, owns the store, and loops: gather what it sees
(process exits, heartbeats, error reports, readiness and "reduced" counters, completed
checkpoints, join requests, signals, a replayed trace's rows), hand each observation to
:func:`chameleon_ft.runtime.control.machine.step`, and perform the effects that come back
(publish a generation, commit or abort a step, fence or launch workers, ask the policy,
write checkpoints, stop). It keeps no field that a decision reads besides the control
value and its handles (store, processes, bulk state, clock): every decision-affecting
change is a pure transition (docs/design.md 4.1).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from chameleon_ft import logs
from chameleon_ft.profile import Profile
from chameleon_ft.runtime.control import machine
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.model import Control, Settings, Wanted, initial, wanted
from chameleon_ft.runtime.coordinator import effects as fx
from chameleon_ft.runtime.coordinator.bulk import BulkState
from chameleon_ft.runtime.coordinator.faults import FaultBook
from chameleon_ft.runtime.coordinator.finish import finish
from chameleon_ft.runtime.coordinator.launcher import POLL_S, Launcher, Proc, adapter_modules
from chameleon_ft.runtime.coordinator.policy import Decide, PlannerDecide
from chameleon_ft.runtime.coordinator.setup import Job, prepare
from chameleon_ft.runtime.coordinator.start import announce
from chameleon_ft.runtime.coordinator.store import ControlStore
from chameleon_ft.runtime.deadlines import Deadline
from chameleon_ft.runtime.protocol import message_kind
from chameleon_ft.runtime.replay import TraceDriver
from chameleon_ft.runtime.report.records import Event, StepRecord
from chameleon_ft.runtime.report.run import RunReport
from chameleon_ft.runtime.signing import Refusals, Signer, control_key
from chameleon_ft.runtime.worker.groups import resolve_backend, resolve_device
from chameleon_ft.spec.config import Config
from chameleon_ft.spec.train import Fault

__all__ = ["Coordinator", "Event", "Hooks", "StepRecord", "WorkerFailure"]

_log = logging.getLogger(__name__)


def log_line(message: str) -> None:
    """The default ``log`` of a coordinator: one of its lines as a record of this module's
    logger (a warning or a stop at its level, the rest as information)."""
    _log.log(logs.level_of(message), message)


class WorkerFailure(RuntimeError):
    """Raised when the job cannot continue (every replica gone and no way to restart)."""


class Hooks:
    """Callbacks a harness (tests, the chaos benchmark) uses to watch and steer a run.

    Each is called on the coordinator's thread; the default does nothing.
    """

    def before_publish(self, coord: Coordinator, directive: dict[str, Any]) -> None:
        """A generation is about to be published (faults injected here reach it)."""

    def on_commit(self, coord: Coordinator, step: int) -> None:
        """``step`` committed."""

    def on_failure(self, coord: Coordinator, event: Event) -> None:
        """A failure was detected (before the decision)."""


def bound_store(host: str, port: int, timeout_s: float) -> Any:
    """The job's ``TCPStore``, listening on ``host`` only (a store started without a
    listening socket of its own listens on every interface, whatever address the job
    gave). The store owns the socket from then on (it closes it when it goes)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


class Coordinator:
    """Runs one training job: start workers, train, recover, report.

    Args:
        config: the job file; ``config.train`` holds steps, dtype and timeouts.
        profile: per-layer costs (default: the config's ``[profile]``).
        decide: the recovery decision function (default: the project's Planner).
        policy: policy name for the default Planner (default ``config.policy.name``).
        faults: injected faults.
        out_dir: the run directory: checkpoints, report, parameters (default: a new
            ``runs/train-<time>`` folder, announced in the log).
        num_local_workers: workers to launch here (default: all); the rest join with
            ``chameleon worker``.
        host: the address the store listens on (and only that one).
        port: store port (0: any free port).
        log: receives each one-line progress message (default: :func:`log_line`, this
            module's logger).
        token: the job token remote workers must prove they know (default: one is
            generated, and printed when workers may join from other hosts).
        job_name: the job's name (workers may name the job they mean to join).
        resume: continue from the newest complete checkpoint in ``out_dir``.
        check_resources: refuse to launch a job whose workers cannot fit this host.
        hooks: callbacks for harnesses.
        model: a layered model object (default: ``[model]``).
        data: a data source object (default: ``[data]``).
        optimizer: an optimizer factory ``params -> torch.optim.Optimizer`` (default:
            ``[optimizer]``).
        lr_schedule: ``step -> learning rate`` (default: ``[optimizer]``'s schedule).
        log_every: a step line every this many steps (default: about 25 per run);
            failures, decisions and recoveries are always logged.
        trace: a failure trace to replay in wall-clock time (``runtime/replay.py``).
        tensorboard: also write TensorBoard event files under ``out_dir/tensorboard``
            (needs the ``tensorboard`` package).
        nccl_semantics: the workers' gloo groups complete their operations as NCCL's do
            (``worker.nccl_like``): how the tests run the NCCL completion path on CPU.
    """

    def __init__(self, config: Config, *, profile: Profile | None = None,
                 decide: Decide | None = None, policy: str | None = None,
                 faults: Sequence[Fault] = (), out_dir: str | Path | None = None,
                 num_local_workers: int | None = None, host: str = "127.0.0.1",
                 port: int = 0, log: Callable[[str], None] | None = None,
                 token: str | None = None, job_name: str | None = None,
                 resume: bool = False, check_resources: bool = True,
                 hooks: Hooks | None = None, model: Any = None, data: Any = None,
                 optimizer: Any = None, lr_schedule: Any = None,
                 log_every: int | None = None, trace: TraceDriver | None = None,
                 tensorboard: bool = False, nccl_semantics: bool = False) -> None:
        """Prepare a job (nothing starts until :meth:`run`; the arguments are the class's).

        Raises:
            ValueError: for bad input (see :func:`~.setup.prepare`).
        """
        self.log = log if log is not None else log_line
        self.job: Job = prepare(
            config, profile=profile, custom_decide=decide is not None, policy=policy,
            faults=faults, out_dir=out_dir, num_local_workers=num_local_workers, host=host,
            port=port, token=token, job_name=job_name, resume=resume,
            check_resources=check_resources, model=model, data=data, optimizer=optimizer,
            lr_schedule=lr_schedule, log_every=log_every, trace=trace, log=self.log)
        self.config, self.train = self.job.config, self.job.config.train
        self.device = resolve_device(self.train.device)
        self.backend = resolve_backend(self.train.backend, self.device)
        self.hooks = hooks or Hooks()
        self.nccl_semantics = nccl_semantics
        """The workers' gloo groups complete operations as NCCL's do (tests)."""
        self.decide: Decide | None = decide
        self.host, self.port = host, port
        self.book = FaultBook(self.job.faults)
        self.report = RunReport(
            self.job.out_dir, steps=self.train.steps, start_step=self.job.start_step,
            tokens_per_step=self.config.job.global_batch * max(1, self.config.seq_len),
            log=self.log, log_every=self.job.log_every,
            resumed=self.job.resumed_from is not None, tensorboard=tensorboard)
        self.t0 = time.monotonic()
        self.control: Control | None = None
        self.signals: list[str] = []
        self.signals_fed = 0
        self.checkpoint_logged_s = -fx.CHECKPOINT_LOG_S
        self.stopped: m.Stop | None = None
        """The run's end, once the control plane decided it."""
        self.final: m.FinalDone | None = None
        """Where the final state is, once the control plane said so."""
        self.crash: str | None = None
        """Why the coordinator failed, when an exception ended the run."""
        self._feeding = False
        self._wanted: tuple[Control | None, Wanted] = (None, Wanted(None))
        self._counts: dict[str, tuple[tuple[int, ...], int]] = {}
        """The last readiness, vote and join slot counts fed."""

    # ------------------------------------------------------------------ for harnesses
    @property
    def ctl(self) -> Control:
        """The control value (once the run started)."""
        assert self.control is not None, "the run has not started"
        return self.control

    @property
    def state(self) -> st.RunState:
        """The run's state."""
        return self.ctl.run

    @property
    def ready_s(self) -> float | None:
        """When the running generation's members were all ready (run clock)."""
        return None if self.control is None else self.control.ready_s

    @property
    def procs(self) -> dict[int, Proc]:
        """The current process of each worker id."""
        return self.launcher.procs

    @property
    def all_procs(self) -> list[Any]:
        """The local processes launched and not reaped yet (current ones, and replaced
        ones until they exit)."""
        launcher = getattr(self, "launcher", None)
        return [] if launcher is None else launcher.all_procs

    @property
    def launched_pids(self) -> list[int]:
        """The pids of the newest local processes launched (every one, up to thousands)."""
        launcher = getattr(self, "launcher", None)
        return [] if launcher is None else list(launcher.launched_pids)

    @property
    def events(self) -> list[Event]:
        """The failures so far (the newest thousand)."""
        return list(self.report.events)

    @property
    def steps(self) -> dict[int, StepRecord]:
        """The committed steps."""
        return self.report.steps

    @property
    def faults(self) -> list[Fault]:
        """The injected faults."""
        return self.book.faults

    @property
    def profile(self) -> Profile:
        """The job's per-layer costs."""
        return self.job.profile

    @property
    def params(self) -> dict[str, Any]:
        """The final parameters by name, read from ``params.pt`` (after :meth:`run`; the
        coordinator itself never holds them)."""
        path = self.job.out_dir / "params.pt"
        if not path.exists():
            return {}
        import torch

        return dict(torch.load(path, weights_only=True))

    @property
    def op_times(self) -> list[dict[str, Any]]:
        """Per committed step and worker: compute seconds of each op (calibration)."""
        return self.report.op_times()

    def now(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.t0

    def inject(self, fault: Fault) -> int:
        """Arm one more fault while the run goes on (chaos harness); returns its index."""
        return self.book.inject(self.cs, fault)

    def retract(self, index: int) -> bool:
        """Disarm fault ``index`` unless it fired already (a fault whose worker left every
        plan would otherwise wait forever)."""
        return self.book.retract(self.cs, index)

    def fault_report(self) -> list[dict[str, Any]]:
        """Every injected fault, whether and where it fired."""
        return self.book.report(self.cs)

    def kill_workers(self, workers: Sequence[int]) -> list[int]:
        """SIGKILL the local processes of ``workers`` now (a replayed hardware failure),
        and wait (at most 1 s) until they exited, so a node's workers are one failure."""
        killed = self.launcher.kill(workers)
        for w in killed:
            self.book.killed_at.setdefault(w, self.now())
        self.launcher.join(killed, 1.0)
        if killed:
            self.log(f"trace: killed worker(s) {killed}")
        return killed

    def relaunch_workers(self, workers: Sequence[int]) -> list[int]:
        """Relaunch those of ``workers`` whose process is gone (a replayed repair)."""
        before = dict(self.launcher.procs)
        self.feed(m.Relaunch(self.now(), tuple(workers)))
        return [w for w in workers if self.launcher.procs.get(w) is not before.get(w)]

    def software_fault(self) -> bool:
        """A job-level software fault: every worker of the running plan reloads the last
        checkpoint. Returns whether it happened."""
        gen = self.state.gen
        self.feed(m.SoftwareFault(self.now()))
        return self.state.gen != gen

    def stop_at_boundary(self, reason: str) -> None:
        """Stop training at the next step boundary (a replayed trace's end)."""
        self.feed(m.TraceEnd(self.now()))

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        """Train to the end (or to a drain on SIGINT/SIGTERM) and return the report.

        Every exception in the coordinator ends through the failure path: the workers are
        told to stop (and killed after the hang deadline), ``report.json`` gives the
        reason, and :class:`WorkerFailure` (or ``ValueError`` for a job that could not
        start as given) says it in one line.

        Raises:
            ValueError: when workers do not join or start, or the address is taken.
            WorkerFailure: when the job cannot continue (``report.json`` says why).
        """
        job = self.job
        job.out_dir.mkdir(parents=True, exist_ok=True)
        if not job.out_dir_given:
            self.log(f"run directory: {job.out_dir} (checkpoints, report, parameters)")
        try:
            self.store = bound_store(self.host, self.port, self.train.join_timeout_s)
        except OSError as exc:
            raise ValueError(f"port: the coordinator cannot listen on {self.host}:{self.port} "
                             f"({exc.strerror or exc}); give another --port or 0") from None
        self.port = self.store.port
        self.cs = ControlStore(
            self.store, Signer(control_key(job.secret), job.job_id),
            Refusals(lambda line: self.log(f"warning: {line}"), kind_of=message_kind))
        self.bulk = BulkState(self.host, job.secret, job.ckpt, job.num_layers,
                              timeout_s=max(self.train.join_timeout_s, 10 * job.hang_s),
                              deadline=Deadline(job.hang_s, self.train.bulk_gb_per_s),
                              tp=self.config.job.tp)
        self.launcher = Launcher(self.host, self.port, job.secret,
                                 preload=adapter_modules(job.model), num_local=job.num_local,
                                 tp=self.config.job.tp)
        self.settings = self._settings()
        self.control = initial(self._start_state(), now_s=self.now(), settings=self.settings)
        old_handlers = self._install_signal_handlers()
        try:
            try:
                self._start()
                self._loop()
            except Exception as exc:  # whatever it was, the run ends through the failure path
                self._crashed(exc)
            try:
                return finish(self)
            except (WorkerFailure, ValueError):
                raise
            except Exception as exc:  # the end itself failed: still one line
                raise WorkerFailure(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._restore_signal_handlers(old_handlers)
            close = getattr(self.decide, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
            self.launcher.reap()
            with contextlib.suppress(Exception):
                self.bulk.close()
            with contextlib.suppress(Exception):
                del self.store

    def _start(self) -> None:
        """Publish the job, open the streamed files, launch the local workers."""
        job = self.job
        job.ckpt.mark_job(job.job_id)
        announce(self)
        self.report.open()
        launched = fx.perform(self, m.Launch(tuple(range(job.num_local)), replacement=False))
        if launched is not None:
            self.feed(launched)
        if job.num_local and isinstance(launched, m.Launched):
            pids = " ".join(map(str, self.launcher.pids(range(job.num_local))))
            self.log(f"launched workers 0-{job.num_local - 1} (pids {pids})")

    def _crashed(self, exc: Exception) -> None:
        """An exception in the coordinator: training stops with its reason (through the
        control plane, which tells the workers; if even that fails, they are killed)."""
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        _log.debug("the coordinator failed", exc_info=exc)
        self.crash = reason
        try:
            self.feed(m.ShellFailed(self.now(), reason, bad_input=isinstance(exc, ValueError)))
        except Exception as again:  # the store itself is gone: nobody can be told
            _log.debug("the failure could not be published", exc_info=again)
        if self.stopped is None:
            self.launcher.kill(sorted(self.launcher.procs))
            self.stopped = m.Stop(gen=self.ctl.run.gen, step=self.ctl.run.next_step, final={},
                                  reason=reason, failed=True)

    def _start_state(self) -> st.RunState:
        step = self.job.start_step
        start = st.start(self.job.plan0, range(self.job.num_workers), step=step,
                         load=st.Load("restore", step) if step else st.INIT)
        # a resumed run may fall back to an older checkpoint if the newest is corrupt
        older = [s for s in self.job.ckpt.steps() if s <= step]
        return replace(start, checkpoints=tuple(sorted({*older, step})))

    def _settings(self) -> Settings:
        job = self.job
        return Settings(
            steps=self.train.steps, num_workers=job.num_workers, num_local=job.num_local,
            num_layers=job.num_layers, hang_s=job.hang_s, heartbeat_s=self.train.heartbeat_s,
            max_retries=self.train.max_retries, rejoin=self.train.rejoin,
            join_timeout_s=self.train.join_timeout_s, initial_plan=job.plan0,
            replay=job.trace is not None, drain_grace_s=job.drain_grace_s(),
            keep_checkpoints=self.train.keep_checkpoints,
            deadline_of=job.collective_deadline,
            join_hint=f"; start the rest with `chameleon worker --coordinator "
                      f"{self.host}:{self.port}`",
            checkpoint_every=self.train.checkpoint_every,
            checkpoint_deadline_s=job.checkpoint_deadline_s())

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        old: dict[int, Any] = {}

        def handler(signum: int, _frame: Any) -> None:
            if self.signals:  # a second signal: stop waiting politely
                raise KeyboardInterrupt
            self.signals.append(signal.Signals(signum).name)

        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, handler)
        return old

    @staticmethod
    def _restore_signal_handlers(old: dict[int, Any]) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    def decide_fn(self) -> Decide:
        """The policy (the project's planner unless one was given)."""
        if self.decide is None:
            self.decide = PlannerDecide(self.config, self.job.profile, self.job.policy)
        return self.decide

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        """Observe, step, perform, until nothing more is waited for."""
        beats_due = 0.0
        while not self.ctl.closed:
            beats_due = self.poll(beats_due)
            if self.ctl.closed:
                return
            self.launcher.wait(self.state.alive, POLL_S)

    def poll(self, beats_due: float) -> float:
        """One pass over everything observable; returns when heartbeats are due next.

        What to read comes from the control value (:func:`~.model.wanted`, asked again
        after each step). Each observation carries the clock reading taken when it was
        made. Completed checkpoints come before deaths (a restart decided in this pass
        reloads the newest), error reports before exits (a failing worker reports, then
        exits); the step's votes come before time (a step every worker reduced commits,
        whatever errors came before it).
        """
        self._observe_joins()
        if self.job.trace is not None and self.wanted().gen is not None:
            self.job.trace.poll(self)
        self.poll_checkpoints()
        exited = self.launcher.exits()
        if exited and self.wanted().gen is not None:
            # A worker that failed reports why before its process exits: read the reports
            # first, so the exit is explained by its error, not only by its status.
            self._observe_errors()
        if exited:
            self.feed(m.Exits(self.now(), exited))
        unregistered = self.wanted().unregistered
        registered = tuple(w for w, inc in unregistered.items() if self.cs.registered(w, inc))
        if registered:
            self.feed(m.Registered(self.now(), registered))
        if self.signals_fed < len(self.signals):
            self.signals_fed = len(self.signals)
            self.feed(m.StopAsked(self.now(), self.signals[-1]))
        if self.wanted().gen is not None:
            beats_due = self._observe_generation(beats_due)
        self.feed(m.Tick(self.now()))
        return beats_due

    def poll_checkpoints(self) -> None:
        """The layer files of the checkpoints being written, and the workers' refusals."""
        progress, failed = self.bulk.poll(self.cs, self.now())
        for step, gen, layers in progress:
            self.feed(m.CheckpointLayers(self.now(), step, gen, layers))
        for step, gen, why in failed:
            self.feed(m.CheckpointFailed(self.now(), step, gen, why))

    def _observe_joins(self) -> None:
        """The join slots reserved, when that count moved or unwritten slots are due again
        (the control plane then asks for the slots to read)."""
        want = self.wanted()
        if not want.joins:
            return
        reserved = self.cs.join_slots()
        now = self.now()
        due = want.joins_recheck_at_s is not None and now >= want.joins_recheck_at_s
        if self._news("joins", (), reserved) or due:
            self.feed(m.JoinSlots(now, reserved))

    def _observe_errors(self) -> None:
        """The running generation's error reports not seen yet."""
        want = self.wanted()
        if want.gen is None:
            return
        reports = self.cs.error_reports(want.gen, want.errors_from)
        if reports:
            self.feed(m.Errors(self.now(), want.gen, reports))

    def _observe_generation(self, beats_due: float) -> float:
        """The running generation: error reports, heartbeats, readiness, the step's votes."""
        self._observe_errors()
        now = self.now()
        want = self.wanted()
        if now >= beats_due and want.beats:
            beats_due = now + self.train.heartbeat_s / 2
            self.feed(m.Beats(now, self.cs.beats(dict(want.beats))))
        want = self.wanted()
        if want.gen is not None and want.ready:
            count = self.cs.ready(want.gen)
            if self._news("ready", (want.gen,), count):
                self.feed(m.Ready(self.now(), want.gen, count))
            if self.ctl.ready_s is not None:
                self._note_memory_reload(want.gen)
        want = self.wanted()
        if want.gen is not None and want.votes_step is not None:
            count = self.cs.reduced(want.gen, want.votes_step, want.voters)
            if self._news("votes", (want.gen, want.votes_step), count):
                self.feed(m.Reduced(self.now(), want.gen, want.votes_step, count))
        return beats_due

    def _news(self, kind: str, of: tuple[int, ...], count: int) -> bool:
        """Whether a counter changed since it was last fed (only news is fed: each poll
        would otherwise step the control plane for nothing)."""
        if self._counts.get(kind) == (of, count):
            return False
        self._counts[kind] = (of, count)
        return True

    def _note_memory_reload(self, gen: int) -> None:
        """With checkpoints in memory: how many layers the recovery that made ``gen`` read
        from peers' memory, on its event."""
        if not self.config.recovery.memory_checkpoint or not self.report.events:
            return
        event = self.report.events[-1]
        if not event.idle and event.gen < gen:
            event.from_memory_layers = self.cs.memory_fetched(gen)

    def wanted(self) -> Wanted:
        """What to read next (:func:`~.model.wanted` of the current control value, kept
        until the value changes)."""
        if self._wanted[0] is not self.control:
            self._wanted = (self.control, wanted(self.ctl))
        return self._wanted[1]

    def feed(self, obs: m.Observation) -> None:
        """One observation through the control plane, then its effects. The answers
        effects bring (a launch's incarnations, the policy's decision...) go through the
        same way once every effect of the step was performed: performing never re-enters
        the step.

        Raises:
            RuntimeError: when called while effects are performed (a defect).
        """
        if self._feeding:
            raise RuntimeError("the control plane was fed while its effects were performed")
        self._feeding = True
        try:
            queue: deque[m.Observation | None] = deque([obs])
            while queue:
                item = queue.popleft()
                if item is None:
                    continue
                before = self.ctl.run.next_step
                self.control, out = machine.step(self.ctl, item, self.settings)
                if self.control.run.next_step < before:
                    self.report.rewind(self.control.run.next_step)
                queue.extend(fx.perform(self, effect) for effect in out)
        finally:
            self._feeding = False
