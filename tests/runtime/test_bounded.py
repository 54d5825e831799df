"""A long run's memory and store keys stay flat: 10,000 generations and their commits
through the pure control plane, the real shell (its poll, its effects) and a store in this
process (c10d's ``HashStore``: the store's own key semantics, without the round trips; a
shorter run on a real ``TCPStore`` checks the same); the workers are simulated by the keys
they write, each through a worker's own channel (``worker.channel``: sealed with the job's
key as a real worker seals them).

Each cycle: a worker dies and the policy reroutes around it (a new generation), the dead
worker is relaunched (a new process), comes up idle, and the policy folds it back in (a
new generation); three steps commit (a checkpoint is due at every second one: one of two
is written, the other refused by a worker's disk); error reports, a stranger's join
request and heartbeats come and go. Every structure the coordinator keeps per process,
per generation, per commit, per checkpoint or per refusal is measured, with the store's
key count, after the first cycles and at the end: both stay flat.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from chameleon_ft import perf
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.plan.plan import Pipeline, Stage
from chameleon_ft.runtime import auth
from chameleon_ft.runtime import protocol as proto
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control.decider import ManualDecision
from chameleon_ft.runtime.control.model import initial
from chameleon_ft.runtime.coordinator.admission import JoinDesk
from chameleon_ft.runtime.coordinator.shell import Coordinator
from chameleon_ft.runtime.coordinator.store import MAX_REFUSAL_REPLIES, ControlStore
from chameleon_ft.runtime.report import run as run_report
from chameleon_ft.runtime.signing import Refusals, Signer, control_key
from chameleon_ft.runtime.worker.channel import Channel, Shared
from chameleon_ft.spec.config import config_from_mapping

pytestmark = pytest.mark.timeout(300)

GENERATIONS = 10_000
WARM_UP = 120
"""Cycles before the first measurement: past every bound (the report's records, kept to
50 here, fill up after 100)."""
DOC = {"model": {"name": "tiny", "num_blocks": 2, "hidden_size": 32, "num_heads": 2,
                 "vocab_size": 256, "seq_len": 32},
       "cluster": {"num_nodes": 2, "devices_per_node": 2, "device": "cpu"},
       "job": {"pp": 2, "dp": 2, "global_batch": 8, "micro_batch": 2},
       "train": {"steps": 10 ** 9, "dtype": "float64", "rejoin": True, "checkpoint_every": 2,
                 "heartbeat_s": 0.1, "hang_timeout_s": 2.0}}


class Launcher:
    """Processes without processes: launches hand out incarnations, exits are told."""

    def __init__(self) -> None:
        self.procs: dict[int, Any] = {}
        self.all_procs: list[Any] = []
        self.launched_pids: list[int] = []
        self.exited: dict[int, int] = {}
        self.count = 0

    def launch(self, ids: Any, *, replacement: bool) -> dict[int, str]:
        out = {}
        for w in ids:
            self.count += 1
            out[w] = f"p{self.count}"
            self.exited.pop(w, None)
        return out

    def admitted(self, *_args: Any) -> int:
        return 0

    def exits(self) -> dict[int, int]:
        return dict(self.exited)

    def kill(self, workers: Any) -> list[int]:
        return []

    def pids(self, ids: Any) -> list[int]:
        return []


class Bulk:
    """Checkpoints without files: the layer reports are read from the store as the real
    handle reads them, and forgotten as it forgets them."""

    def __init__(self, num_layers: int) -> None:
        self.pending: dict[tuple[int, int], frozenset[int]] = {}
        self.num_layers = num_layers
        self.assemblies = self.pending

    def expect(self, step: int, gen: int, now_s: float = 0.0, *, fallback: bool = False) -> None:
        self.pending.setdefault((step, gen), frozenset())

    def poll(self, cs: ControlStore, now_s: float) -> tuple[list[Any], list[Any]]:
        progress, failed = [], []
        for (step, gen), seen in list(self.pending.items()):
            why = cs.checkpoint_failure(gen, step)
            if why is not None:
                failed.append((step, gen, why))
                continue
            layers = frozenset(layer for layer, _ in
                               cs.checkpoint_files(gen, step, self.num_layers))
            if layers != seen:
                self.pending[(step, gen)] = layers
                progress.append((step, gen, layers))
        return progress, failed

    def save(self, step: int, gen: int, *, store: ControlStore,
             **_kwargs: Any) -> tuple[Any, dict[str, Any]] | None:
        self.pending.pop((step, gen), None)
        store.forget_checkpoint(gen, step, self.num_layers)
        return SimpleNamespace(folder=Path(f"step{step}")), {"committed_at_s": 0.0}

    def drop(self, step: int, gen: int, store: ControlStore) -> None:
        self.pending.pop((step, gen), None)
        store.forget_checkpoint(gen, step, self.num_layers)

    def refuse_before(self, epoch: int) -> None:
        pass


class Policy:
    """Reroutes around a dead worker (its replica takes its stage); folds idle ones back
    into the initial plan."""

    def __init__(self, plan0: Any) -> None:
        self.plan0 = plan0

    def __call__(self, plan: Any, failed: frozenset[int], alive: frozenset[int],
                 now_s: float, since_s: float | None) -> ManualDecision:
        (dead,) = failed
        pipes = tuple(Pipeline(tuple(Stage(s.worker ^ 1 if s.worker == dead else s.worker,
                                           s.first_layer, s.end_layer) for s in p.stages),
                               p.num_microbatches) for p in self.plan0.pipelines)
        return ManualDecision("reroute", ExecutionPlan(num_layers=self.plan0.num_layers,
                                                       pipelines=pipes))

    def rejoin(self, plan: Any, idle: frozenset[int], alive: frozenset[int],
               now_s: float) -> ManualDecision:
        return ManualDecision("dynamic", self.plan0)


class Cluster:
    """The coordinator's shell on a real store, and the keys its workers would write."""

    def __init__(self, tmp_path: Path, tcp: bool) -> None:
        coord = Coordinator(config_from_mapping(DOC), out_dir=tmp_path, check_resources=False,
                            log=lambda _line: None)
        if tcp:
            self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            self.client = dist.TCPStore("127.0.0.1", self.store.port, is_master=False)
        else:
            self.store = self.client = dist.HashStore()
        job = coord.job
        self.signer = Signer(control_key(job.secret), job.job_id)
        coord.store = self.store
        coord.cs = ControlStore(self.store, self.signer, Refusals(kind_of=proto.message_kind))
        coord.launcher = Launcher()  # type: ignore[assignment]
        coord.bulk = Bulk(coord.job.num_layers)  # type: ignore[assignment]
        coord.decide = Policy(coord.job.plan0)
        coord.desk = JoinDesk(coord.cs, token=job.token, job_name=job.job_name,
                              job_id=job.job_id, nonce=job.nonce)
        self.chans: dict[int, Channel] = {}
        """Each worker's current process's channel."""
        # each plan's deadline and schedule once (five plans come back again and again)
        coord.settings = replace(coord._settings(), deadline_of=lambda _p, _m: (3.0, None))
        self.clock = 0.0
        coord.now = lambda: self.clock  # type: ignore[method-assign]
        coord.control = initial(coord._start_state(), now_s=0.0, settings=coord.settings)
        coord.report.open()
        self.coord = coord
        self.beats = 0
        self.due = 0
        self.seen_gen = -1
        answer = coord.launcher.launch(range(4), replacement=False)
        coord.feed(m.Launched(0.0, answer, local=True, replacement=False))
        self.register()
        self.poll()  # every worker joined: generation 0
        self.step()  # its first commit (a death before it would only reload)

    # ------------------------------------------------------------------ the workers
    def incarnation(self, w: int) -> str:
        return self.coord.ctl.members.incarnation(w)

    def chan(self, w: int) -> Channel:
        """Worker ``w``'s current process's channel (a new process: a new channel)."""
        incarnation = self.incarnation(w)
        chan = self.chans.get(w)
        if chan is None or chan.incarnation != incarnation:
            chan = self.chans[w] = Channel(self.client, Shared(self.signer, w, incarnation))
        return chan

    def register(self) -> None:
        for w, member in self.coord.ctl.members.by_worker.items():
            if not member.gone:
                self.chan(w).register({})

    def poll(self) -> None:
        self.clock += 0.01
        self.beats += 1
        for w in self.coord.ctl.run.alive:
            self.chan(w).beat(self.beats)
        self.coord.poll(0.0)
        run = self.coord.ctl.run
        if run.gen != self.seen_gen and self.coord.ctl.gens.get(run.gen) is not None:
            self.seen_gen = run.gen
            self.join_generation(run.gen, sorted(run.world))

    def join_generation(self, gen: int, world: list[int]) -> None:
        """Every member starts building the groups, writes the rendezvous and is ready."""
        for w in world:
            self.chan(w).began(gen)
            self.chan(w).ready(gen)
        groups = self.coord.cs._groups.get(gen, [])
        rendezvous = self.chan(world[0]).rendezvous(1.0)
        for key in proto.rendezvous_keys(groups):
            rendezvous.set(key, b"addr")

    def step(self) -> None:
        """The plan's workers reduce the step in flight and report loss and timings; a
        checkpoint it makes due is written by its writers, or (every other one) refused by
        a worker's disk."""
        run = self.coord.ctl.run
        gen, step = run.gen, run.next_step
        for w in run.plan.workers:
            self.chan(w).step_report(gen, step, [[w, 0.5]], {"f_s": [0.001]})
            self.chan(w).reduced(gen, step)
        self.poll()
        assert self.coord.ctl.run.next_step == step + 1, "the step did not commit"
        for (ck_step, ck_gen) in list(self.coord.bulk.pending):
            self.due += 1
            if self.due % 2:
                self.chan(1).checkpoint_failed(ck_gen, ck_step,
                                               "worker 1: No space left on device")
                continue
            for layer in range(self.coord.job.num_layers):
                self.chan(0).layer_written(ck_gen, ck_step, layer, {
                    "file": f"layer{layer}.bin", "size": 1, "sha256": "x", "worker": 0})

    def cycle(self, k: int) -> None:
        """Two generations: a death rerouted around, then the repaired worker folded back
        in; three commits; an error report and a stranger's join request."""
        dead = k % 4
        gen = self.coord.ctl.run.gen
        assert self.chan(dead ^ 1).report(gen, proto.ErrorReport(
            worker=dead ^ 1, fatal=False, peer=None, message="slow peer"))
        slot = self.client.add(proto.JOIN_SLOTS_KEY, 1) - 1  # a stranger asks to join
        self.client.set(proto.join_request_key(slot), auth.JoinRequest(
            wnonce=f"stranger{k}", proof="forged", job="", host="elsewhere",
            address="10.0.0.9").to_json())
        self.coord.launcher.exited = {dead: -9}  # type: ignore[attr-defined]
        self.poll()  # the death, the decision, the new generation
        assert self.coord.ctl.run.gen == gen + 1 and dead not in self.coord.ctl.run.alive
        self.step()  # the recovery commits; the repair is launched
        self.register()
        self.poll()  # the replacement is up, idle
        assert dead in self.coord.ctl.run.idle
        self.step()  # the re-join is asked and planned
        self.step()  # the switch: every worker on the initial plan again
        assert self.coord.ctl.run.gen == gen + 2 and not self.coord.ctl.run.idle

    # ------------------------------------------------------------------ measuring
    def sizes(self) -> dict[str, int]:
        c, coord = self.coord.ctl, self.coord
        report = coord.report
        return {
            # asked on the workers' connection: a set is never answered, so this request's
            # answer comes after their last sets were applied (the coordinator's own
            # connection could count before them)
            "store keys": self.client.num_keys(),
            "members": len(c.members.by_worker), "failed starts": len(c.members.failed_starts),
            "heartbeats": len(c.beats), "generations": len(c.gens),
            "checkpoint times": len(c.checkpoint_times), "checkpoints": len(c.run.checkpoints),
            "expected": len(c.expected), "error messages": len(c.watch.messages),
            "stateless": len(c.run.stateless), "groups": len(coord.cs._groups),
            "bulk": len(coord.bulk.pending), "refusal replies": len(coord.cs._refusal_replies),
            "proofs": sum(len(u) for u in coord.desk.used),
            "numbered keys": len(coord.cs.signed._latest),
            "refused values": len(coord.cs.refusals._seen),
            "workers' refusals": len(coord.cs._reported.followed),
            "followed": len(coord.cs._votes) + len(coord.cs._ready) + len(coord.cs._reports)
            + len(coord.cs._world) + len(coord.cs._watched),
            "events": len(report.events), "refused": len(report.refused),
            "dropped": len(report.dropped), "writes": len(report.checkpoint_writes),
            "rejoins": len(report.rejoins), "transitions open": len(report.meter.waiting)
            + len(report.meter.measuring), "steps in memory": len(report.steps),
            "control entries": entries(c),
        }


