"""The checkpoint protocol's rules, pure: each takes the control value and returns the new
one with the effects (docs/design.md 4.4).

- *due*: committing a step that ends a checkpoint interval makes its checkpoint due; it is
  expected (:class:`~messages.ExpectCheckpoint`: each layer's writer, the deadline) before
  the verdict is written, so no worker's upload can arrive before it is expected;
- *complete*: once every layer's file is reported the manifest is written
  (:class:`~messages.SaveCheckpoint`), unless the checkpoint belongs to an abandoned
  timeline; once written it may be loaded;
- *failed*: a worker's disk refused, a writer died before writing, the deadline passed, or
  the manifest was refused: the checkpoint is dropped and training goes on;
- *the final checkpoint*: the final holders write the final step's state unless a
  checkpoint of it is complete or being written; an attempt that fails is followed by the
  next (:data:`~chameleon_ft.runtime.control.checkpoints.FINAL_ATTEMPTS`), a layer whose
  writer exited goes to its next holder, and the last attempt uploads the state into the
  run folder, so a checkpoint folder that fills up never loses the trained model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from chameleon_ft.runtime.control import checkpoints as ck
from chameleon_ft.runtime.control import members as mb
from chameleon_ft.runtime.control import messages as m
from chameleon_ft.runtime.control import state as st
from chameleon_ft.runtime.control.model import Control, Settings

Out = tuple[Control, list[m.Effect]]


def expect(c: Control, step: int, gen: int, writers: dict[int, int], now_s: float,
           p: Settings, *, fallback: bool = False) -> Out:
    """Follow a checkpoint being written."""
    expected = dict(c.expected)
    expected[(step, gen)] = ck.Expected(now_s + p.checkpoint_deadline_s, writers,
                                        fallback=fallback)
    return replace(c, expected=expected), [
        m.ExpectCheckpoint(step, gen, now_s + p.checkpoint_deadline_s, writers, now_s,
                           fallback)]


def on_commit(c: Control, step: int, gen: int, now_s: float, p: Settings) -> Out:
    """``step`` is about to commit: its checkpoint, when due, is expected first (workers
    start writing it once they read the verdict)."""
    if not ck.due(step, p.checkpoint_every):
        return c, []
    return expect(c, step + 1, gen, ck.writers(c.run.plan), now_s, p)


def on_layers(c: Control, obs: m.CheckpointLayers, p: Settings) -> Out:
    """More layer files of a checkpoint were reported: once all are, write its manifest
    (or discard it: an abandoned timeline's, or one that exists)."""
    key = (obs.step, obs.gen)
    entry = c.expected.get(key)
    if entry is None:
        return c, []
    entry = replace(entry, written=entry.written | obs.layers)
    expected = dict(c.expected)
    if entry.missing(p.num_layers):
        expected[key] = entry
        return replace(c, expected=expected), []
    del expected[key]
    accepted = entry.fallback or st.checkpoint_acceptable(c.run, obs.step, obs.gen)
    return replace(c, expected=expected), [
        m.SaveCheckpoint(obs.step, obs.gen, accepted, c.run.state_plan, entry.fallback)]


def on_done(c: Control, obs: m.CheckpointDone, p: Settings) -> Out:
    """The manifest is written: the checkpoint is complete (a restart may load it); the
    final checkpoint complete ends the run."""
    final = c.final
    if final is not None and final.key == (obs.step, obs.gen) and \
            ck.FINAL_ATTEMPTS[final.attempt] == "fallback":
        return _final_done(c, "fallback")
    c = replace(c, expected={k: v for k, v in c.expected.items() if k != (obs.step, obs.gen)})
    run, accepted = st.checkpoint_complete(c.run, obs.step, obs.gen, p.keep_checkpoints)
    if accepted:
        times = {s: t for s, t in c.checkpoint_times.items() if s in run.checkpoints}
        times[obs.step] = obs.now_s
        c = replace(c, run=run, checkpoint_times=times)
    if final is not None and obs.step == final.step:
        return _final_done(c, "checkpoints")
    return c, []


def on_failed(c: Control, obs: m.CheckpointFailed, p: Settings) -> Out:
    """A checkpoint could not be written: drop it (never complete); the previous one stays
    valid and the next is tried as usual. The final one is tried again."""
    c, effects = _drop(c, obs.step, obs.gen, obs.reason)
    final = c.final
    if final is not None and final.key == (obs.step, obs.gen):
        c, more = _next_attempt(c, obs.reason, obs.now_s, p)
        effects += more
    return c, effects


def _drop(c: Control, step: int, gen: int, reason: str, *, quiet: bool = False) -> Out:
    expected = {k: v for k, v in c.expected.items() if k != (step, gen)}
    c = replace(c, expected=expected)
    effects: list[m.Effect] = [m.DropCheckpoint(step, gen, reason, quiet=quiet)]
    if not quiet:
        latest = c.run.latest_checkpoint()
        effects.append(m.Log(f"warning: checkpoint after {step} steps dropped ({reason}); "
                             f"the last complete one holds {latest} steps"
                             + ("" if c.final is not None else "; training goes on")))
    return c, effects


def expire(c: Control, now_s: float, p: Settings) -> Out:
    """Checkpoints past their deadline failed."""
    effects: list[m.Effect] = []
    for (step, gen), entry in sorted(c.expected.items()):
        if now_s > entry.deadline_s:
            why = (f"not written within its deadline; {len(entry.written)} of "
                   f"{p.num_layers} layers were")
            c, more = on_failed(c, m.CheckpointFailed(now_s, step, gen, why), p)
            effects += more
    return c, effects


def writers_gone(c: Control, gone: Iterable[int], now_s: float, p: Settings) -> Out:
    """Workers died or exited: a checkpoint one of them still had to write fails (the final
    one asks each such layer of its next holder instead)."""
    dead = frozenset(gone)
    effects: list[m.Effect] = []
    for (step, gen), entry in sorted(c.expected.items()):
        final = c.final
        if final is not None and final.key == (step, gen) and final.attempt > 0:
            c, more = _ask_next_holders(c, entry, dead, now_s, p)
            effects += more
            continue
        lost = sorted({entry.writers[i] for i in entry.missing(p.num_layers)
                       if entry.writers.get(i) in dead})
        if lost:
            why = f"worker(s) {lost} exited before writing their layers"
            c, more = on_failed(c, m.CheckpointFailed(now_s, step, gen, why), p)
            effects += more
    return c, effects


def drop_timelines(c: Control, epoch: int) -> Out:
    """Checkpoints being written by generations before the last (re)load belong to an
    abandoned timeline: dropped without a word (their uploads are refused)."""
    effects: list[m.Effect] = [m.DropTimelines(epoch)]
    for step, gen in sorted(k for k in c.expected if k[1] < epoch):
        c, more = _drop(c, step, gen, "abandoned timeline", quiet=True)
        effects += more
    return c, effects


# ---------------------------------------------------------------------- the final one
def start_final(c: Control, holders: dict[int, tuple[int, ...]], gen: int, now_s: float,
                p: Settings) -> tuple[Control, list[m.Effect], bool]:
    """The run finished at ``c.run.next_step`` under the final generation ``gen``: wait
    for a complete or pending checkpoint of that step, else have the holders write it.

    Returns:
        The control value, the effects to perform before the stop directive, and whether
        the directive asks the holders to write (the first attempt into the folder).
    """
    step = c.run.next_step
    if step in c.run.checkpoints:
        return replace(c, closed=True), [m.FinalDone(gen, step, "checkpoints")], False
    bare = sorted(i for i in range(p.num_layers) if not holders.get(i))
    if bare:
        return replace(c, closed=True), [m.FinalDone(gen, step, None, (
            f"layer(s) {bare}: no worker holds their final state"))], False
    pending = sorted(k for k, v in c.expected.items() if k[0] == step and not v.fallback)
    if pending:
        return replace(c, final=ck.Final(step, gen, holders, 0, pending[-1])), [], False
    c = replace(c, final=ck.Final(step, gen, holders, 1, (step, gen)))
    c, effects = expect(c, step, gen, ck.primaries(holders), now_s, p)
    return c, effects, True


def _next_attempt(c: Control, reason: str, now_s: float, p: Settings) -> Out:
    """The final checkpoint's attempt failed: the next one, or the end without it."""
    final = c.final
    assert final is not None
    attempt = final.attempt + 1
    if attempt >= len(ck.FINAL_ATTEMPTS):
        return _final_done(c, None, f"the final checkpoint after {final.step} steps could "
                                    f"not be written: {reason}")
    fallback = ck.FINAL_ATTEMPTS[attempt] == "fallback"
    gone = {w for w, x in c.members.by_worker.items() if x.gone}
    live = {layer: tuple(w for w in ws if w not in gone) for layer, ws in final.holders.items()}
    bare = sorted(layer for layer, ws in live.items() if not ws)
    if bare:
        return _final_done(c, None, f"the final checkpoint after {final.step} steps could "
                                    f"not be written ({reason}), and layer(s) {bare} have no "
                                    "holder left")
    first = ck.primaries(live)
    c = replace(c, final=replace(final, attempt=attempt, key=(final.step, final.gen),
                                 asked={}, tried={}))
    c, effects = expect(c, final.step, final.gen, first, now_s, p, fallback=fallback)
    if fallback:
        effects.append(m.Log(f"warning: the checkpoint folder refused the final checkpoint "
                             f"({reason}); the final holders upload it into the run folder"))
    for worker, layers in sorted(ck.shares(first).items()):
        c, more = _ask(c, worker, layers)
        effects += more
    return c, effects


def _ask(c: Control, worker: int, layers: Iterable[int]) -> Out:
    final = c.final
    assert final is not None
    asked = dict(final.asked)
    asked[worker] = tuple(sorted({*asked.get(worker, ()), *layers}))
    c = replace(c, final=replace(final, asked=asked))
    upload = ck.FINAL_ATTEMPTS[final.attempt] == "fallback"
    return c, [m.AskFinal(final.gen, worker, asked[worker], final.attempt, upload)]


def _ask_next_holders(c: Control, entry: ck.Expected, dead: frozenset[int], now_s: float,
                      p: Settings) -> Out:
    """Layers of the final checkpoint whose writer is gone go to their next live holder
    (each holder asked once per layer); a layer with none left ends the run without it."""
    final = c.final
    assert final is not None
    gone = dead | frozenset(w for w, x in c.members.by_worker.items() if x.gone)
    writers, tried = dict(entry.writers), dict(final.tried)
    moved: dict[int, list[int]] = {}
    for layer in entry.missing(p.num_layers):
        if writers.get(layer) not in gone:
            continue
        holders = final.holders.get(layer, ())
        seen = tried.get(layer, frozenset({writers.get(layer, -1)}))
        live = [w for w in holders if w not in seen and w not in gone]
        if not live:
            return _final_done(c, None, f"layer {layer}: every holder of its final state is "
                                        f"gone (holders {list(holders)})")
        writers[layer] = live[0]
        tried[layer] = seen | {live[0]}
        moved.setdefault(live[0], []).append(layer)
    expected = dict(c.expected)
    expected[final.key] = replace(entry, writers=writers)
    c = replace(c, expected=expected, final=replace(final, tried=tried))
    effects: list[m.Effect] = []
    for worker, layers in sorted(moved.items()):
        c, more = _ask(c, worker, layers)
        effects += more
    return c, effects


def _final_done(c: Control, folder: str | None, reason: str = "") -> Out:
    final = c.final
    assert final is not None
    expected = {k: v for k, v in c.expected.items() if k[0] != final.step}
    return replace(c, final=None, closed=True, expected=expected), [
        m.FinalDone(final.gen, final.step, folder, reason)]


def abandon_final(c: Control, reason: str) -> Out:
    """The shell cannot follow the final checkpoint any more: the run ends without it."""
    if c.final is None:
        return replace(c, closed=True), []
    return _final_done(c, None, reason)


def on_exits(c: Control, obs: m.Exits, p: Settings) -> Out:
    """After the end: workers leave (those without final state at once); a writer of the
    final checkpoint that left hands its layers to the next holder."""
    gone = [w for w in obs.statuses if w in c.members.by_worker
            and not c.members.by_worker[w].gone]
    if not gone:
        return c, []
    members, _ = mb.died(c.members, gone)
    return writers_gone(replace(c, members=members), gone, obs.now_s, p)