def entries(value: Any) -> int:
    """Entries of every mapping, set and sequence in a control value, recursively (a plan
    counts as one: its size is the layout's)."""
    if isinstance(value, ExecutionPlan | str | bytes):
        return 1
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(entries(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, Mapping):
        return len(value) + sum(entries(k) + entries(v) for k, v in value.items())
    if isinstance(value, tuple | list | set | frozenset):
        return len(value) + sum(entries(v) for v in value)
    return 1


@pytest.mark.parametrize(("store", "generations"), [("hash", GENERATIONS), ("tcp", 400)])
def test_ten_thousand_generations_keep_memory_and_store_keys_flat(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str, generations: int) -> None:
    monkeypatch.setattr(run_report, "MAX_RECORDS", 50)  # full after a few dozen cycles
    schedules: dict[Any, Any] = {}
    real = perf.build_schedule
    monkeypatch.setattr(perf, "build_schedule", lambda plan, *args: schedules.setdefault(
        plan, real(plan, *args)))
    cluster = Cluster(tmp_path, tcp=store == "tcp")
    for k in range(WARM_UP):  # past every bound: the report's records keep only the newest
        cluster.cycle(k)
    early = cluster.sizes()
    k = WARM_UP
    while cluster.coord.ctl.run.gen < generations:
        cluster.cycle(k)
        k += 1
    late = cluster.sizes()
    grown = {name: (early[name], late[name]) for name in early if late[name] > early[name]}
    assert not grown, grown
    # a generation's keys, the next one's, the processes' and the newest refusals' replies
    assert late["store keys"] < 60 + MAX_REFUSAL_REPLIES, late
    report = cluster.coord.report
    assert report.refused.left_out + len(report.refused) == k  # every refusal counted
    assert len(report.events) == 50 and report.events_left_out == k - 50
    assert len(report.ordered_steps()) == cluster.coord.ctl.run.next_step  # all, from disk
    print(f"\n{store}: after {cluster.coord.ctl.run.gen} generations and "
          f"{cluster.coord.ctl.run.next_step} commits: {late} (after {WARM_UP} cycles: "
          f"{early})",
          file=sys.stderr)
